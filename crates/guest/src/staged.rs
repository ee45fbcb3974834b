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
    /// The destination was freed (an SVM mirror): fetch into scratch memory instead.
    discard: bool,
    /// The thread whose connection carried the staging request (asynchronous, so a fetch on
    /// another thread's connection can reach the server before it).
    origin: std::thread::ThreadId,
}

fn pending() -> std::sync::MutexGuard<'static, Vec<Pending>> {
    static P: OnceLock<Mutex<Vec<Pending>>> = OnceLock::new();
    P.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

static NEXT: AtomicU64 = AtomicU64::new(1);
static ANY: AtomicU64 = AtomicU64::new(0);

/// A blocking transfer done in place (a buffer in the arena, `direct.rs`) or pipelined in
/// chunks (large, no wait list); `None` for the rest.
///
/// # Safety
/// As `clEnqueueReadBuffer` (`write`: as `clEnqueueWriteBuffer`), `ptr` as the call's.
#[allow(clippy::too_many_arguments)]
unsafe fn bulk(
    write: bool,
    queue: *mut c_void,
    buffer: *mut c_void,
    blocking: u32,
    offset: usize,
    size: usize,
    ptr: *mut u8,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> Option<i32> {
    // SAFETY: forwarded contract.
    let direct = unsafe {
        crate::direct::transfer(
            write, queue, buffer, blocking, offset, size, ptr, nwait, wait, event,
        )
    };
    if direct.is_some() {
        return direct;
    }
    if blocking != 0 && nwait == 0 && size >= crate::transfer::PIPELINE_FROM && !ptr.is_null() {
        // SAFETY: forwarded contract (blocking, no wait list).
        return Some(unsafe {
            crate::transfer::pipelined(write, queue, buffer, offset, size, ptr, event)
        });
    }
    None
}

/// `clEnqueueReadBuffer`: blocking reads of a buffer in the arena are copied in place (`direct.rs`),
/// other blocking reads go straight through; non-blocking ones are staged.
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
    // SAFETY: forwarded contract.
    if let Some(ret) = unsafe {
        bulk(
            false,
            queue,
            buffer,
            blocking,
            offset,
            size,
            ptr as *mut u8,
            nwait,
            wait,
            event,
        )
    } {
        return ret;
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
        push(staging, ptr as usize, size);
    }
    ret
}

/// A fresh staging id (SVM copies to the host use them too).
pub(crate) fn next_id() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Remember a staged read into `size` bytes at `dst`, fetched when the application synchronizes.
pub(crate) fn push(staging: u64, dst: usize, size: usize) {
    pending().push(Pending {
        staging,
        dst,
        size,
        discard: false,
        origin: std::thread::current().id(),
    });
    ANY.fetch_add(1, Ordering::Relaxed);
}

/// Memory `[lo, hi)` is being freed: staged reads headed there go to scratch memory.
pub(crate) fn discard(lo: usize, hi: usize) {
    if ANY.load(Ordering::Relaxed) == 0 {
        return;
    }
    for p in pending().iter_mut() {
        if p.dst < hi && p.dst.saturating_add(p.size) > lo {
            p.discard = true;
        }
    }
}

/// If staged read `staging` has not reached its destination yet, it never will (it is
/// fetched into scratch memory): true. False once it was delivered.
pub(crate) fn cancel(staging: u64) -> bool {
    if ANY.load(Ordering::Relaxed) == 0 {
        return false;
    }
    match pending().iter_mut().find(|p| p.staging == staging) {
        Some(p) => {
            p.discard = true;
            true
        }
        None => false,
    }
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
        let mut scratch = Vec::new();
        let dst = if p.discard {
            scratch.resize(p.size, 0u8);
            scratch.as_mut_ptr() as *mut c_void
        } else {
            p.dst as *mut c_void
        };
        // SAFETY: dst has size writable bytes (the application's read destination, or scratch).
        let r = unsafe { crate::hiraFetchStaged(p.staging, p.size, dst) };
        if r == 1 {
            return true;
        }
        if r == hira_opencl::cl::CL_INVALID_VALUE && std::thread::current().id() != p.origin {
            // Not staged yet as far as this connection can tell: the request is still on
            // its way on the origin's connection. Only the origin, whose connection is
            // ordered after the request, may conclude that staging failed.
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
            | OP_CLENQUEUESVMMEMCPY
            | OP_CLENQUEUESVMMAP
    )
}

/// `clEnqueueWriteBuffer`: blocking writes of a buffer in the arena are copied in place
/// (`direct.rs`), other large blocking writes are pipelined; the rest go straight through.
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
    // SAFETY: forwarded contract.
    if let Some(ret) = unsafe {
        bulk(
            true,
            queue,
            buffer,
            blocking,
            offset,
            size,
            ptr as *mut u8,
            nwait,
            wait,
            event,
        )
    } {
        return ret;
    }
    // SAFETY: forwarded contract.
    unsafe {
        stubs::clEnqueueWriteBuffer(
            queue, buffer, blocking, offset, size, ptr, nwait, wait, event,
        )
    }
}
