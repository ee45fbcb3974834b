//! Device-memory quotas end to end: the built `hira` router in front of the host's real
//! OpenCL, with Python (pyopencl) tenants that run `tests/quota/tenant.py` under `hira run`.
//! Skipped when the guest ICD was not built next to `hira` (`cargo build -p hira-guest`) or
//! when python3 cannot import pyopencl and numpy.

mod common;

use common::{ctl, hira, icd_built, start_router};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};

const MIB: u64 = 1 << 20;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/quota/tenant.py")
}

fn can_run() -> bool {
    let icd = icd_built();
    let python = Command::new("python3")
        .args(["-c", "import pyopencl, numpy"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !icd || !python {
        eprintln!("skipped: needs libhira_opencl.so next to hira and python3 with pyopencl");
    }
    icd && python
}

/// `hira run [flags] -- python3 tenant.py LIMIT MODE`.
fn tenant(socket: &Path, flags: &[&str], limit: u64, mode: &str) -> Child {
    Command::new(hira())
        .args(["run", "--router"])
        .arg(socket)
        .args(flags)
        .arg("--")
        .arg("python3")
        .arg(script())
        .arg(limit.to_string())
        .arg(mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("hira run starts")
}

/// Reads `key value` lines until `until` (or EOF); returns them.
fn read_until(out: &mut BufReader<ChildStdout>, until: &str) -> HashMap<String, i64> {
    let mut seen = HashMap::new();
    let mut line = String::new();
    while out.read_line(&mut line).is_ok_and(|n| n > 0) {
        let mut words = line.split_whitespace();
        let key = words.next().unwrap_or_default().to_string();
        let value = words.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        let done = key == until;
        seen.insert(key, value);
        line.clear();
        if done {
            break;
        }
    }
    seen
}

fn finish(mut child: Child, out: BufReader<ChildStdout>) -> (HashMap<String, i64>, Output) {
    let mut out = out;
    let seen = read_until(&mut out, "done");
    drop(child.stdin.take());
    let output = child.wait_with_output().expect("tenant exits");
    (seen, output)
}

fn stats_of(socket: &Path, pid: i64) -> serde_json::Value {
    let out = ctl(socket, &["stats", "--json"]);
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats are JSON");
    all.as_array()
        .expect("a list of tenants")
        .iter()
        .find(|t| t["pid"] == pid)
        .cloned()
        .expect("the tenant is listed")
}

#[test]
fn quotas_limit_allocations_and_what_tenants_see() {
    if !can_run() {
        return;
    }
    let (mut router, socket) = start_router(
        "quota",
        "[memory]\nquota = \"8MiB\"\ncapacity = \"48MiB\"\n",
        "info",
    );

    // A: its own quota from `hira run`, lowered live below its use. B, at the same time:
    // the configured default.
    let mut a = tenant(&socket, &["--memory-quota", "16MiB"], 16 * MIB, "wait");
    let mut a_out = BufReader::new(a.stdout.take().unwrap());
    let mut b = tenant(&socket, &[], 8 * MIB, "nowait");
    let b_out = BufReader::new(b.stdout.take().unwrap());
    let a_before = read_until(&mut a_out, "ready");
    let a_pid = a_before["pid"];
    let a_held = stats_of(&socket, a_pid)["mem_held"].as_u64().unwrap();
    let set = ctl(
        &socket,
        &["set", &format!("pid:{a_pid}"), "memory_quota=4MiB"],
    );
    a.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    let (a_after, a_exit) = finish(a, a_out);
    let (b_seen, b_exit) = finish(b, b_out);
    // C, alone: no quota (`none` overrides the default), bounded by the device's capacity.
    let mut c = tenant(&socket, &["--memory-quota=none"], 48 * MIB, "nowait");
    let c_out = BufReader::new(c.stdout.take().unwrap());
    let (c_seen, c_exit) = finish(c, c_out);
    let metrics = String::from_utf8(ctl(&socket, &["metrics"]).stdout).unwrap();
    ctl(&socket, &["shutdown"]);
    let router_log = {
        let _ = router.wait();
        let mut s = String::new();
        std::io::Read::read_to_string(router.stderr.as_mut().unwrap(), &mut s).unwrap();
        s
    };
    let _ = std::fs::remove_dir_all(socket.parent().expect("the router's directory"));

    assert!(a_exit.status.success(), "tenant A: {a_exit:?}");
    assert_eq!(a_before["global"], (16 * MIB) as i64);
    assert_eq!(a_before["maxalloc"], (16 * MIB) as i64);
    assert_eq!(a_before["over"], -4, "just over the quota");
    assert_eq!(a_before["under"], 0, "just under the quota");
    assert_eq!(a_before["exact"], 0, "exactly at the quota");
    assert_eq!(a_before["one_more"], -4, "one byte past the quota");
    assert_eq!(a_before["after_release"], 0, "released memory is reusable");
    assert!(
        (16 * MIB - 4096..=16 * MIB).contains(&a_held),
        "held {a_held}"
    );
    assert!(set.status.success(), "ctl set: {set:?}");
    assert_eq!(
        a_after["lowered"], -4,
        "new allocations fail under the lowered quota"
    );
    assert_eq!(a_after["intact"], 1, "the existing buffer keeps its data");
    assert_eq!(a_after["global_after"], (4 * MIB) as i64);
    assert_eq!(a_after["maxalloc_after"], (4 * MIB) as i64);
    assert_eq!(
        a_after["small"], 0,
        "after freeing, the lowered quota applies"
    );
    assert!(b_exit.status.success(), "tenant B: {b_exit:?}");
    assert_eq!(b_seen["global"], (8 * MIB) as i64);
    assert_eq!(b_seen["over"], -4);
    assert_eq!(b_seen["under"], 0);
    assert_eq!(b_seen["one_more"], -4);
    assert!(c_exit.status.success(), "tenant C: {c_exit:?}");
    assert_eq!(
        c_seen["global"],
        (48 * MIB) as i64,
        "no quota: the capacity"
    );
    assert_eq!(c_seen["over"], -5, "past the device's capacity");
    assert_eq!(c_seen["under"], 0);
    assert_eq!(c_seen["one_more"], -5);
    assert!(
        metrics.contains("hira_device_alloc_refused_total{device=\"0\"}"),
        "{metrics}"
    );
    let quota_line = metrics
        .lines()
        .find(|l| {
            l.starts_with("hira_tenant_mem_quota_bytes{") && l.contains(&format!("pid=\"{a_pid}\""))
        })
        .unwrap_or_default();
    assert!(quota_line.ends_with(&format!(" {}", 4 * MIB)), "{metrics}");
    assert!(router_log.contains("allocation refused"), "{router_log}");
}
