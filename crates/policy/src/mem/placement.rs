//! Slot placement: the device is divided into `n` equal slots and each tenant is mapped to a
//! contiguous run of them, sized by its reservation. Tenants may share slots (gScale's slot
//! sharing); a tenant alone on its slots never swaps, so the algorithms differ in who gets to
//! be alone.
//!
//! - [`PlacementAlgo::LeftmostLowestScore`]: gVirt's allocator as DymGPU §2.1 describes it.
//!   Each slot scores a very large weight per tenant already on it; a tenant takes the
//!   contiguous run with the lowest total, the leftmost on ties. Tenants are placed in the
//!   order given (their arrival order).
//! - [`PlacementAlgo::SizeBased`]: DymGPU Algorithm 1. Largest first from the left while each
//!   fits alone; the first that does not is pushed to the right end (`V_K`); everyone after
//!   starts where `V_K` starts, on top of the shared slots.
//! - [`PlacementAlgo::UtilizationBased`]: DymGPU Algorithm 2. Busiest first from the left
//!   while each fits alone; everyone after is pushed to the right end.
//!
//! Idle tenants are left out (DymGPU treats them as terminated; gScale skips them).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{MemError, TenantId};

/// Which placement algorithm to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PlacementAlgo {
    /// gVirt: leftmost contiguous run with the lowest sharing score (`lls`).
    #[serde(rename = "lls")]
    LeftmostLowestScore,
    /// DymGPU Algorithm 1, by reservation size (`size`).
    #[serde(rename = "size")]
    SizeBased,
    /// DymGPU Algorithm 2, by averaged utilization (`util`).
    #[serde(rename = "util")]
    UtilizationBased,
}

impl PlacementAlgo {
    /// All algorithms, in the order reports list them.
    pub const ALL: [PlacementAlgo; 3] = [
        PlacementAlgo::LeftmostLowestScore,
        PlacementAlgo::SizeBased,
        PlacementAlgo::UtilizationBased,
    ];

    /// The configuration name: `lls`, `size` or `util`.
    pub fn name(self) -> &'static str {
        match self {
            PlacementAlgo::LeftmostLowestScore => "lls",
            PlacementAlgo::SizeBased => "size",
            PlacementAlgo::UtilizationBased => "util",
        }
    }
}

impl fmt::Display for PlacementAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PlacementAlgo {
    type Err = MemError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "lls" => Ok(PlacementAlgo::LeftmostLowestScore),
            "size" => Ok(PlacementAlgo::SizeBased),
            "util" => Ok(PlacementAlgo::UtilizationBased),
            _ => Err(MemError::InvalidConfig(
                "placement algorithm must be lls, size or util",
            )),
        }
    }
}

/// What the allocator knows of one tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantDemand {
    pub id: TenantId,
    /// Reserved device bytes (its quota, or its use when unlimited).
    pub bytes: u64,
    /// Device utilization in 0..=1, averaged over the monitor's window.
    pub utilization: f64,
    /// Idle past the monitor's threshold: left out of the placement.
    pub idle: bool,
}

/// A contiguous run of slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlotRange {
    pub start: usize,
    pub len: usize,
}

impl SlotRange {
    /// One past the last slot.
    pub fn end(self) -> usize {
        self.start + self.len
    }

    /// Whether the two runs have a slot in common.
    pub fn overlaps(self, other: SlotRange) -> bool {
        self.start < other.end() && other.start < self.end()
    }
}

/// Slots needed for `bytes`: at least one, at most the whole device.
pub fn slots_needed(bytes: u64, slot_bytes: u64, slots: usize) -> usize {
    if slot_bytes == 0 {
        return slots.min(1);
    }
    let k = usize::try_from(bytes.div_ceil(slot_bytes)).unwrap_or(usize::MAX);
    k.max(1).min(slots)
}

/// Each placed tenant's slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    slots: usize,
    slot_bytes: u64,
    ranges: BTreeMap<TenantId, SlotRange>,
}

impl Placement {
    /// A device of `slots` slots of `slot_bytes` each, with nobody placed.
    pub fn empty(slots: usize, slot_bytes: u64) -> Self {
        Placement {
            slots,
            slot_bytes,
            ranges: BTreeMap::new(),
        }
    }

    /// Number of slots on the device.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// `t`'s slots, or `None` when it is not placed.
    pub fn range(&self, t: TenantId) -> Option<SlotRange> {
        self.ranges.get(&t).copied()
    }

    /// Placed tenants and their slots, by tenant id.
    pub fn iter(&self) -> impl Iterator<Item = (TenantId, SlotRange)> + '_ {
        self.ranges.iter().map(|(&t, &r)| (t, r))
    }

    /// Other tenants with a slot in common with `t`, by id.
    pub fn sharers(&self, t: TenantId) -> Vec<TenantId> {
        let Some(mine) = self.range(t) else {
            return Vec::new();
        };
        self.iter()
            .filter(|&(other, r)| other != t && r.overlaps(mine))
            .map(|(other, _)| other)
            .collect()
    }

    /// Whether `t` is placed and alone on all its slots.
    pub fn is_private(&self, t: TenantId) -> bool {
        self.ranges.contains_key(&t) && self.sharers(t).is_empty()
    }

    /// Tenants on each slot.
    pub fn occupancy(&self) -> Vec<usize> {
        let mut occupancy = vec![0; self.slots];
        for r in self.ranges.values() {
            for count in &mut occupancy[r.start..r.end()] {
                *count += 1;
            }
        }
        occupancy
    }

    /// Slots held by more than one tenant.
    pub fn shared_slots(&self) -> usize {
        self.occupancy().iter().filter(|&&n| n > 1).count()
    }

    fn insert(&mut self, t: TenantId, start: usize, len: usize) {
        self.ranges.insert(t, SlotRange { start, len });
    }
}

/// Expected swapping under a placement: for every pair of tenants with slots in common, the
/// slots they share times the utilization of the less busy one (the device switches between
/// them about as often as that one runs). Tenants missing from `utilization` count as idle.
pub fn sharing_cost(p: &Placement, utilization: &BTreeMap<TenantId, f64>) -> f64 {
    let ranges: Vec<(TenantId, SlotRange)> = p.iter().collect();
    let mut cost = 0.0;
    for (i, &(a, ra)) in ranges.iter().enumerate() {
        for &(b, rb) in &ranges[i + 1..] {
            let shared = ra
                .end()
                .min(rb.end())
                .saturating_sub(ra.start.max(rb.start));
            if shared > 0 {
                let ua = utilization.get(&a).copied().unwrap_or(0.0);
                let ub = utilization.get(&b).copied().unwrap_or(0.0);
                cost += shared as f64 * ua.min(ub);
            }
        }
    }
    cost
}

/// Whether two placements give every tenant the same number of slots (they differ at most in
/// where the slots are).
pub fn same_shape(a: &Placement, b: &Placement) -> bool {
    a.slots() == b.slots()
        && a.iter().count() == b.iter().count()
        && a.iter()
            .all(|(t, r)| b.range(t).is_some_and(|o| o.len == r.len))
}

/// Places every non-idle tenant on `slots` slots of `slot_bytes` each. A tenant reserving
/// `b` bytes gets `ceil(b / slot_bytes)` consecutive slots (at least one, at most all).
/// Ties keep the order of `tenants`.
pub fn place(
    slots: usize,
    slot_bytes: u64,
    tenants: &[TenantDemand],
    algo: PlacementAlgo,
) -> Placement {
    let mut placement = Placement::empty(slots, slot_bytes);
    if slots == 0 {
        return placement;
    }
    let active: Vec<(&TenantDemand, usize)> = tenants
        .iter()
        .filter(|d| !d.idle)
        .map(|d| (d, slots_needed(d.bytes, slot_bytes, slots)))
        .collect();
    match algo {
        PlacementAlgo::LeftmostLowestScore => leftmost_lowest_score(&mut placement, &active),
        PlacementAlgo::SizeBased => {
            let mut order = active;
            order.sort_by_key(|a| std::cmp::Reverse(a.1));
            dymgpu(&mut placement, &order, Rest::OnTopOfVk);
        }
        PlacementAlgo::UtilizationBased => {
            let mut order = active;
            order.sort_by(|a, b| utilization(b.0).total_cmp(&utilization(a.0)));
            dymgpu(&mut placement, &order, Rest::RightEnd);
        }
    }
    placement
}

fn utilization(d: &TenantDemand) -> f64 {
    if d.utilization.is_nan() {
        0.0
    } else {
        d.utilization.clamp(0.0, 1.0)
    }
}

/// gVirt: each tenant in turn takes the leftmost run whose slots carry the fewest tenants.
fn leftmost_lowest_score(placement: &mut Placement, order: &[(&TenantDemand, usize)]) {
    let mut occupancy = vec![0usize; placement.slots];
    for &(d, k) in order {
        let mut score: usize = occupancy[..k].iter().sum();
        let (mut best_start, mut best_score) = (0, score);
        for start in 1..=placement.slots - k {
            score = score + occupancy[start + k - 1] - occupancy[start - 1];
            if score < best_score {
                (best_start, best_score) = (start, score);
            }
        }
        for count in &mut occupancy[best_start..best_start + k] {
            *count += 1;
        }
        placement.insert(d.id, best_start, k);
    }
}

/// Where DymGPU puts the tenants that did not get slots of their own.
#[derive(Clone, Copy)]
enum Rest {
    /// Algorithm 1, line 15: `P_index ← P_K`.
    OnTopOfVk,
    /// Algorithm 2, line 14: `P_index ← M − S_index`.
    RightEnd,
}

/// DymGPU Algorithms 1 and 2 after their sort (line 1), which differ only in `rest`.
fn dymgpu(placement: &mut Placement, order: &[(&TenantDemand, usize)], rest: Rest) {
    let m = placement.slots;
    let mut starts = Vec::with_capacity(order.len());
    let mut sum = 0;
    let mut index = 0;
    let mut k = None;
    // Lines 4-13, stopping early when everyone fits.
    while sum < m && index < order.len() {
        let s = order[index].1;
        if sum + s < m {
            starts.push(sum);
        } else {
            starts.push(m - s);
            k = Some(index);
        }
        sum += s;
        index += 1;
    }
    // The first loop only ends with tenants left after its `else` branch set K.
    let p_k = k.map_or(0, |k| starts[k]);
    while index < order.len() {
        starts.push(match rest {
            Rest::OnTopOfVk => p_k,
            Rest::RightEnd => m - order[index].1,
        });
        index += 1;
    }
    for (&(d, s), start) in order.iter().zip(starts) {
        placement.insert(d.id, start, s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(id: TenantId, slots: u64, utilization: f64) -> TenantDemand {
        TenantDemand {
            id,
            bytes: slots * 64,
            utilization,
            idle: false,
        }
    }

    fn starts(p: &Placement) -> Vec<(TenantId, usize, usize)> {
        p.iter().map(|(t, r)| (t, r.start, r.len)).collect()
    }

    #[test]
    fn sharing_cost_weighs_shared_slots_by_the_less_busy_tenant() {
        let tenants = [demand(1, 3, 0.9), demand(2, 3, 0.5), demand(3, 2, 0.1)];
        let util: BTreeMap<TenantId, f64> = tenants.iter().map(|d| (d.id, d.utilization)).collect();
        // Util-based on 4 slots: 1 alone on 0..3, then 2 on 1..4 and 3 on 2..4.
        let p = place(4, 64, &tenants, PlacementAlgo::UtilizationBased);
        assert_eq!(starts(&p), [(1, 0, 3), (2, 1, 3), (3, 2, 2)]);
        let cost = sharing_cost(&p, &util);
        // 1–2 share slots 1,2 (×0.5); 1–3 share slot 2 (×0.1); 2–3 share slots 2,3 (×0.1).
        assert!(
            (cost - (2.0 * 0.5 + 0.1 + 2.0 * 0.1)).abs() < 1e-9,
            "{cost}"
        );
        let alone = place(8, 64, &tenants, PlacementAlgo::UtilizationBased);
        assert_eq!(sharing_cost(&alone, &util), 0.0);
        assert!(same_shape(
            &p,
            &place(4, 64, &tenants, PlacementAlgo::LeftmostLowestScore)
        ));
        assert!(!same_shape(&p, &alone), "different slot count");
    }

    #[test]
    fn algorithm_names_round_trip() {
        let parsed: Vec<PlacementAlgo> = ["lls", "size", "util"]
            .iter()
            .map(|s| s.parse().expect("known name"))
            .collect();
        let shown: Vec<String> = parsed.iter().map(ToString::to_string).collect();

        assert_eq!(parsed, PlacementAlgo::ALL);
        assert_eq!(shown, ["lls", "size", "util"]);
        assert!("best".parse::<PlacementAlgo>().is_err());
    }

    #[test]
    fn slots_needed_rounds_up_and_clamps() {
        assert_eq!(slots_needed(0, 64, 8), 1);
        assert_eq!(slots_needed(64, 64, 8), 1);
        assert_eq!(slots_needed(65, 64, 8), 2);
        assert_eq!(slots_needed(64 * 100, 64, 8), 8);
    }

    /// DymGPU §2.1: five slots, the first four held by one VM; a VM needing two slots gets
    /// slots 4 and 5 (counting from one).
    #[test]
    fn leftmost_lowest_score_follows_the_gvirt_example() {
        let tenants = [demand(1, 4, 0.5), demand(2, 2, 0.5)];

        let p = place(5, 64, &tenants, PlacementAlgo::LeftmostLowestScore);

        assert_eq!(starts(&p), [(1, 0, 4), (2, 3, 2)]);
    }

    #[test]
    fn leftmost_lowest_score_spreads_before_sharing() {
        let tenants = [
            demand(1, 2, 0.5),
            demand(2, 2, 0.5),
            demand(3, 2, 0.5),
            demand(4, 1, 0.5),
        ];

        let p = place(6, 64, &tenants, PlacementAlgo::LeftmostLowestScore);

        assert_eq!(starts(&p), [(1, 0, 2), (2, 2, 2), (3, 4, 2), (4, 0, 1)]);
        assert_eq!(p.sharers(1), [4]);
        assert!(p.is_private(2));
    }

    /// DymGPU §3.2.1: M = 5 and V0..V3 need 4, 4, 3 and 2 slots, so P = 0, 1, 1, 1 and the
    /// shared run L covers three slots.
    #[test]
    fn size_based_follows_the_paper_example() {
        let tenants = [
            demand(13, 2, 0.9),
            demand(10, 4, 0.1),
            demand(12, 3, 0.9),
            demand(11, 4, 0.1),
        ];

        let p = place(5, 64, &tenants, PlacementAlgo::SizeBased);

        assert_eq!(starts(&p), [(10, 0, 4), (11, 1, 4), (12, 1, 3), (13, 1, 2)]);
        assert_eq!(p.occupancy(), [1, 4, 4, 3, 1]);
        assert_eq!(p.shared_slots(), 3);
    }

    #[test]
    fn utilization_based_keeps_the_busiest_alone_and_pushes_the_rest_right() {
        let tenants = [
            demand(1, 3, 0.1),
            demand(2, 3, 0.9),
            demand(3, 3, 0.5),
            demand(4, 2, 0.2),
            demand(5, 4, 0.7),
        ];

        let p = place(10, 64, &tenants, PlacementAlgo::UtilizationBased);

        // Sorted by utilization: 2 (0.9), 5 (0.7), 3 (0.5), 4 (0.2), 1 (0.1).
        assert_eq!(
            starts(&p),
            [(1, 7, 3), (2, 0, 3), (3, 7, 3), (4, 8, 2), (5, 3, 4)]
        );
        assert!(p.is_private(2));
        assert!(p.is_private(5));
        assert_eq!(p.sharers(3), [1, 4]);
    }

    #[test]
    fn idle_tenants_are_left_out() {
        let mut idle = demand(2, 4, 0.9);
        idle.idle = true;
        let tenants = [demand(1, 4, 0.1), idle, demand(3, 4, 0.5)];

        let placements: Vec<Placement> = PlacementAlgo::ALL
            .iter()
            .map(|&a| place(8, 64, &tenants, a))
            .collect();

        assert!(placements.iter().all(|p| p.range(2).is_none()));
        assert!(placements
            .iter()
            .all(|p| p.is_private(1) && p.is_private(3)));
    }

    #[test]
    fn everyone_fitting_is_everyone_private() {
        let tenants = [demand(1, 3, 0.2), demand(2, 5, 0.9), demand(3, 2, 0.4)];

        let placements: Vec<Placement> = PlacementAlgo::ALL
            .iter()
            .map(|&a| place(10, 64, &tenants, a))
            .collect();

        assert!(placements.iter().all(|p| p.shared_slots() == 0));
        assert!(placements
            .iter()
            .all(|p| p.occupancy().iter().all(|&n| n == 1)));
    }
}
