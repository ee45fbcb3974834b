//! What every room knows of the OpenCL spec: opcodes, handle kinds, the per-opcode table
//! (sync/async, device time, allocations) that the router's accounting reads, info
//! translations, and the OpenCL constants hand-written code needs. Generated from
//! `spec/opencl.spec` at build time.
#![forbid(unsafe_code)]

pub mod cl;

/// How a call travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    Sync,
    Async,
    AsyncUnless,
    Unsupported,
    GuestOnly,
}

/// How an info result is translated between server and guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InfoMode {
    Handle,
    Handles,
    Properties,
    Guest,
}

/// What the spec says of one function.
#[derive(Clone, Copy, Debug)]
pub struct OpInfo {
    pub name: &'static str,
    pub opcode: u16,
    pub forward: Forward,
    pub device_time: bool,
    /// Touches buffers on the device (the spec's `resident`): scheduled like a launch while
    /// over-subscription is on.
    pub resident: bool,
    /// Handle kind created (0 if none).
    pub creates: u8,
    pub retains: bool,
    pub releases: bool,
    pub allocates: bool,
    pub custom: bool,
    /// Error code returned when unsupported (0 otherwise).
    pub unsupported: i32,
}

#[allow(clippy::all, unused_variables)]
mod generated {
    use super::*;
    use cl::*;
    include!(concat!(env!("OUT_DIR"), "/common.rs"));
}
pub use generated::*;

/// The spec's entry for an opcode.
pub fn op(opcode: u16) -> Option<&'static OpInfo> {
    OPS.get(usize::from(opcode).checked_sub(1)?)
}

/// Whether the reply to a request may go from the API server straight to the guest (on a
/// connection that has a direct reply socket): every reply except those the router reads —
/// a new memory object's id (device-memory accounting binds the charge to it) and a launch's
/// status (a refused launch frees its device slot). Router and server decide with this same
/// function, so the router knows which replies it will not see.
pub fn reply_skips_router(opcode: u16) -> bool {
    op(opcode).is_some_and(|o| !o.device_time && o.creates != K_MEM)
}

/// Translation mode and handle kind of an info query result, if it needs one.
pub fn info_mode(opcode: u16, param: u32) -> Option<(InfoMode, u8)> {
    INFOS
        .iter()
        .find(|i| i.0 == opcode && i.1 == param)
        .map(|i| (i.2, i.3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcodes_index_the_table() {
        let info = op(OP_CLENQUEUENDRANGEKERNEL).expect("in the spec");

        assert_eq!(info.name, "clEnqueueNDRangeKernel");
        assert!(info.device_time);
        assert_eq!(info.forward, Forward::Async);
    }

    #[test]
    fn alloc_hook_reads_image_size() {
        let mut w = hira_wire::Writer::default();
        w.u64(7); // context id
        w.u64(0); // flags
        let format = [0x10B5u32.to_le_bytes(), 0x10DEu32.to_le_bytes()].concat(); // RGBA float
        w.blob(hira_wire::Blob::Inline(&format));
        let mut desc = [0u8; 72];
        desc[0..4].copy_from_slice(&cl::CL_MEM_OBJECT_IMAGE2D.to_le_bytes());
        desc[8..16].copy_from_slice(&64u64.to_le_bytes());
        desc[16..24].copy_from_slice(&32u64.to_le_bytes());
        w.blob(hira_wire::Blob::Inline(&desc));
        w.blob(hira_wire::Blob::Null); // host_ptr

        assert_eq!(
            alloc_request_bytes(OP_CLCREATEIMAGE, &w.buf),
            Some(64 * 32 * 16)
        );
    }

    #[test]
    fn alloc_hook_reads_buffer_size() {
        let mut w = hira_wire::Writer::default();
        w.u64(7); // context id
        w.u64(0); // flags
        w.u64(4096); // size
        w.blob(hira_wire::Blob::Null); // host_ptr

        assert_eq!(alloc_request_bytes(OP_CLCREATEBUFFER, &w.buf), Some(4096));
    }
}
