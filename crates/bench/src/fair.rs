//! `hira bench fairness`: GPUvm's fairness experiment with real processes. A router runs
//! in-process with the policy under test; tenant processes loop a short "madd" kernel
//! (~1 ms of device time) or a 5× longer "long-madd", keeping a few launches queued; the
//! router's per-tenant device time (its DONE frames) is sampled every 50 ms. Reported per
//! policy: AvA's unfairness |t₁−t₂|/(t₁+t₂) between the two groups over 500 ms and 1 s
//! windows (median, max), device utilization, throughput relative to FIFO, device time
//! reported per second of wall time ("kernels"), the short group's share of device time and
//! device switches per second; a PNG of every tenant's device share over time (GPUvm
//! Fig. 7), with a title, labelled axes and a legend. A weights mode reports shares against
//! entitlements, with an optional live weight change.

use std::ffi::c_void;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hira_router::{Config, SchedulerConfig, TenantPatch};

use crate::{check, median, setup, Cl};

const MADD: &[u8] = b"__kernel void madd(__global float *a, int iters) {\n\
    size_t i = get_global_id(0);\n\
    float x = a[i];\n\
    for (int k = 0; k < iters; k++) { x = x * 0.999f + 0.5f; }\n\
    a[i] = x;\n\
}\n\0";
/// Work items per launch.
const GLOBAL: usize = 256;
/// How often the router is sampled.
const SAMPLE: Duration = Duration::from_millis(50);
/// Live alternation: how long each policy runs before the router switches to the other, and
/// how much of it is not counted. Half a second: the machine's speed moves within seconds.
const ALT_SLICE: Duration = Duration::from_millis(500);
const ALT_SETTLE: Duration = Duration::from_millis(100);
/// The long kernel is this many times the short one.
pub const LONG_FACTOR: u32 = 5;

/// A built madd kernel on a queue.
struct Madd {
    cl: Cl,
    kernel: *mut c_void,
}

impl Madd {
    fn new() -> Result<Madd> {
        let cl = setup()?;
        let kernel = cl.kernel(MADD, c"madd")?;
        cl.buffer_arg0(kernel, GLOBAL * 4)?;
        Ok(Madd { cl, kernel })
    }

    /// Enqueues one launch of `iters`; returns its event.
    fn launch(&self, iters: u32) -> Result<*mut c_void> {
        let api = self.cl.api;
        let n = iters as i32;
        let mut ev = std::ptr::null_mut();
        // SAFETY: a 4-byte argument of a live kernel.
        check("clSetKernelArg", unsafe {
            api.clSetKernelArg.context("missing")?(
                self.kernel,
                1,
                4,
                &n as *const i32 as *const c_void,
            )
        })?;
        self.cl.launch_1d(self.kernel, GLOBAL, &mut ev)?;
        Ok(ev)
    }

    fn wait(&self, ev: *mut c_void) -> Result<()> {
        let api = self.cl.api;
        // SAFETY: `ev` is a live event of ours, released exactly once here.
        unsafe {
            check(
                "clWaitForEvents",
                api.clWaitForEvents.context("missing")?(1, &ev),
            )?;
            api.clReleaseEvent.context("missing")?(ev);
        }
        Ok(())
    }

    fn finish(&self) -> Result<()> {
        self.cl.finish()
    }
}

/// The tenant process: launches madd of `iters` in a loop for `seconds`, keeping `depth`
/// launches outstanding; returns the launches completed.
pub fn tenant(iters: u32, depth: usize, seconds: f64) -> Result<u64> {
    let k = Madd::new()?;
    let depth = depth.max(1);
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let mut out = std::collections::VecDeque::new();
    let mut done = 0u64;
    while Instant::now() < end {
        out.push_back(k.launch(iters)?);
        if out.len() >= depth {
            k.wait(out.pop_front().expect("depth ≥ 1"))?;
            done += 1;
        }
    }
    while let Some(ev) = out.pop_front() {
        k.wait(ev)?;
        done += 1;
    }
    Ok(done)
}

/// The runaway tenant: one kernel that never ends, then waits for it. Returns the error
/// the wait ends with (the router stops the tenant: CL_OUT_OF_RESOURCES).
pub fn spin() -> Result<()> {
    const SPIN: &[u8] =
        b"__kernel void spin(__global volatile int *a) { while (1) { a[0]++; } }\n\0";
    let cl = setup()?;
    let kernel = cl.kernel(SPIN, c"spin")?;
    cl.buffer_arg0(kernel, 4)?;
    cl.launch_1d(kernel, 1, std::ptr::null_mut())?;
    cl.finish()
}

/// Iterations of madd that take `target` of device time on this machine, measured natively
/// once the device is warm, with launches queued back to back as the tenants queue them.
/// From cold, the first ~100 ms of kernels run up to 1.8× slower here (PoCL's threads and
/// the virtual CPUs waking up: a launch that takes 0.53 ms warm took 0.95 ms of device time
/// cold), which once made the "1 ms" kernel 0.7 ms long.
pub fn calibrate(target: Duration) -> Result<u32> {
    let k = Madd::new()?;
    let queued = |iters: u32, n: u32| -> Result<()> {
        let evs = (0..n)
            .map(|_| k.launch(iters))
            .collect::<Result<Vec<_>>>()?;
        evs.into_iter().try_for_each(|e| k.wait(e))
    };
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_millis(500) {
        queued(2000, 8)?;
    }
    let time = |iters: u32, n: u32| -> Result<f64> {
        let t = Instant::now();
        queued(iters, n)?;
        k.finish()?;
        Ok(t.elapsed().as_secs_f64() / f64::from(n))
    };
    let mut iters = 2000u32;
    for _ in 0..3 {
        let per = time(iters, 20)?;
        let scale = target.as_secs_f64() / per.max(1e-6);
        iters = ((f64::from(iters) * scale) as u32).clamp(1, 50_000_000);
    }
    Ok(iters)
}

/// What to run.
#[derive(Clone, Debug)]
pub struct FairOpts {
    /// Policies to compare; FIFO is run first as the throughput baseline when missing.
    pub policies: Vec<String>,
    pub tenants: usize,
    pub seconds: f64,
    /// Directory for one PNG per policy.
    pub png: Option<PathBuf>,
    /// Weights mode: one short-kernel tenant per weight.
    pub weights: Option<Vec<u32>>,
    /// Weights mode: reverse the weights halfway through.
    pub live: bool,
    /// Launches each tenant keeps outstanding.
    pub depth: usize,
    /// Times FIFO and the policies run, alternating (the machine's speed drifts by 10% and
    /// more within a minute; alternation spreads the drift over every policy alike).
    pub rounds: usize,
    /// The `hira` executable (API servers and tenants).
    pub exe: PathBuf,
    /// The guest ICD.
    pub icd: PathBuf,
}

/// (time since start s, per-tenant kernel ns, per-tenant kernels, device busy ns, device
/// switches), all cumulative.
type Sample = (f64, Vec<u64>, Vec<u64>, u64, u64);

/// One policy's run: cumulative samples.
struct Run {
    policy: String,
    /// (time since start s, per-tenant kernel ns, per-tenant kernels, device busy ns,
    /// device switches).
    samples: Vec<Sample>,
    long: Vec<bool>,
    weights: Vec<u32>,
    /// When the weights were changed (weights mode, live).
    changed_at: Option<f64>,
    /// CPU used during the measured part, in cores: the router's process, the tenants'.
    cpu: (f64, f64),
}

/// The summary of one run.
#[derive(Clone, Debug)]
pub struct Summary {
    pub policy: String,
    pub med500: f64,
    pub max500: f64,
    pub med1s: f64,
    pub max1s: f64,
    pub util: f64,
    /// Work done per second, short kernels = 1, long = 5.
    pub work_per_s: f64,
    /// Normalized progress (system throughput, STP): the sum over tenants of its kernels per
    /// second divided by its kind's kernels per second when alone on the device. Unlike
    /// `work_per_s` it does not reward handing the device to the kind of kernel that does
    /// more iterations per device second, so its ratio to FIFO's is what the scheduler costs.
    pub progress: f64,
    /// The short-kernel group's share of device time over the whole run (fair: 50 %).
    pub short_share: f64,
    /// Device switches between tenants per second.
    pub switches_per_s: f64,
    /// Device time reported by DONE frames per second of wall time, all tenants: about 1
    /// when the device is exclusive and never idle, above 1 when kernels overlap.
    pub kernel_load: f64,
    /// Average device time of one short and of one long kernel, ms.
    pub kernel_ms: [f64; 2],
    /// CPU the router used, in cores (on a CPU device it is taken from the kernels).
    pub router_cpu: f64,
    /// With several rounds: the median over rounds of `progress` and of `work_per_s` against
    /// the FIFO runs just before and just after (the `thr/FIFO` and `iter/FIFO` columns then
    /// show these instead of the ratio of means).
    pub bracketed: Option<[f64; 2]>,
}

fn spawn_tenant(o: &FairOpts, socket: Option<&Path>, iters: u32, seconds: f64) -> Result<Child> {
    let mut cmd = Command::new(&o.exe);
    cmd.arg("bench-tenant")
        .arg("--iters")
        .arg(iters.to_string())
        .arg("--depth")
        .arg(o.depth.to_string())
        .arg("--seconds")
        .arg(seconds.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    match socket {
        Some(s) => cmd.env("OCL_ICD_VENDORS", &o.icd).env("HIRA_SOCKET", s),
        None => cmd.env_remove("OCL_ICD_VENDORS").env_remove("HIRA_SOCKET"),
    };
    cmd.spawn().context("starting a tenant")
}

fn router(o: &FairOpts, policy: &str, tag: &str) -> Result<hira_router::Handle> {
    let socket = PathBuf::from(format!("/tmp/hira-fair-{}-{tag}.sock", std::process::id()));
    let cfg = Config {
        socket,
        server_exe: Some(o.exe.clone()),
        scheduler: SchedulerConfig {
            policy: policy.to_string(),
            ..SchedulerConfig::default()
        },
        ..Config::default()
    };
    Ok(hira_router::start(cfg)?)
}

fn run_policy(o: &FairOpts, policy: &str, short: u32, weights: &[u32]) -> Result<Run> {
    let handle = router(o, policy, policy)?;
    let n = weights.len();
    let long: Vec<bool> = (0..n).map(|i| o.weights.is_none() && i % 2 == 1).collect();
    let mut kids = Vec::new();
    for i in 0..n {
        let iters = if long[i] { short * LONG_FACTOR } else { short };
        let child = spawn_tenant(o, Some(handle.socket()), iters, o.seconds + 30.0)?;
        handle.register(
            child.id() as i32,
            TenantPatch {
                weight: Some(weights[i]),
                ..TenantPatch::default()
            },
        );
        kids.push(child);
    }
    let pids: Vec<i32> = kids.iter().map(|c| c.id() as i32).collect();
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut changed_at = None;
    let mut ready_at: Option<Instant> = None;
    let mut cpu_from = None;
    // Measure `seconds` from the moment every tenant has finished a kernel.
    loop {
        std::thread::sleep(SAMPLE);
        let stats = handle.stats();
        let get = |pid: i32| stats.iter().rev().find(|t| t.pid == pid && t.alive);
        let ns: Vec<u64> = pids
            .iter()
            .map(|&p| get(p).map_or(0, |t| t.sched.kernel_ns))
            .collect();
        let k: Vec<u64> = pids
            .iter()
            .map(|&p| get(p).map_or(0, |t| t.sched.kernels))
            .collect();
        let now = start.elapsed().as_secs_f64();
        let device = handle.device();
        samples.push((now, ns, k.clone(), device.busy_ns, device.switches));
        if ready_at.is_none() && k.iter().all(|&x| x > 0) {
            ready_at = Some(Instant::now());
            cpu_from = Some(cpu_now(&pids));
        }
        let Some(ready) = ready_at else {
            if start.elapsed() > Duration::from_secs(60) {
                bail!("tenants did not start within 60 s");
            }
            continue;
        };
        let ran = ready.elapsed().as_secs_f64();
        if o.live && changed_at.is_none() && ran >= o.seconds / 2.0 {
            for (i, &pid) in pids.iter().enumerate() {
                let patch = TenantPatch {
                    weight: Some(weights[n - 1 - i]),
                    ..TenantPatch::default()
                };
                handle.set_tenant(&format!("pid:{pid}"), &patch)?;
            }
            changed_at = Some(now);
        }
        if ran >= o.seconds + 0.5 {
            break;
        }
    }
    let cpu = cpu_from.map(|(at, router, tenants)| {
        let (end, router2, tenants2) = cpu_now(&pids);
        let dt = end.duration_since(at).as_secs_f64().max(1e-3);
        ((router2 - router) / dt, (tenants2 - tenants) / dt)
    });
    for mut k in kids {
        let _ = k.kill();
        let _ = k.wait();
    }
    handle.stop();
    let _ = handle.wait();
    // Keep only the measured part: from half a second after every tenant ran.
    let first = samples
        .iter()
        .position(|s| s.2.iter().all(|&x| x > 0))
        .unwrap_or(0);
    let t0 = samples.get(first).map_or(0.0, |s| s.0) + 0.5;
    samples.retain(|s| s.0 >= t0);
    Ok(Run {
        policy: policy.to_string(),
        samples,
        long,
        weights: weights.to_vec(),
        changed_at,
        cpu: cpu.unwrap_or((f64::NAN, f64::NAN)),
    })
}

/// CPU seconds used so far by this process (the router and the sampling loop) and by the
/// tenant processes, with the time they were read.
fn cpu_now(tenants: &[i32]) -> (Instant, f64, f64) {
    let of = |pid: &str| -> f64 {
        // Fields 14 and 15 of /proc/<pid>/stat (after the parenthesized command): user and
        // system time in clock ticks, 100 per second on Linux.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let rest = &s[s.rfind(')')? + 2..];
                let f: Vec<&str> = rest.split_whitespace().collect();
                Some((f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?) as f64)
            })
            .unwrap_or(0.0)
            / 100.0
    };
    let router = of("self");
    let tenants = tenants.iter().map(|p| of(&p.to_string())).sum();
    (Instant::now(), router, tenants)
}

/// Per-window deltas of every tenant's device time, windows of `w` seconds.
fn windows(run: &Run, w: f64) -> Vec<(f64, Vec<u64>)> {
    let mut out = Vec::new();
    let Some(first) = run.samples.first() else {
        return out;
    };
    let mut from = first;
    for s in &run.samples {
        if s.0 - from.0 >= w - 1e-9 {
            let d =
                s.1.iter()
                    .zip(&from.1)
                    .map(|(a, b)| a.saturating_sub(*b))
                    .collect();
            out.push((from.0, d));
            from = s;
        }
    }
    out
}

/// AvA's unfairness between the short and long groups in each window.
fn unfairness(run: &Run, w: f64) -> Vec<f64> {
    windows(run, w)
        .into_iter()
        .filter_map(|(_, d)| {
            let (mut t1, mut t2) = (0f64, 0f64);
            for (i, ns) in d.iter().enumerate() {
                if run.long[i] {
                    t2 += *ns as f64;
                } else {
                    t1 += *ns as f64;
                }
            }
            (t1 + t2 > 0.0).then(|| (t1 - t2).abs() / (t1 + t2))
        })
        .collect()
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

/// Kernels per second of a short and of a long tenant alone on the device, natively.
#[derive(Clone, Copy, Debug)]
pub struct Solo {
    pub short: f64,
    pub long: f64,
}

fn summarize(run: &Run, solo: Solo) -> Summary {
    let u500 = unfairness(run, 0.5);
    let u1 = unfairness(run, 1.0);
    let mut sum = Summary {
        policy: run.policy.clone(),
        med500: median(&u500),
        max500: max(&u500),
        med1s: median(&u1),
        max1s: max(&u1),
        util: f64::NAN,
        work_per_s: f64::NAN,
        progress: f64::NAN,
        short_share: f64::NAN,
        switches_per_s: f64::NAN,
        kernel_load: f64::NAN,
        kernel_ms: [f64::NAN; 2],
        router_cpu: run.cpu.0,
        bracketed: None,
    };
    let (Some(a), Some(b)) = (run.samples.first(), run.samples.last()) else {
        return sum;
    };
    let dt = b.0 - a.0;
    if dt <= 0.0 {
        return sum;
    }
    let delta = |x: &u64, y: &u64| x.saturating_sub(*y) as f64;
    let mut work = 0.0;
    let mut progress = 0.0;
    let mut ns = [0.0; 2];
    let mut count = [0.0; 2];
    for (i, long) in run.long.iter().enumerate() {
        let f = if *long { LONG_FACTOR } else { 1 };
        let kernels = delta(&b.2[i], &a.2[i]);
        count[usize::from(*long)] += kernels;
        work += kernels * f64::from(f);
        progress += kernels / dt / if *long { solo.long } else { solo.short };
        ns[usize::from(*long)] += delta(&b.1[i], &a.1[i]);
    }
    sum.util = delta(&b.3, &a.3) / 1e9 / dt;
    sum.work_per_s = work / dt;
    sum.progress = progress;
    sum.short_share = ns[0] / (ns[0] + ns[1]).max(1.0);
    sum.switches_per_s = delta(&b.4, &a.4) / dt;
    sum.kernel_load = (ns[0] + ns[1]) / 1e9 / dt;
    sum.kernel_ms = [0, 1].map(|g| ns[g] / 1e6 / count[g]);
    sum
}

/// The fairness table (percentages), throughput relative to the `fifo` row.
/// FIFO's rows (more than one when FIFO ran before and after the others, to cancel drift)
/// are averaged into the baseline.
pub fn table(rows: &[Summary], tenants: usize) -> String {
    let fifo: Vec<&Summary> = rows.iter().filter(|r| r.policy == "fifo").collect();
    let mean = |f: fn(&Summary) -> f64| -> Option<f64> {
        (!fifo.is_empty()).then(|| fifo.iter().map(|r| f(r)).sum::<f64>() / fifo.len() as f64)
    };
    let base_progress = mean(|r| r.progress);
    let base_work = mean(|r| r.work_per_s);
    let pct = |ratio: f64| format!("{:.1}%", 100.0 * ratio);
    let rel = |v: f64, base: Option<f64>| base.map_or("-".to_string(), |b| pct(v / b));
    let mut s = format!(
        "{:<10} {:>7} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9} {:>10} {:>7} {:>7} {:>9} {:>13} {:>7}\n",
        "policy",
        "tenants",
        "med 0.5s",
        "max 0.5s",
        "med 1s",
        "max 1s",
        "util",
        "thr/FIFO",
        "iter/FIFO",
        "work/s",
        "kernels",
        "short",
        "switch/s",
        "ms/kernel s/l",
        "router"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<10} {:>7} {:>8.1}% {:>8.1}% {:>8.1}% {:>8.1}% {:>6.0}% {:>9} {:>9} {:>10.0} {:>6.0}% {:>6.1}% {:>9.0} {:>6.2}/{:<6.2} {:>6.1}%",
            r.policy,
            tenants,
            100.0 * r.med500,
            100.0 * r.max500,
            100.0 * r.med1s,
            100.0 * r.max1s,
            100.0 * r.util,
            r.bracketed
                .map_or_else(|| rel(r.progress, base_progress), |b| pct(b[0])),
            r.bracketed
                .map_or_else(|| rel(r.work_per_s, base_work), |b| pct(b[1])),
            r.work_per_s,
            100.0 * r.kernel_load,
            100.0 * r.short_share,
            r.switches_per_s,
            r.kernel_ms[0],
            r.kernel_ms[1],
            100.0 * r.router_cpu
        );
    }
    s
}

/// Kernels per second of one short and one long tenant, each alone and native, for
/// `seconds` each, in 1 s turns (short, long, long, short, …): the machine's speed drifts
/// within a minute, and a drift between two back-to-back measurements once made the long
/// kernel 7× the short one instead of 5×, biasing every policy's normalized progress.
fn solo(o: &FairOpts, short: u32, seconds: f64) -> Result<Solo> {
    let turns = seconds.ceil().max(1.0) as usize;
    let each = seconds / turns as f64;
    let (mut s, mut l) = (0.0, 0.0);
    for turn in 0..turns {
        let rate =
            |iters: u32| -> Result<f64> { Ok(count(spawn_tenant(o, None, iters, each)?)? / each) };
        if turn % 2 == 0 {
            s += rate(short)?;
            l += rate(short * LONG_FACTOR)?;
        } else {
            l += rate(short * LONG_FACTOR)?;
            s += rate(short)?;
        }
    }
    Ok(Solo {
        short: s / turns as f64,
        long: l / turns as f64,
    })
}

/// The kernels a tenant process reports.
fn count(child: Child) -> Result<f64> {
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .with_context(|| format!("tenant printed {text:?}"))
}

/// Runs the benchmark and returns its report.
pub fn fairness(o: &FairOpts) -> Result<String> {
    let mut report = String::new();
    let short = calibrate(Duration::from_millis(1))?;
    let _ = writeln!(
        report,
        "calibrated: madd {short} iterations ≈ 1 ms, long-madd {} ≈ {} ms (native, {GLOBAL} work items)",
        short * LONG_FACTOR,
        LONG_FACTOR
    );
    eprint!("{report}");
    if o.tenants == 1 && o.weights.is_none() {
        return lone(o, short, report);
    }
    if let Some(w) = &o.weights {
        return weighted(o, short, w, report);
    }
    let solo = solo(o, short, 4.0)?;
    let _ = writeln!(
        report,
        "alone, native: short {:.0} kernels/s, long {:.0} kernels/s (thr/FIFO compares normalized \
         progress, the sum of each tenant's rate over its rate alone; iter/FIFO compares \
         iterations, long = 5)",
        solo.short, solo.long
    );
    // FIFO first and, when anything else runs, last too: the baseline is the mean of the two,
    // so a machine that drifts during the runs does not favour whichever policy ran nearer it.
    let mut policies: Vec<String> = o
        .policies
        .iter()
        .filter(|p| *p != "fifo")
        .cloned()
        .collect();
    if !policies.is_empty() {
        policies.push("fifo".into());
    }
    policies.insert(0, "fifo".into());
    if o.rounds > 1 {
        // Every round runs FIFO then each policy once (the last FIFO of the list is dropped:
        // the next round's first one follows it).
        policies.dedup();
        if policies.len() > 1 && policies.last().is_some_and(|p| p == "fifo") {
            policies.pop();
        }
    }
    let mut rows: Vec<Summary> = Vec::new();
    let mut pooled: Vec<Vec<Summary>> = vec![Vec::new(); policies.len()];
    for round in 0..o.rounds {
        for (k, p) in policies.iter().enumerate() {
            eprintln!(
                "running {p} with {} tenants for {} s (round {} of {}) ...",
                o.tenants,
                o.seconds,
                round + 1,
                o.rounds
            );
            let run = run_policy(o, p, short, &vec![1; o.tenants])?;
            if round == 0 {
                draw(o, p, &run)?;
            }
            if o.rounds > 1 {
                pooled[k].push(summarize(&run, solo));
            } else {
                rows.push(summarize(&run, solo));
            }
        }
    }
    let mut per_round = String::new();
    if o.rounds > 1 {
        // A closing FIFO run: every policy run then has FIFO just before and just after it,
        // and its throughput is taken against their mean, which cancels a machine whose
        // speed drifts steadily through the round (FIFO alone moved by 12% within a minute).
        eprintln!(
            "running fifo with {} tenants for {} s (closing) ...",
            o.tenants, o.seconds
        );
        let run = run_policy(o, "fifo", short, &vec![1; o.tenants])?;
        pooled[0].push(summarize(&run, solo));
        rows = pooled.iter().map(|runs| pool(runs)).collect();
        let fifo = &pooled[0];
        for (k, runs) in pooled.iter().enumerate().skip(1) {
            let ratios = |f: fn(&Summary) -> f64| -> Vec<f64> {
                runs.iter()
                    .zip(fifo.windows(2))
                    .map(|(r, w)| 2.0 * f(r) / (f(&w[0]) + f(&w[1])))
                    .collect()
            };
            let thr = ratios(|r| r.progress);
            let iter = ratios(|r| r.work_per_s);
            rows[k].bracketed = Some([median(&thr), median(&iter)]);
            let _ = writeln!(
                per_round,
                "thr/FIFO per round, {}: {} (median {:.1}%; ratio of the means {:.1}%)",
                policies[k],
                thr.iter()
                    .map(|x| format!("{:.1}%", 100.0 * x))
                    .collect::<Vec<_>>()
                    .join(" "),
                100.0 * median(&thr),
                100.0 * rows[k].progress / rows[0].progress
            );
        }
    }
    report += &table(&rows, o.tenants);
    if o.rounds > 1 {
        let _ = writeln!(
            report,
            "({} rounds of FIFO and each policy in turn, and a closing FIFO; medians are the \
             median of the rounds' medians, maxima the largest, rates the mean; thr/FIFO and \
             iter/FIFO the median over rounds of each run against the FIFO runs around it)",
            o.rounds
        );
        report += &per_round;
    }
    // The same tenants under FIFO and each policy in turn, switched live.
    let pairs = ((o.seconds * o.rounds as f64) / (2.0 * ALT_SLICE.as_secs_f64()))
        .round()
        .max(10.0) as usize;
    for p in policies.iter().filter(|p| *p != "fifo") {
        eprintln!(
            "alternating fifo and {p} live, {pairs} pairs of {} ms slices ...",
            ALT_SLICE.as_millis()
        );
        let (ratios, pooled) = alternating(o, p, short, solo, pairs)?;
        let _ = writeln!(
            report,
            "throughput vs FIFO, same tenants, policy switched live every {} ms, {p}: \
             pooled {:.1}%, median {:.1}% ({})",
            ALT_SLICE.as_millis(),
            100.0 * pooled,
            100.0 * median(&ratios),
            ratios
                .iter()
                .map(|x| format!("{:.1}%", 100.0 * x))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    if let [only] = o.policies.as_slice() {
        if let Some(r) = rows.iter().find(|r| &r.policy == only) {
            let _ = writeln!(report, "median unfairness 1s: {:.1}%", 100.0 * r.med1s);
        }
    }
    Ok(report)
}

/// Throughput of `policy` against FIFO on the same tenants: one set of tenant processes, the
/// router's policy switched live between FIFO and `policy` every [`ALT_SLICE`], FIFO first
/// and last. Each `policy` slice is taken against the FIFO slices just before and after it
/// (the first [`ALT_SETTLE`] of every slice is not counted: the new scheduler takes over and
/// the old one's commands drain). Separate runs with fresh tenants compare tens of seconds
/// apart on a machine whose speed moves by 10% and more within a minute; adjacent half
/// seconds of the same tenants do not. Returns the per-pair ratios of normalized progress
/// and the pooled ratio (the policy slices' progress summed over their neighbours' means
/// summed: the counting error of short slices averages out).
fn alternating(
    o: &FairOpts,
    policy: &str,
    short: u32,
    solo: Solo,
    pairs: usize,
) -> Result<(Vec<f64>, f64)> {
    let handle = router(o, "fifo", &format!("alt-{policy}"))?;
    let n = o.tenants;
    let long: Vec<bool> = (0..n).map(|i| i % 2 == 1).collect();
    let slices = 2 * pairs + 1;
    let seconds = (ALT_SLICE.as_secs_f64() * slices as f64) + 60.0;
    let mut kids = Vec::new();
    for &l in &long {
        let iters = if l { short * LONG_FACTOR } else { short };
        kids.push(spawn_tenant(o, Some(handle.socket()), iters, seconds)?);
    }
    let pids: Vec<i32> = kids.iter().map(|c| c.id() as i32).collect();
    let kernels = || -> Vec<u64> {
        let stats = handle.stats();
        pids.iter()
            .map(|&p| {
                stats
                    .iter()
                    .rev()
                    .find(|t| t.pid == p && t.alive)
                    .map_or(0, |t| t.sched.kernels)
            })
            .collect()
    };
    let result = (|| {
        let start = Instant::now();
        while kernels().contains(&0) {
            if start.elapsed() > Duration::from_secs(60) {
                bail!("tenants did not start within 60 s");
            }
            std::thread::sleep(SAMPLE);
        }
        let mut progress = Vec::with_capacity(slices);
        for slice in 0..slices {
            handle.set_policy(if slice % 2 == 0 { "fifo" } else { policy })?;
            std::thread::sleep(ALT_SETTLE);
            let (a, from) = (kernels(), Instant::now());
            std::thread::sleep(ALT_SLICE - ALT_SETTLE);
            let (b, dt) = (kernels(), from.elapsed().as_secs_f64());
            progress.push(
                (0..n)
                    .map(|i| {
                        let rate = (b[i] - a[i]) as f64 / dt;
                        rate / if long[i] { solo.long } else { solo.short }
                    })
                    .sum::<f64>(),
            );
        }
        let around = |k: usize| (progress[k - 1] + progress[k + 1]) / 2.0;
        let ratios = (1..slices)
            .step_by(2)
            .map(|k| progress[k] / around(k))
            .collect();
        let policy_sum: f64 = (1..slices).step_by(2).map(|k| progress[k]).sum();
        let fifo_sum: f64 = (1..slices).step_by(2).map(around).sum();
        Ok((ratios, policy_sum / fifo_sum))
    })();
    for mut k in kids {
        let _ = k.kill();
        let _ = k.wait();
    }
    handle.stop();
    let _ = handle.wait();
    result
}

/// One summary of several runs of one policy.
fn pool(runs: &[Summary]) -> Summary {
    let mean = |f: fn(&Summary) -> f64| runs.iter().map(f).sum::<f64>() / runs.len() as f64;
    let med = |f: fn(&Summary) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
    let most = |f: fn(&Summary) -> f64| runs.iter().map(f).fold(f64::NAN, f64::max);
    Summary {
        policy: runs.first().map_or_else(String::new, |r| r.policy.clone()),
        med500: med(|r| r.med500),
        max500: most(|r| r.max500),
        med1s: med(|r| r.med1s),
        max1s: most(|r| r.max1s),
        util: mean(|r| r.util),
        work_per_s: mean(|r| r.work_per_s),
        progress: mean(|r| r.progress),
        short_share: mean(|r| r.short_share),
        switches_per_s: mean(|r| r.switches_per_s),
        kernel_load: mean(|r| r.kernel_load),
        kernel_ms: [mean(|r| r.kernel_ms[0]), mean(|r| r.kernel_ms[1])],
        router_cpu: mean(|r| r.router_cpu),
        bracketed: None,
    }
}

/// The share-over-time picture of one policy's run, if asked for.
fn draw(o: &FairOpts, p: &str, run: &Run) -> Result<()> {
    if let Some(dir) = &o.png {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("fairness-{p}-{}.png", o.tenants));
        let title = format!(
            "{p}: {} tenants, short (1 ms) and long (5 ms) kernels",
            o.tenants
        );
        share_png(run, &title, &path)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// A lone tenant natively, under hira with FIFO, and under hira with the policy, in
/// alternating rounds (a machine whose speed drifts affects all three alike). Reported
/// against native (remoting and scheduling together) and against hira's FIFO (what the
/// policy itself costs a tenant that is alone: it should be work-conserving).
fn lone(o: &FairOpts, short: u32, mut report: String) -> Result<String> {
    // Slices of about a second: the machine's speed drifts within a minute, so the three
    // take turns often and each round's ratio compares runs made seconds apart. Both kernel
    // kinds: remoting costs a fixed amount of CPU per kernel, and on a CPU device that CPU
    // is taken from the kernels, so the short kernel shows the most.
    let rounds = (o.seconds.round() as usize).max(3);
    let policy = o.policies.first().map_or("fifo", String::as_str);
    let each = o.seconds / rounds as f64;
    let fifo_router = router(o, "fifo", "lone-fifo")?;
    let policy_router = router(o, policy, "lone")?;
    let sockets = [
        None,
        Some(fifo_router.socket()),
        Some(policy_router.socket()),
    ];
    let kinds = [("short", short), ("long", short * LONG_FACTOR)];
    let mut kernels = [[0.0; 3]; 2];
    let mut of_native = [Vec::new(), Vec::new()];
    let mut of_fifo = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        eprintln!("lone tenant, round {} of {rounds} ...", round + 1);
        for (kind, &(_, iters)) in kinds.iter().enumerate() {
            // The order rotates each round, so none of the three always runs first.
            let mut this = [0.0; 3];
            for k in 0..3 {
                let which = (k + round) % 3;
                this[which] = count(spawn_tenant(o, sockets[which], iters, each)?)?;
                kernels[kind][which] += this[which];
            }
            of_native[kind].push(this[2] / this[0]);
            of_fifo[kind].push(this[2] / this[1]);
        }
    }
    for h in [fifo_router, policy_router] {
        h.stop();
        let _ = h.wait();
    }
    let secs = each * rounds as f64;
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{:.1}–{:.1}%", 100.0 * lo, 100.0 * hi)
    };
    for (kind, &(name, _)) in kinds.iter().enumerate() {
        let [native, fifo, hira] = kernels[kind].map(|k| k / secs);
        let _ = writeln!(
            report,
            "lone tenant, {name} kernel ({policy}), {rounds} rounds of {each:.1} s: native \
             {native:.0} kernels/s, hira fifo {fifo:.0}, hira {policy} {hira:.0}; per round, \
             median {:.1}% of native ({}), {:.1}% of hira fifo ({}); pooled {:.1}% / {:.1}%",
            100.0 * median(&of_native[kind]),
            range(&of_native[kind]),
            100.0 * median(&of_fifo[kind]),
            range(&of_fifo[kind]),
            100.0 * hira / native,
            100.0 * hira / fifo
        );
    }
    Ok(report)
}

/// Weights mode: shares against entitlements, optionally with a live change.
fn weighted(o: &FairOpts, short: u32, weights: &[u32], mut report: String) -> Result<String> {
    let policy = o.policies.first().map_or("wfq", String::as_str);
    eprintln!(
        "running {policy} with weights {weights:?} for {} s ...",
        o.seconds
    );
    let run = run_policy(o, policy, short, weights)?;
    if let Some(dir) = &o.png {
        std::fs::create_dir_all(dir)?;
        let live = if o.live { "-live" } else { "" };
        let path = dir.join(format!("weights-{policy}{live}.png"));
        let ratio: Vec<String> = weights.iter().map(u32::to_string).collect();
        let title = format!(
            "{policy}: weights {}{}",
            ratio.join(":"),
            if o.live { ", reversed halfway" } else { "" }
        );
        share_png(&run, &title, &path)?;
        eprintln!("wrote {}", path.display());
    }
    let entitled = |w: &[u32]| -> Vec<f64> {
        let sum: u32 = w.iter().sum();
        w.iter()
            .map(|&x| f64::from(x) / f64::from(sum.max(1)))
            .collect()
    };
    let before = entitled(weights);
    let reversed: Vec<u32> = weights.iter().rev().copied().collect();
    let after = entitled(&reversed);
    let wins = windows(&run, 1.0);
    let _ = writeln!(
        report,
        "policy {policy}, weights {weights:?}; shares per 1 s window:"
    );
    let _ = writeln!(
        report,
        "{:>6}  {}",
        "t(s)",
        (0..weights.len())
            .map(|i| format!("{:>9}", format!("tenant{i}")))
            .collect::<String>()
    );
    for (t, d) in &wins {
        let total: u64 = d.iter().sum();
        let mark = match run.changed_at {
            Some(c) if *t >= c => "  (after change)",
            _ => "",
        };
        let _ = writeln!(
            report,
            "{:>6.1}  {}{mark}",
            t,
            d.iter()
                .map(|&x| format!("{:>8.1}%", 100.0 * x as f64 / total.max(1) as f64))
                .collect::<String>()
        );
    }
    let share = |from: f64, to: f64| -> Vec<f64> {
        let pick = |t: f64| run.samples.iter().find(|s| s.0 >= t).or(run.samples.last());
        match (pick(from), pick(to)) {
            (Some(a), Some(b)) => {
                let d: Vec<u64> =
                    b.1.iter()
                        .zip(&a.1)
                        .map(|(x, y)| x.saturating_sub(*y))
                        .collect();
                let total: u64 = d.iter().sum();
                d.iter().map(|&x| x as f64 / total.max(1) as f64).collect()
            }
            _ => vec![f64::NAN; weights.len()],
        }
    };
    let t_first = run.samples.first().map_or(0.0, |s| s.0);
    let t_last = run.samples.last().map_or(0.0, |s| s.0);
    let mut line = |label: &str, s: &[f64], e: &[f64], w: &[u32]| {
        let _ = writeln!(report, "{label}:");
        for i in 0..s.len() {
            let _ = writeln!(
                report,
                "  tenant{i} weight {:>2}: share {:>5.1}%  entitled {:>5.1}%  off by {:>4.1} points ({:.1}% relative)",
                w[i],
                100.0 * s[i],
                100.0 * e[i],
                100.0 * (s[i] - e[i]).abs(),
                100.0 * (s[i] - e[i]).abs() / e[i]
            );
        }
    };
    match run.changed_at {
        None => line("whole run", &share(t_first, t_last), &before, weights),
        Some(c) => {
            line("before the change", &share(t_first, c), &before, weights);
            line(
                "after the change (from 1 s after)",
                &share(c + 1.0, t_last),
                &after,
                &reversed,
            );
            // Windows (1 s) after the change until every share is within 5 points.
            let settled = wins.iter().filter(|(t, _)| *t >= c).position(|(_, d)| {
                let total: u64 = d.iter().sum();
                d.iter()
                    .zip(&after)
                    .all(|(&x, e)| (x as f64 / total.max(1) as f64 - e).abs() <= 0.05)
            });
            let _ = writeln!(
                report,
                "shares within 5 points of the new entitlement in window {} after the change",
                settled.map_or("never".to_string(), |k| (k + 1).to_string())
            );
        }
    }
    let _ = run.weights.len();
    Ok(report)
}

// ---- the share-over-time picture ----

const W: usize = 1000;
const H: usize = 420;
/// The plot area: left, top, right, bottom.
const PLOT: (usize, usize, usize, usize) = (60, 40, 820, 370);
const COLORS: [[u8; 3]; 8] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
];
const BLACK: [u8; 3] = [0, 0, 0];
const GRID: [u8; 3] = [220, 220, 220];

/// A 3×5 pixel font (rows top to bottom, bit 2 = left column), drawn at twice the size.
fn glyph(c: char) -> [u8; 5] {
    match c.to_ascii_uppercase() {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 2, 2],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        'A' => [2, 5, 7, 5, 5],
        'B' => [6, 5, 6, 5, 6],
        'C' => [3, 4, 4, 4, 3],
        'D' => [6, 5, 5, 5, 6],
        'E' => [7, 4, 6, 4, 7],
        'F' => [7, 4, 6, 4, 4],
        'G' => [3, 4, 5, 5, 3],
        'H' => [5, 5, 7, 5, 5],
        'I' => [7, 2, 2, 2, 7],
        'J' => [1, 1, 1, 5, 2],
        'K' => [5, 5, 6, 5, 5],
        'L' => [4, 4, 4, 4, 7],
        'M' => [5, 7, 7, 5, 5],
        'N' => [6, 5, 5, 5, 5],
        'O' => [2, 5, 5, 5, 2],
        'P' => [6, 5, 6, 4, 4],
        'Q' => [2, 5, 5, 6, 3],
        'R' => [6, 5, 6, 5, 5],
        'S' => [3, 4, 2, 1, 6],
        'T' => [7, 2, 2, 2, 2],
        'U' => [5, 5, 5, 5, 7],
        'V' => [5, 5, 5, 5, 2],
        'W' => [5, 5, 7, 7, 5],
        'X' => [5, 5, 2, 5, 5],
        'Y' => [5, 5, 2, 2, 2],
        'Z' => [7, 1, 2, 4, 7],
        '%' => [4, 1, 2, 4, 1],
        '.' => [0, 0, 0, 0, 2],
        ',' => [0, 0, 0, 2, 4],
        ':' => [0, 2, 0, 2, 0],
        '-' => [0, 0, 7, 0, 0],
        '=' => [0, 7, 0, 7, 0],
        '/' => [1, 1, 2, 4, 4],
        '(' => [1, 2, 2, 2, 1],
        ')' => [4, 2, 2, 2, 4],
        _ => [0; 5],
    }
}

/// Pixels a text is wide.
fn text_width(s: &str) -> usize {
    s.chars().count() * 8
}

/// An RGB canvas.
struct Canvas {
    rgb: Vec<u8>,
}

impl Canvas {
    fn new() -> Canvas {
        Canvas {
            rgb: vec![255u8; W * H * 3],
        }
    }

    fn put(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if (0..W as i64).contains(&x) && (0..H as i64).contains(&y) {
            let i = (y as usize * W + x as usize) * 3;
            self.rgb[i..i + 3].copy_from_slice(&c);
        }
    }

    fn rect(&mut self, x: usize, y: usize, w: usize, h: usize, c: [u8; 3]) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.put(xx as i64, yy as i64, c);
            }
        }
    }

    /// Text with its top left corner at (x, y).
    fn text(&mut self, x: usize, y: usize, s: &str, c: [u8; 3]) {
        for (i, ch) in s.chars().enumerate() {
            for (row, bits) in glyph(ch).iter().enumerate() {
                for col in 0..3 {
                    if bits & (4 >> col) != 0 {
                        self.rect(x + i * 8 + col * 2, y + row * 2, 2, 2, c);
                    }
                }
            }
        }
    }

    /// A line two pixels thick (Bresenham).
    fn line(&mut self, (mut x0, mut y0): (i64, i64), (x1, y1): (i64, i64), c: [u8; 3]) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let mut err = dx + dy;
        loop {
            self.put(x0, y0, c);
            self.put(x0, y0 + 1, c);
            if x0 == x1 && y0 == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x0 += sx;
            }
            if e2 <= dx {
                err += dx;
                y0 += sy;
            }
        }
    }
}

/// What a tenant is, for the legend.
fn tenant_label(run: &Run, i: usize) -> String {
    let kind = if run.long.get(i).copied().unwrap_or(false) {
        "long"
    } else {
        "short"
    };
    match run.changed_at {
        Some(_) => format!(
            "t{i} {kind} w{}-{}",
            run.weights[i],
            run.weights[run.weights.len() - 1 - i]
        ),
        None => format!("t{i} {kind} w{}", run.weights[i]),
    }
}

/// Every tenant's share of device time over a sliding 500 ms window, as a PNG: title,
/// labelled axes (share in %, seconds since the measured part began), one line per tenant
/// and a legend; in weights mode with a live change, a dashed line marks the change.
fn share_png(run: &Run, title: &str, path: &Path) -> Result<()> {
    let mut cv = Canvas::new();
    let (x0, y0, x1, y1) = PLOT;
    cv.text(x0, 4, title, BLACK);
    // Grid and y labels every 25 %.
    for q in 0..=4 {
        let y = y1 - (y1 - y0) * q / 4;
        let c = if q == 0 { BLACK } else { GRID };
        cv.rect(x0, y, x1 - x0 + 1, 1, c);
        let label = format!("{}%", q * 25);
        cv.text(x0 - 8 - text_width(&label), y - 5, &label, BLACK);
    }
    cv.rect(x0, y0, 1, y1 - y0 + 1, BLACK);
    let xlabel = "time (s)";
    cv.text((x0 + x1 - text_width(xlabel)) / 2, H - 22, xlabel, BLACK);
    cv.text(4, y0 - 16, "device share, 0.5 s window", BLACK);
    let s = &run.samples;
    let lag = (0.5 / SAMPLE.as_secs_f64()).round() as usize;
    if s.len() > lag + 1 {
        let (t0, t1) = (s[lag].0, s[s.len() - 1].0);
        let span = (t1 - t0).max(1e-9);
        let xpos = |t: f64| x0 as f64 + (t - t0) / span * (x1 - x0) as f64;
        // A tick and a label every second.
        let mut k = 0u32;
        while t0 + f64::from(k) <= t1 {
            let x = xpos(t0 + f64::from(k)) as usize;
            cv.rect(x, y1, 1, 6, BLACK);
            let label = k.to_string();
            cv.text(
                x.saturating_sub(text_width(&label) / 2),
                y1 + 9,
                &label,
                BLACK,
            );
            k += 1;
        }
        if let Some(c) = run.changed_at.filter(|c| (t0..=t1).contains(c)) {
            let x = xpos(c) as usize;
            for y in (y0..y1).step_by(8) {
                cv.rect(x, y, 1, 4, BLACK);
            }
            cv.text(x + 4, y0 + 4, "weights reversed", BLACK);
        }
        for tenant in 0..s[0].1.len() {
            let c = COLORS[tenant % COLORS.len()];
            let mut prev: Option<(i64, i64)> = None;
            for i in lag..s.len() {
                let d: Vec<u64> = s[i]
                    .1
                    .iter()
                    .zip(&s[i - lag].1)
                    .map(|(a, b)| a.saturating_sub(*b))
                    .collect();
                let total: u64 = d.iter().sum();
                let share = d[tenant] as f64 / total.max(1) as f64;
                let y = y1 as f64 - share * (y1 - y0) as f64;
                let p = (xpos(s[i].0) as i64, y as i64);
                if let Some(q) = prev {
                    cv.line(q, p, c);
                }
                prev = Some(p);
            }
        }
    }
    // Legend, right of the plot.
    for tenant in 0..run.weights.len() {
        let c = COLORS[tenant % COLORS.len()];
        let y = y0 + 4 + tenant * 20;
        cv.rect(x1 + 16, y + 2, 18, 6, c);
        cv.text(x1 + 40, y, &tenant_label(run, tenant), BLACK);
    }
    std::fs::write(path, png(&cv.rgb, W, H))?;
    Ok(())
}

/// An RGB image as a PNG file (stored, uncompressed deflate blocks).
pub fn png(rgb: &[u8], w: usize, h: usize) -> Vec<u8> {
    let mut raw = Vec::with_capacity((w * 3 + 1) * h);
    for row in rgb.chunks(w * 3).take(h) {
        raw.push(0);
        raw.extend_from_slice(row);
    }
    let mut z = vec![0x78, 0x01];
    let mut blocks = raw.chunks(65_535).peekable();
    while let Some(b) = blocks.next() {
        z.push(u8::from(blocks.peek().is_none()));
        let n = b.len() as u16;
        z.extend_from_slice(&n.to_le_bytes());
        z.extend_from_slice(&(!n).to_le_bytes());
        z.extend_from_slice(b);
    }
    z.extend_from_slice(&adler32(&raw).to_be_bytes());
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(w as u32).to_be_bytes());
    ihdr.extend_from_slice(&(h as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &z);
    chunk(&mut out, b"IEND", &[]);
    out
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for &x in data {
        a = (a + u32::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    (b << 16) | a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_of(samples: Vec<(f64, Vec<u64>)>) -> Run {
        Run {
            policy: "x".into(),
            samples: samples
                .into_iter()
                .map(|(t, ns)| (t, ns.clone(), ns, 0, 0))
                .collect(),
            long: vec![false, true],
            weights: vec![1, 1],
            changed_at: None,
            cpu: (0.0, 0.0),
        }
    }

    #[test]
    fn unfairness_is_avas_metric() {
        let run = run_of(vec![
            (0.0, vec![0, 0]),
            (1.0, vec![300, 100]),
            (2.0, vec![400, 200]),
        ]);

        let u = unfairness(&run, 1.0);

        assert_eq!(u, vec![0.5, 0.0]);
    }

    #[test]
    fn png_has_signature_and_chunks() {
        let img = png(&[255u8; 2 * 2 * 3], 2, 2);

        assert_eq!(&img[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&img[12..16], b"IHDR");
        assert_eq!(&img[img.len() - 8..img.len() - 4], b"IEND");
    }

    #[test]
    fn crc_matches_reference() {
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
    }

    #[test]
    fn median_of_even_count_is_the_mean_of_the_middle() {
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
