//! Shared memory backed by a memfd, mapped read/write and shared with a
//! peer process by passing the fd over a [`crate::Conn`].
//!
//! The peer may be hostile: it can change the contents at any moment, even
//! in the middle of a copy. Readers copy bytes out once and validate the
//! copy; they never read the same shared bytes twice expecting the same
//! answer. The size, by contrast, is trustworthy: the creator seals the file
//! against shrinking and [`ShmRegion::from_fd`] checks the size before
//! mapping, so an access inside the region cannot fault (`SIGBUS`).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::{Error, Result};

/// Largest region accepted: 1 TiB.
pub const MAX_SHM_LEN: usize = 1 << 40;

/// Where regions that two processes map at one address are placed (16 TiB to 80 TiB on a
/// 47-bit user address space): far below where the kernel puts mappings (just under the
/// stack, near 128 TiB) and far above the executable and its heap, so an address picked at
/// random here is free in both processes almost surely, whatever their libraries and
/// address-space randomisation.
pub const SHARED_WINDOW: std::ops::Range<usize> = (16 << 40)..(80 << 40);

/// Alignment of addresses picked in [`SHARED_WINDOW`].
const WINDOW_ALIGN: usize = 1 << 30;

/// A random address in [`SHARED_WINDOW`] where `len` bytes fit; `None` if they cannot.
pub fn window_address(len: usize) -> Option<usize> {
    let slots = (SHARED_WINDOW.end - SHARED_WINDOW.start).checked_sub(len)? / WINDOW_ALIGN;
    let mut r = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into `r`.
    let got = unsafe { libc::getrandom(r.as_mut_ptr().cast(), r.len(), 0) };
    let n = if got == 8 {
        u64::from_le_bytes(r)
    } else {
        // No entropy source: the clock's low bits are random enough for a placement.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    };
    Some(SHARED_WINDOW.start + (n % (slots as u64 + 1)) as usize * WINDOW_ALIGN)
}

/// Tries at most this many random addresses before taking any address.
const WINDOW_TRIES: usize = 16;

/// A shared-memory region backed by a memfd (`memfd_create` with
/// `MFD_CLOEXEC | MFD_ALLOW_SEALING`), mapped `MAP_SHARED` read/write.
/// Unmapped on drop.
#[derive(Debug)]
pub struct ShmRegion {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
    shrink_sealed: bool,
}

// SAFETY: the region owns its mapping and fd outright; nothing in it is tied
// to the creating thread. Memory is reached only through raw pointers and
// byte copies, never through Rust references, and its contents are already
// treated as changing at any time (another process writes them), so access
// from several threads adds no hazard the API does not already document.
unsafe impl Send for ShmRegion {}
// SAFETY: `&ShmRegion` only exposes the length, the fd, raw pointers and
// bounds-checked byte copies; see the `Send` impl.
unsafe impl Sync for ShmRegion {}

impl ShmRegion {
    /// Creates a memfd named `name` of `len` bytes, seals it against
    /// shrinking (so a receiving peer can trust its size) and maps it.
    pub fn create(name: &str, len: usize) -> Result<ShmRegion> {
        Self::map(Self::new_file(name, len)?, len, true, None)
    }

    /// [`ShmRegion::create`], mapped at a random address of [`SHARED_WINDOW`] (at any address
    /// if a few tries find none free): for a region a peer maps at the same address.
    pub fn create_in_window(name: &str, len: usize) -> Result<ShmRegion> {
        let fd = Self::new_file(name, len)?;
        for _ in 0..WINDOW_TRIES {
            let Some(at) = window_address(len) else { break };
            match Self::map(fd.try_clone()?, len, true, Some(at)) {
                Ok(r) => return Ok(r),
                // Taken, or outside a smaller address space: try elsewhere.
                Err(Error::Io(e))
                    if e.kind() == io::ErrorKind::AddrInUse
                        || e.raw_os_error() == Some(libc::ENOMEM) => {}
                Err(e) => return Err(e),
            }
        }
        Self::map(fd, len, true, None)
    }

    /// [`ShmRegion::map_again_at`] at a random address of [`SHARED_WINDOW`] (a few tries).
    pub fn map_again_in_window(&self) -> Result<ShmRegion> {
        let mut last = Error::Io(io::Error::from(io::ErrorKind::AddrInUse));
        for _ in 0..WINDOW_TRIES {
            let Some(at) = window_address(self.len) else {
                break;
            };
            match self.map_again_at(at) {
                Ok(r) => return Ok(r),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// A new memfd of `len` bytes, sealed against shrinking.
    fn new_file(name: &str, len: usize) -> Result<OwnedFd> {
        check_len(len)?;
        let name = CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains NUL"))?;
        // SAFETY: `name` is a valid NUL-terminated string for the call.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: memfd_create just returned this fd to us and nothing else
        // owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on an fd we own; `len` fits off_t (checked above).
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: fcntl(F_ADD_SEALS) on an fd we own takes an int argument.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
            return Err(io::Error::last_os_error().into());
        }
        Ok(fd)
    }

    /// A second mapping of this region's file at exactly `addr` (`MAP_FIXED_NOREPLACE`:
    /// nothing already mapped there is replaced); `AddrInUse` if the range is taken. Two
    /// processes that map one file at the same address can share memory holding pointers.
    pub fn map_again_at(&self, addr: usize) -> Result<ShmRegion> {
        let fd = self.fd.try_clone()?;
        Self::map(fd, self.len, self.shrink_sealed, Some(addr))
    }

    /// Maps a region received from a peer.
    ///
    /// Seals the file against shrinking if possible (a file already sealed
    /// with `F_SEAL_SEAL`, or one that is not sealable, is accepted without;
    /// see [`ShmRegion::shrink_sealed`]), then checks it is a regular file of
    /// at least `len` bytes: mapping past the end of a smaller file would
    /// fault on access. Rejects `len == 0` and `len > 1 << 40`.
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<ShmRegion> {
        Self::from_fd_at(fd, len, None)
    }

    /// [`ShmRegion::from_fd`], mapped at exactly `addr` when given (`MAP_FIXED_NOREPLACE`;
    /// `AddrInUse` if anything is mapped in the range).
    pub fn from_fd_at(fd: OwnedFd, len: usize, addr: Option<usize>) -> Result<ShmRegion> {
        check_len(len)?;
        // Seal before checking the size, so the size cannot shrink between
        // the check and the mapping.
        // SAFETY: fcntl(F_ADD_SEALS) on an fd we own takes an int argument.
        let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if !matches!(err.raw_os_error(), Some(libc::EPERM | libc::EINVAL)) {
                return Err(err.into());
            }
        }
        // SAFETY: F_GET_SEALS on an fd we own takes no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        let shrink_sealed = seals >= 0 && seals & libc::F_SEAL_SHRINK != 0;
        // SAFETY: `stat` is plain old data; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is valid for writes of a `stat`.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error().into());
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(Error::NotRegularFile);
        }
        let actual = u64::try_from(st.st_size).unwrap_or(0);
        if actual < len as u64 {
            return Err(Error::ShmTooSmall {
                expected: len,
                actual,
            });
        }
        Self::map(fd, len, shrink_sealed, addr)
    }

    fn map(fd: OwnedFd, len: usize, shrink_sealed: bool, at: Option<usize>) -> Result<ShmRegion> {
        let (hint, fixed) = match at {
            Some(a) if a % page_size() != 0 || a.checked_add(len).is_none() => {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad address").into());
            }
            Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED_NOREPLACE),
            None => (std::ptr::null_mut(), 0),
        };
        // SAFETY: a fresh shared mapping; with MAP_FIXED_NOREPLACE the kernel refuses a
        // range that overlaps any existing mapping, so no existing memory (Rust's or
        // anyone's) is replaced or aliased; `fd` is open and `len` is non-zero.
        let ptr = unsafe {
            libc::mmap(
                hint,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | fixed,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EEXIST) {
                return Err(io::Error::from(io::ErrorKind::AddrInUse).into());
            }
            return Err(err.into());
        }
        if at.is_some_and(|a| a != ptr as usize) {
            // A kernel without MAP_FIXED_NOREPLACE took the address as a hint.
            // SAFETY: the mapping just made, used by nothing.
            unsafe { libc::munmap(ptr, len) };
            return Err(io::Error::from(io::ErrorKind::AddrInUse).into());
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(ShmRegion {
            ptr,
            len,
            fd,
            shrink_sealed,
        })
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, e.g. to send it to a peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Whether the file is sealed against shrinking. Always true for regions
    /// from [`ShmRegion::create`]; false for a received file the peer had
    /// already locked with `F_SEAL_SEAL`, or one that is not sealable, which
    /// the peer could shrink later to make accesses fault.
    pub fn shrink_sealed(&self) -> bool {
        self.shrink_sealed
    }

    /// Start of the mapping. The memory may change under the reader at any
    /// time (a peer process writes it).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bounds-checked raw pointer to `[offset, offset + len)`: `None` if the
    /// range overflows or leaves the region.
    pub fn range(&self, offset: u64, len: u64) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        if end > self.len as u64 {
            return None;
        }
        // SAFETY: `offset <= end <= self.len`, so the result stays within
        // (or one past the end of) the mapping.
        Some(unsafe { self.ptr.as_ptr().add(offset as usize) })
    }

    /// Copies `data` into the region at `offset`; [`Error::OutOfBounds`] if
    /// the range leaves the region.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self
            .range(offset, data.len() as u64)
            .ok_or(Error::OutOfBounds)?;
        // SAFETY: `range` checked that `dst..dst + data.len()` lies in the
        // mapping, which lives as long as `self`; `data` is a Rust slice and
        // so cannot overlap the shared mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` into `out`; [`Error::OutOfBounds`] if the
    /// range leaves the region. The copy is a snapshot: validate `out`, not
    /// the shared bytes, which the peer may change at any time.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self
            .range(offset, out.len() as u64)
            .ok_or(Error::OutOfBounds)?;
        // SAFETY: `range` checked that `src..src + out.len()` lies in the
        // mapping, which lives as long as `self`; `out` is a Rust slice and
        // so cannot overlap the shared mapping.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `map`, and no
        // borrow of it can outlive `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096).max(1)
}

fn check_len(len: usize) -> Result<()> {
    if len == 0 || len > MAX_SHM_LEN {
        return Err(Error::BadLength(len));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Conn;

    #[test]
    fn memfd_passed_over_conn_shares_writes() {
        let region = ShmRegion::create("test", 4096).unwrap();
        let (a, b) = Conn::pair().unwrap();
        a.send(b"m", &[region.fd()]).unwrap();
        let mut fds = Vec::new();
        b.recv(&mut [0u8; 1], &mut fds).unwrap();
        let peer = ShmRegion::from_fd(fds.pop().unwrap(), 4096).unwrap();

        region.write_at(100, b"shared!").unwrap();
        let mut out = [0u8; 7];
        peer.read_at(100, &mut out).unwrap();

        assert_eq!(&out, b"shared!");
        assert!(peer.shrink_sealed());
    }

    #[test]
    fn from_fd_rejects_too_small_file() {
        let region = ShmRegion::create("small", 4096).unwrap();
        let fd = region.fd().try_clone_to_owned().unwrap();

        let err = ShmRegion::from_fd(fd, 8192).unwrap_err();

        assert!(matches!(
            err,
            Error::ShmTooSmall {
                expected: 8192,
                actual: 4096
            }
        ));
    }

    #[test]
    fn from_fd_rejects_bad_lengths() {
        let region = ShmRegion::create("len", 4096).unwrap();

        let zero = ShmRegion::from_fd(region.fd().try_clone_to_owned().unwrap(), 0);
        let huge = ShmRegion::from_fd(region.fd().try_clone_to_owned().unwrap(), (1 << 40) + 1);

        assert!(matches!(zero, Err(Error::BadLength(0))));
        assert!(matches!(huge, Err(Error::BadLength(_))));
    }

    #[test]
    fn from_fd_rejects_non_regular_file() {
        let (a, _b) = Conn::pair().unwrap();

        let err = ShmRegion::from_fd(a.into_owned(), 4096).unwrap_err();

        assert!(matches!(err, Error::NotRegularFile));
    }

    #[test]
    fn range_rejects_overflow_and_out_of_range() {
        let region = ShmRegion::create("range", 4096).unwrap();

        assert!(region.range(u64::MAX, 1).is_none());
        assert!(region.range(1, u64::MAX).is_none());
        assert!(region.range(4000, 97).is_none());
        assert!(region.range(4096, 1).is_none());
        assert_eq!(
            region.range(4000, 96),
            Some(region.as_ptr().wrapping_add(4000))
        );
        assert!(region.range(4096, 0).is_some());
    }

    #[test]
    fn copies_out_of_bounds_fail() {
        let region = ShmRegion::create("oob", 16).unwrap();

        let write = region.write_at(10, &[0; 7]);
        let read = region.read_at(u64::MAX, &mut [0; 2]);

        assert!(matches!(write, Err(Error::OutOfBounds)));
        assert!(matches!(read, Err(Error::OutOfBounds)));
    }

    #[test]
    fn mapped_again_at_an_address_shares_the_bytes_there_and_never_replaces() {
        let region = ShmRegion::create("at", 1 << 20).unwrap();
        // A free address: reserve a range, release it, map there (again if another test
        // thread mapped something there in between).
        let twin = loop {
            let probe = ShmRegion::create("probe", 1 << 20).unwrap();
            let free = probe.as_ptr() as usize;
            drop(probe);
            match region.map_again_at(free) {
                Ok(twin) => break twin,
                Err(Error::Io(e)) if e.kind() == io::ErrorKind::AddrInUse => continue,
                Err(e) => panic!("{e}"),
            }
        };
        let free = twin.as_ptr() as usize;
        region.write_at(4096, b"same bytes").unwrap();
        let mut out = [0u8; 10];
        twin.read_at(4096, &mut out).unwrap();

        let taken = region.map_again_at(region.as_ptr() as usize);
        let peer = ShmRegion::from_fd_at(
            region.fd().try_clone_to_owned().unwrap(),
            1 << 20,
            Some(twin.as_ptr() as usize),
        );
        let unaligned = region.map_again_at(free + 1);

        assert_eq!(&out, b"same bytes");
        assert!(matches!(taken, Err(Error::Io(e)) if e.kind() == io::ErrorKind::AddrInUse));
        assert!(matches!(peer, Err(Error::Io(e)) if e.kind() == io::ErrorKind::AddrInUse));
        assert!(unaligned.is_err());
    }

    #[test]
    fn regions_in_the_window_land_there_and_map_again_there() {
        let region = ShmRegion::create_in_window("window", 1 << 30).unwrap();
        let at = region.as_ptr() as usize;
        let twin = region.map_again_in_window().unwrap();
        region.write_at(1 << 29, b"window").unwrap();
        let mut out = [0u8; 6];
        twin.read_at(1 << 29, &mut out).unwrap();

        assert!(SHARED_WINDOW.contains(&at), "{at:#x}");
        assert_eq!(at % WINDOW_ALIGN, 0);
        assert!(SHARED_WINDOW.contains(&(twin.as_ptr() as usize)));
        assert_ne!(twin.as_ptr(), region.as_ptr());
        assert_eq!(&out, b"window");
        assert!(window_address(SHARED_WINDOW.end).is_none());
        assert!((0..64).all(|_| window_address(1 << 34)
            .is_some_and(|a| a >= SHARED_WINDOW.start && a + (1 << 34) <= SHARED_WINDOW.end)));
    }

    #[test]
    fn creator_region_cannot_shrink() {
        let region = ShmRegion::create("sealed", 4096).unwrap();

        // SAFETY: ftruncate on an fd the region owns; expected to fail.
        let rc = unsafe { libc::ftruncate(region.fd().as_raw_fd(), 0) };

        assert_eq!(rc, -1);
        assert!(region.shrink_sealed());
        assert_eq!(region.len(), 4096);
    }
}
