//! The fixed frame header.

use crate::{Error, Result};

/// "HIRA" in little-endian.
pub const MAGIC: u32 = u32::from_le_bytes(*b"HIRA");
/// Current wire version; a peer speaking another is refused (so a guest library and a router
/// from different builds fail at once, with this error, rather than at their first frame the
/// other does not know). 2: `control::FENCE`.
pub const VERSION: u16 = 2;
/// Bytes in a header.
pub const HEADER_LEN: usize = 40;
/// Largest frame accepted (header included). Bulk data travels through shared memory, so
/// frames stay small; this bounds what a hostile peer can make us buffer.
pub const MAX_FRAME: usize = 64 << 20;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// An API call (opcode from the spec).
    Request = 1,
    /// The answer to a synchronous request (same sequence number).
    Reply = 2,
    /// A callback delivered from the server to the guest.
    Callback = 3,
    /// Session management (see [`crate::control`]).
    Control = 4,
}

impl TryFrom<u8> for Kind {
    type Error = Error;
    fn try_from(v: u8) -> Result<Kind> {
        Ok(match v {
            1 => Kind::Request,
            2 => Kind::Reply,
            3 => Kind::Callback,
            4 => Kind::Control,
            other => return Err(Error::BadKind(other)),
        })
    }
}

/// Header flags.
pub mod flags {
    /// The sender expects no reply (an asynchronous, batched call).
    pub const ASYNC: u8 = 1;
    /// Reply: an earlier asynchronous call of this connection failed; the payload's status
    /// carries the first such error (AvA: errors surface at the next synchronizing call).
    pub const DEFERRED_ERROR: u8 = 2;
}

/// The fixed 40-byte frame header, little-endian on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub flags: u8,
    pub opcode: u16,
    /// Total frame length, header included.
    pub len: u32,
    /// Per-connection sequence number of the request (replies echo it).
    pub seq: u64,
    /// Bytes of bulk data this frame moves through shared memory.
    pub bulk: u64,
    /// Replies: device time (ns) the tenant consumed since the previous reply.
    pub device_ns: u64,
}

impl Header {
    /// A header for a frame of `payload_len` bytes after the header.
    pub fn new(kind: Kind, opcode: u16, seq: u64, payload_len: usize) -> Header {
        Header {
            kind,
            flags: 0,
            opcode,
            len: (HEADER_LEN + payload_len) as u32,
            seq,
            bulk: 0,
            device_ns: 0,
        }
    }

    /// Payload bytes after the header.
    pub fn payload_len(&self) -> usize {
        self.len as usize - HEADER_LEN
    }

    /// Encode into the first [`HEADER_LEN`] bytes of `out`.
    pub fn write_to(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.kind as u8;
        out[7] = self.flags;
        out[8..10].copy_from_slice(&self.opcode.to_le_bytes());
        out[10..12].copy_from_slice(&0u16.to_le_bytes());
        out[12..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..24].copy_from_slice(&self.seq.to_le_bytes());
        out[24..32].copy_from_slice(&self.bulk.to_le_bytes());
        out[32..40].copy_from_slice(&self.device_ns.to_le_bytes());
    }

    /// Encode as bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        self.write_to(&mut b);
        b
    }

    /// Decode and validate a header: magic, version, kind and a length in
    /// `HEADER_LEN..=MAX_FRAME`. This is the only way bytes become a `Header`.
    pub fn parse(b: &[u8]) -> Result<Header> {
        if b.len() < HEADER_LEN {
            return Err(Error::Truncated {
                at: b.len(),
                wanted: HEADER_LEN,
            });
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(Error::BadMagic(magic));
        }
        let version = u16_at(4);
        if version != VERSION {
            return Err(Error::BadVersion(version));
        }
        let kind = Kind::try_from(b[6])?;
        let len = u32_at(12);
        if (len as usize) < HEADER_LEN || len as usize > MAX_FRAME {
            return Err(Error::BadLength(len as u64));
        }
        Ok(Header {
            kind,
            flags: b[7],
            opcode: u16_at(8),
            len,
            seq: u64_at(16),
            bulk: u64_at(24),
            device_ns: u64_at(32),
        })
    }

    /// Length of the whole frame whose header starts `b`, for a frame reader.
    pub fn frame_len(b: &[u8]) -> std::result::Result<usize, String> {
        Header::parse(b)
            .map(|h| h.len as usize)
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let mut h = Header::new(Kind::Request, 42, 7, 100);
        h.flags = flags::ASYNC;
        h.bulk = 4096;
        h.device_ns = 9;

        let back = Header::parse(&h.to_bytes());

        assert_eq!(back, Ok(h));
    }

    #[test]
    fn bad_magic_is_refused() {
        let mut b = Header::new(Kind::Request, 1, 1, 0).to_bytes();
        b[0] ^= 0xff;

        assert!(matches!(Header::parse(&b), Err(Error::BadMagic(_))));
    }

    #[test]
    fn oversized_length_is_refused() {
        let mut b = Header::new(Kind::Request, 1, 1, 0).to_bytes();
        b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());

        assert_eq!(Header::parse(&b), Err(Error::BadLength(u32::MAX as u64)));
    }

    #[test]
    fn short_length_is_refused() {
        let mut b = Header::new(Kind::Request, 1, 1, 0).to_bytes();
        b[12..16].copy_from_slice(&3u32.to_le_bytes());

        assert_eq!(Header::parse(&b), Err(Error::BadLength(3)));
    }

    #[test]
    fn truncated_header_is_refused() {
        let b = Header::new(Kind::Request, 1, 1, 0).to_bytes();

        assert!(matches!(
            Header::parse(&b[..10]),
            Err(Error::Truncated { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = Header::parse(&bytes);
        }
    }
}
