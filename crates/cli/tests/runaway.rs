//! A tenant launches a kernel that never ends: the router stops it (kills its API server,
//! reports it), the other tenant's work completes and the router keeps serving. Runs the
//! built `hira` against the host's real OpenCL; skipped when the guest ICD was not built
//! next to it (`cargo build -p hira-guest`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn hira() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hira"))
}

fn icd_built() -> bool {
    hira().with_file_name("libhira_opencl.so").is_file()
}

fn tenant(socket: &Path, args: &[&str]) -> Child {
    Command::new(hira())
        .args(["run", "--router"])
        .arg(socket)
        .arg("--")
        .arg(hira())
        .arg("bench-tenant")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("hira run starts")
}

fn ctl(socket: &Path, args: &[&str]) -> Output {
    Command::new(hira())
        .args(["ctl", "--router"])
        .arg(socket)
        .args(args)
        .output()
        .expect("hira ctl runs")
}

fn wait_for_socket(socket: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn runaway_kernel_stops_only_its_tenant() {
    if !icd_built() {
        eprintln!(
            "skipped: libhira_opencl.so is not next to {}",
            hira().display()
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("hira-runaway-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("r.sock");
    let config = dir.join("router.toml");
    std::fs::write(
        &config,
        format!(
            "socket = \"{}\"\n[scheduler]\npolicy = \"wfq\"\nkernel_timeout = \"2s\"\n",
            socket.display()
        ),
    )
    .unwrap();
    let mut router = Command::new(hira())
        .args(["serve", "--config"])
        .arg(&config)
        .env("RUST_LOG", "error")
        .stderr(Stdio::piped())
        .spawn()
        .expect("router starts");
    wait_for_socket(&socket);

    let runaway = tenant(&socket, &["--spin"]);
    let good = tenant(&socket, &["--iters", "2000", "--seconds", "3"]);
    let good = good.wait_with_output().unwrap();
    let runaway = runaway.wait_with_output().unwrap();
    let after = tenant(&socket, &["--iters", "2000", "--seconds", "0.5"])
        .wait_with_output()
        .unwrap();
    let stats = String::from_utf8(ctl(&socket, &["stats", "--json"]).stdout).unwrap();
    ctl(&socket, &["shutdown"]);
    let router_out = {
        let _ = router.wait();
        let mut s = String::new();
        std::io::Read::read_to_string(router.stderr.as_mut().unwrap(), &mut s).unwrap();
        s
    };
    let _ = std::fs::remove_dir_all(&dir);

    assert!(good.status.success(), "good tenant: {good:?}");
    assert!(String::from_utf8_lossy(&good.stdout).starts_with("kernels "));
    assert!(!runaway.status.success(), "runaway tenant: {runaway:?}");
    assert!(String::from_utf8_lossy(&runaway.stderr).contains("-5"));
    assert!(stats.contains("\"stopped\": \"runaway kernel\""), "{stats}");
    assert!(
        after.status.success(),
        "tenant after the runaway: {after:?}"
    );
    assert!(router_out.contains("kernel_timeout"), "{router_out}");
}
