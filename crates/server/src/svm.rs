//! Shared virtual memory, the server half. Fine-grained allocations live in the tenant's
//! arena, mapped at the same address in the guest ([`crate::arena`]): their pointers need no
//! translation and no copy, and the vendor takes them as it takes its own. What follows is
//! about coarse-grained allocations, which the vendor makes.
//!
//! The vendor allocates SVM memory inside this process, where the application cannot see it.
//! The guest gives the application a mirror of every allocation and sends, wherever the API
//! takes an SVM pointer, the server pointer (an opaque u64) at the same offset instead. Each
//! of them is checked here against the allocations this tenant made through this server
//! ([`Table`]) before the vendor sees it: a forged pointer is refused with CL_INVALID_VALUE
//! (CL_INVALID_ARG_VALUE for a kernel argument) and logged, so a tenant can make the server
//! read or write nothing but its own SVM memory.
//!
//! Bytes move with the vendor's `clEnqueueSVMMemcpy` between the allocation and the
//! request or reply: a map copies the region out (blocking, or staged like a non-blocking
//! buffer read), the unmap of a writable map copies it back in. Both are ordinary enqueued
//! commands, so they honour the wait list and queue order, give the application real events,
//! and never leave the allocation mapped in the server between requests.

use crate::arena::{self, Arena, Refused};
use crate::ctx::{Ctx, Fail};
use hira_opencl::cl::*;
use hira_opencl::*;
use hira_wire::{Blob, OutSpec, Reader, Writer};
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A `cl_mem_flags` bit no OpenCL flag uses: the guest sets it on clCreateBuffer(WithProperties)
/// when a CL_MEM_USE_HOST_PTR host pointer lies inside an SVM mirror. The host_ptr blob then
/// holds the server pointer (8 bytes) and the buffer is created on the allocation itself.
/// The same value is in `crates/guest/src/svm.rs`.
pub const HOST_PTR_IS_SVM: u64 = 1 << 63;

/// SVM capabilities hira can offer: coarse-grained buffers on any device; fine-grained
/// buffers and atomics only where a kernel reaches host memory (a CPU device), through the
/// arena. Fine-grained *system* SVM (any malloc'd pointer) cannot cross a process boundary.
pub const CL_DEVICE_SVM_COARSE_GRAIN_BUFFER: u64 = 1;
const CL_DEVICE_SVM_FINE_GRAIN_BUFFER: u64 = 2;
const CL_DEVICE_SVM_ATOMICS: u64 = 8;
const CL_CONTEXT_DEVICES: u32 = 0x1081;
const CL_DEVICE_TYPE: u32 = 0x1000;
const CL_DEVICE_TYPE_CPU: u64 = 1 << 1;
/// `cl_arm_shared_virtual_memory`'s name for the same query.
pub const CL_DEVICE_SVM_CAPABILITIES_ARM: u32 = 0x40B6;

const CL_MEM_SVM_FINE_GRAIN_BUFFER: u64 = 1 << 10;
const CL_MEM_SVM_ATOMICS: u64 = 1 << 11;
const CL_KERNEL_EXEC_INFO_SVM_PTRS: u32 = 0x11B6;
const CL_KERNEL_EXEC_INFO_SVM_FINE_GRAIN_SYSTEM: u32 = 0x11B7;
const CL_QUEUE_CONTEXT: u32 = 0x1090;
/// Largest copy staged in server memory (the same bound as staged buffer reads).
const MAX_STAGED: u64 = 1 << 31;
/// Most pointers one request may name.
const MAX_POINTERS: u64 = 1 << 16;

/// Wire tags of a copy's destination and source (guest and server agree on them).
const DST_SVM: u64 = 0;
const DST_REPLY: u64 = 1;
const DST_STAGED: u64 = 2;
const SRC_SVM: u64 = 0;
const SRC_BYTES: u64 = 1;

struct Alloc {
    size: usize,
    /// The vendor context (the table holds a reference on it while the allocation lives).
    context: usize,
    /// In the arena (fine-grained), not made by the vendor.
    fine: bool,
}

/// The tenant's SVM allocations (base address → allocation), shared by all its connections.
#[derive(Default)]
pub(crate) struct Table {
    allocs: Mutex<BTreeMap<usize, Alloc>>,
    /// The fine-grained arena, once the guest sent one that could be mapped.
    arena: Mutex<Option<Arena>>,
    /// A free address to offer the guest after its arena's address was taken here (0: none).
    offer: AtomicU64,
    /// Length of the arena the guest sent last, while none is mapped (0: none sent, or it
    /// was refused for a reason no other address cures).
    unplaced: AtomicU64,
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<usize, Alloc>> {
        self.allocs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `[ptr, ptr + len)` lies inside one allocation (a zero-length range at the
    /// base of a zero-sized one counts).
    fn contains(&self, ptr: u64, len: u64) -> bool {
        let (Ok(p), Ok(len)) = (usize::try_from(ptr), usize::try_from(len)) else {
            return false;
        };
        let Some(end) = p.checked_add(len) else {
            return false;
        };
        let map = self.lock();
        let Some((&base, a)) = map.range(..=p).next_back() else {
            return false;
        };
        let limit = base.saturating_add(a.size);
        (p < limit || (p == base && len == 0)) && end <= limit
    }

    /// Number of live allocations (tests and logs).
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Where the guest should map its unplaced arena: the address offered when it was taken,
    /// while that is still free here, else a fresh free one (0 when there is no arena to
    /// place). Asked with no arena mapped.
    fn offer_address(&self) -> u64 {
        let len = self.unplaced.load(Ordering::Relaxed);
        if len == 0 {
            return 0;
        }
        let offer = self.offer.load(Ordering::Relaxed);
        if offer != 0 && arena::is_free(offer as usize, len as usize) {
            return offer;
        }
        let fresh = arena::free_address(len as usize).unwrap_or(0) as u64;
        self.offer.store(fresh, Ordering::Relaxed);
        fresh
    }

    pub(crate) fn arena(&self) -> MutexGuard<'_, Option<Arena>> {
        self.arena.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `control::SVM_ARENA`: map the guest's arena at its address. A tenant has one arena;
    /// failures are logged, and the next fine-grained clSVMAlloc reports them to the guest
    /// (with a free address to try when the guest's was taken here).
    pub(crate) fn take_arena(&self, fd: OwnedFd, addr: u64, len: u64) {
        let mut slot = self.arena();
        if slot.is_some() {
            tracing::warn!("second SVM arena refused: the tenant has one");
            return;
        }
        match Arena::map(fd, addr, len) {
            Ok(a) => {
                tracing::debug!(
                    base = format_args!("{:#x}", a.base()),
                    len,
                    "SVM arena mapped"
                );
                *slot = Some(a);
            }
            Err(Refused::Taken(offer)) => {
                tracing::info!(
                    addr = format_args!("{addr:#x}"),
                    offer = format_args!("{offer:#x}"),
                    "SVM arena address taken in the server; offering another"
                );
                self.offer.store(offer as u64, Ordering::Relaxed);
                self.unplaced.store(len, Ordering::Relaxed);
            }
            Err(Refused::Bad(why)) => {
                tracing::warn!(%why, "SVM arena refused");
                self.unplaced.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// Whether `device` can take arena memory as fine-grained SVM: a kernel on a CPU device
/// reaches any memory of the server process (`HIRA_FINE_SVM=0` turns the offer off).
pub(crate) fn fine_grain_device(cx: &Ctx, device: *mut c_void) -> bool {
    if std::env::var_os("HIRA_FINE_SVM").is_some_and(|v| v == "0") {
        return false;
    }
    let Some(f) = cx.api.clGetDeviceInfo else {
        return false;
    };
    let (mut ty, mut caps) = (0u64, 0u64);
    // SAFETY: 8-byte outputs for two cl_bitfield queries on a validated device.
    let ok = unsafe {
        f(
            device,
            CL_DEVICE_TYPE,
            8,
            &mut ty as *mut u64 as *mut c_void,
            std::ptr::null_mut(),
        ) == CL_SUCCESS
            && f(
                device,
                CL_DEVICE_SVM_CAPABILITIES,
                8,
                &mut caps as *mut u64 as *mut c_void,
                std::ptr::null_mut(),
            ) == CL_SUCCESS
    };
    ok && ty & CL_DEVICE_TYPE_CPU != 0 && caps & CL_DEVICE_SVM_FINE_GRAIN_BUFFER != 0
}

/// The SVM capabilities a tenant sees, from the vendor's.
pub(crate) fn capabilities(cx: &Ctx, device: *mut c_void, vendor: u64) -> u64 {
    let offered = if fine_grain_device(cx, device) {
        CL_DEVICE_SVM_COARSE_GRAIN_BUFFER | CL_DEVICE_SVM_FINE_GRAIN_BUFFER | CL_DEVICE_SVM_ATOMICS
    } else {
        CL_DEVICE_SVM_COARSE_GRAIN_BUFFER
    };
    vendor & offered
}

/// Whether every device of `context` takes arena memory.
pub(crate) fn fine_grain_context(cx: &Ctx, context: *mut c_void) -> bool {
    let Some(f) = cx.api.clGetContextInfo else {
        return false;
    };
    let mut devs = [std::ptr::null_mut::<c_void>(); 16];
    let mut got = 0usize;
    // SAFETY: a validated context; room for 16 device handles.
    let r = unsafe {
        f(
            context,
            CL_CONTEXT_DEVICES,
            std::mem::size_of_val(&devs),
            devs.as_mut_ptr() as *mut c_void,
            &mut got,
        )
    };
    let n = got / std::mem::size_of::<*mut c_void>();
    r == CL_SUCCESS && n > 0 && devs[..n].iter().all(|&d| fine_grain_device(cx, d))
}

/// A server pointer a tenant sent, checked: `[ptr, ptr + len)` must lie inside one of this
/// tenant's allocations; anything else is refused with `err` and logged.
fn checked_or(cx: &Ctx, ptr: u64, len: u64, op: &str, err: i32) -> Result<*mut c_void, Fail> {
    if ptr != 0 && cx.shared.svm.contains(ptr, len) {
        return Ok(ptr as usize as *mut c_void);
    }
    tracing::warn!(
        op,
        ptr = format_args!("{ptr:#x}"),
        len,
        allocations = cx.shared.svm.len(),
        "SVM pointer outside this tenant's allocations refused"
    );
    Err(Fail::Cl(err))
}

fn checked(cx: &Ctx, ptr: u64, len: u64, op: &str) -> Result<*mut c_void, Fail> {
    checked_or(cx, ptr, len, op, CL_INVALID_VALUE)
}

/// clCreateBuffer(WithProperties) on an SVM allocation (flags hold [`HOST_PTR_IS_SVM`]): the
/// checked server pointer the buffer will use as its host memory.
pub(crate) fn buffer_host_ptr(
    cx: &Ctx,
    b: Blob<'_>,
    flags: u64,
    len: u64,
) -> Result<*const u8, Fail> {
    let ptr = match b {
        Blob::Inline(d) if d.len() == 8 && flags & CL_MEM_USE_HOST_PTR != 0 => {
            u64::from_le_bytes(d.try_into().map_err(|_| Fail::Cl(CL_INVALID_VALUE))?)
        }
        _ => {
            tracing::warn!("malformed SVM host pointer refused");
            return Err(Fail::Cl(CL_INVALID_VALUE));
        }
    };
    Ok(checked(cx, ptr, len, "clCreateBuffer")? as *const u8)
}

fn u64s(v: &crate::ctx::In<u64>, n: u64) -> Vec<u64> {
    if v.ptr().is_null() {
        return Vec::new();
    }
    // SAFETY: in_array returned n values at ptr (or null, handled above).
    unsafe { std::slice::from_raw_parts(v.ptr(), n as usize) }.to_vec()
}

/// After an enqueue: the event goes to the guest's id (or is released once complete), and
/// staged input bytes live until the command completes.
fn enqueued(cx: &mut Ctx, ret: i32, ev: *mut c_void, event_id: u64) -> Result<(), Fail> {
    cx.track_event(ret, ev, event_id == 0, false, 0);
    if ret == CL_SUCCESS && event_id != 0 && !ev.is_null() {
        cx.bind(event_id, ev, K_EVENT)?;
    }
    Ok(())
}

fn status(ret: i32) -> Result<Writer, Fail> {
    let mut w = Writer::default();
    w.i32(ret);
    Ok(w)
}

// ---- Allocation ---------------------------------------------------------------------------

/// `[context][flags][size][alignment]` → `[status][server pointer]` (0 when it failed).
pub fn h_clSVMAlloc(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let context = cx.handle(r.u64()?, K_CONTEXT)?;
    let flags = r.u64()?;
    let size = r.u64()?;
    let alignment = r.u64()?;
    r.finish()?;
    let refuse = |code: i32, why: &str| {
        tracing::info!(flags, size, alignment, why, "clSVMAlloc refused");
        let mut w = Writer::default();
        w.i32(code);
        w.u64(0);
        Ok(w)
    };
    let (Ok(alignment), Ok(bytes)) = (u32::try_from(alignment), usize::try_from(size)) else {
        return refuse(CL_INVALID_VALUE, "alignment or size out of range");
    };
    // The router charges memory objects, not SVM: hold SVM to the tenant's quota here.
    let quota = cx.shared.quota.load(Ordering::Relaxed);
    let held = cx.shared.mem_bytes.load(Ordering::Relaxed);
    if quota != 0 && held.saturating_add(size) > quota {
        return refuse(CL_MEM_OBJECT_ALLOCATION_FAILURE, "over the tenant's quota");
    }
    let fine = flags & (CL_MEM_SVM_FINE_GRAIN_BUFFER | CL_MEM_SVM_ATOMICS) != 0;
    let p = if fine {
        if flags & CL_MEM_SVM_FINE_GRAIN_BUFFER == 0 {
            return refuse(CL_INVALID_VALUE, "SVM atomics without fine grain");
        }
        if !fine_grain_context(cx, context) {
            return refuse(
                CL_INVALID_VALUE,
                "fine-grained SVM is not offered on this device",
            );
        }
        let mut arena = cx.shared.svm.arena();
        let Some(arena) = arena.as_mut() else {
            // The guest maps its arena again at the offered address and retries.
            let offer = cx.shared.svm.offer_address();
            tracing::info!(
                offer = format_args!("{offer:#x}"),
                "fine-grained clSVMAlloc before the SVM arena is placed"
            );
            let mut w = Writer::default();
            w.i32(CL_MEM_OBJECT_ALLOCATION_FAILURE);
            w.u64(0);
            w.u64(offer);
            return Ok(w);
        };
        let align = match alignment {
            0 => arena::GRAIN,
            a if a.is_power_of_two() => a as usize,
            _ => return refuse(CL_INVALID_VALUE, "alignment not a power of two"),
        };
        match arena.alloc(bytes, align) {
            Some(p) => p as *mut c_void,
            None => return refuse(CL_MEM_OBJECT_ALLOCATION_FAILURE, "the arena is full"),
        }
    } else {
        let f = cx.api.clSVMAlloc.ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
        // SAFETY: a validated context; the vendor checks flags, size and alignment.
        let p = unsafe { f(context, flags, bytes, alignment) };
        if p.is_null() {
            return refuse(CL_MEM_OBJECT_ALLOCATION_FAILURE, "the vendor returned NULL");
        }
        p
    };
    if let Some(retain) = cx.api.clRetainContext {
        // SAFETY: a live context; released when the allocation is freed.
        unsafe { retain(context) };
    }
    cx.shared.svm.lock().insert(
        p as usize,
        Alloc {
            size: bytes,
            context: context as usize,
            fine,
        },
    );
    cx.shared.mem_bytes.fetch_add(size, Ordering::Relaxed);
    let mut w = Writer::default();
    w.i32(CL_SUCCESS);
    w.u64(p as u64);
    Ok(w)
}

/// An allocation left the table (its vendor memory is freed or about to be; an arena
/// allocation goes back to the arena here).
fn forgotten(shared: &crate::ctx::Shared, base: usize, a: &Alloc) {
    if a.fine {
        if let Some(arena) = shared.svm.arena().as_mut() {
            arena.free(base, a.size);
        }
    }
    let held = shared.mem_bytes.load(Ordering::Relaxed);
    shared
        .mem_bytes
        .fetch_sub((a.size as u64).min(held), Ordering::Relaxed);
    if let Some(release) = shared.api.clReleaseContext {
        // SAFETY: the reference taken in h_clSVMAlloc.
        unsafe { release(a.context as *mut c_void) };
    }
}

/// `[context][server pointer]` → `[status]`. The pointer must be the base of an allocation
/// this tenant made in that context.
pub fn h_clSVMFree(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let context_id = r.u64()?;
    let ptr = r.u64()?;
    r.finish()?;
    if ptr == 0 {
        return status(CL_SUCCESS);
    }
    let context = cx.handle(context_id, K_CONTEXT)?;
    let a = {
        let mut map = cx.shared.svm.lock();
        let base = usize::try_from(ptr).unwrap_or(0);
        match map.get(&base) {
            Some(a) if a.context == context as usize => map.remove(&base),
            _ => None,
        }
    };
    let Some(a) = a else {
        tracing::warn!(
            ptr = format_args!("{ptr:#x}"),
            "clSVMFree of a pointer that is no SVM allocation of this tenant in this context refused"
        );
        return status(CL_INVALID_VALUE);
    };
    if let (Some(f), false) = (cx.api.clSVMFree, a.fine) {
        // SAFETY: ptr is the base of a live allocation of this context (removed from the
        // table above, so no other request can name it any more).
        unsafe { f(context, ptr as usize as *mut c_void) };
    }
    forgotten(&cx.shared, ptr as usize, &a);
    status(CL_SUCCESS)
}

/// The vendor context of a queue.
fn queue_context(cx: &Ctx, queue: *mut c_void) -> Option<usize> {
    let f = cx.api.clGetCommandQueueInfo?;
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: a validated queue; an 8-byte output.
    let r = unsafe {
        f(
            queue,
            CL_QUEUE_CONTEXT,
            8,
            &mut ctx as *mut *mut c_void as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    (r == CL_SUCCESS).then_some(ctx as usize)
}

/// `[queue][n][pointers][nwait][wait list][event id]`: every pointer the base of an
/// allocation of the queue's context. No free callback reaches the server (the guest runs
/// one after a marker), so the vendor frees the memory.
pub fn h_clEnqueueSVMFree(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let queue = cx.handle(r.u64()?, K_QUEUE)?;
    let n = r.u64()?;
    let ptrs_b = r.blob()?;
    let nwait = r.u64()? as u32;
    let wait_b = r.blob()?;
    let event_id = r.u64()?;
    r.finish()?;
    if n == 0 || n > MAX_POINTERS {
        return Err(Fail::Cl(CL_INVALID_VALUE));
    }
    let wait = cx.in_handles(wait_b, u64::from(nwait), K_EVENT)?;
    let ptrs = u64s(&cx.in_array::<u64>(ptrs_b, n)?, n);
    if ptrs.len() as u64 != n {
        return Err(Fail::Cl(CL_INVALID_VALUE));
    }
    let f = cx
        .api
        .clEnqueueSVMFree
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let qctx = queue_context(cx, queue).ok_or(Fail::Cl(CL_INVALID_COMMAND_QUEUE))?;
    // Take them out of the table first: once enqueued, no request may name them.
    let taken: Vec<(usize, Alloc)> = {
        let mut map = cx.shared.svm.lock();
        let mut bases: Vec<usize> = ptrs.iter().map(|&p| p as usize).collect();
        bases.sort_unstable();
        bases.dedup();
        let ok = bases.len() == ptrs.len()
            && bases
                .iter()
                .all(|b| map.get(b).is_some_and(|a| a.context == qctx));
        if !ok {
            drop(map);
            tracing::warn!(
                n,
                "clEnqueueSVMFree of pointers that are no SVM allocations of this tenant refused"
            );
            return Err(Fail::Cl(CL_INVALID_VALUE));
        }
        bases
            .into_iter()
            .filter_map(|b| map.remove(&b).map(|a| (b, a)))
            .collect()
    };
    let (fine, vendor): (Vec<(usize, Alloc)>, Vec<(usize, Alloc)>) =
        taken.into_iter().partition(|(_, a)| a.fine);
    let mut raw: Vec<*mut c_void> = vendor.iter().map(|&(b, _)| b as *mut c_void).collect();
    let mut ev: *mut c_void = std::ptr::null_mut();
    let mut ret = CL_SUCCESS;
    let vendor_freed = !raw.is_empty();
    if vendor_freed {
        // SAFETY: a validated queue and wait list; every pointer is the base of a live
        // allocation of the queue's context, held by nobody else now; no callback, so the
        // vendor frees them.
        ret = unsafe {
            f(
                queue,
                raw.len() as u32,
                raw.as_mut_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                nwait,
                wait.ptr(),
                &mut ev,
            )
        };
    }
    if ret == CL_SUCCESS && !fine.is_empty() {
        // Arena memory goes back to the arena once a marker behind the free has completed.
        let after: Vec<*mut c_void> = if ev.is_null() {
            // SAFETY: nwait validated handles.
            (0..nwait as usize)
                .map(|i| unsafe { *wait.ptr().add(i) })
                .collect()
        } else {
            vec![ev]
        };
        match free_after_marker(cx, queue, &after, fine) {
            Ok(marker) => {
                if !ev.is_null() {
                    if let Some(rel) = cx.api.clReleaseEvent {
                        // SAFETY: the vendor free's event; the marker's stands for both.
                        unsafe { rel(ev) };
                    }
                }
                ev = marker;
            }
            Err((code, fine)) => {
                ret = code;
                cx.shared.svm.lock().extend(fine);
            }
        }
    }
    if ret == CL_SUCCESS || (vendor_freed && !ev.is_null()) {
        // Enqueued with the vendor: its memory is as good as gone.
        for (b, a) in &vendor {
            forgotten(&cx.shared, *b, a);
        }
    } else {
        cx.shared.svm.lock().extend(vendor);
    }
    enqueued(cx, ret, ev, event_id)?;
    status(ret)
}

struct ArenaFree {
    shared: std::sync::Arc<crate::ctx::Shared>,
    allocs: Vec<(usize, Alloc)>,
}

extern "C" fn arena_free_tramp(ev: *mut c_void, _status: i32, ud: *mut c_void) {
    let _ = ev;
    // SAFETY: the box made in free_after_marker, handed over exactly once.
    let f = unsafe { Box::from_raw(ud as *mut ArenaFree) };
    for (b, a) in &f.allocs {
        forgotten(&f.shared, *b, a);
    }
}

/// A marker after `after` (or after everything before it) whose completion frees `allocs`
/// in the arena; returns its event. On failure the allocations come back with the error.
#[allow(clippy::type_complexity)]
fn free_after_marker(
    cx: &Ctx,
    queue: *mut c_void,
    after: &[*mut c_void],
    allocs: Vec<(usize, Alloc)>,
) -> Result<*mut c_void, (i32, Vec<(usize, Alloc)>)> {
    let (Some(marker), Some(set_cb)) = (
        cx.api.clEnqueueMarkerWithWaitList,
        cx.api.clSetEventCallback,
    ) else {
        return Err((CL_INVALID_OPERATION, allocs));
    };
    let mut ev: *mut c_void = std::ptr::null_mut();
    // SAFETY: a validated queue; `after` holds live events.
    let r = unsafe {
        marker(
            queue,
            after.len() as u32,
            if after.is_empty() {
                std::ptr::null()
            } else {
                after.as_ptr()
            },
            &mut ev,
        )
    };
    if r != CL_SUCCESS {
        return Err((r, allocs));
    }
    let ud = Box::into_raw(Box::new(ArenaFree {
        shared: cx.shared.clone(),
        allocs,
    }));
    // SAFETY: a live event; the trampoline takes the box back exactly once.
    let r = unsafe {
        set_cb(
            ev,
            CL_COMPLETE,
            arena_free_tramp as *mut c_void,
            ud as *mut c_void,
        )
    };
    if r != CL_SUCCESS {
        // SAFETY: the callback was not registered, so the box is still ours.
        let back = unsafe { Box::from_raw(ud) };
        return Err((r, back.allocs));
    }
    Ok(ev)
}

// ---- Copies -------------------------------------------------------------------------------

enum Dst {
    Svm(u64),
    /// Into the reply (the copy runs blocking).
    Reply(OutSpec),
    /// Into a staging buffer the guest fetches later (non-blocking).
    Staged(u64),
}

enum Src<'a> {
    Svm(u64),
    Bytes(Blob<'a>),
}

fn read_dst(r: &mut Reader<'_>) -> Result<Dst, Fail> {
    Ok(match r.u64()? {
        DST_SVM => Dst::Svm(r.u64()?),
        DST_REPLY => Dst::Reply(r.out_spec()?),
        DST_STAGED => Dst::Staged(r.u64()?),
        _ => return Err(Fail::Cl(CL_INVALID_VALUE)),
    })
}

fn read_src<'a>(r: &mut Reader<'a>) -> Result<Src<'a>, Fail> {
    Ok(match r.u64()? {
        SRC_SVM => Src::Svm(r.u64()?),
        SRC_BYTES => Src::Bytes(r.blob()?),
        _ => return Err(Fail::Cl(CL_INVALID_VALUE)),
    })
}

/// One vendor clEnqueueSVMMemcpy with each side checked or materialized.
fn copy(
    cx: &mut Ctx,
    op: &str,
    queue_id: u64,
    blocking: bool,
    dst: Dst,
    src: Src<'_>,
    size: u64,
    nwait: u32,
    wait_b: Blob<'_>,
    event_id: u64,
) -> Result<Writer, Fail> {
    let queue = cx.handle(queue_id, K_QUEUE)?;
    let wait = cx.in_handles(wait_b, u64::from(nwait), K_EVENT)?;
    let f = cx
        .api
        .clEnqueueSVMMemcpy
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let blocking = match dst {
        Dst::Svm(_) => blocking,
        Dst::Reply(_) => true,
        Dst::Staged(_) => false,
    };
    let mut keep = None;
    let src_ptr: *const c_void = match src {
        Src::Svm(p) => checked(cx, p, size, op)?,
        Src::Bytes(b) => {
            // A non-blocking copy reads its source after this handler returns: hold a copy.
            let v = keep.insert(cx.in_bytes_staged(b, size, !blocking)?);
            v.ptr() as *const c_void
        }
    };
    let mut out = None;
    let mut staged = None;
    let dst_ptr: *mut c_void = match &dst {
        Dst::Svm(p) => checked(cx, *p, size, op)?,
        Dst::Reply(o) => out.insert(cx.out(*o, size)?).ptr(),
        Dst::Staged(_) => {
            if size > MAX_STAGED {
                return Err(Fail::Cl(CL_INVALID_VALUE));
            }
            let mut v: Vec<u8> = Vec::new();
            v.try_reserve_exact(size as usize)
                .map_err(|_| Fail::Cl(CL_OUT_OF_HOST_MEMORY))?;
            v.resize(size as usize, 0);
            staged.insert(v).as_mut_ptr() as *mut c_void
        }
    };
    let mut ev: *mut c_void = std::ptr::null_mut();
    // SAFETY: a validated queue and wait list; SVM sides lie inside this tenant's allocations
    // for `size` bytes (checked above); host sides are `size` bytes of request input, reply
    // output or staging memory, which live until the copy is done (blocking) or its event
    // completes (staged inputs and staging buffers).
    let ret = unsafe {
        f(
            queue,
            blocking as u32,
            dst_ptr,
            src_ptr,
            size as usize,
            nwait,
            wait.ptr(),
            &mut ev,
        )
    };
    drop(keep);
    if let (Dst::Staged(staging), Some(data)) = (dst, staged) {
        return stage(cx, ret, ev, event_id, staging, data);
    }
    enqueued(cx, ret, ev, event_id)?;
    let mut w = Writer::default();
    w.i32(ret);
    if let Some(o) = &out {
        o.emit(&mut w);
    }
    Ok(w)
}

/// A non-blocking copy into server memory: the staging entry keeps the data (and an event
/// reference) until the guest fetches it with hiraFetchStaged, as staged buffer reads do.
fn stage(
    cx: &mut Ctx,
    ret: i32,
    ev: *mut c_void,
    event_id: u64,
    staging: u64,
    data: Vec<u8>,
) -> Result<Writer, Fail> {
    // Staged source bytes (host to host) live until the copy completes.
    cx.track_event(ret, ev, false, false, 0);
    if ret != CL_SUCCESS || ev.is_null() {
        return status(ret);
    }
    crate::custom::stage_read(cx, ev, event_id, staging, data)?;
    status(ret)
}

/// `[queue][blocking][dst][src][size][nwait][wait list][event id]`; each side is an SVM
/// pointer or host bytes (see the tags above).
pub fn h_clEnqueueSVMMemcpy(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let queue_id = r.u64()?;
    let blocking = r.u64()? != 0;
    let dst = read_dst(r)?;
    let src = read_src(r)?;
    let size = r.u64()?;
    let nwait = r.u64()? as u32;
    let wait_b = r.blob()?;
    let event_id = r.u64()?;
    r.finish()?;
    copy(
        cx,
        "clEnqueueSVMMemcpy",
        queue_id,
        blocking,
        dst,
        src,
        size,
        nwait,
        wait_b,
        event_id,
    )
}

/// `[queue][blocking][flags][pointer][size][dst: reply or staged][nwait][wait list][event id]`:
/// the region's bytes for the guest's mirror.
pub fn h_clEnqueueSVMMap(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let queue_id = r.u64()?;
    let blocking = r.u64()? != 0;
    let _flags = r.u64()?;
    let ptr = r.u64()?;
    let size = r.u64()?;
    let dst = read_dst(r)?;
    let nwait = r.u64()? as u32;
    let wait_b = r.blob()?;
    let event_id = r.u64()?;
    r.finish()?;
    if matches!(dst, Dst::Svm(_)) {
        return Err(Fail::Cl(CL_INVALID_VALUE));
    }
    copy(
        cx,
        "clEnqueueSVMMap",
        queue_id,
        blocking,
        dst,
        Src::Svm(ptr),
        size,
        nwait,
        wait_b,
        event_id,
    )
}

/// `[queue][pointer][size][bytes][nwait][wait list][event id]`: the mirror's bytes of a
/// writable map, copied into the allocation.
pub fn h_clEnqueueSVMUnmap(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let queue_id = r.u64()?;
    let ptr = r.u64()?;
    let size = r.u64()?;
    let bytes = r.blob()?;
    let nwait = r.u64()? as u32;
    let wait_b = r.blob()?;
    let event_id = r.u64()?;
    r.finish()?;
    copy(
        cx,
        "clEnqueueSVMUnmap",
        queue_id,
        false,
        Dst::Svm(ptr),
        Src::Bytes(bytes),
        size,
        nwait,
        wait_b,
        event_id,
    )
}

// ---- Other commands -----------------------------------------------------------------------

/// `[queue][pointer][pattern][pattern size][size][nwait][wait list][event id]`.
pub fn h_clEnqueueSVMMemFill(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let queue = cx.handle(r.u64()?, K_QUEUE)?;
    let ptr = r.u64()?;
    let pattern_b = r.blob()?;
    let pattern_size = r.u64()?;
    let size = r.u64()?;
    let nwait = r.u64()? as u32;
    let wait_b = r.blob()?;
    let event_id = r.u64()?;
    r.finish()?;
    let wait = cx.in_handles(wait_b, u64::from(nwait), K_EVENT)?;
    let pattern = cx.in_bytes(pattern_b, pattern_size)?;
    let p = checked(cx, ptr, size, "clEnqueueSVMMemFill")?;
    let f = cx
        .api
        .clEnqueueSVMMemFill
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let mut ev: *mut c_void = std::ptr::null_mut();
    // SAFETY: [p, p + size) lies inside this tenant's allocation (checked); the pattern has
    // pattern_size readable bytes (the vendor copies it during the call).
    let ret = unsafe {
        f(
            queue,
            p,
            pattern.ptr() as *const c_void,
            pattern_size as usize,
            size as usize,
            nwait,
            wait.ptr(),
            &mut ev,
        )
    };
    enqueued(cx, ret, ev, event_id)?;
    status(ret)
}

/// `[queue][n][pointers][sizes or null][flags][nwait][wait list][event id]`; a zero size
/// migrates the whole allocation holding the pointer.
pub fn h_clEnqueueSVMMigrateMem(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let queue = cx.handle(r.u64()?, K_QUEUE)?;
    let n = r.u64()?;
    let ptrs_b = r.blob()?;
    let sizes_b = r.blob()?;
    let flags = r.u64()?;
    let nwait = r.u64()? as u32;
    let wait_b = r.blob()?;
    let event_id = r.u64()?;
    r.finish()?;
    if n == 0 || n > MAX_POINTERS {
        return Err(Fail::Cl(CL_INVALID_VALUE));
    }
    let wait = cx.in_handles(wait_b, u64::from(nwait), K_EVENT)?;
    let ptrs = u64s(&cx.in_array::<u64>(ptrs_b, n)?, n);
    let sizes_in = cx.in_array::<u64>(sizes_b, n)?;
    let sizes = u64s(&sizes_in, n);
    if ptrs.len() as u64 != n {
        return Err(Fail::Cl(CL_INVALID_VALUE));
    }
    let mut raw = Vec::with_capacity(ptrs.len());
    for (i, &p) in ptrs.iter().enumerate() {
        let len = sizes.get(i).copied().unwrap_or(0);
        raw.push(checked(cx, p, len, "clEnqueueSVMMigrateMem")? as *const c_void);
    }
    let sizes_usize: Vec<usize> = sizes.iter().map(|&s| s as usize).collect();
    let f = cx
        .api
        .clEnqueueSVMMigrateMem
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let mut ev: *mut c_void = std::ptr::null_mut();
    // SAFETY: n checked pointers (each range inside this tenant's allocations), n sizes or
    // null; a validated queue and wait list.
    let ret = unsafe {
        f(
            queue,
            n as u32,
            raw.as_mut_ptr() as *mut *mut c_void,
            if sizes.is_empty() {
                std::ptr::null()
            } else {
                sizes_usize.as_ptr()
            },
            flags,
            nwait,
            wait.ptr(),
            &mut ev,
        )
    };
    enqueued(cx, ret, ev, event_id)?;
    status(ret)
}

/// `[kernel][index][pointer]` (0 = NULL).
pub fn h_clSetKernelArgSVMPointer(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let kernel = cx.handle(r.u64()?, K_KERNEL)?;
    let index = r.u64()? as u32;
    let ptr = r.u64()?;
    r.finish()?;
    let p = if ptr == 0 {
        std::ptr::null_mut()
    } else {
        checked_or(cx, ptr, 0, "clSetKernelArgSVMPointer", CL_INVALID_ARG_VALUE)?
    };
    let f = cx
        .api
        .clSetKernelArgSVMPointer
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    // SAFETY: a validated kernel; p is NULL or inside this tenant's allocation (the vendor
    // only records the value).
    let ret = unsafe { f(kernel, index, p as *const c_void) };
    status(ret)
}

/// `[kernel][param][size][value]`: SVM_PTRS (checked pointers) and FINE_GRAIN_SYSTEM; other
/// parameters are refused (their values could hold pointers hira cannot check).
pub fn h_clSetKernelExecInfo(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let kernel = cx.handle(r.u64()?, K_KERNEL)?;
    let param = r.u64()? as u32;
    let size = r.u64()?;
    let value_b = r.blob()?;
    r.finish()?;
    let f = cx
        .api
        .clSetKernelExecInfo
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    match param {
        CL_KERNEL_EXEC_INFO_SVM_PTRS => {
            let n = size / 8;
            if size % 8 != 0 || n > MAX_POINTERS {
                return Err(Fail::Cl(CL_INVALID_VALUE));
            }
            let ptrs = u64s(&cx.in_array::<u64>(value_b, n)?, n);
            let mut raw = Vec::with_capacity(ptrs.len());
            for &p in &ptrs {
                raw.push(checked(cx, p, 0, "clSetKernelExecInfo")? as usize);
            }
            let value = if ptrs.is_empty() && n > 0 {
                std::ptr::null()
            } else {
                raw.as_ptr() as *const c_void
            };
            // SAFETY: a validated kernel; `size` bytes of checked pointers (or null).
            let ret = unsafe { f(kernel, param, size as usize, value) };
            status(ret)
        }
        CL_KERNEL_EXEC_INFO_SVM_FINE_GRAIN_SYSTEM => {
            let v = cx.in_bytes(value_b, size)?;
            // SAFETY: a validated kernel; `size` readable bytes (or null).
            let ret = unsafe { f(kernel, param, size as usize, v.ptr() as *const c_void) };
            status(ret)
        }
        _ => {
            tracing::debug!(param, "clSetKernelExecInfo parameter not forwarded");
            status(CL_INVALID_VALUE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(allocs: &[(usize, usize)]) -> Table {
        let t = Table::default();
        for &(base, size) in allocs {
            t.lock().insert(
                base,
                Alloc {
                    size,
                    context: 1,
                    fine: false,
                },
            );
        }
        t
    }

    #[test]
    fn ranges_must_lie_inside_one_allocation() {
        let t = table(&[(0x1000, 0x100), (0x1100, 0x100), (0x3000, 0)]);

        assert!(t.contains(0x1000, 0x100));
        assert!(t.contains(0x10ff, 1));
        assert!(t.contains(0x1080, 0));
        assert!(t.contains(0x3000, 0));
        assert!(!t.contains(0x1080, 0x100), "spans two allocations");
        assert!(!t.contains(0xfff, 1));
        assert!(!t.contains(0x1200, 0), "one past the end");
        assert!(!t.contains(0x3000, 1));
        assert!(!t.contains(0x2000, 8));
        assert!(!t.contains(u64::MAX, 0));
        assert!(!t.contains(0x1000, u64::MAX));
    }
}
