//! Channels between hira's processes (Linux only): connected Unix stream
//! sockets that carry file descriptors ([`Conn`], [`Listener`]), a buffered
//! frame reader over them ([`FrameReader`]), and memfd-backed shared memory
//! ([`ShmRegion`]) whose fd travels over a [`Conn`], the page of kernel
//! completions an API server shares with the router ([`CompletionPage`]), and the
//! board of launch completions it shares with its guest ([`EventBoard`]).
//!
//! This crate moves bytes and fds; it knows nothing of the wire format beyond
//! "a fixed-size header says how long the frame is". Everything a peer sends
//! is hostile: lengths are bounded, received fds are owned immediately, and
//! shared memory is validated before it is mapped.

pub mod board;
pub mod completion;
pub mod shm;
pub mod unix;

pub use board::EventBoard;
pub use completion::{CompletionPage, NEVER as NOTIFY_NEVER};
pub use shm::*;
pub use unix::*;

/// Errors from sockets, framing and shared memory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A system call failed.
    #[error("I/O error")]
    Io(#[from] std::io::Error),
    /// The header callback rejected a frame header (or said it was shorter
    /// than the header). The [`FrameReader`] is unusable afterwards.
    #[error("bad frame: {0}")]
    BadFrame(String),
    /// The peer closed the connection in the middle of a frame.
    #[error("connection closed mid-frame")]
    Truncated,
    /// A frame header announced this many bytes, more than allowed. The
    /// [`FrameReader`] is unusable afterwards.
    #[error("frame of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// The frame reader failed earlier with a framing error and has lost sync.
    #[error("frame reader lost sync after an earlier error")]
    Desynced,
    /// A shared-memory access fell outside the region.
    #[error("shared memory access out of bounds")]
    OutOfBounds,
    /// A shared-memory length was zero or above the limit.
    #[error("invalid shared memory length {0}")]
    BadLength(usize),
    /// A received shared-memory file is smaller than the length claimed.
    #[error("shared memory file has {actual} bytes, expected at least {expected}")]
    ShmTooSmall {
        /// The length the peer claimed.
        expected: usize,
        /// The file's actual size.
        actual: u64,
    },
    /// A received shared-memory fd is not a regular (memfd) file.
    #[error("shared memory fd is not a regular file")]
    NotRegularFile,
}

impl Error {
    /// True when the error is the peer's doing (malformed or oversized frame,
    /// truncated stream, bad shared memory) rather than a local failure.
    pub fn is_peer_fault(&self) -> bool {
        !matches!(self, Error::Io(_))
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;
