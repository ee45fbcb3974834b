//! The wire between guest, router and API server: a fixed frame header, validated once on
//! receipt, followed by a payload of little-endian primitives. No I/O happens here; a tenant's
//! bytes are hostile until [`Header::parse`] and the bounds-checked [`Reader`] have accepted them.
#![forbid(unsafe_code)]

mod codec;
mod header;

pub use codec::{Blob, OutSpec, Reader, Writer};
pub use header::{flags, Header, Kind, HEADER_LEN, MAGIC, MAX_FRAME, VERSION};

/// Errors met while decoding a frame.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("bad magic {0:#x}")]
    BadMagic(u32),
    #[error("unsupported wire version {0}")]
    BadVersion(u16),
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("frame length {0} out of range")]
    BadLength(u64),
    #[error("payload truncated: wanted {wanted} bytes at offset {at}")]
    Truncated { at: usize, wanted: usize },
    #[error("invalid tag {0}")]
    BadTag(u8),
    #[error("{0} trailing bytes after payload")]
    Trailing(usize),
}

impl Error {
    /// Every decoding error is the sender's fault: the frame did not follow the protocol.
    pub fn is_peer_fault(&self) -> bool {
        true
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Control opcodes (frames of kind [`Kind::Control`]); API calls use the spec's opcodes.
pub mod control {
    /// Guest → router, first frame of every connection. Payload: role u32, pid u32, tid u64,
    /// shm length u64, then optionally options u32 ([`OPT_DIRECT`]). The shm memfd rides
    /// along as SCM_RIGHTS.
    pub const HELLO: u16 = 1;
    /// Router → guest reply to HELLO. Payload: tenant id u64, connection id u64, status i32,
    /// then optionally options u32: [`OPT_DIRECT`] when the direct reply socket rides along
    /// as SCM_RIGHTS.
    pub const WELCOME: u16 = 2;
    /// HELLO/WELCOME/ATTACH option: replies the router has no use for travel from the API
    /// server straight to the guest on a socket of their own (one crossing and one router
    /// wake-up fewer per synchronous call). Which replies: `hira_opencl::reply_skips_router`.
    pub const OPT_DIRECT: u32 = 1;
    /// Guest → server: a new, larger shm region replaces the old one (fd attached). Payload: len u64.
    pub const SHM_GROW: u16 = 3;
    /// Round trip that does nothing; replies once every earlier frame has been executed.
    pub const PING: u16 = 4;
    /// Router → server over the control socket: a new connection (socket + shm fds attached).
    /// Payload: connection id u64, role u32, shm len u64, then optionally options u32
    /// ([`OPT_DIRECT`]: the direct reply socket is the last fd).
    pub const ATTACH: u16 = 5;
    /// Server → router over the control socket: accounting sample. Payload: device ns u64,
    /// memory bytes u64, objects u64, bytes of replies sent directly to the guest u64.
    pub const USAGE: u16 = 6;
    /// Router → guest: the call failed because the tenant's server is gone or the tenant was
    /// stopped. Payload: OpenCL error code i32.
    pub const FAILED: u16 = 7;

    /// Server → router over the control socket: one device-time command (a kernel launch)
    /// completed. Payload: device ns u64 (profiling START..END, or wall clock from enqueue
    /// when the device cannot tell), measured u8 (1 = by the device).
    pub const DONE: u16 = 8;

    /// Router → server over the control socket: the tenant's device-memory quota changed.
    /// Payload: quota bytes u64 (0 = none). The server reports it as the device's
    /// CL_DEVICE_GLOBAL_MEM_SIZE and caps CL_DEVICE_MAX_MEM_ALLOC_SIZE by it; the router
    /// enforces it.
    pub const SET_QUOTA: u16 = 9;

    /// Router → server over the control socket: over-subscription is on, so commands that
    /// touch buffers (the spec's `resident` calls) are scheduled like kernels and their
    /// completions reported with DONE. Payload: on u8 (1 = on).
    pub const SWAP_MODE: u16 = 10;

    /// Router → server over the control socket: copy these buffers to host memory and free
    /// them on the device; the guest's ids stay valid and the next command that uses one
    /// restores it. Payload: count u32, then count × buffer id u64.
    pub const EVICT: u16 = 11;

    /// Server → router, the reply to EVICT (same seq). Payload: bytes evicted u64, time ns
    /// u64, count of buffers kept u32, then their ids u64 (pinned, unknown or busy).
    pub const EVICTED: u16 = 12;

    /// Server → router, unsolicited: a command needed an evicted buffer and the server
    /// restored it. Payload: buffer id u64, bytes u64, time ns u64.
    pub const RESTORED: u16 = 13;

    /// Guest → server (through the router, which forwards the fd): the arena for the
    /// tenant's fine-grained SVM, a memfd sealed against shrinking (fd attached) that the
    /// guest has mapped at `address`. The server maps it at the same address, so pointers
    /// into it, and pointers stored in it, mean the same in both processes. No reply: the
    /// next fine-grained clSVMAlloc says whether it took. Payload: address u64, len u64.
    pub const SVM_ARENA: u16 = 14;

    /// Router → server over the control socket, first: the tenant's completion page
    /// (`hira_transport::CompletionPage`, fd attached). The server then counts kernel
    /// completions there and sends DONE only while the router's notify flag is up. No
    /// payload.
    pub const DONE_PAGE: u16 = 15;

    /// Guest → server (through the router, which forwards the fd): the tenant's event board
    /// (`hira_transport::EventBoard`, fd attached), sent once on each connection before its
    /// first launch that names an event. The server posts the completions of launches whose
    /// events the guest named there, so the guest waits for them without a round trip. No
    /// payload, no reply.
    pub const EVENT_BOARD: u16 = 16;

    /// Guest → server (through the router), before a call that waits, when other threads
    /// of the application sent commands on their own connections: the server runs nothing
    /// more of this connection until each named connection has run its frames up to the
    /// sequence number given (or is gone, or 5 s passed). Natively a command one thread
    /// enqueued is in the queue for every thread; across connections served by different
    /// server threads this keeps it so. Payload: pairs of connection id u64 (as WELCOME
    /// named it) and frame sequence number u64. No reply.
    pub const FENCE: u16 = 17;

    /// Connection roles carried by HELLO.
    pub const ROLE_CALLS: u32 = 1;
    /// The connection on which the server delivers callbacks to the guest.
    pub const ROLE_CALLBACKS: u32 = 2;
}
