//! Device-memory over-subscription end to end: the built `hira` router in front of the host's
//! real OpenCL, tenants running `hira bench-mem-tenant` under `hira run`. Their buffers
//! together are three times the configured capacity; each fills its buffers, runs kernels on
//! them interleaved with the others and checks every byte. Skipped when the guest ICD was not
//! built next to `hira` (`cargo build -p hira-guest`).

mod common;

use common::{ctl, hira, icd_built, start_router};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// `hira run --router SOCKET -- hira bench-mem-tenant ...`.
fn tenant(socket: &Path, buffers: u32, size: u64, seed: u32) -> Child {
    Command::new(hira())
        .args(["run", "--router"])
        .arg(socket)
        .arg("--")
        .arg(hira())
        .args(["bench-mem-tenant", "--buffers", &buffers.to_string()])
        .args(["--size", &size.to_string(), "--rounds", "3"])
        .args(["--seed", &seed.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("hira run starts")
}

/// The value of a device-level series in Prometheus text (0 when absent).
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

struct Outcome {
    evicted: u64,
    restored: u64,
    /// Most bytes seen resident in the slots while the tenants ran.
    peak_resident: u64,
}

/// Three tenants of `per_tenant` bytes (six buffers each) on a router configured by
/// `memory`; asserts that every tenant verified every byte.
fn run_three(name: &str, memory: &str, per_tenant: u64) -> Outcome {
    let config = format!("[scheduler]\npolicy = \"rr\"\n[memory]\n{memory}");
    let (mut router, socket) = start_router(name, &config, "hira=info");
    let tenants: Vec<Child> = (1..=3)
        .map(|seed| tenant(&socket, 6, per_tenant / 6, seed))
        .collect();
    // Sample residency while they run: it must never exceed the capacity.
    let mut peak_resident = 0;
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut tenants: Vec<(Child, Option<std::process::Output>)> =
        tenants.into_iter().map(|c| (c, None)).collect();
    while tenants.iter().any(|(_, o)| o.is_none()) && Instant::now() < deadline {
        let text = String::from_utf8_lossy(&ctl(&socket, &["metrics"]).stdout).into_owned();
        peak_resident = peak_resident.max(metric(&text, "hira_device_mem_resident_bytes"));
        for (child, out) in tenants.iter_mut().filter(|(_, o)| o.is_none()) {
            if child.try_wait().expect("wait").is_some() {
                let c = std::mem::replace(child, Command::new("true").spawn().expect("true"));
                *out = Some(c.wait_with_output().expect("tenant output"));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = String::from_utf8_lossy(&ctl(&socket, &["metrics"]).stdout).into_owned();
    let stats = String::from_utf8_lossy(&ctl(&socket, &["stats"]).stdout).into_owned();
    ctl(&socket, &["shutdown"]);
    let _ = router.wait();
    for (i, (mut child, out)) in tenants.into_iter().enumerate() {
        let Some(out) = out else {
            let _ = child.kill();
            panic!("{name}: tenant {i} did not finish in time\n{stats}");
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("checksums ok"),
            "{name}: tenant {i} failed ({}):\n{stdout}\n{}\n{stats}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    eprintln!("{name}:\n{stats}");
    Outcome {
        evicted: metric(&text, "hira_swap_evicted_bytes_total"),
        restored: metric(&text, "hira_swap_restored_bytes_total"),
        peak_resident,
    }
}

#[test]
fn three_times_the_capacity_keeps_every_byte_under_each_placement() {
    if !icd_built() {
        eprintln!("skipped: needs libhira_opencl.so next to hira");
        return;
    }
    let capacity = 24 * MIB;
    for placement in ["lls", "size", "util"] {
        let memory = format!(
            "capacity = \"24MiB\"\novercommit = 4\nslots = 8\nplacement = \"{placement}\"\nidle_after = \"1s\"\nreplace_every = \"1s\"\n"
        );
        let o = run_three(&format!("swap-{placement}"), &memory, capacity);
        assert!(
            o.evicted >= capacity && o.restored >= capacity,
            "{placement}: three tenants of the whole capacity must swap (evicted {}, restored {})",
            o.evicted,
            o.restored
        );
        assert!(
            o.peak_resident <= capacity,
            "{placement}: {} resident on a {capacity}-byte device",
            o.peak_resident
        );
    }
}

#[test]
fn without_over_commit_nothing_is_swapped() {
    if !icd_built() {
        eprintln!("skipped: needs libhira_opencl.so next to hira");
        return;
    }
    // Swapping is on (overcommit 2) but the capacity holds all three tenants.
    let memory = "capacity = \"96MiB\"\novercommit = 2\nslots = 12\nplacement = \"util\"\n";
    let o = run_three("swap-fits", memory, 24 * MIB);
    assert_eq!((o.evicted, o.restored), (0, 0));
}
