//! A tenant launches a kernel that never ends: the router stops it (kills its API server,
//! reports it), the other tenant's work completes and the router keeps serving. Runs the
//! built `hira` against the host's real OpenCL; skipped when the guest ICD was not built
//! next to it (`cargo build -p hira-guest`).

mod common;

use common::{ctl, hira, icd_built, start_router};
use std::path::Path;
use std::process::{Child, Command, Stdio};

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

#[test]
fn runaway_kernel_stops_only_its_tenant() {
    if !icd_built() {
        eprintln!(
            "skipped: libhira_opencl.so is not next to {}",
            hira().display()
        );
        return;
    }
    let (mut router, socket) = start_router(
        "runaway",
        "[scheduler]\npolicy = \"wfq\"\nkernel_timeout = \"2s\"\n",
        "error",
    );

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
    let _ = std::fs::remove_dir_all(socket.parent().expect("the router's directory"));

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
