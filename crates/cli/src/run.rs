//! `hira run`: start (or find) a router, then run an application against it.

use std::fs::{DirBuilder, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hira_transport::Conn;

/// How long an auto-started router may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(5);
/// Name of the guest ICD library.
const ICD_NAME: &str = "libhira_opencl.so";

pub fn run(args: Vec<String>) -> Result<u8> {
    let mut it = args.into_iter();
    let (mut router, mut autostart, mut cmd) = (None, true, Vec::new());
    let mut settings: Vec<String> = Vec::new();
    while let Some(arg) = it.next() {
        let setting = [
            "--weight",
            "--cap",
            "--priority",
            "--slo",
            "--kernel-timeout",
            "--memory-quota",
        ]
        .into_iter()
        .find(|name| arg == *name || arg.starts_with(&format!("{name}=")));
        if let Some(name) = setting.filter(|_| cmd.is_empty()) {
            let v = crate::take_value(&arg, name, &mut it)?.context("a value is needed")?;
            settings.push(format!("{}={v}", name.trim_start_matches("--")));
        } else if let Some(v) = crate::take_value(&arg, "--router", &mut it)? {
            router = Some(v);
        } else if arg == "--no-autostart" {
            autostart = false;
        } else if arg == "--" {
            cmd.extend(it.by_ref());
        } else if arg.starts_with('-') && cmd.is_empty() {
            bail!("unknown option {arg:?} for run");
        } else {
            cmd.push(arg);
            cmd.extend(it.by_ref());
        }
    }
    let Some((prog, prog_args)) = cmd.split_first() else {
        bail!("hira run: no command given");
    };
    let explicit = router.is_some();
    let socket = crate::router_socket(router);
    let icd = find_icd()?;
    if Conn::connect(&socket).is_err() {
        if explicit || !autostart {
            bail!("no router listening on {}", socket.display());
        }
        start_router(&socket)?;
    }
    // Held open while the application runs, so that an auto-started router does not exit
    // for idleness before the application's first OpenCL call. It also carries this run's
    // tenant settings: the router applies them to tenants descended from this process
    // (it knows our pid from the socket's credentials), for as long as it stays open.
    let mut hold = hira_router::Client::connect(&socket).ok();
    if !settings.is_empty() {
        let patch = hira_router::TenantPatch::parse_words(&settings)?;
        let client = hold
            .as_mut()
            .with_context(|| format!("no control socket for {}", socket.display()))?;
        client
            .call(&hira_router::Request::Register { patch })
            .context("registering the tenant's settings")?;
    }
    let mut child = Command::new(prog)
        .args(prog_args)
        .env("OCL_ICD_VENDORS", &icd)
        .env("HIRA_SOCKET", &socket)
        .spawn()
        .with_context(|| format!("cannot run {prog}"))?;
    // The terminal's Ctrl-C reaches the application too; hira waits for its exit status.
    // SAFETY: setting a signal disposition to SIG_IGN has no preconditions.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGQUIT, libc::SIG_IGN);
    }
    let status = child.wait().context("waiting for the application")?;
    Ok(match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        _ => 1,
    })
}

/// `$HIRA_ICD`, else `libhira_opencl.so` next to the `hira` executable.
pub(crate) fn find_icd() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("HIRA_ICD") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("HIRA_ICD={} is not a file", p.display());
    }
    let exe = std::env::current_exe().context("cannot locate the hira executable")?;
    let candidate = exe
        .parent()
        .map(|d| d.join(ICD_NAME))
        .filter(|p| p.is_file());
    candidate.with_context(|| {
        format!(
            "{ICD_NAME} not found next to {} (build it with `cargo build -p hira-guest`, or set HIRA_ICD)",
            exe.display()
        )
    })
}

/// Starts a router daemon on `socket` unless another `hira run` has just done so.
fn start_router(socket: &Path) -> Result<()> {
    let dir = socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create {}", dir.display()))?;
    let lock_path = dir.join("start.lock");
    let lock =
        File::create(&lock_path).with_context(|| format!("cannot open {}", lock_path.display()))?;
    // SAFETY: flock on an fd we own; it is released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("cannot lock {}", lock_path.display()));
    }
    if Conn::connect(socket).is_ok() {
        return Ok(());
    }
    let log_path = dir.join("router.log");
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("cannot open {}", log_path.display()))?;
    let exe = std::env::current_exe().context("cannot locate the hira executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve")
        .arg("--socket")
        .arg(socket)
        .arg("--idle-exit")
        .arg("5s")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid is async-signal-safe and has no memory-safety preconditions.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("cannot start the router")?;
    let deadline = Instant::now() + START_TIMEOUT;
    while Instant::now() < deadline {
        if Conn::connect(socket).is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            bail!("the router exited ({status}); see {}", log_path.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    bail!(
        "the router did not start listening on {} within {}s; see {}",
        socket.display(),
        START_TIMEOUT.as_secs(),
        log_path.display()
    )
}
