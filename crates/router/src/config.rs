//! The router's configuration: one serde struct, filled from TOML or the command line.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hira_transport::Conn;
use serde::{Deserialize, Serialize};

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
