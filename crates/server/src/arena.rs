//! The arena of a tenant's fine-grained SVM.
//!
//! Fine-grained SVM lets the host and the device touch the same bytes without map/unmap,
//! and lets SVM memory hold pointers into SVM memory. Across a process boundary that needs
//! memory both processes map at the same address. The guest creates a memfd (sealed against
//! shrinking), maps it at a random address of [`hira_transport::SHARED_WINDOW`] (free in both
//! processes almost surely) and sends it with its address (`control::SVM_ARENA`); the server maps
//! it at that very address ([`hira_transport::ShmRegion::from_fd_at`], never replacing a
//! mapping of its own) and carves fine-grained allocations out of it. On a CPU device a
//! kernel reaches any host memory, so the vendor takes these pointers like its own.
//!
//! The allocator's bookkeeping lives here, in server memory, never in the shared bytes: the
//! guest can scribble over its arena (its own data) but cannot confuse the allocator.

use hira_transport::ShmRegion;
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

/// Every allocation starts at a multiple of this (as the vendor's own SVM allocations do:
/// CL_DEVICE_MEM_BASE_ADDR_ALIGN on PoCL) and is a multiple of it long.
pub const GRAIN: usize = 128;
/// Smallest and largest arena accepted.
pub const MIN_LEN: usize = 1 << 20;
pub const MAX_LEN: usize = 1 << 40;
/// Freed ranges at least this large give their pages back to the system.
const RELEASE_FROM: usize = 1 << 16;

/// A mapped arena and its free ranges (offset → length, coalesced).
#[derive(Debug)]
pub struct Arena {
    region: ShmRegion,
    free: BTreeMap<usize, usize>,
}

/// Why an arena was not taken.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// Something of this process is mapped in the range; a free address to offer instead.
    Taken(usize),
    /// Malformed, unsealed or unmappable; nothing to offer.
    Bad(String),
}

impl Arena {
    /// Maps the guest's memfd at `addr`.
    pub fn map(fd: OwnedFd, addr: u64, len: u64) -> Result<Arena, Refused> {
        let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else {
            return Err(Refused::Bad("address or length out of range".into()));
        };
        if !(MIN_LEN..=MAX_LEN).contains(&len) || len % GRAIN != 0 || addr == 0 {
            return Err(Refused::Bad(format!("arena of {len} bytes at {addr:#x}")));
        }
        let region = match ShmRegion::from_fd_at(fd, len, Some(addr)) {
            Ok(r) => r,
            Err(hira_transport::Error::Io(e)) if e.kind() == std::io::ErrorKind::AddrInUse => {
                return Err(free_address(len).map_or_else(
                    || Refused::Bad("address taken and no other free".into()),
                    Refused::Taken,
                ));
            }
            Err(e) => return Err(Refused::Bad(e.to_string())),
        };
        if !region.shrink_sealed() {
            // A file the guest could shrink would fault (SIGBUS) under a running kernel.
            return Err(Refused::Bad("memfd not sealed against shrinking".into()));
        }
        Ok(Arena {
            region,
            free: BTreeMap::from([(0, len)]),
        })
    }

    /// The first address of the arena.
    pub fn base(&self) -> usize {
        self.region.as_ptr() as usize
    }

    fn len(&self) -> usize {
        self.region.len()
    }

    /// `size` bytes aligned to `align` (a power of two, or 0; at least [`GRAIN`] anyway),
    /// first fit.
    pub fn alloc(&mut self, size: usize, align: usize) -> Option<usize> {
        if (align != 0 && !align.is_power_of_two()) || size == 0 {
            return None;
        }
        let align = align.max(GRAIN);
        let size = size.checked_next_multiple_of(GRAIN)?;
        let base = self.base();
        let (off, len, at) = self.free.iter().find_map(|(&off, &len)| {
            let at = (base + off).checked_next_multiple_of(align)? - base;
            (at.checked_add(size)? <= off + len).then_some((off, len, at))
        })?;
        self.free.remove(&off);
        if at > off {
            self.free.insert(off, at - off);
        }
        if at + size < off + len {
            self.free.insert(at + size, off + len - at - size);
        }
        Some(base + at)
    }

    /// Returns `[addr, addr + size)`, allocated by [`Arena::alloc`] with this size.
    pub fn free(&mut self, addr: usize, size: usize) {
        let Some(mut off) = addr.checked_sub(self.base()) else {
            return;
        };
        let Some(mut len) = size.checked_next_multiple_of(GRAIN) else {
            return;
        };
        if off + len > self.len() {
            return;
        }
        if let Some((&p, &plen)) = self.free.range(..off).next_back() {
            if p + plen == off {
                self.free.remove(&p);
                off = p;
                len += plen;
            }
        }
        if let Some(nlen) = self.free.remove(&(off + len)) {
            len += nlen;
        }
        self.free.insert(off, len);
        if len >= RELEASE_FROM {
            self.release(off, len);
        }
    }

    /// Gives the whole pages inside a free range back to the system (they read as zeros when
    /// next touched).
    fn release(&self, off: usize, len: usize) {
        let page = 4096;
        let start = (self.base() + off).next_multiple_of(page);
        let end = (self.base() + off + len) / page * page;
        if end > start {
            // SAFETY: a page-aligned range inside our own shared mapping that no allocation
            // holds; MADV_REMOVE only drops the file's pages there.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_REMOVE) };
        }
    }

    /// Bytes not allocated.
    #[cfg(test)]
    fn free_bytes(&self) -> usize {
        self.free.values().sum()
    }
}

/// An address range of `len` bytes that nothing in this process maps right now: a random
/// one in the window where the guest places its arena (so it is almost surely free there
/// too), else wherever the kernel likes.
pub(crate) fn free_address(len: usize) -> Option<usize> {
    (0..16)
        .filter_map(|_| hira_transport::window_address(len))
        .find(|&at| is_free(at, len))
        .or_else(|| probe(0, len, 0))
}

/// Whether nothing of this process is mapped in `[at, at + len)` right now.
pub(crate) fn is_free(at: usize, len: usize) -> bool {
    at != 0 && probe(at, len, libc::MAP_FIXED_NOREPLACE) == Some(at)
}

/// Where the kernel puts an anonymous reservation of `len` bytes asked for at `at` with
/// `flags`; the reservation is undone at once.
fn probe(at: usize, len: usize, flags: libc::c_int) -> Option<usize> {
    // SAFETY: an anonymous PROT_NONE reservation (MAP_FIXED_NOREPLACE never replaces a
    // mapping; without it `at` is a hint), unmapped at once.
    unsafe {
        let p = libc::mmap(
            at as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | flags,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return None;
        }
        libc::munmap(p, len);
        Some(p as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(len: usize) -> (ShmRegion, Arena) {
        let guest = ShmRegion::create("arena", len).unwrap();
        // Tests map concurrently: a free address may be taken by the time it is used.
        let mut at = free_address(len).unwrap();
        loop {
            let fd = guest.fd().try_clone_to_owned().unwrap();
            match Arena::map(fd, at as u64, len as u64) {
                Ok(a) => return (guest, a),
                Err(Refused::Taken(offer)) => at = offer,
                Err(e) => panic!("{e:?}"),
            }
        }
    }

    #[test]
    fn allocations_are_aligned_disjoint_and_coalesce_when_freed() {
        let (_g, mut a) = arena(MIN_LEN);
        let base = a.base();
        let x = a.alloc(100, 0).unwrap();
        let y = a.alloc(1000, 4096).unwrap();
        let z = a.alloc(GRAIN, 64).unwrap();

        assert_eq!(x, base);
        assert_eq!(y % 4096, 0);
        assert!(z >= x + GRAIN && (z + GRAIN <= y || z >= y + 1024));
        assert_eq!(a.free_bytes(), MIN_LEN - GRAIN - 1024 - GRAIN);
        a.free(y, 1000);
        a.free(x, 100);
        a.free(z, GRAIN);
        assert_eq!(a.free_bytes(), MIN_LEN);
        assert_eq!(a.free.len(), 1, "every range merged back into one");
        assert_eq!(a.alloc(MIN_LEN, 0), Some(base));
        assert_eq!(a.alloc(1, 0), None, "full");
    }

    #[test]
    fn bad_requests_get_nothing() {
        let (_g, mut a) = arena(MIN_LEN);

        assert_eq!(a.alloc(0, 0), None);
        assert_eq!(a.alloc(64, 3 << 7), None, "alignment not a power of two");
        assert_eq!(a.alloc(64, 3), None, "not even below the grain");
        assert_eq!(a.alloc(MIN_LEN + 1, 0), None);
        a.free(a.base() + MIN_LEN, GRAIN); // outside: ignored
        a.free(1, GRAIN); // below: ignored
        assert_eq!(a.free_bytes(), MIN_LEN);
    }

    #[test]
    fn a_taken_address_gets_an_offer_and_the_offered_one_maps_the_same_file() {
        let len = MIN_LEN;
        let guest = ShmRegion::create("arena", len).unwrap();
        // In this one test process the guest's own mapping occupies its address.
        let taken = Arena::map(
            guest.fd().try_clone_to_owned().unwrap(),
            guest.as_ptr() as u64,
            len as u64,
        );
        let Err(Refused::Taken(mut offer)) = taken else {
            panic!("expected an offer, got {taken:?}");
        };
        let a = loop {
            let fd = guest.fd().try_clone_to_owned().unwrap();
            match Arena::map(fd, offer as u64, len as u64) {
                Ok(a) => break a,
                // Another test thread mapped there first.
                Err(Refused::Taken(again)) => offer = again,
                Err(e) => panic!("{e:?}"),
            }
        };
        // SAFETY: inside the arena mapping.
        unsafe { (a.base() as *mut u64).write(0xfeed) };
        let mut out = [0u8; 8];
        guest.read_at(0, &mut out).unwrap();

        assert_eq!(a.base(), offer);
        assert_eq!(u64::from_le_bytes(out), 0xfeed);
    }

    #[test]
    fn unsealed_or_malformed_arenas_are_refused() {
        // SAFETY: memfd_create with a literal name; the fd is owned below.
        let raw = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: just created, owned by nobody else.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        // SAFETY: ftruncate on our fd.
        assert_eq!(unsafe { libc::ftruncate(raw, MIN_LEN as i64) }, 0);
        // Tests map concurrently: retry wherever the free address was taken meanwhile.
        let map_free = |fd: &OwnedFd, len: u64| {
            let mut at = free_address(MIN_LEN).unwrap() as u64;
            loop {
                match Arena::map(fd.try_clone().unwrap(), at, len) {
                    Err(Refused::Taken(offer)) => at = offer as u64,
                    other => return other,
                }
            }
        };
        let unsealed = map_free(&fd, MIN_LEN as u64);
        let guest = ShmRegion::create("arena", MIN_LEN).unwrap();
        let small = map_free(&guest.fd().try_clone_to_owned().unwrap(), 4096);
        let addr = free_address(MIN_LEN).unwrap() as u64;
        let odd = Arena::map(
            guest.fd().try_clone_to_owned().unwrap(),
            addr + 1,
            MIN_LEN as u64,
        );

        assert!(matches!(unsealed, Err(Refused::Bad(_))), "{unsealed:?}");
        assert!(matches!(small, Err(Refused::Bad(_))));
        assert!(matches!(odd, Err(Refused::Bad(_))));
    }
}
