//! The per-device dispatcher: a device-time command (a kernel launch) is forwarded only once
//! the device's [`Scheduler`] has picked its tenant. The forwarding thread of the command's
//! connection blocks in [`Dispatcher::acquire`] (so a connection's frames stay in order);
//! the server's DONE frame ends the command ([`Dispatcher::complete`]).
//!
//! Up to `max_inflight` commands may be dispatched and not yet done, so the device never
//! idles while the router turns around; each slot goes to the tenant the scheduler picks.
//! Only device time reported by the server is charged: the router's own switching time is
//! never counted. The clock is a monotonic [`Instant`] converted to nanoseconds.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
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
}

/// One device's dispatcher.
pub struct Dispatcher {
    st: Mutex<State>,
    cv: Condvar,
    epoch: Instant,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher").finish_non_exhaustive()
    }
}

struct State {
    sched: Box<dyn Scheduler>,
    policy: PolicyKind,
    cfg: SchedConfig,
    max_inflight: u32,
    inflight: u32,
    tenants: HashMap<TenantId, Slot>,
    next_wake: Option<Nanos>,
    busy_ns: u64,
    busy_since: Option<Nanos>,
    dispatched: u64,
    completed: u64,
    runaways: u64,
}

#[derive(Debug)]
struct Slot {
    s: TenantSched,
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
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Dispatcher {
    /// A dispatcher running `policy`, with up to `max_inflight` (at least 1) commands out.
    pub fn new(policy: PolicyKind, cfg: &SchedConfig, max_inflight: u32) -> Dispatcher {
        Dispatcher {
            st: Mutex::new(State {
                sched: new_scheduler(policy, cfg),
                policy,
                cfg: cfg.clone(),
                max_inflight: max_inflight.max(1),
                inflight: 0,
                tenants: HashMap::new(),
                next_wake: None,
                busy_ns: 0,
                busy_since: None,
                dispatched: 0,
                completed: 0,
                runaways: 0,
            }),
            cv: Condvar::new(),
            epoch: Instant::now(),
        }
    }

    fn now(&self) -> Nanos {
        self.epoch.elapsed().as_nanos() as Nanos
    }

    /// Admits tenant `t` (again: replaces its settings).
    pub fn add(&self, t: TenantId, s: TenantSched) {
        let now = self.now();
        let mut st = lock(&self.st);
        st.sched.add_tenant(t, &s.params, now);
        match st.tenants.get_mut(&t) {
            Some(slot) => slot.s = s,
            None => {
                st.tenants.insert(
                    t,
                    Slot {
                        s,
                        waiting: 0,
                        granted: 0,
                        dispatched: VecDeque::new(),
                        last_done: now,
                        kernels: 0,
                        kernel_ns: 0,
                        queue_wait_ns: 0,
                        stopped: None,
                    },
                );
            }
        }
        self.cv.notify_all();
    }

    /// Forgets tenant `t`: its queued commands are dropped, its slots returned, its waiting
    /// threads woken (their [`Dispatcher::acquire`] answers false). Returns its final view.
    pub fn remove(&self, t: TenantId) -> Option<SchedView> {
        let now = self.now();
        let mut st = lock(&self.st);
        let view = view_of(&st, t);
        let slot = st.tenants.remove(&t)?;
        st.sched.remove_tenant(t, now);
        let n = slot.dispatched.len() as u32;
        release(&mut st, n, now);
        pump(&mut st, now);
        drop(st);
        self.cv.notify_all();
        view
    }

    /// Waits until the scheduler lets tenant `t` dispatch one command. False if the tenant
    /// was removed or stopped meanwhile (drop the command). A tenant the dispatcher does not
    /// know passes at once.
    pub fn acquire(&self, t: TenantId) -> bool {
        let start = self.now();
        let mut st = lock(&self.st);
        match st.tenants.get_mut(&t) {
            None => return true,
            Some(slot) if slot.stopped.is_some() => return false,
            Some(slot) => slot.waiting += 1,
        }
        st.sched.submit(t, start);
        loop {
            let now = self.now();
            if pump(&mut st, now) {
                self.cv.notify_all();
            }
            let Some(slot) = st.tenants.get_mut(&t) else {
                return false;
            };
            if slot.granted > 0 {
                slot.granted -= 1;
                slot.waiting -= 1;
                slot.queue_wait_ns += now.saturating_sub(start);
                return true;
            }
            let sleep = st
                .next_wake
                .map_or(MAX_SLEEP, |u| Duration::from_nanos(u.saturating_sub(now)))
                .clamp(Duration::from_micros(50), MAX_SLEEP);
            st = self
                .cv
                .wait_timeout(st, sleep)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// A dispatched command of `t` finished after `device_ns` of device time.
    pub fn complete(&self, t: TenantId, device_ns: Nanos) {
        let now = self.now();
        let mut st = lock(&self.st);
        let Some(slot) = st.tenants.get_mut(&t) else {
            return;
        };
        let was_out = slot.dispatched.pop_front().is_some();
        slot.last_done = now;
        slot.kernels += 1;
        slot.kernel_ns += device_ns;
        st.sched.complete(t, device_ns, now);
        st.completed += 1;
        if was_out {
            release(&mut st, 1, now);
        }
        pump(&mut st, now);
        drop(st);
        self.cv.notify_all();
    }

    /// A dispatched command of `t` failed before reaching the device (no DONE will come).
    pub fn cancel(&self, t: TenantId) {
        let now = self.now();
        let mut st = lock(&self.st);
        let Some(slot) = st.tenants.get_mut(&t) else {
            return;
        };
        if slot.dispatched.pop_back().is_some() {
            st.sched.complete(t, 0, now);
            release(&mut st, 1, now);
            pump(&mut st, now);
        }
        drop(st);
        self.cv.notify_all();
    }

    /// Live change of a tenant's settings; effective within one scheduler window.
    pub fn set(&self, t: TenantId, s: TenantSched) -> bool {
        let now = self.now();
        let mut st = lock(&self.st);
        let Some(slot) = st.tenants.get_mut(&t) else {
            return false;
        };
        slot.s = s.clone();
        st.sched.set_params(t, &s.params, now);
        pump(&mut st, now);
        drop(st);
        self.cv.notify_all();
        true
    }

    /// The tenant's current settings.
    pub fn settings(&self, t: TenantId) -> Option<TenantSched> {
        lock(&self.st).tenants.get(&t).map(|s| s.s.clone())
    }

    /// Switches the policy: a fresh scheduler learns every tenant, its waiting commands and
    /// its commands still on the device.
    pub fn set_policy(&self, policy: PolicyKind) {
        let now = self.now();
        let mut st = lock(&self.st);
        let mut sched = new_scheduler(policy, &st.cfg);
        let mut ids: Vec<TenantId> = st.tenants.keys().copied().collect();
        ids.sort_unstable();
        for &t in &ids {
            let slot = &st.tenants[&t];
            sched.add_tenant(t, &slot.s.params, now);
            for _ in 0..slot.waiting.saturating_sub(slot.granted) {
                sched.submit(t, now);
            }
        }
        st.sched = sched;
        st.policy = policy;
        pump(&mut st, now);
        drop(st);
        self.cv.notify_all();
    }

    /// The current policy.
    pub fn policy(&self) -> PolicyKind {
        lock(&self.st).policy
    }

    /// The tenant whose oldest dispatched command has gone without progress for longer than
    /// its `kernel_timeout`, if any; it is marked stopped (its waiting threads give up) and
    /// the others' clocks restart, since a stuck device delays everyone's commands.
    pub fn take_runaway(&self, why: &str) -> Option<(TenantId, Duration)> {
        let now = self.now();
        let mut st = lock(&self.st);
        let (t, since) = st
            .tenants
            .iter()
            .filter(|(_, s)| s.stopped.is_none())
            .filter_map(|(&t, s)| {
                let since = (*s.dispatched.front()?).max(s.last_done);
                let limit = s.s.kernel_timeout.as_nanos() as Nanos;
                (now.saturating_sub(since) > limit).then_some((t, since))
            })
            .min_by_key(|&(_, since)| since)?;
        st.runaways += 1;
        for (&u, s) in st.tenants.iter_mut() {
            if u == t {
                s.stopped = Some(why.to_string());
            } else {
                s.last_done = s.last_done.max(now);
            }
        }
        drop(st);
        self.cv.notify_all();
        Some((t, Duration::from_nanos(now.saturating_sub(since))))
    }

    /// The tenant's scheduling view.
    pub fn view(&self, t: TenantId) -> Option<SchedView> {
        view_of(&lock(&self.st), t)
    }

    /// The device's view.
    pub fn device(&self) -> DeviceStats {
        let now = self.now();
        let st = lock(&self.st);
        DeviceStats {
            policy: st.policy.name().to_string(),
            max_inflight: st.max_inflight,
            inflight: st.inflight,
            waiting: st.tenants.values().map(|s| s.waiting).sum(),
            busy_ns: st.busy_ns + st.busy_since.map_or(0, |b| now.saturating_sub(b)),
            uptime_ns: now,
            dispatched: st.dispatched,
            completed: st.completed,
            runaways: st.runaways,
        }
    }
}

fn view_of(st: &State, t: TenantId) -> Option<SchedView> {
    let slot = st.tenants.get(&t)?;
    let ss = st.sched.stats(t).unwrap_or_default();
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

/// `n` dispatched commands are off the device.
fn release(st: &mut State, n: u32, now: Nanos) {
    st.inflight = st.inflight.saturating_sub(n);
    if st.inflight == 0 {
        if let Some(b) = st.busy_since.take() {
            st.busy_ns += now.saturating_sub(b);
        }
    }
}

/// Hands free slots to the tenants the scheduler picks; true if any was granted.
fn pump(st: &mut State, now: Nanos) -> bool {
    let mut any = false;
    while st.inflight < st.max_inflight {
        match st.sched.pick(now) {
            Decision::Run(t) => {
                let Some(slot) = st.tenants.get_mut(&t) else {
                    // Not ours (cannot happen): give the scheduler its slot back.
                    st.sched.complete(t, 0, now);
                    continue;
                };
                slot.granted += 1;
                slot.dispatched.push_back(now);
                st.inflight += 1;
                st.dispatched += 1;
                if st.busy_since.is_none() {
                    st.busy_since = Some(now);
                }
                any = true;
            }
            Decision::Wait { until } => {
                st.next_wake = Some(until);
                return any;
            }
            Decision::Idle => break,
        }
    }
    st.next_wake = None;
    any
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn settings(weight: u32) -> TenantSched {
        TenantSched {
            params: TenantParams::weighted(weight),
            kernel_timeout: Duration::from_secs(10),
        }
    }

    #[test]
    fn lone_tenant_gets_every_slot() {
        let d = Dispatcher::new(PolicyKind::Wfq, &SchedConfig::default(), 2);
        d.add(1, settings(1));

        let first = d.acquire(1);
        let second = d.acquire(1);

        assert!(first && second);
        assert_eq!(d.device().inflight, 2);
    }

    #[test]
    fn completion_frees_a_slot_for_a_waiter() {
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
    fn removal_returns_slots_and_wakes_waiters() {
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

        d.remove(1);

        assert!(waiter.join().unwrap());
        assert_eq!(d.device().inflight, 1);
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

    #[test]
    fn policy_switch_keeps_waiters() {
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
        std::thread::sleep(Duration::from_millis(5));

        d.set_policy(PolicyKind::Wfq);
        d.complete(1, 1000);

        assert!(waiter.join().unwrap());
        assert_eq!(d.policy(), PolicyKind::Wfq);
    }
}
