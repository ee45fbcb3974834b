//! Weighted fair queuing on measured device time (AvA §5.5.2.2, §5.6.5).
//!
//! Each tenant has a virtual time that advances by `device_ns / weight` when one of its
//! commands completes; the ready tenant with the least virtual time goes next (start-time
//! fair queuing: the length of a kernel is known only once it has run). The system virtual
//! time is that of the last dispatched tenant; a tenant that was idle comes back at no less
//! than it, so idleness earns no credit and costs nothing.
//!
//! - `wfq`: the above; `cap` as every policy enforces it (a budget per period).
//! - `wfq-fixed`: `cap` enforced AvA's way: a tenant whose device time over the last
//!   `window` reached its cap is postponed by a fixed `poll` and checked again.
//! - `wfq-aimd`: each tenant also has an allowance of device time per `window`, adapted by
//!   AIMD: halved when the tenant used more than its weight share of the window (plus the
//!   one kernel it could not be stopped in), raised by `aimd_step` when it stayed under its
//!   share while the device was contended. A tenant past its allowance goes after every
//!   tenant within theirs, but still runs when nobody else is ready (work-conserving).

use std::cmp::Reverse;
use std::collections::BTreeMap;

use super::core::{Choice, Policy, Table};
use super::{Nanos, PolicyKind, SchedConfig, TenantId};

/// Fixed-point scale of virtual time, so that small kernels on heavy weights still count.
const SCALE: u128 = 1 << 20;

#[derive(Debug)]
struct Flow {
    vtime: u128,
    /// AIMD: device time the tenant may use per window while others are ready.
    allowance: Nanos,
    used_window: Nanos,
    longest_kernel: Nanos,
    active: bool,
}

#[derive(Debug)]
pub(crate) struct Wfq {
    kind: PolicyKind,
    window: Nanos,
    step: Nanos,
    window_index: u64,
    /// System virtual time: that of the last dispatched tenant.
    floor: u128,
    flows: BTreeMap<TenantId, Flow>,
}

impl Wfq {
    pub fn new(cfg: &SchedConfig, kind: PolicyKind) -> Self {
        Self {
            kind,
            window: cfg.window,
            step: cfg.aimd_step,
            window_index: 0,
            floor: 0,
            flows: BTreeMap::new(),
        }
    }

    fn aimd(&self) -> bool {
        self.kind == PolicyKind::WfqAimd
    }

    fn over_allowance(&self, t: TenantId) -> bool {
        self.aimd()
            && self
                .flows
                .get(&t)
                .is_some_and(|f| f.used_window >= f.allowance)
    }

    /// AIMD at the end of a window.
    fn adapt(&mut self, table: &Table) {
        let active = |t: TenantId, flows: &BTreeMap<TenantId, Flow>| {
            flows.get(&t).is_some_and(|f| f.active) || table.get(t).is_some_and(|e| e.busy())
        };
        let members: Vec<(TenantId, u64)> = table
            .iter()
            .filter(|(t, _)| active(*t, &self.flows))
            .map(|(t, e)| (t, e.params.weight()))
            .collect();
        let total: u64 = members.iter().map(|(_, w)| w).sum::<u64>().max(1);
        let contended = members.len() >= 2;
        for (t, w) in members {
            let Some(f) = self.flows.get_mut(&t) else {
                continue;
            };
            let share = u128::from(self.window) * u128::from(w) / u128::from(total);
            let used = u128::from(f.used_window);
            if used > share + u128::from(f.longest_kernel) {
                f.allowance = (f.allowance / 2).max(self.step);
            } else if contended && used < share {
                f.allowance = (f.allowance + self.step).min(self.window);
            }
        }
        for (t, f) in self.flows.iter_mut() {
            f.used_window = 0;
            f.longest_kernel = 0;
            f.active = table.get(*t).is_some_and(|e| e.busy());
        }
    }
}

impl Policy for Wfq {
    fn kind(&self) -> PolicyKind {
        self.kind
    }

    fn roll(&mut self, table: &Table, now: Nanos) {
        let index = now / self.window;
        if self.aimd() && index > self.window_index {
            self.adapt(table);
        }
        self.window_index = index;
    }

    fn added(&mut self, t: TenantId, _table: &Table, _now: Nanos) {
        let flow = Flow {
            vtime: self.floor,
            allowance: self.window,
            used_window: 0,
            longest_kernel: 0,
            active: false,
        };
        self.flows.insert(t, flow);
    }

    fn removed(&mut self, t: TenantId, _table: &Table, _now: Nanos) {
        self.flows.remove(&t);
    }

    fn submitted(&mut self, t: TenantId, was_idle: bool, _table: &Table, _now: Nanos) {
        let floor = self.floor;
        if let Some(f) = self.flows.get_mut(&t) {
            if was_idle {
                f.vtime = f.vtime.max(floor);
            }
            f.active = true;
        }
    }

    fn choose(&mut self, table: &Table, _now: Nanos) -> Choice {
        table
            .iter()
            .filter(|(t, _)| table.ready(*t))
            .min_by_key(|(t, e)| {
                let vtime = self.flows.get(t).map_or(0, |f| f.vtime);
                (
                    self.over_allowance(*t),
                    vtime,
                    Reverse(e.params.priority),
                    *t,
                )
            })
            .map_or(Choice::Nothing, |(t, _)| Choice::Run(t))
    }

    fn dispatched(&mut self, t: TenantId, _table: &Table, _now: Nanos) {
        if let Some(f) = self.flows.get_mut(&t) {
            self.floor = self.floor.max(f.vtime);
            f.active = true;
        }
    }

    fn completed(&mut self, t: TenantId, device_ns: Nanos, table: &Table, _now: Nanos) {
        let weight = table.get(t).map_or(1, |e| e.params.weight());
        if let Some(f) = self.flows.get_mut(&t) {
            f.vtime += u128::from(device_ns) * SCALE / u128::from(weight);
            f.used_window += device_ns;
            f.longest_kernel = f.longest_kernel.max(device_ns);
        }
    }

    fn credit_ns(&self, t: TenantId) -> i64 {
        let left = |f: &Flow| {
            i64::try_from(f.allowance).unwrap_or(i64::MAX)
                - i64::try_from(f.used_window).unwrap_or(i64::MAX)
        };
        match self.flows.get(&t) {
            Some(f) if self.aimd() => left(f),
            _ => 0,
        }
    }

    fn virtual_ns(&self, t: TenantId) -> u64 {
        self.flows
            .get(&t)
            .map_or(0, |f| u64::try_from(f.vtime / SCALE).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use crate::sched::tests::dispatch_order;
    use crate::sched::{new_scheduler, Decision, PolicyKind, SchedConfig, TenantParams, MS};

    #[test]
    fn least_virtual_time_goes_first() {
        let mut s = new_scheduler(PolicyKind::Wfq, &SchedConfig::default());
        s.add_tenant(1, &TenantParams::weighted(1), 0);
        s.add_tenant(2, &TenantParams::weighted(2), 0);
        (0..6).for_each(|_| s.submit(1, 0));
        (0..6).for_each(|_| s.submit(2, 0));

        let turns = dispatch_order(s.as_mut(), 0, 6, MS);

        assert_eq!(turns, [1, 2, 2, 1, 2, 2]);
    }

    #[test]
    fn returning_tenant_starts_at_current_virtual_time() {
        let mut s = new_scheduler(PolicyKind::Wfq, &SchedConfig::default());
        s.add_tenant(1, &TenantParams::default(), 0);
        s.add_tenant(2, &TenantParams::default(), 0);
        (0..100).for_each(|_| s.submit(1, 0));
        dispatch_order(s.as_mut(), 0, 50, MS);
        s.submit(2, 50 * MS);

        let turns = dispatch_order(s.as_mut(), 50 * MS, 4, MS);
        let v2 = s.stats(2).map(|st| st.virtual_ns);

        assert_eq!(turns, [2, 1, 1, 1]);
        assert_eq!(v2, Some(50 * MS));
    }

    #[test]
    fn capped_lone_tenant_waits_for_next_window() {
        let mut s = new_scheduler(PolicyKind::Wfq, &SchedConfig::default());
        let capped = TenantParams {
            cap: Some(0.1),
            ..TenantParams::default()
        };
        s.add_tenant(1, &capped, 0);
        (0..3).for_each(|_| s.submit(1, 0));
        assert_eq!(s.pick(0), Decision::Run(1));
        s.complete(1, 10 * MS, 10 * MS);

        let throttled = s.pick(10 * MS);
        let next_window = s.pick(100 * MS);

        assert_eq!(throttled, Decision::Wait { until: 100 * MS });
        assert_eq!(next_window, Decision::Run(1));
    }

    #[test]
    fn fixed_rate_polls_a_capped_tenant() {
        let mut s = new_scheduler(PolicyKind::WfqFixedRate, &SchedConfig::default());
        let capped = TenantParams {
            cap: Some(0.1),
            ..TenantParams::default()
        };
        s.add_tenant(1, &capped, 0);
        (0..3).for_each(|_| s.submit(1, 0));
        assert_eq!(s.pick(0), Decision::Run(1));
        s.complete(1, 50 * MS, 50 * MS);

        let throttled = s.pick(50 * MS);
        let later = s.pick(549 * MS);
        let after_window = s.pick(550 * MS);

        assert_eq!(throttled, Decision::Wait { until: 55 * MS });
        assert_eq!(later, Decision::Wait { until: 554 * MS });
        assert_eq!(after_window, Decision::Run(1));
    }
}
