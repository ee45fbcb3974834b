//! Device-memory over-subscription: which buffers are on the device, and who copies what out
//! before a tenant runs.
//!
//! The router owns the decision; the tenants' API servers own the bytes. The configured
//! capacity is cut into slots and every tenant placed on a run of them (gScale's
//! leftmost-lowest-score or DymGPU's size- and utilization-based algorithms, from
//! `hira_policy::mem`). Each buffer has a fixed place inside its tenant's slots. Before the
//! dispatcher lets a tenant's command through, [`Swapper::before_run`] works out the buffers
//! the command uses (the memory objects it names and, for a launch, its kernel's buffer
//! arguments as the router saw them set), and has the servers of the tenants whose resident
//! buffers overlap those places copy them out (EVICT, answered by EVICTED). The running
//! tenant's server then restores what the command touches, on demand, and reports it
//! (RESTORED). Tenants alone on their slots never swap.
//!
//! Locking: `inner` is held while evictions are performed, and an eviction waits for a reply
//! that a tenant's control thread delivers; so nothing a control thread calls here
//! ([`Swapper::note_restored`], [`Swapper::note_busy`]) takes `inner`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hira_policy::mem::{
    place, same_shape, sharing_cost, BufferId, MemError, Monitor, MonitorConfig, PlacementAlgo,
    Residency, TenantDemand, TenantId,
};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

/// How the device's memory is shared.
#[derive(Debug, Clone, Copy)]
pub struct SwapConfig {
    /// Device bytes the tenants' resident buffers may occupy together.
    pub capacity: u64,
    /// Slots the capacity is cut into.
    pub slots: usize,
    pub placement: PlacementAlgo,
    /// Idle threshold and re-placement period.
    pub monitor: MonitorConfig,
}

/// A server's answer to EVICT.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evicted {
    pub bytes: u64,
    pub ns: u64,
    /// Buffers the server kept on the device (pinned, or unknown to it).
    pub kept: Vec<u64>,
}

/// The way to a tenant's API server.
pub trait Evictor: Send + Sync {
    /// Has the server copy the buffers `ids` (its own ids) to host memory; waits for the
    /// answer.
    fn evict(&self, ids: &[u64]) -> Result<Evicted, String>;
}

/// Totals since the router started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapTotals {
    pub bytes_evicted: u64,
    pub bytes_restored: u64,
    pub buffers_evicted: u64,
    pub buffers_restored: u64,
    /// Commands before which something had to be copied out.
    pub swaps: u64,
    /// Time the router waited for evictions.
    pub evict_ns: u64,
    /// Time servers spent restoring.
    pub restore_ns: u64,
    /// Placements computed (tenants came, went, outgrew their slots, or the monitor's
    /// period ended).
    pub placements: u64,
    /// Bytes of buffers the servers keep on the device whatever happens (USE_HOST_PTR,
    /// host-inaccessible, parents of sub-buffers, …): outside the slots.
    pub pinned_bytes: u64,
}

/// One tenant's memory as the swapper sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantSwap {
    pub tenant: TenantId,
    /// First slot and number of slots; None while unplaced (idle).
    pub slots: Option<(usize, usize)>,
    pub buffers: usize,
    pub bytes: u64,
    pub resident_bytes: u64,
    /// Tenants sharing a slot with this one.
    pub sharers: Vec<TenantId>,
}

/// Everything `hira ctl` and the metrics show.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwapView {
    pub capacity: u64,
    pub slots: usize,
    pub placement: String,
    pub resident_bytes: u64,
    pub totals: SwapTotals,
    pub tenants: Vec<TenantSwap>,
}

struct TenantMem {
    evictor: Arc<dyn Evictor>,
    quota: Option<u64>,
    /// Live buffers: id → bytes.
    buffers: HashMap<u64, u64>,
    /// Kernel id → argument index → buffer id, from clSetKernelArg.
    kernels: HashMap<u64, BTreeMap<u32, u64>>,
}

impl TenantMem {
    fn used(&self) -> u64 {
        self.buffers.values().sum()
    }

    /// Bytes the tenant reserves for placement: its quota, else what it holds.
    fn demand(&self) -> u64 {
        self.quota.unwrap_or_else(|| self.used())
    }
}

struct Inner {
    res: Residency,
    monitor: Monitor,
    placement: PlacementAlgo,
    tenants: BTreeMap<TenantId, TenantMem>,
    /// Evictions decided but not yet performed (re-placement, buffers created on occupied
    /// bytes); done before the next command runs.
    pending: Vec<(TenantId, BufferId, u64)>,
    /// Buffers outside the slots: key → bytes.
    pinned: HashMap<BufferId, u64>,
    totals: SwapTotals,
}

/// A RESTORED report, applied the next time `inner` is taken.
struct Note {
    tenant: TenantId,
    id: u64,
    bytes: u64,
    ns: u64,
}

/// The router's over-subscription state (one device).
pub struct Swapper {
    cfg: SwapConfig,
    start: Instant,
    inner: Mutex<Inner>,
    notes: Mutex<Vec<Note>>,
    /// Device time per tenant since the last tick.
    busy: Mutex<HashMap<TenantId, u64>>,
}

impl std::fmt::Debug for Swapper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Swapper")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Residency key of a tenant's buffer: tenants number their own objects, so the tenant goes
/// in the high bits. None for ids too large to pack (never handed out by the server).
fn key(t: TenantId, id: u64) -> Option<BufferId> {
    (id < 1 << 32 && t < 1 << 31).then_some(t << 32 | id)
}

fn unkey(k: BufferId) -> (TenantId, u64) {
    (k >> 32, k & 0xffff_ffff)
}

impl Swapper {
    pub fn new(cfg: SwapConfig) -> Result<Swapper, MemError> {
        if cfg.slots == 0 || cfg.capacity < cfg.slots as u64 {
            return Err(MemError::InvalidConfig(
                "memory.slots must be between 1 and the capacity in bytes",
            ));
        }
        let monitor = Monitor::new(cfg.monitor, 0)?;
        let slot_bytes = cfg.capacity / cfg.slots as u64;
        Ok(Swapper {
            inner: Mutex::new(Inner {
                res: Residency::new(place(cfg.slots, slot_bytes, &[], cfg.placement)),
                monitor,
                placement: cfg.placement,
                tenants: BTreeMap::new(),
                pending: Vec::new(),
                pinned: HashMap::new(),
                totals: SwapTotals::default(),
            }),
            cfg,
            start: Instant::now(),
            notes: Mutex::new(Vec::new()),
            busy: Mutex::new(HashMap::new()),
        })
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn slot_bytes(&self) -> u64 {
        self.cfg.capacity / self.cfg.slots as u64
    }

    /// A new tenant, reached through `evictor`; it is placed at once.
    pub fn add_tenant(&self, t: TenantId, quota: Option<u64>, evictor: Arc<dyn Evictor>) {
        let now = self.now();
        let mut g = lock(&self.inner);
        let tm = TenantMem {
            evictor,
            quota,
            buffers: HashMap::new(),
            kernels: HashMap::new(),
        };
        g.monitor.admit(t, tm.demand(), now);
        g.tenants.insert(t, tm);
        self.replace(&mut g, now);
    }

    /// The tenant is gone (its server with it): forget its buffers and re-place the others.
    pub fn remove_tenant(&self, t: TenantId) {
        let now = self.now();
        let mut g = lock(&self.inner);
        if g.tenants.remove(&t).is_none() {
            return;
        }
        g.res.remove_tenant(t);
        g.monitor.remove(t);
        g.pending.retain(|&(o, _, _)| o != t);
        g.pinned.retain(|&k, _| unkey(k).0 != t);
        self.replace(&mut g, now);
    }

    /// The tenant's quota changed: it is its reservation from the next placement on.
    pub fn set_quota(&self, t: TenantId, quota: Option<u64>) {
        let mut g = lock(&self.inner);
        if let Some(tm) = g.tenants.get_mut(&t) {
            tm.quota = quota;
            let d = tm.demand();
            g.monitor.set_bytes(t, d);
        }
    }

    /// The tenant's server created buffer `id` of `bytes` (it is on the device now).
    pub fn created(&self, t: TenantId, id: u64, bytes: u64) {
        let now = self.now();
        let mut g = lock(&self.inner);
        let Some(tm) = g.tenants.get_mut(&t) else {
            return;
        };
        let Some(k) = key(t, id) else {
            return;
        };
        tm.buffers.insert(id, bytes);
        let d = tm.demand();
        g.monitor.set_bytes(t, d);
        let mut placed = g.res.alloc(t, k, bytes);
        if matches!(
            placed,
            Err(MemError::NoRoom { .. } | MemError::NotPlaced { .. })
        ) {
            // Outgrew its slots: place everyone again with the new reservation.
            g.res.free(t, k);
            self.replace(&mut g, now);
            placed = g.res.alloc(t, k, bytes);
        }
        if let Err(e) = placed {
            // Larger than the slots it can get (bigger than the device): it stays where the
            // server put it, outside the slots.
            info!(tenant = t, buffer = id, bytes, error = %e, "buffer kept outside the slots");
            g.pinned.insert(k, bytes);
            return;
        }
        if !g.res.settle_new(k) {
            debug!(
                tenant = t,
                buffer = id,
                "new buffer lies on bytes another tenant holds"
            );
            g.pending.push((t, k, bytes));
        }
    }

    /// The tenant released buffer `id` for the last time.
    pub fn freed(&self, t: TenantId, id: u64) {
        let mut g = lock(&self.inner);
        let Some(tm) = g.tenants.get_mut(&t) else {
            return;
        };
        if tm.buffers.remove(&id).is_none() {
            return;
        }
        let d = tm.demand();
        g.monitor.set_bytes(t, d);
        if let Some(k) = key(t, id) {
            g.res.free(t, k);
            g.pinned.remove(&k);
            g.pending.retain(|&(_, b, _)| b != k);
        }
    }

    /// `clSetKernelArg(kernel, index, …)` named the memory object `mem` (None: not a buffer
    /// of this tenant, or a plain value).
    pub fn kernel_arg(&self, t: TenantId, kernel: u64, index: u32, mem: Option<u64>) {
        let mut g = lock(&self.inner);
        let Some(tm) = g.tenants.get_mut(&t) else {
            return;
        };
        match mem.filter(|m| tm.buffers.contains_key(m)) {
            Some(m) => {
                tm.kernels.entry(kernel).or_default().insert(index, m);
            }
            None => {
                if let Some(args) = tm.kernels.get_mut(&kernel) {
                    args.remove(&index);
                }
            }
        }
    }

    /// A server restored a buffer on its own (RESTORED). Called from control threads: never
    /// blocks on `inner`.
    pub fn note_restored(&self, t: TenantId, id: u64, bytes: u64, ns: u64) {
        lock(&self.notes).push(Note {
            tenant: t,
            id,
            bytes,
            ns,
        });
    }

    /// A command of `t` used `ns` of device time (for the monitor's utilization).
    pub fn note_busy(&self, t: TenantId, ns: u64) {
        *lock(&self.busy).entry(t).or_default() += ns.max(1);
    }

    /// Before tenant `t`'s command `opcode` reaches its server (the dispatcher has let it
    /// through): copy out whatever lies where the command's buffers must be.
    pub fn before_run(&self, t: TenantId, opcode: u16, payload: &[u8]) {
        let (mems, kernel) = hira_opencl::request_mems(opcode, payload).unwrap_or_default();
        let mut g = lock(&self.inner);
        self.apply_notes(&mut g);
        let Some(tm) = g.tenants.get(&t) else {
            return;
        };
        let mut needed: BTreeSet<BufferId> = BTreeSet::new();
        let args = tm.kernels.get(&kernel).into_iter().flat_map(|a| a.values());
        for &id in mems.iter().chain(args) {
            if tm.buffers.contains_key(&id) {
                if let Some(k) = key(t, id).filter(|k| !g.pinned.contains_key(k)) {
                    needed.insert(k);
                }
            }
        }
        let needed: Vec<BufferId> = needed.into_iter().collect();
        if needed.iter().all(|&k| g.res.is_resident(k)) && g.pending.is_empty() {
            return;
        }
        let plan = match g.res.on_switch(t, &needed) {
            Err(MemError::NotPlaced { .. }) => {
                // Left out as idle, and now busy again.
                let now = self.now();
                g.monitor.record(t, 1, now);
                self.replace(&mut g, now);
                g.res.on_switch(t, &needed)
            }
            other => other,
        };
        let mut evict = std::mem::take(&mut g.pending);
        match plan {
            Ok(plan) => evict.extend(plan.evict),
            Err(e) => debug!(tenant = t, error = %e, "no swap plan"),
        }
        self.perform(&mut g, evict);
    }

    /// Monitor tick (call about every second): feeds utilization, and re-places everyone
    /// when the monitor's period ends (idle tenants lose their slots).
    pub fn tick(&self) {
        let now = self.now();
        let busy: Vec<(TenantId, u64)> = lock(&self.busy).drain().collect();
        let mut g = lock(&self.inner);
        self.apply_notes(&mut g);
        for (t, ns) in busy {
            if g.tenants.contains_key(&t) {
                g.monitor.record(t, ns, now);
            }
        }
        if let Some(demands) = g.monitor.tick(now) {
            self.adopt(&mut g, &demands, true);
        }
    }

    /// Switches the placement algorithm; takes effect at once.
    pub fn set_placement(&self, algo: PlacementAlgo) {
        let now = self.now();
        let mut g = lock(&self.inner);
        g.placement = algo;
        self.replace(&mut g, now);
    }

    pub fn totals(&self) -> SwapTotals {
        let mut g = lock(&self.inner);
        self.apply_notes(&mut g);
        let mut t = g.totals;
        t.pinned_bytes = g.pinned.values().sum();
        t
    }

    pub fn view(&self) -> SwapView {
        let mut g = lock(&self.inner);
        self.apply_notes(&mut g);
        let mut totals = g.totals;
        totals.pinned_bytes = g.pinned.values().sum();
        let placement = g.res.placement();
        let mut tenants = Vec::new();
        for (&t, tm) in &g.tenants {
            let resident_bytes = g
                .res
                .buffers()
                .filter(|(_, b)| b.owner == t && b.resident)
                .map(|(_, b)| b.bytes)
                .sum();
            tenants.push(TenantSwap {
                tenant: t,
                slots: placement.range(t).map(|r| (r.start, r.len)),
                buffers: tm.buffers.len(),
                bytes: tm.used(),
                resident_bytes,
                sharers: placement.sharers(t),
            });
        }
        SwapView {
            capacity: self.cfg.capacity,
            slots: self.cfg.slots,
            placement: g.placement.name().into(),
            resident_bytes: g.res.resident_bytes(),
            totals,
            tenants,
        }
    }

    fn apply_notes(&self, g: &mut Inner) {
        let notes = std::mem::take(&mut *lock(&self.notes));
        for n in notes {
            g.totals.bytes_restored += n.bytes;
            g.totals.buffers_restored += 1;
            g.totals.restore_ns += n.ns;
            let Some(k) = key(n.tenant, n.id) else {
                continue;
            };
            // Restored outside a plan (an info query, a kernel cloned behind the router's
            // back): whatever it now overlaps goes out before the next command.
            let victims = g.res.claim(k);
            g.pending.extend(victims);
        }
    }

    /// Places every tenant afresh from the monitor's current demands.
    fn replace(&self, g: &mut Inner, now: u64) {
        let mut demands = g.monitor.demands(now);
        for d in &mut demands {
            if let Some(tm) = g.tenants.get(&d.id) {
                d.bytes = tm.demand();
            }
        }
        self.adopt(g, &demands, false);
    }

    /// Adopts the placement `demands` give. A `periodic` re-placement that gives every
    /// tenant the same number of slots is adopted only if it is expected to swap clearly
    /// less ([`REPLACE_GAIN`]): measured utilizations jitter, and chasing every reordering
    /// would copy more than it saves.
    fn adopt(&self, g: &mut Inner, demands: &[TenantDemand], periodic: bool) {
        let placement = place(self.cfg.slots, self.slot_bytes(), demands, g.placement);
        if &placement == g.res.placement() {
            return;
        }
        if periodic && same_shape(&placement, g.res.placement()) {
            let util: BTreeMap<TenantId, f64> =
                demands.iter().map(|d| (d.id, d.utilization)).collect();
            let (new, old) = (
                sharing_cost(&placement, &util),
                sharing_cost(g.res.placement(), &util),
            );
            if new > old * (1.0 - REPLACE_GAIN) {
                debug!(new, old, "re-placement not worth its copies; kept");
                return;
            }
        }
        g.totals.placements += 1;
        debug!(placement = ?placement.iter().collect::<Vec<_>>(), "tenants placed");
        let evictions = g.res.replace(placement);
        g.pending.extend(evictions);
    }

    /// Has the owners' servers copy `evict` out, one EVICT per tenant.
    fn perform(&self, g: &mut Inner, evict: Vec<(TenantId, BufferId, u64)>) {
        if evict.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut by_owner: BTreeMap<TenantId, Vec<u64>> = BTreeMap::new();
        for (owner, k, _) in evict {
            let (t, id) = unkey(k);
            if t == owner {
                by_owner.entry(owner).or_default().push(id);
            }
        }
        for (owner, mut ids) in by_owner {
            ids.sort_unstable();
            ids.dedup();
            let Some(tm) = g.tenants.get(&owner) else {
                continue;
            };
            match tm.evictor.evict(&ids) {
                Ok(ev) => {
                    g.totals.bytes_evicted += ev.bytes;
                    g.totals.buffers_evicted += (ids.len() - ev.kept.len().min(ids.len())) as u64;
                    for id in ev.kept {
                        // The server will not let it go: it stays on the device, outside
                        // the slots, and no plan counts on its bytes again.
                        let Some(k) = key(owner, id) else { continue };
                        if let Some(&bytes) = tm.buffers.get(&id) {
                            g.res.free(owner, k);
                            g.pinned.insert(k, bytes);
                            info!(
                                tenant = owner,
                                buffer = id,
                                bytes,
                                "buffer pinned on the device"
                            );
                        }
                    }
                }
                Err(e) => warn!(tenant = owner, error = %e, "eviction failed"),
            }
        }
        g.totals.swaps += 1;
        g.totals.evict_ns += started.elapsed().as_nanos() as u64;
    }
}

/// How much less a periodic re-placement must be expected to swap (by
/// [`sharing_cost`]) to be worth moving tenants: 20 %.
pub const REPLACE_GAIN: f64 = 0.2;

/// The time an eviction may take before the router gives up waiting.
pub const EVICT_TIMEOUT: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that evicts everything it is asked to, except `pinned`, and logs the calls.
    #[derive(Default)]
    struct FakeServer {
        calls: Mutex<Vec<Vec<u64>>>,
        pinned: Vec<u64>,
        sizes: HashMap<u64, u64>,
    }

    impl Evictor for FakeServer {
        fn evict(&self, ids: &[u64]) -> Result<Evicted, String> {
            lock(&self.calls).push(ids.to_vec());
            let kept: Vec<u64> = ids
                .iter()
                .copied()
                .filter(|i| self.pinned.contains(i))
                .collect();
            let bytes = ids
                .iter()
                .filter(|i| !kept.contains(i))
                .map(|i| self.sizes.get(i).copied().unwrap_or(0))
                .sum();
            Ok(Evicted { bytes, ns: 1, kept })
        }
    }

    const MIB: u64 = 1 << 20;

    fn swapper(capacity: u64, slots: usize) -> Swapper {
        Swapper::new(SwapConfig {
            capacity,
            slots,
            placement: PlacementAlgo::LeftmostLowestScore,
            monitor: MonitorConfig {
                idle_threshold: 20_000_000_000,
                period: 20_000_000_000,
            },
        })
        .unwrap()
    }

    fn server(sizes: &[(u64, u64)], pinned: &[u64]) -> Arc<FakeServer> {
        Arc::new(FakeServer {
            calls: Mutex::new(Vec::new()),
            pinned: pinned.to_vec(),
            sizes: sizes.iter().copied().collect(),
        })
    }

    /// Two tenants whose 32 MiB reservations fill the same two slots, with servers that
    /// know the buffer sizes given (`pinned_a`: tenant 1's server keeps these).
    fn pair(
        a_sizes: &[(u64, u64)],
        b_sizes: &[(u64, u64)],
        pinned_a: &[u64],
    ) -> (Swapper, Arc<FakeServer>, Arc<FakeServer>) {
        let s = swapper(32 * MIB, 2);
        let a = server(a_sizes, pinned_a);
        let b = server(b_sizes, &[]);
        s.add_tenant(1, Some(32 * MIB), a.clone());
        s.add_tenant(2, Some(32 * MIB), b.clone());
        (s, a, b)
    }

    /// The payload of clEnqueueWriteBuffer(queue, buffer, …) as the guest encodes it: only
    /// the two leading handles matter to `request_mems`, so the test builds the real frame
    /// through the generated decoder's own layout.
    fn write_payload(buffer: u64) -> Vec<u8> {
        let mut w = hira_wire::Writer::default();
        w.u64(1); // queue
        w.u64(buffer);
        w.u64(1); // blocking
        w.u64(0); // offset
        w.u64(4); // size
        w.blob(hira_wire::Blob::Inline(&[0, 0, 0, 0]));
        w.u64(0); // no wait list
        w.blob(hira_wire::Blob::Null);
        w.u64(0); // no event
        w.buf
    }

    #[test]
    fn the_payload_names_its_buffer() {
        let (mems, kernel) =
            hira_opencl::request_mems(hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(7))
                .expect("decodable");
        assert_eq!((mems, kernel), (vec![7], 0));
    }

    #[test]
    fn tenants_that_fit_never_swap() {
        let s = swapper(64 * MIB, 8);
        let a = server(&[(1, 16 * MIB)], &[]);
        let b = server(&[(1, 16 * MIB)], &[]);
        s.add_tenant(1, None, a.clone());
        s.add_tenant(2, None, b.clone());
        s.created(1, 1, 16 * MIB);
        s.created(2, 1, 16 * MIB);
        for _ in 0..3 {
            s.before_run(1, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
            s.before_run(2, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        }
        assert!(lock(&a.calls).is_empty() && lock(&b.calls).is_empty());
        assert_eq!(s.totals().bytes_evicted, 0);
    }

    #[test]
    fn tenants_on_the_same_slots_take_turns() {
        let (s, a, b) = pair(&[(1, 24 * MIB)], &[(1, 24 * MIB)], &[]);
        s.created(1, 1, 24 * MIB);
        s.created(2, 1, 24 * MIB);
        // Tenant 2's new buffer lay on tenant 1's: it goes out before anything runs.
        s.before_run(1, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        assert_eq!(*lock(&b.calls), vec![vec![1]]);
        s.before_run(2, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        assert_eq!(*lock(&a.calls), vec![vec![1]]);
        s.before_run(2, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        assert_eq!(lock(&a.calls).len(), 1, "already resident: nothing to do");
        assert_eq!(s.totals().bytes_evicted, 48 * MIB);
    }

    #[test]
    fn a_launch_needs_its_kernel_arguments() {
        let (s, a, b) = pair(&[(1, 24 * MIB)], &[(1, 8 * MIB), (2, 24 * MIB)], &[]);
        s.created(1, 1, 24 * MIB);
        s.created(2, 1, 8 * MIB);
        s.created(2, 2, 24 * MIB);
        s.kernel_arg(2, 50, 0, Some(2));
        s.kernel_arg(2, 50, 1, Some(999)); // not a buffer of tenant 2
        s.before_run(1, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        lock(&b.calls).clear();
        let mut w = hira_wire::Writer::default();
        w.u64(1); // queue
        w.u64(50); // kernel
        w.u64(1); // work_dim
        w.blob(hira_wire::Blob::Null);
        w.blob(hira_wire::Blob::Inline(&8u64.to_le_bytes()));
        w.blob(hira_wire::Blob::Null);
        w.u64(0);
        w.blob(hira_wire::Blob::Null);
        w.u64(0);
        s.before_run(2, hira_opencl::OP_CLENQUEUENDRANGEKERNEL, &w.buf);
        assert_eq!(
            *lock(&a.calls),
            vec![vec![1]],
            "argument 0 lies on tenant 1's buffer"
        );
    }

    #[test]
    fn a_kept_buffer_is_pinned_and_never_asked_for_again() {
        let (s, a, _b) = pair(&[(1, 24 * MIB)], &[(1, 24 * MIB)], &[1]);
        s.created(1, 1, 24 * MIB);
        s.created(2, 1, 24 * MIB);
        s.before_run(1, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        s.before_run(2, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        s.before_run(2, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        assert_eq!(*lock(&a.calls), vec![vec![1]]);
        assert_eq!(s.totals().pinned_bytes, 24 * MIB);
    }

    #[test]
    fn restored_outside_a_plan_evicts_what_it_overlaps() {
        let (s, _a, b) = pair(&[(1, 24 * MIB)], &[(1, 24 * MIB)], &[]);
        s.created(1, 1, 24 * MIB);
        s.created(2, 1, 24 * MIB);
        s.before_run(1, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        // Tenant 2's server restored its buffer for an info query.
        s.note_restored(2, 1, 24 * MIB, 5);
        s.before_run(1, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        assert_eq!(
            lock(&b.calls).len(),
            2,
            "evicted after creation, then after the query"
        );
        let t = s.totals();
        assert_eq!((t.bytes_restored, t.restore_ns), (24 * MIB, 5));
    }

    #[test]
    fn periodic_re_placement_ignores_jitter_but_follows_real_change() {
        let s = Swapper::new(SwapConfig {
            placement: PlacementAlgo::UtilizationBased,
            ..swapper(64 * MIB, 8).cfg
        })
        .unwrap();
        let demands = |u: [f64; 4]| -> Vec<TenantDemand> {
            (0..4)
                .map(|i| TenantDemand {
                    id: i as u64 + 1,
                    bytes: 24 * MIB,
                    utilization: u[i],
                    idle: false,
                })
                .collect()
        };
        let mut g = lock(&s.inner);
        s.adopt(&mut g, &demands([0.9, 0.8, 0.1, 0.05]), false);
        let first = g.res.placement().clone();
        // The two busy tenants swap ranks by a hair: same cost, nothing moves.
        s.adopt(&mut g, &demands([0.8, 0.9, 0.1, 0.05]), true);
        assert_eq!(g.res.placement(), &first);
        // The idle pair became the busy pair: worth moving.
        s.adopt(&mut g, &demands([0.05, 0.1, 0.8, 0.9]), true);
        assert_ne!(g.res.placement(), &first);
        assert_eq!(g.totals.placements, 2);
    }

    #[test]
    fn released_buffers_and_departed_tenants_are_forgotten() {
        let (s, a, b) = pair(&[(1, 24 * MIB)], &[(1, 24 * MIB)], &[]);
        s.created(1, 1, 24 * MIB);
        s.freed(1, 1);
        s.created(2, 1, 24 * MIB);
        s.before_run(2, hira_opencl::OP_CLENQUEUEWRITEBUFFER, &write_payload(1));
        assert!(lock(&a.calls).is_empty() && lock(&b.calls).is_empty());
        s.remove_tenant(2);
        assert_eq!(s.view().tenants.len(), 1);
    }
}
