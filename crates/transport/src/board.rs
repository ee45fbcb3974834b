//! The event board: completions of a tenant's kernel launches, posted by its API server in
//! memory the guest shares, so that `clWaitForEvents` on launch events needs no round trip.
//!
//! A synchronous wait through the router costs a send, a wake-up of the server's thread (which
//! then sleeps in the vendor's wait and is woken again) and a reply that wakes the guest. On a
//! CPU device every wake-up is taken from the kernels. Here the server's completion callback
//! (it has one per launch anyway, for device time) writes the event's word and wakes the guest
//! only if a guest thread sleeps on the board: one wake-up, as natively.
//!
//! Layout: a header page (the guest's count of sleeping waiters, on a line of its own; the
//! server's count of connections holding an error of an asynchronous call that no reply has
//! reported yet, on another), then [`SLOTS`] 32-bit words. An event's slot is its guest id
//! modulo [`SLOTS`]; its word holds the low 31 bits of the id of the last event posted there,
//! shifted left by one, and a failure bit. The guest compares the sequence number in the word
//! with the one it waits for: equal — posted; older — not yet (wait); newer — the slot was
//! taken by a later event, so the guest cannot tell and asks the server instead. Every answer
//! that is not "posted, succeeded" sends the guest back to the round trip, which stays the
//! authority on errors: the board can only save time, never change an outcome.
//!
//! The wake-up protocol is Dekker's, as in [`crate::CompletionPage`]: the server writes the
//! word and then reads the waiter count; a guest thread raises the count and then reads the
//! word before it sleeps on it (all sequentially consistent). A guest that scribbles on the
//! board misleads only its own waits.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::time::Instant;

use crate::{Result, ShmRegion};

/// Slots on the board.
pub const SLOTS: usize = 4096;
/// Length of the board: a header page and the slots.
pub const BOARD_LEN: usize = 4096 + SLOTS * 4;
const WAITERS: usize = 0;
const DEFERRED: usize = 64;
const SLOT0: usize = 4096;
const SEQ_MASK: u32 = 0x7fff_ffff;

/// What the board says of one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Completed successfully.
    Done,
    /// Failed (the enqueue was refused, or the command ended with an error), or the board
    /// cannot tell (the slot was reused, the deadline passed): ask the server.
    Ask,
}

/// The shared board (see the module doc).
#[derive(Debug)]
pub struct EventBoard {
    region: ShmRegion,
}

/// The sequence number a guest id is known by on the board; 0 (never posted) for ids whose
/// low 31 bits are zero, which therefore never use the board.
pub fn seq(id: u64) -> u32 {
    id as u32 & SEQ_MASK
}

impl EventBoard {
    /// A fresh board (guest side): nothing posted.
    pub fn create() -> Result<EventBoard> {
        Ok(EventBoard {
            region: ShmRegion::create("hira-events", BOARD_LEN)?,
        })
    }

    /// The board the guest sent (server side).
    pub fn from_fd(fd: OwnedFd) -> Result<EventBoard> {
        Ok(EventBoard {
            region: ShmRegion::from_fd(fd, BOARD_LEN)?,
        })
    }

    /// The memfd, to send to the server.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.region.fd()
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off` + 4 lies inside the mapping (the callers' offsets are constants or
        // slot offsets below BOARD_LEN), which lives as long as `self`; both processes only
        // ever access the memory atomically.
        unsafe { AtomicU32::from_ptr(self.region.as_ptr().add(off).cast()) }
    }

    fn slot(&self, id: u64) -> &AtomicU32 {
        self.word(SLOT0 + (id as usize % SLOTS) * 4)
    }

    /// Server: the event the guest named `id` completed (`ok`) or failed.
    pub fn post(&self, id: u64, ok: bool) {
        if seq(id) == 0 {
            return;
        }
        let w = self.slot(id);
        w.store(seq(id) << 1 | u32::from(!ok), SeqCst);
        if self.word(WAITERS).load(SeqCst) != 0 {
            futex_wake(w);
        }
    }

    /// Server: one more (`true`) or one fewer connection holds an unreported error of an
    /// asynchronous call.
    pub fn deferred(&self, more: bool) {
        if more {
            self.word(DEFERRED).fetch_add(1, SeqCst);
        } else {
            let _ = self
                .word(DEFERRED)
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1));
        }
    }

    /// Guest: whether some connection holds an unreported error of an asynchronous call.
    pub fn has_deferred(&self) -> bool {
        self.word(DEFERRED).load(SeqCst) != 0
    }

    /// Guest: waits until event `id` is posted or `deadline` passes.
    pub fn wait(&self, id: u64, deadline: Instant) -> Seen {
        let want = seq(id);
        if want == 0 {
            return Seen::Ask;
        }
        let w = self.slot(id);
        loop {
            let cur = w.load(SeqCst);
            let behind = want.wrapping_sub(cur >> 1) & SEQ_MASK;
            if behind == 0 {
                return if cur & 1 == 0 { Seen::Done } else { Seen::Ask };
            }
            if behind > SEQ_MASK / 2 {
                // A later event took the slot.
                return Seen::Ask;
            }
            let now = Instant::now();
            if now >= deadline {
                return Seen::Ask;
            }
            let waiters = self.word(WAITERS);
            waiters.fetch_add(1, SeqCst);
            if w.load(SeqCst) == cur {
                futex_wait(w, cur, deadline - now);
            }
            waiters.fetch_sub(1, SeqCst);
        }
    }
}

fn futex_wait(w: &AtomicU32, expected: u32, timeout: std::time::Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `w` is a live 4-byte aligned word of a shared mapping; FUTEX_WAIT only reads
    // it. Not FUTEX_PRIVATE: the waker is another process.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            w.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn futex_wake(w: &AtomicU32) {
    // SAFETY: as in `futex_wait`; FUTEX_WAKE does not touch the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            w.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::time::Duration;

    fn pair() -> (EventBoard, EventBoard) {
        let guest = EventBoard::create().unwrap();
        let server = EventBoard::from_fd(guest.fd().as_fd().try_clone_to_owned().unwrap()).unwrap();
        (guest, server)
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(20)
    }

    #[test]
    fn posted_events_are_seen_and_failures_send_the_guest_to_the_server() {
        let (guest, server) = pair();
        server.post(7, true);
        server.post(8, false);
        assert_eq!(guest.wait(7, soon()), Seen::Done);
        assert_eq!(guest.wait(8, soon()), Seen::Ask);
    }

    #[test]
    fn an_event_not_yet_posted_times_out_and_a_reused_slot_is_not_trusted() {
        let (guest, server) = pair();
        let t = Instant::now();
        assert_eq!(guest.wait(9, t + Duration::from_millis(30)), Seen::Ask);
        assert!(t.elapsed() >= Duration::from_millis(30));
        // A later event in the same slot: the earlier one cannot be told.
        server.post(9 + SLOTS as u64, true);
        assert_eq!(guest.wait(9, soon()), Seen::Ask);
        assert_eq!(guest.wait(9 + SLOTS as u64, soon()), Seen::Done);
        // Ids whose sequence number is 0 never use the board.
        server.post(1 << 31, true);
        assert_eq!(guest.wait(1 << 31, soon()), Seen::Ask);
    }

    #[test]
    fn a_sleeping_waiter_is_woken_by_the_post() {
        let (guest, server) = pair();
        let id = (1 << 63) | 42;
        let t = Instant::now();
        let waiter =
            std::thread::spawn(move || guest.wait(id, Instant::now() + Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(50));
        server.post(id, true);
        assert_eq!(waiter.join().unwrap(), Seen::Done);
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn deferred_errors_are_counted_and_never_go_below_zero() {
        let (guest, server) = pair();
        assert!(!guest.has_deferred());
        server.deferred(true);
        server.deferred(true);
        server.deferred(false);
        assert!(guest.has_deferred());
        server.deferred(false);
        server.deferred(false);
        assert!(!guest.has_deferred());
    }
}
