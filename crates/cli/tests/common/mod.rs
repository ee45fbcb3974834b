//! What the end-to-end tests share: the built `hira`, a router started from a config, `hira ctl`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn hira() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hira"))
}

/// Whether the guest ICD was built next to `hira` (`cargo build -p hira-guest`).
pub fn icd_built() -> bool {
    hira().with_file_name("libhira_opencl.so").is_file()
}

pub fn ctl(socket: &Path, args: &[&str]) -> Output {
    Command::new(hira())
        .args(["ctl", "--router"])
        .arg(socket)
        .args(args)
        .output()
        .expect("hira ctl runs")
}

/// `hira serve --config` with `config` (after a `socket = ...` line) in a fresh directory
/// named after `name`; returns the router process (stderr piped) and its socket once it
/// listens.
pub fn start_router(name: &str, config: &str, log: &str) -> (Child, PathBuf) {
    let dir = std::env::temp_dir().join(format!("hira-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let socket = dir.join("r.sock");
    let file = dir.join("router.toml");
    std::fs::write(
        &file,
        format!("socket = \"{}\"\n{config}", socket.display()),
    )
    .expect("config");
    let router = Command::new(hira())
        .args(["serve", "--config"])
        .arg(&file)
        .env("RUST_LOG", log)
        .stderr(Stdio::piped())
        .spawn()
        .expect("router starts");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    (router, socket)
}
