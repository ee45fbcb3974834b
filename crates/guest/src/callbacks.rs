//! Callbacks delivered back to the application: registrations keyed by id, and one listener
//! thread per process on a connection of role ROLE_CALLBACKS that invokes them.

use crate::rt::{self, Connection};
use hira_opencl::{K_EVENT, K_PROGRAM};
use hira_wire::{control, Reader};
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Which C signature a callback has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // the names of the spec's callback kinds
pub enum CallbackKind {
    ContextNotify,
    ProgramNotify,
    EventNotify,
    ObjectNotify,
}

struct Registration {
    kind: CallbackKind,
    pfn: usize,
    user_data: usize,
}

fn registry() -> &'static Mutex<HashMap<u64, Registration>> {
    static R: OnceLock<Mutex<HashMap<u64, Registration>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

static NEXT: AtomicU64 = AtomicU64::new(1);

/// Register a callback and make sure the listener runs; returns the id sent to the server.
pub fn register(kind: CallbackKind, pfn: *mut c_void, user_data: *mut c_void) -> u64 {
    start_listener();
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    registry().lock().unwrap_or_else(|e| e.into_inner()).insert(
        id,
        Registration {
            kind,
            pfn: pfn as usize,
            user_data: user_data as usize,
        },
    );
    id
}

fn start_listener() {
    static STARTED: OnceLock<bool> = OnceLock::new();
    STARTED.get_or_init(|| {
        let Ok(conn) = Connection::open(control::ROLE_CALLBACKS) else {
            return false;
        };
        std::thread::Builder::new()
            .name("hira-callbacks".into())
            .spawn(move || listen(conn))
            .is_ok()
    });
}

fn listen(mut conn: Connection) {
    while let Ok((_h, payload)) = conn.next_frame() {
        let mut r = Reader::new(&payload);
        let Ok(id) = r.u64() else { continue };
        let reg = {
            let mut map = registry().lock().unwrap_or_else(|e| e.into_inner());
            let kind = map.get(&id).map(|r| r.kind);
            match kind {
                // Context notifications may come many times; the others once.
                Some(CallbackKind::ContextNotify) => {
                    map.get(&id).map(|r| (r.kind, r.pfn, r.user_data))
                }
                Some(_) => map.remove(&id).map(|r| (r.kind, r.pfn, r.user_data)),
                None => None,
            }
        };
        let Some((kind, pfn, ud)) = reg else { continue };
        let ud = ud as *mut c_void;
        match kind {
            CallbackKind::EventNotify => {
                let (Ok(ev), Ok(status)) = (r.u64(), r.i32()) else {
                    continue;
                };
                // The event may be a staged read's: its data must be in place first.
                crate::staged::drain();
                // SAFETY: the application registered this function with this signature.
                let f: extern "C" fn(*mut c_void, i32, *mut c_void) =
                    unsafe { std::mem::transmute(pfn) };
                let event = rt::shell(ev, K_EVENT);
                f(event, status, ud);
                // The reference clSetEventCallback took (`events.rs`).
                rt::event_unref(event);
            }
            CallbackKind::ProgramNotify => {
                let Ok(prog) = r.u64() else { continue };
                // SAFETY: as above.
                let f: extern "C" fn(*mut c_void, *mut c_void) =
                    unsafe { std::mem::transmute(pfn) };
                f(rt::shell(prog, K_PROGRAM), ud);
            }
            CallbackKind::ObjectNotify => {
                let (Ok(obj), Ok(kind)) = (r.u64(), r.u8()) else {
                    continue;
                };
                // SAFETY: as above.
                let f: extern "C" fn(*mut c_void, *mut c_void) =
                    unsafe { std::mem::transmute(pfn) };
                f(rt::shell(obj, kind), ud);
            }
            CallbackKind::ContextNotify => {
                let Ok(info) = r.bytes() else { continue };
                let mut msg = info.to_vec();
                msg.push(0);
                // SAFETY: as above.
                let f: extern "C" fn(*const c_char, *const c_void, usize, *mut c_void) =
                    unsafe { std::mem::transmute(pfn) };
                f(msg.as_ptr() as *const c_char, std::ptr::null(), 0, ud);
            }
        }
    }
}
