//! Deterministic OpenCL program using the `opencl3` crate.
//!
//! Every line printed to stdout must be identical natively and under
//! `hira run --`, so only stable properties and checksums are printed.

use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use opencl3::command_queue::{CommandQueue, CL_QUEUE_PROFILING_ENABLE};
use opencl3::context::Context;
use opencl3::device::{Device, CL_DEVICE_TYPE_ALL, CL_DEVICE_TYPE_CPU, CL_DEVICE_TYPE_GPU};
use opencl3::event::Event;
use opencl3::kernel::{ExecuteKernel, Kernel};
use opencl3::memory::{Buffer, CL_MEM_READ_ONLY, CL_MEM_READ_WRITE, CL_MEM_WRITE_ONLY};
use opencl3::platform::get_platforms;
use opencl3::program::Program;
use opencl3::types::{cl_event, cl_float, cl_int, cl_uint, CL_BLOCKING, CL_NON_BLOCKING};
use opencl3::Result;

const SRC: &str = r#"
kernel void saxpy(global float *z, global const float *x, global const float *y, float a) {
    size_t i = get_global_id(0);
    z[i] = a * x[i] + y[i];
}
kernel void square_plus(global const float *in, global uint *out, uint k) {
    size_t i = get_global_id(0);
    float v = in[i];
    out[i] = (uint)(v * v) + k * (uint)i;
}
kernel void block_sum(global const uint *in, global uint *out, local uint *scratch) {
    size_t lid = get_local_id(0);
    scratch[lid] = in[get_global_id(0)];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (size_t s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (lid < s) scratch[lid] += scratch[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) out[get_group_id(0)] = scratch[0];
}
"#;

const N: usize = 1 << 15;
const LOCAL: usize = 64;

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

fn as_bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (f32/u32) reinterpreted as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

static CALLBACK_RUNS: AtomicUsize = AtomicUsize::new(0);
static CALLBACK_STATUS: AtomicI32 = AtomicI32::new(99);

extern "C" fn on_complete(_ev: cl_event, status: cl_int, _user: *mut c_void) {
    CALLBACK_STATUS.store(status, Ordering::SeqCst);
    CALLBACK_RUNS.fetch_add(1, Ordering::SeqCst);
}

fn monotone(ev: &Event) -> Result<bool> {
    let q = ev.profiling_command_queued()?;
    let s = ev.profiling_command_submit()?;
    let b = ev.profiling_command_start()?;
    let e = ev.profiling_command_end()?;
    Ok(q <= s && s <= b && b <= e)
}

fn type_name(t: u64) -> &'static str {
    if t & CL_DEVICE_TYPE_CPU != 0 {
        "CPU"
    } else if t & CL_DEVICE_TYPE_GPU != 0 {
        "GPU"
    } else {
        "OTHER"
    }
}

fn main() -> Result<()> {
    let platforms = get_platforms()?;
    println!("platforms: {}", platforms.len());
    let platform = &platforms[0];
    println!("platform name: {}", platform.name()?);
    println!("platform vendor: {}", platform.vendor()?);
    println!("platform version: {}", platform.version()?);
    let device_ids = platform.get_devices(CL_DEVICE_TYPE_ALL)?;
    println!("devices: {}", device_ids.len());
    let device = Device::new(device_ids[0]);
    println!("device name: {}", device.name()?);
    println!("device vendor: {}", device.vendor()?);
    println!("device version: {}", device.version()?);
    println!("device type: {}", type_name(device.dev_type()?));
    println!("device compute units: {}", device.max_compute_units()?);
    println!("device global mem: {}", device.global_mem_size()?);
    println!("device max alloc: {}", device.max_mem_alloc_size()?);

    let context = Context::from_device(&device)?;
    #[allow(deprecated)]
    let queue = CommandQueue::create_default(&context, CL_QUEUE_PROFILING_ENABLE)?;
    let program = Program::create_and_build_from_source(&context, SRC, "")
        .unwrap_or_else(|log| panic!("build failed: {log}"));
    let saxpy = Kernel::create(&program, "saxpy")?;
    let square = Kernel::create(&program, "square_plus")?;
    let block_sum = Kernel::create(&program, "block_sum")?;
    println!("kernels: {} {} {}", saxpy.function_name()?, square.function_name()?, block_sum.function_name()?);

    // ---- SAXPY
    let xs: Vec<cl_float> = (0..N).map(|i| (i % 97) as cl_float).collect();
    let ys: Vec<cl_float> = (0..N).map(|i| (i % 13) as cl_float * 0.25).collect();
    let a: cl_float = 3.0;
    // SAFETY: buffers are created with a null host pointer and valid sizes.
    let (mut x, mut y, z) = unsafe {
        (
            Buffer::<cl_float>::create(&context, CL_MEM_READ_ONLY, N, ptr::null_mut())?,
            Buffer::<cl_float>::create(&context, CL_MEM_READ_ONLY, N, ptr::null_mut())?,
            Buffer::<cl_float>::create(&context, CL_MEM_READ_WRITE, N, ptr::null_mut())?,
        )
    };
    // SAFETY: host slices outlive the (blocking / waited-on) transfers.
    let wx = unsafe { queue.enqueue_write_buffer(&mut x, CL_BLOCKING, 0, &xs, &[])? };
    let wy = unsafe { queue.enqueue_write_buffer(&mut y, CL_NON_BLOCKING, 0, &ys, &[])? };
    // SAFETY: argument types match the kernel signature.
    let k1 = unsafe {
        ExecuteKernel::new(&saxpy)
            .set_arg(&z)
            .set_arg(&x)
            .set_arg(&y)
            .set_arg(&a)
            .set_global_work_size(N)
            .set_wait_event(&wy)
            .enqueue_nd_range(&queue)?
    };
    k1.set_callback(opencl3::event::CL_COMPLETE, on_complete, ptr::null_mut())?;
    let mut zs = vec![0.0 as cl_float; N];
    // SAFETY: zs outlives the read, which is waited on below.
    let rz = unsafe { queue.enqueue_read_buffer(&z, CL_NON_BLOCKING, 0, &mut zs, &[k1.get()])? };
    rz.wait()?;
    let ok = (0..N).all(|i| zs[i] == a * xs[i] + ys[i]);
    println!("saxpy: correct={} checksum={:016x}", ok, fnv1a(as_bytes(&zs)));

    // ---- second kernel chained on the first with events, then a local-memory reduction
    // SAFETY: null host pointer, valid sizes.
    let (sq, sums) = unsafe {
        (
            Buffer::<cl_uint>::create(&context, CL_MEM_READ_WRITE, N, ptr::null_mut())?,
            Buffer::<cl_uint>::create(&context, CL_MEM_WRITE_ONLY, N / LOCAL, ptr::null_mut())?,
        )
    };
    let k: cl_uint = 7;
    // SAFETY: argument types match the kernel signatures.
    let k2 = unsafe {
        ExecuteKernel::new(&square)
            .set_arg(&z)
            .set_arg(&sq)
            .set_arg(&k)
            .set_global_work_size(N)
            .set_wait_event(&k1)
            .enqueue_nd_range(&queue)?
    };
    // SAFETY: as above; local buffer size is LOCAL u32s.
    let k3 = unsafe {
        ExecuteKernel::new(&block_sum)
            .set_arg(&sq)
            .set_arg(&sums)
            .set_arg_local_buffer(LOCAL * std::mem::size_of::<cl_uint>())
            .set_global_work_size(N)
            .set_local_work_size(LOCAL)
            .set_wait_event(&k2)
            .enqueue_nd_range(&queue)?
    };
    let mut sq_host = vec![0 as cl_uint; N];
    let mut sums_host = vec![0 as cl_uint; N / LOCAL];
    // SAFETY: host vectors outlive the blocking reads.
    unsafe {
        queue.enqueue_read_buffer(&sq, CL_NON_BLOCKING, 0, &mut sq_host, &[k2.get()])?;
        queue.enqueue_read_buffer(&sums, CL_BLOCKING, 0, &mut sums_host, &[k3.get()])?;
    }
    queue.finish()?;
    let expect_sq: Vec<cl_uint> = (0..N)
        .map(|i| ((zs[i] * zs[i]) as cl_uint).wrapping_add(k.wrapping_mul(i as cl_uint)))
        .collect();
    println!(
        "square_plus: correct={} checksum={:016x}",
        sq_host == expect_sq,
        fnv1a(as_bytes(&sq_host))
    );
    let dev_total = sums_host.iter().fold(0u32, |acc, v| acc.wrapping_add(*v));
    let host_total = expect_sq.iter().fold(0u32, |acc, v| acc.wrapping_add(*v));
    println!("block_sum: groups={} total={} match={}", sums_host.len(), dev_total, dev_total == host_total);

    // ---- events: status, type, profiling monotonicity, callback
    for (name, ev) in [("write_x", &wx), ("write_y", &wy), ("saxpy", &k1), ("square", &k2), ("block_sum", &k3), ("read_z", &rz)] {
        println!(
            "event {name}: status={} type={:#x} profiling_monotone={}",
            ev.command_execution_status()?.0,
            ev.command_type()?.0,
            monotone(ev)?
        );
    }
    let chained = k2.profiling_command_start()? >= k1.profiling_command_end()?
        && k3.profiling_command_start()? >= k2.profiling_command_end()?;
    println!("dependent kernels ordered: {chained}");
    let mut waited = 0;
    while CALLBACK_RUNS.load(Ordering::SeqCst) == 0 && waited < 1000 {
        std::thread::sleep(std::time::Duration::from_millis(10));
        waited += 1;
    }
    println!(
        "event callback: runs={} status={}",
        CALLBACK_RUNS.load(Ordering::SeqCst),
        CALLBACK_STATUS.load(Ordering::SeqCst)
    );

    // ---- two threads with their own queues sharing the context and program
    let results: Vec<(usize, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2usize)
            .map(|t| {
                let context = &context;
                let program = &program;
                s.spawn(move || -> Result<(usize, u64)> {
                    #[allow(deprecated)]
                    let q = CommandQueue::create_default(context, 0)?;
                    let kern = Kernel::create(program, "saxpy")?;
                    let n = 2048usize;
                    let xs: Vec<cl_float> = (0..n).map(|i| (i + t) as cl_float).collect();
                    let mut acc: Vec<cl_float> = vec![1.0; n];
                    // SAFETY: null host pointer, valid sizes.
                    let (mut bx, mut bacc, bout) = unsafe {
                        (
                            Buffer::<cl_float>::create(context, CL_MEM_READ_ONLY, n, ptr::null_mut())?,
                            Buffer::<cl_float>::create(context, CL_MEM_READ_WRITE, n, ptr::null_mut())?,
                            Buffer::<cl_float>::create(context, CL_MEM_READ_WRITE, n, ptr::null_mut())?,
                        )
                    };
                    let alpha: cl_float = 0.5 + t as cl_float;
                    for _ in 0..10 {
                        // SAFETY: host data outlives blocking transfers; arg types match.
                        unsafe {
                            q.enqueue_write_buffer(&mut bx, CL_BLOCKING, 0, &xs, &[])?;
                            q.enqueue_write_buffer(&mut bacc, CL_BLOCKING, 0, &acc, &[])?;
                            ExecuteKernel::new(&kern)
                                .set_arg(&bout)
                                .set_arg(&bx)
                                .set_arg(&bacc)
                                .set_arg(&alpha)
                                .set_global_work_size(n)
                                .enqueue_nd_range(&q)?;
                            q.enqueue_read_buffer(&bout, CL_BLOCKING, 0, &mut acc, &[])?;
                        }
                    }
                    q.finish()?;
                    Ok((t, fnv1a(as_bytes(&acc))))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread panicked")).collect::<Result<Vec<_>>>()
    })?;
    for (t, sum) in results {
        println!("thread {t}: checksum={sum:016x}");
    }
    println!("done");
    Ok(())
}
