//! What every policy shares: per-tenant queue lengths and charged time, the `cap` limiter,
//! and the engine that drives a [`Policy`] through the [`Scheduler`] trait.

use std::collections::{BTreeMap, VecDeque};

use super::{Decision, Nanos, PolicyKind, Scheduler, TenantId, TenantParams, TenantSchedStats};

/// How `cap` is enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CapMode {
    /// A budget of `cap * window` per aligned window; overshoot is carried as debt, unused
    /// budget is not carried. A throttled tenant is retried at the next window.
    Window { window: Nanos },
    /// AvA's fixed-rate polling: a tenant whose device time over the last `window` reached
    /// `cap * window` is postponed by `poll` and checked again.
    Polling { window: Nanos, poll: Nanos },
}

impl CapMode {
    fn window(self) -> Nanos {
        match self {
            CapMode::Window { window } | CapMode::Polling { window, .. } => window,
        }
    }
}

/// A tenant's `cap` state.
#[derive(Debug, Default)]
struct Limiter {
    /// Current aligned window (window mode).
    index: u64,
    /// Budget left in the current window, negative when in debt (window mode).
    allowance: i64,
    /// Completions within the sliding window: (time, device ns) (polling mode).
    recent: VecDeque<(Nanos, Nanos)>,
    recent_sum: Nanos,
}

fn budget(cap: f64, window: Nanos) -> i64 {
    // Saturating float-to-int conversion; caps are validated to (0, 1].
    (cap * window as f64) as i64
}

impl Limiter {
    fn new(mode: CapMode, cap: Option<f64>, now: Nanos) -> Self {
        Self {
            index: now / mode.window(),
            allowance: cap.map_or(0, |c| budget(c, mode.window())),
            ..Self::default()
        }
    }

    fn roll(&mut self, mode: CapMode, cap: Option<f64>, now: Nanos) {
        match mode {
            CapMode::Window { window } => {
                let index = now / window;
                if index > self.index {
                    let b = cap.map_or(0, |c| budget(c, window));
                    let windows = i64::try_from(index - self.index).unwrap_or(i64::MAX);
                    self.allowance = self
                        .allowance
                        .saturating_add(b.saturating_mul(windows))
                        .min(b);
                    self.index = index;
                }
            }
            CapMode::Polling { window, .. } => {
                while let Some(&(at, ns)) = self.recent.front() {
                    if at.saturating_add(window) > now {
                        break;
                    }
                    self.recent.pop_front();
                    self.recent_sum -= ns;
                }
            }
        }
    }

    fn allows(&self, mode: CapMode, cap: Option<f64>) -> bool {
        match (cap, mode) {
            (None, _) => true,
            (Some(_), CapMode::Window { .. }) => self.allowance > 0,
            (Some(c), CapMode::Polling { window, .. }) => {
                i64::try_from(self.recent_sum).unwrap_or(i64::MAX) < budget(c, window)
            }
        }
    }

    fn charge(&mut self, mode: CapMode, ns: Nanos, now: Nanos) {
        match mode {
            CapMode::Window { .. } => {
                self.allowance = self
                    .allowance
                    .saturating_sub(i64::try_from(ns).unwrap_or(i64::MAX));
            }
            CapMode::Polling { .. } => {
                self.recent.push_back((now, ns));
                self.recent_sum += ns;
            }
        }
    }

    /// A new cap takes effect now: never more budget than the new cap allows in this window.
    fn recap(&mut self, mode: CapMode, old: Option<f64>, new: Option<f64>) {
        if let (CapMode::Window { window }, Some(c)) = (mode, new) {
            let b = budget(c, window);
            self.allowance = if old.is_none() {
                b
            } else {
                self.allowance.min(b)
            };
        }
    }

    fn retry_at(&self, mode: CapMode, now: Nanos) -> Nanos {
        match mode {
            CapMode::Window { window } => (now / window + 1) * window,
            CapMode::Polling { poll, .. } => now + poll,
        }
    }
}

/// A tenant as every policy sees it.
#[derive(Debug)]
pub(crate) struct Entry {
    pub params: TenantParams,
    /// Submitted, not yet dispatched.
    pub queued: u32,
    /// Dispatched, not yet completed.
    pub running: u32,
    /// Device time charged so far.
    pub charged: Nanos,
    /// Time with queued work held back by the cap.
    pub throttled: Nanos,
    /// Time with work queued or running.
    pub backlogged: Nanos,
    throttled_now: bool,
    limiter: Limiter,
}

impl Entry {
    /// Has work queued or running.
    pub fn busy(&self) -> bool {
        self.queued > 0 || self.running > 0
    }
}

/// All tenants, in id order (so every policy is deterministic).
#[derive(Debug)]
pub(crate) struct Table {
    tenants: BTreeMap<TenantId, Entry>,
    mode: CapMode,
    last: Nanos,
}

impl Table {
    pub fn get(&self, t: TenantId) -> Option<&Entry> {
        self.tenants.get(&t)
    }

    pub fn iter(&self) -> impl Iterator<Item = (TenantId, &Entry)> {
        self.tenants.iter().map(|(t, e)| (*t, e))
    }

    /// Has a command queued and is not held back by its cap.
    pub fn ready(&self, t: TenantId) -> bool {
        self.tenants
            .get(&t)
            .is_some_and(|e| e.queued > 0 && e.limiter.allows(self.mode, e.params.cap))
    }

    /// Commands running on the device.
    pub fn running(&self) -> u32 {
        self.tenants.values().map(|e| e.running).sum()
    }

    /// Some tenant has a command queued.
    pub fn any_queued(&self) -> bool {
        self.tenants.values().any(|e| e.queued > 0)
    }

    fn advance(&mut self, now: Nanos) {
        let dt = now.saturating_sub(self.last);
        for e in self.tenants.values_mut() {
            if e.throttled_now {
                e.throttled += dt;
            }
            if e.busy() {
                e.backlogged += dt;
            }
            e.limiter.roll(self.mode, e.params.cap, now);
        }
        self.last = self.last.max(now);
    }

    fn refresh(&mut self) {
        for e in self.tenants.values_mut() {
            e.throttled_now = e.queued > 0 && !e.limiter.allows(self.mode, e.params.cap);
        }
    }

    /// When the earliest tenant held back by its cap should be checked again.
    fn cap_retry(&self, now: Nanos) -> Option<Nanos> {
        self.tenants
            .values()
            .filter(|e| e.queued > 0 && !e.limiter.allows(self.mode, e.params.cap))
            .map(|e| e.limiter.retry_at(self.mode, now))
            .min()
    }
}

/// A policy's answer before the cap is folded in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    Run(TenantId),
    Wait(Nanos),
    Nothing,
}

/// The part that differs between policies. The engine has already updated the [`Table`]
/// when a hook runs; `choose` must only return tenants for which [`Table::ready`] holds.
pub(crate) trait Policy: Send {
    fn kind(&self) -> PolicyKind;
    /// Time advanced to `now` (periods, windows); called first in every event.
    fn roll(&mut self, _table: &Table, _now: Nanos) {}
    fn added(&mut self, t: TenantId, table: &Table, now: Nanos);
    fn removed(&mut self, t: TenantId, table: &Table, now: Nanos);
    fn params_changed(&mut self, _t: TenantId, _table: &Table, _now: Nanos) {}
    /// One more command of `t`; `was_idle` when it had nothing queued or running before.
    fn submitted(&mut self, _t: TenantId, _was_idle: bool, _table: &Table, _now: Nanos) {}
    fn choose(&mut self, table: &Table, now: Nanos) -> Choice;
    fn dispatched(&mut self, _t: TenantId, _table: &Table, _now: Nanos) {}
    fn completed(&mut self, _t: TenantId, _device_ns: Nanos, _table: &Table, _now: Nanos) {}
    fn credit_ns(&self, _t: TenantId) -> i64 {
        0
    }
    fn virtual_ns(&self, _t: TenantId) -> u64 {
        0
    }
}

/// Drives a [`Policy`]: bookkeeping, the cap, statistics.
pub(crate) struct Engine<P> {
    table: Table,
    policy: P,
}

impl<P: Policy> Engine<P> {
    pub fn new(policy: P, mode: CapMode) -> Self {
        Self {
            table: Table {
                tenants: BTreeMap::new(),
                mode,
                last: 0,
            },
            policy,
        }
    }

    fn advance(&mut self, now: Nanos) {
        self.table.advance(now);
        self.policy.roll(&self.table, now);
    }
}

impl<P: Policy> Scheduler for Engine<P> {
    fn kind(&self) -> PolicyKind {
        self.policy.kind()
    }

    fn add_tenant(&mut self, t: TenantId, p: &TenantParams, now: Nanos) {
        if self.table.tenants.contains_key(&t) {
            self.set_params(t, p, now);
            return;
        }
        self.advance(now);
        let entry = Entry {
            params: p.clone(),
            queued: 0,
            running: 0,
            charged: 0,
            throttled: 0,
            backlogged: 0,
            throttled_now: false,
            limiter: Limiter::new(self.table.mode, p.cap, now),
        };
        self.table.tenants.insert(t, entry);
        self.policy.added(t, &self.table, now);
    }

    fn remove_tenant(&mut self, t: TenantId, now: Nanos) {
        self.advance(now);
        if self.table.tenants.remove(&t).is_some() {
            self.policy.removed(t, &self.table, now);
        }
    }

    fn set_params(&mut self, t: TenantId, p: &TenantParams, now: Nanos) {
        self.advance(now);
        let mode = self.table.mode;
        let Some(e) = self.table.tenants.get_mut(&t) else {
            return;
        };
        e.limiter.recap(mode, e.params.cap, p.cap);
        e.params = p.clone();
        self.policy.params_changed(t, &self.table, now);
        self.table.refresh();
    }

    fn submit(&mut self, t: TenantId, now: Nanos) {
        self.advance(now);
        let Some(e) = self.table.tenants.get_mut(&t) else {
            return;
        };
        let was_idle = !e.busy();
        e.queued += 1;
        self.policy.submitted(t, was_idle, &self.table, now);
        self.table.refresh();
    }

    fn pick(&mut self, now: Nanos) -> Decision {
        self.advance(now);
        let cap_retry = self.table.cap_retry(now);
        let decision = match self.policy.choose(&self.table, now) {
            Choice::Run(t) => {
                debug_assert!(
                    self.table.ready(t),
                    "{} chose a tenant that may not run",
                    self.policy.kind()
                );
                let e = self
                    .table
                    .tenants
                    .get_mut(&t)
                    .expect("choose returns known tenants");
                e.queued = e.queued.saturating_sub(1);
                e.running += 1;
                self.policy.dispatched(t, &self.table, now);
                Decision::Run(t)
            }
            Choice::Wait(until) => Decision::Wait {
                until: cap_retry.map_or(until, |c| c.min(until)),
            },
            Choice::Nothing => match cap_retry {
                Some(until) => Decision::Wait { until },
                None => Decision::Idle,
            },
        };
        self.table.refresh();
        decision
    }

    fn complete(&mut self, t: TenantId, device_ns: Nanos, now: Nanos) {
        self.advance(now);
        let mode = self.table.mode;
        let Some(e) = self.table.tenants.get_mut(&t) else {
            return;
        };
        e.running = e.running.saturating_sub(1);
        e.charged += device_ns;
        e.limiter.charge(mode, device_ns, now);
        self.policy.completed(t, device_ns, &self.table, now);
        self.table.refresh();
    }

    fn stats(&self, t: TenantId) -> Option<TenantSchedStats> {
        let e = self.table.get(t)?;
        Some(TenantSchedStats {
            charged_ns: e.charged,
            throttled_ns: e.throttled,
            queued: e.queued,
            running: e.running,
            credit_ns: self.policy.credit_ns(t),
            virtual_ns: self.policy.virtual_ns(t),
        })
    }
}
