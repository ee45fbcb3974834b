fn main() -> anyhow::Result<()> {
    let spec_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../spec/opencl.spec");
    println!("cargo:rerun-if-changed={}", spec_path.display());
    let spec = hira_gen::load(&spec_path)?;
    hira_gen::write_out("server.rs", &hira_gen::server(&spec))?;
    Ok(())
}
