//! AccC and SLAF (Pegasus §4.1, §4.3, Algorithm 1).
//!
//! AccC: a tenant's credits (its weight) become ticks, `weight / least weight` (at least 1),
//! so credits 1024, 512, 256, 512 give 4, 2, 1 and 2 ticks. The run queue is ordered by
//! credits; the tenant at its head runs its commands until it has used its ticks of device
//! time, then the next tenant with work takes its turn. Kernels cannot be cut, so the
//! overshoot of a turn is carried as debt into the tenant's next turn (as in deficit round
//! robin); a tenant that runs out of work gives up the rest of its turn.
//!
//! SLAF adds feedback: every `slo_window` each tenant with an SLO is checked against it
//! (device time used ≥ `slo` × the time it had work). A tenant that fell short gets one more
//! tick per turn, cumulatively while it keeps falling short, and goes first in the run
//! queue; one that beats its SLO by a tick gives an extra tick back.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use super::core::{Choice, Policy, Table};
use super::{Nanos, PolicyKind, SchedConfig, TenantId};

/// Most extra ticks SLAF grants a tenant.
const MAX_COMPENSATION: u64 = 64;

#[derive(Debug, Default)]
struct Slot {
    /// Debt from overshooting earlier turns (≤ 0).
    carry: i64,
    /// SLAF: extra ticks per turn.
    compensation: u64,
    /// SLAF: fell short of its SLO in the last window.
    violating: bool,
    /// SLAF: device time used in the current window.
    used_window: Nanos,
    /// SLAF: the tenant's backlogged time at the start of the window.
    backlog_mark: Nanos,
}

/// Run-queue order: SLO violators first, then more credits first, then id.
type Key = (bool, Reverse<u64>, TenantId);

#[derive(Debug)]
pub(crate) struct AccC {
    slaf: bool,
    tick: Nanos,
    slo_window: Nanos,
    window_index: u64,
    slots: BTreeMap<TenantId, Slot>,
    /// Whose turn it is and how much of it is left.
    current: Option<TenantId>,
    remaining: i64,
    last: Option<Key>,
}

fn ns_i64(ns: Nanos) -> i64 {
    i64::try_from(ns).unwrap_or(i64::MAX)
}

impl AccC {
    pub fn new(cfg: &SchedConfig, slaf: bool) -> Self {
        Self {
            slaf,
            tick: cfg.tick,
            slo_window: cfg.slo_window,
            window_index: 0,
            slots: BTreeMap::new(),
            current: None,
            remaining: 0,
            last: None,
        }
    }

    fn key(&self, t: TenantId, table: &Table) -> Key {
        let violating = self.slots.get(&t).is_some_and(|s| s.violating);
        let weight = table.get(t).map_or(1, |e| e.params.weight());
        (!violating, Reverse(weight), t)
    }

    /// Device time of one turn of `t`: its ticks plus SLAF's extra ticks.
    fn quantum(&self, t: TenantId, table: &Table) -> i64 {
        let least = table
            .iter()
            .map(|(_, e)| e.params.weight())
            .min()
            .unwrap_or(1);
        let ticks = table
            .get(t)
            .map_or(1, |e| (e.params.weight() / least).max(1));
        let extra = self.slots.get(&t).map_or(0, |s| s.compensation);
        ns_i64(self.tick).saturating_mul(ns_i64(ticks + extra))
    }

    /// Ends the current turn, keeping only its debt.
    fn end_turn(&mut self) {
        if let Some(c) = self.current.take() {
            if let Some(s) = self.slots.get_mut(&c) {
                s.carry = self.remaining.min(0);
            }
        }
        self.remaining = 0;
    }

    fn evaluate_slos(&mut self, table: &Table) {
        let tick = self.tick;
        for (t, e) in table.iter() {
            let Some(s) = self.slots.get_mut(&t) else {
                continue;
            };
            let demand = e.backlogged.saturating_sub(s.backlog_mark);
            let target = e.params.slo.map_or(0.0, |slo| slo * demand as f64);
            let used = s.used_window as f64;
            s.violating = e.params.slo.is_some() && demand > 0 && used < target;
            if s.violating {
                s.compensation = (s.compensation + 1).min(MAX_COMPENSATION);
            } else if used >= target + tick as f64 {
                s.compensation = s.compensation.saturating_sub(1);
            }
            s.used_window = 0;
            s.backlog_mark = e.backlogged;
        }
    }
}

impl Policy for AccC {
    fn kind(&self) -> PolicyKind {
        if self.slaf {
            PolicyKind::Slaf
        } else {
            PolicyKind::AccC
        }
    }

    fn roll(&mut self, table: &Table, now: Nanos) {
        let index = now / self.slo_window;
        if self.slaf && index > self.window_index {
            self.evaluate_slos(table);
        }
        self.window_index = index;
    }

    fn added(&mut self, t: TenantId, table: &Table, _now: Nanos) {
        let backlog_mark = table.get(t).map_or(0, |e| e.backlogged);
        self.slots.insert(
            t,
            Slot {
                backlog_mark,
                ..Slot::default()
            },
        );
    }

    fn removed(&mut self, t: TenantId, _table: &Table, _now: Nanos) {
        self.slots.remove(&t);
        if self.current == Some(t) {
            self.current = None;
            self.remaining = 0;
        }
    }

    fn choose(&mut self, table: &Table, _now: Nanos) -> Choice {
        if let Some(c) = self.current {
            if self.remaining > 0 && table.ready(c) {
                return Choice::Run(c);
            }
        }
        self.end_turn();
        let mut order: Vec<(Key, TenantId)> = table
            .iter()
            .filter(|(t, _)| table.ready(*t))
            .map(|(t, _)| (self.key(t, table), t))
            .collect();
        if order.is_empty() {
            return Choice::Nothing;
        }
        order.sort();
        let start = self.last.map_or(0, |last| {
            order.iter().position(|(k, _)| *k > last).unwrap_or(0)
        });
        order.rotate_left(start);
        // Whole rounds in which every ready tenant only pays off debt.
        let rounds = order
            .iter()
            .map(|(_, t)| {
                let debt = -self.slots.get(t).map_or(0, |s| s.carry);
                debt / self.quantum(*t, table).max(1)
            })
            .min()
            .unwrap_or(0);
        for (key, t) in order {
            let quantum = self.quantum(t, table);
            let Some(s) = self.slots.get_mut(&t) else {
                continue;
            };
            let balance = s
                .carry
                .saturating_add(quantum.saturating_mul(rounds))
                .saturating_add(quantum);
            if balance > 0 {
                s.carry = 0;
                self.current = Some(t);
                self.remaining = balance;
                self.last = Some(key);
                return Choice::Run(t);
            }
            s.carry = balance;
        }
        Choice::Nothing
    }

    fn completed(&mut self, t: TenantId, device_ns: Nanos, _table: &Table, _now: Nanos) {
        if self.current == Some(t) {
            self.remaining = self.remaining.saturating_sub(ns_i64(device_ns));
        } else if let Some(s) = self.slots.get_mut(&t) {
            s.carry = s.carry.saturating_sub(ns_i64(device_ns));
        }
        if let Some(s) = self.slots.get_mut(&t) {
            s.used_window += device_ns;
        }
    }

    fn credit_ns(&self, t: TenantId) -> i64 {
        match self.current {
            Some(c) if c == t => self.remaining,
            _ => self.slots.get(&t).map_or(0, |s| s.carry),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::sched::tests::dispatch_order;
    use crate::sched::{new_scheduler, Decision, PolicyKind, SchedConfig, TenantParams, MS};

    /// Pegasus' example: credits 1024, 512, 256, 512 give 4, 2, 1, 2 ticks per turn.
    #[test]
    fn credits_become_ticks() {
        let cfg = SchedConfig {
            tick: MS,
            ..SchedConfig::default()
        };
        let mut s = new_scheduler(PolicyKind::AccC, &cfg);
        let credits = [(1, 1024), (2, 512), (3, 256), (4, 512)];
        credits
            .iter()
            .for_each(|&(t, w)| s.add_tenant(t, &TenantParams::weighted(w), 0));
        credits
            .iter()
            .for_each(|&(t, _)| (0..20).for_each(|_| s.submit(t, 0)));

        let turns = dispatch_order(s.as_mut(), 0, 9, MS);

        assert_eq!(turns, [1, 1, 1, 1, 2, 2, 4, 4, 3]);
    }

    #[test]
    fn overshoot_is_paid_back_next_turn() {
        let cfg = SchedConfig {
            tick: MS,
            ..SchedConfig::default()
        };
        let mut s = new_scheduler(PolicyKind::AccC, &cfg);
        s.add_tenant(1, &TenantParams::default(), 0);
        s.add_tenant(2, &TenantParams::default(), 0);
        (0..5).for_each(|_| s.submit(1, 0));
        (0..5).for_each(|_| s.submit(2, 0));
        assert_eq!(s.pick(0), Decision::Run(1));
        s.complete(1, 3 * MS, 3 * MS);

        let turns = dispatch_order(s.as_mut(), 3 * MS, 4, MS);

        assert_eq!(turns, [2, 2, 2, 1]);
    }
}
