//! `hira bench`: the remoting overhead, measured natively and through hira in one run.
//! [`worker`] runs the workload against whatever OpenCL the ICD loader finds (the host's, or
//! hira's when started under `hira run`); [`compare`] runs it both ways and prints the ratio.

pub mod fair;
pub mod mem;

use anyhow::{Context, Result};
use hira_server::Api;
use std::ffi::c_void;
use std::fmt;
use std::time::Instant;

const CL_DEVICE_TYPE_CPU: u64 = 1 << 1;
const CL_DEVICE_TYPE_GPU: u64 = 1 << 2;
const CL_DEVICE_TYPE_ACCELERATOR: u64 = 1 << 3;
const CL_DEVICE_NOT_FOUND: i32 = -1;
const CL_DEVICE_NAME: u32 = 0x102B;
const CL_DEVICE_GLOBAL_MEM_SIZE: u32 = 0x101F;

/// One measured quantity.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub name: String,
    pub value: f64,
    pub unit: &'static str,
    /// Higher is better (bandwidth) rather than lower (latency).
    pub higher_better: bool,
}

struct Cl {
    api: &'static Api,
    ctx: *mut c_void,
    queue: *mut c_void,
    device: *mut c_void,
}

/// An OpenCL call that failed.
#[derive(Debug)]
pub(crate) struct ClError {
    pub(crate) call: &'static str,
    pub(crate) code: i32,
}

impl fmt::Display for ClError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} returned {}", self.call, self.code)?;
        if let Some(name) = cl_error_name(self.code) {
            write!(f, " ({name})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ClError {}

fn cl_error_name(code: i32) -> Option<&'static str> {
    Some(match code {
        -1 => "CL_DEVICE_NOT_FOUND",
        -2 => "CL_DEVICE_NOT_AVAILABLE",
        -4 => "CL_MEM_OBJECT_ALLOCATION_FAILURE",
        -5 => "CL_OUT_OF_RESOURCES",
        -6 => "CL_OUT_OF_HOST_MEMORY",
        -11 => "CL_BUILD_PROGRAM_FAILURE",
        -14 => "CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST",
        -30 => "CL_INVALID_VALUE",
        -33 => "CL_INVALID_DEVICE",
        -34 => "CL_INVALID_CONTEXT",
        -36 => "CL_INVALID_COMMAND_QUEUE",
        -38 => "CL_INVALID_MEM_OBJECT",
        -48 => "CL_INVALID_KERNEL",
        -51 => "CL_INVALID_ARG_SIZE",
        -52 => "CL_INVALID_KERNEL_ARGS",
        -54 => "CL_INVALID_WORK_GROUP_SIZE",
        -59 => "CL_INVALID_OPERATION",
        -61 => "CL_INVALID_BUFFER_SIZE",
        -1001 => "CL_PLATFORM_NOT_FOUND_KHR",
        _ => return None,
    })
}

/// `Ok` for CL_SUCCESS, else the call's [`ClError`].
fn check(call: &'static str, code: i32) -> Result<()> {
    if code != 0 {
        return Err(ClError { call, code }.into());
    }
    Ok(())
}

/// A context and in-order queue on the first GPU, accelerator or CPU device of the first
/// platform.
fn setup() -> Result<Cl> {
    // SAFETY: loading the system ICD loader.
    let lib =
        unsafe { libloading::Library::new("libOpenCL.so.1") }.context("loading libOpenCL.so.1")?;
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    let api: &'static Api = Box::leak(Box::new(Api::load(lib)));
    let mut platform = std::ptr::null_mut();
    let mut device = std::ptr::null_mut();
    let mut err = 0;
    // SAFETY: out-pointers are live locals; counts match.
    unsafe {
        check(
            "clGetPlatformIDs",
            api.clGetPlatformIDs.context("clGetPlatformIDs missing")?(
                1,
                &mut platform,
                std::ptr::null_mut(),
            ),
        )?;
        let get = api.clGetDeviceIDs.context("clGetDeviceIDs missing")?;
        let mut found = false;
        for ty in [
            CL_DEVICE_TYPE_GPU,
            CL_DEVICE_TYPE_ACCELERATOR,
            CL_DEVICE_TYPE_CPU,
        ] {
            match get(platform, ty, 1, &mut device, std::ptr::null_mut()) {
                0 => {
                    found = true;
                    break;
                }
                CL_DEVICE_NOT_FOUND => continue,
                code => check("clGetDeviceIDs", code)?,
            }
        }
        if !found {
            check("clGetDeviceIDs", CL_DEVICE_NOT_FOUND)?;
        }
        let ctx = api.clCreateContext.context("clCreateContext missing")?(
            std::ptr::null(),
            1,
            &device,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut err,
        );
        check("clCreateContext", err)?;
        let queue = api
            .clCreateCommandQueue
            .context("clCreateCommandQueue missing")?(ctx, device, 0, &mut err);
        check("clCreateCommandQueue", err)?;
        Ok(Cl {
            api,
            ctx,
            queue,
            device,
        })
    }
}

impl Cl {
    /// Enqueues `kernel` (its arguments set) over `global` work items in one dimension;
    /// `event` is null or receives the launch's event.
    fn launch_1d(&self, kernel: *mut c_void, global: usize, event: *mut *mut c_void) -> Result<()> {
        // SAFETY: a kernel of this context with its arguments set; one dimension, no wait
        // list; `event` is null or writable (caller).
        check("clEnqueueNDRangeKernel", unsafe {
            self.api.clEnqueueNDRangeKernel.context("missing")?(
                self.queue,
                kernel,
                1,
                std::ptr::null(),
                &global,
                std::ptr::null(),
                0,
                std::ptr::null(),
                event,
            )
        })
    }

    /// Waits for everything enqueued on the queue.
    fn finish(&self) -> Result<()> {
        // SAFETY: a live queue.
        check("clFinish", unsafe {
            self.api.clFinish.context("missing")?(self.queue)
        })
    }

    /// A new buffer of `bytes`, set as argument 0 of `kernel`.
    fn buffer_arg0(&self, kernel: *mut c_void, bytes: usize) -> Result<()> {
        let api = self.api;
        let mut err = 0;
        // SAFETY: a plain buffer; the argument is the cl_mem value, pointer-sized.
        unsafe {
            let buf = api.clCreateBuffer.context("missing")?(
                self.ctx,
                1,
                bytes,
                std::ptr::null_mut(),
                &mut err,
            );
            check("clCreateBuffer", err)?;
            let set = api.clSetKernelArg.context("missing")?;
            check(
                "clSetKernelArg",
                set(
                    kernel,
                    0,
                    std::mem::size_of::<*mut c_void>(),
                    &buf as *const *mut c_void as *const c_void,
                ),
            )
        }
    }

    /// Build `src` (NUL-terminated OpenCL C) and create its kernel `name`.
    fn kernel(&self, src: &[u8], name: &std::ffi::CStr) -> Result<*mut c_void> {
        let api = self.api;
        let mut err = 0;
        let p = src.as_ptr();
        // SAFETY: one NUL-terminated source; outputs are live locals.
        unsafe {
            let prog = api.clCreateProgramWithSource.context("missing")?(
                self.ctx,
                1,
                &p as *const *const u8 as *mut *mut i8,
                std::ptr::null(),
                &mut err,
            );
            check("clCreateProgramWithSource", err)?;
            let build = api.clBuildProgram.context("missing")?;
            check(
                "clBuildProgram",
                build(
                    prog,
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                ),
            )?;
            let k = api.clCreateKernel.context("missing")?(prog, name.as_ptr(), &mut err);
            check("clCreateKernel", err)?;
            Ok(k)
        }
    }
}

/// `n` calls of clGetDeviceInfo(`param`, up to 256 bytes), µs per call.
fn device_info_loop(cl: &Cl, n: u32, param: u32, name: &str) -> Result<Row> {
    let f = cl.api.clGetDeviceInfo.context("clGetDeviceInfo missing")?;
    let mut value = [0u8; 256];
    let t = Instant::now();
    for _ in 0..n {
        // SAFETY: 256-byte output.
        check("clGetDeviceInfo", unsafe {
            f(
                cl.device,
                param,
                256,
                value.as_mut_ptr() as *mut c_void,
                std::ptr::null_mut(),
            )
        })?;
    }
    Ok(Row {
        name: name.into(),
        value: t.elapsed().as_secs_f64() * 1e6 / n as f64,
        unit: "us/call",
        higher_better: false,
    })
}

/// A synchronous call that must reach the device: CL_DEVICE_GLOBAL_MEM_SIZE (hira reports
/// the tenant's quota there, which may change, so the guest never keeps the answer).
fn sync_call(cl: &Cl, n: u32) -> Result<Row> {
    device_info_loop(
        cl,
        n,
        CL_DEVICE_GLOBAL_MEM_SIZE,
        "sync call (clGetDeviceInfo GLOBAL_MEM_SIZE)",
    )
}

/// An info query whose answer cannot change (CL_DEVICE_NAME): the guest keeps it after the
/// first call.
fn kept_info(cl: &Cl, n: u32) -> Result<Row> {
    device_info_loop(
        cl,
        n,
        CL_DEVICE_NAME,
        "info query kept by the guest (DEVICE_NAME)",
    )
}

fn async_stream(cl: &Cl, n: u32) -> Result<Row> {
    let api = cl.api;
    let kernel = cl.kernel(b"__kernel void k(int a) { }\0", c"k")?;
    let set = api.clSetKernelArg.context("missing")?;
    let nd = api.clEnqueueNDRangeKernel.context("missing")?;
    let finish = api.clFinish.context("missing")?;
    let global = 1usize;
    let t = Instant::now();
    for i in 0..n {
        let a = i as i32;
        // SAFETY: a 4-byte argument; one work item; no events.
        unsafe {
            check(
                "clSetKernelArg",
                set(kernel, 0, 4, &a as *const i32 as *const c_void),
            )?;
            check(
                "clEnqueueNDRangeKernel",
                nd(
                    cl.queue,
                    kernel,
                    1,
                    std::ptr::null(),
                    &global,
                    std::ptr::null(),
                    0,
                    std::ptr::null(),
                    std::ptr::null_mut(),
                ),
            )?;
        }
    }
    // SAFETY: a live queue.
    check("clFinish", unsafe { finish(cl.queue) })?;
    let per = t.elapsed().as_secs_f64() * 1e6 / (2.0 * n as f64);
    Ok(Row {
        name: format!("async call (SetKernelArg+NDRange, {n}x2)"),
        value: per,
        unit: "us/call",
        higher_better: false,
    })
}

/// Launches of an empty kernel, each with an event, `depth` of them outstanding: the
/// application waits for the oldest and releases it before the next launch (depth 1: a
/// launch and its wait, one after the other).
fn launch_waits(cl: &Cl, n: u32, depth: usize) -> Result<Row> {
    let api = cl.api;
    let kernel = cl.kernel(b"__kernel void k(int a) { }\0", c"k")?;
    let set = api.clSetKernelArg.context("missing")?;
    let wait = api.clWaitForEvents.context("missing")?;
    let release = api.clReleaseEvent.context("missing")?;
    let mut pending = std::collections::VecDeque::new();
    let wait_oldest = |pending: &mut std::collections::VecDeque<*mut c_void>| -> Result<()> {
        let ev = pending.pop_front().context("an outstanding launch")?;
        // SAFETY: a live event of ours, released exactly once here.
        unsafe {
            check("clWaitForEvents", wait(1, &ev))?;
            release(ev);
        }
        Ok(())
    };
    let t = Instant::now();
    for i in 0..n {
        let a = i as i32;
        let mut ev = std::ptr::null_mut();
        // SAFETY: a 4-byte argument of a live kernel.
        check("clSetKernelArg", unsafe {
            set(kernel, 0, 4, &a as *const i32 as *const c_void)
        })?;
        cl.launch_1d(kernel, 1, &mut ev)?;
        pending.push_back(ev);
        if pending.len() >= depth {
            wait_oldest(&mut pending)?;
        }
    }
    while !pending.is_empty() {
        wait_oldest(&mut pending)?;
    }
    let per = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    Ok(Row {
        name: if depth == 1 {
            format!("launch + wait, empty kernel ({n}x)")
        } else {
            format!("launches, {depth} queued, wait oldest ({n}x)")
        },
        value: per,
        unit: "us/kernel",
        higher_better: false,
    })
}

fn bandwidth(cl: &Cl, size: usize, write: bool) -> Result<Row> {
    let api = cl.api;
    let mut err = 0;
    // SAFETY: a plain buffer of `size` bytes.
    let buf = unsafe {
        api.clCreateBuffer.context("missing")?(cl.ctx, 1, size, std::ptr::null_mut(), &mut err)
    };
    check("clCreateBuffer", err)?;
    let mut host = vec![1u8; size];
    let reps = ((256usize << 20) / size).clamp(3, 2000);
    let wr = api.clEnqueueWriteBuffer.context("missing")?;
    let rd = api.clEnqueueReadBuffer.context("missing")?;
    let run = |host: &mut Vec<u8>| -> Result<()> {
        // SAFETY: host has `size` bytes; blocking transfer.
        unsafe {
            if write {
                check(
                    "write",
                    wr(
                        cl.queue,
                        buf,
                        1,
                        0,
                        size,
                        host.as_ptr() as *const c_void,
                        0,
                        std::ptr::null(),
                        std::ptr::null_mut(),
                    ),
                )
            } else {
                check(
                    "read",
                    rd(
                        cl.queue,
                        buf,
                        1,
                        0,
                        size,
                        host.as_mut_ptr() as *mut c_void,
                        0,
                        std::ptr::null(),
                        std::ptr::null_mut(),
                    ),
                )
            }
        }
    };
    run(&mut host)?; // warm: first touch of every page on both sides
    let t = Instant::now();
    for _ in 0..reps {
        run(&mut host)?;
    }
    let gbs = (size * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
    // SAFETY: releasing our buffer.
    unsafe { api.clReleaseMemObject.context("missing")?(buf) };
    let label = if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    };
    Ok(Row {
        name: format!("{} {label}", if write { "write" } else { "read" }),
        value: gbs,
        unit: "GB/s",
        higher_better: true,
    })
}

/// Run the workload on whatever OpenCL the loader finds.
pub fn worker(quick: bool) -> Result<Vec<Row>> {
    let cl = setup()?;
    let mut rows = vec![
        sync_call(&cl, if quick { 2000 } else { 20000 })?,
        kept_info(&cl, if quick { 2000 } else { 20000 })?,
        async_stream(&cl, if quick { 10_000 } else { 100_000 })?,
        launch_waits(&cl, if quick { 2000 } else { 20000 }, 1)?,
        launch_waits(&cl, if quick { 2000 } else { 20000 }, 3)?,
    ];
    let sizes: &[usize] = if quick {
        &[4 << 10, 1 << 20, 16 << 20]
    } else {
        &[4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
    };
    for &s in sizes {
        rows.push(bandwidth(&cl, s, true)?);
        rows.push(bandwidth(&cl, s, false)?);
    }
    Ok(rows)
}

/// Rows as lines `name\tvalue\tunit\thigher` (the worker's output).
pub fn encode(rows: &[Row]) -> String {
    rows.iter()
        .map(|r| format!("{}\t{}\t{}\t{}\n", r.name, r.value, r.unit, r.higher_better))
        .collect()
}

/// Parse a worker's output.
pub fn decode(s: &str) -> Vec<Row> {
    s.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            let unit = match *f.get(2)? {
                "us/call" => "us/call",
                "us/kernel" => "us/kernel",
                "GB/s" => "GB/s",
                _ => return None,
            };
            Some(Row {
                name: f[0].into(),
                value: f.get(1)?.parse().ok()?,
                unit,
                higher_better: *f.get(3)? == "true",
            })
        })
        .collect()
}

/// The side-by-side table; ratio is hira relative to native (hira/native for bandwidth,
/// native/hira for latency, so 1.0 means no overhead and lower is worse).
pub fn table(native: &[Row], hira: &[Row]) -> String {
    let mut s = format!(
        "{:<44} {:>12} {:>12} {:>8}  {}\n",
        "measurement", "native", "hira", "ratio", "unit"
    );
    for n in native {
        let Some(h) = hira.iter().find(|h| h.name == n.name) else {
            continue;
        };
        let ratio = if n.higher_better {
            h.value / n.value
        } else {
            n.value / h.value
        };
        s += &format!(
            "{:<44} {:>12.3} {:>12.3} {:>8.2}  {}\n",
            n.name, n.value, h.value, ratio, n.unit
        );
    }
    s
}

/// The side-by-side table over several rounds: per measurement the median of the rounds for
/// native and for hira, the ratio of the medians, and the lowest and highest ratio within a
/// round (the machine's speed drifts; a round runs native and hira back to back).
pub fn table_rounds(native: &[Vec<Row>], hira: &[Vec<Row>]) -> String {
    let Some(first) = native.first() else {
        return String::new();
    };
    let mut s = format!(
        "{:<44} {:>12} {:>12} {:>8} {:>13}  {}\n",
        "measurement", "native", "hira", "ratio", "round ratios", "unit"
    );
    let ratio = |n: f64, h: f64, higher_better: bool| if higher_better { h / n } else { n / h };
    for row in first {
        let value = |rounds: &[Vec<Row>]| -> Vec<f64> {
            rounds
                .iter()
                .filter_map(|r| r.iter().find(|x| x.name == row.name).map(|x| x.value))
                .collect()
        };
        let (n, h) = (value(native), value(hira));
        if n.is_empty() || n.len() != h.len() {
            continue;
        }
        let per: Vec<f64> = n
            .iter()
            .zip(&h)
            .map(|(&a, &b)| ratio(a, b, row.higher_better))
            .collect();
        let lo = per.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = per.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let (mn, mh) = (median(&n), median(&h));
        s += &format!(
            "{:<44} {:>12.3} {:>12.3} {:>8.2} {:>13}  {}\n",
            row.name,
            mn,
            mh,
            ratio(mn, mh, row.higher_better),
            format!("{lo:.2}–{hi:.2}"),
            row.unit
        );
    }
    s
}

/// The median (the mean of the middle two for an even count; NaN for none).
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_take_medians_and_show_the_spread() {
        let row = |v: f64| {
            vec![Row {
                name: "sync".into(),
                value: v,
                unit: "us/call",
                higher_better: false,
            }]
        };
        let native = vec![row(1.0), row(1.0), row(1.0)];
        let hira = vec![row(2.0), row(4.0), row(5.0)];

        let t = table_rounds(&native, &hira);

        assert!(t.contains(" 4.000 "), "{t}");
        assert!(t.contains("0.20–0.50"), "{t}");
    }

    #[test]
    fn rows_round_trip_through_the_worker_format() {
        let rows = vec![Row {
            name: "write 4 KiB".into(),
            value: 1.5,
            unit: "GB/s",
            higher_better: true,
        }];

        assert_eq!(decode(&encode(&rows)), rows);
    }

    #[test]
    fn ratio_is_relative_to_native() {
        let native = vec![Row {
            name: "x".into(),
            value: 10.0,
            unit: "us/call",
            higher_better: false,
        }];
        let hira = vec![Row {
            name: "x".into(),
            value: 20.0,
            unit: "us/call",
            higher_better: false,
        }];

        assert!(table(&native, &hira).contains("0.50"));
    }
}
