//! The router: the mediator between tenants and their API servers. It accepts guest
//! connections on a Unix socket, identifies each tenant by the kernel's peer credentials,
//! spawns and supervises one API server per tenant process, forwards every frame (validating
//! what guests send), charges calls, bytes and device time to the tenant, fails a tenant's
//! calls with the API's own error when its server dies, and answers a JSON control API on
//! `<socket>.ctl` ([`ctl::Request`]). Kernel launches pass the device's [`Dispatcher`],
//! which asks the configured scheduling policy whose command goes next and stops a tenant
//! whose command runs past its `kernel_timeout`. Allocations are charged against each
//! tenant's device-memory quota and the device's capacity before they are forwarded
//! (`memory`), and refused with the API's own error past either. Metrics are also served
//! over HTTP (`metrics_addr`, `GET /metrics`).
//!
//! Unsafe code is limited to process supervision (`pre_exec`, `waitid`, `kill`).

mod config;
pub mod ctl;
pub mod dispatch;
mod http;
mod memory;
mod metrics;
mod router;
mod supervise;
pub mod swap;

pub use config::{
    default_socket_path, parse_duration, Config, MemoryConfig, SchedulerConfig, SpawnMode,
    TenantPatch, TenantSettings, DEFAULT_KERNEL_TIMEOUT, SERVER_GRACE,
};
pub use ctl::{ctl_path, request, Client, Request, Response};
pub use dispatch::{DeviceStats, Dispatcher, SchedView, TenantSched};
pub use memory::{format_size, parse_size};
pub use metrics::{prometheus, prometheus_memory, prometheus_with_device};
pub use metrics::{MemoryStats, TenantMetrics, TenantStats};
pub use router::{serve, start, Handle};

use std::path::PathBuf;

/// Errors of the router.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The configuration file could not be read.
    #[error("cannot read {path}")]
    ReadConfig {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The configuration file is not valid TOML for [`Config`].
    #[error("cannot parse configuration")]
    ParseConfig(#[from] toml::de::Error),
    /// A socket operation failed.
    #[error("transport failure")]
    Transport(#[from] hira_transport::Error),
    /// A system call failed.
    #[error("I/O failure")]
    Io(#[from] std::io::Error),
    /// The API server could not be started.
    #[error("cannot spawn API server {exe}")]
    Spawn {
        exe: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A control-API message could not be encoded or decoded.
    #[error("bad control message")]
    Json(#[from] serde_json::Error),
    /// The control API answered with an error.
    #[error("router refused: {0}")]
    Refused(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
