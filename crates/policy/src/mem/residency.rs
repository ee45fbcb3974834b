//! Residency: which buffers are on the device and which were swapped to the host.
//!
//! This is gScale's private shadow GTT at AvA's buffer granularity (§5.4.6). Each tenant sees
//! its own address space as long as its slots; a buffer gets a fixed offset there when it is
//! allocated, and its device bytes are the tenant's first slot plus that offset. Tenants
//! whose slots overlap contend for those bytes: before a tenant runs, the buffers it needs
//! are restored, evicting only the other tenants' resident buffers that overlap them
//! (gScale's on-demand copying: buffers the command does not use stay where they are). A
//! tenant alone on its slots keeps everything resident and never swaps.
//!
//! A new buffer starts on the host and is materialized by the first switch that needs it,
//! so every byte reaches the device through a restore.

use std::collections::{BTreeMap, BTreeSet};

use super::placement::Placement;
use super::{BufferId, MemError, Result, TenantId};

/// One buffer as residency sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferInfo {
    pub owner: TenantId,
    pub bytes: u64,
    /// On the device (else swapped to, or not yet copied from, the host).
    pub resident: bool,
    /// Offset inside the owner's slots; `None` while the owner has no slots, or no room after
    /// its slots shrank.
    pub offset: Option<u64>,
}

/// What to do before a tenant runs: evictions first, then restores.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SwapPlan {
    /// Buffers to copy to the host and release on the device: (owner, buffer, bytes).
    pub evict: Vec<(TenantId, BufferId, u64)>,
    /// Buffers of the incoming tenant to recreate on the device: (buffer, bytes).
    pub restore: Vec<(BufferId, u64)>,
}

impl SwapPlan {
    /// Nothing to copy.
    pub fn is_empty(&self) -> bool {
        self.evict.is_empty() && self.restore.is_empty()
    }

    /// Bytes copied to the host.
    pub fn bytes_evicted(&self) -> u64 {
        self.evict.iter().map(|&(_, _, b)| b).sum()
    }

    /// Bytes copied to the device.
    pub fn bytes_restored(&self) -> u64 {
        self.restore.iter().map(|&(_, b)| b).sum()
    }
}

/// Running totals since the residency was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwapStats {
    pub bytes_evicted: u64,
    pub bytes_restored: u64,
    pub buffers_evicted: u64,
    pub buffers_restored: u64,
    /// Switches to a tenant other than the one that ran last.
    pub switches: u64,
}

impl SwapStats {
    /// Bytes moved either way.
    pub fn bytes_swapped(&self) -> u64 {
        self.bytes_evicted + self.bytes_restored
    }
}

/// Buffers of all tenants, where they live, and the placement that decides it.
#[derive(Debug, Clone)]
pub struct Residency {
    placement: Placement,
    buffers: BTreeMap<BufferId, BufferInfo>,
    current: Option<TenantId>,
    stats: SwapStats,
}

impl Residency {
    /// Nothing allocated yet, tenants placed as `placement` says.
    pub fn new(placement: Placement) -> Self {
        Residency {
            placement,
            buffers: BTreeMap::new(),
            current: None,
            stats: SwapStats::default(),
        }
    }

    /// The current placement.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Totals so far.
    pub fn stats(&self) -> SwapStats {
        self.stats
    }

    /// The tenant that ran last.
    pub fn current(&self) -> Option<TenantId> {
        self.current
    }

    /// One buffer.
    pub fn buffer(&self, buf: BufferId) -> Option<BufferInfo> {
        self.buffers.get(&buf).copied()
    }

    /// Whether `buf` is on the device.
    pub fn is_resident(&self, buf: BufferId) -> bool {
        self.buffers.get(&buf).is_some_and(|b| b.resident)
    }

    /// All buffers, by id.
    pub fn buffers(&self) -> impl Iterator<Item = (BufferId, BufferInfo)> + '_ {
        self.buffers.iter().map(|(&id, &b)| (id, b))
    }

    /// Bytes on the device.
    pub fn resident_bytes(&self) -> u64 {
        self.buffers
            .values()
            .filter(|b| b.resident)
            .map(|b| b.bytes)
            .sum()
    }

    /// Resident bytes in each slot; never more than the slot holds.
    pub fn slot_usage(&self) -> Vec<u64> {
        let slot_bytes = self.placement.slot_bytes();
        let mut usage = vec![0; self.placement.slots()];
        if slot_bytes == 0 {
            return usage;
        }
        for (lo, hi) in self.buffers.values().filter_map(|b| self.extent(b)) {
            let mut at = lo;
            while at < hi {
                let slot = at / slot_bytes;
                let slot_end = (slot + 1) * slot_bytes;
                let upto = hi.min(slot_end);
                if let Some(used) = usize::try_from(slot).ok().and_then(|s| usage.get_mut(s)) {
                    *used += upto - at;
                }
                at = upto;
            }
        }
        usage
    }

    /// Registers a new buffer of `t`, on the host until a switch needs it. Fails when it does
    /// not fit in the free space of `t`'s slots; a tenant without slots gets its offset when
    /// it is next placed.
    pub fn alloc(&mut self, t: TenantId, buf: BufferId, bytes: u64) -> Result<()> {
        if self.buffers.contains_key(&buf) {
            return Err(MemError::DuplicateBuffer {
                tenant: t,
                buffer: buf,
            });
        }
        let offset = match self.space(t) {
            Some(space) => {
                let taken = self.offsets_of(t);
                Some(first_fit(&taken, bytes, space).ok_or(MemError::NoRoom {
                    tenant: t,
                    buffer: buf,
                    bytes,
                })?)
            }
            None => None,
        };
        self.buffers.insert(
            buf,
            BufferInfo {
                owner: t,
                bytes,
                resident: false,
                offset,
            },
        );
        Ok(())
    }

    /// Forgets `buf`. Unknown buffers, or buffers of another tenant, are ignored.
    pub fn free(&mut self, t: TenantId, buf: BufferId) {
        if self.buffers.get(&buf).is_some_and(|b| b.owner == t) {
            self.buffers.remove(&buf);
        }
    }

    /// Forgets every buffer of `t`.
    pub fn remove_tenant(&mut self, t: TenantId) {
        self.buffers.retain(|_, b| b.owner != t);
        if self.current == Some(t) {
            self.current = None;
        }
    }

    /// Makes `needed` resident before `to` runs a command using them, evicting only the
    /// overlapping buffers of tenants that share `to`'s slots. Buffers of `to` that the
    /// command does not use are not restored. Nothing changes on error.
    pub fn on_switch(&mut self, to: TenantId, needed: &[BufferId]) -> Result<SwapPlan> {
        if self.placement.range(to).is_none() {
            return Err(MemError::NotPlaced { tenant: to });
        }
        for &buf in needed {
            let info = self.buffers.get(&buf).filter(|b| b.owner == to).ok_or(
                MemError::UnknownBuffer {
                    tenant: to,
                    buffer: buf,
                },
            )?;
            if info.offset.is_none() {
                return Err(MemError::NoRoom {
                    tenant: to,
                    buffer: buf,
                    bytes: info.bytes,
                });
            }
        }
        if self.current != Some(to) {
            self.current = Some(to);
            self.stats.switches += 1;
        }
        let mut plan = SwapPlan::default();
        let mut seen = BTreeSet::new();
        for &buf in needed {
            let Some(info) = self.buffers.get(&buf).copied() else {
                continue;
            };
            if info.resident || !seen.insert(buf) {
                continue;
            }
            if let Some(want) = self.extent_if_placed(&info) {
                let victims: Vec<BufferId> = self
                    .buffers
                    .iter()
                    .filter(|(_, b)| b.owner != to)
                    .filter(|(_, b)| self.extent(b).is_some_and(|e| overlaps(e, want)))
                    .map(|(&id, _)| id)
                    .collect();
                for id in victims {
                    plan.evict.push(self.evict(id));
                }
            }
            if let Some(b) = self.buffers.get_mut(&buf) {
                b.resident = true;
            }
            plan.restore.push((buf, info.bytes));
        }
        self.stats.bytes_restored += plan.bytes_restored();
        self.stats.buffers_restored += plan.restore.len() as u64;
        Ok(plan)
    }

    /// A buffer just created on the device (its tenant made it while another may be
    /// running): it stays resident if its extent collides with no resident buffer of another
    /// tenant, and returns true; otherwise it is marked evicted and false tells the caller to
    /// copy it out.
    pub fn settle_new(&mut self, buf: BufferId) -> bool {
        let Some(info) = self.buffers.get(&buf).copied() else {
            return false;
        };
        let free = self.extent_if_placed(&info).is_some_and(|want| {
            !self
                .buffers
                .iter()
                .filter(|&(&id, b)| id != buf && b.owner != info.owner)
                .filter_map(|(_, b)| self.extent(b))
                .any(|e| overlaps(e, want))
        });
        if let Some(b) = self.buffers.get_mut(&buf) {
            b.resident = free;
        }
        if !free {
            self.stats.bytes_evicted += info.bytes;
            self.stats.buffers_evicted += 1;
        }
        free
    }

    /// `buf` became resident outside a switch (its tenant restored it on its own, e.g. for an
    /// info query): marks it resident and returns the other tenants' resident buffers that
    /// overlap it, now marked evicted, for the caller to copy out.
    pub fn claim(&mut self, buf: BufferId) -> Vec<(TenantId, BufferId, u64)> {
        let Some(info) = self.buffers.get(&buf).copied() else {
            return Vec::new();
        };
        if info.resident {
            return Vec::new();
        }
        let mut out = Vec::new();
        if let Some(want) = self.extent_if_placed(&info) {
            let victims: Vec<BufferId> = self
                .buffers
                .iter()
                .filter(|(_, b)| b.owner != info.owner)
                .filter(|(_, b)| self.extent(b).is_some_and(|e| overlaps(e, want)))
                .map(|(&id, _)| id)
                .collect();
            for id in victims {
                out.push(self.evict(id));
            }
        }
        if let Some(b) = self.buffers.get_mut(&buf) {
            b.resident = true;
        }
        self.stats.bytes_restored += info.bytes;
        self.stats.buffers_restored += 1;
        out
    }

    /// Adopts a new placement (after the monitor re-placed tenants). Tenants whose slots
    /// moved or resized get their buffers laid out afresh inside the new slots; their
    /// resident buffers stay resident where that collides with nothing already there, and are
    /// evicted otherwise. Tenants left without slots (idle) are evicted entirely. Returns the
    /// evictions, which the router performs before the next switch.
    pub fn replace(&mut self, placement: Placement) -> Vec<(TenantId, BufferId, u64)> {
        let old = std::mem::replace(&mut self.placement, placement);
        let owners: BTreeSet<TenantId> = self.buffers.values().map(|b| b.owner).collect();
        let moved: BTreeSet<TenantId> = owners
            .into_iter()
            .filter(|&t| byte_span(&old, t) != byte_span(&self.placement, t))
            .collect();
        let mut unsettled = Vec::new();
        for &t in &moved {
            let space = self.space(t);
            let mut order: Vec<(Option<u64>, BufferId)> = self
                .buffers
                .iter()
                .filter(|(_, b)| b.owner == t)
                .map(|(&id, b)| (b.offset, id))
                .collect();
            order.sort_by_key(|&(offset, id)| (offset.is_none(), offset, id));
            let mut cursor = 0u64;
            for (_, id) in order {
                let Some(b) = self.buffers.get_mut(&id) else {
                    continue;
                };
                b.offset = match space {
                    Some(space) if space - cursor >= b.bytes => {
                        cursor += b.bytes;
                        Some(cursor - b.bytes)
                    }
                    _ => None,
                };
                if b.resident {
                    b.resident = false;
                    unsettled.push(id);
                }
            }
        }
        let mut evicted = Vec::new();
        for id in unsettled {
            let Some(info) = self.buffers.get(&id).copied() else {
                continue;
            };
            let fits = self.extent_if_placed(&info).is_some_and(|want| {
                !self
                    .buffers
                    .values()
                    .filter_map(|b| self.extent(b))
                    .any(|e| overlaps(e, want))
            });
            if fits {
                if let Some(b) = self.buffers.get_mut(&id) {
                    b.resident = true;
                }
            } else {
                evicted.push((info.owner, id, info.bytes));
            }
        }
        self.stats.bytes_evicted += evicted.iter().map(|&(_, _, b)| b).sum::<u64>();
        self.stats.buffers_evicted += evicted.len() as u64;
        evicted
    }

    fn evict(&mut self, id: BufferId) -> (TenantId, BufferId, u64) {
        let mut out = (0, id, 0);
        if let Some(b) = self.buffers.get_mut(&id) {
            b.resident = false;
            out = (b.owner, id, b.bytes);
        }
        self.stats.bytes_evicted += out.2;
        self.stats.buffers_evicted += 1;
        out
    }

    /// Bytes in `t`'s slots, or `None` when it has none.
    fn space(&self, t: TenantId) -> Option<u64> {
        byte_span(&self.placement, t).map(|(_, len)| len)
    }

    fn offsets_of(&self, t: TenantId) -> Vec<(u64, u64)> {
        let mut taken: Vec<(u64, u64)> = self
            .buffers
            .values()
            .filter(|b| b.owner == t)
            .filter_map(|b| b.offset.map(|o| (o, o + b.bytes)))
            .collect();
        taken.sort_unstable();
        taken
    }

    /// Device bytes `b` would occupy under the current placement.
    fn extent_if_placed(&self, b: &BufferInfo) -> Option<(u64, u64)> {
        let (base, _) = byte_span(&self.placement, b.owner)?;
        let lo = base + b.offset?;
        Some((lo, lo + b.bytes))
    }

    /// Device bytes `b` occupies, if resident.
    fn extent(&self, b: &BufferInfo) -> Option<(u64, u64)> {
        if b.resident {
            self.extent_if_placed(b)
        } else {
            None
        }
    }
}

/// First device byte and length of `t`'s slots.
fn byte_span(p: &Placement, t: TenantId) -> Option<(u64, u64)> {
    let r = p.range(t)?;
    Some((
        r.start as u64 * p.slot_bytes(),
        r.len as u64 * p.slot_bytes(),
    ))
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// Lowest offset where `bytes` fit between the sorted `taken` extents within `space`.
fn first_fit(taken: &[(u64, u64)], bytes: u64, space: u64) -> Option<u64> {
    let mut cursor = 0u64;
    for &(lo, hi) in taken {
        if lo >= cursor && lo - cursor >= bytes {
            return Some(cursor);
        }
        cursor = cursor.max(hi);
    }
    (space >= cursor && space - cursor >= bytes).then_some(cursor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::placement::{place, PlacementAlgo, TenantDemand};
    use proptest::prelude::*;

    const SLOT: u64 = 16;

    fn demand(id: TenantId, bytes: u64, utilization: f64) -> TenantDemand {
        TenantDemand {
            id,
            bytes,
            utilization,
            idle: false,
        }
    }

    /// Each tenant's buffers, one per slot it reserves, ids `100 * t + i`.
    fn slot_buffers(t: TenantId, slots: u64) -> Vec<BufferId> {
        (0..slots).map(|i| 100 * t + i).collect()
    }

    fn fig4_run(algo: PlacementAlgo, rounds: usize) -> (Vec<(TenantId, usize)>, SwapStats) {
        let tenants: Vec<TenantDemand> = (1..=4).map(|t| demand(t, 6 * SLOT, 0.25)).collect();
        let placement = place(12, SLOT, &tenants, algo);
        let starts = placement.iter().map(|(t, r)| (t, r.start)).collect();
        let mut residency = Residency::new(placement);
        for t in 1..=4 {
            for buf in slot_buffers(t, 6) {
                residency
                    .alloc(t, buf, SLOT)
                    .expect("fits the tenant's slots");
            }
        }
        for _ in 0..rounds {
            for t in 1..=4 {
                residency
                    .on_switch(t, &slot_buffers(t, 6))
                    .expect("placed tenant, own buffers");
            }
        }
        (starts, residency.stats())
    }

    /// DymGPU §2.3 and Fig. 4: twelve slots, four vGPUs of six slots each, round robin. gVirt
    /// (Fig. 4a) pairs vGPU1 with vGPU3 and vGPU2 with vGPU4, so every switch copies:
    /// 24 + 24(n − 1) slot copies. Giving one vGPU its own slots (Fig. 4b) saves six per
    /// round: 24 + 18(n − 1). Both DymGPU algorithms find such a layout (vGPU1 alone here;
    /// with equal utilization Algorithm 2 sorts like Algorithm 1).
    #[test]
    fn dymgpu_fig4_placements_and_copy_counts() {
        let rounds = 5;

        let (lls, lls_stats) = fig4_run(PlacementAlgo::LeftmostLowestScore, rounds);
        let (size, size_stats) = fig4_run(PlacementAlgo::SizeBased, rounds);
        let (util, util_stats) = fig4_run(PlacementAlgo::UtilizationBased, rounds);

        assert_eq!(lls, [(1, 0), (2, 6), (3, 0), (4, 6)]);
        assert_eq!(size, [(1, 0), (2, 6), (3, 6), (4, 6)]);
        assert_eq!(util, size);
        assert_eq!(lls_stats.bytes_restored, (24 + 24 * (5 - 1)) * SLOT);
        assert_eq!(size_stats.bytes_restored, (24 + 18 * (5 - 1)) * SLOT);
        assert_eq!(util_stats.bytes_restored, (24 + 18 * (5 - 1)) * SLOT);
        assert_eq!(lls_stats.switches, 4 * 5);
    }

    /// Two tenants on the same two slots.
    fn shared_pair() -> Residency {
        let tenants = [demand(1, 2 * SLOT, 0.5), demand(2, 2 * SLOT, 0.5)];
        let placement = place(2, SLOT, &tenants, PlacementAlgo::LeftmostLowestScore);
        assert!(placement
            .range(1)
            .unwrap()
            .overlaps(placement.range(2).unwrap()));
        Residency::new(placement)
    }

    #[test]
    fn new_buffer_stays_resident_only_on_free_bytes() {
        let mut r = shared_pair();
        r.alloc(1, 10, SLOT).unwrap();
        assert!(r.settle_new(10), "nothing else is resident");
        r.alloc(2, 20, SLOT).unwrap();
        assert!(!r.settle_new(20), "tenant 1's buffer holds those bytes");
        assert!(!r.is_resident(20));
        assert_eq!(r.stats().bytes_evicted, SLOT);
        r.alloc(1, 11, SLOT).unwrap();
        assert!(r.settle_new(11), "a tenant's own buffers never collide");
    }

    #[test]
    fn claim_evicts_the_overlapping_buffers_of_others() {
        let mut r = shared_pair();
        r.alloc(1, 10, SLOT).unwrap();
        r.alloc(1, 11, SLOT).unwrap();
        r.alloc(2, 20, SLOT).unwrap();
        r.on_switch(1, &[10, 11]).unwrap();
        assert_eq!(r.claim(20), vec![(1, 10, SLOT)]);
        assert!(r.is_resident(20) && !r.is_resident(10) && r.is_resident(11));
        assert!(r.claim(20).is_empty(), "already resident");
        assert!(r.claim(99).is_empty(), "unknown buffer");
    }

    #[test]
    fn only_needed_buffers_are_restored() {
        let placement = place(
            4,
            SLOT,
            &[demand(1, 4 * SLOT, 0.5)],
            PlacementAlgo::SizeBased,
        );
        let mut residency = Residency::new(placement);
        residency.alloc(1, 10, SLOT).expect("fits");
        residency.alloc(1, 11, SLOT).expect("fits");
        residency.alloc(1, 12, SLOT).expect("fits");

        let plan = residency.on_switch(1, &[11]).expect("own buffer");

        assert_eq!(plan.restore, [(11, SLOT)]);
        assert!(plan.evict.is_empty());
        assert!(!residency.is_resident(10));
        assert!(!residency.is_resident(12));
    }

    #[test]
    fn only_overlapping_buffers_of_sharers_are_evicted() {
        let tenants = [demand(1, 4 * SLOT, 0.5), demand(2, 4 * SLOT, 0.5)];
        let placement = place(4, SLOT, &tenants, PlacementAlgo::LeftmostLowestScore);
        let mut residency = Residency::new(placement);
        for i in 0..4 {
            residency.alloc(1, 10 + i, SLOT).expect("fits");
        }
        residency.alloc(2, 20, 2 * SLOT).expect("fits");
        residency
            .on_switch(1, &[10, 11, 12, 13])
            .expect("own buffers");

        let plan = residency.on_switch(2, &[20]).expect("own buffer");

        assert_eq!(plan.evict, [(1, 10, SLOT), (1, 11, SLOT)]);
        assert_eq!(plan.restore, [(20, 2 * SLOT)]);
        assert!(residency.is_resident(12));
        assert!(residency.is_resident(13));
    }

    #[test]
    fn alloc_fails_when_the_tenants_slots_are_full() {
        let placement = place(
            4,
            SLOT,
            &[demand(1, 2 * SLOT, 0.5)],
            PlacementAlgo::SizeBased,
        );
        let mut residency = Residency::new(placement);
        residency.alloc(1, 10, 2 * SLOT - 1).expect("fits");

        let result = residency.alloc(1, 11, 2);

        assert_eq!(
            result,
            Err(MemError::NoRoom {
                tenant: 1,
                buffer: 11,
                bytes: 2
            })
        );
    }

    #[test]
    fn freed_space_is_reused_first_fit() {
        let placement = place(
            4,
            SLOT,
            &[demand(1, 2 * SLOT, 0.5)],
            PlacementAlgo::SizeBased,
        );
        let mut residency = Residency::new(placement);
        residency.alloc(1, 10, 8).expect("fits");
        residency.alloc(1, 11, 8).expect("fits");
        residency.alloc(1, 12, 8).expect("fits");
        residency.free(1, 11);
        residency.free(1, 11);

        residency.alloc(1, 13, 4).expect("fits in the hole");

        assert_eq!(residency.buffer(13).map(|b| b.offset), Some(Some(8)));
        assert_eq!(residency.buffer(11), None);
    }

    #[test]
    fn switching_to_an_unplaced_tenant_or_a_foreign_buffer_fails() {
        let placement = place(4, SLOT, &[demand(1, SLOT, 0.5)], PlacementAlgo::SizeBased);
        let mut residency = Residency::new(placement);
        residency.alloc(1, 10, SLOT).expect("fits");
        residency
            .alloc(2, 20, SLOT)
            .expect("unplaced tenants may allocate");

        let unplaced = residency.on_switch(2, &[20]);
        let foreign = residency.on_switch(1, &[20]);

        assert_eq!(unplaced, Err(MemError::NotPlaced { tenant: 2 }));
        assert_eq!(
            foreign,
            Err(MemError::UnknownBuffer {
                tenant: 1,
                buffer: 20
            })
        );
        assert_eq!(residency.stats(), SwapStats::default());
    }

    #[test]
    fn replacing_evicts_tenants_that_lose_their_slots_and_lays_out_newcomers() {
        let before = place(
            4,
            SLOT,
            &[demand(1, 4 * SLOT, 0.5)],
            PlacementAlgo::SizeBased,
        );
        let mut residency = Residency::new(before);
        residency.alloc(1, 10, SLOT).expect("fits");
        residency
            .alloc(2, 20, SLOT)
            .expect("unplaced tenants may allocate");
        residency.on_switch(1, &[10]).expect("own buffer");
        let mut idle = demand(1, 4 * SLOT, 0.0);
        idle.idle = true;
        let after = place(
            4,
            SLOT,
            &[idle, demand(2, SLOT, 0.5)],
            PlacementAlgo::SizeBased,
        );

        let evicted = residency.replace(after);
        let plan = residency.on_switch(2, &[20]).expect("now placed");

        assert_eq!(evicted, [(1, 10, SLOT)]);
        assert_eq!(residency.buffer(10).map(|b| b.offset), Some(None));
        assert_eq!(plan.restore, [(20, SLOT)]);
    }

    #[test]
    fn replacing_keeps_moved_buffers_resident_when_nothing_collides() {
        let tenants = [demand(1, 2 * SLOT, 0.9), demand(2, 2 * SLOT, 0.1)];
        let before = place(4, SLOT, &tenants, PlacementAlgo::UtilizationBased);
        let mut residency = Residency::new(before);
        residency.alloc(1, 10, 2 * SLOT).expect("fits");
        residency.alloc(2, 20, 2 * SLOT).expect("fits");
        residency.on_switch(1, &[10]).expect("own buffer");
        residency.on_switch(2, &[20]).expect("own buffer");
        let swapped = [demand(1, 2 * SLOT, 0.1), demand(2, 2 * SLOT, 0.9)];
        let after = place(4, SLOT, &swapped, PlacementAlgo::UtilizationBased);

        let evicted = residency.replace(after);

        assert_eq!(residency.placement().range(2).map(|r| r.start), Some(0));
        assert!(evicted.is_empty());
        assert!(residency.is_resident(10));
        assert!(residency.is_resident(20));
    }

    /// A tenant: buffer sizes (each at most one slot) and its utilization.
    type TenantSpec = (Vec<u64>, f64);
    /// Slots, tenants, algorithm, and a trace of (tenant index, mask of buffers needed).
    type Scenario = (usize, Vec<TenantSpec>, PlacementAlgo, Vec<(usize, u8)>);

    fn tenant_strategy() -> impl Strategy<Value = TenantSpec> {
        (prop::collection::vec(1..=SLOT, 1..=4), 0.0..=1.0f64)
    }

    fn algo_strategy() -> impl Strategy<Value = PlacementAlgo> {
        prop::sample::select(PlacementAlgo::ALL.to_vec())
    }

    /// Tenant `i` is id `i + 1`, its buffers `100 * (i + 1) + j`; each reserves the sum of
    /// its buffers, so they always fit its slots.
    fn build(slots: usize, tenants: &[TenantSpec], algo: PlacementAlgo) -> Residency {
        let demands: Vec<TenantDemand> = tenants
            .iter()
            .zip(1..)
            .map(|((sizes, u), t)| demand(t, sizes.iter().sum(), *u))
            .collect();
        let mut residency = Residency::new(place(slots, SLOT, &demands, algo));
        for ((sizes, _), t) in tenants.iter().zip(1..) {
            for (&bytes, j) in sizes.iter().zip(0..) {
                residency
                    .alloc(t, 100 * t + j, bytes)
                    .expect("reservation covers the buffers");
            }
        }
        residency
    }

    /// The buffers of tenant `t` picked by the bits of `mask`.
    fn pick(tenants: &[TenantSpec], t: TenantId, mask: u8) -> Vec<BufferId> {
        let count = tenants[(t - 1) as usize].0.len() as u64;
        (0..count)
            .filter(|j| mask & (1 << j) != 0)
            .map(|j| 100 * t + j)
            .collect()
    }

    fn sizes(residency: &Residency) -> BTreeMap<BufferId, u64> {
        residency.buffers().map(|(id, b)| (id, b.bytes)).collect()
    }

    fn scenario() -> impl Strategy<Value = Scenario> {
        (
            4usize..=8,
            prop::collection::vec(tenant_strategy(), 1..=6),
            algo_strategy(),
        )
            .prop_flat_map(|(slots, tenants, algo)| {
                let n = tenants.len();
                let trace = prop::collection::vec((0..n, any::<u8>()), 0..40);
                (Just(slots), Just(tenants), Just(algo), trace)
            })
    }

    proptest! {
        #[test]
        fn switches_keep_every_invariant((slots, tenants, algo, trace) in scenario()) {
            let mut residency = build(slots, &tenants, algo);
            let allocated = sizes(&residency);
            let private: BTreeSet<TenantId> = (1..=tenants.len() as u64)
                .filter(|&t| residency.placement().is_private(t))
                .collect();
            let mut ever_restored = BTreeSet::new();

            for (i, mask) in trace {
                let t = i as u64 + 1;
                let needed = pick(&tenants, t, mask);
                let plan = residency.on_switch(t, &needed).expect("placed tenant, own buffers");

                prop_assert!(needed.iter().all(|&b| residency.is_resident(b)));
                prop_assert!(residency.slot_usage().iter().all(|&u| u <= SLOT));
                prop_assert_eq!(sizes(&residency), allocated.clone());
                let stats = residency.stats();
                prop_assert_eq!(
                    residency.resident_bytes(),
                    stats.bytes_restored - stats.bytes_evicted
                );
                prop_assert!(plan.evict.iter().all(|(owner, _, _)| !private.contains(owner)));
                // A private tenant copies each buffer in once, when first needed.
                let first_time = plan.restore.iter().all(|(b, _)| !ever_restored.contains(b));
                prop_assert!(!private.contains(&t) || first_time);
                ever_restored.extend(plan.restore.iter().map(|&(b, _)| b));
            }
        }

        #[test]
        fn replacing_mid_trace_keeps_every_invariant(
            (slots, tenants, algo, trace) in scenario(),
            next in algo_strategy(),
            utilization in prop::collection::vec(0.0..=1.0f64, 6),
        ) {
            let mut residency = build(slots, &tenants, algo);
            let allocated = sizes(&residency);
            let half = trace.len() / 2;
            let demands: Vec<TenantDemand> = tenants
                .iter()
                .zip(1..)
                .zip(&utilization)
                .map(|(((sizes, _), t), &u)| demand(t, sizes.iter().sum(), u))
                .collect();

            for &(i, mask) in &trace[..half] {
                let t = i as u64 + 1;
                residency.on_switch(t, &pick(&tenants, t, mask)).expect("placed");
            }
            residency.replace(place(slots, SLOT, &demands, next));
            prop_assert!(residency.slot_usage().iter().all(|&u| u <= SLOT));
            for &(i, mask) in &trace[half..] {
                let t = i as u64 + 1;
                let needed = pick(&tenants, t, mask);
                residency.on_switch(t, &needed).expect("placed");
                prop_assert!(needed.iter().all(|&b| residency.is_resident(b)));
                prop_assert!(residency.slot_usage().iter().all(|&u| u <= SLOT));
            }

            prop_assert_eq!(sizes(&residency), allocated);
            let stats = residency.stats();
            prop_assert_eq!(residency.resident_bytes(), stats.bytes_restored - stats.bytes_evicted);
        }

        /// Without over-commit (reservations, in whole slots, fit the device) every algorithm
        /// gives everyone its own slots and nothing is ever evicted; each buffer is copied in
        /// once, when first needed.
        #[test]
        fn without_over_commit_nothing_is_swapped(
            reservations in prop::collection::vec((1u64..=3, 0.0..=1.0f64), 1..=6),
            spare in 0usize..=3,
            algo in algo_strategy(),
            trace in prop::collection::vec((0usize..6, any::<u8>()), 0..40),
        ) {
            let slots = reservations.iter().map(|&(k, _)| k as usize).sum::<usize>() + spare;
            let tenants: Vec<TenantSpec> = reservations
                .iter()
                .map(|&(k, u)| (vec![SLOT; k as usize], u))
                .collect();
            let mut residency = build(slots, &tenants, algo);
            let mut needed_ever = BTreeSet::new();

            for (i, mask) in trace {
                let t = (i % tenants.len()) as u64 + 1;
                let needed = pick(&tenants, t, mask);
                residency.on_switch(t, &needed).expect("placed");
                needed_ever.extend(needed);
            }

            prop_assert_eq!(residency.placement().shared_slots(), 0);
            prop_assert_eq!(residency.stats().bytes_evicted, 0);
            prop_assert_eq!(residency.stats().bytes_restored, needed_ever.len() as u64 * SLOT);
        }
    }
}
