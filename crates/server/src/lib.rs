//! The per-tenant API server: one process per tenant, executing that tenant's calls with the
//! vendor's OpenCL library (loaded at run time). It keeps the tenant's handle table (a tenant
//! names only objects it created), runs one shadow thread per guest connection (a guest
//! thread's calls run in order on one server thread), delivers callbacks, and measures device
//! time from profiling events. It trusts nothing it receives.
#![allow(non_snake_case)]

mod arena;
mod ctx;
mod custom;
mod direct;
mod expr;
mod fence;
mod serve;
mod svm;
mod swap;

pub use ctx::{Ctx, Fail, Shared};
pub use serve::{main_from_env, serve_control};

#[allow(clippy::all, clippy::undocumented_unsafe_blocks, missing_docs)]
mod generated {
    use crate::ctx::{Ctx, Fail};
    use crate::hira_spec_callback::CallbackKind;
    use crate::{custom, expr};
    use hira_opencl::cl::*;
    use hira_opencl::*;
    use hira_wire::{Reader, Writer};
    use std::ffi::c_void;
    include!(concat!(env!("OUT_DIR"), "/server.rs"));
}
pub use generated::{dispatch, Api};

/// Callback kinds as the generated code names them.
pub mod hira_spec_callback {
    pub use crate::ctx::CallbackKind;
}
