//! A page of kernel completions that an API server shares with the router, with notification
//! suppression in the manner of virtio's used ring.
//!
//! The server counts every completed device-time command and its device time here. The router
//! reads the totals whenever it schedules (a launch arrives, a stats sample, the watchdog),
//! and asks for a message (`control::DONE`) only for the completion it waits for: the one
//! that drains the tenant's commands while another tenant waits for the device, or the one
//! that frees a slot the tenant's next command waits for. It writes the completion count at
//! which the server is to send (`notify_from`); a tenant alone on its device, and every
//! completion but the last of an owner's run, cost no message. A message costs more than the
//! router's wake-up: the server sends it from the vendor's completion callback, which on
//! PoCL runs on a worker thread, and the send wakes a router thread that often takes that
//! worker's core (measured: 40–140 µs of the worker's time per kernel with 4 tenants).
//! The protocol is Dekker's: the server adds to the totals and then reads the threshold; the
//! router writes the threshold and then reads the totals (all sequentially consistent), so a
//! completion the router waits for is either seen by its read or announced by a message.
//!
//! The router trusts the totals no more than it trusts DONE messages: a server can only lie
//! about its own tenant, and the router never completes more than it dispatched.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use crate::{Result, ShmRegion};

/// Length of the page.
pub const PAGE_LEN: usize = 4096;
/// Byte offsets: completions (u64), their device ns (u64), and — on a line of its own, since
/// the other side writes it — the count from which the router wants messages (u64).
const COUNT: usize = 0;
const NS: usize = 8;
const NOTIFY: usize = 64;

/// [`CompletionPage::notify_from`]: no messages.
pub const NEVER: u64 = u64::MAX;

/// The shared page (see the module doc).
#[derive(Debug)]
pub struct CompletionPage {
    region: ShmRegion,
}

impl CompletionPage {
    /// A fresh page (router side): no completions, no messages wanted.
    pub fn create() -> Result<CompletionPage> {
        let page = CompletionPage {
            region: ShmRegion::create("hira-done", PAGE_LEN)?,
        };
        page.notify_from(NEVER);
        Ok(page)
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

    /// Server: one command completed after `device_ns`. True if the router wants a message.
    pub fn record(&self, device_ns: u64) -> bool {
        self.u64_at(NS).fetch_add(device_ns, SeqCst);
        let count = self.u64_at(COUNT).fetch_add(1, SeqCst) + 1;
        count >= self.u64_at(NOTIFY).load(SeqCst)
    }

    /// Router: (completions, device ns) so far. The ns may already include a completion the
    /// count does not show yet; the next reading settles it.
    pub fn totals(&self) -> (u64, u64) {
        let count = self.u64_at(COUNT).load(SeqCst);
        (count, self.u64_at(NS).load(SeqCst))
    }

    /// Router: a message for every completion that brings the count to `count` or beyond
    /// ([`NEVER`]: none, 0: every one).
    pub fn notify_from(&self, count: u64) {
        self.u64_at(NOTIFY).store(count, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn both_sides_see_the_totals_and_the_threshold() {
        let router = CompletionPage::create().unwrap();
        let server =
            CompletionPage::from_fd(router.fd().as_fd().try_clone_to_owned().unwrap()).unwrap();

        let quiet = server.record(1_000);
        router.notify_from(3);
        let before = server.record(500);
        let at = server.record(250);
        let after = server.record(250);
        router.notify_from(NEVER);
        let off = server.record(0);

        assert_eq!(
            [quiet, before, at, after, off],
            [false, false, true, true, false]
        );
        assert_eq!(router.totals(), (5, 2_000));
    }
}
