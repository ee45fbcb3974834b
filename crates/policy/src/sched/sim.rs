//! A fake device with scripted kernel times, for scheduler tests and the router's fairness
//! benchmark: tenants submit commands (keeping `depth` outstanding, or one at a time after a
//! think time, like a synchronous client), the device runs one command at a time for its
//! scripted length, the router's switch between tenants costs `switch_ns` of device time that
//! nobody is charged for. The report has every tenant's device time per window, AvA's
//! unfairness metric |t1 − t2| / (t1 + t2), utilization, starvation and every moment the
//! scheduler left the device idle while an uncapped tenant had work.

use std::collections::{BTreeMap, VecDeque};

use super::{new_scheduler, Decision, Nanos, PolicyKind, SchedConfig, TenantId, TenantParams, MS};

/// A scripted tenant.
#[derive(Clone, Debug, PartialEq)]
pub struct SimTenant {
    pub id: TenantId,
    pub params: TenantParams,
    /// Kernel lengths, used in turn and cycled.
    pub kernels: Vec<Nanos>,
    /// Commands kept outstanding (queued or running); at least 1.
    pub depth: u32,
    /// Delay from a completion to the next submission.
    pub think: Nanos,
    /// Intervals [start, end) in which the tenant submits; empty means always.
    pub on: Vec<(Nanos, Nanos)>,
}

impl SimTenant {
    /// A tenant that always has work: kernels of `kernel` ns, two commands outstanding.
    pub fn busy(id: TenantId, kernel: Nanos) -> Self {
        Self {
            id,
            params: TenantParams::default(),
            kernels: vec![kernel],
            depth: 2,
            think: 0,
            on: Vec::new(),
        }
    }

    /// A synchronous client: one command at a time, `think` ns between completion and the next.
    pub fn synchronous(id: TenantId, kernel: Nanos, think: Nanos) -> Self {
        Self {
            depth: 1,
            think,
            ..Self::busy(id, kernel)
        }
    }

    /// With these parameters.
    pub fn with_params(self, params: TenantParams) -> Self {
        Self { params, ..self }
    }

    /// With this weight.
    pub fn with_weight(self, weight: u32) -> Self {
        let params = TenantParams {
            weight,
            ..self.params.clone()
        };
        Self { params, ..self }
    }

    /// With these kernel lengths, cycled.
    pub fn with_kernels(self, kernels: Vec<Nanos>) -> Self {
        Self { kernels, ..self }
    }

    /// Submitting only within these intervals.
    pub fn with_on(self, on: Vec<(Nanos, Nanos)>) -> Self {
        Self { on, ..self }
    }

    fn is_on(&self, at: Nanos) -> bool {
        self.on.is_empty() || self.on.iter().any(|&(s, e)| s <= at && at < e)
    }

    /// The first time ≥ `at` the tenant submits, if any.
    fn next_on(&self, at: Nanos) -> Option<Nanos> {
        if self.is_on(at) {
            return Some(at);
        }
        self.on.iter().map(|&(s, _)| s).filter(|&s| s > at).min()
    }
}

/// A parameter change during the run.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamChange {
    pub at: Nanos,
    pub tenant: TenantId,
    pub params: TenantParams,
}

/// What to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    pub kind: PolicyKind,
    pub sched: SchedConfig,
    pub duration: Nanos,
    /// Device time the router spends switching to another tenant; charged to nobody.
    pub switch_ns: Nanos,
    pub tenants: Vec<SimTenant>,
    pub changes: Vec<ParamChange>,
}

impl SimConfig {
    /// `tenants` under `kind` with default intervals for `duration`, no switch cost.
    pub fn new(kind: PolicyKind, duration: Nanos, tenants: Vec<SimTenant>) -> Self {
        Self {
            kind,
            sched: SchedConfig::default(),
            duration,
            switch_ns: 0,
            tenants,
            changes: Vec::new(),
        }
    }
}

/// A stretch of device time spent on one tenant's kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Busy {
    /// Index of the tenant in [`SimConfig::tenants`].
    pub tenant: usize,
    pub start: Nanos,
    pub end: Nanos,
}

/// A decision other than `Run` while an uncapped tenant had a command queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stall {
    pub at: Nanos,
    /// How long the scheduler asked to wait (`None`: it said `Idle`).
    pub wait: Option<Nanos>,
}

/// The outcome of a simulation.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    pub tenants: Vec<TenantId>,
    pub duration: Nanos,
    pub busy: Vec<Busy>,
    /// Device time the scheduler charged each tenant.
    pub charged: Vec<Nanos>,
    /// Longest time each tenant had a command ready, the device free of its own kernel,
    /// and was not dispatched.
    pub longest_starvation: Vec<Nanos>,
    pub stalls: Vec<Stall>,
}

/// Median and maximum of a series.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// Of `xs` (0 for an empty series).
    pub fn of(xs: &[f64]) -> Self {
        let mut sorted = xs.to_vec();
        sorted.sort_by(f64::total_cmp);
        Self {
            median: sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
            max: sorted.last().copied().unwrap_or(0.0),
        }
    }
}

impl SimReport {
    /// Device time of each tenant in each complete window of `window` ns: `[window][tenant]`.
    pub fn device_ns(&self, window: Nanos) -> Vec<Vec<Nanos>> {
        let windows = usize::try_from(self.duration / window).unwrap_or(usize::MAX);
        let mut out = vec![vec![0; self.tenants.len()]; windows];
        for b in &self.busy {
            let mut at = b.start;
            while at < b.end {
                let index = at / window;
                let edge = ((index + 1) * window).min(b.end);
                if let Some(row) = usize::try_from(index).ok().and_then(|i| out.get_mut(i)) {
                    row[b.tenant] += edge - at;
                }
                at = edge;
            }
        }
        out
    }

    /// AvA's unfairness |ta − tb| / (ta + tb) between tenants `a` and `b` (indices) per window.
    pub fn unfairness(&self, window: Nanos, a: usize, b: usize) -> Vec<f64> {
        self.device_ns(window)
            .iter()
            .map(|row| {
                let (ta, tb) = (row[a] as f64, row[b] as f64);
                if ta + tb == 0.0 {
                    0.0
                } else {
                    (ta - tb).abs() / (ta + tb)
                }
            })
            .collect()
    }

    /// Fraction of each window's device time that went to each tenant: `[window][tenant]`.
    pub fn shares(&self, window: Nanos) -> Vec<Vec<f64>> {
        self.device_ns(window)
            .iter()
            .map(|row| {
                let total = row.iter().sum::<Nanos>().max(1) as f64;
                row.iter().map(|&t| t as f64 / total).collect()
            })
            .collect()
    }

    /// Fraction of tenant `i`'s device time in all device time from `from` on.
    pub fn share_since(&self, i: usize, from: Nanos) -> f64 {
        let clip = |b: &Busy| b.end.saturating_sub(b.start.max(from));
        let total: Nanos = self.busy.iter().map(clip).sum();
        let mine: Nanos = self.busy.iter().filter(|b| b.tenant == i).map(clip).sum();
        mine as f64 / total.max(1) as f64
    }

    /// Fraction of the run the device spent on kernels.
    pub fn utilization(&self) -> f64 {
        let busy: Nanos = self
            .busy
            .iter()
            .map(|b| b.end.min(self.duration).saturating_sub(b.start))
            .sum();
        busy as f64 / self.duration.max(1) as f64
    }
}

/// Runs the simulation.
pub fn run(cfg: &SimConfig) -> SimReport {
    Sim::new(cfg).run()
}

/// Two always-busy tenants with kernels of `a` and `b` ns for `duration` under `kind`:
/// unfairness over 500 ms and 1 s windows and utilization (the AvA §5.6.5 experiment).
pub fn two_tenant_fairness(kind: PolicyKind, a: Nanos, b: Nanos, duration: Nanos) -> Fairness {
    fairness(
        kind,
        [SimTenant::busy(1, a), SimTenant::busy(2, b)],
        duration,
    )
}

/// Unfairness between two scripted tenants over 500 ms and 1 s windows, and utilization.
pub fn fairness(kind: PolicyKind, tenants: [SimTenant; 2], duration: Nanos) -> Fairness {
    let report = run(&SimConfig::new(kind, duration, tenants.to_vec()));
    Fairness {
        kind,
        half_second: Spread::of(&report.unfairness(500 * MS, 0, 1)),
        second: Spread::of(&report.unfairness(1000 * MS, 0, 1)),
        utilization: report.utilization(),
    }
}

/// Result of [`fairness`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fairness {
    pub kind: PolicyKind,
    pub half_second: Spread,
    pub second: Spread,
    pub utilization: f64,
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    index: BTreeMap<TenantId, usize>,
    /// Pending submissions: time → tenant indices.
    submissions: BTreeMap<Nanos, Vec<usize>>,
    cursor: Vec<usize>,
    queued: Vec<u32>,
    running: Vec<bool>,
    /// Since when each tenant has had a command ready and the device free of its own kernel.
    pending_since: Vec<Option<Nanos>>,
    longest: Vec<Nanos>,
    capped: Vec<bool>,
    busy: Vec<Busy>,
    stalls: Vec<Stall>,
    changes: VecDeque<ParamChange>,
}

impl<'a> Sim<'a> {
    fn new(cfg: &'a SimConfig) -> Self {
        let n = cfg.tenants.len();
        let mut changes: Vec<ParamChange> = cfg.changes.clone();
        changes.sort_by_key(|c| c.at);
        Self {
            cfg,
            index: cfg
                .tenants
                .iter()
                .enumerate()
                .map(|(i, t)| (t.id, i))
                .collect(),
            submissions: BTreeMap::new(),
            cursor: vec![0; n],
            queued: vec![0; n],
            running: vec![false; n],
            pending_since: vec![None; n],
            longest: vec![0; n],
            capped: cfg.tenants.iter().map(|t| t.params.cap.is_some()).collect(),
            busy: Vec::new(),
            stalls: Vec::new(),
            changes: changes.into(),
        }
    }

    fn schedule_submit(&mut self, i: usize, at: Nanos) {
        if let Some(at) = self.cfg.tenants[i].next_on(at) {
            self.submissions.entry(at).or_default().push(i);
        }
    }

    fn run(mut self) -> SimReport {
        let mut sched = new_scheduler(self.cfg.kind, &self.cfg.sched);
        for (i, t) in self.cfg.tenants.iter().enumerate() {
            sched.add_tenant(t.id, &t.params, 0);
            (0..t.depth.max(1)).for_each(|_| self.schedule_submit(i, 0));
        }
        // The kernel on the device: (tenant index, completion time, device ns).
        let mut device: Option<(usize, Nanos, Nanos)> = None;
        let mut last_tenant: Option<usize> = None;
        let mut wake: Option<Nanos> = None;
        let mut now: Nanos = 0;
        loop {
            if let Some((i, end, ns)) = device.filter(|d| d.1 <= now) {
                sched.complete(self.cfg.tenants[i].id, ns, end);
                self.running[i] = false;
                if self.queued[i] > 0 {
                    self.pending_since[i] = Some(end);
                }
                device = None;
                self.schedule_submit(i, end + self.cfg.tenants[i].think);
            }
            while let Some(c) = self.changes.front().filter(|c| c.at <= now).cloned() {
                self.changes.pop_front();
                sched.set_params(c.tenant, &c.params, now);
                if let Some(&i) = self.index.get(&c.tenant) {
                    self.capped[i] = c.params.cap.is_some();
                }
            }
            let due: Vec<Nanos> = self.submissions.range(..=now).map(|(t, _)| *t).collect();
            for at in due {
                for i in self.submissions.remove(&at).unwrap_or_default() {
                    sched.submit(self.cfg.tenants[i].id, now);
                    self.queued[i] += 1;
                    if !self.running[i] && self.pending_since[i].is_none() {
                        self.pending_since[i] = Some(now);
                    }
                }
            }
            if device.is_none() {
                wake = None;
                match sched.pick(now) {
                    Decision::Run(id) => {
                        let i = self.index[&id];
                        let tenant = &self.cfg.tenants[i];
                        let ns = tenant
                            .kernels
                            .get(self.cursor[i] % tenant.kernels.len().max(1))
                            .copied()
                            .unwrap_or(MS);
                        self.cursor[i] += 1;
                        self.queued[i] = self.queued[i].saturating_sub(1);
                        self.running[i] = true;
                        if let Some(since) = self.pending_since[i].take() {
                            self.longest[i] = self.longest[i].max(now - since);
                        }
                        let switch = if last_tenant.is_some_and(|l| l != i) {
                            self.cfg.switch_ns
                        } else {
                            0
                        };
                        last_tenant = Some(i);
                        let start = now + switch;
                        self.busy.push(Busy {
                            tenant: i,
                            start,
                            end: start + ns,
                        });
                        device = Some((i, start + ns, ns));
                    }
                    Decision::Wait { until } => {
                        self.note_stall(now, Some(until.saturating_sub(now)));
                        wake = Some(until.max(now + 1));
                    }
                    Decision::Idle => self.note_stall(now, None),
                }
            }
            let next = [
                device.map(|d| d.1),
                self.submissions.keys().next().copied(),
                self.changes.front().map(|c| c.at),
                wake,
            ]
            .into_iter()
            .flatten()
            .min();
            match next {
                Some(t) if t <= self.cfg.duration => now = t.max(now),
                _ => break,
            }
        }
        let charged = self
            .cfg
            .tenants
            .iter()
            .map(|t| sched.stats(t.id).map_or(0, |s| s.charged_ns))
            .collect();
        SimReport {
            tenants: self.cfg.tenants.iter().map(|t| t.id).collect(),
            duration: self.cfg.duration,
            busy: self.busy,
            charged,
            longest_starvation: self.longest,
            stalls: self.stalls,
        }
    }

    fn note_stall(&mut self, at: Nanos, wait: Option<Nanos>) {
        let uncapped_waiting =
            (0..self.queued.len()).any(|i| self.queued[i] > 0 && !self.capped[i]);
        if uncapped_waiting {
            self.stalls.push(Stall { at, wait });
        }
    }
}
