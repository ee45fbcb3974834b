//! The per-device dispatcher: a device-time command (a kernel launch) is forwarded only once
//! the device's [`Scheduler`] has picked its tenant. The forwarding thread of the command's
//! connection blocks in [`Dispatcher::acquire`] (so a connection's frames stay in order);
//! the server's DONE frame ends the command ([`Dispatcher::complete`]).
//!
//! The device belongs to one tenant at a time, its *owner*. PoCL (like a GPU driver) runs
//! the kernels of different processes at the same time, so with several tenants' kernels
//! out at once their measured device times overlap and no policy can shape the shares. The
//! owner may have up to `max_inflight` commands dispatched and not yet done (pipelining: the
//! device does not idle while the router turns around). Whenever the owner has a command
//! ready and a slot is free the scheduler is asked (`pick`): if it names the owner, the
//! command goes; if it names another tenant, the owner is fed no more, its commands drain,
//! and the device switches to the tenant named, whose command goes first (GPUvm: the
//! device is not preemptible). An owner with commands out but none ready is not asked
//! about: its next command is on its way, and asking would hand the device over on a
//! momentary gap. An owner that drains with nothing ready keeps the device a little
//! longer (`band_wait`, 500 µs by default) for its next command, and the scheduler hears of
//! its last completion only then: a tenant whose app turns around between kernels is not
//! taken for one that went idle (WFQ would restart it at the system virtual time, and it
//! would lose its place on every turnaround). After that the device is free and the
//! scheduler picks anyone (this is where BAND's own short wait applies).
//!
//! Completions reach the dispatcher through the tenant's completion page
//! ([`CompletionPage`]): the server counts them there and the dispatcher reads the totals
//! whenever it decides anything. A DONE message is asked for only for a completion the
//! dispatcher waits for while some command waits for a grant: the owner's last one (the
//! device can turn), or the next one when the owner's own command waits for a free slot; a
//! tenant alone on its device, and an owner's completions before its last, cost no message
//! (virtio's notification suppression).
//! Tenants without a page (over-subscription on, or `HIRA_DONE_PAGE=0`) send DONE for
//! every completion, as servers did before the page.
//!
//! Only device time reported by the server (DONE) is charged: draining and switching are
//! charged to nobody (DymGPU §4.5). The clock is a monotonic [`Instant`] converted to
//! nanoseconds; the state machine ([`State`]) takes the time as an argument, so tests
//! drive it with a fake clock and fake completions.

use hira_transport::{CompletionPage, NOTIFY_NEVER};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hira_policy::sched::{
    new_scheduler, Decision, Nanos, PolicyKind, SchedConfig, Scheduler, TenantId, TenantParams,
};
use serde::{Deserialize, Serialize};

/// Longest a waiting thread sleeps before it looks again (nothing is lost if it oversleeps:
/// every state change notifies).
const MAX_SLEEP: Duration = Duration::from_millis(200);

/// A tenant's scheduling settings as the router applies them.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantSched {
    pub params: TenantParams,
    /// Longest one command of the tenant may run before the tenant is stopped.
    pub kernel_timeout: Duration,
}

/// The scheduling part of a tenant's stats.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedView {
    pub weight: u32,
    pub cap: Option<f64>,
    pub priority: i32,
    pub slo: Option<f64>,
    pub kernel_timeout_ms: u64,
    /// Device-time commands completed (DONE frames).
    pub kernels: u64,
    /// Device time reported by DONE frames.
    pub kernel_ns: u64,
    /// Device time the scheduler charged.
    pub charged_ns: u64,
    /// Time commands waited for the scheduler's permission.
    pub queue_wait_ns: u64,
    /// Time the tenant had work but was held back by its cap.
    pub throttled_ns: u64,
    /// Commands waiting for permission now.
    pub waiting: u32,
    /// Commands dispatched and not yet done.
    pub inflight: u32,
    /// Why the router stopped the tenant, if it did.
    pub stopped: Option<String>,
}

/// The device's view, for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeviceStats {
    pub policy: String,
    pub max_inflight: u32,
    pub inflight: u32,
    /// Commands waiting for permission.
    pub waiting: u32,
    /// Time with at least one command dispatched (device busy), since start.
    pub busy_ns: u64,
    /// Time since the router started.
    pub uptime_ns: u64,
    pub dispatched: u64,
    pub completed: u64,
    /// Tenants stopped for a runaway command.
    pub runaways: u64,
    /// The tenant the device belongs to now.
    pub owner: Option<u64>,
    /// Times the device went from one tenant to another the scheduler picked.
    pub switches: u64,
    /// Time spent draining an owner's commands before a switch (charged to nobody).
    pub drain_ns: u64,
    /// Times an owner that had drained got its next command in within the anticipation
    /// and kept its place.
    pub anticipated: u64,
}

/// One device's dispatcher. Each tenant's waiting threads sleep on the tenant's own condition
/// variable and are woken only when something changes for that tenant (a grant, a stop, its
/// removal) or when the earliest timed decision moves earlier: with every waiter on one
/// shared variable, every completion woke all of them, and on a CPU device those wake-ups
/// are taken from the kernels.
pub struct Dispatcher {
    st: Mutex<State>,
    epoch: Instant,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher").finish_non_exhaustive()
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Dispatcher {
    /// A dispatcher running `policy`, with up to `max_inflight` (at least 1) commands of the
    /// owner out.
    pub fn new(policy: PolicyKind, cfg: &SchedConfig, max_inflight: u32) -> Dispatcher {
        Dispatcher {
            st: Mutex::new(State::new(policy, cfg, max_inflight)),
            epoch: Instant::now(),
        }
    }

    fn now(&self) -> Nanos {
        self.epoch.elapsed().as_nanos() as Nanos
    }

    /// Runs `f` on the state at the current time (the state wakes whom it concerns), with
    /// every completion the pages show applied first.
    fn change<R>(&self, f: impl FnOnce(&mut State, Nanos) -> R) -> R {
        let now = self.now();
        let mut st = lock(&self.st);
        st.sync_pages(now);
        let r = f(&mut st, now);
        st.settle_notify();
        r
    }

    /// Tenant `t`'s completions come through `page` from now on.
    pub fn attach_page(&self, t: TenantId, page: Arc<CompletionPage>) {
        self.change(|st, _| st.attach_page(t, page));
    }

    /// Admits tenant `t` (again: replaces its settings).
    pub fn add(&self, t: TenantId, s: TenantSched) {
        self.change(|st, now| st.add(t, s, now));
    }

    /// Forgets tenant `t`: its queued commands are dropped, its slots returned (the device
    /// is free again if it owned it), its waiting threads woken (their
    /// [`Dispatcher::acquire`] answers false). Returns its final view.
    pub fn remove(&self, t: TenantId) -> Option<SchedView> {
        self.change(|st, now| st.remove(t, now))
    }

    /// Waits until the scheduler lets tenant `t` dispatch one command. False if the tenant
    /// was removed or stopped meanwhile (drop the command). A tenant the dispatcher does not
    /// know passes at once.
    pub fn acquire(&self, t: TenantId) -> bool {
        match self.try_acquire(t) {
            Ok(answer) => answer,
            Err(ticket) => self.wait_grant(ticket),
        }
    }

    /// Like [`Dispatcher::acquire`] without blocking: the answer if it is ready now, else a
    /// ticket to wait on with [`Dispatcher::wait_grant`] (the command is already queued with
    /// the scheduler). The router sends what it has batched before it waits.
    pub fn try_acquire(&self, t: TenantId) -> Result<bool, Ticket> {
        let start = self.now();
        let mut st = lock(&self.st);
        st.sync_pages(start);
        let answer = match st.enter(t, start) {
            Some(answer) => Some(answer),
            None => {
                st.pump(start);
                st.take(t, start, start)
            }
        };
        // A command left waiting raises the pages' notify flags before the lock goes:
        // wait_grant reads the pages again before it sleeps.
        st.settle_notify();
        answer.ok_or(Ticket { t, start })
    }

    /// Wait for the grant of a command that [`Dispatcher::try_acquire`] queued.
    pub fn wait_grant(&self, ticket: Ticket) -> bool {
        let Ticket { t, start } = ticket;
        let mut st = lock(&self.st);
        loop {
            let now = self.now();
            st.sync_pages(now);
            st.pump(now);
            if let Some(answer) = st.take(t, start, now) {
                st.settle_notify();
                return answer;
            }
            // Ask for DONE messages, then look once more: a completion counted before the
            // flag went up announced itself to nobody.
            st.settle_notify();
            if st.sync_pages(now) {
                continue;
            }
            let sleep = st
                .next_wake
                .map_or(MAX_SLEEP, |u| Duration::from_nanos(u.saturating_sub(now)))
                .clamp(Duration::from_micros(50), MAX_SLEEP);
            let Some(slot) = st.tenants.get_mut(&t) else {
                return false;
            };
            slot.sleepers += 1;
            let cv = Arc::clone(&slot.cv);
            st = cv
                .wait_timeout(st, sleep)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            if let Some(slot) = st.tenants.get_mut(&t) {
                slot.sleepers = slot.sleepers.saturating_sub(1);
            }
        }
    }

    /// A DONE message of `t`: a dispatched command finished after `device_ns` of device
    /// time (for a tenant with a completion page, the page says what finished, and it has
    /// been read).
    pub fn complete(&self, t: TenantId, device_ns: Nanos) {
        self.change(|st, now| {
            if st.tenants.get(&t).is_some_and(|s| s.page.is_none()) {
                st.complete(t, device_ns, now);
            }
        });
    }

    /// A dispatched command of `t` failed before reaching the device (no DONE will come).
    pub fn cancel(&self, t: TenantId) {
        self.change(|st, now| st.cancel(t, now));
    }

    /// Live change of a tenant's settings; effective within one scheduler window.
    pub fn set(&self, t: TenantId, s: TenantSched) -> bool {
        self.change(|st, now| st.set(t, s, now))
    }

    /// The tenant's current settings.
    pub fn settings(&self, t: TenantId) -> Option<TenantSched> {
        lock(&self.st).tenants.get(&t).map(|s| s.s.clone())
    }

    /// Switches the policy: a fresh scheduler learns every tenant, its waiting commands and
    /// the owner's commands still on the device.
    pub fn set_policy(&self, policy: PolicyKind) {
        self.change(|st, now| st.set_policy(policy, now));
    }

    /// The current policy.
    pub fn policy(&self) -> PolicyKind {
        lock(&self.st).policy
    }

    /// The tenant whose oldest dispatched command has gone without progress for longer than
    /// its `kernel_timeout`, if any; it is marked stopped (its waiting threads give up) and
    /// the others' clocks restart, since a stuck device delays everyone's commands.
    pub fn take_runaway(&self, why: &str) -> Option<(TenantId, Duration)> {
        self.change(|st, now| st.take_runaway(why, now))
    }

    /// The tenant's scheduling view.
    pub fn view(&self, t: TenantId) -> Option<SchedView> {
        self.change(|st, _| st.view(t))
    }

    /// The device's view.
    pub fn device(&self) -> DeviceStats {
        self.change(|st, now| st.device(now))
    }
}

/// The dispatcher's state machine; every event carries the time.
struct State {
    sched: Box<dyn Scheduler>,
    policy: PolicyKind,
    cfg: SchedConfig,
    max_inflight: u32,
    /// Commands granted and not yet done: all of them the owner's.
    inflight: u32,
    tenants: HashMap<TenantId, Slot>,
    /// The tenant the device belongs to; `None` when it has nothing out.
    owner: Option<TenantId>,
    /// The tenant the scheduler picked while the owner had commands out, and when: its
    /// command (already taken from the scheduler's queue) goes once the owner has drained.
    next: Option<(TenantId, Nanos)>,
    /// When the scheduler wants to be asked again (it answered `Wait`), or the owner's
    /// anticipation ends.
    next_wake: Option<Nanos>,
    /// How long a drained owner with nothing ready keeps the device.
    anticipate: Nanos,
    /// The drained owner's last completion (device ns), not yet told to the scheduler.
    deferred: Option<(TenantId, Nanos)>,
    busy_ns: u64,
    busy_since: Option<Nanos>,
    dispatched: u64,
    completed: u64,
    runaways: u64,
    switches: u64,
    drain_ns: u64,
    anticipated: u64,
}

/// A command queued with the scheduler whose grant has not come yet.
#[derive(Debug)]
#[must_use = "wait for the grant with Dispatcher::wait_grant"]
pub struct Ticket {
    t: TenantId,
    start: Nanos,
}

/// How much of the owner's device time may be queued on the device: the longest a tenant the
/// scheduler switches to waits for the owner to drain.
const DRAIN_BUDGET: Nanos = 2_000_000;
/// The deepest in-flight window, for very short kernels.
const MAX_WINDOW: u32 = 1024;

#[derive(Debug)]
struct Slot {
    s: TenantSched,
    /// Threads in `acquire`, including those granted and not yet awake.
    waiting: u32,
    /// Slots granted to the tenant that no thread of it has taken yet.
    granted: u32,
    /// Dispatch time of every command not yet done, oldest first.
    dispatched: VecDeque<Nanos>,
    last_done: Nanos,
    kernels: u64,
    kernel_ns: u64,
    queue_wait_ns: u64,
    stopped: Option<String>,
    /// The tenant's waiting threads sleep here.
    cv: Arc<Condvar>,
    /// How many of them sleep there now (a notification without sleepers would still cost
    /// a futex system call, once per kernel).
    sleepers: u32,
    /// Where the tenant's server counts completions, and the totals already applied.
    page: Option<(Arc<CompletionPage>, (u64, u64))>,
    /// The completion count from which the page asks for DONE messages.
    notify_at: u64,
}

impl Slot {
    /// Wakes the tenant's sleeping threads, if any.
    fn wake(&self) {
        if self.sleepers > 0 {
            self.cv.notify_all();
        }
    }

    /// Commands the scheduler has queued (or picked) that have no slot yet.
    fn ready(&self) -> u32 {
        self.waiting.saturating_sub(self.granted)
    }
}

impl State {
    fn new(policy: PolicyKind, cfg: &SchedConfig, max_inflight: u32) -> State {
        State {
            sched: new_scheduler(policy, cfg),
            policy,
            cfg: cfg.clone(),
            max_inflight: max_inflight.max(1),
            inflight: 0,
            tenants: HashMap::new(),
            owner: None,
            next: None,
            next_wake: None,
            anticipate: cfg.band_wait,
            deferred: None,
            busy_ns: 0,
            busy_since: None,
            dispatched: 0,
            completed: 0,
            runaways: 0,
            switches: 0,
            drain_ns: 0,
            anticipated: 0,
        }
    }

    fn add(&mut self, t: TenantId, s: TenantSched, now: Nanos) {
        self.sched.add_tenant(t, &s.params, now);
        match self.tenants.get_mut(&t) {
            Some(slot) => slot.s = s,
            None => {
                let slot = Slot {
                    s,
                    waiting: 0,
                    granted: 0,
                    dispatched: VecDeque::new(),
                    last_done: now,
                    kernels: 0,
                    kernel_ns: 0,
                    queue_wait_ns: 0,
                    stopped: None,
                    cv: Arc::new(Condvar::new()),
                    sleepers: 0,
                    page: None,
                    notify_at: NOTIFY_NEVER,
                };
                self.tenants.insert(t, slot);
            }
        }
    }

    fn attach_page(&mut self, t: TenantId, page: Arc<CompletionPage>) {
        if let Some(slot) = self.tenants.get_mut(&t) {
            page.notify_from(NOTIFY_NEVER);
            slot.notify_at = NOTIFY_NEVER;
            let seen = page.totals();
            slot.page = Some((page, seen));
        }
        self.settle_notify();
    }

    /// Applies the completions the pages show and the dispatcher has not seen; true if any.
    /// A tenant is never credited with more completions than it has commands out (its
    /// server could lie only about its own tenant anyway).
    fn sync_pages(&mut self, now: Nanos) -> bool {
        let mut done = Vec::new();
        for (&t, slot) in &mut self.tenants {
            let Some((page, seen)) = &mut slot.page else {
                continue;
            };
            let (count, ns) = page.totals();
            let fresh = count.wrapping_sub(seen.0);
            if fresh == 0 {
                continue;
            }
            let fresh_ns = ns.wrapping_sub(seen.1);
            *seen = (count, ns);
            let n = fresh.min(slot.dispatched.len() as u64);
            if n > 0 {
                done.push((t, n, fresh_ns));
            }
        }
        for &(t, n, ns) in &done {
            for i in 0..n {
                let share = ns / n + if i + 1 == n { ns % n } else { 0 };
                self.complete(t, share, now);
            }
        }
        !done.is_empty()
    }

    /// Whether some command waits for a grant (then the pages ask for the completions the
    /// dispatcher waits for).
    fn notify_wanted(&self) -> bool {
        self.next.is_some() || self.tenants.values().any(|s| s.ready() > 0)
    }

    /// Sets each page's threshold: while a command waits for a grant (or the scheduler has
    /// picked one that waits for the owner to drain), a message for the completion that
    /// drains the tenant's commands — or for the next one, when the owner's own command waits
    /// for a free slot; no messages when nobody waits.
    fn settle_notify(&mut self) {
        let want = self.notify_wanted();
        let (owner, window_full) = (self.owner, self.inflight >= self.window());
        for (&t, slot) in &mut self.tenants {
            let out = slot.dispatched.len() as u64;
            let slot_wanted = owner == Some(t) && window_full && slot.ready() > 0;
            let Some((page, seen)) = &slot.page else {
                continue;
            };
            let at = match (want, slot_wanted) {
                (false, _) => NOTIFY_NEVER,
                (true, true) => seen.0 + 1,
                (true, false) => seen.0 + out.max(1),
            };
            if at != slot.notify_at {
                slot.notify_at = at;
                page.notify_from(at);
            }
        }
    }

    fn remove(&mut self, t: TenantId, now: Nanos) -> Option<SchedView> {
        let view = self.view(t);
        let slot = self.tenants.remove(&t)?;
        slot.wake();
        self.sched.remove_tenant(t, now);
        if self.next.is_some_and(|(n, _)| n == t) {
            self.next = None;
        }
        if self.deferred.is_some_and(|(d, _)| d == t) {
            self.deferred = None;
        }
        self.release(slot.dispatched.len() as u32, now);
        self.pump(now);
        view
    }

    /// A thread of `t` has a command: the answer at once, or `None`: it waits for a grant.
    fn enter(&mut self, t: TenantId, now: Nanos) -> Option<bool> {
        match self.tenants.get_mut(&t) {
            None => return Some(true),
            Some(slot) if slot.stopped.is_some() => return Some(false),
            Some(slot) => slot.waiting += 1,
        }
        self.sched.submit(t, now);
        if self.deferred.is_some_and(|(d, _)| d == t) {
            // Back within the anticipation: busy all along, as far as the scheduler knows.
            self.anticipated += 1;
            self.flush(now);
        }
        None
    }

    /// A waiting thread of `t` (since `start`) takes a granted slot (`Some(true)`), gives up
    /// because the tenant is gone or stopped (`Some(false)`), or waits on (`None`).
    fn take(&mut self, t: TenantId, start: Nanos, now: Nanos) -> Option<bool> {
        let Some(slot) = self.tenants.get_mut(&t) else {
            return Some(false);
        };
        if slot.stopped.is_some() {
            slot.waiting = slot.waiting.saturating_sub(1);
            return Some(false);
        }
        if slot.granted == 0 {
            return None;
        }
        slot.granted -= 1;
        slot.waiting -= 1;
        slot.queue_wait_ns += now.saturating_sub(start);
        Some(true)
    }

    fn complete(&mut self, t: TenantId, device_ns: Nanos, now: Nanos) {
        let Some(slot) = self.tenants.get_mut(&t) else {
            return;
        };
        let was_out = slot.dispatched.pop_front().is_some();
        slot.last_done = now;
        slot.kernels += 1;
        slot.kernel_ns += device_ns;
        let drained_idle = slot.dispatched.is_empty() && slot.ready() == 0;
        self.completed += 1;
        if was_out {
            self.release(1, now);
        }
        let anticipate = drained_idle
            && self.owner == Some(t)
            && self.inflight == 0
            && self.next.is_none()
            && self.anticipate > 0;
        self.flush(now);
        if anticipate {
            self.deferred = Some((t, device_ns));
        } else {
            self.sched.complete(t, device_ns, now);
        }
        self.pump(now);
    }

    /// Tells the scheduler of the drained owner's last completion.
    fn flush(&mut self, now: Nanos) {
        if let Some((t, ns)) = self.deferred.take() {
            self.sched.complete(t, ns, now);
        }
    }

    /// The drained owner did not come back within the anticipation: the scheduler hears of
    /// its last completion as of when it happened. The anticipation was the wait after it:
    /// BAND's own short wait after a completion, counted from the anticipation's end, would
    /// leave the device idle twice as long for a tenant that is not coming.
    fn flush_expired(&mut self, now: Nanos) {
        if let Some((t, ns)) = self.deferred.take() {
            let at = self.tenants.get(&t).map_or(now, |s| s.last_done.min(now));
            self.sched.complete(t, ns, at);
        }
    }

    fn cancel(&mut self, t: TenantId, now: Nanos) {
        let Some(slot) = self.tenants.get_mut(&t) else {
            return;
        };
        if slot.dispatched.pop_back().is_some() {
            self.sched.complete(t, 0, now);
            self.release(1, now);
            self.pump(now);
        }
    }

    fn set(&mut self, t: TenantId, s: TenantSched, now: Nanos) -> bool {
        let Some(slot) = self.tenants.get_mut(&t) else {
            return false;
        };
        slot.s = s.clone();
        if slot.stopped.is_none() {
            self.sched.set_params(t, &s.params, now);
        }
        self.pump(now);
        true
    }

    fn set_policy(&mut self, policy: PolicyKind, now: Nanos) {
        self.flush(now);
        let mut sched = new_scheduler(policy, &self.cfg);
        // The owner first, alone, so that the new policy sees its commands out as running.
        if let Some(slot) = self
            .owner
            .and_then(|o| self.tenants.get(&o).map(|s| (o, s)))
        {
            let (o, slot) = slot;
            sched.add_tenant(o, &slot.s.params, now);
            for _ in 0..slot.dispatched.len() {
                sched.submit(o, now);
                let _ = sched.pick(now);
            }
        }
        let mut ids: Vec<TenantId> = self
            .tenants
            .iter()
            .filter(|(_, s)| s.stopped.is_none())
            .map(|(&t, _)| t)
            .collect();
        ids.sort_unstable();
        for &t in &ids {
            let slot = &self.tenants[&t];
            sched.add_tenant(t, &slot.s.params, now);
            // Including the command of the tenant picked to go next: the new policy decides.
            for _ in 0..slot.ready() {
                sched.submit(t, now);
            }
        }
        self.sched = sched;
        self.policy = policy;
        self.next = None;
        self.pump(now);
        self.tenants.values().for_each(Slot::wake);
    }

    fn take_runaway(&mut self, why: &str, now: Nanos) -> Option<(TenantId, Duration)> {
        let (t, since) = self
            .tenants
            .iter()
            .filter(|(_, s)| s.stopped.is_none())
            .filter_map(|(&t, s)| {
                let since = (*s.dispatched.front()?).max(s.last_done);
                let limit = s.s.kernel_timeout.as_nanos() as Nanos;
                (now.saturating_sub(since) > limit).then_some((t, since))
            })
            .min_by_key(|&(_, since)| since)?;
        self.runaways += 1;
        self.flush(now);
        for (&u, s) in self.tenants.iter_mut() {
            if u == t {
                s.stopped = Some(why.to_string());
                s.wake();
            } else {
                s.last_done = s.last_done.max(now);
            }
        }
        // Its queued commands will never run; its commands out hold the device until the
        // router removes it.
        self.sched.remove_tenant(t, now);
        if self.next.is_some_and(|(n, _)| n == t) {
            self.next = None;
        }
        self.pump(now);
        Some((t, Duration::from_nanos(now.saturating_sub(since))))
    }

    fn view(&self, t: TenantId) -> Option<SchedView> {
        let slot = self.tenants.get(&t)?;
        let ss = self.sched.stats(t).unwrap_or_default();
        let p = &slot.s.params;
        Some(SchedView {
            weight: p.weight,
            cap: p.cap,
            priority: p.priority,
            slo: p.slo,
            kernel_timeout_ms: slot.s.kernel_timeout.as_millis() as u64,
            kernels: slot.kernels,
            kernel_ns: slot.kernel_ns,
            charged_ns: ss.charged_ns,
            queue_wait_ns: slot.queue_wait_ns,
            throttled_ns: ss.throttled_ns,
            waiting: slot.waiting,
            inflight: slot.dispatched.len() as u32,
            stopped: slot.stopped.clone(),
        })
    }

    fn device(&self, now: Nanos) -> DeviceStats {
        DeviceStats {
            policy: self.policy.name().to_string(),
            max_inflight: self.max_inflight,
            inflight: self.inflight,
            waiting: self.tenants.values().map(|s| s.waiting).sum(),
            busy_ns: self.busy_ns + self.busy_since.map_or(0, |b| now.saturating_sub(b)),
            uptime_ns: now,
            dispatched: self.dispatched,
            completed: self.completed,
            runaways: self.runaways,
            owner: self.owner,
            switches: self.switches,
            drain_ns: self.drain_ns,
            anticipated: self.anticipated,
        }
    }

    /// `n` dispatched commands are off the device.
    fn release(&mut self, n: u32, now: Nanos) {
        self.inflight = self.inflight.saturating_sub(n);
        if self.inflight == 0 {
            if let Some(b) = self.busy_since.take() {
                self.busy_ns += now.saturating_sub(b);
            }
        }
    }

    /// One slot to `t`, which owns the device from now on.
    fn grant(&mut self, t: TenantId, now: Nanos) {
        let Some(slot) = self.tenants.get_mut(&t) else {
            // Not ours (cannot happen): give the scheduler its command back as done.
            self.sched.complete(t, 0, now);
            return;
        };
        slot.granted += 1;
        slot.dispatched.push_back(now);
        slot.wake();
        self.owner = Some(t);
        self.inflight += 1;
        self.dispatched += 1;
        self.busy_since.get_or_insert(now);
    }

    /// The end of the drained owner's anticipation, while it lasts.
    fn anticipating(&self, now: Nanos) -> Option<Nanos> {
        let (t, _) = self.deferred?;
        let until = self.tenants.get(&t)?.last_done + self.anticipate;
        (now < until).then_some(until)
    }

    /// How many commands the owner may have out: `max_inflight`, or more for short kernels —
    /// as many as fit in [`DRAIN_BUDGET`] of its average measured device time — so a stream
    /// of tiny launches is not made synchronous with their completions.
    fn window(&self) -> u32 {
        let avg = self
            .owner
            .and_then(|o| self.tenants.get(&o))
            .filter(|s| s.kernels >= 8)
            .map(|s| s.kernel_ns / s.kernels);
        match avg {
            Some(avg) => ((DRAIN_BUDGET / avg.max(1)) as u32)
                .clamp(self.max_inflight, MAX_WINDOW.max(self.max_inflight)),
            None => self.max_inflight,
        }
    }

    /// Hands free slots out as the scheduler picks (`grant` wakes the tenant it concerns).
    fn pump(&mut self, now: Nanos) {
        let before = self.next_wake.take();
        self.pump_inner(now);
        // Waiters sleep until the earliest timed decision; one that moved earlier needs
        // someone awake to act on it.
        if self.next_wake.is_some_and(|w| before.is_none_or(|b| w < b)) {
            self.tenants.values().for_each(Slot::wake);
        }
    }

    fn pump_inner(&mut self, now: Nanos) {
        loop {
            if self.inflight == 0 {
                // The owner has drained: the device switches, waits for the owner's next
                // command a little, or is free.
                if let Some((t, since)) = self.next.take() {
                    self.switches += 1;
                    self.drain_ns += now.saturating_sub(since);
                    self.grant(t, now);
                    continue;
                }
                if let Some(until) = self.anticipating(now) {
                    self.next_wake = Some(until);
                    break;
                }
                self.flush_expired(now);
                self.owner = None;
            }
            if self.next.is_some() || self.inflight >= self.window() {
                break;
            }
            // An owner with commands out and none ready keeps the device without asking.
            if let Some(o) = self.owner {
                if self.tenants.get(&o).is_none_or(|s| s.ready() == 0) {
                    break;
                }
            }
            match self.sched.pick(now) {
                Decision::Run(t) if self.owner.is_none_or(|o| o == t) => self.grant(t, now),
                Decision::Run(t) => self.next = Some((t, now)),
                Decision::Wait { until } => {
                    self.next_wake = Some(until);
                    break;
                }
                Decision::Idle => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use hira_policy::sched::{MS, US};

    use super::*;

    fn settings(weight: u32) -> TenantSched {
        TenantSched {
            params: TenantParams::weighted(weight),
            kernel_timeout: Duration::from_secs(10),
        }
    }

    /// A state with tenants 1..=n of weight 1.
    fn state(policy: PolicyKind, max_inflight: u32, n: u64) -> State {
        let mut st = State::new(policy, &SchedConfig::default(), max_inflight);
        (1..=n).for_each(|t| st.add(t, settings(1), 0));
        st
    }

    /// `k` commands of `t` arrive at `now`; how many of them got a slot at once.
    fn submit(st: &mut State, t: TenantId, k: u32, now: Nanos) -> u32 {
        (0..k).for_each(|_| assert_eq!(st.enter(t, now), None));
        st.pump(now);
        take_all(st, t, now)
    }

    /// Every granted slot of `t` taken by its waiting threads.
    fn take_all(st: &mut State, t: TenantId, now: Nanos) -> u32 {
        let mut n = 0;
        while st.take(t, 0, now) == Some(true) {
            n += 1;
        }
        n
    }

    /// Two tenants whose apps keep 3 launches outstanding, each through one connection (at
    /// most one launch of a tenant waits in `acquire`, the next arrives once it is
    /// granted), on a device whose every command of tenant `t` takes `kernel_ns[t - 1]`.
    /// Device time completed per tenant after 2000 completions.
    fn closed_loop(policy: PolicyKind, weights: [u32; 2], kernel_ns: [Nanos; 2]) -> [Nanos; 2] {
        let mut st = State::new(policy, &SchedConfig::default(), 4);
        st.add(1, settings(weights[0]), 0);
        st.add(2, settings(weights[1]), 0);
        let depth = 3;
        // Launches of each tenant not yet granted (the first of them is in `acquire`).
        let mut backlog = [depth, depth];
        let mut now = 0;
        let mut used = [0; 2];
        let feed = |st: &mut State, backlog: &mut [u32; 2], now: Nanos| {
            for t in [1, 2] {
                let b = &mut backlog[t as usize - 1];
                let mut entered = st.tenants[&t].waiting > 0;
                while *b > 0 {
                    if !entered {
                        assert_eq!(st.enter(t, now), None);
                        st.pump(now);
                    }
                    if st.take(t, 0, now) != Some(true) {
                        break;
                    }
                    *b -= 1;
                    entered = false;
                }
            }
        };
        feed(&mut st, &mut backlog, now);
        for _ in 0..2000 {
            let t = st.owner.expect("someone owns a busy device");
            let ns = kernel_ns[t as usize - 1];
            now += ns;
            st.complete(t, ns, now);
            used[t as usize - 1] += ns;
            backlog[t as usize - 1] += 1;
            feed(&mut st, &mut backlog, now);
            feed(&mut st, &mut backlog, now);
        }
        used
    }

    #[test]
    fn lone_tenant_pipelines_up_to_max_inflight() {
        let mut st = state(PolicyKind::Wfq, 4, 1);

        let granted = submit(&mut st, 1, 6, 0);

        assert_eq!(granted, 4);
        assert_eq!(st.owner, Some(1));
    }

    fn paged(st: &mut State, t: TenantId) -> Arc<CompletionPage> {
        let page = Arc::new(CompletionPage::create().expect("page"));
        st.attach_page(t, Arc::clone(&page));
        page
    }

    #[test]
    fn a_lone_tenant_sends_no_messages_and_its_completions_count_at_its_next_launch() {
        let mut st = state(PolicyKind::Wfq, 4, 1);
        let page = paged(&mut st, 1);
        submit(&mut st, 1, 4, 0);
        st.settle_notify();

        let asked = [page.record(US), page.record(2 * US)];
        let full = submit(&mut st, 1, 1, 3 * US);
        let read = st.sync_pages(3 * US);
        let more = take_all(&mut st, 1, 3 * US);
        st.settle_notify();

        assert_eq!(asked, [false, false], "nobody waits: no DONE messages");
        assert_eq!(full, 0, "four out, before the page is read");
        assert!(read);
        assert_eq!(more, 1, "two slots came back through the page");
        assert_eq!(st.tenants[&1].kernels, 2);
        assert_eq!(st.tenants[&1].kernel_ns, 3 * US);
        assert!(!st.notify_wanted());
    }

    #[test]
    fn a_waiting_command_asks_for_messages_until_it_is_granted() {
        let mut st = state(PolicyKind::Fifo, 4, 2);
        let p1 = paged(&mut st, 1);
        let p2 = paged(&mut st, 2);
        submit(&mut st, 1, 2, 0);
        st.settle_notify();
        let quiet = p1.record(US);
        submit(&mut st, 2, 1, US);
        st.settle_notify();

        let asked = p1.record(US);
        let before = take_all(&mut st, 2, 2 * US);
        st.sync_pages(2 * US);
        // Tenant 1 drained: once its anticipation (band_wait) is over, the device turns.
        let later = 2 * US + 1000 * US;
        st.pump(later);
        let granted = take_all(&mut st, 2, later);
        st.settle_notify();

        assert!(!quiet);
        assert!(
            asked,
            "tenant 2 waits: tenant 1's completions are announced"
        );
        assert_eq!(before, 0);
        assert_eq!(
            granted, 1,
            "the completions read from the page let tenant 2 go"
        );
        assert!(
            !st.notify_wanted() && !p2.record(0),
            "nobody waits any more"
        );
    }

    #[test]
    fn only_the_completion_that_drains_the_owner_is_announced() {
        let mut st = state(PolicyKind::Fifo, 4, 2);
        let p1 = paged(&mut st, 1);
        submit(&mut st, 1, 3, 0);
        submit(&mut st, 2, 1, US);
        st.settle_notify();

        let asked = [p1.record(US), p1.record(US), p1.record(US)];

        assert_eq!(
            asked,
            [false, false, true],
            "tenant 2 waits for the drain, not each kernel"
        );
    }

    #[test]
    fn an_owner_waiting_for_a_slot_hears_of_its_next_completion() {
        let mut st = state(PolicyKind::Fifo, 2, 1);
        let p1 = paged(&mut st, 1);
        let granted = submit(&mut st, 1, 3, 0);
        st.settle_notify();

        let asked = p1.record(US);
        st.sync_pages(US);
        st.pump(US);
        let more = take_all(&mut st, 1, US);
        st.settle_notify();
        let after = p1.record(US);

        assert_eq!(granted, 2, "a window of two");
        assert!(asked, "the third command waits for a slot");
        assert_eq!(more, 1);
        assert!(!after, "nothing waits any more");
    }

    #[test]
    fn a_page_never_completes_more_than_was_dispatched() {
        let mut st = state(PolicyKind::Fifo, 4, 1);
        let page = paged(&mut st, 1);
        submit(&mut st, 1, 2, 0);
        for _ in 0..10 {
            page.record(US);
        }

        st.sync_pages(US);

        assert_eq!(st.tenants[&1].kernels, 2);
        assert!(st.tenants[&1].dispatched.is_empty());
        assert_eq!(st.inflight, 0);
    }

    #[test]
    fn a_window_above_the_short_kernel_limit_is_taken_as_configured() {
        // max_inflight beyond MAX_WINDOW once panicked (clamp with min > max) when the
        // owner's average kernel became known.
        let mut st = state(PolicyKind::Fifo, MAX_WINDOW + 10, 1);
        let mut now = 0;
        submit(&mut st, 1, 16, now);
        for _ in 0..16 {
            now += US;
            st.complete(1, US, now);
        }

        let granted = submit(&mut st, 1, MAX_WINDOW + 20, now);

        assert_eq!(granted, MAX_WINDOW + 10);
    }

    #[test]
    fn other_tenant_waits_while_the_owner_has_commands_out() {
        let mut st = state(PolicyKind::Fifo, 4, 2);
        submit(&mut st, 1, 2, 0);

        let granted = submit(&mut st, 2, 1, US);

        assert_eq!(granted, 0);
        assert_eq!(st.device(US).inflight, 2);
    }

    #[test]
    fn picking_another_tenant_drains_the_owner_then_switches() {
        let mut st = state(PolicyKind::Wfq, 4, 2);
        submit(&mut st, 1, 2, 0);
        submit(&mut st, 2, 1, 0);
        st.complete(1, MS, MS);
        let owner_fed = submit(&mut st, 1, 1, MS);
        let before = take_all(&mut st, 2, MS);

        st.complete(1, MS, 2 * MS);

        assert_eq!((owner_fed, before), (0, 0));
        assert_eq!(take_all(&mut st, 2, 2 * MS), 1);
        assert_eq!(st.owner, Some(2));
        assert_eq!(st.device(2 * MS).switches, 1);
        assert_eq!(st.device(2 * MS).drain_ns, MS);
    }

    #[test]
    fn owner_between_commands_keeps_the_device() {
        let mut st = state(PolicyKind::Wfq, 4, 2);
        submit(&mut st, 1, 2, 0);
        submit(&mut st, 2, 1, 0);

        st.complete(1, MS, MS);

        assert_eq!(take_all(&mut st, 2, MS), 0);
        assert_eq!(st.next, None);
    }

    #[test]
    fn drained_owner_frees_the_device_after_the_anticipation() {
        let mut st = state(PolicyKind::Wfq, 4, 2);
        submit(&mut st, 1, 1, 0);
        submit(&mut st, 2, 1, 0);
        st.complete(1, MS, MS);
        let during = take_all(&mut st, 2, MS);
        let wake = st.next_wake;

        st.pump(MS + 500 * US);

        assert_eq!((during, wake), (0, Some(MS + 500 * US)));
        assert_eq!(take_all(&mut st, 2, MS + 500 * US), 1);
        assert_eq!(st.owner, Some(2));
    }

    #[test]
    fn owner_back_within_the_anticipation_keeps_its_place() {
        let mut st = state(PolicyKind::Wfq, 4, 2);
        submit(&mut st, 2, 1, 0);
        st.complete(2, 10 * MS, 10 * MS);
        submit(&mut st, 1, 1, 10 * MS);
        st.pump(10 * MS + 500 * US);
        take_all(&mut st, 1, 10 * MS + 500 * US);
        submit(&mut st, 2, 1, 11 * MS);
        st.complete(1, MS, 11 * MS + 500 * US);

        let again = submit(&mut st, 1, 1, 11 * MS + 600 * US);

        assert_eq!(again, 1);
        assert_eq!(take_all(&mut st, 2, 11 * MS + 600 * US), 0);
        assert_eq!(st.device(11 * MS + 600 * US).anticipated, 1);
    }

    #[test]
    fn wfq_shares_device_time_by_weight() {
        let used = closed_loop(PolicyKind::Wfq, [1, 2], [MS, 5 * MS]);

        let share = used[1] as f64 / (used[0] + used[1]) as f64;

        assert!((share - 2.0 / 3.0).abs() < 0.02, "share {share}");
    }

    #[test]
    fn wfq_shares_device_time_equally_between_short_and_long_kernels() {
        let used = closed_loop(PolicyKind::Wfq, [1, 1], [MS, 5 * MS]);

        let share = used[0] as f64 / (used[0] + used[1]) as f64;

        assert!((share - 0.5).abs() < 0.02, "share {share}");
    }

    #[test]
    fn every_policy_serves_both_tenants() {
        let starved: Vec<PolicyKind> = PolicyKind::ALL
            .into_iter()
            .filter(|&p| closed_loop(p, [1, 1], [MS, 5 * MS]).contains(&0))
            .collect();

        assert!(starved.is_empty(), "starved under {starved:?}");
    }

    #[test]
    fn cap_holds_a_lone_tenant_until_the_next_window() {
        let mut st = State::new(PolicyKind::Wfq, &SchedConfig::default(), 4);
        let capped = TenantSched {
            params: TenantParams {
                cap: Some(0.1),
                ..TenantParams::default()
            },
            ..settings(1)
        };
        st.add(1, capped, 0);
        submit(&mut st, 1, 1, 0);
        st.complete(1, 10 * MS, 10 * MS);

        let throttled = submit(&mut st, 1, 1, 10 * MS);
        let wake = st.next_wake;
        st.pump(100 * MS);

        assert_eq!((throttled, wake), (0, Some(100 * MS)));
        assert_eq!(take_all(&mut st, 1, 100 * MS), 1);
    }

    /// BAND at 21 ms, device free: tenant 2 ran 1 ms, tenant 1 then 20 ms (over its
    /// bandwidth; tenant 2 under it).
    fn band_after_a_long_kernel() -> State {
        let mut st = state(PolicyKind::Band, 4, 2);
        submit(&mut st, 2, 1, 0);
        submit(&mut st, 1, 1, 0);
        st.complete(2, MS, MS);
        st.pump(MS + 500 * US);
        take_all(&mut st, 1, MS + 500 * US);
        st.complete(1, 20 * MS, 21 * MS);
        st
    }

    #[test]
    fn band_waits_briefly_on_a_free_device() {
        let mut st = band_after_a_long_kernel();

        let waited = submit(&mut st, 1, 1, 21 * MS);
        let wake = st.next_wake;
        let short = submit(&mut st, 2, 1, 21 * MS + 100 * US);

        assert_eq!((waited, wake), (0, Some(21 * MS + 500 * US)));
        assert_eq!(short, 1);
    }

    #[test]
    fn band_does_not_wait_again_after_the_anticipation() {
        let mut st = band_after_a_long_kernel();
        // Tenant 2 drains and does not come back.
        submit(&mut st, 2, 1, 21 * MS);
        let waiting = submit(&mut st, 1, 1, 21 * MS);
        st.complete(2, MS, 22 * MS);
        let anticipated = st.next_wake;

        st.pump(22 * MS + 500 * US);

        assert_eq!((waiting, anticipated), (0, Some(22 * MS + 500 * US)));
        assert_eq!(
            take_all(&mut st, 1, 22 * MS + 500 * US),
            1,
            "no second wait"
        );
        assert_eq!(st.owner, Some(1));
    }

    #[test]
    fn removing_the_owner_hands_the_device_on() {
        let mut st = state(PolicyKind::Fifo, 4, 2);
        submit(&mut st, 1, 3, 0);
        submit(&mut st, 2, 2, 0);

        st.remove(1, MS);

        assert_eq!(take_all(&mut st, 2, MS), 2);
        assert_eq!(st.owner, Some(2));
    }

    #[test]
    fn removing_the_next_tenant_lets_the_owner_go_on() {
        let mut st = state(PolicyKind::Wfq, 4, 2);
        submit(&mut st, 1, 2, 0);
        submit(&mut st, 2, 1, 0);
        st.complete(1, MS, MS);
        submit(&mut st, 1, 1, MS);

        st.remove(2, MS);

        assert_eq!(take_all(&mut st, 1, MS), 1);
        assert_eq!(st.next, None);
    }

    #[test]
    fn stopped_owner_gives_up_and_its_removal_frees_the_device() {
        let mut st = state(PolicyKind::Fifo, 4, 2);
        st.add(
            1,
            TenantSched {
                kernel_timeout: Duration::ZERO,
                ..settings(1)
            },
            0,
        );
        submit(&mut st, 1, 1, 0);
        assert_eq!(st.enter(1, 0), None);
        submit(&mut st, 2, 1, 0);

        let runaway = st.take_runaway("runaway kernel", MS);
        let gave_up = st.take(1, 0, MS);
        st.remove(1, 2 * MS);

        assert_eq!(runaway.map(|(t, _)| t), Some(1));
        assert_eq!(gave_up, Some(false));
        assert_eq!(take_all(&mut st, 2, 2 * MS), 1);
    }

    #[test]
    fn policy_switch_keeps_the_owner_and_the_waiters() {
        let mut st = state(PolicyKind::Wfq, 4, 2);
        submit(&mut st, 1, 2, 0);
        submit(&mut st, 2, 1, 0);
        st.complete(1, MS, MS);
        submit(&mut st, 1, 1, MS);

        st.set_policy(PolicyKind::RoundRobin, MS);
        let out = st.sched.stats(1).map(|s| s.running);
        st.complete(1, MS, 2 * MS);

        assert_eq!(st.policy, PolicyKind::RoundRobin);
        assert_eq!(out, Some(1));
        assert_eq!(st.device(2 * MS).inflight, 1);
        assert_eq!(st.tenants.values().map(|s| s.granted).sum::<u32>(), 1);
    }

    #[test]
    fn completion_frees_a_slot_for_a_waiting_thread() {
        let d = Arc::new(Dispatcher::new(
            PolicyKind::Fifo,
            &SchedConfig::default(),
            1,
        ));
        d.add(1, settings(1));
        d.add(2, settings(1));
        assert!(d.acquire(1));
        let waiter = {
            let d = Arc::clone(&d);
            std::thread::spawn(move || d.acquire(2))
        };

        d.complete(1, 1_000_000);

        assert!(waiter.join().unwrap());
        assert_eq!(d.view(1).unwrap().kernel_ns, 1_000_000);
    }

    #[test]
    fn removal_wakes_waiting_threads() {
        let d = Arc::new(Dispatcher::new(
            PolicyKind::Fifo,
            &SchedConfig::default(),
            4,
        ));
        d.add(1, settings(1));
        d.add(2, settings(1));
        assert!(d.acquire(1));
        let waiter = {
            let d = Arc::clone(&d);
            std::thread::spawn(move || d.acquire(2))
        };

        d.remove(1);

        assert!(waiter.join().unwrap());
        assert_eq!(d.device().owner, Some(2));
    }

    #[test]
    fn unknown_tenant_passes() {
        let d = Dispatcher::new(PolicyKind::Wfq, &SchedConfig::default(), 1);

        assert!(d.acquire(9));
    }

    #[test]
    fn runaway_is_the_stuck_tenant() {
        let d = Dispatcher::new(PolicyKind::Fifo, &SchedConfig::default(), 2);
        d.add(
            1,
            TenantSched {
                kernel_timeout: Duration::ZERO,
                ..settings(1)
            },
        );
        assert!(d.acquire(1));
        std::thread::sleep(Duration::from_millis(2));

        let r = d.take_runaway("runaway kernel");

        assert_eq!(r.map(|(t, _)| t), Some(1));
        assert!(!d.acquire(1));
        assert_eq!(
            d.view(1).unwrap().stopped.as_deref(),
            Some("runaway kernel")
        );
    }
}
