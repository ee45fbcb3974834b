//! The memory ledger: bytes allocated per tenant against its quota and against the device's
//! capacity times an over-subscription ratio.
//!
//! AvA (§5.3.6) tracks the device memory each guest allocates from the sizes in the
//! allocation calls; this is that ledger. Over-subscription beyond 1.0 is only safe with the
//! swapping of [`super::residency`] (AvA §5.4.6).

use std::collections::BTreeMap;

use super::{BufferId, MemError, Result, TenantId};

#[derive(Debug, Clone, Default)]
struct TenantMem {
    quota: Option<u64>,
    used: u64,
    buffers: BTreeMap<BufferId, u64>,
}

/// Bytes allocated per tenant, checked against quotas and the over-commit limit.
#[derive(Debug, Clone)]
pub struct MemLedger {
    capacity: u64,
    limit: u64,
    committed: u64,
    tenants: BTreeMap<TenantId, TenantMem>,
}

impl MemLedger {
    /// A ledger for a device of `capacity` bytes whose allocations may sum to
    /// `capacity × ratio` (1.0 = no over-commit).
    pub fn new(capacity: u64, ratio: f64) -> Result<Self> {
        if !ratio.is_finite() || ratio <= 0.0 {
            return Err(MemError::InvalidConfig(
                "over-subscription ratio must be finite and positive",
            ));
        }
        // `as` saturates, so a huge product caps at u64::MAX.
        let limit = (capacity as f64 * ratio) as u64;
        Ok(MemLedger {
            capacity,
            limit,
            committed: 0,
            tenants: BTreeMap::new(),
        })
    }

    /// Device capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The most all tenants together may allocate: capacity × ratio.
    pub fn commit_limit(&self) -> u64 {
        self.limit
    }

    /// Bytes allocated by all tenants.
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// Records `bytes` for a new buffer of `t`, or refuses it without changing anything.
    /// The quota is checked first, so a tenant over its own quota is told so even on a full
    /// device.
    pub fn charge(&mut self, t: TenantId, buf: BufferId, bytes: u64) -> Result<()> {
        let entry = self.tenants.entry(t).or_default();
        if entry.buffers.contains_key(&buf) {
            return Err(MemError::DuplicateBuffer {
                tenant: t,
                buffer: buf,
            });
        }
        if let Some(quota) = entry.quota {
            if entry.used.saturating_add(bytes) > quota {
                return Err(MemError::OverQuota {
                    tenant: t,
                    requested: bytes,
                    used: entry.used,
                    quota,
                });
            }
        }
        if self.committed.saturating_add(bytes) > self.limit {
            return Err(MemError::OverCommit {
                tenant: t,
                requested: bytes,
                committed: self.committed,
                limit: self.limit,
            });
        }
        entry.buffers.insert(buf, bytes);
        entry.used += bytes;
        self.committed += bytes;
        Ok(())
    }

    /// Returns the bytes of `buf` to `t`. Unknown buffers, or buffers of another tenant, are
    /// ignored, so releasing twice is harmless.
    pub fn release(&mut self, t: TenantId, buf: BufferId) {
        let Some(entry) = self.tenants.get_mut(&t) else {
            return;
        };
        if let Some(bytes) = entry.buffers.remove(&buf) {
            entry.used -= bytes;
            self.committed -= bytes;
        }
    }

    /// Sets or clears `t`'s quota. A quota below current use keeps existing buffers; only new
    /// allocations fail until the tenant frees enough.
    pub fn set_quota(&mut self, t: TenantId, quota: Option<u64>) {
        self.tenants.entry(t).or_default().quota = quota;
    }

    /// `t`'s quota; `None` when unlimited (bounded by the device only).
    pub fn quota(&self, t: TenantId) -> Option<u64> {
        self.tenants.get(&t).and_then(|m| m.quota)
    }

    /// Bytes `t` has allocated.
    pub fn used(&self, t: TenantId) -> u64 {
        self.tenants.get(&t).map_or(0, |m| m.used)
    }

    /// What `CL_DEVICE_GLOBAL_MEM_SIZE` reports to `t`: its quota, never more than the
    /// device holds.
    pub fn visible_global_mem(&self, t: TenantId) -> u64 {
        self.quota(t)
            .map_or(self.capacity, |q| q.min(self.capacity))
    }

    /// What `CL_DEVICE_MAX_MEM_ALLOC_SIZE` reports to `t`: the device's own limit, never more
    /// than the global memory `t` is shown.
    pub fn visible_max_alloc(&self, t: TenantId, device_max_alloc: u64) -> u64 {
        device_max_alloc.min(self.visible_global_mem(t))
    }

    /// Forgets `t`, freeing everything it allocated.
    pub fn remove_tenant(&mut self, t: TenantId) {
        if let Some(entry) = self.tenants.remove(&t) {
            self.committed -= entry.used;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn ledger_with_quota(quota: u64) -> MemLedger {
        let mut ledger = MemLedger::new(64 * MIB, 1.0).expect("valid ratio");
        ledger.set_quota(1, Some(quota));
        ledger
    }

    #[test]
    fn charge_just_under_quota_succeeds() {
        let mut ledger = ledger_with_quota(10 * MIB);

        let result = ledger.charge(1, 100, 10 * MIB - 1);

        assert_eq!(result, Ok(()));
        assert_eq!(ledger.used(1), 10 * MIB - 1);
    }

    #[test]
    fn charge_exactly_at_quota_succeeds() {
        let mut ledger = ledger_with_quota(10 * MIB);
        ledger.charge(1, 100, 4 * MIB).expect("under quota");

        let result = ledger.charge(1, 101, 6 * MIB);

        assert_eq!(result, Ok(()));
        assert_eq!(ledger.used(1), 10 * MIB);
    }

    #[test]
    fn charge_over_quota_fails_and_changes_nothing() {
        let mut ledger = ledger_with_quota(10 * MIB);
        ledger.charge(1, 100, 4 * MIB).expect("under quota");

        let result = ledger.charge(1, 101, 6 * MIB + 1);

        assert_eq!(
            result,
            Err(MemError::OverQuota {
                tenant: 1,
                requested: 6 * MIB + 1,
                used: 4 * MIB,
                quota: 10 * MIB,
            })
        );
        assert_eq!(ledger.used(1), 4 * MIB);
        assert_eq!(ledger.committed(), 4 * MIB);
    }

    #[test]
    fn over_quota_is_the_tenants_fault_and_over_commit_is_not() {
        let quota = MemError::OverQuota {
            tenant: 1,
            requested: 1,
            used: 0,
            quota: 0,
        };
        let commit = MemError::OverCommit {
            tenant: 1,
            requested: 1,
            committed: 0,
            limit: 0,
        };

        assert!(quota.is_tenant_fault());
        assert!(!commit.is_tenant_fault());
    }

    #[test]
    fn lowering_quota_below_use_keeps_buffers_but_fails_new_allocations() {
        let mut ledger = ledger_with_quota(10 * MIB);
        ledger.charge(1, 100, 8 * MIB).expect("under quota");

        ledger.set_quota(1, Some(4 * MIB));
        let grow = ledger.charge(1, 101, 1);

        assert!(matches!(grow, Err(MemError::OverQuota { .. })));
        assert_eq!(ledger.used(1), 8 * MIB);
    }

    #[test]
    fn after_live_lowering_freeing_below_the_new_quota_allows_allocation_again() {
        let mut ledger = ledger_with_quota(10 * MIB);
        ledger.charge(1, 100, 6 * MIB).expect("under quota");
        ledger.charge(1, 101, 2 * MIB).expect("under quota");
        ledger.set_quota(1, Some(4 * MIB));

        ledger.release(1, 100);
        let again = ledger.charge(1, 102, 2 * MIB);

        assert_eq!(again, Ok(()));
        assert_eq!(ledger.used(1), 4 * MIB);
    }

    #[test]
    fn release_is_idempotent_and_ignores_unknown_and_foreign_buffers() {
        let mut ledger = ledger_with_quota(10 * MIB);
        ledger.charge(1, 100, 3 * MIB).expect("under quota");
        ledger.charge(2, 200, 5 * MIB).expect("no quota");

        ledger.release(1, 100);
        ledger.release(1, 100);
        ledger.release(1, 999);
        ledger.release(1, 200);
        ledger.release(7, 100);

        assert_eq!(ledger.used(1), 0);
        assert_eq!(ledger.used(2), 5 * MIB);
        assert_eq!(ledger.committed(), 5 * MIB);
    }

    #[test]
    fn duplicate_buffer_is_refused() {
        let mut ledger = ledger_with_quota(10 * MIB);
        ledger.charge(1, 100, MIB).expect("under quota");

        let result = ledger.charge(1, 100, MIB);

        assert_eq!(
            result,
            Err(MemError::DuplicateBuffer {
                tenant: 1,
                buffer: 100
            })
        );
        assert_eq!(ledger.used(1), MIB);
    }

    #[test]
    fn visible_sizes_are_the_quota_capped_by_the_device() {
        let mut ledger = MemLedger::new(64 * MIB, 2.0).expect("valid ratio");
        ledger.set_quota(1, Some(16 * MIB));
        ledger.set_quota(2, Some(100 * MIB));

        assert_eq!(ledger.visible_global_mem(1), 16 * MIB);
        assert_eq!(ledger.visible_global_mem(2), 64 * MIB);
        assert_eq!(ledger.visible_global_mem(3), 64 * MIB);
        assert_eq!(ledger.visible_max_alloc(1, 32 * MIB), 16 * MIB);
        assert_eq!(ledger.visible_max_alloc(2, 32 * MIB), 32 * MIB);
        assert_eq!(ledger.visible_max_alloc(3, 32 * MIB), 32 * MIB);
    }

    #[test]
    fn without_over_commit_the_sum_of_allocations_stops_at_capacity() {
        let mut ledger = MemLedger::new(64 * MIB, 1.0).expect("valid ratio");
        ledger.charge(1, 100, 40 * MIB).expect("fits");
        ledger.charge(2, 200, 24 * MIB).expect("fits exactly");

        let result = ledger.charge(3, 300, 1);

        assert_eq!(
            result,
            Err(MemError::OverCommit {
                tenant: 3,
                requested: 1,
                committed: 64 * MIB,
                limit: 64 * MIB,
            })
        );
    }

    #[test]
    fn over_commit_ratio_raises_the_device_limit() {
        let mut ledger = MemLedger::new(64 * MIB, 1.5).expect("valid ratio");
        ledger.charge(1, 100, 64 * MIB).expect("fits the device");
        ledger
            .charge(2, 200, 32 * MIB)
            .expect("fits the over-commit");

        let result = ledger.charge(3, 300, 1);

        assert_eq!(ledger.commit_limit(), 96 * MIB);
        assert!(matches!(result, Err(MemError::OverCommit { .. })));
    }

    #[test]
    fn invalid_ratios_are_refused() {
        assert!(MemLedger::new(MIB, 0.0).is_err());
        assert!(MemLedger::new(MIB, -1.0).is_err());
        assert!(MemLedger::new(MIB, f64::NAN).is_err());
        assert!(MemLedger::new(MIB, f64::INFINITY).is_err());
    }

    #[test]
    fn remove_tenant_frees_everything_it_held() {
        let mut ledger = MemLedger::new(64 * MIB, 1.0).expect("valid ratio");
        ledger.charge(1, 100, 30 * MIB).expect("fits");
        ledger.charge(1, 101, 30 * MIB).expect("fits");
        ledger.charge(2, 200, 4 * MIB).expect("fits");

        ledger.remove_tenant(1);
        let result = ledger.charge(3, 300, 60 * MIB);

        assert_eq!(ledger.used(1), 0);
        assert_eq!(result, Ok(()));
        assert_eq!(ledger.committed(), 64 * MIB);
    }
}
