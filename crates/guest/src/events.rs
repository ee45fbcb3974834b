//! The lifetime of event shells. An application may make millions of events (a launch each),
//! so a shell cannot outlive the application's last reference to its event, as shells of
//! other kinds do (there are few of those, and they live as long as their objects): the guest
//! counts the application's references — one at creation, `clRetainEvent`, `clReleaseEvent`
//! — and a registered event callback holds one until it has run (natively the event is valid
//! in its callback even if the application released it). The last reference frees the shell.
//! A released event's pointer then means nothing, as natively.

use std::ffi::c_void;

use crate::rt;
use crate::stubs;

/// # Safety
/// Standard `clRetainEvent` contract.
pub unsafe extern "C" fn clRetainEvent(event: *mut c_void) -> i32 {
    // SAFETY: forwarded contract.
    let ret = unsafe { stubs::clRetainEvent(event) };
    rt::event_ref(event);
    ret
}

/// # Safety
/// Standard `clReleaseEvent` contract.
pub unsafe extern "C" fn clReleaseEvent(event: *mut c_void) -> i32 {
    // SAFETY: forwarded contract.
    let ret = unsafe { stubs::clReleaseEvent(event) };
    rt::event_unref(event);
    ret
}

/// # Safety
/// Standard `clSetEventCallback` contract.
pub unsafe extern "C" fn clSetEventCallback(
    event: *mut c_void,
    command_exec_callback_type: i32,
    pfn_notify: *mut c_void,
    user_data: *mut c_void,
) -> i32 {
    // Held until the callback has run (`callbacks.rs`).
    rt::event_ref(event);
    // SAFETY: forwarded contract.
    let ret = unsafe {
        stubs::clSetEventCallback(event, command_exec_callback_type, pfn_notify, user_data)
    };
    if ret != hira_opencl::cl::CL_SUCCESS {
        rt::event_unref(event);
    }
    ret
}
