//! Transfers and maps of buffers the server placed in the arena (the server's `direct.rs`):
//! the vendor maps the region in place, and this process, which maps the arena at the same
//! address, copies straight between the application's memory and the buffer's bytes. A
//! blocking write or read costs one round trip (the map) and one copy, as natively; the
//! unmap travels asynchronously. An application's own map of such a buffer gets the arena
//! pointer itself.

use crate::rt::shell_ref;
use hira_opencl::cl::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Blocking transfers at least this large go through a map when they can (below it, the
/// asynchronous unmap costs more than the copy it saves).
pub const DIRECT_FROM: usize = 16 << 10;

/// Whether the server placed the buffer in the arena.
pub fn placed(mem: *mut c_void) -> bool {
    shell_ref(mem).is_some_and(|s| s.in_arena.load(Ordering::Relaxed))
}

/// The application's live maps of placed buffers: (buffer, address) → how many times mapped
/// there (the vendor hands out one address for each map of a region). An unmap of anything
/// else is refused at once, as the vendor would.
fn live() -> MutexGuard<'static, HashMap<(usize, usize), u32>> {
    static M: OnceLock<Mutex<HashMap<(usize, usize), u32>>> = OnceLock::new();
    M.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// `clEnqueueMapBuffer` of a placed buffer: the arena address itself.
///
/// # Safety
/// As `clEnqueueMapBuffer`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn app_map(
    queue: *mut c_void,
    buffer: *mut c_void,
    blocking: u32,
    flags: u64,
    offset: usize,
    size: usize,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> Result<*mut u8, i32> {
    // SAFETY: forwarded contract.
    let p = unsafe {
        map(
            queue,
            buffer,
            blocking,
            flags,
            offset,
            size,
            nwait,
            wait,
            event,
            std::ptr::null_mut(),
        )
    }?;
    *live().entry((buffer as usize, p as usize)).or_insert(0) += 1;
    Ok(p)
}

/// `clEnqueueUnmapMemObject` of a placed buffer.
///
/// # Safety
/// As `clEnqueueUnmapMemObject`.
pub unsafe fn app_unmap(
    queue: *mut c_void,
    buffer: *mut c_void,
    mapped: *mut c_void,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    {
        let mut live = live();
        let key = (buffer as usize, mapped as usize);
        match live.get_mut(&key) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                live.remove(&key);
            }
            None => return CL_INVALID_VALUE,
        }
    }
    // SAFETY: forwarded contract; a live map of this buffer.
    unsafe { unmap(queue, buffer, mapped, nwait, wait, event) }
}

/// Maps `[offset, offset + size)` of a placed buffer; the address lies in this process's
/// arena (anything else is unmapped again and reported as CL_MAP_FAILURE). A blocking map
/// writes its QUEUED, SUBMIT and START times to `started` unless that is null.
///
/// # Safety
/// As `clEnqueueMapBuffer`; `event` and `started` are null or writable.
#[allow(clippy::too_many_arguments)]
unsafe fn map(
    queue: *mut c_void,
    buffer: *mut c_void,
    blocking: u32,
    flags: u64,
    offset: usize,
    size: usize,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
    started: *mut [u64; 3],
) -> Result<*mut u8, i32> {
    let mut mapped = 0u64;
    // SAFETY: forwarded contract; mapped is a live 8-byte output.
    let ret = unsafe {
        crate::hiraEnqueueMapArena(
            queue,
            buffer,
            blocking,
            flags,
            offset,
            size,
            nwait,
            wait,
            event,
            &mut mapped,
            started as *mut u64,
        )
    };
    if ret != CL_SUCCESS {
        return Err(ret);
    }
    let p = mapped as usize;
    if !crate::svm::in_arena(p, size) {
        crate::svm::log("a buffer map outside the arena; unmapped");
        // SAFETY: the mapping just made.
        unsafe {
            unmap(
                queue,
                buffer,
                p as *mut c_void,
                0,
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        };
        return Err(CL_MAP_FAILURE);
    }
    Ok(p as *mut u8)
}

/// Unmaps what [`map`] mapped (asynchronous: errors surface at the next synchronizing call).
///
/// # Safety
/// As `clEnqueueUnmapMemObject`.
unsafe fn unmap(
    queue: *mut c_void,
    buffer: *mut c_void,
    mapped: *mut c_void,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    // SAFETY: forwarded contract.
    unsafe { crate::hiraEnqueueUnmapArena(queue, buffer, mapped as u64, nwait, wait, event) }
}

/// `clEnqueue{Read,Write}Buffer` of a placed buffer, when it blocks and moves at least
/// [`DIRECT_FROM`] bytes: map, copy, unmap, then what a blocking transfer makes the guest do
/// (staged reads that completed are delivered). None otherwise (the caller takes the
/// ordinary path). The application's event is the unmap's; the guest answers for it what
/// the vendor's read or write would: its command type, and its QUEUED, SUBMIT and START
/// times, which are the map's (END and COMPLETE are the unmap's), so the event spans the
/// whole transfer.
///
/// # Safety
/// As `clEnqueue{Read,Write}Buffer`; `host` has `size` bytes (readable for writes, writable
/// for reads).
#[allow(clippy::too_many_arguments)]
pub unsafe fn transfer(
    write: bool,
    queue: *mut c_void,
    buffer: *mut c_void,
    blocking: u32,
    offset: usize,
    size: usize,
    host: *mut u8,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> Option<i32> {
    if blocking == 0 || size < DIRECT_FROM || host.is_null() || !placed(buffer) {
        return None;
    }
    let mut started = [0u64; 3];
    let flags = if write {
        CL_MAP_WRITE_INVALIDATE_REGION
    } else {
        CL_MAP_READ
    };
    // SAFETY: forwarded contract, blocking, no event.
    let p = match unsafe {
        map(
            queue,
            buffer,
            CL_TRUE,
            flags,
            offset,
            size,
            nwait,
            wait,
            std::ptr::null_mut(),
            if event.is_null() {
                std::ptr::null_mut()
            } else {
                &mut started
            },
        )
    } {
        Ok(p) => p,
        Err(e) => return Some(e),
    };
    // SAFETY: p has `size` mapped bytes in the arena; host has `size` bytes (caller); they
    // cannot overlap (the arena is hira's own mapping).
    unsafe {
        if write {
            std::ptr::copy_nonoverlapping(host as *const u8, p, size);
        } else {
            std::ptr::copy_nonoverlapping(p as *const u8, host, size);
        }
    }
    // SAFETY: the mapping made above; `event` is null or writable (caller).
    let ret = unsafe { unmap(queue, buffer, p as *mut c_void, 0, std::ptr::null(), event) };
    if ret == CL_SUCCESS && !event.is_null() {
        let ty = if write {
            CL_COMMAND_WRITE_BUFFER
        } else {
            CL_COMMAND_READ_BUFFER
        };
        // SAFETY: the event the unmap wrote.
        unsafe { crate::infocache::transfer_event(event, ty, started) };
    }
    crate::staged::drain();
    Some(ret)
}
