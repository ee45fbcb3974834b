//! `hira`: run an unmodified OpenCL application on a shared device (`hira run`), serve the
//! router (`hira serve`), inspect and control it (`hira ctl`, `hira top`). `hira server` is
//! the per-tenant API server the router spawns.

mod bench;
mod run;
mod show;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use hira_router::Config;

const USAGE: &str = "\
usage:
  hira run [--router SOCKET] [--no-autostart] [--weight N] [--cap X] [--priority P]
           [--slo S] [--kernel-timeout DURATION] [--memory-quota SIZE] [--] CMD [ARGS...]
  hira serve [--config FILE] [--socket PATH] [--idle-exit DURATION] [--vendors PATH]
             [--server-exe PATH] [--policy P] [--metrics-addr HOST:PORT]
  hira ctl [--router SOCKET] stats [--json] | metrics | shutdown | policy P
           | set TENANT KEY=VALUE...   (TENANT: id or pid:N; keys weight, cap, priority,
                                        slo, kernel_timeout, memory_quota)
  hira top [--router SOCKET] [--interval MS] [--once]
  hira bench [--quick] [--rounds N]
  hira bench fairness [--policy P|P,Q|all] [--tenants N] [--seconds S] [--rounds R] [--png DIR]
                      [--weights 1,2,4 [--live]] [--depth D]
  hira bench memory [--mix set1..set5|all] [--seconds S] [--placement lls,size,util|all]
                    [--tenants N] [--no-control] [--kernel-ms MS] [--sched P] [--unit-kib K]
                    [--idle-after DURATION] [--replace-every DURATION] [--demand D|none]

SIZE: bytes, or with a unit KiB, MiB, GiB (e.g. 64MiB); none removes a quota.
The router socket defaults to $HIRA_SOCKET, else /tmp/hira-<uid>/router.sock.";

fn main() -> ExitCode {
    match run() {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("hira: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run() -> Result<u8> {
    let mut args = std::env::args().skip(1);
    let cmd = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match cmd.as_str() {
        "run" => run::run(rest),
        "serve" => serve(rest).map(|()| 0),
        "server" => {
            init_logging(None);
            hira_server::main_from_env().map(|()| 0)
        }
        "ctl" => show::ctl(rest),
        "top" => show::top(rest),
        "bench" => bench::bench(rest),
        "bench-worker" => bench::worker(rest),
        "bench-tenant" => bench::tenant(rest),
        "bench-mem-tenant" => Ok(bench::mem_tenant(rest)),
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(0)
        }
        "version" | "--version" | "-V" => {
            println!("hira {}", env!("CARGO_PKG_VERSION"));
            Ok(0)
        }
        "" => bail!("no command\n{USAGE}"),
        other => bail!("unknown command {other:?}\n{USAGE}"),
    }
}

/// Takes the value of a `--flag VALUE` or `--flag=VALUE` option.
pub(crate) fn take_value(
    arg: &str,
    name: &str,
    it: &mut impl Iterator<Item = String>,
) -> Result<Option<String>> {
    if arg == name {
        return it
            .next()
            .map(Some)
            .with_context(|| format!("{name} needs a value"));
    }
    Ok(arg
        .strip_prefix(name)
        .and_then(|r| r.strip_prefix('='))
        .map(str::to_string))
}

/// The router socket: `--router`, else `$HIRA_SOCKET`, else the default.
pub(crate) fn router_socket(explicit: Option<String>) -> PathBuf {
    explicit
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HIRA_SOCKET")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(hira_router::default_socket_path)
}

fn serve(args: Vec<String>) -> Result<()> {
    let mut it = args.into_iter();
    let (mut config, mut socket, mut idle, mut vendors, mut exe) = (None, None, None, None, None);
    let (mut policy, mut metrics) = (None, None);
    while let Some(arg) = it.next() {
        if let Some(v) = take_value(&arg, "--config", &mut it)? {
            config = Some(v);
        } else if let Some(v) = take_value(&arg, "--socket", &mut it)? {
            socket = Some(v);
        } else if let Some(v) = take_value(&arg, "--idle-exit", &mut it)? {
            idle = Some(v);
        } else if let Some(v) = take_value(&arg, "--vendors", &mut it)? {
            vendors = Some(v);
        } else if let Some(v) = take_value(&arg, "--server-exe", &mut it)? {
            exe = Some(v);
        } else if let Some(v) = take_value(&arg, "--policy", &mut it)? {
            policy = Some(v);
        } else if let Some(v) = take_value(&arg, "--metrics-addr", &mut it)? {
            metrics = Some(v);
        } else {
            bail!("unknown option {arg:?} for serve\n{USAGE}");
        }
    }
    let mut cfg = match &config {
        Some(path) => {
            Config::load(path.as_ref()).with_context(|| format!("loading configuration {path}"))?
        }
        None => Config {
            socket: router_socket(None),
            ..Config::default()
        },
    };
    if let Some(s) = socket {
        cfg.socket = PathBuf::from(s);
    }
    if let Some(d) = idle {
        cfg.idle_exit =
            Some(hira_router::parse_duration(&d).with_context(|| format!("bad duration {d:?}"))?);
    }
    if let Some(v) = vendors {
        cfg.vendors = Some(v);
    }
    if let Some(e) = exe {
        cfg.server_exe = Some(PathBuf::from(e));
    }
    if let Some(p) = policy {
        cfg.scheduler.policy = p;
    }
    if let Some(m) = metrics {
        cfg.metrics_addr = Some(m);
    }
    cfg.validate()?;
    init_logging(cfg.log.as_deref());
    hira_router::serve(cfg)?;
    Ok(())
}

fn init_logging(default: Option<&str>) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(default.unwrap_or("info")))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
