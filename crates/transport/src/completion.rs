//! A page of kernel completions that an API server shares with the router, with notification
//! suppression in the manner of virtio's used ring.
//!
//! The server counts every completed device-time command and its device time here. The router
//! reads the totals whenever it schedules (a launch arrives, a stats sample, the watchdog),
//! and asks for a message (`control::DONE`) only while some tenant waits for the device: then
//! completions must wake it. A tenant alone on its device thus costs the router no wake-up per
//! kernel. The flag protocol is Dekker's: the server adds to the totals and then reads the
//! flag; the router raises the flag and then reads the totals (all sequentially consistent),
//! so a completion is either seen by the router's read or announced by a message.
//!
//! The router trusts the totals no more than it trusts DONE messages: a server can only lie
//! about its own tenant, and the router never completes more than it dispatched.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

use crate::{Result, ShmRegion};

/// Length of the page.
pub const PAGE_LEN: usize = 4096;
/// Byte offsets: completions (u64), their device ns (u64), and — on a line of its own, since
/// the other side writes it — the router's notify flag (u32).
const COUNT: usize = 0;
const NS: usize = 8;
const NOTIFY: usize = 64;

/// The shared page (see the module doc).
#[derive(Debug)]
pub struct CompletionPage {
    region: ShmRegion,
}

impl CompletionPage {
    /// A fresh page (router side): no completions, notify off.
    pub fn create() -> Result<CompletionPage> {
        Ok(CompletionPage {
            region: ShmRegion::create("hira-done", PAGE_LEN)?,
        })
    }

    /// The page the router sent (server side).
    pub fn from_fd(fd: OwnedFd) -> Result<CompletionPage> {
        Ok(CompletionPage {
            region: ShmRegion::from_fd(fd, PAGE_LEN)?,
        })
    }

    /// The memfd, to send to the server.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.region.fd()
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` + 8 lies inside the page-aligned mapping, which lives as long as
        // `self`; the memory is only ever accessed atomically, by both processes.
        unsafe { AtomicU64::from_ptr(self.region.as_ptr().add(off).cast()) }
    }

    fn notify_flag(&self) -> &AtomicU32 {
        // SAFETY: as in `u64_at`.
        unsafe { AtomicU32::from_ptr(self.region.as_ptr().add(NOTIFY).cast()) }
    }

    /// Server: one command completed after `device_ns`. True if the router wants a message.
    pub fn record(&self, device_ns: u64) -> bool {
        self.u64_at(NS).fetch_add(device_ns, SeqCst);
        self.u64_at(COUNT).fetch_add(1, SeqCst);
        self.notify_flag().load(SeqCst) != 0
    }

    /// Router: (completions, device ns) so far. The ns may already include a completion the
    /// count does not show yet; the next reading settles it.
    pub fn totals(&self) -> (u64, u64) {
        let count = self.u64_at(COUNT).load(SeqCst);
        (count, self.u64_at(NS).load(SeqCst))
    }

    /// Router: ask for (or stop asking for) a message per completion.
    pub fn set_notify(&self, on: bool) {
        self.notify_flag().store(u32::from(on), SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn both_sides_see_the_totals_and_the_flag() {
        let router = CompletionPage::create().unwrap();
        let server =
            CompletionPage::from_fd(router.fd().as_fd().try_clone_to_owned().unwrap()).unwrap();

        let quiet = server.record(1_000);
        router.set_notify(true);
        let asked = server.record(500);

        assert!(!quiet);
        assert!(asked);
        assert_eq!(router.totals(), (2, 1_500));
    }
}
