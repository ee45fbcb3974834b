//! `hira bench memory`: DymGPU's evaluation of slot placement (§4.2.2, Table 2) with real
//! tenant processes on an over-subscribed device, and the tenant workload it runs
//! (`hira bench-mem-tenant`).
//!
//! **The tenant** ([`tenant_main`]) creates a context and an in-order queue on the first
//! GPU, accelerator or CPU device of the first platform, allocates `--buffers` buffers of
//! `--size` bytes, fills them with a pattern of (seed, buffer, element), then launches a
//! kernel that adds a round- and buffer-specific number to every element of one buffer at a
//! time, buffers in a seeded shuffled order, for `--rounds` or `--seconds`. It keeps only the
//! total addend per buffer on the host, reads back and verifies one buffer every
//! [`CHECK_EVERY`] launches, sleeps after each launch so that its launches take the fraction
//! `--utilization` of its wall time, and verifies every element of every buffer at the end.
//! `--kernel-us` sizes the kernel's inner loop, measured at start (the benchmark measures it
//! once natively and passes the loop count with the hidden `--iters`).
//!
//! **The benchmark** ([`memory`]) reproduces Table 2 scaled to this machine: 15 tenants (or
//! fewer, proportionally) of low, medium and high utilization (0.1, 0.5, 0.9) reserving 384,
//! 704 and 1024 paper-MB in rotation, on a device of 60 slots of 64 paper-MB, with one paper-MB
//! standing for [`DEFAULT_UNIT`] bytes. Each placement algorithm runs the same tenants in a
//! fresh router (`hira serve`) whose capacity × over-commit holds every reservation; a control
//! run with a device large enough for every reservation must swap nothing. The router's swap
//! totals are read over its control socket at the start and end of the window in which every
//! tenant runs; the tenants report their kernels and checksums. The simulator
//! (`hira_policy::mem::sim`) replays the same mix for comparison.

use std::ffi::c_void;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hira_policy::mem::sim::{self, Mix, SimConfig, TABLE2};
use hira_policy::mem::{MonitorConfig, PlacementAlgo};
use hira_router::swap::SwapTotals;
use hira_router::{Request, Response};

use crate::Cl;

// ---------------------------------------------------------------------------------------
// The tenant
// ---------------------------------------------------------------------------------------

/// One buffer of the tenant is read back and verified after this many launches.
pub const CHECK_EVERY: u64 = 8;

/// What `hira bench-mem-tenant` accepts.
pub const TENANT_USAGE: &str = "\
usage: hira bench-mem-tenant --buffers N --size BYTES [--rounds R] [--seconds S] [--seed X]
                             [--utilization U] [--kernel-us K]
  BYTES a multiple of 4; U in (0, 1]; default: 4 rounds (with --seconds only: until S s)";

const ADD_SRC: &[u8] =
    b"__kernel void hira_mem_add(__global uint *a, uint add, uint iters, uint mask) {\n\
    size_t i = get_global_id(0);\n\
    uint x = a[i];\n\
    uint y = x ^ (uint)i;\n\
    for (uint k = 0; k < iters; k++) { y = y * 1664525u + 1013904223u; }\n\
    a[i] = x + add + (y & mask);\n\
}\n\0";

const CL_MEM_READ_WRITE: u64 = 1;

/// The tenant's options.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantOpts {
    pub buffers: usize,
    /// Bytes per buffer, a multiple of 4.
    pub size: usize,
    /// Rounds to run; None: until `seconds` (then at least one of the two is set).
    pub rounds: Option<u64>,
    pub seconds: Option<f64>,
    pub seed: u64,
    /// Fraction of wall time spent in launches, in (0, 1].
    pub utilization: f64,
    /// Target time of one launch, µs; the inner loop is sized by measuring.
    pub kernel_us: Option<f64>,
    /// Hidden: the inner loop's count, measured elsewhere (overrides `kernel_us`).
    pub iters: Option<u32>,
    /// Hidden: after filling, print `ready` on stderr and wait for this file to exist;
    /// print `rounds done` on stderr when the rounds end (the benchmark's start signal).
    pub start_file: Option<PathBuf>,
}

impl TenantOpts {
    /// Parses `--flag VALUE` / `--flag=VALUE` arguments.
    pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<TenantOpts> {
        let mut o = TenantOpts {
            buffers: 0,
            size: 0,
            rounds: None,
            seconds: None,
            seed: 1,
            utilization: 1.0,
            kernel_us: None,
            iters: None,
            start_file: None,
        };
        let (mut buffers, mut size) = (None, None);
        let mut it = args.iter().map(|a| a.as_ref().to_string());
        while let Some(arg) = it.next() {
            let (name, inline) = match arg.split_once('=') {
                Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
                _ => (arg.clone(), None),
            };
            let mut value = || -> Result<String> {
                match &inline {
                    Some(v) => Ok(v.clone()),
                    None => it.next().with_context(|| format!("{name} needs a value")),
                }
            };
            match name.as_str() {
                "--buffers" => buffers = Some(value()?.parse().context("--buffers")?),
                "--size" => size = Some(value()?.parse().context("--size")?),
                "--rounds" => o.rounds = Some(value()?.parse().context("--rounds")?),
                "--seconds" => o.seconds = Some(value()?.parse().context("--seconds")?),
                "--seed" => o.seed = value()?.parse().context("--seed")?,
                "--utilization" => o.utilization = value()?.parse().context("--utilization")?,
                "--kernel-us" => o.kernel_us = Some(value()?.parse().context("--kernel-us")?),
                "--iters" => o.iters = Some(value()?.parse().context("--iters")?),
                "--start-file" => o.start_file = Some(PathBuf::from(value()?)),
                _ => bail!("unknown argument {arg:?}"),
            }
        }
        o.buffers = buffers.context("--buffers is required")?;
        o.size = size.context("--size is required")?;
        if o.buffers == 0 {
            bail!("--buffers must be at least 1");
        }
        if o.size == 0 || !o.size.is_multiple_of(4) {
            bail!("--size must be a positive multiple of 4");
        }
        if !(o.utilization > 0.0 && o.utilization <= 1.0) {
            bail!("--utilization must be in (0, 1]");
        }
        if o.seconds.is_some_and(|s| !(s > 0.0 && s.is_finite())) {
            bail!("--seconds must be positive");
        }
        if o.kernel_us.is_some_and(|k| !(k > 0.0 && k.is_finite())) {
            bail!("--kernel-us must be positive");
        }
        if o.rounds.is_none() && o.seconds.is_none() {
            o.rounds = Some(4);
        }
        Ok(o)
    }
}

/// SplitMix64's finalizer.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The base of buffer `buffer`'s pattern.
fn pattern_base(seed: u64, buffer: usize) -> u64 {
    mix64(mix64(seed) ^ (buffer as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

/// The initial value of element `element` of buffer `buffer`.
pub fn pattern(seed: u64, buffer: usize, element: usize) -> u32 {
    mix64(pattern_base(seed, buffer) ^ element as u64) as u32
}

/// What round `round` adds to buffer `buffer`.
pub fn addend(seed: u64, round: u64, buffer: usize) -> u32 {
    (mix64(seed ^ mix64(round.wrapping_add(1) << 32 | buffer as u64)) as u32) | 1
}

/// The buffers in round `round`'s order: a seeded Fisher–Yates shuffle.
pub fn order(seed: u64, round: u64, n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut state = mix64(seed.wrapping_mul(31).wrapping_add(round));
    for i in (1..n).rev() {
        state = mix64(state);
        let j = (state % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// A wrong element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub buffer: usize,
    pub element: usize,
    pub got: u32,
    pub want: u32,
}

/// Buffer `buffer`'s contents against its pattern plus `added`.
pub fn verify(seed: u64, buffer: usize, added: u32, got: &[u32]) -> Option<Mismatch> {
    let base = pattern_base(seed, buffer);
    got.iter().enumerate().find_map(|(j, &g)| {
        let want = (mix64(base ^ j as u64) as u32).wrapping_add(added);
        (g != want).then_some(Mismatch {
            buffer,
            element: j,
            got: g,
            want,
        })
    })
}

/// What a tenant run did.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantReport {
    pub buffers: usize,
    pub size: usize,
    pub kernels: u64,
    pub verified_bytes: u64,
    /// Wall time of the rounds.
    pub seconds: f64,
    /// Wall time inside launches (enqueue to clFinish).
    pub busy_seconds: f64,
    pub mismatch: Option<Mismatch>,
}

impl TenantReport {
    /// The JSON line the benchmark reads.
    pub fn json(&self) -> String {
        format!(
            "{{\"kernels\":{},\"verified_bytes\":{},\"seconds\":{:.6},\"busy_seconds\":{:.6}}}",
            self.kernels, self.verified_bytes, self.seconds, self.busy_seconds
        )
    }

    /// The final line.
    pub fn last_line(&self) -> String {
        match &self.mismatch {
            None => format!(
                "checksums ok: {} buffers, {} bytes, {} kernels, {:.2} s",
                self.buffers,
                self.buffers as u64 * self.size as u64,
                self.kernels,
                self.seconds
            ),
            Some(m) => format!(
                "checksum MISMATCH: buffer {} element {}: got {} want {}",
                m.buffer, m.element, m.got, m.want
            ),
        }
    }
}

/// The tenant's kernel, its buffers and queue.
struct Work {
    cl: Cl,
    kernel: *mut c_void,
    bufs: Vec<*mut c_void>,
    elems: usize,
}

impl Work {
    fn set_arg<T>(&self, index: u32, v: &T) -> Result<()> {
        // SAFETY: `v` is a live value of the argument's size.
        crate::check("clSetKernelArg", unsafe {
            self.cl.api.clSetKernelArg.context("missing")?(
                self.kernel,
                index,
                std::mem::size_of::<T>(),
                v as *const T as *const c_void,
            )
        })
    }

    /// One launch on buffer `b` adding `add`, waited for; its wall time.
    fn launch(&self, b: usize, add: u32) -> Result<Duration> {
        let t = Instant::now();
        self.set_arg(0, &self.bufs[b])?;
        self.set_arg(1, &add)?;
        self.cl
            .launch_1d(self.kernel, self.elems, std::ptr::null_mut())?;
        self.cl.finish()?;
        Ok(t.elapsed())
    }

    fn write(&self, b: usize, host: &[u32]) -> Result<()> {
        // SAFETY: `host` holds the buffer's bytes; blocking.
        crate::check("clEnqueueWriteBuffer", unsafe {
            self.cl.api.clEnqueueWriteBuffer.context("missing")?(
                self.cl.queue,
                self.bufs[b],
                1,
                0,
                host.len() * 4,
                host.as_ptr() as *const c_void,
                0,
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        })
    }

    fn read(&self, b: usize, host: &mut [u32]) -> Result<()> {
        // SAFETY: `host` has room for the buffer's bytes; blocking.
        crate::check("clEnqueueReadBuffer", unsafe {
            self.cl.api.clEnqueueReadBuffer.context("missing")?(
                self.cl.queue,
                self.bufs[b],
                1,
                0,
                host.len() * 4,
                host.as_mut_ptr() as *mut c_void,
                0,
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        })
    }
}

/// Builds the kernel and `n` buffers of `size` bytes on `cl`.
fn work(cl: Cl, n: usize, size: usize) -> Result<Work> {
    let kernel = cl.kernel(ADD_SRC, c"hira_mem_add")?;
    let mut bufs = Vec::with_capacity(n);
    for _ in 0..n {
        let mut err = 0;
        // SAFETY: a plain read-write buffer without host pointer.
        let b = unsafe {
            cl.api.clCreateBuffer.context("missing")?(
                cl.ctx,
                CL_MEM_READ_WRITE,
                size,
                std::ptr::null_mut(),
                &mut err,
            )
        };
        crate::check("clCreateBuffer", err)?;
        bufs.push(b);
    }
    let w = Work {
        cl,
        kernel,
        bufs,
        elems: size / 4,
    };
    w.set_arg(2, &0u32)?;
    w.set_arg(3, &0u32)?;
    Ok(w)
}

/// The inner-loop count that makes one launch on buffer 0 take about `target_us`, by
/// measuring (median of five launches at each step; launches add 0, so contents stay).
/// Returns (iterations, µs of a launch without the loop, µs measured at the result).
fn calibrate(w: &Work, target_us: f64) -> Result<(u32, f64, f64)> {
    let time = |iters: u32| -> Result<f64> {
        w.set_arg(2, &iters)?;
        let mut v = Vec::with_capacity(5);
        for _ in 0..5 {
            v.push(w.launch(0, 0)?.as_secs_f64() * 1e6);
        }
        Ok(crate::median(&v))
    };
    w.launch(0, 0)?; // warm
    let base = time(0)?;
    let (mut iters, mut at) = (0u32, base);
    if base < target_us {
        // A loop count whose cost is at least half the target's, then a few secant steps.
        let mut probe = 4u32;
        let mut t = time(probe)?;
        while t < base + 0.5 * (target_us - base) && probe < 1 << 24 {
            probe *= 2;
            t = time(probe)?;
        }
        (iters, at) = (probe, t);
        for _ in 0..3 {
            if (at - target_us).abs() <= 0.05 * target_us || at <= base {
                break;
            }
            let slope = (at - base) / f64::from(iters.max(1));
            let next = ((target_us - base) / slope).round().clamp(1.0, 1e8) as u32;
            if next == iters {
                break;
            }
            let t = time(next)?;
            if (t - target_us).abs() < (at - target_us).abs() {
                (iters, at) = (next, t);
            } else {
                break;
            }
        }
    }
    w.set_arg(2, &iters)?;
    Ok((iters, base, at))
}

/// Measures natively, in this process, the inner-loop count for launches of `target_us` on
/// a buffer of `size` bytes (what the benchmark passes to its tenants): the median of three
/// calibrations, with the launch time measured at it.
pub fn calibrate_native(size: usize, target_us: f64) -> Result<(u32, f64, f64)> {
    let w = work(crate::setup()?, 1, size)?;
    let mut runs = Vec::new();
    for _ in 0..3 {
        runs.push(calibrate(&w, target_us)?);
    }
    runs.sort_by_key(|r| r.0);
    Ok(runs[1])
}

fn wait_for_file(path: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    while !path.exists() {
        if Instant::now() > deadline {
            bail!("start file {} did not appear", path.display());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Runs the tenant: fill, rounds, final verification. A wrong element ends the run early
/// with `mismatch` set; an OpenCL failure is an error.
pub fn run_tenant(o: &TenantOpts) -> Result<TenantReport> {
    let w = work(crate::setup()?, o.buffers, o.size)?;
    let elems = o.size / 4;
    let mut host = vec![0u32; elems];
    for b in 0..o.buffers {
        let base = pattern_base(o.seed, b);
        for (j, x) in host.iter_mut().enumerate() {
            *x = mix64(base ^ j as u64) as u32;
        }
        w.write(b, &host)?;
    }
    let iters = match (o.iters, o.kernel_us) {
        (Some(i), _) => {
            w.set_arg(2, &i)?;
            i
        }
        (None, Some(k)) => {
            let (i, base, at) = calibrate(&w, k)?;
            eprintln!(
                "bench-mem-tenant: kernel loop {i} iterations: {at:.0} us per launch (target {k:.0}, without the loop {base:.0})"
            );
            i
        }
        (None, None) => 0,
    };
    let _ = iters;
    if let Some(f) = &o.start_file {
        eprintln!("bench-mem-tenant: ready");
        wait_for_file(f)?;
    }
    let mut r = TenantReport {
        buffers: o.buffers,
        size: o.size,
        kernels: 0,
        verified_bytes: 0,
        seconds: 0.0,
        busy_seconds: 0.0,
        mismatch: None,
    };
    let mut added = vec![0u32; o.buffers];
    let mut next_check = 0usize;
    let start = Instant::now();
    let deadline = o.seconds.map(|s| start + Duration::from_secs_f64(s));
    let mut round = 0u64;
    'rounds: while o.rounds.is_none_or(|n| round < n) {
        for b in order(o.seed, round, o.buffers) {
            let add = addend(o.seed, round, b);
            let dt = w.launch(b, add)?;
            added[b] = added[b].wrapping_add(add);
            r.kernels += 1;
            r.busy_seconds += dt.as_secs_f64();
            if o.utilization < 1.0 {
                let mut pause = dt.mul_f64((1.0 - o.utilization) / o.utilization);
                if let Some(d) = deadline {
                    // Never past the end of the run.
                    pause = pause.min(d.saturating_duration_since(Instant::now()));
                }
                std::thread::sleep(pause);
            }
            if r.kernels.is_multiple_of(CHECK_EVERY) {
                let c = next_check % o.buffers;
                next_check += 1;
                w.read(c, &mut host)?;
                r.verified_bytes += o.size as u64;
                if let Some(m) = verify(o.seed, c, added[c], &host) {
                    r.seconds = start.elapsed().as_secs_f64();
                    r.mismatch = Some(m);
                    return Ok(r);
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break 'rounds;
            }
        }
        round += 1;
    }
    r.seconds = start.elapsed().as_secs_f64();
    if o.start_file.is_some() {
        eprintln!("bench-mem-tenant: rounds done");
    }
    for (b, &a) in added.iter().enumerate() {
        w.read(b, &mut host)?;
        r.verified_bytes += o.size as u64;
        if let Some(m) = verify(o.seed, b, a, &host) {
            r.mismatch = Some(m);
            return Ok(r);
        }
    }
    Ok(r)
}

/// `hira bench-mem-tenant ...`: prints the JSON line and the final line; exit 0 (checksums
/// ok), 1 (mismatch), 2 (an OpenCL call failed), 64 (bad arguments).
pub fn tenant_main<S: AsRef<str>>(args: &[S]) -> u8 {
    let o = match TenantOpts::parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("hira bench-mem-tenant: {e:#}\n{TENANT_USAGE}");
            return 64;
        }
    };
    match run_tenant(&o) {
        Ok(r) => {
            println!("{}", r.json());
            println!("{}", r.last_line());
            u8::from(r.mismatch.is_some())
        }
        Err(e) => {
            let line = match e.downcast_ref::<crate::ClError>() {
                Some(c) => format!("OpenCL error: {c}"),
                None => format!("OpenCL error: {e:#}"),
            };
            eprintln!("{line}");
            println!("{line}");
            2
        }
    }
}

// ---------------------------------------------------------------------------------------
// The benchmark
// ---------------------------------------------------------------------------------------

/// Bytes standing for one of the paper's megabytes: 64 KiB, so the 3840 MB device is
/// 240 MiB, a slot 4 MiB and the largest reservation 64 MiB.
pub const DEFAULT_UNIT: u64 = 64 << 10;
/// Table 2's tenant count.
pub const TABLE2_TENANTS: usize = 15;
/// Slots of the paper's device (3840 MB / 64 MB).
pub const SLOTS: usize = 60;
/// Paper megabytes per slot, and the largest buffer (sim's `max_buffer_mb`).
pub const SLOT_MB: u64 = 64;
/// Reservations in paper megabytes, in rotation per workload (§4.2.1).
pub const RESERVATIONS_MB: [u64; 3] = [384, 704, 1024];
/// The monitor's default idle threshold in the benchmark's routers, ms: DymGPU's own 20 s,
/// unscaled. Every tenant of Table 2 runs continuously, but a low-utilization tenant on a
/// loaded 2-core machine pauses for seconds between launches, and a shorter threshold
/// would have the placement drop and re-admit it (measured: 7 re-placements in 20 s at 2 s).
pub const IDLE_AFTER_MS: u64 = 20_000;
/// The monitor's default re-placement period, ms: a tenth of the default run, as DymGPU's
/// 20 s period is of its 200 s runs.
pub const REPLACE_EVERY_MS: u64 = 2_000;

/// What `hira bench memory` runs.
#[derive(Clone, Debug)]
pub struct MemOpts {
    pub mixes: Vec<Mix>,
    pub seconds: f64,
    pub placements: Vec<PlacementAlgo>,
    /// Tenants per mix (15: Table 2; fewer scales each workload proportionally).
    pub tenants: usize,
    /// Also run the no-over-commit control.
    pub control: bool,
    /// Target time of one launch, ms.
    pub kernel_ms: f64,
    /// Scale every tenant's utilization so the mix asks for this many devices' worth of
    /// busy time (None: Table 2's values as they are, 7.5 devices for set4).
    pub demand: Option<f64>,
    /// The routers' scheduling policy.
    pub sched: String,
    /// Bytes per paper megabyte.
    pub unit: u64,
    /// The routers' (and the simulator's) idle threshold and re-placement period.
    pub monitor: MonitorConfig,
    /// The `hira` executable.
    pub exe: PathBuf,
}

/// A mix by name (`set1` … `set5`).
pub fn mix_by_name(name: &str) -> Option<Mix> {
    TABLE2.iter().find(|m| m.name == name).copied()
}

/// `mix` with `tenants` tenants instead of 15, each workload scaled proportionally
/// (largest remainder, so the counts add up).
pub fn scale_mix(mix: &Mix, tenants: usize) -> Mix {
    let counts = [mix.lightsmark, mix.firefox_asteroids, mix.urbanterror];
    let total: usize = counts.iter().sum();
    if total == 0 || tenants == total {
        return *mix;
    }
    let exact: Vec<f64> = counts
        .iter()
        .map(|&c| c as f64 * tenants as f64 / total as f64)
        .collect();
    let mut out: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
    let mut left = tenants - out.iter().sum::<usize>();
    let mut by_rest: Vec<usize> = (0..3).collect();
    by_rest.sort_by(|&a, &b| {
        (exact[b] - exact[b].floor())
            .total_cmp(&(exact[a] - exact[a].floor()))
            .then(a.cmp(&b))
    });
    for &i in by_rest.iter().cycle() {
        if left == 0 {
            break;
        }
        out[i] += 1;
        left -= 1;
    }
    Mix {
        name: mix.name,
        lightsmark: out[0],
        firefox_asteroids: out[1],
        urbanterror: out[2],
    }
}

/// Slots of the device for a mix of `mb` paper-MB of reservations when Table 2's full mix
/// reserves `full_mb` on 60 slots: proportionally fewer, so the over-subscription stays.
pub fn scaled_slots(mb: u64, full_mb: u64) -> usize {
    if mb == full_mb || full_mb == 0 {
        return SLOTS;
    }
    ((SLOTS as u64 * mb) as f64 / full_mb as f64)
        .round()
        .max(1.0) as usize
}

/// One tenant of a mix.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub workload: &'static str,
    /// Table 2's utilization of the workload.
    pub utilization: f64,
    /// The busy fraction the tenant is run with (`utilization`, or scaled by `--demand`).
    pub target: f64,
    /// Reservation in paper megabytes.
    pub mb: u64,
}

/// The tenants of `mix` in arrival order, as the simulator builds them: the workloads
/// interleaved, each workload's reservations rotating through `RESERVATIONS_MB`.
pub fn specs(mix: &Mix) -> Vec<Spec> {
    let kinds = [sim::LIGHTSMARK, sim::FIREFOX_ASTEROIDS, sim::URBANTERROR];
    let mut left = [mix.lightsmark, mix.firefox_asteroids, mix.urbanterror];
    let mut seen = [0usize; 3];
    let mut out = Vec::new();
    while left.iter().any(|&n| n > 0) {
        for k in 0..3 {
            if left[k] == 0 {
                continue;
            }
            left[k] -= 1;
            out.push(Spec {
                workload: kinds[k].name,
                utilization: kinds[k].utilization,
                target: kinds[k].utilization,
                mb: RESERVATIONS_MB[seen[k] % RESERVATIONS_MB.len()],
            });
            seen[k] += 1;
        }
    }
    out
}

/// Buffers of at most `SLOT_MB` paper-MB making up `mb` (all reservations are multiples).
pub fn buffers_of(mb: u64) -> Vec<u64> {
    let mut v = vec![SLOT_MB; (mb / SLOT_MB) as usize];
    if !mb.is_multiple_of(SLOT_MB) {
        v.push(mb % SLOT_MB);
    }
    v
}

/// The monitor's idle threshold and period, from milliseconds.
pub fn monitor_ms(idle_after_ms: u64, replace_every_ms: u64) -> MonitorConfig {
    MonitorConfig {
        idle_threshold: idle_after_ms * 1_000_000,
        period: replace_every_ms * 1_000_000,
    }
}

/// The simulator's configuration matching a real run.
pub fn sim_config(unit: u64, slots: usize, seconds: f64, monitor: MonitorConfig) -> SimConfig {
    SimConfig {
        unit,
        slots,
        slot_mb: SLOT_MB,
        reservations_mb: RESERVATIONS_MB.to_vec(),
        max_buffer_mb: SLOT_MB,
        quantum: 16_000_000,
        duration: (seconds * 1e9) as u64,
        monitor,
    }
}

/// The over-commit ratio that lets `total` bytes of reservations into `capacity`: the
/// ratio rounded up to a half, at least 1.5 (over-subscription stays on).
pub fn overcommit_for(total: u64, capacity: u64) -> f64 {
    let r = total as f64 / capacity.max(1) as f64;
    ((r * 2.0).ceil() / 2.0).max(1.5)
}

/// The `[memory]`/`[scheduler]` configuration of one run's router.
pub fn router_toml(
    socket: &Path,
    sched: &str,
    capacity: u64,
    overcommit: f64,
    slots: usize,
    placement: PlacementAlgo,
    monitor: MonitorConfig,
) -> String {
    format!(
        "socket = {socket:?}\n\
         log = \"info\"\n\
         [scheduler]\n\
         policy = \"{sched}\"\n\
         kernel_timeout = \"60s\"\n\
         [memory]\n\
         capacity = {capacity}\n\
         overcommit = {overcommit}\n\
         slots = {slots}\n\
         placement = \"{placement}\"\n\
         idle_after = \"{}ms\"\n\
         replace_every = \"{}ms\"\n",
        monitor.idle_threshold / 1_000_000,
        monitor.period / 1_000_000,
        socket = socket.display().to_string()
    )
}

/// The numbers of a tenant's JSON line.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TenantNumbers {
    pub kernels: u64,
    pub verified_bytes: u64,
    pub seconds: f64,
    pub busy_seconds: f64,
}

/// Parses `{"kernels":..,"verified_bytes":..,"seconds":..,"busy_seconds":..}`.
pub fn parse_json_line(line: &str) -> Option<TenantNumbers> {
    let body = line.trim().strip_prefix('{')?.strip_suffix('}')?;
    let mut n = TenantNumbers::default();
    let mut seen = 0;
    for field in body.split(',') {
        let (k, v) = field.split_once(':')?;
        let v = v.trim();
        match k.trim().trim_matches('"') {
            "kernels" => n.kernels = v.parse().ok()?,
            "verified_bytes" => n.verified_bytes = v.parse().ok()?,
            "seconds" => n.seconds = v.parse().ok()?,
            "busy_seconds" => n.busy_seconds = v.parse().ok()?,
            _ => continue,
        }
        seen += 1;
    }
    (seen == 4).then_some(n)
}

/// How one tenant ended.
#[derive(Clone, Debug)]
struct TenantEnd {
    spec: Spec,
    status: String,
    ok: bool,
    numbers: Option<TenantNumbers>,
    last_line: String,
    stderr_tail: Vec<String>,
}

/// One router run.
#[derive(Clone, Debug)]
pub struct RunResult {
    pub label: String,
    /// Measured window (every tenant in its rounds), seconds.
    pub window_s: f64,
    /// Swap totals over the window.
    pub window: SwapTotals,
    /// Swap totals over the whole run (fill and final verification included).
    pub whole: SwapTotals,
    /// Sum over tenants of kernels per second of their rounds.
    pub kernels_per_s: f64,
    pub tenants_ok: usize,
    pub tenants: usize,
    /// Achieved busy fraction per utilization class (low, medium, high).
    pub busy: [f64; 3],
    /// Mean wall time of one launch per class, ms (queueing and swapping included).
    pub launch_ms: [f64; 3],
    /// Kernels per second per class (sum over its tenants).
    pub class_kps: [f64; 3],
    pub failures: Vec<String>,
}

impl RunResult {
    pub fn swapped_per_s(&self) -> f64 {
        (self.window.bytes_evicted + self.window.bytes_restored) as f64 / self.window_s.max(1e-9)
    }

    /// Bytes swapped in the window per kernel the tenants ran (NaN without kernels): the
    /// measure that does not move with the machine's speed, which sets the kernel rate.
    pub fn swapped_per_kernel(&self) -> f64 {
        let k = self.kernels_per_s * self.window_s;
        if k > 0.0 {
            (self.window.bytes_evicted + self.window.bytes_restored) as f64 / k
        } else {
            f64::NAN
        }
    }

    /// Average switch time, ms: eviction and restore time per swap.
    pub fn switch_ms(&self) -> Option<f64> {
        (self.window.swaps > 0).then(|| {
            (self.window.evict_ns + self.window.restore_ns) as f64 / 1e6 / self.window.swaps as f64
        })
    }
}

fn delta(a: &SwapTotals, b: &SwapTotals) -> SwapTotals {
    SwapTotals {
        bytes_evicted: b.bytes_evicted.saturating_sub(a.bytes_evicted),
        bytes_restored: b.bytes_restored.saturating_sub(a.bytes_restored),
        buffers_evicted: b.buffers_evicted.saturating_sub(a.buffers_evicted),
        buffers_restored: b.buffers_restored.saturating_sub(a.buffers_restored),
        swaps: b.swaps.saturating_sub(a.swaps),
        evict_ns: b.evict_ns.saturating_sub(a.evict_ns),
        restore_ns: b.restore_ns.saturating_sub(a.restore_ns),
        placements: b.placements.saturating_sub(a.placements),
        pinned_bytes: b.pinned_bytes,
    }
}

/// The router's swap totals (zero when over-subscription is off).
fn swap_totals(socket: &Path) -> Result<SwapTotals> {
    match hira_router::request(socket, &Request::Stats)? {
        Response::Stats { memory, .. } => Ok(memory
            .and_then(|m| m.swap)
            .map(|s| s.totals)
            .unwrap_or_default()),
        other => bail!("unexpected answer to stats: {other:?}"),
    }
}

/// A `hira serve` of one run, stopped and reaped on drop.
struct Router {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Router {
    fn start(exe: &Path, dir: &Path, tag: &str, toml: &str, socket: &Path) -> Result<Router> {
        let cfg = dir.join(format!("{tag}.toml"));
        std::fs::write(&cfg, toml)?;
        let log = dir.join(format!("{tag}.router.log"));
        let out = std::fs::File::create(&log)?;
        let child = Command::new(exe)
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting hira serve")?;
        let mut r = Router {
            child,
            socket: socket.to_path_buf(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if swap_totals(socket).is_ok() {
                return Ok(r);
            }
            if let Ok(Some(st)) = r.child.try_wait() {
                bail!("hira serve exited ({st}): {}", r.log_tail());
            }
            if Instant::now() > deadline {
                bail!("hira serve did not answer within 10 s: {}", r.log_tail());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = hira_router::request(&self.socket, &Request::Shutdown);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

enum Event {
    Ready(usize),
    Done,
    Line(usize, String),
}

/// The tenant processes of a run, as their stderr lines and exits report them.
struct Tenants {
    rx: mpsc::Receiver<Event>,
    /// None once reaped.
    kids: Vec<Option<Child>>,
    ready: Vec<bool>,
    status: Vec<Option<std::process::ExitStatus>>,
    /// The last lines of each tenant's stderr.
    logs: Vec<Vec<String>>,
    /// When the first tenant ended its rounds.
    first_done: Option<Instant>,
}

impl Tenants {
    fn running(&self) -> bool {
        self.status.iter().any(Option::is_none)
    }

    /// Takes the events of up to `wait`, and reaps the tenants that exited.
    fn pump(&mut self, wait: Duration) {
        let mut ev = self.rx.recv_timeout(wait).ok();
        while let Some(e) = ev.take() {
            match e {
                Event::Ready(i) => self.ready[i] = true,
                Event::Done => {
                    self.first_done.get_or_insert_with(Instant::now);
                }
                Event::Line(i, l) => {
                    self.logs[i].push(l);
                    if self.logs[i].len() > 20 {
                        self.logs[i].remove(0);
                    }
                }
            }
            ev = self.rx.try_recv().ok();
        }
        for (i, k) in self.kids.iter_mut().enumerate() {
            if let Some(c) = k {
                if let Ok(Some(st)) = c.try_wait() {
                    self.status[i] = Some(st);
                    *k = None;
                }
            }
        }
    }
}

/// Where runs keep their router configurations, logs, sockets and start files.
fn work_dir() -> PathBuf {
    std::env::temp_dir().join(format!("hira-bench-mem-{}", std::process::id()))
}

/// One run of `specs` on a fresh router.
fn run_one(
    o: &MemOpts,
    label: &str,
    specs: &[Spec],
    slots: usize,
    placement: PlacementAlgo,
    iters: u32,
) -> Result<RunResult> {
    let dir = work_dir();
    std::fs::create_dir_all(&dir)?;
    let tag = label.replace(' ', "-");
    let socket = dir.join(format!("{tag}.sock"));
    let _ = std::fs::remove_file(&socket);
    let start_file = dir.join(format!("{tag}.start"));
    let _ = std::fs::remove_file(&start_file);
    let total: u64 = specs.iter().map(|s| s.mb * o.unit).sum();
    let capacity = slots as u64 * SLOT_MB * o.unit;
    let overcommit = overcommit_for(total, capacity);
    let toml = router_toml(
        &socket, &o.sched, capacity, overcommit, slots, placement, o.monitor,
    );
    let router = Router::start(&o.exe, &dir, &tag, &toml, &socket)?;
    let buffer_bytes = SLOT_MB * o.unit;
    let (tx, rx) = mpsc::channel();
    let mut kids: Vec<Option<Child>> = Vec::new();
    let mut outs = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let mut cmd = Command::new(&o.exe);
        cmd.arg("run")
            .arg("--router")
            .arg(&socket)
            .arg("--memory-quota")
            .arg((s.mb * o.unit).to_string())
            .arg("--")
            .arg(&o.exe)
            .arg("bench-mem-tenant")
            .arg("--buffers")
            .arg(buffers_of(s.mb).len().to_string())
            .arg("--size")
            .arg(buffer_bytes.to_string())
            .arg("--seconds")
            .arg(o.seconds.to_string())
            .arg("--seed")
            .arg((i + 1).to_string())
            .arg("--utilization")
            .arg(format!("{:.6}", s.target))
            .arg("--iters")
            .arg(iters.to_string())
            .arg("--start-file")
            .arg(&start_file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_remove("RUST_LOG");
        let mut child = cmd.spawn().context("starting a tenant")?;
        let stderr = child.stderr.take().context("tenant stderr")?;
        let mut stdout = child.stdout.take().context("tenant stdout")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let ev = match line.as_str() {
                    "bench-mem-tenant: ready" => Event::Ready(i),
                    "bench-mem-tenant: rounds done" => Event::Done,
                    _ => Event::Line(i, line),
                };
                if tx.send(ev).is_err() {
                    break;
                }
            }
        });
        outs.push(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stdout.read_to_string(&mut s);
            s
        }));
        kids.push(Some(child));
    }
    drop(tx);
    let n = specs.len();
    let mut t = Tenants {
        rx,
        kids,
        ready: vec![false; n],
        status: vec![None; n],
        logs: vec![Vec::new(); n],
        first_done: None,
    };
    // Every tenant filled its buffers (or died).
    let deadline = Instant::now() + Duration::from_secs(300);
    while (0..n).any(|i| !t.ready[i] && t.status[i].is_none()) && Instant::now() < deadline {
        t.pump(Duration::from_millis(50));
    }
    let a = swap_totals(&router.socket)?;
    let t_a = Instant::now();
    std::fs::write(&start_file, b"go")?;
    // Until the first tenant ends its rounds: the window in which every tenant runs.
    let deadline = t_a + Duration::from_secs_f64(o.seconds + 120.0);
    while t.first_done.is_none() && t.running() && Instant::now() < deadline {
        t.pump(Duration::from_millis(20));
    }
    let b = swap_totals(&router.socket)?;
    let t_b = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(300);
    while t.running() && Instant::now() < deadline {
        t.pump(Duration::from_millis(50));
    }
    let mut killed = vec![false; n];
    for (i, k) in t.kids.iter_mut().enumerate() {
        if let Some(c) = k {
            let _ = c.kill();
            t.status[i] = c.wait().ok();
            killed[i] = true;
        }
    }
    let (status, mut logs) = (t.status, t.logs);
    let c = swap_totals(&router.socket)?;
    let log = router.log.clone();
    drop(router);
    let _ = std::fs::remove_file(&start_file);
    let mut ends = Vec::new();
    for (i, h) in outs.into_iter().enumerate() {
        let out = h.join().unwrap_or_default();
        let numbers = out.lines().find_map(parse_json_line);
        let last_line = out.lines().last().unwrap_or("").to_string();
        let st = status[i];
        let code = st.and_then(|s| s.code());
        let ok = code == Some(0) && last_line.starts_with("checksums ok:") && numbers.is_some();
        let status = match (killed[i], st) {
            (true, _) => "killed (did not finish in time)".to_string(),
            (false, Some(s)) => s.to_string(),
            (false, None) => "unknown".to_string(),
        };
        ends.push(TenantEnd {
            spec: specs[i].clone(),
            status,
            ok,
            numbers,
            last_line,
            stderr_tail: std::mem::take(&mut logs[i]),
        });
    }
    let mut busy = [(0.0, 0usize); 3];
    let mut launch = [(0.0, 0usize); 3];
    let mut class_kps = [0.0; 3];
    let mut kernels_per_s = 0.0;
    let mut failures = Vec::new();
    for (i, e) in ends.iter().enumerate() {
        if let Some(nu) = e.numbers.filter(|nu| nu.seconds > 0.0) {
            kernels_per_s += nu.kernels as f64 / nu.seconds;
            let class = class_of(e.spec.utilization);
            busy[class].0 += nu.busy_seconds / nu.seconds;
            busy[class].1 += 1;
            class_kps[class] += nu.kernels as f64 / nu.seconds;
            if nu.kernels > 0 {
                launch[class].0 += 1000.0 * nu.busy_seconds / nu.kernels as f64;
                launch[class].1 += 1;
            }
        }
        if !e.ok {
            let mut f = format!(
                "tenant {i} ({}, {} paper-MB): {}: {}",
                e.spec.workload, e.spec.mb, e.status, e.last_line
            );
            for l in e.stderr_tail.iter().rev().take(5).rev() {
                let _ = write!(f, "\n    {l}");
            }
            failures.push(f);
        }
    }
    if !failures.is_empty() {
        // What the router saw: warnings, errors, servers that did not exit cleanly.
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let mut f = format!("router log {}:", log.display());
        for l in text
            .lines()
            .filter(|l| {
                l.contains(" WARN ")
                    || l.contains(" ERROR ")
                    || (l.contains("server exited") && !l.contains("exit code 0"))
            })
            .take(8)
        {
            let l: String = l.chars().take(300).collect();
            let _ = write!(f, "\n    {l}");
        }
        failures.push(f);
    }
    Ok(RunResult {
        label: label.to_string(),
        window_s: (t_b - t_a).as_secs_f64(),
        window: delta(&a, &b),
        whole: c,
        kernels_per_s,
        tenants_ok: ends.iter().filter(|e| e.ok).count(),
        tenants: n,
        busy: busy.map(|(s, k)| if k > 0 { s / k as f64 } else { f64::NAN }),
        launch_ms: launch.map(|(s, k)| if k > 0 { s / k as f64 } else { f64::NAN }),
        class_kps,
        failures,
    })
}

fn class_of(utilization: f64) -> usize {
    if utilization < 0.3 {
        0
    } else if utilization < 0.7 {
        1
    } else {
        2
    }
}

/// A table: a label column, then one right-aligned column per header.
pub fn grid(headers: &[String], rows: &[(String, Vec<String>)]) -> String {
    let label_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..headers.len())
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.1.get(c).map(|s| s.chars().count()))
                .chain([headers[c].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut s = format!("{:<label_w$}", "");
    for (h, w) in headers.iter().zip(&widths) {
        let _ = write!(s, "  {h:>w$}");
    }
    s.push('\n');
    for (label, cells) in rows {
        let _ = write!(s, "{label:<label_w$}");
        for (c, w) in cells.iter().zip(&widths) {
            let _ = write!(s, "  {c:>w$}");
        }
        s.push('\n');
    }
    s
}

/// `x` against `base` as "N% fewer" / "N% more".
pub fn fewer(x: f64, base: f64) -> String {
    if x.is_nan() || base.is_nan() {
        return "n/a".into();
    }
    if base <= 0.0 {
        return if x <= 0.0 {
            "equal (both 0)".into()
        } else {
            "more (lls swapped nothing)".into()
        };
    }
    let p = 100.0 * (1.0 - x / base);
    if p >= 0.0 {
        format!("{p:.0}% fewer")
    } else {
        format!("{:.0}% more", -p)
    }
}

fn mib(bytes: f64) -> String {
    format!("{:.1}", bytes / (1u64 << 20) as f64)
}

/// The report of one mix: real runs side by side, then the simulator's numbers.
pub fn mix_table(
    runs: &[RunResult],
    sims: &[(PlacementAlgo, sim::SimReport)],
    sim_seconds: f64,
) -> String {
    let headers: Vec<String> = runs.iter().map(|r| r.label.clone()).collect();
    let col = |f: &dyn Fn(&RunResult) -> String| -> Vec<String> { runs.iter().map(f).collect() };
    let sim_of = |r: &RunResult| sims.iter().find(|(a, _)| a.name() == r.label).map(|x| &x.1);
    let mut rows: Vec<(String, Vec<String>)> = vec![
        (
            "bytes swapped (MiB/s)".into(),
            col(&|r| mib(r.swapped_per_s())),
        ),
        (
            "  evicted / restored (MiB)".into(),
            col(&|r| {
                format!(
                    "{} / {}",
                    mib(r.window.bytes_evicted as f64),
                    mib(r.window.bytes_restored as f64)
                )
            }),
        ),
        (
            "bytes swapped per kernel (MiB)".into(),
            col(&|r| {
                let k = r.swapped_per_kernel();
                if k.is_nan() {
                    "-".into()
                } else {
                    mib(k)
                }
            }),
        ),
        (
            "swaps (per s)".into(),
            col(&|r| format!("{:.1}", r.window.swaps as f64 / r.window_s.max(1e-9))),
        ),
        (
            "avg switch time (ms)".into(),
            col(&|r| r.switch_ms().map_or("-".into(), |m| format!("{m:.2}"))),
        ),
        (
            "throughput (kernels/s)".into(),
            col(&|r| format!("{:.1}", r.kernels_per_s)),
        ),
        (
            "  low/med/high (kernels/s)".into(),
            col(&|r| {
                format!(
                    "{:.1}/{:.1}/{:.1}",
                    r.class_kps[0], r.class_kps[1], r.class_kps[2]
                )
            }),
        ),
        (
            "launch wall low/med/high (ms)".into(),
            col(&|r| {
                let p = |x: f64| {
                    if x.is_nan() {
                        "-".to_string()
                    } else {
                        format!("{x:.0}")
                    }
                };
                format!(
                    "{}/{}/{}",
                    p(r.launch_ms[0]),
                    p(r.launch_ms[1]),
                    p(r.launch_ms[2])
                )
            }),
        ),
        (
            "busy low/med/high (%)".into(),
            col(&|r| {
                let p = |x: f64| {
                    if x.is_nan() {
                        "-".to_string()
                    } else {
                        format!("{:.0}", 100.0 * x)
                    }
                };
                format!("{}/{}/{}", p(r.busy[0]), p(r.busy[1]), p(r.busy[2]))
            }),
        ),
        (
            "placements (window / run)".into(),
            col(&|r| format!("{} / {}", r.window.placements, r.whole.placements)),
        ),
        (
            "whole run swapped (MiB)".into(),
            col(&|r| mib((r.whole.bytes_evicted + r.whole.bytes_restored) as f64)),
        ),
        (
            "pinned (MiB)".into(),
            col(&|r| mib(r.whole.pinned_bytes as f64)),
        ),
        ("window (s)".into(), col(&|r| format!("{:.1}", r.window_s))),
        (
            "checksums".into(),
            col(&|r| {
                if r.tenants_ok == r.tenants {
                    format!("all {} ok", r.tenants)
                } else {
                    format!("{}/{} ok FAILED", r.tenants_ok, r.tenants)
                }
            }),
        ),
    ];
    if !sims.is_empty() {
        rows.push((
            "sim: bytes swapped (MiB/s)".into(),
            col(&|r| sim_of(r).map_or("-".into(), |s| mib(s.bytes_swapped() as f64 / sim_seconds))),
        ));
        rows.push((
            "sim: bytes swapped per run (MiB)".into(),
            col(&|r| {
                sim_of(r).map_or("-".into(), |s| {
                    mib(s.bytes_swapped() as f64 / s.runs.max(1) as f64)
                })
            }),
        ));
        rows.push((
            "sim: paper's shared-slot copies (MiB/s)".into(),
            col(&|r| {
                sim_of(r).map_or("-".into(), |s| {
                    mib(s.shared_slot_copies as f64 / sim_seconds)
                })
            }),
        ));
    }
    let mut out = grid(&headers, &rows);
    let real = |name: &str| runs.iter().find(|r| r.label == name);
    let simmed = |name: &str| sims.iter().find(|(a, _)| a.name() == name).map(|x| &x.1);
    for name in ["util", "size"] {
        let (Some(x), Some(base)) = (real(name), real("lls")) else {
            continue;
        };
        let _ = write!(
            out,
            "{name} vs lls: {} bytes swapped per kernel, {} per second",
            fewer(x.swapped_per_kernel(), base.swapped_per_kernel()),
            fewer(x.swapped_per_s(), base.swapped_per_s())
        );
        if let (Some(sx), Some(sb)) = (simmed(name), simmed("lls")) {
            let per_run = |r: &sim::SimReport| r.bytes_swapped() as f64 / r.runs.max(1) as f64;
            let _ = write!(
                out,
                " (simulated: {} per run; paper's count: {})",
                fewer(per_run(sx), per_run(sb)),
                fewer(sx.shared_slot_copies as f64, sb.shared_slot_copies as f64)
            );
        }
        out.push('\n');
    }
    if let Some(c) = real("control") {
        let swapped = c.whole.bytes_evicted + c.whole.bytes_restored;
        let _ = writeln!(
            out,
            "control (device holds every reservation): {} bytes swapped over the whole run{}",
            swapped,
            if swapped == 0 { "" } else { " -- EXPECTED 0" }
        );
    }
    for r in runs {
        for f in &r.failures {
            let _ = writeln!(out, "{} FAILURE: {f}", r.label);
        }
    }
    out
}

/// Runs the benchmark and returns its report, and whether every tenant's checksums matched
/// and every control run swapped nothing.
pub fn memory(o: &MemOpts) -> Result<(String, bool)> {
    if o.tenants == 0 || o.placements.is_empty() || o.mixes.is_empty() {
        bail!("nothing to run");
    }
    let buffer_bytes = (SLOT_MB * o.unit) as usize;
    let (iters, base_us, at_us) = calibrate_native(buffer_bytes, o.kernel_ms * 1000.0)
        .context("measuring the kernel natively")?;
    let mut report = String::new();
    let _ = writeln!(
        report,
        "DymGPU Table 2 on real tenants: 1 paper-MB = {} KiB, so slots and buffers of 64 paper-MB = {} MiB; Table 2's device of {SLOTS} slots = {} MiB",
        o.unit >> 10,
        (SLOT_MB * o.unit) >> 20,
        (SLOTS as u64 * SLOT_MB * o.unit) >> 20,
    );
    let _ = writeln!(
        report,
        "scheduler {}, idle_after {} s, replace_every {} s, {} s measured per run; kernel: {iters} loop iterations = {:.2} ms per launch natively ({:.2} ms without the loop)",
        o.sched,
        o.monitor.idle_threshold as f64 / 1e9,
        o.monitor.period as f64 / 1e9,
        o.seconds,
        at_us / 1000.0,
        base_us / 1000.0
    );
    if o.tenants != TABLE2_TENANTS {
        let _ = writeln!(
            report,
            "scaled down: {} tenants instead of Table 2's {TABLE2_TENANTS}, each workload proportionally, and the device's slots with the reservations (same over-subscription)",
            o.tenants
        );
    }
    eprint!("{report}");
    let mut failed = false;
    for mix in &o.mixes {
        let m = scale_mix(mix, o.tenants);
        let mut sp = specs(&m);
        let asked: f64 = sp.iter().map(|s| s.utilization).sum();
        if let Some(d) = o.demand {
            let f = d / asked;
            for s in &mut sp {
                s.target = s.utilization * f;
            }
            let line = format!(
                "utilizations scaled by {f:.4} to {:.4}/{:.4}/{:.4} (low/medium/high): the tenants together ask for {d} of the device instead of {asked:.2}, the ratios 1:5:9 kept (--demand none: unscaled)\n",
                0.1 * f,
                0.5 * f,
                0.9 * f
            );
            report += &line;
        }
        let total_mb: u64 = sp.iter().map(|s| s.mb).sum();
        let full_mb: u64 = specs(mix).iter().map(|s| s.mb).sum();
        let slots = scaled_slots(total_mb, full_mb);
        let capacity = slots as u64 * SLOT_MB * o.unit;
        let total = total_mb * o.unit;
        let head = format!(
            "\n{}: {} lightsmark (0.1), {} firefox-asteroids (0.5), {} urbanterror (0.9); reservations {} paper-MB = {} MiB on {} MiB in {slots} slots (over-commit {:.2}x, configured {})\n",
            m.name,
            m.lightsmark,
            m.firefox_asteroids,
            m.urbanterror,
            total_mb,
            total >> 20,
            capacity >> 20,
            total as f64 / capacity as f64,
            overcommit_for(total, capacity),
        );
        eprint!("{head}");
        report += &head;
        let mut runs = Vec::new();
        for &algo in &o.placements {
            eprintln!("running {} with {} tenants ...", algo, sp.len());
            let r = run_one(o, algo.name(), &sp, slots, algo, iters)?;
            eprintln!(
                "  {}: {} MiB/s swapped, {:.1} kernels/s, {}/{} checksums ok",
                algo,
                mib(r.swapped_per_s()),
                r.kernels_per_s,
                r.tenants_ok,
                r.tenants
            );
            runs.push(r);
        }
        if o.control {
            // Whole slots for every reservation, and a tenth more.
            let needed: usize = sp.iter().map(|s| s.mb.div_ceil(SLOT_MB) as usize).sum();
            let big = needed + needed.div_ceil(10);
            eprintln!("running the control ({big} slots) ...");
            let r = run_one(
                o,
                "control",
                &sp,
                big,
                PlacementAlgo::UtilizationBased,
                iters,
            )?;
            let line = format!(
                "control: util placement on {} MiB ({big} slots), holds all {} MiB\n",
                (big as u64 * SLOT_MB * o.unit) >> 20,
                total >> 20
            );
            eprint!("{line}");
            report += &line;
            runs.push(r);
        }
        let cfg = sim_config(o.unit, slots, o.seconds, o.monitor);
        let sims: Vec<(PlacementAlgo, sim::SimReport)> = o
            .placements
            .iter()
            .map(|&a| (a, sim::run(&m, a, &cfg)))
            .collect();
        let _ = writeln!(
            report,
            "simulator: same mix, {} s of 16 ms quanta, same slots, monitor and buffers",
            o.seconds
        );
        report += &mix_table(&runs, &sims, o.seconds);
        failed |= runs.iter().any(|r| !r.failures.is_empty());
        failed |= runs
            .iter()
            .any(|r| r.label == "control" && r.whole.bytes_evicted + r.whole.bytes_restored > 0);
    }
    if failed {
        let _ = writeln!(
            report,
            "router configurations and logs kept in {}",
            work_dir().display()
        );
    } else {
        let _ = std::fs::remove_dir_all(work_dir());
    }
    Ok((report, !failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_arguments_parse_with_defaults() {
        let o = TenantOpts::parse(&["--buffers", "3", "--size=4096"]).unwrap();
        assert_eq!(
            (o.buffers, o.size, o.rounds, o.seconds),
            (3, 4096, Some(4), None)
        );
        assert_eq!(o.utilization, 1.0);

        let o = TenantOpts::parse(&[
            "--buffers",
            "2",
            "--size",
            "8",
            "--seconds",
            "1.5",
            "--utilization",
            "0.5",
            "--kernel-us",
            "500",
            "--seed",
            "7",
        ])
        .unwrap();
        assert_eq!((o.rounds, o.seconds, o.seed), (None, Some(1.5), 7));
        assert_eq!((o.utilization, o.kernel_us), (0.5, Some(500.0)));

        for bad in [
            &["--buffers", "1"][..],
            &["--buffers", "1", "--size", "6"],
            &["--buffers", "0", "--size", "4"],
            &["--buffers", "1", "--size", "4", "--utilization", "0"],
            &["--buffers", "1", "--size", "4", "--bogus", "1"],
        ] {
            assert!(TenantOpts::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn verification_finds_the_first_wrong_element() {
        let mut host: Vec<u32> = (0..100)
            .map(|j| pattern(5, 2, j).wrapping_add(77))
            .collect();
        assert_eq!(verify(5, 2, 77, &host), None);

        host[42] ^= 1;

        let m = verify(5, 2, 77, &host).unwrap();
        assert_eq!((m.buffer, m.element), (2, 42));
        assert_eq!(m.want, pattern(5, 2, 42).wrapping_add(77));
        assert_ne!(pattern(5, 2, 0), pattern(5, 3, 0), "buffers differ");
    }

    #[test]
    fn the_order_is_a_seeded_permutation() {
        let a = order(1, 0, 16);
        let mut sorted = a.clone();
        sorted.sort_unstable();

        assert_eq!(sorted, (0..16).collect::<Vec<_>>());
        assert_eq!(a, order(1, 0, 16));
        assert_ne!(a, order(1, 1, 16));
    }

    #[test]
    fn report_lines_have_the_promised_form() {
        let mut r = TenantReport {
            buffers: 2,
            size: 8,
            kernels: 9,
            verified_bytes: 24,
            seconds: 1.234,
            busy_seconds: 0.5,
            mismatch: None,
        };
        assert_eq!(
            r.last_line(),
            "checksums ok: 2 buffers, 16 bytes, 9 kernels, 1.23 s"
        );
        let n = parse_json_line(&r.json()).unwrap();
        assert_eq!((n.kernels, n.verified_bytes), (9, 24));
        assert!((n.busy_seconds - 0.5).abs() < 1e-9);

        r.mismatch = Some(Mismatch {
            buffer: 1,
            element: 3,
            got: 4,
            want: 5,
        });
        assert_eq!(
            r.last_line(),
            "checksum MISMATCH: buffer 1 element 3: got 4 want 5"
        );
        assert_eq!(parse_json_line("checksums ok"), None);
    }

    #[test]
    fn mixes_scale_proportionally() {
        let set4 = mix_by_name("set4").unwrap();

        assert_eq!(scale_mix(&set4, 15), set4);
        let ten = scale_mix(&set4, 10);
        assert_eq!(
            (ten.lightsmark, ten.firefox_asteroids, ten.urbanterror),
            (4, 2, 4)
        );
        let five = scale_mix(&set4, 5);
        assert_eq!(
            (five.lightsmark, five.firefox_asteroids, five.urbanterror),
            (2, 1, 2)
        );
        for n in 1..=15 {
            let m = scale_mix(&mix_by_name("set1").unwrap(), n);
            assert_eq!(m.lightsmark + m.firefox_asteroids + m.urbanterror, n);
        }
        assert_eq!(scaled_slots(10_560, 10_560), 60);
        // set4 at 5 tenants reserves 2560 paper-MB: 14.5 slots keep the 2.75x of the full mix.
        assert_eq!(scaled_slots(2_560, 10_560), 15);
    }

    #[test]
    fn specs_follow_the_simulators_rotation() {
        let sp = specs(&mix_by_name("set4").unwrap());

        assert_eq!(sp.len(), 15);
        assert_eq!(sp.iter().map(|s| s.mb).sum::<u64>(), 10_560);
        assert_eq!((sp[0].workload, sp[0].mb), (sim::LIGHTSMARK.name, 384));
        assert_eq!((sp[3].workload, sp[3].mb), (sim::LIGHTSMARK.name, 704));
        assert_eq!(buffers_of(704), vec![64; 11]);
        assert_eq!(buffers_of(100), vec![64, 36]);
        // 10560 paper-MB on 3840: 2.75, configured 3.
        assert_eq!(overcommit_for(10_560, 3_840), 3.0);
        assert_eq!(overcommit_for(100, 3_840), 1.5);
    }

    #[test]
    fn router_configuration_parses() {
        let text = router_toml(
            Path::new("/tmp/x.sock"),
            "rr",
            240 << 20,
            3.0,
            60,
            PlacementAlgo::SizeBased,
            MonitorConfig {
                idle_threshold: 10_000_000_000,
                period: 2_500_000_000,
            },
        );
        let cfg = hira_router::Config::parse(&text).unwrap();

        assert_eq!(cfg.memory.capacity, Some(240 << 20));
        assert_eq!(cfg.memory.slots, 60);
        assert_eq!(cfg.memory.placement, PlacementAlgo::SizeBased);
        assert_eq!(cfg.memory.overcommit, 3.0);
        assert_eq!(cfg.scheduler.policy, "rr");
        assert_eq!(cfg.memory.idle_after, Duration::from_secs(10));
        assert_eq!(cfg.memory.replace_every, Duration::from_millis(2500));
    }

    #[test]
    fn grid_aligns_columns_and_fewer_reads_naturally() {
        let g = grid(
            &["lls".into(), "util".into()],
            &[
                ("a".into(), vec!["1.0".into(), "22.5".into()]),
                ("longer".into(), vec!["100".into(), "2".into()]),
            ],
        );
        let lines: Vec<&str> = g.lines().collect();

        assert_eq!(lines[0], "        lls  util");
        assert_eq!(lines[1], "a       1.0  22.5");
        assert_eq!(lines[2], "longer  100     2");
        assert_eq!(fewer(60.0, 100.0), "40% fewer");
        assert_eq!(fewer(120.0, 100.0), "20% more");
        assert_eq!(fewer(f64::NAN, 100.0), "n/a");
    }

    fn result(label: &str, bytes: u64, kernels_per_s: f64, ok: usize) -> RunResult {
        RunResult {
            label: label.into(),
            window_s: 10.0,
            window: SwapTotals {
                bytes_evicted: bytes / 2,
                bytes_restored: bytes / 2,
                swaps: 10,
                evict_ns: 20_000_000,
                restore_ns: 10_000_000,
                ..SwapTotals::default()
            },
            whole: SwapTotals::default(),
            kernels_per_s,
            tenants_ok: ok,
            tenants: 15,
            busy: [0.1, 0.5, f64::NAN],
            launch_ms: [1.0, 2.0, 3.0],
            class_kps: [1.0, 2.0, 3.0],
            failures: if ok < 15 {
                vec!["tenant 3: exit status: 1: checksum MISMATCH".into()]
            } else {
                Vec::new()
            },
        }
    }

    #[test]
    fn the_mix_table_puts_algorithms_side_by_side_and_shows_failures() {
        // lls: 100 MiB over 10 s at 10 kernels/s; util: 40 MiB at 8 kernels/s.
        let runs = [
            result("lls", 100 << 20, 10.0, 15),
            result("util", 40 << 20, 8.0, 14),
        ];

        let t = mix_table(&runs, &[], 10.0);

        let header = t.lines().next().unwrap();
        assert!(header.trim_start().starts_with("lls") && header.ends_with("util"));
        assert!(t.contains("bytes swapped (MiB/s)"));
        assert!(t.contains("avg switch time (ms)"));
        assert!(t.contains("all 15 ok") && t.contains("14/15 ok FAILED"));
        // Per kernel: 1.0 MiB against 0.5 MiB; per second: 10 against 4 MiB/s.
        assert!(
            t.contains("util vs lls: 50% fewer bytes swapped per kernel, 60% fewer per second"),
            "{t}"
        );
        assert!(t.contains("util FAILURE: tenant 3"));
        assert!(runs[0].switch_ms().is_some_and(|m| (m - 3.0).abs() < 1e-9));
    }
}
