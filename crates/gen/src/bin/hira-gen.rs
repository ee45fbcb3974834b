//! `hira-gen coverage [SPEC] [HEADER...]`: print the coverage table.
//! `hira-gen provisional HEADER`: print a provisional spec (prototypes, no descriptors).

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    match args.first().map(String::as_str) {
        Some("coverage") => {
            let spec_path = args
                .get(1)
                .map_or(root.join("spec/opencl.spec"), Into::into);
            let spec = hira_gen::load(&spec_path)?;
            let headers: Vec<String> = if args.len() > 2 {
                args[2..].to_vec()
            } else {
                vec![
                    "/usr/include/CL/cl.h".into(),
                    "/usr/include/CL/cl_gl.h".into(),
                ]
            };
            let mut parsed = Vec::new();
            for h in headers {
                let text = std::fs::read_to_string(&h).with_context(|| format!("reading {h}"))?;
                let name = std::path::Path::new(&h)
                    .file_name()
                    .map_or(h.clone(), |n| n.to_string_lossy().into());
                parsed.push((name, hira_spec::header::prototypes(&text)));
            }
            print!("{}", hira_gen::coverage::table(&spec, &parsed));
        }
        Some("provisional") => {
            let h = args.get(1).context("usage: hira-gen provisional HEADER")?;
            for p in hira_spec::header::prototypes(&std::fs::read_to_string(h)?) {
                println!("{};", p.text);
            }
        }
        _ => anyhow::bail!("usage: hira-gen coverage [SPEC] [HEADER...] | provisional HEADER"),
    }
    Ok(())
}
