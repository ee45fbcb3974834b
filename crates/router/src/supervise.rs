//! Starting and supervising API servers.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use hira_transport::Conn;
use tracing::{info, warn};

use crate::config::{Config, SpawnMode};
use crate::{Error, Result};

/// The fd number of the control socket in the server.
const CONTROL_FD: i32 = 3;

/// A server child process, reaped by its own thread.
#[derive(Debug)]
pub(crate) struct ServerProc {
    pub pid: i32,
    exited: Mutex<bool>,
    cv: Condvar,
}

impl ServerProc {
    /// Waits up to `grace` for the process to exit, then kills it.
    pub fn kill_after(&self, grace: Duration) {
        let exited = self.exited.lock().unwrap_or_else(|e| e.into_inner());
        let (exited, _) = self
            .cv
            .wait_timeout_while(exited, grace, |exited| !*exited)
            .unwrap_or_else(|e| e.into_inner());
        if !*exited {
            warn!(
                pid = self.pid,
                "API server did not exit in time; killing it"
            );
            // SAFETY: kill has no memory-safety preconditions. The pid cannot have been
            // reused: the reaper only reaps after setting `exited`, which we hold locked.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
    }
}

/// Starts a tenant's API server. Returns the router's end of the control socket and, for a
/// process, its supervision handle; `on_exit` runs on the reaper thread once the process
/// has exited.
pub(crate) fn spawn(
    cfg: &Config,
    tenant: u64,
    on_exit: impl FnOnce(String) + Send + 'static,
) -> Result<(Conn, Option<Arc<ServerProc>>)> {
    let (router_end, server_end) = Conn::pair()?;
    match &cfg.spawn {
        SpawnMode::InProcess(f) => {
            let f = Arc::clone(f);
            std::thread::Builder::new()
                .name(format!("hira-fake-server-{tenant}"))
                .spawn(move || f(server_end))?;
            Ok((router_end, None))
        }
        SpawnMode::Process => {
            let exe = match &cfg.server_exe {
                Some(exe) => exe.clone(),
                None => std::env::current_exe()?,
            };
            let proc = spawn_process(cfg, &exe, tenant, server_end)
                .map_err(|source| Error::Spawn { exe, source })?;
            Ok((router_end, Some(proc_reaper(proc, tenant, on_exit)?)))
        }
    }
}

/// Vendor settings every server gets unless the router's own environment sets them.
///
/// `POCL_AFFINITY=1` pins PoCL's worker threads one to a core. Unpinned, a worker woken while
/// its core's twin runs a work-group often waits in that core's run queue while the other
/// core idles (the scheduler will not pull a task that ran moments ago), and a kernel of
/// two work-groups then runs them one after the other: measured with 8 tenants, 21–30% of
/// 1 ms kernels took about twice their usual time (0.7% natively for one process, whose
/// workers rarely sleep); pinned, 1–2%. The device belongs to one server at a time, so
/// pinned workers of different servers do not contend.
fn vendor_defaults(is_set: impl Fn(&str) -> bool) -> Vec<(&'static str, &'static str)> {
    [("POCL_AFFINITY", "1")]
        .into_iter()
        .filter(|(key, _)| !is_set(key))
        .collect()
}

fn spawn_process(
    cfg: &Config,
    exe: &PathBuf,
    tenant: u64,
    server_end: Conn,
) -> std::io::Result<std::process::Child> {
    let mut cmd = Command::new(exe);
    cmd.arg("server")
        .env("HIRA_CONTROL_FD", CONTROL_FD.to_string())
        .env("HIRA_TENANT", tenant.to_string())
        .env_remove("HIRA_SOCKET")
        .stdin(Stdio::null());
    for (key, value) in vendor_defaults(|k| std::env::var_os(k).is_some()) {
        cmd.env(key, value);
    }
    match &cfg.vendors {
        Some(v) => cmd.env("OCL_ICD_VENDORS", v),
        None => cmd.env_remove("OCL_ICD_VENDORS"),
    };
    let fd = server_end.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and only calls the
    // async-signal-safe dup2 and fcntl on an fd the parent keeps open until spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            if fd == CONTROL_FD {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, CONTROL_FD) < 0 {
                // dup2 leaves FD_CLOEXEC clear on the new fd.
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    drop(server_end);
    Ok(child)
}

fn proc_reaper(
    mut child: std::process::Child,
    tenant: u64,
    on_exit: impl FnOnce(String) + Send + 'static,
) -> Result<Arc<ServerProc>> {
    let proc = Arc::new(ServerProc {
        pid: child.id() as i32,
        exited: Mutex::new(false),
        cv: Condvar::new(),
    });
    let handle = Arc::clone(&proc);
    info!(tenant, pid = proc.pid, "API server spawned");
    let spawned = std::thread::Builder::new()
        .name(format!("hira-reaper-{tenant}"))
        .spawn(move || {
            wait_exit_nowait(handle.pid);
            let status = {
                let mut exited = handle.exited.lock().unwrap_or_else(|e| e.into_inner());
                *exited = true;
                child.wait()
            };
            handle.cv.notify_all();
            let what = match status {
                Ok(s) => match (s.code(), s.signal()) {
                    (Some(c), _) => format!("exit code {c}"),
                    (_, Some(sig)) => format!("signal {sig}"),
                    _ => "unknown status".to_string(),
                },
                Err(e) => format!("wait failed: {e}"),
            };
            on_exit(what);
        });
    if let Err(e) = spawned {
        // Without a reaper the child cannot be supervised: stop it now.
        // SAFETY: kill has no memory-safety preconditions; the child is not reaped yet.
        unsafe { libc::kill(proc.pid, libc::SIGKILL) };
        return Err(e.into());
    }
    Ok(proc)
}

/// Blocks until `pid` has exited, without reaping it (`WNOWAIT`), so that its pid stays
/// reserved while `kill_after` may still signal it.
fn wait_exit_nowait(pid: i32) {
    loop {
        // SAFETY: siginfo_t is plain old data; all-zero is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is valid for writes for the duration of the call.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::vendor_defaults;

    #[test]
    fn servers_pin_pocl_workers_unless_the_router_was_told_otherwise() {
        let unset = vendor_defaults(|_| false);
        let set = vendor_defaults(|k| k == "POCL_AFFINITY");

        assert_eq!(unset, [("POCL_AFFINITY", "1")]);
        assert!(set.is_empty());
    }
}
