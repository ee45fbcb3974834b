//! Non-blocking reads (AvA's in-flight buffer registry): the server reads into a staging
//! buffer of its own; the guest copies the data into the application's memory when the
//! application synchronizes — clFinish, clWaitForEvents, a blocking transfer, an event status
//! query, or before an event callback runs. Running them blocking in the server instead would
//! deadlock a read gated on a user event that the application sets later.

use crate::stubs;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

struct Pending {
    staging: u64,
    dst: usize,
    size: usize,
}

fn pending() -> std::sync::MutexGuard<'static, Vec<Pending>> {
    static P: OnceLock<Mutex<Vec<Pending>>> = OnceLock::new();
    P.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

static NEXT: AtomicU64 = AtomicU64::new(1);
static ANY: AtomicU64 = AtomicU64::new(0);

/// `clEnqueueReadBuffer`: blocking reads go straight through; non-blocking ones are staged.
///
/// # Safety
/// Standard `clEnqueueReadBuffer` contract.
pub unsafe extern "C" fn clEnqueueReadBuffer(
    queue: *mut c_void,
    buffer: *mut c_void,
    blocking: u32,
    offset: usize,
    size: usize,
    ptr: *mut c_void,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    if blocking != 0 && nwait == 0 && size >= crate::transfer::PIPELINE_FROM && !ptr.is_null() {
        // SAFETY: forwarded contract (blocking, no wait list).
        return unsafe {
            crate::transfer::pipelined(false, queue, buffer, offset, size, ptr as *mut u8, event)
        };
    }
    if blocking != 0 || ptr.is_null() || size == 0 {
        // SAFETY: forwarded contract.
        return unsafe {
            stubs::clEnqueueReadBuffer(
                queue, buffer, blocking, offset, size, ptr, nwait, wait, event,
            )
        };
    }
    let staging = NEXT.fetch_add(1, Ordering::Relaxed);
    // SAFETY: forwarded contract; the event (if wanted) is named by the guest.
    let ret = unsafe {
        crate::hiraEnqueueReadBufferStaged(queue, buffer, offset, size, staging, nwait, wait, event)
    };
    if ret == 0 {
        pending().push(Pending {
            staging,
            dst: ptr as usize,
            size,
        });
        ANY.fetch_add(1, Ordering::Relaxed);
    }
    ret
}

/// Copy every staged read that has completed into the application's memory. The registry
/// stays locked throughout, so a thread that returns from here (say from clFinish) knows no
/// other thread (the callback listener) is still copying a read it depends on.
pub fn drain() {
    if ANY.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut list = pending();
    list.retain(|p| {
        // SAFETY: dst has size writable bytes (the application's read destination).
        let r = unsafe { crate::hiraFetchStaged(p.staging, p.size, p.dst as *mut c_void) };
        if r == 1 {
            return true;
        }
        ANY.fetch_sub(1, Ordering::Relaxed);
        false
    });
}

/// Calls after which staged reads may have completed.
pub fn drains_after(opcode: u16) -> bool {
    use hira_opencl::*;
    matches!(
        opcode,
        OP_CLFINISH
            | OP_CLWAITFOREVENTS
            | OP_CLGETEVENTINFO
            | OP_CLENQUEUEREADBUFFER
            | OP_CLENQUEUEREADBUFFERRECT
            | OP_CLENQUEUEREADIMAGE
            | OP_CLENQUEUEWRITEBUFFER
            | OP_CLENQUEUEWRITEBUFFERRECT
            | OP_CLENQUEUEWRITEIMAGE
    )
}

/// `clEnqueueWriteBuffer`: large blocking writes are pipelined; the rest go straight through.
///
/// # Safety
/// Standard `clEnqueueWriteBuffer` contract.
pub unsafe extern "C" fn clEnqueueWriteBuffer(
    queue: *mut c_void,
    buffer: *mut c_void,
    blocking: u32,
    offset: usize,
    size: usize,
    ptr: *const c_void,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    if blocking != 0 && nwait == 0 && size >= crate::transfer::PIPELINE_FROM && !ptr.is_null() {
        // SAFETY: forwarded contract (blocking, no wait list).
        return unsafe {
            crate::transfer::pipelined(true, queue, buffer, offset, size, ptr as *mut u8, event)
        };
    }
    // SAFETY: forwarded contract.
    unsafe {
        stubs::clEnqueueWriteBuffer(
            queue, buffer, blocking, offset, size, ptr, nwait, wait, event,
        )
    }
}
