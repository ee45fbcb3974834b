//! Round robin (Pegasus §4): one command per tenant with work, in turn. The cycle visits
//! tenants by priority (higher first), then by id. It ignores kernel lengths, so a tenant
//! with long kernels gets more device time: the baseline the fair policies improve on.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use super::core::{Choice, Policy, Table};
use super::{Nanos, PolicyKind, TenantId};

type Key = (Reverse<i32>, TenantId);

#[derive(Debug, Default)]
pub(crate) struct RoundRobin {
    ring: BTreeSet<Key>,
    /// Position of the tenant that ran last.
    last: Option<Key>,
}

fn key(t: TenantId, table: &Table) -> Key {
    (Reverse(table.get(t).map_or(0, |e| e.params.priority)), t)
}

impl Policy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }

    fn added(&mut self, t: TenantId, table: &Table, _now: Nanos) {
        self.ring.insert(key(t, table));
    }

    fn removed(&mut self, t: TenantId, _table: &Table, _now: Nanos) {
        self.ring.retain(|k| k.1 != t);
    }

    fn params_changed(&mut self, t: TenantId, table: &Table, now: Nanos) {
        self.removed(t, table, now);
        self.added(t, table, now);
    }

    fn choose(&mut self, table: &Table, _now: Nanos) -> Choice {
        let after = |k: &&Key| self.last.is_none_or(|last| **k > last);
        let next = self
            .ring
            .iter()
            .filter(after)
            .chain(self.ring.iter())
            .find(|k| table.ready(k.1))
            .copied();
        match next {
            Some(k) => {
                self.last = Some(k);
                Choice::Run(k.1)
            }
            None => Choice::Nothing,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::sched::{new_scheduler, Decision, PolicyKind, SchedConfig, TenantParams};

    #[test]
    fn cycles_among_tenants_with_work() {
        let mut s = new_scheduler(PolicyKind::RoundRobin, &SchedConfig::default());
        let p = TenantParams::default();
        s.add_tenant(1, &p, 0);
        s.add_tenant(2, &p, 0);
        s.add_tenant(3, &p, 0);
        s.submit(1, 0);
        s.submit(1, 0);
        s.submit(3, 0);
        s.submit(3, 0);

        let order = [s.pick(1), s.pick(1), s.pick(1), s.pick(1), s.pick(1)];

        assert_eq!(
            order,
            [
                Decision::Run(1),
                Decision::Run(3),
                Decision::Run(1),
                Decision::Run(3),
                Decision::Idle
            ]
        );
    }

    #[test]
    fn higher_priority_leads_each_cycle() {
        let mut s = new_scheduler(PolicyKind::RoundRobin, &SchedConfig::default());
        let high = TenantParams {
            priority: 1,
            ..TenantParams::default()
        };
        s.add_tenant(1, &TenantParams::default(), 0);
        s.add_tenant(2, &high, 0);
        s.submit(1, 0);
        s.submit(2, 0);

        let first = s.pick(1);

        assert_eq!(first, Decision::Run(2));
    }
}
