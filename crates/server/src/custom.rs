//! Server halves written by hand (the spec marks them `custom_server` or `custom`).

use crate::ctx::{Ctx, Fail};
use hira_opencl::cl::*;
use hira_opencl::*;
use hira_wire::{Reader, Writer};
use std::ffi::c_void;

pub use crate::direct::{
    h_clCreateBuffer, h_clCreateBufferWithProperties, h_clGetMemObjectInfo, h_hiraEnqueueMapArena,
    h_hiraEnqueueUnmapArena,
};
pub use crate::svm::{
    h_clEnqueueSVMFree, h_clEnqueueSVMMap, h_clEnqueueSVMMemFill, h_clEnqueueSVMMemcpy,
    h_clEnqueueSVMMigrateMem, h_clEnqueueSVMUnmap, h_clSVMAlloc, h_clSVMFree,
    h_clSetKernelArgSVMPointer, h_clSetKernelExecInfo,
};

/// A vendor info query of the shape `(object, param, size, value, size_ret)`.
pub(crate) type InfoFn =
    unsafe extern "C" fn(*mut c_void, u32, usize, *mut c_void, *mut usize) -> i32;

/// An info query as the generated handlers run it, answered with `refuse(cx, object)`
/// instead of asking the vendor when that is an error code, and with `fix` applied to a
/// successful answer of at least 8 bytes (`fix(cx, object, param, value)`) before handles
/// are translated.
pub(crate) fn info_query(
    cx: &mut Ctx,
    r: &mut Reader<'_>,
    (op, kind): (u16, u8),
    f: Option<InfoFn>,
    refuse: impl FnOnce(&Ctx, *mut c_void) -> Option<i32>,
    fix: impl FnOnce(&Ctx, *mut c_void, u32, *mut u64),
) -> Result<Writer, Fail> {
    let object = cx.handle(r.u64()?, kind)?;
    let param = r.u64()? as u32;
    let size = r.u64()?;
    let (vo, so) = (r.out_spec()?, r.out_spec()?);
    r.finish()?;
    let mut value = cx.out(vo, size)?;
    let mut size_ret = cx.out(so, 8)?;
    let f = f.ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let vp = cx.info_ptr(op, param, &mut value);
    let ret = match refuse(cx, object) {
        Some(code) => code,
        // SAFETY: outputs sized as the spec says; the object validated.
        None => unsafe {
            f(
                object,
                param,
                size as usize,
                vp,
                size_ret.ptr() as *mut usize,
            )
        },
    };
    if ret == CL_SUCCESS && size >= 8 && !vp.is_null() {
        fix(cx, object, param, vp as *mut u64);
    }
    cx.info_out(op, param, &mut value, ret)?;
    let mut w = Writer::default();
    w.i32(ret);
    value.emit(&mut w);
    size_ret.emit(&mut w);
    Ok(w)
}

/// Device info as the tenant sees it: of SVM, what hira forwards (`svm::capabilities`:
/// fine-grained only on a CPU device, never system SVM); the quota bounds the memory sizes.
pub fn h_clGetDeviceInfo(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let f = cx.api.clGetDeviceInfo;
    info_query(
        cx,
        r,
        (OP_CLGETDEVICEINFO, K_DEVICE),
        f,
        |_, _| None,
        |cx, device, param, v| {
            let quota = cx.shared.quota.load(std::sync::atomic::Ordering::Relaxed);
            match param {
                CL_DEVICE_SVM_CAPABILITIES | crate::svm::CL_DEVICE_SVM_CAPABILITIES_ARM => {
                    // SAFETY: at least 8 bytes at v, a cl_bitfield result.
                    unsafe { *v = crate::svm::capabilities(cx, device, *v) }
                }
                CL_DEVICE_GLOBAL_MEM_SIZE | CL_DEVICE_MAX_MEM_ALLOC_SIZE if quota != 0 => {
                    // SAFETY: at least 8 bytes at v, a cl_ulong result.
                    unsafe { *v = (*v).min(quota) }
                }
                _ => {}
            }
        },
    )
}

/// Queues always profile, so device time is measured by the device.
pub fn h_clCreateCommandQueue(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let context = cx.handle(r.u64()?, K_CONTEXT)?;
    let device = cx.handle(r.u64()?, K_DEVICE)?;
    let props = r.u64()?;
    r.finish()?;
    let f = cx
        .api
        .clCreateCommandQueue
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let mut err = 0i32;
    // SAFETY: validated handles; err is a live output.
    let q = unsafe { f(context, device, props | CL_QUEUE_PROFILING_ENABLE, &mut err) };
    let id = cx.register(q, K_QUEUE);
    remember_profiling(cx, id, props & CL_QUEUE_PROFILING_ENABLE != 0);
    let mut w = Writer::default();
    w.i32(err);
    w.u64(id);
    Ok(w)
}

pub fn h_clCreateCommandQueueWithProperties(
    cx: &mut Ctx,
    r: &mut Reader<'_>,
) -> Result<Writer, Fail> {
    let context = cx.handle(r.u64()?, K_CONTEXT)?;
    let device = cx.handle(r.u64()?, K_DEVICE)?;
    let pb = r.blob()?;
    r.finish()?;
    let given = cx.in_properties(pb, false)?;
    let mut props: Vec<u64> = Vec::new();
    let mut found = false;
    let mut asked = false;
    let mut i = 0;
    // SAFETY: in_properties returns a zero-terminated list (or null).
    while !given.ptr().is_null() && unsafe { *given.ptr().add(i) } != 0 {
        // SAFETY: non-zero keys have values.
        let (k, mut v) = unsafe { (*given.ptr().add(i), *given.ptr().add(i + 1)) };
        if k == CL_QUEUE_PROPERTIES {
            asked = v & CL_QUEUE_PROFILING_ENABLE != 0;
            v |= CL_QUEUE_PROFILING_ENABLE;
            found = true;
        }
        props.extend([k, v]);
        i += 2;
    }
    if !found {
        props.extend([CL_QUEUE_PROPERTIES, CL_QUEUE_PROFILING_ENABLE]);
    }
    props.push(0);
    let f = cx
        .api
        .clCreateCommandQueueWithProperties
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let mut err = 0i32;
    // SAFETY: validated handles; props is zero-terminated.
    let q = unsafe { f(context, device, props.as_ptr(), &mut err) };
    let id = cx.register(q, K_QUEUE);
    remember_profiling(cx, id, asked);
    let mut w = Writer::default();
    w.i32(err);
    w.u64(id);
    Ok(w)
}

/// Records a new queue (`id`, 0 if none was made) that the tenant made without profiling.
fn remember_profiling(cx: &Ctx, id: u64, asked: bool) {
    if id != 0 && !asked {
        cx.shared
            .unprofiled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id);
    }
}

/// CL_QUEUE_PROPERTIES as the tenant asked: without profiling if it did not ask for it.
pub fn h_clGetCommandQueueInfo(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let f = cx.api.clGetCommandQueueInfo;
    info_query(
        cx,
        r,
        (OP_CLGETCOMMANDQUEUEINFO, K_QUEUE),
        f,
        |_, _| None,
        |cx, queue, param, v| {
            if u64::from(param) == CL_QUEUE_PROPERTIES && cx.shared.unprofiled(queue) {
                // SAFETY: at least 8 bytes at v, a cl_bitfield result.
                unsafe { *v &= !CL_QUEUE_PROFILING_ENABLE };
            }
        },
    )
}

/// Profiling of a command on a queue the tenant made without profiling is
/// CL_PROFILING_INFO_NOT_AVAILABLE, as the vendor would answer it.
pub fn h_clGetEventProfilingInfo(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    const CL_PROFILING_INFO_NOT_AVAILABLE: i32 = -7;
    const CL_EVENT_COMMAND_QUEUE: u32 = 0x11D0;
    let f = cx.api.clGetEventProfilingInfo;
    let refuse = |cx: &Ctx, event: *mut c_void| {
        let info = cx.api.clGetEventInfo?;
        let mut queue: *mut c_void = std::ptr::null_mut();
        // SAFETY: a validated event; an 8-byte output.
        unsafe {
            info(
                event,
                CL_EVENT_COMMAND_QUEUE,
                8,
                &mut queue as *mut *mut c_void as *mut c_void,
                std::ptr::null_mut(),
            )
        };
        (!queue.is_null() && cx.shared.unprofiled(queue)).then_some(CL_PROFILING_INFO_NOT_AVAILABLE)
    };
    info_query(
        cx,
        r,
        (OP_CLGETEVENTPROFILINGINFO, K_EVENT),
        f,
        refuse,
        |_, _, _, _| {},
    )
}

/// One device's program binary into the caller's output.
pub fn h_hiraGetProgramBinary(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let program = cx.handle(r.u64()?, K_PROGRAM)?;
    let index = r.u64()? as usize;
    let size = r.u64()?;
    let o = r.out_spec()?;
    r.finish()?;
    let mut out = cx.out(o, size)?;
    let f = cx
        .api
        .clGetProgramInfo
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let mut n: u32 = 0;
    // SAFETY: validated program; 4-byte output.
    let ret = unsafe {
        f(
            program,
            CL_PROGRAM_NUM_DEVICES,
            4,
            &mut n as *mut u32 as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    if ret != CL_SUCCESS || index >= n as usize {
        return Err(Fail::Cl(if ret != CL_SUCCESS {
            ret
        } else {
            CL_INVALID_VALUE
        }));
    }
    let mut sizes = vec![0usize; n as usize];
    // SAFETY: n size_t outputs.
    unsafe {
        f(
            program,
            CL_PROGRAM_BINARY_SIZES,
            n as usize * 8,
            sizes.as_mut_ptr() as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    if (sizes[index] as u64) > size {
        return Err(Fail::Cl(CL_INVALID_VALUE));
    }
    let mut ptrs = vec![std::ptr::null_mut::<c_void>(); n as usize];
    ptrs[index] = out.ptr();
    // SAFETY: one non-null destination with room for its binary (checked above).
    let ret = unsafe {
        f(
            program,
            CL_PROGRAM_BINARIES,
            n as usize * 8,
            ptrs.as_mut_ptr() as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    let mut w = Writer::default();
    w.i32(ret);
    out.emit(&mut w);
    Ok(w)
}

/// Map and unmap are emulated in the guest with reads and writes; nothing reaches here.
pub fn h_clEnqueueMapBuffer(_cx: &mut Ctx, _r: &mut Reader<'_>) -> Result<Writer, Fail> {
    Err(Fail::Cl(CL_INVALID_OPERATION))
}
pub fn h_clEnqueueMapImage(_cx: &mut Ctx, _r: &mut Reader<'_>) -> Result<Writer, Fail> {
    Err(Fail::Cl(CL_INVALID_OPERATION))
}
pub fn h_clEnqueueUnmapMemObject(_cx: &mut Ctx, _r: &mut Reader<'_>) -> Result<Writer, Fail> {
    Err(Fail::Cl(CL_INVALID_OPERATION))
}

/// A non-blocking read into a server-side staging buffer (see the spec).
pub fn h_hiraEnqueueReadBufferStaged(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let queue = cx.handle(r.u64()?, K_QUEUE)?;
    let buffer = cx.handle(r.u64()?, K_MEM)?;
    let offset = r.u64()? as usize;
    let size = r.u64()?;
    let staging = r.u64()?;
    let nwait = r.u64()? as u32;
    let wait_b = r.blob()?;
    let event_id = r.u64()?;
    r.finish()?;
    let wait = cx.in_handles(wait_b, u64::from(nwait), K_EVENT)?;
    if size > 1 << 31 {
        return Err(Fail::Cl(CL_INVALID_VALUE));
    }
    let f = cx
        .api
        .clEnqueueReadBuffer
        .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
    let gated = cx.gated();
    let mut data = vec![0u8; size as usize];
    let mut ev: *mut c_void = std::ptr::null_mut();
    // SAFETY: validated handles; data has `size` bytes and lives in the staging table until
    // the read completes (fetched or the tenant goes away), or is waited for below.
    let ret = unsafe {
        f(
            queue,
            buffer,
            CL_FALSE,
            offset,
            size as usize,
            data.as_mut_ptr() as *mut c_void,
            nwait,
            wait.ptr(),
            &mut ev,
        )
    };
    if ret != CL_SUCCESS || ev.is_null() {
        // A resident call while over-subscribed: the router holds a slot for it.
        cx.track_event(ret, ev, false, gated, 0);
        let mut w = Writer::default();
        w.i32(ret);
        return Ok(w);
    }
    let retain = cx.api.clRetainEvent;
    if gated {
        if let Some(retain) = retain {
            // SAFETY: a live event; the completion callback releases this extra reference.
            unsafe { retain(ev) };
            cx.track_event(ret, ev, true, true, 0);
        } else {
            cx.track_event(ret, ev, false, true, 0);
        }
    }
    stage_read(cx, ev, event_id, staging, data)?;
    let mut w = Writer::default();
    w.i32(ret);
    Ok(w)
}

/// Hands an enqueued read's `data` (which the vendor is writing) and its event `ev` to the
/// staging entry `staging`, binding `ev` to the guest's `event_id` (0: none). The vendor's
/// reference goes to the guest's event or to the staging entry; with an event id the
/// staging entry takes one more. On failure the read is waited for before `data` goes, and
/// the references this call owns are released.
pub(crate) fn stage_read(
    cx: &mut Ctx,
    ev: *mut c_void,
    event_id: u64,
    staging: u64,
    data: Vec<u8>,
) -> Result<(), Fail> {
    let (retain, release) = (cx.api.clRetainEvent, cx.api.clReleaseEvent);
    let bound = if event_id != 0 {
        if let Some(retain) = retain {
            // SAFETY: a live event; the staging entry holds this extra reference.
            unsafe { retain(ev) };
        }
        cx.bind(event_id, ev, K_EVENT).map_err(|e| (e, true))
    } else {
        Ok(())
    };
    let staged = match bound {
        Ok(()) => cx.stage(staging, data, ev).map_err(|(e, d)| (e, false, d)),
        Err((e, unbound)) => Err((e, unbound, data)),
    };
    if let Err((e, unbound, data)) = staged {
        // The read is writing into `data`: it must finish before `data` goes.
        if let Some(wait) = cx.api.clWaitForEvents {
            // SAFETY: ev is live (this function still holds its references).
            unsafe { wait(1, &ev) };
        }
        drop(data);
        if let Some(release) = release {
            // The staging entry's reference, and the guest's if it was never bound.
            let n = if event_id != 0 && unbound { 2 } else { 1 };
            for _ in 0..n {
                // SAFETY: references this function owns (see above).
                unsafe { release(ev) };
            }
        }
        return Err(e);
    }
    Ok(())
}

/// Copy a staged read out once its event completed; 1 while it is still running.
pub fn h_hiraFetchStaged(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {
    let staging = r.u64()?;
    let size = r.u64()?;
    let o = r.out_spec()?;
    r.finish()?;
    let mut out = cx.out(o, size)?;
    let ret = cx.fetch_staged(staging, &mut out, size)?;
    let mut w = Writer::default();
    w.i32(ret);
    out.emit(&mut w);
    Ok(w)
}
