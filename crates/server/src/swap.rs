//! Device-memory over-subscription: on the router's word (`EVICT`) the server copies buffers
//! to host memory and frees them on the device; the next command that uses one restores it
//! (`RESTORED`). The tenant never notices: its ids stay, contents come back bit for bit, and
//! kernel arguments that named an evicted buffer are bound again before the next launch.
//!
//! Pieces:
//! - **Tracking.** Every plain buffer (clCreateBuffer[WithProperties]: type BUFFER, no
//!   associated object) is recorded with its context, flags and size when registered.
//!   Buffers that cannot or must not move are *pinned* (see [`Pin`]); images, pipes and
//!   sub-buffers are not tracked at all. EVICT answers "kept" for both.
//! - **The gate.** A writer-preferring readers/writer gate: a request takes the read side the
//!   first time it resolves a buffer (or binds kernel arguments, or launches) and gives it
//!   back when the request ends (`Ctx::reset`). An eviction holds the write side while it
//!   works, so no request is between resolving a buffer and handing it to the vendor.
//!   Restores run inside requests (read side) and serialize on the state mutex instead.
//! - **Eviction** (the `evict` thread): write side, drain every queue of the tenant (a marker
//!   per queue, bounded wait), then per buffer: check the vendor's reference count equals the
//!   tenant's, blocking read into host memory on an internal queue (one per context, made for
//!   this EVICT and released after it, so the server never keeps a tenant's context alive),
//!   NULL the kernel arguments bound to it, retain its context, release the vendor object as
//!   many times as the tenant holds it. The handle table keeps the id with a raw pointer of 0.
//!   If the gate or the drain cannot be had in time, nothing is evicted (all ids "kept").
//! - **Restore** (`Ctx::handle`, `prepare_kernel`): clCreateBuffer with the original flags
//!   and CL_MEM_COPY_HOST_PTR from the host copy (no host write, so HOST_READ_ONLY buffers
//!   move too), retain up to the tenant's references, new generation, `RESTORED` to the
//!   router. A failure is the call's CL_MEM_OBJECT_ALLOCATION_FAILURE; the copy stays.
//! - **Kernel arguments**: clSetKernelArg records (kernel id, index) → (buffer id,
//!   generation); an evicted buffer is passed as NULL. A launch restores what its kernel
//!   names and sets again every argument whose generation changed. clCloneKernel copies
//!   the record; the kernel's release drops it.
//! - **Retain/release of an evicted buffer** only adjust the table's count; the last
//!   release drops the host copy.
//!
//! Accounting: `Shared::mem_bytes` (USAGE) counts every live buffer, evicted or not — the
//! tenant's footprint; the router learns what is resident from EVICTED and RESTORED.
//! [`Swap::evicted_bytes`] is what currently lives in host memory.

use crate::ctx::{Ctx, Fail, Shared};
use hira_opencl::cl::*;
use hira_opencl::{
    K_KERNEL, K_MEM, K_QUEUE, OP_CLCLONEKERNEL, OP_CLCREATEBUFFER, OP_CLCREATEBUFFERWITHPROPERTIES,
    OP_CLRELEASECOMMANDQUEUE, OP_CLRELEASEKERNEL, OP_CLRELEASEMEMOBJECT, OP_CLRETAINMEMOBJECT,
    OP_CLSETKERNELARG, OP_CLSETKERNELARGSVMPOINTER, OP_CLSETMEMOBJECTDESTRUCTORCALLBACK,
};
use hira_wire::{control, Blob, Reader, Writer, HEADER_LEN};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const CL_MEM_REFERENCE_COUNT: u32 = 0x1105;
const CL_MEM_CONTEXT: u32 = 0x1106;
const CL_MEM_HOST_WRITE_ONLY: u64 = 1 << 7;
const CL_MEM_HOST_NO_ACCESS: u64 = 1 << 9;
const CL_CONTEXT_DEVICES: u32 = 0x1081;
const CL_EVENT_COMMAND_EXECUTION_STATUS: u32 = 0x11D3;

/// How long an eviction waits for running requests to leave the gate.
const GATE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an eviction waits for the tenant's queues to drain.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A writer-preferring readers/writer gate whose read side outlives any one borrow (a
/// request takes it in one call and gives it back in another).
#[derive(Default)]
pub(crate) struct Gate {
    m: Mutex<GateState>,
    cv: Condvar,
}

#[derive(Default)]
struct GateState {
    readers: u64,
    writer: bool,
    waiting: u32,
}

impl Gate {
    /// Take the read side; waits while a writer holds or wants the gate.
    pub(crate) fn read(&self) {
        let mut g = lock(&self.m);
        while g.writer || g.waiting > 0 {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.readers += 1;
    }

    /// Give back a read side taken with [`Gate::read`].
    pub(crate) fn read_done(&self) {
        let mut g = lock(&self.m);
        g.readers = g.readers.saturating_sub(1);
        if g.readers == 0 && g.waiting > 0 {
            self.cv.notify_all();
        }
    }

    /// The write side, or None if readers still hold the gate after `timeout` (a request
    /// blocked on something only a waiting request would do: give up rather than deadlock).
    fn write(&self, timeout: Duration) -> Option<WriteGuard<'_>> {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.m);
        g.waiting += 1;
        while g.writer || g.readers > 0 {
            let now = Instant::now();
            if now >= deadline {
                g.waiting -= 1;
                self.cv.notify_all();
                return None;
            }
            g = match self.cv.wait_timeout(g, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
        g.waiting -= 1;
        g.writer = true;
        Some(WriteGuard(self))
    }
}

struct WriteGuard<'a>(&'a Gate);

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        lock(&self.0.m).writer = false;
        self.0.cv.notify_all();
    }
}

/// Why a buffer is never evicted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pin {
    /// CL_MEM_USE_HOST_PTR: the guest keeps the application's memory in step with it.
    UseHostPtr,
    /// Its storage lies in the tenant's arena, where the guest reads and writes it in place
    /// (`direct.rs`): a restored copy would live elsewhere.
    Arena,
    /// CL_MEM_HOST_WRITE_ONLY / HOST_NO_ACCESS: the host cannot read it back.
    HostAccess,
    /// Created with properties: a restore could not recreate them.
    Properties,
    /// The memory of a sub-buffer or of an image (which hold its vendor pointer).
    Underlies,
    /// A destructor callback would fire at eviction.
    Destructor,
}

struct Buf {
    /// The vendor context (while evicted the swap state holds a reference on it).
    context: usize,
    /// CL_MEM_FLAGS as the vendor reports them.
    flags: u64,
    size: u64,
    /// Bumped at every restore (a new vendor object); kernel bindings compare it.
    generation: u64,
    pinned: Option<Pin>,
    /// The contents while evicted.
    host: Option<Vec<u8>>,
}

/// A buffer bound to a kernel argument, and the generation the vendor kernel holds
/// (0: the vendor holds NULL, the buffer was evicted).
#[derive(Clone, Copy)]
struct Binding {
    mem: u64,
    generation: u64,
}

#[derive(Default)]
struct State {
    bufs: HashMap<u64, Buf>,
    /// Kernel id → argument index → binding.
    kernels: HashMap<u64, HashMap<u32, Binding>>,
    evicted_bytes: u64,
}

/// The tenant's swap state (in `Shared`).
#[derive(Default)]
pub(crate) struct Swap {
    pub(crate) gate: Gate,
    state: Mutex<State>,
    /// SWAP_MODE from the router.
    mode: AtomicBool,
    /// Some buffer was evicted once: launches check their bindings from then on.
    ever: AtomicBool,
}

impl Swap {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub(crate) fn gated(&self) -> bool {
        self.mode.load(Ordering::Relaxed)
    }

    pub(crate) fn set_mode(&self, on: bool) {
        self.mode.store(on, Ordering::Relaxed);
    }

    /// Bytes of buffers currently held in host memory.
    pub(crate) fn evicted_bytes(&self) -> u64 {
        self.state().evicted_bytes
    }

    fn pin(&self, id: u64, why: Pin) {
        if let Some(b) = self.state().bufs.get_mut(&id) {
            if b.pinned.is_none() {
                tracing::debug!(id, ?why, "buffer pinned");
                b.pinned = Some(why);
            }
        }
    }
}

fn mem_info<T: Copy>(shared: &Shared, raw: *mut c_void, param: u32, init: T) -> Option<T> {
    let f = shared.api.clGetMemObjectInfo?;
    let mut v = init;
    // SAFETY: raw is a live memory object; v is an output of exactly size_of::<T>() bytes.
    let r = unsafe {
        f(
            raw,
            param,
            std::mem::size_of::<T>(),
            &mut v as *mut T as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    (r == CL_SUCCESS).then_some(v)
}

/// A memory object was registered (Ctx::account_mem): track plain buffers, pin the buffer
/// under a sub-buffer or an image.
pub(crate) fn registered(
    shared: &Shared,
    id: u64,
    raw: *mut c_void,
    size: u64,
    parent: *mut c_void,
) {
    if !parent.is_null() {
        let pid = shared
            .table()
            .by_raw
            .get(&(parent as usize, K_MEM))
            .copied();
        if let Some(pid) = pid {
            shared.swap.pin(pid, Pin::Underlies);
        }
        return;
    }
    let Some(ty) = mem_info::<u32>(shared, raw, CL_MEM_TYPE, 0) else {
        return;
    };
    if ty != CL_MEM_OBJECT_BUFFER || size == 0 {
        return;
    }
    let (Some(flags), Some(context)) = (
        mem_info::<u64>(shared, raw, CL_MEM_FLAGS, 0),
        mem_info::<usize>(shared, raw, CL_MEM_CONTEXT, 0),
    ) else {
        return;
    };
    if context == 0 {
        return;
    }
    let pinned =
        (flags & (CL_MEM_HOST_WRITE_ONLY | CL_MEM_HOST_NO_ACCESS) != 0).then_some(Pin::HostAccess);
    shared.swap.state().bufs.insert(
        id,
        Buf {
            context,
            flags,
            size,
            generation: 1,
            pinned,
            host: None,
        },
    );
}

fn current_raw(shared: &Shared, id: u64) -> Option<*mut c_void> {
    shared
        .table()
        .by_id
        .get(&id)
        .filter(|e| e.kind == K_MEM && e.raw != 0)
        .map(|e| e.raw as *mut c_void)
}

/// Bring an evicted buffer back (Ctx::handle met a raw pointer of 0).
pub(crate) fn restore(shared: &Shared, id: u64) -> Result<*mut c_void, Fail> {
    let mut st = shared.swap.state();
    restore_locked(shared, &mut st, id)
}

fn restore_locked(shared: &Shared, st: &mut State, id: u64) -> Result<*mut c_void, Fail> {
    let t0 = Instant::now();
    let api = shared.api;
    let Some(b) = st.bufs.get_mut(&id) else {
        // Its last reference went while this request waited for the state.
        tracing::debug!(id, "evicted buffer released meanwhile");
        return Err(Fail::Cl(CL_INVALID_MEM_OBJECT));
    };
    let Some(host) = b.host.as_ref() else {
        // Another request restored it meanwhile.
        return current_raw(shared, id).ok_or(Fail::Cl(CL_INVALID_MEM_OBJECT));
    };
    let create = api.clCreateBuffer.ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let flags = (b.flags & !(CL_MEM_USE_HOST_PTR | CL_MEM_COPY_HOST_PTR)) | CL_MEM_COPY_HOST_PTR;
    let mut err = 0i32;
    // SAFETY: the context is alive (the swap state holds a reference on it while the buffer
    // is evicted); host holds `size` bytes, which the vendor copies during the call.
    let raw = unsafe {
        create(
            b.context as *mut c_void,
            flags,
            b.size as usize,
            host.as_ptr() as *mut c_void,
            &mut err,
        )
    };
    if err != CL_SUCCESS || raw.is_null() {
        tracing::warn!(
            id,
            bytes = b.size,
            err,
            "could not restore an evicted buffer"
        );
        return Err(Fail::Cl(CL_MEM_OBJECT_ALLOCATION_FAILURE));
    }
    let refs = {
        let mut g = shared.table();
        let t = &mut *g;
        match t.by_id.get_mut(&id) {
            Some(e) if e.kind == K_MEM && e.raw == 0 => {
                e.raw = raw as usize;
                t.by_raw.insert((raw as usize, K_MEM), id);
                e.refs
            }
            _ => 0,
        }
    };
    if refs == 0 {
        // Cannot happen (releases of evicted buffers hold the state lock); don't leak.
        tracing::warn!(id, "restored buffer has no handle");
        if let Some(rel) = api.clReleaseMemObject {
            // SAFETY: the object made above, never handed out.
            unsafe { rel(raw) };
        }
        return Err(Fail::Cl(CL_INVALID_MEM_OBJECT));
    }
    if let Some(retain) = api.clRetainMemObject {
        for _ in 1..refs {
            // SAFETY: raw is the live object made above; the vendor count mirrors the
            // tenant's references, as before the eviction.
            unsafe { retain(raw) };
        }
    }
    if let Some(rel) = api.clReleaseContext {
        // SAFETY: the reference taken at eviction; the new buffer holds its own.
        unsafe { rel(b.context as *mut c_void) };
    }
    let bytes = b.size;
    b.host = None;
    b.generation += 1;
    st.evicted_bytes = st.evicted_bytes.saturating_sub(bytes);
    let ns = t0.elapsed().as_nanos() as u64;
    tracing::debug!(id, bytes, ns, "evicted buffer restored");
    let mut w = Writer::with_header_room(HEADER_LEN);
    w.u64(id);
    w.u64(bytes);
    w.u64(ns);
    shared.send_control(control::RESTORED, 0, w);
    Ok(raw)
}

/// Before a launch (the generated clEnqueueNDRangeKernel / clEnqueueTask): restore the
/// buffers bound to the kernel's arguments and bind again those the vendor holds stale.
pub(crate) fn prepare_kernel(cx: &mut Ctx, kernel_id: u64) -> Result<(), Fail> {
    cx.hold_gate();
    let shared = &*cx.shared;
    if !shared.swap.ever.load(Ordering::Relaxed) {
        return Ok(());
    }
    let kernel = cx.handle(kernel_id, K_KERNEL)?;
    let mut st = shared.swap.state();
    let Some(args) = st.kernels.get(&kernel_id) else {
        return Ok(());
    };
    let args: Vec<(u32, Binding)> = args.iter().map(|(i, b)| (*i, *b)).collect();
    for (index, bound) in args {
        let Some(b) = st.bufs.get(&bound.mem) else {
            continue; // released since; the vendor holds what the tenant left it
        };
        if b.host.is_none() && b.generation == bound.generation {
            continue;
        }
        let raw = if b.host.is_some() {
            restore_locked(shared, &mut st, bound.mem)?
        } else {
            current_raw(shared, bound.mem).ok_or(Fail::Cl(CL_INVALID_MEM_OBJECT))?
        };
        let generation = st.bufs.get(&bound.mem).map_or(0, |b| b.generation);
        let set = shared
            .api
            .clSetKernelArg
            .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
        // SAFETY: kernel is the tenant's live kernel (resolved above), raw a live buffer;
        // the vendor reads the 8-byte cl_mem value during the call.
        let r = unsafe {
            set(
                kernel,
                index,
                8,
                &raw as *const *mut c_void as *const c_void,
            )
        };
        if r != CL_SUCCESS {
            tracing::warn!(
                kernel_id,
                index,
                r,
                "could not bind a restored buffer again"
            );
            return Err(Fail::Cl(r));
        }
        if let Some(bnd) = st
            .kernels
            .get_mut(&kernel_id)
            .and_then(|m| m.get_mut(&index))
        {
            bnd.generation = generation;
        }
    }
    Ok(())
}

/// Wait until every command the tenant enqueued has finished: a marker on each of its
/// queues, polled with a deadline. False if they did not finish in time.
fn drain(shared: &Shared) -> bool {
    let api = shared.api;
    let queues: Vec<usize> = shared
        .table()
        .by_id
        .values()
        .filter(|e| e.kind == K_QUEUE && e.raw != 0)
        .map(|e| e.raw)
        .collect();
    let mut markers = Vec::new();
    for q in queues {
        let q = q as *mut c_void;
        let mut ev: *mut c_void = std::ptr::null_mut();
        // SAFETY: q is a live queue of the tenant (queue releases hold the gate, which this
        // eviction holds for writing); ev is an event output.
        let r = unsafe {
            match (api.clEnqueueMarkerWithWaitList, api.clEnqueueMarker) {
                (Some(m), _) => m(q, 0, std::ptr::null(), &mut ev),
                (None, Some(m)) => m(q, &mut ev),
                (None, None) => CL_INVALID_OPERATION,
            }
        };
        if r != CL_SUCCESS || ev.is_null() {
            // A device-side queue, say: nothing the host enqueued can be on it.
            tracing::debug!(r, "no marker on a queue while draining");
            continue;
        }
        if let Some(flush) = api.clFlush {
            // SAFETY: as above.
            unsafe { flush(q) };
        }
        markers.push(ev);
    }
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    let mut pause = Duration::from_micros(20);
    let mut done = false;
    while !done {
        done = markers.iter().all(|&ev| {
            let mut status: i32 = 0;
            api.clGetEventInfo.is_none_or(|f| {
                // SAFETY: ev is a marker event this function holds; 4-byte output.
                let r = unsafe {
                    f(
                        ev,
                        CL_EVENT_COMMAND_EXECUTION_STATUS,
                        4,
                        &mut status as *mut i32 as *mut c_void,
                        std::ptr::null_mut(),
                    )
                };
                r != CL_SUCCESS || status <= CL_COMPLETE
            })
        });
        if !done {
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }
    if let Some(rel) = api.clReleaseEvent {
        for ev in markers {
            // SAFETY: the marker's only reference, taken above.
            unsafe { rel(ev) };
        }
    }
    done
}

/// An internal queue on the context's first device, for eviction reads.
fn internal_queue(shared: &Shared, context: *mut c_void) -> Option<*mut c_void> {
    let api = shared.api;
    let info = api.clGetContextInfo?;
    let mut n: usize = 0;
    // SAFETY: context is alive (a buffer of it is); size query only.
    let r = unsafe { info(context, CL_CONTEXT_DEVICES, 0, std::ptr::null_mut(), &mut n) };
    if r != CL_SUCCESS || n < 8 {
        return None;
    }
    let mut devices = vec![std::ptr::null_mut::<c_void>(); n / 8];
    // SAFETY: room for n bytes of device pointers.
    let r = unsafe {
        info(
            context,
            CL_CONTEXT_DEVICES,
            devices.len() * 8,
            devices.as_mut_ptr() as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    let device = *devices.first()?;
    if r != CL_SUCCESS || device.is_null() {
        return None;
    }
    let mut err = 0i32;
    // SAFETY: context and device are alive; no properties (NULL) / none (0); err an output.
    let q = unsafe {
        match (
            api.clCreateCommandQueueWithProperties,
            api.clCreateCommandQueue,
        ) {
            (Some(f), _) => f(context, device, std::ptr::null(), &mut err),
            (None, Some(f)) => f(context, device, 0, &mut err),
            (None, None) => return None,
        }
    };
    if err != CL_SUCCESS || q.is_null() {
        tracing::warn!(err, "no internal queue for eviction");
        return None;
    }
    Some(q)
}

/// Evict one buffer (state locked, gate held for writing, queues drained): bytes freed.
fn evict_one(
    shared: &Shared,
    st: &mut State,
    queues: &mut HashMap<usize, Option<usize>>,
    id: u64,
) -> Result<u64, &'static str> {
    let api = shared.api;
    let (Some(read), Some(set), Some(rel)) = (
        api.clEnqueueReadBuffer,
        api.clSetKernelArg,
        api.clReleaseMemObject,
    ) else {
        return Err("the vendor library lacks what eviction needs");
    };
    let b = st
        .bufs
        .get(&id)
        .ok_or("not a buffer the server can evict")?;
    if b.pinned.is_some() {
        return Err("pinned");
    }
    if b.host.is_some() {
        return Ok(0);
    }
    let (context, size) = (b.context, b.size);
    let (raw, refs) = shared
        .table()
        .by_id
        .get(&id)
        .filter(|e| e.kind == K_MEM && e.raw != 0)
        .map(|e| (e.raw as *mut c_void, e.refs))
        .ok_or("no live handle")?;
    // Releasing `refs` times must free the object and nothing else may hold it.
    let count = mem_info::<u32>(shared, raw, CL_MEM_REFERENCE_COUNT, 0).ok_or("no count")?;
    if count != refs {
        tracing::warn!(
            id,
            count,
            refs,
            "vendor holds other references; not evicted"
        );
        return Err("vendor holds other references");
    }
    let q = *queues
        .entry(context)
        .or_insert_with(|| internal_queue(shared, context as *mut c_void).map(|q| q as usize));
    let q = q.ok_or("no internal queue")? as *mut c_void;
    let size_us = usize::try_from(size).map_err(|_| "too large")?;
    let mut host: Vec<u8> = Vec::new();
    host.try_reserve_exact(size_us)
        .map_err(|_| "no host memory")?;
    // SAFETY: q is a live internal queue of the buffer's context, raw the live buffer;
    // host has room for `size` bytes; the read is blocking, so host outlives it.
    let r = unsafe {
        read(
            q,
            raw,
            CL_TRUE,
            0,
            size_us,
            host.as_mut_ptr() as *mut c_void,
            0,
            std::ptr::null(),
            std::ptr::null_mut(),
        )
    };
    if r != CL_SUCCESS {
        tracing::warn!(id, r, "reading a buffer back for eviction failed");
        return Err("read back failed");
    }
    // SAFETY: the completed read wrote all `size` bytes (no need to zero them first).
    unsafe { host.set_len(size_us) };
    // The vendor's kernels must not keep a pointer to the freed object.
    let null: *mut c_void = std::ptr::null_mut();
    for (kid, args) in st.kernels.iter_mut() {
        for (index, bnd) in args.iter_mut() {
            if bnd.mem != id || bnd.generation == 0 {
                continue;
            }
            let kraw = shared
                .table()
                .by_id
                .get(kid)
                .filter(|e| e.kind == K_KERNEL)
                .map(|e| e.raw as *mut c_void);
            let Some(kraw) = kraw else { continue };
            // SAFETY: kraw is the tenant's live kernel (kernel releases hold the gate);
            // the vendor reads the 8-byte NULL cl_mem value during the call.
            let r = unsafe {
                set(
                    kraw,
                    *index,
                    8,
                    &null as *const *mut c_void as *const c_void,
                )
            };
            if r != CL_SUCCESS {
                tracing::warn!(
                    id,
                    kernel = kid,
                    index,
                    r,
                    "could not unbind a kernel argument"
                );
                return Err("kernel argument not unbound");
            }
            bnd.generation = 0;
        }
    }
    if let Some(retain) = api.clRetainContext {
        // SAFETY: the context is alive (the buffer holds it); keep it for the restore.
        unsafe { retain(context as *mut c_void) };
    }
    for _ in 0..refs {
        // SAFETY: the tenant's references, which the vendor count equals (checked above);
        // no command uses the buffer (queues drained) and no kernel holds it (unbound).
        unsafe { rel(raw) };
    }
    {
        let mut g = shared.table();
        let t = &mut *g;
        t.by_raw.remove(&(raw as usize, K_MEM));
        if let Some(e) = t.by_id.get_mut(&id) {
            e.raw = 0;
        }
    }
    if let Some(b) = st.bufs.get_mut(&id) {
        b.host = Some(host);
    }
    st.evicted_bytes += size;
    Ok(size)
}

/// EVICT: (bytes evicted, ids kept). Runs on the `evict` thread.
pub(crate) fn evict(shared: &Shared, ids: &[u64]) -> (u64, Vec<u64>) {
    let api = shared.api;
    let busy = |why: &str| {
        let st = shared.swap.state();
        let kept: Vec<u64> = ids
            .iter()
            .copied()
            .filter(|id| st.bufs.get(id).is_none_or(|b| b.host.is_none()))
            .collect();
        tracing::warn!(buffers = ids.len(), "eviction refused: {why}");
        (0, kept)
    };
    let Some(_w) = shared.swap.gate.write(GATE_TIMEOUT) else {
        return busy("requests still hold buffers");
    };
    if !drain(shared) {
        return busy("the tenant's queues did not drain");
    }
    shared.swap.ever.store(true, Ordering::Relaxed);
    let mut st = shared.swap.state();
    let mut queues: HashMap<usize, Option<usize>> = HashMap::new();
    let (mut bytes, mut kept) = (0u64, Vec::new());
    for &id in ids {
        match evict_one(shared, &mut st, &mut queues, id) {
            Ok(n) => {
                bytes += n;
                if n > 0 {
                    tracing::debug!(id, bytes = n, "buffer evicted");
                }
            }
            Err(why) => {
                tracing::debug!(id, "buffer kept: {why}");
                kept.push(id);
            }
        }
    }
    drop(st);
    if let Some(rel) = api.clReleaseCommandQueue {
        for q in queues.into_values().flatten() {
            // SAFETY: internal queues made by internal_queue, idle (reads were blocking).
            unsafe { rel(q as *mut c_void) };
        }
    }
    (bytes, kept)
}

/// clRetainMemObject / clReleaseMemObject of an evicted buffer: count without the vendor.
/// None if the buffer is not evicted (the generated handler runs). Gate held.
fn refcount_evicted(shared: &Shared, id: u64, retain: bool) -> Option<Writer> {
    let mut st = shared.swap.state();
    // Only evicted buffers; resident ones go to the vendor.
    st.bufs.get(&id)?.host.as_ref()?;
    if retain {
        let mut t = shared.table();
        let e = t.by_id.get_mut(&id)?;
        e.refs = e.refs.saturating_add(1);
    } else if shared.released(id) {
        if let Some(b) = st.bufs.remove(&id) {
            st.evicted_bytes = st.evicted_bytes.saturating_sub(b.size);
            if let Some(rel) = shared.api.clReleaseContext {
                // SAFETY: the reference taken at eviction.
                unsafe { rel(b.context as *mut c_void) };
            }
            tracing::debug!(id, bytes = b.size, "evicted buffer released");
        }
    }
    let mut w = Writer::default();
    w.i32(CL_SUCCESS);
    Some(w)
}

fn only_u64(payload: &[u8]) -> Option<u64> {
    let mut r = Reader::new(payload);
    let v = r.u64().ok()?;
    r.finish().ok()?;
    Some(v)
}

fn reply_status(w: &Writer) -> Option<i32> {
    Reader::new(&w.buf).i32().ok()
}

/// Run one request: the generated dispatch with the swap's hooks around it.
pub fn dispatch(cx: &mut Ctx, op: u16, payload: &[u8]) -> Result<Writer, Fail> {
    match op {
        OP_CLRETAINMEMOBJECT | OP_CLRELEASEMEMOBJECT => {
            cx.hold_gate();
            if let Some(w) = only_u64(payload)
                .and_then(|id| refcount_evicted(&cx.shared, id, op == OP_CLRETAINMEMOBJECT))
            {
                return Ok(w);
            }
        }
        // They touch kernel arguments or queues an eviction works with.
        OP_CLSETKERNELARG
        | OP_CLSETKERNELARGSVMPOINTER
        | OP_CLCLONEKERNEL
        | OP_CLRELEASEKERNEL
        | OP_CLRELEASECOMMANDQUEUE => cx.hold_gate(),
        _ => {}
    }
    let res = crate::dispatch(cx, op, &mut Reader::new(payload));
    if let Ok(w) = &res {
        after(cx, op, payload, w);
    }
    res
}

/// Bookkeeping once a call succeeded.
fn after(cx: &mut Ctx, op: u16, payload: &[u8], w: &Writer) {
    if reply_status(w) != Some(CL_SUCCESS) {
        return;
    }
    let shared = &*cx.shared;
    let swap = &shared.swap;
    let mut r = Reader::new(payload);
    let gone = |id: u64| !shared.table().by_id.contains_key(&id);
    match op {
        OP_CLCREATEBUFFER | OP_CLCREATEBUFFERWITHPROPERTIES => {
            let Ok(id) = Reader::new(&w.buf[4..]).u64() else {
                return;
            };
            let _context = r.u64();
            let props = if op == OP_CLCREATEBUFFERWITHPROPERTIES {
                match r.blob() {
                    Ok(Blob::Inline(d)) => d.len() >= 8 && d[..8] != [0; 8],
                    _ => false,
                }
            } else {
                false
            };
            let flags = r.u64().unwrap_or(0);
            // The reply's third word: where the buffer was placed in the arena (0: not).
            let placed = Reader::new(w.buf.get(12..).unwrap_or(&[]))
                .u64()
                .unwrap_or(0);
            if placed != 0 {
                swap.pin(id, Pin::Arena);
            } else if flags & CL_MEM_USE_HOST_PTR != 0 {
                swap.pin(id, Pin::UseHostPtr);
            } else if props {
                swap.pin(id, Pin::Properties);
            }
        }
        OP_CLSETMEMOBJECTDESTRUCTORCALLBACK => {
            if let Ok(id) = r.u64() {
                swap.pin(id, Pin::Destructor);
            }
        }
        OP_CLRELEASEMEMOBJECT => {
            if let Some(id) = only_u64(payload).filter(|&id| gone(id)) {
                if let Some(b) = swap.state().bufs.remove(&id) {
                    // Resident when released (evicted ones never reach the vendor).
                    debug_assert!(b.host.is_none());
                }
            }
        }
        // An SVM pointer replaces whatever buffer the argument held (no binding is kept).
        OP_CLSETKERNELARG | OP_CLSETKERNELARGSVMPOINTER => {
            let (Ok(kernel), Ok(index)) = (r.u64(), r.u64()) else {
                return;
            };
            let index = index as u32;
            let mut st = swap.state();
            let binding = cx.arg_mem.take().and_then(|(mem, null)| {
                let b = st.bufs.get(&mem)?;
                Some(Binding {
                    mem,
                    generation: if null { 0 } else { b.generation },
                })
            });
            match binding {
                Some(b) => {
                    st.kernels.entry(kernel).or_default().insert(index, b);
                }
                None => {
                    if let Some(m) = st.kernels.get_mut(&kernel) {
                        m.remove(&index);
                    }
                }
            }
        }
        OP_CLCLONEKERNEL => {
            let (Ok(src), Ok(new)) = (r.u64(), Reader::new(&w.buf[4..]).u64()) else {
                return;
            };
            let mut st = swap.state();
            if let Some(args) = st.kernels.get(&src).cloned() {
                st.kernels.insert(new, args);
            }
        }
        OP_CLRELEASEKERNEL => {
            if let Some(id) = only_u64(payload).filter(|&id| gone(id)) {
                swap.state().kernels.remove(&id);
            }
        }
        _ => {}
    }
}

/// Decode an EVICT payload: the ids, or the ids read before it turned out malformed.
pub(crate) fn parse_evict(payload: &[u8]) -> Result<Vec<u64>, (Vec<u64>, String)> {
    let mut r = Reader::new(payload);
    let n = r.u32().map_err(|e| (Vec::new(), e.to_string()))?;
    let room = r.remaining() / 8;
    let mut ids = Vec::with_capacity((n as usize).min(room));
    for _ in 0..(n as usize).min(room) {
        match r.u64() {
            Ok(id) => ids.push(id),
            Err(e) => return Err((ids, e.to_string())),
        }
    }
    if ids.len() < n as usize {
        return Err((ids, format!("{n} ids announced, {} present", room)));
    }
    if let Err(e) = r.finish() {
        return Err((ids, e.to_string()));
    }
    Ok(ids)
}

/// The `evict` thread: EVICT requests from the control reader, one at a time, each
/// answered with EVICTED (same seq).
pub(crate) fn evictor(
    shared: std::sync::Arc<Shared>,
    rx: std::sync::mpsc::Receiver<(u64, Vec<u8>)>,
) {
    while let Ok((seq, payload)) = rx.recv() {
        let t0 = Instant::now();
        let (bytes, kept) = match parse_evict(&payload) {
            Ok(ids) => evict(&shared, &ids),
            Err((ids, e)) => {
                tracing::warn!(seq, "malformed EVICT ({e}); nothing evicted");
                (0, ids)
            }
        };
        let ns = t0.elapsed().as_nanos() as u64;
        tracing::info!(
            seq,
            bytes,
            ns,
            kept = kept.len(),
            in_host_memory = shared.swap.evicted_bytes(),
            "eviction done"
        );
        let mut w = Writer::with_header_room(HEADER_LEN);
        w.u64(bytes);
        w.u64(ns);
        w.u32(kept.len() as u32);
        for id in kept {
            w.u64(id);
        }
        shared.send_control(control::EVICTED, seq, w);
    }
}
