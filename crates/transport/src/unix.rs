//! Unix stream sockets that carry file descriptors, and a buffered frame
//! reader over them.

use std::collections::VecDeque;
use std::io;
use std::mem;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::AtomicI32;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::{Error, Result};

/// Most fds accepted with one received message; any beyond are closed.
pub const MAX_FDS_PER_MSG: usize = 8;

/// Initial size of a [`FrameReader`]'s buffer.
const INITIAL_READ_BUF: usize = 64 * 1024;

/// Credentials of the process at the other end of a socket, as the kernel
/// recorded them at `connect()`/`socketpair()` time (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// A connected `SOCK_STREAM` Unix socket that can carry fds (`SCM_RIGHTS`).
///
/// [`Conn::recv`] never sleeps inside `recvmsg`: it reads without blocking and, when nothing
/// is there, sleeps in `poll(POLLIN)`. A thread asleep in `recvmsg` on a Unix stream socket
/// shares the socket's wait queue with its writers and is woken (for nothing) each time the
/// peer consumes what this side sent; `poll` waits only for what it asked for. On a router
/// that reads and writes the same socket from two threads, that was one wasted wake-up per
/// forwarded batch, and on a CPU device every wake-up is taken from the kernels.
#[derive(Debug)]
pub struct Conn {
    stream: UnixStream,
    /// The read timeout [`Conn::set_read_timeout`] set on this handle, in ms (−1: none).
    timeout_ms: AtomicI32,
}

impl Conn {
    /// Connects to the listening socket at `path`.
    pub fn connect(path: &Path) -> Result<Conn> {
        Ok(Conn::wrap(UnixStream::connect(path)?))
    }

    fn wrap(stream: UnixStream) -> Conn {
        Conn {
            stream,
            timeout_ms: AtomicI32::new(-1),
        }
    }

    /// A connected pair (`socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC)`).
    pub fn pair() -> Result<(Conn, Conn)> {
        let (a, b) = UnixStream::pair()?;
        Ok((Conn::wrap(a), Conn::wrap(b)))
    }

    /// Wraps an fd that must be a connected Unix stream socket.
    pub fn from_owned(fd: OwnedFd) -> Conn {
        Conn::wrap(UnixStream::from(fd))
    }

    /// Gives up the socket's fd.
    pub fn into_owned(self) -> OwnedFd {
        OwnedFd::from(self.stream)
    }

    /// The socket's raw fd.
    pub fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// A second handle to the same socket (`F_DUPFD_CLOEXEC`), with this handle's read
    /// timeout.
    pub fn try_clone(&self) -> Result<Conn> {
        Ok(Conn {
            stream: self.stream.try_clone()?,
            timeout_ms: AtomicI32::new(self.timeout_ms.load(Relaxed)),
        })
    }

    /// The peer's pid, uid and gid (`SO_PEERCRED`).
    pub fn peer_cred(&self) -> Result<PeerCred> {
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: `cred` and `len` are valid for writes and `len` holds the
        // size of `cred`, so the kernel writes at most that many bytes.
        let rc = unsafe {
            libc::getsockopt(
                self.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error().into());
        }
        Ok(PeerCred {
            pid: cred.pid,
            uid: cred.uid,
            gid: cred.gid,
        })
    }

    /// Writes all of `data`; `fds` (may be empty) ride on the first
    /// `sendmsg` as `SCM_RIGHTS`. Retries `EINTR`, continues after short
    /// writes, and uses `MSG_NOSIGNAL` (a closed peer gives `EPIPE`, never
    /// `SIGPIPE`). Sending fds with empty `data` is an `InvalidInput` error:
    /// a stream socket needs at least one byte to carry them.
    pub fn send(&self, data: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        if data.is_empty() && !fds.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "fds need at least one data byte to ride on",
            )
            .into());
        }
        let mut sent = 0;
        if !fds.is_empty() {
            sent = self.send_with_fds(data, fds)?;
        }
        while sent < data.len() {
            let rest = &data[sent..];
            // SAFETY: `rest` is a live slice; the kernel reads at most
            // `rest.len()` bytes from it.
            let n = unsafe {
                libc::send(
                    self.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err.into());
            }
            sent += n as usize;
        }
        Ok(())
    }

    /// One `sendmsg` of (a prefix of) `data` carrying `fds`; returns the
    /// number of bytes sent (at least one, since `data` is not empty).
    fn send_with_fds(&self, data: &[u8], fds: &[BorrowedFd<'_>]) -> Result<usize> {
        let fds_bytes = mem::size_of_val(fds);
        let payload_len = u32::try_from(fds_bytes).map_err(|_| {
            io::Error::new(io::ErrorKind::InvalidInput, "too many fds for one message")
        })?;
        // SAFETY: CMSG_SPACE is pure arithmetic on its argument.
        let space = unsafe { libc::CMSG_SPACE(payload_len) } as usize;
        // u64 elements keep the buffer aligned for `cmsghdr`.
        let mut control = vec![0u64; space.div_ceil(mem::size_of::<u64>())];
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        // SAFETY: msghdr is plain old data; all-zero is a valid value.
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` points at `control`, which is `space` bytes long,
        // aligned for cmsghdr and large enough for one header plus
        // `fds_bytes` of data, so the first header and its data are in
        // bounds. BorrowedFd is repr(transparent) over RawFd, so copying
        // `fds_bytes` bytes from `fds` copies the raw fd numbers.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload_len) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                fds_bytes,
            );
        }
        loop {
            // SAFETY: `msg` describes `iov` (pointing into `data`, only read
            // by the kernel) and `control`, all of which outlive the call.
            let n = unsafe { libc::sendmsg(self.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err.into());
            }
        }
    }

    /// One `recvmsg` into `buf`; fds received (with `MSG_CMSG_CLOEXEC`) are
    /// pushed to `fds`. `Ok(0)` means EOF (or an empty `buf`). At most
    /// [`MAX_FDS_PER_MSG`] fds are accepted per message; any beyond are
    /// closed. Retries `EINTR`; a read timeout gives `WouldBlock`. Waits in `poll`, not in
    /// `recvmsg` (see [`Conn`]).
    pub fn recv(&self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<usize> {
        const FD_BYTES: u32 = (MAX_FDS_PER_MSG * mem::size_of::<RawFd>()) as u32;
        // SAFETY: CMSG_SPACE is pure arithmetic on its argument.
        const SPACE: usize = unsafe { libc::CMSG_SPACE(FD_BYTES) } as usize;
        let mut control = [0u64; SPACE.div_ceil(mem::size_of::<u64>())];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain old data; all-zero is a valid value.
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        let mut deadline = None;
        let n = loop {
            msg.msg_controllen = mem::size_of_val(&control) as _;
            // SAFETY: `msg` describes `iov` (all of `buf`) and `control`,
            // both valid for writes of their stated lengths for the call.
            let n = unsafe {
                libc::recvmsg(
                    self.as_raw_fd(),
                    &mut msg,
                    libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT,
                )
            };
            if n >= 0 {
                break n as usize;
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock => self.wait_readable(&mut deadline)?,
                _ => return Err(err.into()),
            }
        };
        // SAFETY: `msg` was filled by a successful recvmsg, so its control
        // fields describe valid cmsg headers inside `control`.
        let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        let mut taken = 0;
        while !cmsg.is_null() {
            // SAFETY: `cmsg` is non-null and was returned by
            // CMSG_FIRSTHDR/CMSG_NXTHDR, so it points at a header in `control`.
            let hdr = unsafe { std::ptr::read_unaligned(cmsg) };
            if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
                // SAFETY: CMSG_LEN is pure arithmetic on its argument.
                let data_len =
                    (hdr.cmsg_len as usize).saturating_sub(unsafe { libc::CMSG_LEN(0) } as usize);
                // SAFETY: `cmsg` is a valid header, so its data follows it.
                let data = unsafe { libc::CMSG_DATA(cmsg) };
                for i in 0..data_len / mem::size_of::<RawFd>() {
                    // SAFETY: fd `i` lies within the header's data, inside
                    // `control`; read_unaligned needs no alignment.
                    let raw = unsafe { std::ptr::read_unaligned(data.cast::<RawFd>().add(i)) };
                    // SAFETY: the kernel just installed `raw` in our fd table
                    // for us, and nothing else owns it.
                    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                    // Dropping `fd` here closes an fd over the limit.
                    if taken < MAX_FDS_PER_MSG {
                        fds.push(fd);
                        taken += 1;
                    }
                }
            }
            // SAFETY: `cmsg` is a valid header within `msg`'s control buffer.
            cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
        }
        Ok(n)
    }

    /// Sleeps until the socket is readable (or hung up), or the read timeout set on this
    /// handle passes (`WouldBlock`).
    fn wait_readable(&self, deadline: &mut Option<std::time::Instant>) -> Result<()> {
        let limit = self.timeout_ms.load(Relaxed);
        let wait_ms = if limit < 0 {
            -1
        } else {
            let until = *deadline.get_or_insert_with(|| {
                std::time::Instant::now() + Duration::from_millis(limit as u64)
            });
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(io::Error::from(io::ErrorKind::WouldBlock).into());
            }
            left.as_millis().clamp(1, i32::MAX as u128) as i32
        };
        let mut pfd = libc::pollfd {
            fd: self.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on a socket we own.
        if unsafe { libc::poll(&mut pfd, 1, wait_ms) } < 0 {
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err.into());
            }
        }
        Ok(())
    }

    /// `shutdown(SHUT_RDWR)`, ignoring errors. Wakes any thread blocked in
    /// [`Conn::recv`] on a clone of this socket.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Shuts the sending direction down: the peer reads EOF and may still answer.
    pub fn shutdown_write(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
    }

    /// Sets (or clears with `None`) the receive timeout; a timed-out
    /// [`Conn::recv`] fails with `WouldBlock`.
    pub fn set_read_timeout(&self, d: Option<Duration>) -> Result<()> {
        self.stream.set_read_timeout(d)?;
        let ms = d.map_or(-1, |d| d.as_millis().clamp(1, i32::MAX as u128) as i32);
        self.timeout_ms.store(ms, Relaxed);
        Ok(())
    }
}

impl AsRawFd for Conn {
    fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

impl AsFd for Conn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

impl From<OwnedFd> for Conn {
    fn from(fd: OwnedFd) -> Conn {
        Conn::from_owned(fd)
    }
}

impl From<Conn> for OwnedFd {
    fn from(conn: Conn) -> OwnedFd {
        conn.into_owned()
    }
}

/// A listening Unix stream socket bound to a path.
#[derive(Debug)]
pub struct Listener {
    listener: UnixListener,
}

impl Listener {
    /// Binds a listening socket at `path`, creating its parent directory
    /// (mode 0700) if missing. A socket file already at `path` is removed
    /// only if nothing answers a `connect()` there; if a live listener
    /// answers, or `path` is not a socket, the error is `Io` of kind
    /// `AddrInUse`.
    pub fn bind(path: &Path) -> Result<Listener> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !parent.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(parent)?;
            }
        }
        match UnixListener::bind(path) {
            Ok(listener) => return Ok(Listener { listener }),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
            Err(e) => return Err(e.into()),
        }
        let in_use = || io::Error::new(io::ErrorKind::AddrInUse, "address in use");
        if !std::fs::symlink_metadata(path)?.file_type().is_socket() {
            return Err(in_use().into());
        }
        match UnixStream::connect(path) {
            Ok(_) => return Err(in_use().into()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
                ) => {}
            Err(e) => return Err(e.into()),
        }
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        Ok(Listener {
            listener: UnixListener::bind(path)?,
        })
    }

    /// Accepts one connection (`accept4` with `SOCK_CLOEXEC`), retrying
    /// `EINTR`.
    pub fn accept(&self) -> Result<Conn> {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => return Ok(Conn::wrap(stream)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The listening socket's raw fd.
    pub fn as_raw_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }
}

impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }
}

/// Buffered frame reader over a [`Conn`]: frames are a fixed-size header
/// followed by a payload whose length the header says.
///
/// Each `recv` asks for as much as fits in the buffer, so a batch of frames
/// sent with one write is usually read with one syscall. The buffer starts at
/// 64 KiB and grows only when a single frame needs more (never past the
/// `max_frame` asked for). Fds received with the bytes are queued in order,
/// read-ahead included: an fd sent with a later frame may already be queued.
#[derive(Debug)]
pub struct FrameReader {
    conn: Conn,
    buf: Vec<u8>,
    /// Start of unconsumed bytes in `buf`.
    start: usize,
    /// End of received bytes in `buf`.
    end: usize,
    fds: VecDeque<OwnedFd>,
    /// Scratch for fds of one `recv`.
    recv_fds: Vec<OwnedFd>,
    /// Set after a framing error: the stream has lost sync.
    desynced: bool,
}

impl FrameReader {
    /// A reader over `conn` with a 64 KiB buffer.
    pub fn new(conn: Conn) -> Self {
        FrameReader {
            conn,
            buf: vec![0; INITIAL_READ_BUF],
            start: 0,
            end: 0,
            fds: VecDeque::new(),
            recv_fds: Vec::new(),
            desynced: false,
        }
    }

    /// The connection being read (e.g. to send replies or shut it down).
    pub fn conn(&self) -> &Conn {
        &self.conn
    }

    /// Reads the next whole frame.
    ///
    /// `header_len` bytes are read first, then `frame_len(header)` returns
    /// the whole frame's length (at least `header_len`) or an error, which is
    /// returned as [`Error::BadFrame`]. Lengths above `max_frame` give
    /// [`Error::TooLarge`]. After either, the reader has lost sync and every
    /// later call fails with [`Error::Desynced`].
    ///
    /// Returns `Ok(None)` on a clean EOF at a frame boundary and
    /// [`Error::Truncated`] on EOF mid-frame. I/O errors (including a read
    /// timeout's `WouldBlock`) leave the reader usable: the next call resumes
    /// the same frame. The returned slice is the whole frame, header
    /// included, valid until the next call.
    pub fn read_frame(
        &mut self,
        header_len: usize,
        max_frame: usize,
        frame_len: impl FnOnce(&[u8]) -> std::result::Result<usize, String>,
    ) -> Result<Option<&[u8]>> {
        if self.desynced {
            return Err(Error::Desynced);
        }
        if header_len > max_frame {
            self.desynced = true;
            return Err(Error::TooLarge(header_len));
        }
        if !self.fill(header_len, max_frame)? {
            return Ok(None);
        }
        let header = &self.buf[self.start..self.start + header_len];
        let len = match frame_len(header) {
            Ok(len) if len < header_len => {
                self.desynced = true;
                return Err(Error::BadFrame(format!(
                    "frame length {len} is shorter than its {header_len}-byte header"
                )));
            }
            Ok(len) if len > max_frame => {
                self.desynced = true;
                return Err(Error::TooLarge(len));
            }
            Ok(len) => len,
            Err(msg) => {
                self.desynced = true;
                return Err(Error::BadFrame(msg));
            }
        };
        if !self.fill(len, max_frame)? {
            return Err(Error::Truncated);
        }
        let frame_start = self.start;
        self.start += len;
        Ok(Some(&self.buf[frame_start..frame_start + len]))
    }

    /// Receives until at least `need` bytes are buffered. Returns false on
    /// a clean EOF with nothing buffered; EOF with a partial frame is
    /// [`Error::Truncated`].
    fn fill(&mut self, need: usize, max_frame: usize) -> Result<bool> {
        while self.end - self.start < need {
            if self.start > 0 {
                // Move the partial frame to the front so the recv below can
                // take as much as the buffer holds. This copies less than one
                // frame, and only when a recv is needed anyway.
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if self.buf.len() < need {
                let grown = need.max(self.buf.len().saturating_mul(2)).min(max_frame);
                self.buf.resize(grown.max(need), 0);
            }
            let n = self
                .conn
                .recv(&mut self.buf[self.end..], &mut self.recv_fds)?;
            self.fds.extend(self.recv_fds.drain(..));
            if n == 0 {
                return if self.end == 0 {
                    Ok(false)
                } else {
                    Err(Error::Truncated)
                };
            }
            self.end += n;
        }
        Ok(true)
    }

    /// The oldest fd received and not yet taken.
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }

    /// Poll (without sleeping) for up to `spin` until the next frame is at least partly
    /// here. A peer in a request/reply exchange usually answers within tens of microseconds;
    /// polling that long saves this thread's wake-up, a good part of a local round trip.
    /// Returns at once when read-ahead is buffered.
    pub fn spin_until_readable(&self, spin: std::time::Duration) {
        if self.buffered() > 0 {
            return;
        }
        let mut pfd = libc::pollfd {
            fd: self.conn.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let until = std::time::Instant::now() + spin;
        while std::time::Instant::now() < until {
            // SAFETY: one valid pollfd on a socket we own, zero timeout.
            if unsafe { libc::poll(&mut pfd, 1, 0) } != 0 {
                return;
            }
            // Hand the core to anything runnable (on a CPU device, the kernels).
            std::thread::yield_now();
        }
    }

    /// Bytes received and not yet returned as frames (read-ahead). Non-zero
    /// means the next [`FrameReader::read_frame`] may not need a system call.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const MAX: usize = 1 << 20;

    /// Test header: 4-byte little-endian payload length.
    fn len4(h: &[u8]) -> std::result::Result<usize, String> {
        let n = u32::from_le_bytes(h.try_into().map_err(|_| "short header".to_string())?);
        Ok(4 + n as usize)
    }

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(payload);
        f
    }

    /// A fresh directory under the temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            TempDir(std::env::temp_dir().join(format!(
                "hira-transport-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            )))
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn send_recv_carries_data_and_fds() {
        let (a, b) = Conn::pair().unwrap();
        let (mut inner_a, inner_b) = UnixStream::pair().unwrap();

        a.send(b"hello", &[inner_b.as_fd()]).unwrap();
        drop(inner_b);
        let mut buf = [0u8; 16];
        let mut fds = Vec::new();
        let n = b.recv(&mut buf, &mut fds).unwrap();
        let mut passed = UnixStream::from(fds.pop().unwrap());
        passed.write_all(b"via fd").unwrap();
        let mut got = [0u8; 6];
        inner_a.read_exact(&mut got).unwrap();

        assert_eq!(&buf[..n], b"hello");
        assert!(fds.is_empty());
        assert_eq!(&got, b"via fd");
    }

    #[test]
    fn recv_keeps_at_most_eight_fds() {
        let (a, b) = Conn::pair().unwrap();
        let (x, _y) = UnixStream::pair().unwrap();
        let many: Vec<BorrowedFd<'_>> = (0..10).map(|_| x.as_fd()).collect();

        a.send(b"x", &many).unwrap();
        let mut fds = Vec::new();
        let n = b.recv(&mut [0u8; 4], &mut fds).unwrap();

        assert_eq!(n, 1);
        assert_eq!(fds.len(), MAX_FDS_PER_MSG);
    }

    #[test]
    fn send_fds_without_data_is_rejected() {
        let (a, _b) = Conn::pair().unwrap();

        let err = a.send(b"", &[a.as_fd()]).unwrap_err();

        assert!(matches!(err, Error::Io(e) if e.kind() == io::ErrorKind::InvalidInput));
    }

    #[test]
    fn send_to_closed_peer_is_epipe_not_sigpipe() {
        let (a, b) = Conn::pair().unwrap();
        drop(b);

        let err = a.send(b"data", &[]).unwrap_err();

        assert!(matches!(err, Error::Io(e) if e.kind() == io::ErrorKind::BrokenPipe));
    }

    #[test]
    fn reads_many_frames_from_one_write() {
        let (a, b) = Conn::pair().unwrap();
        let payloads: Vec<Vec<u8>> = (0..1000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let batch: Vec<u8> = payloads.iter().flat_map(|p| frame(p)).collect();
        a.send(&batch, &[]).unwrap();
        drop(a);
        let mut reader = FrameReader::new(b);

        let got: Vec<Vec<u8>> = (0..1000)
            .map(|_| reader.read_frame(4, MAX, len4).unwrap().unwrap()[4..].to_vec())
            .collect();
        let end = reader.read_frame(4, MAX, len4).unwrap();

        assert_eq!(got, payloads);
        assert!(end.is_none());
    }

    #[test]
    fn reads_frame_split_across_many_writes_and_grows() {
        let (a, b) = Conn::pair().unwrap();
        let payload: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let bytes = [frame(&payload), frame(b"next")].concat();
        let writer = std::thread::spawn(move || {
            bytes.chunks(1000).for_each(|c| a.send(c, &[]).unwrap());
        });
        let mut reader = FrameReader::new(b);

        let first = reader.read_frame(4, MAX, len4).unwrap().unwrap().to_vec();
        let second = reader.read_frame(4, MAX, len4).unwrap().unwrap().to_vec();
        writer.join().unwrap();
        let end = reader.read_frame(4, MAX, len4).unwrap();

        assert_eq!(&first[4..], &payload[..]);
        assert_eq!(&second[4..], b"next");
        assert!(end.is_none());
    }

    #[test]
    fn header_split_across_writes() {
        let (a, b) = Conn::pair().unwrap();
        let bytes = frame(b"abc");
        let writer = std::thread::spawn(move || {
            bytes.chunks(1).for_each(|c| a.send(c, &[]).unwrap());
        });
        let mut reader = FrameReader::new(b);

        let got = reader.read_frame(4, MAX, len4).unwrap().unwrap().to_vec();
        writer.join().unwrap();

        assert_eq!(got, frame(b"abc"));
    }

    #[test]
    fn eof_mid_frame_is_truncated() {
        let (a, b) = Conn::pair().unwrap();
        let mut partial = 100u32.to_le_bytes().to_vec();
        partial.extend_from_slice(&[7; 10]);
        a.send(&partial, &[]).unwrap();
        drop(a);
        let mut reader = FrameReader::new(b);

        let err = reader.read_frame(4, MAX, len4).unwrap_err();

        assert!(matches!(err, Error::Truncated));
    }

    #[test]
    fn eof_mid_header_is_truncated() {
        let (a, b) = Conn::pair().unwrap();
        a.send(&[1, 0], &[]).unwrap();
        drop(a);
        let mut reader = FrameReader::new(b);

        let err = reader.read_frame(4, MAX, len4).unwrap_err();

        assert!(matches!(err, Error::Truncated));
    }

    #[test]
    fn oversized_frame_is_too_large_and_desyncs() {
        let (a, b) = Conn::pair().unwrap();
        a.send(&(1u32 << 30).to_le_bytes(), &[]).unwrap();
        let mut reader = FrameReader::new(b);

        let err = reader.read_frame(4, 1024, len4).unwrap_err();
        let again = reader.read_frame(4, 1024, len4).unwrap_err();

        assert!(matches!(err, Error::TooLarge(n) if n == 4 + (1 << 30)));
        assert!(matches!(again, Error::Desynced));
    }

    #[test]
    fn header_callback_error_is_bad_frame() {
        let (a, b) = Conn::pair().unwrap();
        a.send(&frame(b"x"), &[]).unwrap();
        let mut reader = FrameReader::new(b);

        let err = reader
            .read_frame(4, MAX, |_| Err("bad opcode".to_string()))
            .unwrap_err();

        assert!(matches!(err, Error::BadFrame(m) if m == "bad opcode"));
    }

    #[test]
    fn clean_eof_is_none() {
        let (a, b) = Conn::pair().unwrap();
        drop(a);
        let mut reader = FrameReader::new(b);

        let got = reader.read_frame(4, MAX, len4).unwrap();

        assert!(got.is_none());
    }

    #[test]
    fn frame_reader_queues_fds() {
        let (a, b) = Conn::pair().unwrap();
        let (x, _y) = UnixStream::pair().unwrap();
        a.send(&frame(b"with fd"), &[x.as_fd()]).unwrap();
        let mut reader = FrameReader::new(b);

        let got = reader.read_frame(4, MAX, len4).unwrap().unwrap().to_vec();
        let fd = reader.take_fd();
        let none = reader.take_fd();

        assert_eq!(&got[4..], b"with fd");
        assert!(fd.is_some());
        assert!(none.is_none());
    }

    #[test]
    fn listener_accepts_and_reports_peer_cred() {
        let dir = TempDir::new();
        let path = dir.0.join("sub/dir/sock");
        let listener = Listener::bind(&path).unwrap();

        let client = Conn::connect(&path).unwrap();
        let server = listener.accept().unwrap();
        let cred = server.peer_cred().unwrap();
        client.send(b"ping", &[]).unwrap();
        let mut buf = [0u8; 4];
        let n = server.recv(&mut buf, &mut Vec::new()).unwrap();

        assert_eq!(cred.pid, std::process::id() as i32);
        // SAFETY: geteuid has no preconditions.
        assert_eq!(cred.uid, unsafe { libc::geteuid() });
        assert_eq!(&buf[..n], b"ping");
    }

    #[test]
    fn bind_on_live_path_fails() {
        let dir = TempDir::new();
        let path = dir.0.join("sock");
        let _live = Listener::bind(&path).unwrap();

        let err = Listener::bind(&path).unwrap_err();

        assert!(matches!(err, Error::Io(e) if e.kind() == io::ErrorKind::AddrInUse));
    }

    #[test]
    fn bind_over_stale_socket_file_succeeds() {
        let dir = TempDir::new();
        let path = dir.0.join("sock");
        drop(Listener::bind(&path).unwrap());

        let listener = Listener::bind(&path).unwrap();
        let _client = Conn::connect(&path).unwrap();
        let accepted = listener.accept();

        assert!(accepted.is_ok());
    }

    #[test]
    fn try_clone_and_shutdown_wake_reader() {
        let (a, _b) = Conn::pair().unwrap();
        let clone = a.try_clone().unwrap();

        clone.shutdown();
        let n = a.recv(&mut [0u8; 4], &mut Vec::new()).unwrap();

        assert_eq!(n, 0);
    }

    #[test]
    fn read_timeout_gives_would_block_and_keeps_reader_usable() {
        let (a, b) = Conn::pair().unwrap();
        b.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        a.send(&[3, 0], &[]).unwrap();
        let mut reader = FrameReader::new(b);

        let err = reader.read_frame(4, MAX, len4).unwrap_err();
        a.send(&[0, 0, b'a', b'b', b'c'], &[]).unwrap();
        let got = reader.read_frame(4, MAX, len4).unwrap().unwrap().to_vec();

        assert!(matches!(err, Error::Io(e) if e.kind() == io::ErrorKind::WouldBlock));
        assert_eq!(got, frame(b"abc"));
    }
}
