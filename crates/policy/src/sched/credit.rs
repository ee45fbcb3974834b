//! CREDIT and BAND (GPUvm §3.5 and §5.3).
//!
//! CREDIT: every period, each tenant that had work gets credit in proportion to its weight
//! (a period's worth of device time shared out); every completion is charged its device time;
//! the tenant with the most credit goes first. Credit never exceeds one period's allotment,
//! so an idle tenant banks nothing.
//!
//! BAND extends CREDIT in three ways:
//! - a tenant whose credit ran out *and* that used more than its bandwidth (weight share)
//!   over the last period goes behind everyone else ("lowers the bar");
//! - just after a completion, if the tenant that would go next is over its bandwidth while
//!   another tenant under its bandwidth has nothing queued, it waits up to `band_wait` for
//!   that tenant to submit (a short-kernel tenant that submits synchronously would otherwise
//!   always find the long-kernel tenant's command in the queue);
//! - the scheduler's own overhead (device free while work was pending, and switch time
//!   around a command) is counted as consumed device time: the period's pool of credit
//!   shrinks by it, so unused credit does not pile up and stop meaning anything. The
//!   overhead is never charged to a tenant.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use super::core::{Choice, Policy, Table};
use super::{Nanos, PolicyKind, SchedConfig, TenantId};

#[derive(Debug, Default)]
struct Account {
    credit: i64,
    /// Device time used in the current and the previous period.
    used_now: Nanos,
    used_prev: Nanos,
    /// Had work at some point in the current period.
    active: bool,
    /// Last time it had work (submitted, dispatched or completed).
    last_seen: Option<Nanos>,
}

#[derive(Debug)]
pub(crate) struct Credit {
    band: bool,
    period: Nanos,
    band_wait: Nanos,
    accounts: BTreeMap<TenantId, Account>,
    period_start: Nanos,
    next_replenish: Option<Nanos>,
    /// A previous period exists (bandwidth is measured over it and the current one).
    has_prev: bool,
    /// BAND: overhead measured in the current period.
    overhead: Nanos,
    /// Device free since then while some work was pending.
    free_since: Option<Nanos>,
    /// Device free since this completion, nothing dispatched since.
    completed_at: Option<Nanos>,
    dispatched_at: Option<Nanos>,
}

fn ns_i64(ns: Nanos) -> i64 {
    i64::try_from(ns).unwrap_or(i64::MAX)
}

impl Credit {
    pub fn new(cfg: &SchedConfig, band: bool) -> Self {
        Self {
            band,
            period: cfg.period,
            band_wait: cfg.band_wait,
            accounts: BTreeMap::new(),
            period_start: 0,
            next_replenish: None,
            has_prev: false,
            overhead: 0,
            free_since: None,
            completed_at: None,
            dispatched_at: None,
        }
    }

    fn is_active(&self, t: TenantId, table: &Table) -> bool {
        self.accounts.get(&t).is_some_and(|a| a.active) || table.get(t).is_some_and(|e| e.busy())
    }

    /// Sum of weights of the tenants with work in this period (at least 1).
    fn active_weight(&self, table: &Table) -> u64 {
        let sum: u64 = table
            .iter()
            .filter(|(t, _)| self.is_active(*t, table))
            .map(|(_, e)| e.params.weight())
            .sum();
        sum.max(1)
    }

    /// Hands out `times` periods' worth of credit.
    fn replenish(&mut self, table: &Table, times: u64) {
        let pool = if self.band {
            self.period.saturating_sub(self.overhead)
        } else {
            self.period
        };
        let total_weight = self.active_weight(table);
        for (t, e) in table.iter() {
            let active = self.is_active(t, table);
            let Some(account) = self.accounts.get_mut(&t) else {
                continue;
            };
            if active {
                let w = u128::from(e.params.weight());
                let share = |ns: Nanos| {
                    i64::try_from(u128::from(ns) * w / u128::from(total_weight)).unwrap_or(i64::MAX)
                };
                account.credit = account
                    .credit
                    .saturating_add(share(pool).saturating_mul(ns_i64(times)))
                    .min(share(self.period));
            }
            account.used_prev = account.used_now;
            account.used_now = 0;
            account.active = e.busy();
        }
        self.overhead = 0;
    }

    /// A tenant back after at least a period without work competes from where the others
    /// stand: no more credit than the richest of them. BAND also forgets everyone's
    /// bandwidth history, which was earned while the device was shared by fewer tenants.
    fn welcome_back(&mut self, t: TenantId, table: &Table) {
        let others_best = self
            .accounts
            .iter()
            .filter(|(u, a)| **u != t && (a.active || table.get(**u).is_some_and(|e| e.busy())))
            .map(|(_, a)| a.credit)
            .max();
        if let (Some(best), Some(a)) = (others_best, self.accounts.get_mut(&t)) {
            a.credit = a.credit.min(best);
        }
        if self.band && others_best.is_some() {
            for a in self.accounts.values_mut() {
                a.used_prev = 0;
                a.used_now = 0;
            }
            self.has_prev = false;
        }
    }

    /// Bandwidth used over the previous and current period exceeds the weight share.
    fn over_bandwidth(&self, t: TenantId, table: &Table, now: Nanos) -> bool {
        let (Some(a), Some(e)) = (self.accounts.get(&t), table.get(t)) else {
            return false;
        };
        let prev = if self.has_prev { self.period } else { 0 };
        let elapsed = (prev + now.saturating_sub(self.period_start)).max(1);
        let used = u128::from(a.used_prev + a.used_now);
        // used / elapsed > w / total  ⇔  used * total > w * elapsed
        used * u128::from(self.active_weight(table))
            > u128::from(e.params.weight()) * u128::from(elapsed)
    }

    fn exhausted(&self, t: TenantId, table: &Table, now: Nanos) -> bool {
        self.band
            && self.accounts.get(&t).is_some_and(|a| a.credit <= 0)
            && self.over_bandwidth(t, table, now)
    }

    /// BAND's wait: `next` is over its bandwidth while someone under it has nothing queued.
    fn should_wait(&self, next: TenantId, table: &Table, now: Nanos) -> Option<Nanos> {
        let until = self.completed_at? + self.band_wait;
        let waiting_pays = now < until
            && table.running() == 0
            && self.over_bandwidth(next, table, now)
            && table.iter().any(|(u, e)| {
                u != next
                    && e.queued == 0
                    && self
                        .accounts
                        .get(&u)
                        .is_some_and(|a| a.active || a.used_prev > 0)
                    && !self.over_bandwidth(u, table, now)
            });
        waiting_pays.then_some(until)
    }
}

impl Policy for Credit {
    fn kind(&self) -> PolicyKind {
        if self.band {
            PolicyKind::Band
        } else {
            PolicyKind::Credit
        }
    }

    fn roll(&mut self, table: &Table, now: Nanos) {
        let Some(next) = self.next_replenish else {
            self.period_start = now;
            self.next_replenish = Some(now + self.period);
            return;
        };
        if now < next {
            return;
        }
        let periods = (now - next) / self.period + 1;
        self.replenish(table, 1);
        if periods > 1 {
            // Long quiet stretch: the rest at once (credit is clamped anyway).
            self.replenish(table, periods - 1);
        }
        self.has_prev = true;
        self.period_start = next + (periods - 1) * self.period;
        self.next_replenish = Some(self.period_start + self.period);
    }

    fn added(&mut self, t: TenantId, _table: &Table, _now: Nanos) {
        self.accounts.insert(t, Account::default());
    }

    fn removed(&mut self, t: TenantId, _table: &Table, _now: Nanos) {
        self.accounts.remove(&t);
    }

    fn submitted(&mut self, t: TenantId, was_idle: bool, table: &Table, now: Nanos) {
        let period = self.period;
        let returning = was_idle
            && self.accounts.get(&t).is_some_and(|a| {
                a.last_seen
                    .is_none_or(|seen| now.saturating_sub(seen) >= period)
            });
        if returning {
            self.welcome_back(t, table);
        }
        if let Some(a) = self.accounts.get_mut(&t) {
            a.active = true;
            a.last_seen = Some(now);
        }
        if table.running() == 0 && self.free_since.is_none() {
            self.free_since = Some(now);
        }
    }

    fn choose(&mut self, table: &Table, now: Nanos) -> Choice {
        let best = table
            .iter()
            .filter(|(t, _)| table.ready(*t))
            .min_by_key(|(t, e)| {
                let credit = self.accounts.get(t).map_or(0, |a| a.credit);
                (
                    self.exhausted(*t, table, now),
                    Reverse(credit),
                    Reverse(e.params.priority),
                    *t,
                )
            })
            .map(|(t, _)| t);
        match best {
            None => Choice::Nothing,
            Some(t) if self.band => match self.should_wait(t, table, now) {
                Some(until) => Choice::Wait(until),
                None => Choice::Run(t),
            },
            Some(t) => Choice::Run(t),
        }
    }

    fn dispatched(&mut self, t: TenantId, _table: &Table, now: Nanos) {
        if let Some(a) = self.accounts.get_mut(&t) {
            a.last_seen = Some(now);
        }
        if let Some(since) = self.free_since.take() {
            self.overhead += now.saturating_sub(since);
        }
        self.completed_at = None;
        self.dispatched_at = Some(now);
        if let Some(a) = self.accounts.get_mut(&t) {
            a.active = true;
        }
    }

    fn completed(&mut self, t: TenantId, device_ns: Nanos, table: &Table, now: Nanos) {
        if let Some(a) = self.accounts.get_mut(&t) {
            a.credit = a.credit.saturating_sub(ns_i64(device_ns));
            a.used_now += device_ns;
            a.last_seen = Some(now);
        }
        if table.running() == 0 {
            if let Some(at) = self.dispatched_at.take() {
                // Switch time around the command: device busy for the router, not the tenant.
                self.overhead += now.saturating_sub(at).saturating_sub(device_ns);
            }
            self.completed_at = Some(now);
            self.free_since = table.any_queued().then_some(now);
        }
    }

    fn credit_ns(&self, t: TenantId) -> i64 {
        self.accounts.get(&t).map_or(0, |a| a.credit)
    }
}

#[cfg(test)]
mod tests {
    use crate::sched::{new_scheduler, Decision, PolicyKind, SchedConfig, TenantParams, MS, US};

    #[test]
    fn credit_runs_the_tenant_with_most_credit() {
        let mut s = new_scheduler(PolicyKind::Credit, &SchedConfig::default());
        let p = TenantParams::default();
        s.add_tenant(1, &p, 0);
        s.add_tenant(2, &p, 0);
        s.submit(1, 0);
        s.submit(2, 0);
        s.submit(1, 0);
        let first = s.pick(0);
        s.complete(1, 3 * MS, 3 * MS);

        let second = s.pick(3 * MS);

        assert_eq!((first, second), (Decision::Run(1), Decision::Run(2)));
    }

    #[test]
    fn band_waits_briefly_for_the_tenant_under_its_bandwidth() {
        let mut s = new_scheduler(PolicyKind::Band, &SchedConfig::default());
        let p = TenantParams::default();
        s.add_tenant(1, &p, 0);
        s.add_tenant(2, &p, 0);
        s.submit(2, 0);
        s.submit(1, 0);
        assert_eq!(s.pick(0), Decision::Run(1));
        s.complete(1, MS, MS);
        assert_eq!(s.pick(MS), Decision::Run(2));
        s.complete(2, 20 * MS, 21 * MS);
        s.submit(2, 21 * MS);

        let waited = s.pick(21 * MS);
        s.submit(1, 21 * MS + 100 * US);
        let after = s.pick(21 * MS + 100 * US);

        assert_eq!(
            waited,
            Decision::Wait {
                until: 21 * MS + 500 * US
            }
        );
        assert_eq!(after, Decision::Run(1));
    }

    #[test]
    fn band_wait_is_bounded_by_band_wait() {
        let mut s = new_scheduler(PolicyKind::Band, &SchedConfig::default());
        let p = TenantParams::default();
        s.add_tenant(1, &p, 0);
        s.add_tenant(2, &p, 0);
        s.submit(1, 0);
        s.submit(2, 0);
        assert_eq!(s.pick(0), Decision::Run(1));
        s.complete(1, MS, MS);
        assert_eq!(s.pick(MS), Decision::Run(2));
        s.complete(2, 20 * MS, 21 * MS);
        s.submit(2, 21 * MS);

        let after_wait = s.pick(21 * MS + 500 * US);

        assert_eq!(after_wait, Decision::Run(2));
    }

    #[test]
    fn lone_band_tenant_never_waits() {
        let mut s = new_scheduler(PolicyKind::Band, &SchedConfig::default());
        s.add_tenant(1, &TenantParams::default(), 0);
        s.submit(1, 0);
        assert_eq!(s.pick(0), Decision::Run(1));
        s.complete(1, 50 * MS, 50 * MS);
        s.submit(1, 50 * MS);

        let next = s.pick(50 * MS);

        assert_eq!(next, Decision::Run(1));
    }
}
