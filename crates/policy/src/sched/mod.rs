//! Device-time schedulers: which tenant's next command goes to the (non-preemptive) device.
//!
//! Every policy is a pure state machine over a clock the caller injects (`now`), fed with
//! the router's events: a tenant has one more command ready (`submit`), the device is free
//! (`pick`), a command finished after `device_ns` of measured device time (`complete`).
//! Time the router spends switching between tenants is never charged to a tenant
//! (DymGPU §4.5); only the device time the device itself reports is.
//!
//! | kind | source | idea |
//! | --- | --- | --- |
//! | `fifo` | GPUvm §5.3 | submission order across tenants |
//! | `rr` | Pegasus §4 | one command per tenant in turn |
//! | `credit` | GPUvm §5.3 | credits replenished per period by weight, charged by device time, highest credit first |
//! | `band` | GPUvm §3.5 | CREDIT, plus: exhausted tenants go last, a short wait after a completion, scheduler overhead counted |
//! | `accc` | Pegasus §4.1 | credits → ticks; each tenant in turn runs for its ticks of device time |
//! | `slaf` | Pegasus §4.3 | AccC plus SLO feedback: a tenant short of its SLO gets extra ticks and goes first |
//! | `wfq` | AvA §5.5.2.2 | weighted fair queuing on measured device time |
//! | `wfq-fixed` | AvA §5.5.2.2 | WFQ, caps enforced by fixed-rate polling over a sliding window |
//! | `wfq-aimd` | AvA §5.5.2.2 | WFQ with a per-tenant allowance adapted by AIMD |
//!
//! A tenant's `cap` limits it under every policy: it gets no more than `cap` of each window
//! plus the one kernel that was running when the budget ran out (kernels are not preemptible).
//! The [`sim`] module is a fake device with scripted kernel times, for tests and benchmarks.

mod accc;
mod core;
mod credit;
mod fifo;
mod rr;
pub mod sim;
mod wfq;

#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;

/// A tenant as the router names it.
pub type TenantId = u64;
/// Monotonic time in nanoseconds, supplied by the caller.
pub type Nanos = u64;

/// One millisecond in [`Nanos`].
pub const MS: Nanos = 1_000_000;
/// One microsecond in [`Nanos`].
pub const US: Nanos = 1_000;

/// Errors of the scheduler module.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SchedError {
    /// A policy name that is not one of [`PolicyKind::ALL`].
    #[error("unknown scheduling policy {0:?}")]
    UnknownPolicy(String),
    /// An interval of the configuration is zero.
    #[error("scheduler interval {0} must be positive")]
    ZeroInterval(&'static str),
    /// Tenant parameters out of range.
    #[error("invalid tenant parameters: {0}")]
    InvalidParams(&'static str),
}

/// Result of this module.
pub type Result<T> = std::result::Result<T, SchedError>;

/// What a tenant is entitled to.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TenantParams {
    /// Share weight (and AccC/SLAF credits); 0 is treated as 1.
    pub weight: u32,
    /// Most device-seconds per second the tenant may use, whatever the policy, e.g. 0.25.
    pub cap: Option<f64>,
    /// Higher runs first where a policy uses priority (FIFO and RR tie-break).
    pub priority: i32,
    /// Promised device-seconds per second while the tenant has work (SLAF), e.g. 0.5.
    pub slo: Option<f64>,
}

impl Default for TenantParams {
    fn default() -> Self {
        Self {
            weight: 1,
            cap: None,
            priority: 0,
            slo: None,
        }
    }
}

impl TenantParams {
    /// Parameters with the given weight and defaults otherwise.
    pub fn weighted(weight: u32) -> Self {
        Self {
            weight,
            ..Self::default()
        }
    }

    /// Checks the ranges: `cap` and `slo` within (0, 1].
    pub fn validate(&self) -> Result<()> {
        let in_range = |x: Option<f64>| x.is_none_or(|v| v.is_finite() && v > 0.0 && v <= 1.0);
        if !in_range(self.cap) {
            return Err(SchedError::InvalidParams("cap must be within (0, 1]"));
        }
        if !in_range(self.slo) {
            return Err(SchedError::InvalidParams("slo must be within (0, 1]"));
        }
        Ok(())
    }

    /// The weight, never 0.
    pub(crate) fn weight(&self) -> u64 {
        u64::from(self.weight.max(1))
    }
}

/// The scheduler's answer when the device is free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Dispatch the next command of this tenant now.
    Run(TenantId),
    /// Work exists but nobody may run yet; ask again at `until` (or when something changes).
    Wait {
        /// When to call `pick` again at the latest.
        until: Nanos,
    },
    /// Nothing is queued.
    Idle,
}

/// Per-tenant view for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TenantSchedStats {
    /// Device time charged so far.
    pub charged_ns: Nanos,
    /// Time the tenant had work but was held back by its cap.
    pub throttled_ns: Nanos,
    /// Commands submitted and not yet dispatched.
    pub queued: u32,
    /// Commands dispatched and not yet completed.
    pub running: u32,
    /// Policy balance in ns: CREDIT/BAND credit, AccC/SLAF slice left or debt,
    /// WFQ-AIMD allowance left in the window; 0 where the policy has none.
    pub credit_ns: i64,
    /// WFQ virtual time in weighted ns (device ns divided by weight); 0 for other policies.
    pub virtual_ns: u64,
}

/// A device-time scheduling policy.
pub trait Scheduler: Send {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;
    /// Admits tenant `t` (again: replaces its parameters).
    fn add_tenant(&mut self, t: TenantId, p: &TenantParams, now: Nanos);
    /// Forgets tenant `t`, including its queued commands.
    fn remove_tenant(&mut self, t: TenantId, now: Nanos);
    /// Live change of parameters, effective within one window.
    fn set_params(&mut self, t: TenantId, p: &TenantParams, now: Nanos);
    /// Tenant t has one more command ready (commands of a tenant run in order).
    fn submit(&mut self, t: TenantId, now: Nanos);
    /// The device is free: which tenant's next command goes now? `Wait{until}` when work
    /// exists but everyone eligible is throttled (cap) or the policy deliberately waits
    /// (BAND's short wait after a completion); `Idle` when nothing is queued.
    fn pick(&mut self, now: Nanos) -> Decision;
    /// The dispatched command of t finished, having used `device_ns` of device time
    /// (measured by the device). Time the router spent switching between tenants is not
    /// included and never charged.
    fn complete(&mut self, t: TenantId, device_ns: Nanos, now: Nanos);
    /// Per-tenant view for metrics.
    fn stats(&self, t: TenantId) -> Option<TenantSchedStats>;
}

/// The scheduling policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// Submission order across tenants (GPUvm FIFO).
    Fifo,
    /// One command per tenant in turn (Pegasus RR).
    RoundRobin,
    /// Proportional credits, highest credit first (GPUvm CREDIT).
    Credit,
    /// Bandwidth-aware non-preemptive device scheduling (GPUvm BAND).
    Band,
    /// Accelerator credits converted to ticks (Pegasus AccC).
    AccC,
    /// AccC with SLO feedback (Pegasus SLAF).
    Slaf,
    /// Weighted fair queuing on device time (AvA).
    Wfq,
    /// WFQ with caps enforced by fixed-rate polling (AvA).
    WfqFixedRate,
    /// WFQ with an AIMD-adapted rate limit (AvA).
    WfqAimd,
}

impl PolicyKind {
    /// Every policy, in the order of the table above.
    pub const ALL: [PolicyKind; 9] = [
        PolicyKind::Fifo,
        PolicyKind::RoundRobin,
        PolicyKind::Credit,
        PolicyKind::Band,
        PolicyKind::AccC,
        PolicyKind::Slaf,
        PolicyKind::Wfq,
        PolicyKind::WfqFixedRate,
        PolicyKind::WfqAimd,
    ];

    /// The short name used on the command line and in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Fifo => "fifo",
            PolicyKind::RoundRobin => "rr",
            PolicyKind::Credit => "credit",
            PolicyKind::Band => "band",
            PolicyKind::AccC => "accc",
            PolicyKind::Slaf => "slaf",
            PolicyKind::Wfq => "wfq",
            PolicyKind::WfqFixedRate => "wfq-fixed",
            PolicyKind::WfqAimd => "wfq-aimd",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = SchedError;

    fn from_str(s: &str) -> Result<Self> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| SchedError::UnknownPolicy(s.to_owned()))
    }
}

/// Intervals of the policies.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SchedConfig {
    /// CREDIT/BAND replenish period, and the window of the `cap` budget (100 ms).
    pub period: Nanos,
    /// BAND's wait after a completion, for a tenant under its bandwidth to submit (500 µs).
    pub band_wait: Nanos,
    /// AccC/SLAF tick: a tenant with the least credits runs this much device time per turn (10 ms).
    pub tick: Nanos,
    /// SLAF's evaluation window for SLO violations (500 ms).
    pub slo_window: Nanos,
    /// AvA's scheduling window: WFQ-fixed's sliding cap window and WFQ-AIMD's window (500 ms).
    pub window: Nanos,
    /// WFQ-fixed's polling delay for a tenant over its cap (AvA's p = 5 ms).
    pub poll: Nanos,
    /// WFQ-AIMD's additive increase per window (AvA's a = 1 ms); the decrease halves.
    pub aimd_step: Nanos,
}

impl Default for SchedConfig {
    fn default() -> Self {
        Self {
            period: 100 * MS,
            band_wait: 500 * US,
            tick: 10 * MS,
            slo_window: 500 * MS,
            window: 500 * MS,
            poll: 5 * MS,
            aimd_step: MS,
        }
    }
}

impl SchedConfig {
    /// Checks that every interval is positive.
    pub fn validate(&self) -> Result<()> {
        let intervals = [
            ("period", self.period),
            ("tick", self.tick),
            ("slo_window", self.slo_window),
            ("window", self.window),
            ("poll", self.poll),
        ];
        match intervals.iter().find(|(_, v)| *v == 0) {
            Some((name, _)) => Err(SchedError::ZeroInterval(name)),
            None => Ok(()),
        }
    }

    /// The configuration with every zero interval raised to its default, so that no policy
    /// divides by zero whatever it is given.
    fn sanitized(&self) -> Self {
        let d = Self::default();
        let pos = |v: Nanos, dflt: Nanos| if v == 0 { dflt } else { v };
        Self {
            period: pos(self.period, d.period),
            band_wait: self.band_wait,
            tick: pos(self.tick, d.tick),
            slo_window: pos(self.slo_window, d.slo_window),
            window: pos(self.window, d.window),
            poll: pos(self.poll, d.poll),
            aimd_step: self.aimd_step,
        }
    }
}

/// A scheduler of the given kind.
pub fn new_scheduler(kind: PolicyKind, cfg: &SchedConfig) -> Box<dyn Scheduler> {
    let cfg = cfg.sanitized();
    let window_cap = core::CapMode::Window { window: cfg.period };
    match kind {
        PolicyKind::Fifo => Box::new(core::Engine::new(fifo::Fifo::default(), window_cap)),
        PolicyKind::RoundRobin => {
            Box::new(core::Engine::new(rr::RoundRobin::default(), window_cap))
        }
        PolicyKind::Credit => Box::new(core::Engine::new(
            credit::Credit::new(&cfg, false),
            window_cap,
        )),
        PolicyKind::Band => Box::new(core::Engine::new(
            credit::Credit::new(&cfg, true),
            window_cap,
        )),
        PolicyKind::AccC => Box::new(core::Engine::new(accc::AccC::new(&cfg, false), window_cap)),
        PolicyKind::Slaf => Box::new(core::Engine::new(accc::AccC::new(&cfg, true), window_cap)),
        PolicyKind::Wfq => Box::new(core::Engine::new(wfq::Wfq::new(&cfg, kind), window_cap)),
        PolicyKind::WfqFixedRate => {
            let polling = core::CapMode::Polling {
                window: cfg.window,
                poll: cfg.poll,
            };
            Box::new(core::Engine::new(wfq::Wfq::new(&cfg, kind), polling))
        }
        PolicyKind::WfqAimd => Box::new(core::Engine::new(wfq::Wfq::new(&cfg, kind), window_cap)),
    }
}
