//! `hira ctl` and `hira top`: the control API, for people.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hira_router::{Client, DeviceStats, MemoryStats, Request, Response, TenantStats};

pub fn ctl(args: Vec<String>) -> Result<u8> {
    let mut it = args.into_iter();
    let (mut router, mut json, mut what, mut words) = (None, false, None, Vec::new());
    while let Some(arg) = it.next() {
        if let Some(v) = crate::take_value(&arg, "--router", &mut it)? {
            router = Some(v);
        } else if arg == "--json" {
            json = true;
        } else if what.is_none() && !arg.starts_with('-') {
            what = Some(arg);
        } else if what.is_some() && !arg.starts_with("--") {
            words.push(arg);
        } else {
            bail!("unknown argument {arg:?} for ctl");
        }
    }
    let socket = crate::router_socket(router);
    let req = match (what.as_deref().unwrap_or("stats"), words.as_slice()) {
        ("stats", []) => Request::Stats,
        ("metrics", []) => Request::Metrics,
        ("shutdown", []) => Request::Shutdown,
        ("policy", [name]) => Request::Policy { name: name.clone() },
        ("placement", [name]) => Request::Placement { name: name.clone() },
        ("set", [tenant, kv @ ..]) if !kv.is_empty() => Request::Set {
            tenant: tenant.clone(),
            patch: hira_router::TenantPatch::parse_words(kv)?,
        },
        (other, _) => bail!(
            "bad ctl request {other:?} (stats, metrics, shutdown, policy P, placement A, set TENANT key=value...)"
        ),
    };
    let resp = hira_router::request(&socket, &req)
        .with_context(|| format!("router at {}", socket.display()))?;
    match resp {
        Response::Stats { tenants, .. } if json => {
            println!("{}", serde_json::to_string_pretty(&tenants)?);
        }
        Response::Stats {
            tenants,
            device,
            memory,
        } => {
            print!("{}", header(device.as_ref(), None, Duration::ZERO));
            print!("{}", memory_line(memory.as_ref()));
            print!("{}", table(&tenants, None, Duration::ZERO));
        }
        Response::Metrics { text } => print!("{text}"),
        Response::Ok => {}
        Response::Error { message } => bail!("router refused: {message}"),
    }
    Ok(0)
}

pub fn top(args: Vec<String>) -> Result<u8> {
    let mut it = args.into_iter();
    let (mut router, mut interval, mut once) = (None, Duration::from_millis(1000), false);
    while let Some(arg) = it.next() {
        if let Some(v) = crate::take_value(&arg, "--router", &mut it)? {
            router = Some(v);
        } else if let Some(v) = crate::take_value(&arg, "--interval", &mut it)? {
            let ms: u64 = v.parse().with_context(|| format!("bad interval {v:?}"))?;
            interval = Duration::from_millis(ms.max(50));
        } else if arg == "--once" {
            once = true;
        } else {
            bail!("unknown argument {arg:?} for top");
        }
    }
    let socket = crate::router_socket(router);
    let mut client =
        Client::connect(&socket).with_context(|| format!("router at {}", socket.display()))?;
    type Sample = (Vec<TenantStats>, Option<DeviceStats>, Option<MemoryStats>);
    let mut fetch = move || -> Result<Sample> {
        match client.call(&Request::Stats)? {
            Response::Stats {
                tenants,
                device,
                memory,
            } => Ok((tenants, device, memory)),
            other => bail!("unexpected answer {other:?}"),
        }
    };
    if once {
        let (tenants, device, memory) = fetch()?;
        print!("{}", header(device.as_ref(), None, Duration::ZERO));
        print!("{}", memory_line(memory.as_ref()));
        print!("{}", table(&tenants, None, Duration::ZERO));
        return Ok(0);
    }
    let _raw = RawTerminal::enter();
    let (tx, keys) = mpsc::channel();
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        while let Ok(1) = std::io::stdin().read(&mut b) {
            if tx.send(b[0]).is_err() {
                return;
            }
        }
    });
    let mut prev: Option<(Instant, Vec<TenantStats>, Option<DeviceStats>)> = None;
    loop {
        let now = Instant::now();
        let (tenants, device, memory) = fetch()?;
        let (before, dev_before, dt) = match &prev {
            Some((t, p, d)) => (Some(p.as_slice()), d.as_ref(), now - *t),
            None => (None, None, Duration::ZERO),
        };
        let mut screen = String::from("\x1b[H\x1b[2J");
        let _ = write!(
            screen,
            "hira top — {} — {} tenant(s) — q to quit\r\n\r\n",
            socket.display(),
            tenants.iter().filter(|t| t.alive).count()
        );
        screen.push_str(&header(device.as_ref(), dev_before, dt).replace('\n', "\r\n"));
        screen.push_str(&memory_line(memory.as_ref()).replace('\n', "\r\n"));
        screen.push_str(&table(&tenants, before, dt).replace('\n', "\r\n"));
        let mut out = std::io::stdout().lock();
        out.write_all(screen.as_bytes())?;
        out.flush()?;
        drop(out);
        prev = Some((now, tenants, device));
        match keys.recv_timeout(interval) {
            Ok(b'q' | b'Q' | 3 | 4) => break,
            Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => std::thread::sleep(interval),
        }
    }
    println!();
    Ok(0)
}

/// The stats as a text table; with a previous sample, calls/s and device utilization.
fn table(tenants: &[TenantStats], before: Option<&[TenantStats]>, dt: Duration) -> String {
    let prev: HashMap<u64, &TenantStats> = before
        .unwrap_or_default()
        .iter()
        .map(|t| (t.id, t))
        .collect();
    let mut s = String::new();
    // Device time in this interval of every tenant, for the share column.
    let delta = |t: &TenantStats| {
        prev.get(&t.id)
            .map(|p| t.sched.kernel_ns.saturating_sub(p.sched.kernel_ns))
    };
    let total: u64 = tenants.iter().filter_map(delta).sum();
    let _ = writeln!(
        s,
        "{:>6} {:>8} {:<16} {:<7} {:>10} {:>9} {:>9} {:>9} {:>9} {:>12} {:>9} {:>17} {:>6} {:>6} {:>5} {:>6} {:>10} {:>10} {:>5}",
        "TENANT",
        "PID",
        "COMMAND",
        "STATE",
        "CALLS",
        "CALLS/S",
        "IN",
        "OUT",
        "BULK",
        "DEVICE MS",
        "MEMORY",
        "HELD/QUOTA",
        "DEV%",
        "SHARE",
        "WEIGHT",
        "CAP",
        "KERNELS",
        "QWAIT MS",
        "QUEUE"
    );
    for t in tenants {
        let (rate, util) = match prev.get(&t.id) {
            Some(p) if !dt.is_zero() => (
                format!(
                    "{:.0}",
                    t.calls.saturating_sub(p.calls) as f64 / dt.as_secs_f64()
                ),
                format!(
                    "{:.0}",
                    100.0 * t.device_ns.saturating_sub(p.device_ns) as f64 / dt.as_nanos() as f64
                ),
            ),
            _ => ("-".into(), "-".into()),
        };
        let share = match delta(t) {
            Some(d) if total > 0 => format!("{:.0}%", 100.0 * d as f64 / total as f64),
            _ => "-".into(),
        };
        let state = match (&t.sched.stopped, t.alive) {
            (Some(_), _) => "stopped",
            (None, true) => "up",
            (None, false) => "done",
        };
        let _ = writeln!(
            s,
            "{:>6} {:>8} {:<16} {:<7} {:>10} {:>9} {:>9} {:>9} {:>9} {:>12.1} {:>9} {:>17} {:>6} {:>6} {:>5} {:>6} {:>10} {:>10.1} {:>5}",
            t.id,
            t.pid,
            truncate(&t.command, 16),
            state,
            t.calls,
            rate,
            bytes(t.bytes_in),
            bytes(t.bytes_out),
            bytes(t.bulk),
            t.device_ns as f64 / 1e6,
            bytes(t.mem_bytes),
            held_quota(t),
            util,
            share,
            t.sched.weight.max(1),
            t.sched.cap.map_or("-".into(), |c| format!("{:.0}%", 100.0 * c)),
            t.sched.kernels,
            t.sched.queue_wait_ns as f64 / 1e6,
            t.sched.waiting + t.sched.inflight
        );
    }
    if tenants.is_empty() {
        s.push_str("(no tenants)\n");
    }
    for t in tenants {
        if let Some(why) = &t.sched.stopped {
            let _ = writeln!(s, "tenant {} (pid {}) stopped: {why}", t.id, t.pid);
        }
        if t.alloc_refused > 0 {
            let _ = writeln!(
                s,
                "tenant {} (pid {}): {} allocation(s) refused",
                t.id, t.pid, t.alloc_refused
            );
        }
    }
    s
}

/// `held/quota` as the router counts it (`-` without a quota).
fn held_quota(t: &TenantStats) -> String {
    let quota = match t.mem_quota {
        0 => "-".to_string(),
        q => bytes(q),
    };
    format!("{}/{quota}", bytes(t.mem_held))
}

/// The device's memory line: charged, limit, refusals (nothing when not reported).
fn memory_line(m: Option<&MemoryStats>) -> String {
    let Some(m) = m else {
        return String::new();
    };
    let limit = m.limit.map_or("unlimited".to_string(), bytes);
    let mut out = format!(
        "device memory: charged {} of {limit}  allocations refused {}\n",
        bytes(m.committed),
        m.refused
    );
    if let Some(sw) = &m.swap {
        let t = &sw.totals;
        out.push_str(&format!(
            "resident {} of {} in {} slots ({})  swapped out {} in {}, back {} in {}  pinned {}\n",
            bytes(sw.resident_bytes),
            bytes(sw.capacity),
            sw.slots,
            sw.placement,
            bytes(t.bytes_evicted),
            t.buffers_evicted,
            bytes(t.bytes_restored),
            t.buffers_restored,
            bytes(t.pinned_bytes),
        ));
        for tn in &sw.tenants {
            let slots = tn
                .slots
                .map_or("idle".to_string(), |(s, n)| format!("slots {s}..{}", s + n));
            out.push_str(&format!(
                "  tenant {}: {slots}  {} resident of {} in {} buffers  shares with {:?}\n",
                tn.tenant,
                bytes(tn.resident_bytes),
                bytes(tn.bytes),
                tn.buffers,
                tn.sharers
            ));
        }
    }
    out.push('\n');
    out
}

/// The device line: policy, in-flight commands, utilization over the interval.
fn header(d: Option<&DeviceStats>, before: Option<&DeviceStats>, dt: Duration) -> String {
    let Some(d) = d else {
        return String::new();
    };
    let util = match before {
        Some(b) if !dt.is_zero() => format!(
            "{:.0}%",
            100.0 * d.busy_ns.saturating_sub(b.busy_ns) as f64 / dt.as_nanos() as f64
        ),
        _ => format!(
            "{:.0}% since start",
            100.0 * d.busy_ns as f64 / d.uptime_ns.max(1) as f64
        ),
    };
    format!(
        "device 0: policy {}  busy {util}  in flight {}/{}  waiting {}  kernels {}  runaways stopped {}\n\n",
        d.policy, d.inflight, d.max_inflight, d.waiting, d.completed, d.runaways
    )
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}B")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

/// Stdin in non-canonical, no-echo, no-signal mode while alive (so q and Ctrl-C arrive as
/// bytes and the terminal is restored on every exit path).
struct RawTerminal {
    saved: Option<libc::termios>,
}

impl RawTerminal {
    fn enter() -> RawTerminal {
        // SAFETY: termios is plain old data; all-zero is a valid value.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `t` is valid for writes; fd 0 may or may not be a terminal.
        if unsafe { libc::tcgetattr(0, &mut t) } != 0 {
            return RawTerminal { saved: None };
        }
        let saved = t;
        t.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG);
        t.c_cc[libc::VMIN] = 1;
        t.c_cc[libc::VTIME] = 0;
        // SAFETY: `t` is a valid termios obtained from tcgetattr.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) };
        print!("\x1b[?25l");
        RawTerminal { saved: Some(saved) }
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(t) = &self.saved {
            // SAFETY: `t` is the termios saved by `enter`.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, t) };
            print!("\x1b[?25h");
            let _ = std::io::stdout().flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_human() {
        assert_eq!(bytes(512), "512B");
        assert_eq!(bytes(1536), "1.5KiB");
        assert_eq!(bytes(3 << 30), "3.0GiB");
    }

    #[test]
    fn table_lists_tenants() {
        let t = TenantStats {
            id: 3,
            pid: 99,
            command: "app".into(),
            alive: true,
            calls: 12,
            ..TenantStats::default()
        };

        let out = table(&[t], None, Duration::ZERO);

        assert!(out.contains("app"));
        assert!(out.lines().nth(1).unwrap().contains(" 12 "));
    }

    #[test]
    fn table_shows_memory_held_quota_and_refusals() {
        let t = TenantStats {
            id: 3,
            pid: 99,
            command: "app".into(),
            alive: true,
            mem_held: 3 << 20,
            mem_quota: 64 << 20,
            alloc_refused: 2,
            ..TenantStats::default()
        };

        let out = table(&[t], None, Duration::ZERO);

        assert!(out.contains("3.0MiB/64.0MiB"), "{out}");
        assert!(out.contains("2 allocation(s) refused"), "{out}");
    }
}
