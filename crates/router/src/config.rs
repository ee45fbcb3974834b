//! The router's configuration: one serde struct, filled from TOML or the command line.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use std::collections::BTreeMap;

use hira_policy::mem::PlacementAlgo;
use hira_policy::sched::{PolicyKind, SchedConfig, TenantParams};
use hira_transport::Conn;
use serde::{Deserialize, Serialize};

use crate::dispatch::TenantSched;

use crate::{Error, Result};

/// How long a retiring API server may take to exit before it is killed.
pub const SERVER_GRACE: Duration = Duration::from_secs(2);

/// How a tenant's API server is started.
#[derive(Clone, Default)]
pub enum SpawnMode {
    /// `<server_exe> server` as a child process, its control socket as fd 3.
    #[default]
    Process,
    /// Call the function on a new thread with the server end of the control socket (tests,
    /// embedding). Its death is noticed when it closes the control socket.
    InProcess(Arc<dyn Fn(Conn) + Send + Sync>),
}

impl fmt::Debug for SpawnMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpawnMode::Process => f.write_str("Process"),
            SpawnMode::InProcess(_) => f.write_str("InProcess(..)"),
        }
    }
}

/// Router configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Socket guests connect to; the control API listens on `<socket>.ctl`.
    pub socket: PathBuf,
    /// `OCL_ICD_VENDORS` for API servers; unset means removed from their environment, so
    /// they see the host's platforms from `/etc/OpenCL/vendors`.
    pub vendors: Option<String>,
    /// Executable run as `<server_exe> server`; default: the current executable.
    pub server_exe: Option<PathBuf>,
    /// Exit once no tenant (and no control client) has been connected for this long.
    /// In TOML: `"5s"`, `"500ms"`, `"2m"` or a number of seconds.
    #[serde(with = "opt_duration")]
    pub idle_exit: Option<Duration>,
    /// Log filter (`tracing` env-filter syntax) used when `RUST_LOG` is unset.
    pub log: Option<String>,
    /// Device-time scheduling (`[scheduler]`).
    pub scheduler: SchedulerConfig,
    /// Device memory: default quota, capacity, over-commit (`[memory]`).
    pub memory: MemoryConfig,
    /// Per-tenant settings keyed by command name (`/proc/<pid>/comm`), e.g.
    /// `[tenants.python] weight = 2`; `[tenants.default]` applies to every other command.
    pub tenants: BTreeMap<String, TenantSettings>,
    /// Serve Prometheus metrics over HTTP on this address (`GET /metrics`), e.g.
    /// `"127.0.0.1:9464"`.
    pub metrics_addr: Option<String>,
    /// How servers are started (not settable from a file).
    #[serde(skip)]
    pub spawn: SpawnMode,
    /// Tests only: identify the tenant by the pid in HELLO instead of the socket's peer
    /// credentials. Never set in production: a guest could pose as another tenant.
    #[serde(skip)]
    pub tenant_by_hello_pid: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            socket: default_socket_path(),
            vendors: None,
            server_exe: None,
            idle_exit: None,
            log: None,
            scheduler: SchedulerConfig::default(),
            memory: MemoryConfig::default(),
            tenants: BTreeMap::new(),
            metrics_addr: None,
            spawn: SpawnMode::Process,
            tenant_by_hello_pid: false,
        }
    }
}

impl Config {
    /// Parses TOML text; call [`Config::validate`] afterwards.
    pub fn parse(text: &str) -> Result<Config> {
        Ok(toml::from_str(text)?)
    }

    /// Reads and parses a TOML file; call [`Config::validate`] afterwards.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::ReadConfig {
            path: path.to_owned(),
            source,
        })?;
        Config::parse(&text)
    }

    /// Checks values that parse but cannot work.
    pub fn validate(&self) -> Result<()> {
        let len = self.socket.as_os_str().len();
        if len == 0 {
            return Err(Error::Config("socket path is empty".into()));
        }
        // sun_path holds 108 bytes including the NUL; the control socket adds ".ctl".
        if len + ".ctl".len() >= 108 {
            return Err(Error::Config(format!(
                "socket path {} is too long for a Unix socket",
                self.socket.display()
            )));
        }
        if self.idle_exit == Some(Duration::ZERO) {
            return Err(Error::Config("idle_exit must be positive".into()));
        }
        self.scheduler.kind()?;
        self.scheduler
            .knobs
            .validate()
            .map_err(|e| Error::Config(e.to_string()))?;
        if self.scheduler.max_inflight == 0 {
            return Err(Error::Config(
                "scheduler.max_inflight must be positive".into(),
            ));
        }
        self.memory.validate()?;
        for (name, t) in &self.tenants {
            t.params
                .validate()
                .map_err(|e| Error::Config(format!("tenants.{name}: {e}")))?;
        }
        if let Some(addr) = &self.metrics_addr {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                return Err(Error::Config(format!(
                    "metrics_addr {addr:?} is not host:port"
                )));
            }
        }
        if let Some(exe) = &self.server_exe {
            if !exe.is_file() {
                return Err(Error::Config(format!(
                    "server_exe {} is not a file",
                    exe.display()
                )));
            }
        }
        Ok(())
    }
}

/// Default longest run of one device-time command before its tenant is stopped.
pub const DEFAULT_KERNEL_TIMEOUT: Duration = Duration::from_secs(10);

/// `[scheduler]`: the device's policy and its knobs.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// One of fifo, rr, credit, band, accc, slaf, wfq, wfq-fixed, wfq-aimd.
    pub policy: String,
    /// Device-time commands dispatched and not yet done, at most (≥ 1). Default 4: on
    /// PoCL (CPU) a kernel's DONE reaches the router a few hundred µs after it ended, and
    /// with 2 a lone tenant of 1 ms kernels kept only 85 % of its throughput (4: 97.7 %).
    pub max_inflight: u32,
    /// Default longest run of one command before its tenant is stopped (`"10s"`).
    #[serde(with = "duration")]
    pub kernel_timeout: Duration,
    /// The policies' intervals, in ns (`period`, `band_wait`, `tick`, `slo_window`,
    /// `window`, `poll`, `aimd_step`).
    #[serde(flatten)]
    pub knobs: SchedConfig,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            policy: "fifo".into(),
            max_inflight: 4,
            kernel_timeout: DEFAULT_KERNEL_TIMEOUT,
            knobs: SchedConfig::default(),
        }
    }
}

impl SchedulerConfig {
    /// The policy, parsed.
    pub fn kind(&self) -> Result<PolicyKind> {
        self.policy
            .parse()
            .map_err(|e: hira_policy::sched::SchedError| Error::Config(e.to_string()))
    }
}

/// `[memory]`: device-memory quotas and the device's capacity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// Quota of every tenant without its own `memory_quota` (`"256MiB"`; `"none"` or 0:
    /// no quota). Default: none.
    #[serde(with = "opt_size")]
    pub quota: Option<u64>,
    /// Device memory all tenants together may hold (`"4GiB"`), before `overcommit`.
    /// Default: unlimited (the real device still refuses what it cannot hold).
    #[serde(with = "opt_size")]
    pub capacity: Option<u64>,
    /// Tenants together may hold `capacity × overcommit` (default 1.0). Above 1.0 (with a
    /// `capacity`) the router over-subscribes: buffers of descheduled tenants are swapped
    /// to host memory so that resident buffers never exceed `capacity`.
    pub overcommit: f64,
    /// Slots the capacity is cut into for placement (default 16).
    pub slots: usize,
    /// Placement algorithm: `lls` (gVirt/gScale leftmost-lowest-score), `size` or `util`
    /// (DymGPU Algorithms 1 and 2). Default `util`.
    pub placement: PlacementAlgo,
    /// A tenant without device work for this long counts as absent for placement (default
    /// 20 s).
    #[serde(with = "duration")]
    pub idle_after: Duration,
    /// Tenants are placed again this often, from utilization averaged over the period
    /// (default 20 s).
    #[serde(with = "duration")]
    pub replace_every: Duration,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            quota: None,
            capacity: None,
            overcommit: 1.0,
            slots: 16,
            placement: PlacementAlgo::UtilizationBased,
            idle_after: Duration::from_secs(20),
            replace_every: Duration::from_secs(20),
        }
    }
}

impl MemoryConfig {
    fn validate(&self) -> Result<()> {
        if !self.overcommit.is_finite() || self.overcommit <= 0.0 {
            return Err(Error::Config(
                "memory.overcommit must be a positive number".into(),
            ));
        }
        if self.capacity == Some(0) {
            return Err(Error::Config("memory.capacity must be positive".into()));
        }
        if self.overcommit > 1.0 && self.capacity.is_none() {
            return Err(Error::Config(
                "memory.overcommit above 1 needs memory.capacity".into(),
            ));
        }
        if self.slots == 0 || self.capacity.is_some_and(|c| c < self.slots as u64) {
            return Err(Error::Config(
                "memory.slots must be between 1 and the capacity in bytes".into(),
            ));
        }
        if self.idle_after.is_zero() || self.replace_every.is_zero() {
            return Err(Error::Config(
                "memory.idle_after and memory.replace_every must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// A tenant's entitlement: `weight`, `cap`, `priority`, `slo`, `kernel_timeout` and
/// `memory_quota`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantSettings {
    #[serde(flatten)]
    pub params: TenantParams,
    /// Longest run of one command; default: `scheduler.kernel_timeout`.
    #[serde(with = "opt_duration")]
    pub kernel_timeout: Option<Duration>,
    /// Device-memory quota (`"64MiB"`; `"none"` or 0: none); default: `memory.quota`.
    #[serde(with = "opt_size")]
    pub memory_quota: Option<u64>,
}

/// A partial change of a tenant's settings (control API, `hira run` flags).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantPatch {
    pub weight: Option<u32>,
    /// A cap ≤ 0 removes the cap.
    pub cap: Option<f64>,
    pub priority: Option<i32>,
    /// An SLO ≤ 0 removes the SLO.
    pub slo: Option<f64>,
    pub kernel_timeout_ms: Option<u64>,
    /// Device-memory quota in bytes; 0 removes the quota.
    pub memory_quota: Option<u64>,
}

impl TenantPatch {
    /// Parses `key=value` words: `weight=2 cap=0.5 priority=1 slo=0.3 kernel_timeout=5s
    /// memory_quota=64MiB` (`cap=none`, `slo=none`, `memory_quota=none` remove them).
    pub fn parse_words<S: AsRef<str>>(words: &[S]) -> Result<TenantPatch> {
        let mut p = TenantPatch::default();
        for w in words {
            let w = w.as_ref();
            let (k, v) = w
                .split_once('=')
                .ok_or_else(|| Error::Config(format!("expected key=value, got {w:?}")))?;
            let bad = || Error::Config(format!("bad value for {k}: {v:?}"));
            let frac = |v: &str| -> Result<f64> {
                if v == "none" {
                    return Ok(0.0);
                }
                v.parse().map_err(|_| bad())
            };
            match k {
                "weight" => p.weight = Some(v.parse().map_err(|_| bad())?),
                "cap" => p.cap = Some(frac(v)?),
                "priority" => p.priority = Some(v.parse().map_err(|_| bad())?),
                "slo" => p.slo = Some(frac(v)?),
                "kernel_timeout" | "kernel-timeout" => {
                    p.kernel_timeout_ms =
                        Some(parse_duration(v).ok_or_else(bad)?.as_millis() as u64)
                }
                "memory_quota" | "memory-quota" => {
                    p.memory_quota = Some(match v {
                        "none" => 0,
                        v => crate::memory::parse_size(v).ok_or_else(bad)?,
                    })
                }
                _ => return Err(Error::Config(format!("unknown tenant setting {k:?}"))),
            }
        }
        Ok(p)
    }

    /// Whether the patch changes any scheduling setting (anything but `memory_quota`).
    pub fn touches_sched(&self) -> bool {
        let TenantPatch {
            weight,
            cap,
            priority,
            slo,
            kernel_timeout_ms,
            memory_quota: _,
        } = self;
        weight.is_some()
            || cap.is_some()
            || priority.is_some()
            || slo.is_some()
            || kernel_timeout_ms.is_some()
    }

    /// Applies the scheduling part of the patch; the result is validated.
    pub fn apply(&self, s: &mut TenantSched) -> Result<()> {
        let mut n = s.clone();
        let opt = |v: f64| (v > 0.0).then_some(v);
        if let Some(w) = self.weight {
            n.params.weight = w;
        }
        if let Some(c) = self.cap {
            n.params.cap = opt(c);
        }
        if let Some(p) = self.priority {
            n.params.priority = p;
        }
        if let Some(v) = self.slo {
            n.params.slo = opt(v);
        }
        if let Some(ms) = self.kernel_timeout_ms {
            n.kernel_timeout = Duration::from_millis(ms);
        }
        n.params
            .validate()
            .map_err(|e| Error::Config(e.to_string()))?;
        *s = n;
        Ok(())
    }
}

impl Config {
    /// The configured settings of a tenant running `command`.
    pub fn tenant_settings(&self, command: &str) -> TenantSched {
        let t = self
            .tenants
            .get(command)
            .or_else(|| self.tenants.get("default"));
        TenantSched {
            params: t.map(|t| t.params.clone()).unwrap_or_default(),
            kernel_timeout: t
                .and_then(|t| t.kernel_timeout)
                .unwrap_or(self.scheduler.kernel_timeout),
        }
    }
}

impl Config {
    /// The configured device-memory quota of a tenant running `command`: its
    /// `[tenants.<command>] memory_quota`, else `[tenants.default]`'s, else
    /// `memory.quota`; None (or an explicit 0) means no quota.
    pub fn memory_quota(&self, command: &str) -> Option<u64> {
        let own = |name: &str| self.tenants.get(name).and_then(|t| t.memory_quota);
        own(command)
            .or_else(|| own("default"))
            .or(self.memory.quota)
            .filter(|&q| q > 0)
    }
}

/// `/tmp/hira-<uid>/router.sock`.
pub fn default_socket_path() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    PathBuf::from(format!("/tmp/hira-{uid}/router.sock"))
}

/// Parses `"500ms"`, `"5s"`, `"2m"`, `"1h"` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    match unit.trim() {
        "" | "s" => Some(Duration::from_secs(n)),
        "ms" => Some(Duration::from_millis(n)),
        "m" | "min" => n.checked_mul(60).map(Duration::from_secs),
        "h" => n.checked_mul(3600).map(Duration::from_secs),
        _ => None,
    }
}

mod duration {
    use std::time::Duration;

    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        super::opt_duration::serialize(&Some(*d), s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        super::opt_duration::deserialize(d)?
            .ok_or_else(|| serde::de::Error::custom("a duration is required"))
    }
}

mod opt_size {
    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Bytes(u64),
        Text(String),
    }

    pub fn serialize<S: Serializer>(n: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match n {
            Some(n) => s.serialize_str(&crate::memory::format_size(*n)),
            None => s.serialize_none(),
        }
    }

    /// A size in bytes: a number, or text with a unit (`"64MiB"`); `"none"` is 0.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        match Option::<Raw>::deserialize(d)? {
            None => Ok(None),
            Some(Raw::Bytes(n)) => Ok(Some(n)),
            Some(Raw::Text(t)) if t.trim() == "none" => Ok(Some(0)),
            Some(Raw::Text(t)) => crate::memory::parse_size(&t).map(Some).ok_or_else(|| {
                serde::de::Error::custom(format!("bad size {t:?} (e.g. \"64MiB\")"))
            }),
        }
    }
}

mod opt_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Secs(u64),
        Text(String),
    }

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&format!("{}ms", d.as_millis())),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match Option::<Raw>::deserialize(d)? {
            None => Ok(None),
            Some(Raw::Secs(n)) => Ok(Some(Duration::from_secs(n))),
            Some(Raw::Text(t)) => super::parse_duration(&t)
                .map(Some)
                .ok_or_else(|| serde::de::Error::custom(format!("bad duration {t:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_toml_with_durations() {
        let cfg = Config::parse(
            "socket = \"/tmp/x.sock\"\nvendors = \"/etc/OpenCL/vendors\"\nidle_exit = \"5s\"\n",
        )
        .unwrap();

        assert_eq!(cfg.socket, PathBuf::from("/tmp/x.sock"));
        assert_eq!(cfg.vendors.as_deref(), Some("/etc/OpenCL/vendors"));
        assert_eq!(cfg.idle_exit, Some(Duration::from_secs(5)));
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn scheduler_and_tenants_parse() {
        let cfg = Config::parse(
            "metrics_addr = \"127.0.0.1:9464\"\n[scheduler]\npolicy = \"wfq\"\nmax_inflight = 3\nkernel_timeout = \"2s\"\nwindow = 250000000\n[tenants.python]\nweight = 2\ncap = 0.5\n[tenants.default]\nkernel_timeout = \"500ms\"\n",
        )
        .unwrap();

        assert!(cfg.validate().is_ok());
        assert_eq!(cfg.scheduler.kind().unwrap(), PolicyKind::Wfq);
        assert_eq!(cfg.scheduler.knobs.window, 250_000_000);
        assert_eq!(cfg.tenant_settings("python").params.weight, 2);
        assert_eq!(
            cfg.tenant_settings("python").kernel_timeout,
            Duration::from_secs(2)
        );
        assert_eq!(
            cfg.tenant_settings("other").kernel_timeout,
            Duration::from_millis(500)
        );
    }

    #[test]
    fn over_subscription_settings_parse_and_are_checked() {
        let cfg = Config::parse(
            "[memory]\ncapacity = \"64MiB\"\novercommit = 3\nslots = 8\nplacement = \"lls\"\nidle_after = \"2s\"\nreplace_every = \"500ms\"\n",
        )
        .unwrap();
        assert_eq!(cfg.memory.placement, PlacementAlgo::LeftmostLowestScore);
        assert_eq!(cfg.memory.slots, 8);
        assert_eq!(cfg.memory.idle_after, Duration::from_secs(2));
        assert_eq!(cfg.memory.replace_every, Duration::from_millis(500));
        for bad in [
            "[memory]\novercommit = 2\n",
            "[memory]\ncapacity = \"1MiB\"\nslots = 0\n",
            "[memory]\nplacement = \"best\"\n",
        ] {
            assert!(
                Config::parse(bad)
                    .and_then(|c| c.memory.validate())
                    .is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn memory_quotas_parse_with_per_command_overrides() {
        let cfg = Config::parse(
            "[memory]\nquota = \"256MiB\"\ncapacity = \"4GiB\"\novercommit = 1.5\n[tenants.python]\nweight = 2\nmemory_quota = \"64MiB\"\n[tenants.free]\nmemory_quota = \"none\"\n[tenants.bytes]\nmemory_quota = 1048576\n",
        )
        .unwrap();

        assert!(cfg.validate().is_ok());
        assert_eq!(cfg.memory.capacity, Some(4 << 30));
        assert_eq!(cfg.memory.overcommit, 1.5);
        assert_eq!(cfg.memory.placement, PlacementAlgo::UtilizationBased);
        assert_eq!(cfg.memory.slots, 16);
        assert_eq!(cfg.memory_quota("python"), Some(64 << 20));
        assert_eq!(cfg.memory_quota("other"), Some(256 << 20));
        assert_eq!(cfg.memory_quota("free"), None);
        assert_eq!(cfg.memory_quota("bytes"), Some(1 << 20));
        assert_eq!(Config::default().memory_quota("x"), None);
    }

    #[test]
    fn bad_memory_settings_are_refused() {
        assert!(Config::parse("[memory]\nquota = \"64 parsecs\"\n").is_err());
        let cfg = Config::parse("[memory]\novercommit = 0.0\n").unwrap();
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn memory_quota_patch_leaves_scheduling_alone() {
        let p = TenantPatch::parse_words(&["memory_quota=64MiB"]).unwrap();
        let none = TenantPatch::parse_words(&["memory-quota=none"]).unwrap();

        assert_eq!(p.memory_quota, Some(64 << 20));
        assert!(!p.touches_sched());
        assert_eq!(none.memory_quota, Some(0));
        assert!(TenantPatch::parse_words(&["memory_quota=lots"]).is_err());
    }

    #[test]
    fn unknown_policy_is_invalid() {
        let cfg = Config::parse("[scheduler]\npolicy = \"lottery\"\n").unwrap();

        assert!(cfg.validate().is_err());
    }

    #[test]
    fn patch_words_apply() {
        let mut s = Config::default().tenant_settings("x");
        let p = TenantPatch::parse_words(&["weight=4", "cap=0.25", "kernel_timeout=3s"]).unwrap();

        p.apply(&mut s).unwrap();

        assert_eq!(s.params.weight, 4);
        assert_eq!(s.params.cap, Some(0.25));
        assert_eq!(s.kernel_timeout, Duration::from_secs(3));
    }

    #[test]
    fn patch_refuses_out_of_range_cap() {
        let mut s = Config::default().tenant_settings("x");
        let p = TenantPatch::parse_words(&["cap=1.5"]).unwrap();

        assert!(p.apply(&mut s).is_err());
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(Config::parse("sockett = \"/tmp/x\"").is_err());
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("x"), None);
        assert_eq!(parse_duration("5 parsecs"), None);
    }

    #[test]
    fn too_long_socket_is_invalid() {
        let cfg = Config {
            socket: PathBuf::from(format!("/tmp/{}", "a".repeat(120))),
            ..Config::default()
        };

        assert!(cfg.validate().is_err());
    }
}
