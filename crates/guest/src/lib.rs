//! hira's guest library: an OpenCL ICD (`libhira_opencl.so`) that the standard ICD loader
//! finds through `OCL_ICD_VENDORS`. Every API call is marshalled by stubs generated from
//! `spec/opencl.spec` and forwarded to the router; objects handed to the application are
//! shells whose first word is the ICD dispatch pointer. It holds no policy.

#![allow(non_snake_case)]

mod board;
mod callbacks;
mod custom;
mod direct;
mod events;
mod infocache;
mod rt;
mod staged;
mod svm;
mod transfer;

use std::ffi::{c_char, c_void};

#[allow(clippy::all, clippy::undocumented_unsafe_blocks, missing_docs)]
mod generated {
    use super::*;
    use hira_opencl::cl::*;
    use hira_opencl::*;
    use rt::CallbackKind;
    include!(concat!(env!("OUT_DIR"), "/guest.rs"));
}
pub use generated::*;
