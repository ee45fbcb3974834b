//! Answers to info queries that cannot change, kept in the guest (as AvA and rCUDA do): a
//! platform's names and versions, a device's limits, a context's devices, a kernel's name
//! and argument count, a memory object's type, flags and size. Applications ask them over and over (pyopencl asks the platform's
//! name and version hundreds of times per test module), and each would otherwise be a round
//! trip of ~17 µs. Only what is fixed for the object's life is kept: never reference or map
//! counts, never a build status, never the device-memory sizes (the tenant's quota, which
//! `hira ctl` may change, is reported there), and of device parameters only the standard
//! ones (a vendor extension may report something live, such as free memory).
//!
//! Entries are keyed by the object's id, which the guest never reuses, so an answer cannot
//! outlive its object into another. The guest does not see objects die, so the answers of
//! dead ones stay until [`MAX_ENTRIES`] are kept; then everything is dropped and the cache
//! fills again.

use hira_opencl::{
    OP_CLGETCONTEXTINFO, OP_CLGETDEVICEINFO, OP_CLGETEVENTINFO, OP_CLGETEVENTPROFILINGINFO,
    OP_CLGETKERNELINFO, OP_CLGETMEMOBJECTINFO, OP_CLGETPLATFORMINFO,
};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Most answers kept.
pub const MAX_ENTRIES: usize = 1 << 16;

const CL_SUCCESS: i32 = 0;
const CL_INVALID_VALUE: i32 = -30;

/// Whether the answer to `param` of `op` is fixed for the object's life.
pub fn cacheable(op: u16, param: u32) -> bool {
    match op {
        OP_CLGETPLATFORMINFO => true,
        OP_CLGETDEVICEINFO => {
            const MAX_MEM_ALLOC_SIZE: u32 = 0x1010;
            const GLOBAL_MEM_SIZE: u32 = 0x101F;
            const AVAILABLE: u32 = 0x1027;
            const REFERENCE_COUNT: u32 = 0x1047;
            (0x1000..=0x107F).contains(&param)
                && !matches!(
                    param,
                    MAX_MEM_ALLOC_SIZE | GLOBAL_MEM_SIZE | AVAILABLE | REFERENCE_COUNT
                )
        }
        // CL_CONTEXT_DEVICES, PROPERTIES, NUM_DEVICES.
        OP_CLGETCONTEXTINFO => matches!(param, 0x1081..=0x1083),
        // CL_KERNEL_FUNCTION_NAME, NUM_ARGS, CONTEXT, PROGRAM, ATTRIBUTES.
        OP_CLGETKERNELINFO => matches!(param, 0x1190 | 0x1191 | 0x1193..=0x1195),
        // CL_MEM_TYPE, FLAGS, SIZE, HOST_PTR; CONTEXT, ASSOCIATED_MEMOBJECT, OFFSET,
        // USES_SVM_POINTER, PROPERTIES (not MAP_COUNT or REFERENCE_COUNT).
        OP_CLGETMEMOBJECTINFO => matches!(param, 0x1100..=0x1103 | 0x1106..=0x110A),
        // CL_EVENT_COMMAND_QUEUE, COMMAND_TYPE, CONTEXT (not the status or reference count).
        OP_CLGETEVENTINFO => matches!(param, 0x11D0 | 0x11D1 | 0x11D4),
        _ => false,
    }
}

type Key = (u16, u64, u32);

fn cache() -> MutexGuard<'static, HashMap<Key, Box<[u8]>>> {
    static C: OnceLock<Mutex<HashMap<Key, Box<[u8]>>>> = OnceLock::new();
    C.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The kept answer to this query, given the way the API gives it: `Some(status)` if there
/// is one (value and size written as the vendor would), `None` to ask the server.
///
/// # Safety
/// `value` is null or has `size` writable bytes; `size_ret` is null or writable.
pub unsafe fn lookup(
    op: u16,
    id: u64,
    param: u32,
    value: *mut u8,
    size: usize,
    size_ret: *mut usize,
) -> Option<i32> {
    // Profiling answers are never kept from the server, only set by `transfer_event`.
    if id == 0 || id == u64::MAX || !(cacheable(op, param) || op == OP_CLGETEVENTPROFILINGINFO) {
        return None;
    }
    let c = cache();
    let kept = c.get(&(op, id, param))?;
    // SAFETY: the caller's contract.
    Some(unsafe { answer(kept, value, size, size_ret) })
}

/// Writes a kept answer as the vendor would: CL_INVALID_VALUE if `value` is too small.
///
/// # Safety
/// As [`lookup`].
unsafe fn answer(kept: &[u8], value: *mut u8, size: usize, size_ret: *mut usize) -> i32 {
    if !value.is_null() {
        if size < kept.len() {
            return CL_INVALID_VALUE;
        }
        // SAFETY: `value` has at least kept.len() writable bytes (checked above).
        unsafe { std::ptr::copy_nonoverlapping(kept.as_ptr(), value, kept.len()) };
    }
    if !size_ret.is_null() {
        // SAFETY: writable by contract.
        unsafe { *size_ret = kept.len() };
    }
    CL_SUCCESS
}

/// Keeps a successful answer (`written` bytes at `value`, already in the application's
/// form: handles translated).
///
/// # Safety
/// `value` is null or has `written` readable bytes.
pub unsafe fn remember(op: u16, id: u64, param: u32, value: *const u8, written: u64) {
    if id == 0 || id == u64::MAX || value.is_null() || !cacheable(op, param) {
        return;
    }
    // SAFETY: the caller's contract.
    let bytes = unsafe { std::slice::from_raw_parts(value, written as usize) };
    let mut c = cache();
    if c.len() >= MAX_ENTRIES {
        c.clear();
    }
    c.insert((op, id, param), bytes.into());
}

/// Sets the answers for the event `event` points to (none if it is null or not ours).
///
/// # Safety
/// `event` is null or points to an event handle.
unsafe fn set(event: *mut *mut std::ffi::c_void, answers: &[(u16, u32, &[u8])]) {
    if event.is_null() {
        return;
    }
    // SAFETY: the caller's contract.
    let id = crate::rt::id_of(unsafe { *event });
    if id == 0 || id == u64::MAX {
        return;
    }
    let mut c = cache();
    if c.len() + answers.len() > MAX_ENTRIES {
        c.clear();
    }
    for &(op, param, bytes) in answers {
        c.insert((op, id, param), bytes.into());
    }
}

/// Event `id` is gone: its kept answers go (ids are never reused, this only frees room).
pub fn forget_event(id: u64) {
    let mut c = cache();
    if c.is_empty() {
        return;
    }
    for param in 0x11D0..=0x11D4 {
        c.remove(&(OP_CLGETEVENTINFO, id, param));
    }
    for param in 0x1280..=0x1284 {
        c.remove(&(OP_CLGETEVENTPROFILINGINFO, id, param));
    }
}

const CL_EVENT_COMMAND_TYPE: u32 = 0x11D1;

/// The command an event stands for, where the guest carried it out with other commands
/// (a map emulated by a read, an SVM map by a marker): the application is told what it
/// enqueued, as the vendor would tell it.
///
/// # Safety
/// `event` is null or points to the event handle the command wrote.
pub unsafe fn command_type(event: *mut *mut std::ffi::c_void, ty: u32) {
    // SAFETY: the caller's contract.
    unsafe {
        set(
            event,
            &[(OP_CLGETEVENTINFO, CL_EVENT_COMMAND_TYPE, &ty.to_le_bytes())],
        )
    };
}

/// A transfer done in place (`direct.rs`): its event, the unmap's, reports the command type
/// `ty` and the QUEUED, SUBMIT and START times `started` of the map, unless they are zero
/// (END and COMPLETE are the unmap's own, asked of the server).
///
/// # Safety
/// `event` is null or points to the event handle the unmap wrote.
pub unsafe fn transfer_event(event: *mut *mut std::ffi::c_void, ty: u32, started: [u64; 3]) {
    const QUEUED: u32 = 0x1280;
    let [q, s, t] = started.map(u64::to_le_bytes);
    let ty = ty.to_le_bytes();
    let all = [
        (OP_CLGETEVENTINFO, CL_EVENT_COMMAND_TYPE, &ty[..]),
        (OP_CLGETEVENTPROFILINGINFO, QUEUED, &q[..]),
        (OP_CLGETEVENTPROFILINGINFO, QUEUED + 1, &s[..]),
        (OP_CLGETEVENTPROFILINGINFO, QUEUED + 2, &t[..]),
    ];
    // No times: the queue does not profile for the application, whose queries the server
    // answers with CL_PROFILING_INFO_NOT_AVAILABLE.
    let n = if started[0] == 0 { 1 } else { all.len() };
    // SAFETY: the caller's contract.
    unsafe { set(event, &all[..n]) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_answers_that_cannot_change_are_kept() {
        assert!(cacheable(OP_CLGETPLATFORMINFO, 0x0902));
        assert!(cacheable(OP_CLGETDEVICEINFO, 0x102B)); // CL_DEVICE_NAME
        assert!(
            !cacheable(OP_CLGETDEVICEINFO, 0x101F),
            "global memory: the live quota"
        );
        assert!(
            !cacheable(OP_CLGETDEVICEINFO, 0x1010),
            "max allocation: the live quota"
        );
        assert!(!cacheable(OP_CLGETDEVICEINFO, 0x1047), "reference count");
        assert!(
            !cacheable(OP_CLGETDEVICEINFO, 0x4039),
            "a vendor's free memory"
        );
        assert!(cacheable(OP_CLGETCONTEXTINFO, 0x1081));
        assert!(!cacheable(OP_CLGETCONTEXTINFO, 0x1080), "reference count");
        assert!(cacheable(OP_CLGETKERNELINFO, 0x1190));
        assert!(!cacheable(OP_CLGETKERNELINFO, 0x1192), "reference count");
        assert!(cacheable(OP_CLGETMEMOBJECTINFO, 0x1102));
        assert!(!cacheable(OP_CLGETMEMOBJECTINFO, 0x1104), "map count");
        assert!(!cacheable(OP_CLGETMEMOBJECTINFO, 0x1105), "reference count");
        assert!(!cacheable(hira_opencl::OP_CLGETPROGRAMBUILDINFO, 0x1181));
        assert!(
            !cacheable(hira_opencl::OP_CLGETEVENTINFO, 0x11D3),
            "an event's status"
        );
        assert!(
            cacheable(hira_opencl::OP_CLGETEVENTINFO, 0x11D1),
            "command type"
        );
        assert!(!cacheable(hira_opencl::OP_CLGETIMAGEINFO, 0x1110));
    }

    #[test]
    fn kept_answers_come_back_as_the_vendor_gives_them() {
        // SAFETY: local buffers of the stated sizes.
        unsafe {
            let name = c"PoCL".to_bytes_with_nul();
            remember(OP_CLGETPLATFORMINFO, 7, 0x0902, name.as_ptr(), 5);
            let mut size = 0usize;
            let mut buf = [0u8; 8];
            let only_size = lookup(
                OP_CLGETPLATFORMINFO,
                7,
                0x0902,
                std::ptr::null_mut(),
                0,
                &mut size,
            );
            let small = lookup(
                OP_CLGETPLATFORMINFO,
                7,
                0x0902,
                buf.as_mut_ptr(),
                4,
                &mut size,
            );
            let full = lookup(
                OP_CLGETPLATFORMINFO,
                7,
                0x0902,
                buf.as_mut_ptr(),
                8,
                std::ptr::null_mut(),
            );
            let other = lookup(
                OP_CLGETPLATFORMINFO,
                8,
                0x0902,
                buf.as_mut_ptr(),
                8,
                &mut size,
            );

            assert_eq!(only_size, Some(CL_SUCCESS));
            assert_eq!(size, 5);
            assert_eq!(small, Some(CL_INVALID_VALUE));
            assert_eq!(full, Some(CL_SUCCESS));
            assert_eq!(&buf[..5], b"PoCL\0");
            assert_eq!(other, None, "another object");
        }
    }
}
