//! DymGPU's monitor (§3.1): per-tenant activity, idle detection and averaged utilization.
//!
//! A tenant with no recorded activity for longer than `idle_threshold` (20 s by default) is
//! idle: absent for placement, and the scheduler does not switch to it (gScale's optimized
//! scheduler). Utilization is device-busy time over a window of `period` (20 s by default),
//! and each closed window yields the demands the allocator re-places from. Between windows a
//! change in who is idle also yields demands, as DymGPU treats a newly idle tenant as
//! terminated without waiting for the period.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::placement::TenantDemand;
use super::{MemError, Nanos, Result, TenantId};

const SECOND: Nanos = 1_000_000_000;

/// Monitor settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MonitorConfig {
    /// Inactivity after which a tenant counts as idle.
    pub idle_threshold: Nanos,
    /// Length of the window utilization is averaged over, and of the re-placement period.
    pub period: Nanos,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        MonitorConfig {
            idle_threshold: 20 * SECOND,
            period: 20 * SECOND,
        }
    }
}

impl MonitorConfig {
    /// Refuses a zero period, which would never close a window.
    pub fn validate(&self) -> Result<()> {
        if self.period == 0 {
            return Err(MemError::InvalidConfig("monitor period must be positive"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Entry {
    bytes: u64,
    last_active: Nanos,
    busy: Nanos,
    average: f64,
}

/// Activity of every tenant over the injected clock.
#[derive(Debug, Clone)]
pub struct Monitor {
    config: MonitorConfig,
    tenants: BTreeMap<TenantId, Entry>,
    window_start: Nanos,
    reported_idle: BTreeSet<TenantId>,
}

impl Monitor {
    /// A monitor whose first window opens at `now`.
    pub fn new(config: MonitorConfig, now: Nanos) -> Result<Self> {
        config.validate()?;
        Ok(Monitor {
            config,
            tenants: BTreeMap::new(),
            window_start: now,
            reported_idle: BTreeSet::new(),
        })
    }

    /// The settings.
    pub fn config(&self) -> MonitorConfig {
        self.config
    }

    /// A new tenant reserving `bytes`, active as of `now`.
    pub fn admit(&mut self, t: TenantId, bytes: u64, now: Nanos) {
        self.tenants.insert(
            t,
            Entry {
                bytes,
                last_active: now,
                busy: 0,
                average: 0.0,
            },
        );
    }

    /// Changes `t`'s reservation (its quota changed).
    pub fn set_bytes(&mut self, t: TenantId, bytes: u64) {
        if let Some(e) = self.tenants.get_mut(&t) {
            e.bytes = bytes;
        }
    }

    /// Forgets `t`.
    pub fn remove(&mut self, t: TenantId) {
        self.tenants.remove(&t);
        self.reported_idle.remove(&t);
    }

    /// `t` kept the device busy for `busy_ns`, ending at `now`; a call with zero busy time
    /// marks it active (it submitted work). Unknown tenants are admitted with no reservation.
    pub fn record(&mut self, t: TenantId, busy_ns: Nanos, now: Nanos) {
        let e = self.tenants.entry(t).or_insert(Entry {
            bytes: 0,
            last_active: now,
            busy: 0,
            average: 0.0,
        });
        e.busy = e.busy.saturating_add(busy_ns);
        e.last_active = e.last_active.max(now);
    }

    /// Whether `t` has been inactive for longer than the threshold (unknown tenants are).
    pub fn is_idle(&self, t: TenantId, now: Nanos) -> bool {
        self.tenants
            .get(&t)
            .is_none_or(|e| now.saturating_sub(e.last_active) > self.config.idle_threshold)
    }

    /// `t`'s utilization over the last closed window.
    pub fn utilization(&self, t: TenantId) -> Option<f64> {
        self.tenants.get(&t).map(|e| e.average)
    }

    /// Every tenant's demand as of `now`, by id: reservation, last window's utilization,
    /// idleness.
    pub fn demands(&self, now: Nanos) -> Vec<TenantDemand> {
        self.tenants
            .iter()
            .map(|(&id, e)| TenantDemand {
                id,
                bytes: e.bytes,
                utilization: e.average,
                idle: self.is_idle(id, now),
            })
            .collect()
    }

    /// Call often (DymGPU checks every second). Closes the window once `period` has passed
    /// and returns the demands averaged over it; between windows returns the demands when
    /// the set of idle tenants changed; otherwise `None`.
    pub fn tick(&mut self, now: Nanos) -> Option<Vec<TenantDemand>> {
        let elapsed = now.saturating_sub(self.window_start);
        if elapsed >= self.config.period {
            for e in self.tenants.values_mut() {
                e.average = (e.busy as f64 / elapsed as f64).min(1.0);
                e.busy = 0;
            }
            self.window_start = now;
            self.reported_idle = self.idle_set(now);
            return Some(self.demands(now));
        }
        let idle = self.idle_set(now);
        if idle != self.reported_idle {
            self.reported_idle = idle;
            return Some(self.demands(now));
        }
        None
    }

    fn idle_set(&self, now: Nanos) -> BTreeSet<TenantId> {
        self.tenants
            .keys()
            .copied()
            .filter(|&t| self.is_idle(t, now))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn monitor() -> Monitor {
        let mut m = Monitor::new(MonitorConfig::default(), 0).expect("valid config");
        m.admit(1, 64, 0);
        m.admit(2, 128, 0);
        m
    }

    #[test]
    fn defaults_are_dymgpus_twenty_seconds() {
        let config = MonitorConfig::default();

        assert_eq!(config.idle_threshold, 20 * SECOND);
        assert_eq!(config.period, 20 * SECOND);
        assert!(Monitor::new(
            MonitorConfig {
                period: 0,
                ..config
            },
            0
        )
        .is_err());
    }

    #[test]
    fn a_tenant_is_idle_only_past_the_threshold() {
        let mut m = monitor();
        m.record(1, 5 * MS, 3 * SECOND);

        assert!(!m.is_idle(1, 23 * SECOND));
        assert!(m.is_idle(1, 23 * SECOND + 1));
        assert!(m.is_idle(2, 20 * SECOND + 1));
        assert!(m.is_idle(9, 0));
    }

    #[test]
    fn tick_is_quiet_inside_a_window() {
        let mut m = monitor();
        m.record(1, SECOND, SECOND);
        m.record(2, SECOND, SECOND);

        let early = m.tick(19 * SECOND);

        assert_eq!(early, None);
    }

    #[test]
    fn tick_averages_busy_time_over_the_window() {
        let mut m = monitor();
        m.record(1, 5 * SECOND, 10 * SECOND);
        m.record(1, 5 * SECOND, 19 * SECOND);
        m.record(2, SECOND, 15 * SECOND);

        let demands = m.tick(20 * SECOND).expect("window closed");

        assert_eq!(
            demands,
            [
                TenantDemand {
                    id: 1,
                    bytes: 64,
                    utilization: 0.5,
                    idle: false
                },
                TenantDemand {
                    id: 2,
                    bytes: 128,
                    utilization: 0.05,
                    idle: false
                },
            ]
        );
    }

    #[test]
    fn each_window_starts_from_zero() {
        let mut m = monitor();
        m.record(1, 10 * SECOND, 10 * SECOND);
        m.tick(20 * SECOND);
        m.record(1, 2 * SECOND, 30 * SECOND);

        m.tick(40 * SECOND);

        assert_eq!(m.utilization(1), Some(0.1));
    }

    #[test]
    fn going_idle_between_windows_is_reported_once() {
        let mut m = monitor();
        m.record(1, SECOND, 10 * SECOND);
        m.record(2, SECOND, 2 * SECOND);
        m.tick(20 * SECOND);

        let first = m.tick(22 * SECOND + 1).expect("tenant 2 went idle");
        let again = m.tick(23 * SECOND);

        assert_eq!(
            first.iter().map(|d| (d.id, d.idle)).collect::<Vec<_>>(),
            [(1, false), (2, true)]
        );
        assert_eq!(again, None);
    }

    #[test]
    fn waking_up_between_windows_is_reported() {
        let mut m = monitor();
        m.tick(25 * SECOND);

        m.record(2, 0, 26 * SECOND);
        let woke = m.tick(26 * SECOND).expect("tenant 2 woke");

        assert_eq!(
            woke.iter().map(|d| (d.id, d.idle)).collect::<Vec<_>>(),
            [(1, true), (2, false)]
        );
    }
}
