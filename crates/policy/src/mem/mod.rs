//! Device-memory policy: what each tenant may allocate and where its buffers live.
//!
//! Every call that allocates or frees device memory passes through the router with its size.
//! The pieces here are pure state machines the router drives with those sizes and an injected
//! clock:
//!
//! - [`quota`]: the ledger of bytes per tenant against a per-tenant quota and a device-wide
//!   over-subscription limit, and the sizes each tenant is shown.
//! - [`placement`]: the device divided into equal slots, each tenant mapped to a contiguous
//!   run of them (gVirt's leftmost-lowest-score and DymGPU's size- and utilization-based
//!   algorithms).
//! - [`residency`]: which buffers are on the device and which were swapped to the host, and
//!   the swap plan before a tenant runs (gScale's on-demand copying at AvA's buffer
//!   granularity).
//! - [`monitor`]: DymGPU's monitor of idle tenants and averaged utilization that drives
//!   periodic re-placement.
//! - [`sim`]: a deterministic replay of DymGPU's mixed-utilization evaluation, shared with the
//!   router's benchmark.

pub mod monitor;
pub mod placement;
pub mod quota;
pub mod residency;
pub mod sim;

pub use monitor::{Monitor, MonitorConfig};
pub use placement::{
    place, same_shape, sharing_cost, Placement, PlacementAlgo, SlotRange, TenantDemand,
};
pub use quota::MemLedger;
pub use residency::{BufferInfo, Residency, SwapPlan, SwapStats};

/// Nanoseconds on the injected clock.
pub type Nanos = u64;
/// A tenant of the router.
pub type TenantId = u64;
/// A device buffer, unique across tenants.
pub type BufferId = u64;

/// Why a memory operation was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MemError {
    /// The allocation would take the tenant past its quota
    /// (the router answers `CL_MEM_OBJECT_ALLOCATION_FAILURE`).
    #[error("tenant {tenant} over quota: {used} used + {requested} requested > {quota}")]
    OverQuota {
        tenant: TenantId,
        requested: u64,
        used: u64,
        quota: u64,
    },
    /// The allocation would take the device past capacity × over-subscription ratio
    /// (the router answers `CL_OUT_OF_RESOURCES`).
    #[error("device over-committed: {committed} committed + {requested} requested > {limit}")]
    OverCommit {
        tenant: TenantId,
        requested: u64,
        committed: u64,
        limit: u64,
    },
    /// The buffer id is already in use.
    #[error("buffer {buffer} already exists")]
    DuplicateBuffer { tenant: TenantId, buffer: BufferId },
    /// The buffer does not exist or belongs to another tenant.
    #[error("tenant {tenant} has no buffer {buffer}")]
    UnknownBuffer { tenant: TenantId, buffer: BufferId },
    /// The tenant holds no slots in the current placement (it was idle or is new); re-place
    /// before running it.
    #[error("tenant {tenant} has no slots")]
    NotPlaced { tenant: TenantId },
    /// The buffer does not fit in the tenant's slots.
    #[error("buffer {buffer} of {bytes} bytes does not fit in the slots of tenant {tenant}")]
    NoRoom {
        tenant: TenantId,
        buffer: BufferId,
        bytes: u64,
    },
    /// A configuration value is out of range.
    #[error("invalid memory configuration: {0}")]
    InvalidConfig(&'static str),
}

impl MemError {
    /// Whether the tenant caused this (answered with an OpenCL error code and charged to it)
    /// rather than the router's own state or configuration.
    pub fn is_tenant_fault(&self) -> bool {
        match self {
            MemError::OverQuota { .. }
            | MemError::DuplicateBuffer { .. }
            | MemError::UnknownBuffer { .. }
            | MemError::NoRoom { .. } => true,
            MemError::OverCommit { .. }
            | MemError::NotPlaced { .. }
            | MemError::InvalidConfig(_) => false,
        }
    }
}

/// Result of a memory-policy operation.
pub type Result<T> = std::result::Result<T, MemError>;
