//! Resource policies of the router as pure state machines over an injected clock:
//! device-time schedulers (`sched`) and device-memory quotas, over-subscription and slot
//! placement (`mem`). Nothing here knows of sockets, processes or OpenCL, so every policy is
//! unit- and property-tested on its own.
#![forbid(unsafe_code)]

pub mod mem;
pub mod sched;
