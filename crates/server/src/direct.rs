//! Buffers in the arena: one copy per transfer, as natively.
//!
//! Remoting a blocking write costs two copies: the guest copies the application's bytes into
//! the transport's shared memory, and the vendor copies them from there into the buffer. On
//! a CPU device the buffer's storage is host memory, so it can be memory the guest maps too.
//! Where the tenant's arena ([`crate::arena`], mapped at the same address in guest and server)
//! is in place and every device of the context is a CPU device, a plain buffer is made with
//! `CL_MEM_USE_HOST_PTR` on a range carved from the arena. The vendor keeps the bytes there
//! (PoCL does; OpenCL requires a map of such a buffer to return the host pointer), and a
//! transfer becomes: the vendor maps the region (`hiraEnqueueMapArena`, honouring queue
//! order and the wait list), the guest copies between the application's memory and the arena
//! in place, the vendor unmaps (`hiraEnqueueUnmapArena`, asynchronous). The application's
//! own maps of such a buffer hand out the arena pointer: no copy at all.
//!
//! What the tenant sees does not change: CL_MEM_FLAGS reports its own host-pointer flags,
//! CL_MEM_HOST_PTR is answered by the guest (NULL), errors are the vendor's (a placement the
//! vendor refuses falls back to an ordinary buffer, whose error is the one reported). Such
//! buffers are never evicted (`swap::Pin::Arena`), and none are placed while the router
//! over-subscribes the tenant's memory. `HIRA_ARENA_BUFFERS=0` turns placement off.
//!
//! The guest can scribble over its arena at any time; that is its own buffers' data, as a
//! native application may scribble over a USE_HOST_PTR buffer. Every map and unmap names a
//! buffer of this tenant that was placed here, and the unmapped pointer must lie inside it.

use crate::ctx::{Ctx, Fail, Shared};
use hira_opencl::cl::*;
use hira_opencl::*;
use hira_wire::{Reader, Writer};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard, Weak};

/// The host-pointer flags the tenant's own view keeps (the vendor's says USE_HOST_PTR).
const HOST_FLAGS: u64 = CL_MEM_USE_HOST_PTR | CL_MEM_ALLOC_HOST_PTR | CL_MEM_COPY_HOST_PTR;
/// Buffers at least this large start on a page (smaller ones on the arena's grain).
const PAGE: usize = 4096;

/// Where a buffer was placed, and the flags the tenant asked for.
#[derive(Clone, Copy, Debug)]
struct Placed {
    addr: usize,
    size: usize,
    flags: u64,
}

/// The tenant's buffers in the arena, by vendor object.
#[derive(Default)]
pub(crate) struct Buffers(Mutex<HashMap<usize, Placed>>);

impl Buffers {
    fn lock(&self) -> MutexGuard<'_, HashMap<usize, Placed>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, raw: *mut c_void) -> Option<Placed> {
        self.lock().get(&(raw as usize)).copied()
    }

    /// Number of buffers placed (tests and logs).
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

/// What the vendor's destructor callback needs to give a placement back.
struct Freed {
    shared: Weak<Shared>,
    raw: usize,
}

extern "C" fn destroyed(_mem: *mut c_void, user_data: *mut c_void) {
    // SAFETY: user_data is the Box made in `place`, handed to the vendor once; the vendor
    // calls each destructor callback once.
    let f = unsafe { Box::from_raw(user_data as *mut Freed) };
    let Some(shared) = f.shared.upgrade() else {
        return;
    };
    let placed = shared.direct.lock().remove(&f.raw);
    if let Some(p) = placed {
        if let Some(arena) = shared.svm.arena().as_mut() {
            arena.free(p.addr, p.size);
        }
    }
}

fn disabled() -> bool {
    std::env::var_os("HIRA_ARENA_BUFFERS").is_some_and(|v| v == "0")
}

/// Whether a buffer with these flags may go to the arena of this tenant in `context`.
fn eligible(cx: &Ctx, context: *mut c_void, flags: u64, size: usize, host: *const u8) -> bool {
    let no_host = flags & (CL_MEM_USE_HOST_PTR | crate::svm::HOST_PTR_IS_SVM) == 0;
    // A host pointer without COPY_HOST_PTR (or COPY without one) is an error: the vendor
    // reports it on the ordinary path.
    let host_ok = (flags & CL_MEM_COPY_HOST_PTR != 0) != host.is_null();
    no_host
        && host_ok
        && size > 0
        && !disabled()
        && !cx.gated()
        && cx.shared.svm.arena().is_some()
        && crate::svm::fine_grain_context(cx, context)
}

/// clCreateBuffer and clCreateBufferWithProperties: `[context]([properties])[flags][size]
/// [host bytes]` → `[status][id][arena address or 0]`.
fn create(cx: &mut Ctx, r: &mut Reader<'_>, with_properties: bool) -> Result<Writer, Fail> {
    let context = cx.handle(r.u64()?, K_CONTEXT)?;
    let properties_b = if with_properties {
        Some(r.blob()?)
    } else {
        None
    };
    let flags = r.u64()?;
    let size = r.u64()? as usize;
    let host_b = r.blob()?;
    r.finish()?;
    let properties = match properties_b {
        Some(b) => Some(cx.in_properties(b, false)?),
        None => None,
    };
    let host = cx.in_host_buffer(host_b, flags, size as u64)?;
    let props = properties.as_ref().map_or(std::ptr::null(), |p| p.ptr());
    let api = cx.api;
    let make = |flags: u64, host: *mut c_void, err: &mut i32| -> Result<*mut c_void, Fail> {
        // SAFETY: a validated context and property list; host is null or has `size` bytes
        // (the request's, or an arena range of that size).
        Ok(unsafe {
            if with_properties {
                let f = api
                    .clCreateBufferWithProperties
                    .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
                f(context, props, flags, size, host, err)
            } else {
                let f = api.clCreateBuffer.ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
                f(context, flags, size, host, err)
            }
        })
    };
    let mut err = CL_SUCCESS;
    let mut placed = 0usize;
    let mut raw = std::ptr::null_mut();
    if eligible(cx, context, flags, size, host.ptr()) {
        let align = if size >= PAGE {
            PAGE
        } else {
            crate::arena::GRAIN
        };
        let addr = cx
            .shared
            .svm
            .arena()
            .as_mut()
            .and_then(|a| a.alloc(size, align));
        if let Some(addr) = addr {
            if flags & CL_MEM_COPY_HOST_PTR != 0 {
                // SAFETY: the request's `size` bytes into a fresh arena range of that size.
                unsafe { std::ptr::copy_nonoverlapping(host.ptr(), addr as *mut u8, size) };
            }
            let vendor_flags = (flags & !HOST_FLAGS) | CL_MEM_USE_HOST_PTR;
            raw = make(vendor_flags, addr as *mut c_void, &mut err)?;
            if raw.is_null() || !keep(cx, raw, addr, size, flags) {
                if !raw.is_null() {
                    if let Some(release) = api.clReleaseMemObject {
                        // SAFETY: the object made just above, not yet known to anyone.
                        unsafe { release(raw) };
                    }
                    raw = std::ptr::null_mut();
                }
                if let Some(a) = cx.shared.svm.arena().as_mut() {
                    a.free(addr, size);
                }
                tracing::debug!(err, size, "arena placement refused; an ordinary buffer");
            } else {
                placed = addr;
            }
        }
    }
    if raw.is_null() {
        err = CL_SUCCESS;
        raw = make(
            Ctx::host_ptr_flags(flags),
            host.ptr() as *mut c_void,
            &mut err,
        )?;
    }
    let id = cx.register(raw, K_MEM);
    let mut w = Writer::default();
    w.i32(err);
    w.u64(id);
    w.u64(placed as u64);
    Ok(w)
}

/// Records a placed buffer and asks the vendor to say when it is gone; false (nothing
/// recorded) when it cannot.
fn keep(cx: &Ctx, raw: *mut c_void, addr: usize, size: usize, flags: u64) -> bool {
    let Some(set) = cx.api.clSetMemObjectDestructorCallback else {
        return false;
    };
    cx.shared
        .direct
        .lock()
        .insert(raw as usize, Placed { addr, size, flags });
    let ud = Box::into_raw(Box::new(Freed {
        shared: std::sync::Arc::downgrade(&cx.shared),
        raw: raw as usize,
    }));
    // SAFETY: a live memory object; the callback frees `ud` when the vendor destroys it.
    let ret = unsafe { set(raw, destroyed as *mut c_void, ud as *mut c_void) };
    if ret != CL_SUCCESS {
        // SAFETY: the vendor refused it, so it never calls back with ud.
        drop(unsafe { Box::from_raw(ud) });
        cx.shared.direct.lock().remove(&(raw as usize));
        return false;
    }
    true
}

pub fn h_clCreateBuffer(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    create(cx, r, false)
}

pub fn h_clCreateBufferWithProperties(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    create(cx, r, true)
}

/// The placement of `mem` or, for a sub-buffer, of its parent.
fn placement(cx: &Ctx, mem: *mut c_void) -> Option<Placed> {
    if cx.shared.direct.len() == 0 {
        return None;
    }
    if let Some(p) = cx.shared.direct.get(mem) {
        return Some(p);
    }
    let f = cx.api.clGetMemObjectInfo?;
    let mut parent: *mut c_void = std::ptr::null_mut();
    // SAFETY: a validated memory object; an 8-byte output.
    let r = unsafe {
        f(
            mem,
            CL_MEM_ASSOCIATED_MEMOBJECT,
            8,
            &mut parent as *mut *mut c_void as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    (r == CL_SUCCESS && !parent.is_null())
        .then(|| cx.shared.direct.get(parent))
        .flatten()
}

/// clGetMemObjectInfo, as generated, except that CL_MEM_FLAGS of a placed buffer (or of a
/// sub-buffer of one) reports the host-pointer flags the tenant asked for.
pub fn h_clGetMemObjectInfo(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let f = cx.api.clGetMemObjectInfo;
    crate::custom::info_query(
        cx,
        r,
        (OP_CLGETMEMOBJECTINFO, K_MEM),
        f,
        |_, _| None,
        |cx, mem, param, v| {
            if param != CL_MEM_FLAGS {
                return;
            }
            if let Some(p) = placement(cx, mem) {
                // SAFETY: at least 8 bytes at v, a cl_mem_flags result.
                unsafe { *v = (*v & !HOST_FLAGS) | (p.flags & HOST_FLAGS) };
            }
        },
    )
}

/// Where the vendor writes an enqueue's event: for the guest's event id (bound afterwards),
/// for hira's own device-time accounting, or nowhere.
fn event_slot(cx: &Ctx, event_id: u64, ev: &mut *mut c_void) -> *mut *mut c_void {
    if event_id != 0 || cx.wants_event(cx.gated()) {
        ev
    } else {
        std::ptr::null_mut()
    }
}

/// After an enqueue: the event goes to the guest's id (or is released once complete).
fn enqueued(cx: &mut Ctx, ret: i32, ev: *mut c_void, event_id: u64) -> Result<(), Fail> {
    let gated = cx.gated();
    cx.track_event(ret, ev, event_id == 0, gated, 0);
    if ret == CL_SUCCESS && event_id != 0 && !ev.is_null() {
        cx.bind(event_id, ev, K_EVENT)?;
    }
    Ok(())
}

/// A request naming a buffer that was not placed in the arena: refused and logged.
fn not_placed(op: &str) -> Fail {
    tracing::warn!(op, "a buffer that is not in the arena refused");
    Fail::Cl(CL_INVALID_MEM_OBJECT)
}

/// `hiraEnqueueMapArena`: the vendor maps `[offset, offset + size)` of a placed buffer; the
/// reply carries the mapped address, which lies in the arena, and, when asked for and the
/// queue profiles for the tenant, the map's queued, submit and start times (else zeros).
pub fn h_hiraEnqueueMapArena(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let queue = cx.handle(r.u64()?, K_QUEUE)?;
    let buffer = cx.handle(r.u64()?, K_MEM)?;
    let blocking = r.u64()? as u32;
    let flags = r.u64()?;
    let offset = r.u64()? as usize;
    let size = r.u64()? as usize;
    let nwait = r.u64()? as u32;
    let wait_b = r.blob()?;
    let event_id = r.u64()?;
    let mapped_o = r.out_spec()?;
    let started_o = r.out_spec()?;
    r.finish()?;
    let wait = cx.in_handles(wait_b, u64::from(nwait), K_EVENT)?;
    let mut mapped = cx.out(mapped_o, 8)?;
    let mut started = cx.out(started_o, 24)?;
    let Some(p) = cx.shared.direct.get(buffer) else {
        return Err(not_placed("hiraEnqueueMapArena"));
    };
    let f = cx
        .api
        .clEnqueueMapBuffer
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let mut ev: *mut c_void = std::ptr::null_mut();
    // The start of a blocking map, when asked for, comes from an event of its own.
    let times = started.ptr() as *mut u64;
    let times =
        (!times.is_null() && blocking != 0 && !cx.shared.unprofiled(queue)).then_some(times);
    let slot = if times.is_some() {
        &mut ev
    } else {
        event_slot(cx, event_id, &mut ev)
    };
    let mut err = CL_SUCCESS;
    // SAFETY: validated handles and wait list; the vendor checks the region and flags.
    let ptr = unsafe {
        f(
            queue,
            buffer,
            blocking,
            flags,
            offset,
            size,
            nwait,
            wait.ptr(),
            slot,
            &mut err,
        )
    };
    if let (Some(times), true) = (times, err == CL_SUCCESS && !ev.is_null()) {
        profile_start(cx, ev, times);
    }
    enqueued(cx, err, ev, event_id)?;
    if err == CL_SUCCESS && Some(ptr as usize) != p.addr.checked_add(offset) {
        // The vendor mapped elsewhere (OpenCL says it may not): the guest must not use it.
        tracing::warn!(
            at = format_args!("{ptr:p}"),
            "vendor mapped a buffer outside its host memory; unmapped"
        );
        if let Some(unmap) = cx.api.clEnqueueUnmapMemObject {
            // SAFETY: the mapping made just above.
            unsafe {
                unmap(
                    queue,
                    buffer,
                    ptr,
                    0,
                    std::ptr::null(),
                    std::ptr::null_mut(),
                )
            };
        }
        err = CL_MAP_FAILURE;
    }
    let out = mapped.ptr() as *mut u64;
    if !out.is_null() {
        // SAFETY: an 8-byte output slot.
        unsafe { *out = if err == CL_SUCCESS { ptr as u64 } else { 0 } };
    }
    let mut w = Writer::default();
    w.i32(err);
    mapped.emit(&mut w);
    started.emit(&mut w);
    Ok(w)
}

/// A completed event's CL_PROFILING_COMMAND_QUEUED, SUBMIT and START into `times` (three
/// u64; zeros where the vendor has none).
fn profile_start(cx: &Ctx, ev: *mut c_void, times: *mut u64) {
    const CL_PROFILING_COMMAND_QUEUED: u32 = 0x1280;
    let Some(f) = cx.api.clGetEventProfilingInfo else {
        return;
    };
    for i in 0..3 {
        // SAFETY: a completed event of this map; `times` has three u64 slots.
        unsafe {
            let slot = times.add(i);
            *slot = 0;
            f(
                ev,
                CL_PROFILING_COMMAND_QUEUED + i as u32,
                8,
                slot as *mut c_void,
                std::ptr::null_mut(),
            );
        }
    }
}

/// `hiraEnqueueUnmapArena`: unmaps what `hiraEnqueueMapArena` mapped.
pub fn h_hiraEnqueueUnmapArena(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let queue = cx.handle(r.u64()?, K_QUEUE)?;
    let mem = cx.handle(r.u64()?, K_MEM)?;
    let mapped = r.u64()?;
    let nwait = r.u64()? as u32;
    let wait_b = r.blob()?;
    let event_id = r.u64()?;
    r.finish()?;
    let wait = cx.in_handles(wait_b, u64::from(nwait), K_EVENT)?;
    let Some(p) = cx.shared.direct.get(mem) else {
        return Err(not_placed("hiraEnqueueUnmapArena"));
    };
    let inside =
        usize::try_from(mapped).is_ok_and(|m| m >= p.addr && m <= p.addr.saturating_add(p.size));
    if !inside {
        tracing::warn!(
            mapped = format_args!("{mapped:#x}"),
            "unmap of a pointer outside the buffer refused"
        );
        return Err(Fail::Cl(CL_INVALID_VALUE));
    }
    let f = cx
        .api
        .clEnqueueUnmapMemObject
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let mut ev: *mut c_void = std::ptr::null_mut();
    let slot = event_slot(cx, event_id, &mut ev);
    // SAFETY: validated handles and wait list; the vendor checks that `mapped` is a live
    // mapping of this buffer.
    let ret = unsafe {
        f(
            queue,
            mem,
            mapped as usize as *mut c_void,
            nwait,
            wait.ptr(),
            slot,
        )
    };
    enqueued(cx, ret, ev, event_id)?;
    let mut w = Writer::default();
    w.i32(ret);
    Ok(w)
}
