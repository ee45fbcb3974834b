//! Order across a tenant's connections (`control::FENCE`).
//!
//! Each application thread has its own connection, run by its own shadow thread here. A
//! command thread A enqueued before thread B calls `clFinish` must be in the queue when B's
//! call runs, as natively; the guest sends A's batch first, but A's frames and B's call still
//! travel on different connections. So every shadow thread publishes how far it has run its
//! connection's frames, and a FENCE frame, which the guest puts before B's call when other
//! connections sent commands, makes B's thread wait until they have run that far.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Longest a FENCE waits: a command held by the device scheduler for longer is unusual; the
/// call then runs anyway (logged), rather than hanging.
pub const FENCE_WAIT: Duration = Duration::from_secs(5);

/// Set for a connection that ended: whatever it sent has run or never will.
const GONE: u64 = u64::MAX;

/// How far every connection of the tenant has run its frames.
#[derive(Default)]
pub struct Progress {
    conns: Mutex<HashMap<u64, Arc<AtomicU64>>>,
    moved: Condvar,
    waiters: AtomicUsize,
}

impl Progress {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<AtomicU64>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new connection (before its first frame); its shadow thread advances the word.
    pub fn register(&self, conn: u64) -> Arc<AtomicU64> {
        let word = Arc::clone(self.lock().entry(conn).or_default());
        self.wake();
        word
    }

    /// The connection ended (its entry stays, as done: a fence may still name it).
    pub fn unregister(&self, conn: u64) {
        if let Some(w) = self.lock().get(&conn) {
            w.store(GONE, Ordering::SeqCst);
        }
        self.wake();
    }

    /// The connection owning `word` has run its frames up to `seq`.
    pub fn advance(&self, word: &AtomicU64, seq: u64) {
        word.store(seq, Ordering::SeqCst);
        self.wake();
    }

    fn wake(&self) {
        // Dekker with `wait`: it counts itself, then reads the word; we write the word, then
        // read the count. A waiter that read the old value is in (or entering) its wait
        // under the lock, which we take before notifying.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.lock();
            self.moved.notify_all();
        }
    }

    /// Waits until connection `conn` has run its frames up to `seq` (true), or `limit`
    /// passed (false). A connection not registered yet (its ATTACH is on its way) is waited
    /// for too; one that ended counts as done.
    pub fn wait(&self, conn: u64, seq: u64, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut map = self.lock();
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let done = loop {
            if map
                .get(&conn)
                .is_some_and(|w| w.load(Ordering::SeqCst) >= seq)
            {
                break true;
            }
            let now = Instant::now();
            if now >= deadline {
                break false;
            }
            map = self
                .moved
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_when_the_connection_gets_there_or_ends_or_time_is_up() {
        let p = Arc::new(Progress::default());
        let a = p.register(1);
        p.advance(&a, 3);
        let already = p.wait(1, 3, Duration::ZERO);
        let timed_out = p.wait(1, 4, Duration::from_millis(20));
        let q = Arc::clone(&p);
        let later = std::thread::spawn(move || q.wait(1, 5, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        p.advance(&a, 5);
        let reached = later.join().unwrap();
        let q = Arc::clone(&p);
        let unborn = std::thread::spawn(move || q.wait(2, 1, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        let b = p.register(2);
        p.unregister(2);

        assert!(already);
        assert!(!timed_out);
        assert!(reached);
        assert!(unborn.join().unwrap(), "registered, then gone");
        assert_eq!(b.load(Ordering::SeqCst), GONE);
    }
}
