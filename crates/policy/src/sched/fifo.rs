//! FIFO (GPUvm §5.3): commands run in the order they were submitted, across tenants.
//! Commands submitted at the same instant go by tenant priority, higher first.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use super::core::{Choice, Policy, Table};
use super::{Nanos, PolicyKind, TenantId};

/// Submission order: (time, priority, sequence number, tenant).
#[derive(Debug, Default)]
pub(crate) struct Fifo {
    seq: u64,
    queue: BTreeSet<(Nanos, Reverse<i32>, u64, TenantId)>,
}

impl Policy for Fifo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Fifo
    }

    fn added(&mut self, _t: TenantId, _table: &Table, _now: Nanos) {}

    fn removed(&mut self, t: TenantId, _table: &Table, _now: Nanos) {
        self.queue.retain(|entry| entry.3 != t);
    }

    fn submitted(&mut self, t: TenantId, _was_idle: bool, table: &Table, now: Nanos) {
        let priority = table.get(t).map_or(0, |e| e.params.priority);
        self.seq += 1;
        self.queue.insert((now, Reverse(priority), self.seq, t));
    }

    fn choose(&mut self, table: &Table, _now: Nanos) -> Choice {
        let first = self
            .queue
            .iter()
            .find(|entry| table.ready(entry.3))
            .copied();
        match first {
            Some(entry) => {
                self.queue.remove(&entry);
                Choice::Run(entry.3)
            }
            None => Choice::Nothing,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::sched::{new_scheduler, Decision, PolicyKind, SchedConfig, TenantParams};

    #[test]
    fn runs_in_submission_order_across_tenants() {
        let mut s = new_scheduler(PolicyKind::Fifo, &SchedConfig::default());
        s.add_tenant(1, &TenantParams::default(), 0);
        s.add_tenant(2, &TenantParams::default(), 0);
        s.submit(2, 1);
        s.submit(1, 2);
        s.submit(2, 3);

        let order = [s.pick(4), s.pick(4), s.pick(4), s.pick(4)];

        assert_eq!(
            order,
            [
                Decision::Run(2),
                Decision::Run(1),
                Decision::Run(2),
                Decision::Idle
            ]
        );
    }

    #[test]
    fn same_instant_goes_by_priority() {
        let mut s = new_scheduler(PolicyKind::Fifo, &SchedConfig::default());
        let high = TenantParams {
            priority: 5,
            ..TenantParams::default()
        };
        s.add_tenant(1, &TenantParams::default(), 0);
        s.add_tenant(2, &high, 0);
        s.submit(1, 7);
        s.submit(2, 7);

        let order = [s.pick(8), s.pick(8)];

        assert_eq!(order, [Decision::Run(2), Decision::Run(1)]);
    }
}
