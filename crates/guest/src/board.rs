//! Waits for launch events without a round trip, on the event board
//! (`hira_transport::board`): this process's board is a memfd sent once on each connection
//! (`control::EVENT_BOARD`) before the connection's first launch that names an event; such
//! events' shells are marked, and the server's completion callback posts them there.
//!
//! `clWaitForEvents` on marked events sends what is batched (the launches may be in the
//! batch), then sleeps on the board. Anything but "every event posted, none failed, no
//! unreported error of an asynchronous call" — a failure, a slot a later event took, a wait
//! longer than [`LOCAL_WAIT`] (a long kernel, a launch the scheduler holds, a server that
//! died) — sends the wait to the server as before, which stays the authority on errors.
//! `HIRA_EVENT_BOARD=0` in the application's environment turns the board off.

use std::ffi::c_void;
use std::sync::atomic::AtomicPtr;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use hira_opencl::cl::CL_SUCCESS;
use hira_transport::board::Seen;
use hira_transport::EventBoard;

use crate::rt::{self, shell_ref};
use crate::stubs;

/// Longest a wait sleeps on the board before it asks the server. The board is for the short
/// waits of a tenant that keeps a device busy with short kernels, where a round trip weighs;
/// against a longer wait it weighs nothing. Tenants that slept here through other tenants'
/// turns (the scheduler holding their launches) did measurably worse: at 8 tenants under
/// BAND, 2–3% less throughput with a limit of 20 or 100 ms than with every wait through the
/// server, and none with 2 ms (four short- and four long-kernel tenants, runs alternated).
/// Why was not found.
const LOCAL_WAIT: Duration = Duration::from_millis(2);
/// Longest event list waited for on the board.
const MAX_EVENTS: usize = 64;

fn off() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    *OFF.get_or_init(|| std::env::var_os("HIRA_EVENT_BOARD").is_some_and(|v| v == "0"))
}

/// This process's board (null until made). Boards are leaked: events marked on one may be
/// waited for at any time.
static BOARD: AtomicPtr<EventBoard> = AtomicPtr::new(std::ptr::null_mut());

/// In the child of a fork: the inherited board is the parent's (its server posts there); the
/// child makes its own.
extern "C" fn forget_board() {
    BOARD.store(std::ptr::null_mut(), Relaxed);
}

/// This process's board, made on first use.
fn board() -> Option<&'static EventBoard> {
    let p = BOARD.load(Acquire);
    if !p.is_null() {
        // SAFETY: boards are leaked, never freed.
        return Some(unsafe { &*p });
    }
    static MAKING: Mutex<()> = Mutex::new(());
    let _g = MAKING.lock().unwrap_or_else(|e| e.into_inner());
    static AT_FORK: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a handler that only stores to an atomic.
    AT_FORK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(forget_board));
    });
    let p = BOARD.load(Acquire);
    if !p.is_null() {
        // SAFETY: as above.
        return Some(unsafe { &*p });
    }
    let made = EventBoard::create()
        .map_err(|e| {
            if std::env::var_os("HIRA_DEBUG").is_some() {
                eprintln!("hira: no event board: {e}");
            }
        })
        .ok()?;
    let p = Box::into_raw(Box::new(made));
    BOARD.store(p, Release);
    // SAFETY: just leaked.
    Some(unsafe { &*p })
}

/// The board, if this thread's connection has sent it to the server.
fn sent() -> Option<&'static EventBoard> {
    if off() {
        return None;
    }
    let b = board()?;
    rt::with_conn(|c| c.send_board_once(b)).ok()?;
    Some(b)
}

/// After a launch named its event `p`: the event is waited for on the board.
pub(crate) fn mark(p: *mut *mut c_void) {
    if p.is_null() || sent().is_none() {
        return;
    }
    // SAFETY: the stub wrote the new shell there.
    if let Some(s) = shell_ref(unsafe { *p }) {
        s.on_board.store(true, Relaxed);
    }
}

/// `clWaitForEvents`: launch events are waited for on the board, the rest by the server.
///
/// # Safety
/// Standard `clWaitForEvents` contract.
pub unsafe extern "C" fn clWaitForEvents(num_events: u32, event_list: *const *mut c_void) -> i32 {
    // SAFETY: forwarded contract.
    if let Some(ret) = unsafe { local_wait(num_events, event_list) } {
        return ret;
    }
    // SAFETY: forwarded contract.
    unsafe { stubs::clWaitForEvents(num_events, event_list) }
}

/// # Safety
/// `list` is null or holds `n` readable pointers.
unsafe fn local_wait(n: u32, list: *const *mut c_void) -> Option<i32> {
    let n = n as usize;
    if n == 0 || n > MAX_EVENTS || list.is_null() || off() {
        return None;
    }
    // SAFETY: n readable pointers by contract.
    let events = unsafe { std::slice::from_raw_parts(list, n) };
    let mut ids = [0u64; MAX_EVENTS];
    for (id, &e) in ids.iter_mut().zip(events) {
        let s = shell_ref(e).filter(|s| s.on_board.load(Relaxed))?;
        *id = s.id;
    }
    let board = board()?;
    rt::flush_batch().ok()?;
    let deadline = Instant::now() + LOCAL_WAIT;
    for &id in &ids[..n] {
        if board.wait(id, deadline) != Seen::Done {
            return None;
        }
    }
    if board.has_deferred() {
        return None;
    }
    crate::staged::drain();
    Some(rt::take_deferred().unwrap_or(CL_SUCCESS))
}
