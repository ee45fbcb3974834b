//! Payload encoding: little-endian primitives, no padding, every read bounds-checked.

use crate::{Error, Result};

/// An input byte buffer as carried in a payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blob<'a> {
    /// A NULL pointer.
    Null,
    /// Bytes inside the frame.
    Inline(&'a [u8]),
    /// Bytes in the connection's shared-memory region.
    Shm { offset: u64, len: u64 },
}

/// Where the receiver should put an output buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutSpec {
    /// A NULL pointer: no output wanted.
    Null,
    /// Return up to `len` bytes inside the reply frame.
    Inline { len: u64 },
    /// Write directly into the shared-memory region.
    Shm { offset: u64, len: u64 },
}

impl OutSpec {
    /// Capacity the receiver may write.
    pub fn len(&self) -> u64 {
        match *self {
            OutSpec::Null => 0,
            OutSpec::Inline { len } | OutSpec::Shm { len, .. } => len,
        }
    }

    /// True for [`OutSpec::Null`] or a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

const TAG_NULL: u8 = 0;
const TAG_INLINE: u8 = 1;
const TAG_SHM: u8 = 2;

/// Builds a payload.
#[derive(Default, Debug, Clone)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    /// A writer whose buffer already holds `reserve` bytes (room for a header).
    pub fn with_header_room(reserve: usize) -> Writer {
        let mut buf = Vec::with_capacity(256);
        buf.resize(reserve, 0);
        Writer { buf }
    }

    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn i32(&mut self, v: i32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    /// Length-prefixed bytes.
    pub fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.buf.extend_from_slice(b);
    }
    pub fn blob(&mut self, b: Blob<'_>) {
        match b {
            Blob::Null => self.u8(TAG_NULL),
            Blob::Inline(data) => {
                self.u8(TAG_INLINE);
                self.bytes(data);
            }
            Blob::Shm { offset, len } => {
                self.u8(TAG_SHM);
                self.u64(offset);
                self.u64(len);
            }
        }
    }
    pub fn out_spec(&mut self, o: OutSpec) {
        match o {
            OutSpec::Null => self.u8(TAG_NULL),
            OutSpec::Inline { len } => {
                self.u8(TAG_INLINE);
                self.u64(len);
            }
            OutSpec::Shm { offset, len } => {
                self.u8(TAG_SHM);
                self.u64(offset);
                self.u64(len);
            }
        }
    }
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Reads a payload; every accessor fails with [`Error::Truncated`] instead of reading past
/// the end.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(Error::Truncated {
                at: self.pos,
                wanted: n,
            }),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32> {
        self.array().map(u32::from_le_bytes)
    }
    pub fn i32(&mut self) -> Result<i32> {
        self.array().map(i32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Result<u64> {
        self.array().map(u64::from_le_bytes)
    }
    pub fn i64(&mut self) -> Result<i64> {
        self.array().map(i64::from_le_bytes)
    }
    /// Length-prefixed bytes.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn blob(&mut self) -> Result<Blob<'a>> {
        match self.u8()? {
            TAG_NULL => Ok(Blob::Null),
            TAG_INLINE => Ok(Blob::Inline(self.bytes()?)),
            TAG_SHM => Ok(Blob::Shm {
                offset: self.u64()?,
                len: self.u64()?,
            }),
            t => Err(Error::BadTag(t)),
        }
    }
    pub fn out_spec(&mut self) -> Result<OutSpec> {
        match self.u8()? {
            TAG_NULL => Ok(OutSpec::Null),
            TAG_INLINE => Ok(OutSpec::Inline { len: self.u64()? }),
            TAG_SHM => Ok(OutSpec::Shm {
                offset: self.u64()?,
                len: self.u64()?,
            }),
            t => Err(Error::BadTag(t)),
        }
    }
    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// Fail unless the whole payload was consumed.
    pub fn finish(&self) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(Error::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primitives_round_trip() {
        let mut w = Writer::default();
        w.u32(7);
        w.i32(-5);
        w.u64(u64::MAX);
        w.blob(Blob::Inline(b"abc"));
        w.blob(Blob::Shm { offset: 8, len: 16 });
        w.out_spec(OutSpec::Inline { len: 9 });
        w.blob(Blob::Null);

        let mut r = Reader::new(&w.buf);

        assert_eq!(r.u32(), Ok(7));
        assert_eq!(r.i32(), Ok(-5));
        assert_eq!(r.u64(), Ok(u64::MAX));
        assert_eq!(r.blob(), Ok(Blob::Inline(b"abc")));
        assert_eq!(r.blob(), Ok(Blob::Shm { offset: 8, len: 16 }));
        assert_eq!(r.out_spec(), Ok(OutSpec::Inline { len: 9 }));
        assert_eq!(r.blob(), Ok(Blob::Null));
        assert_eq!(r.finish(), Ok(()));
    }

    #[test]
    fn oversized_length_prefix_is_truncation() {
        let mut w = Writer::default();
        w.u32(u32::MAX);

        let mut r = Reader::new(&w.buf);

        assert!(matches!(r.bytes(), Err(Error::Truncated { .. })));
    }

    #[test]
    fn unknown_tag_is_refused() {
        let mut r = Reader::new(&[9u8]);

        assert_eq!(r.blob(), Err(Error::BadTag(9)));
    }

    proptest::proptest! {
        #[test]
        fn reader_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..128)) {
            let mut r = Reader::new(&bytes);
            let _ = r.blob();
            let _ = r.out_spec();
            let _ = r.bytes();
            let _ = r.u64();
        }
    }
}
