//! The guest runtime the generated stubs call: a connection per application thread to the
//! router, request building with bulk data placed in shared memory, reply decoding, object
//! shells (the pointers the application holds), and info-result translation.

use hira_opencl::cl::*;
use hira_opencl::{InfoMode, K_EVENT, K_MEM, K_PLATFORM};
use hira_transport::{Conn, FrameReader, ShmRegion};
use hira_wire::{
    control, flags, Blob, Header, Kind, OutSpec, Reader, Writer, HEADER_LEN, MAX_FRAME,
};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

pub use crate::callbacks::CallbackKind;

/// Payloads up to this size travel inside the frame; larger ones through shared memory.
const INLINE_MAX: u64 = 32 << 10;
/// Initial shared-memory region (virtual; pages are touched only when used).
const SHM_INITIAL: usize = 64 << 20;
/// Largest shared-memory region a connection grows to.
const SHM_MAX: usize = 1 << 31;
/// How long a thread waiting for a reply polls (yielding) before it sleeps — only while its
/// recent replies came back faster than that. `HIRA_POLL_US` overrides it (0 = never poll):
/// polling saves a wake-up per call, but on a CPU device it competes with the kernels.
fn poll_window() -> std::time::Duration {
    static W: OnceLock<std::time::Duration> = OnceLock::new();
    *W.get_or_init(|| {
        let us = std::env::var("HIRA_POLL_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(40);
        std::time::Duration::from_micros(us)
    })
}
/// Flush the batch of asynchronous calls once it holds this many bytes.
const BATCH_MAX: usize = 64 << 10;

/// An object the application holds: the ICD loader requires the dispatch pointer first.
#[repr(C)]
pub struct Shell {
    dispatch: *const crate::IcdDispatch,
    pub id: u64,
    pub kind: u8,
    /// CL_MEM_USE_HOST_PTR buffers: the application's pointer.
    pub host_ptr: std::sync::atomic::AtomicPtr<c_void>,
    /// A buffer the server placed in the arena (its transfers and maps are done in place).
    pub in_arena: std::sync::atomic::AtomicBool,
    /// A launch's event the server posts on the event board (`board.rs`).
    pub on_board: std::sync::atomic::AtomicBool,
    /// An event's references held by the application and by its pending callbacks
    /// (`events.rs`); unused for other kinds.
    refs: std::sync::atomic::AtomicU32,
}

#[derive(Default)]
struct Shells {
    by_id: HashMap<u64, usize>,
    by_addr: HashMap<usize, u64>,
}

fn shells() -> std::sync::MutexGuard<'static, Shells> {
    static S: OnceLock<Mutex<Shells>> = OnceLock::new();
    S.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The shell for server object `id` of `kind` (the same pointer every time), or null for 0.
pub fn shell(id: u64, kind: u8) -> *mut c_void {
    if id == 0 {
        return std::ptr::null_mut();
    }
    let mut s = shells();
    if let Some(&p) = s.by_id.get(&id) {
        return p as *mut c_void;
    }
    let b = Box::new(Shell {
        dispatch: &crate::DISPATCH,
        id,
        kind,
        host_ptr: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
        in_arena: std::sync::atomic::AtomicBool::new(false),
        on_board: std::sync::atomic::AtomicBool::new(false),
        refs: std::sync::atomic::AtomicU32::new(1),
    });
    let p = Box::into_raw(b) as usize;
    s.by_id.insert(id, p);
    s.by_addr.insert(p, id);
    p as *mut c_void
}

/// One more reference to event shell `p` (nothing for other pointers).
pub fn event_ref(p: *mut c_void) {
    if let Some(s) = shell_ref(p).filter(|s| s.kind == K_EVENT) {
        s.refs.fetch_add(1, Ordering::SeqCst);
    }
}

/// One reference fewer to event shell `p`; the last frees it (`events.rs`). Over-releases are
/// ignored (the server answers them).
pub fn event_unref(p: *mut c_void) {
    let mut s = shells();
    let Some(&id) = s.by_addr.get(&(p as usize)) else {
        return;
    };
    // SAFETY: a live shell (it is in the table, and shells leave it only here, under the lock).
    let shell = unsafe { &*(p as *const Shell) };
    if shell.kind != K_EVENT {
        return;
    }
    let before = shell
        .refs
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    if before == Ok(1) {
        s.by_addr.remove(&(p as usize));
        s.by_id.remove(&id);
        drop(s);
        // SAFETY: made by Box::into_raw in `shell`, out of the table now, no reference left.
        drop(unsafe { Box::from_raw(p as *mut Shell) });
        crate::infocache::forget_event(id);
    }
}

/// The shell behind an application pointer, if it is one of ours. Found by address: the
/// value may be any 8 bytes (a kernel argument), so it is never dereferenced unless known.
pub fn shell_ref<'a>(p: *mut c_void) -> Option<&'a Shell> {
    if p.is_null() || !shells().by_addr.contains_key(&(p as usize)) {
        return None;
    }
    // SAFETY: p is a live shell: shells are never freed, but for events whose last
    // reference the application gave up (using one after that is the application's error).
    Some(unsafe { &*(p as *const Shell) })
}

/// The wire id of an application handle: 0 for null, an id no table holds for a pointer
/// that is not one of our shells (so the server answers with the API's invalid-handle error).
pub fn id_of(p: *mut c_void) -> u64 {
    match shell_ref(p) {
        Some(s) => s.id,
        None if p.is_null() => 0,
        None => u64::MAX,
    }
}

static NEXT_GUEST_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh id for an object the guest names before the server creates it (events of
/// asynchronous enqueues); the high bit keeps it apart from server-assigned ids.
fn guest_id() -> u64 {
    (1 << 63) | NEXT_GUEST_ID.fetch_add(1, Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------
// Connections

/// One connection to the router.
pub struct Connection {
    /// The batch of asynchronous frames and the sending end (shared with `OUTBOXES`).
    out: Arc<Mutex<Outbox>>,
    reader: FrameReader,
    shm: ShmRegion,
    shm_top: u64,
    seq: u64,
    /// Calls being built on this thread (nested helper calls must not reset the shm).
    building: u32,
    /// First error of an earlier asynchronous call, not yet reported.
    deferred: i32,
    /// Requests sent whose replies have not been read.
    outstanding: u32,
    /// Moving average of the time replies take (decides whether to poll for the next).
    recent_wait: std::time::Duration,
    /// Replies the router has no use for come straight from the API server on this socket
    /// (`control::OPT_DIRECT`); everything else, FAILED frames included, on `reader`.
    direct: Option<FrameReader>,
    /// The event board went to the server on this connection.
    board_sent: bool,
    /// Other connections' asynchronous requests as of this connection's last fence, and how
    /// far it fenced on each (`fence`).
    others_seen: u64,
    fenced: HashMap<u64, u64>,
}

/// Whether this connection asks for a direct reply socket (`HIRA_DIRECT=0`: no, every reply
/// through the router).
fn want_direct() -> bool {
    static W: OnceLock<bool> = OnceLock::new();
    *W.get_or_init(|| std::env::var("HIRA_DIRECT").map_or(true, |v| v != "0"))
}

/// Polls `fds` for input: `timeout_ms` as poll(2) takes it. The readable ones are marked.
fn poll_in(fds: &[i32], timeout_ms: i32) -> [bool; 2] {
    let mut p = [libc::pollfd {
        fd: -1,
        events: libc::POLLIN,
        revents: 0,
    }; 2];
    for (slot, &fd) in p.iter_mut().zip(fds) {
        slot.fd = fd;
    }
    let n = fds.len().min(2);
    // SAFETY: `n` valid pollfds on sockets this connection owns.
    let r = unsafe { libc::poll(p.as_mut_ptr(), n as libc::nfds_t, timeout_ms) };
    if r <= 0 {
        return [false; 2];
    }
    [0, 1].map(|i| i < n && p[i].revents != 0)
}

fn socket_path() -> Option<std::path::PathBuf> {
    std::env::var_os("HIRA_SOCKET").map(Into::into)
}

impl Connection {
    pub fn open(role: u32) -> Result<Connection, i32> {
        let path = socket_path().ok_or(CL_DEVICE_NOT_AVAILABLE)?;
        let sock = Conn::connect(&path).map_err(|e| log_err("connect", e))?;
        let shm = ShmRegion::create("hira-guest", SHM_INITIAL).map_err(|e| log_err("shm", e))?;
        let mut w = Writer::with_header_room(HEADER_LEN);
        w.u32(role);
        w.u32(std::process::id());
        // SAFETY: gettid has no preconditions.
        w.u64(unsafe { libc::gettid() } as u64);
        w.u64(shm.len() as u64);
        w.u32(if role == control::ROLE_CALLS && want_direct() {
            control::OPT_DIRECT
        } else {
            0
        });
        finish_frame(&mut w.buf, Kind::Control, control::HELLO, 0, 0, 0);
        sock.send(&w.buf, &[shm.fd()])
            .map_err(|e| log_err("hello", e))?;
        let reader = FrameReader::new(sock.try_clone().map_err(|e| log_err("clone", e))?);
        let mut c = Connection {
            out: Outbox::register(sock),
            reader,
            shm,
            shm_top: 0,
            seq: 0,
            building: 0,
            deferred: 0,
            outstanding: 0,
            recent_wait: std::time::Duration::ZERO,
            direct: None,
            board_sent: false,
            others_seen: 0,
            fenced: HashMap::new(),
        };
        let (h, payload) = c.read_frame()?;
        let mut r = Reader::new(&payload);
        let (_tenant, conn, status) = (r.u64(), r.u64(), r.i32().unwrap_or(CL_OUT_OF_RESOURCES));
        lock(&c.out).conn_id = conn.unwrap_or(0);
        if h.opcode != control::WELCOME || status != 0 {
            return Err(if status != 0 {
                status
            } else {
                CL_OUT_OF_RESOURCES
            });
        }
        if r.u32().unwrap_or(0) & control::OPT_DIRECT != 0 {
            let fd = c.reader.take_fd().ok_or_else(|| {
                log_code(
                    "WELCOME announces a direct reply socket but carries none",
                    CL_OUT_OF_RESOURCES,
                )
            })?;
            c.direct = Some(FrameReader::new(Conn::from_owned(fd)));
        }
        Ok(c)
    }

    /// The next frame from the router (the callback listener's loop).
    pub fn next_frame(&mut self) -> Result<(Header, Vec<u8>), i32> {
        self.read_frame()
    }

    fn read_frame(&mut self) -> Result<(Header, Vec<u8>), i32> {
        let start = std::time::Instant::now();
        let window = poll_window();
        let from_direct = match &self.direct {
            None => {
                if self.recent_wait < window {
                    self.reader.spin_until_readable(window);
                }
                false
            }
            Some(direct) => {
                let fds = [self.reader.conn().as_raw_fd(), direct.conn().as_raw_fd()];
                let deadline = start + window;
                let mut ready = [self.reader.buffered() > 0, direct.buffered() > 0];
                if ready == [false, false] && self.recent_wait < window {
                    // Poll (yielding) before sleeping, as with one socket.
                    while ready == [false, false] && std::time::Instant::now() < deadline {
                        ready = poll_in(&fds, 0);
                        if ready == [false, false] {
                            std::thread::yield_now();
                        }
                    }
                }
                while ready == [false, false] {
                    ready = poll_in(&fds, -1);
                }
                // The router's frames first: a FAILED there may end the wait.
                !ready[0]
            }
        };
        let reader = if from_direct {
            self.direct.as_mut().expect("direct socket present")
        } else {
            &mut self.reader
        };
        let got = match reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {
            Ok(Some(f)) => Ok(Some((
                Header::parse(f).map_err(|_| CL_OUT_OF_RESOURCES)?,
                f[HEADER_LEN..].to_vec(),
            ))),
            Ok(None) => Ok(None),
            Err(e) => Err(e),
        };
        match got {
            Ok(Some(frame)) => {
                // Moving average of how long replies take.
                self.recent_wait = (self.recent_wait * 3 + start.elapsed()) / 4;
                Ok(frame)
            }
            Ok(None) if from_direct => {
                // The API server is gone; the router answers what follows.
                self.direct = None;
                Err(log_code(
                    "API server closed the direct reply socket",
                    CL_OUT_OF_RESOURCES,
                ))
            }
            Ok(None) => Err(log_code(
                "router closed the connection",
                CL_OUT_OF_RESOURCES,
            )),
            Err(e) => Err(log_err("read", e)),
        }
    }

    fn flush(&mut self) -> Result<(), i32> {
        lock(&self.out).flush()
    }

    /// Adds a frame to the batch; its length after.
    fn push(&mut self, frame: &[u8]) -> usize {
        lock(&self.out).push(frame)
    }

    /// Sends what is batched, then `frame` with `fds`.
    fn send_now(&mut self, frame: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<(), i32> {
        let mut o = lock(&self.out);
        o.flush()?;
        o.sock.send(frame, fds).map_err(|e| log_err("send", e))
    }

    /// Room in shared memory for `len` bytes; grows the region if needed.
    fn shm_alloc(&mut self, len: u64) -> Result<u64, i32> {
        let at = (self.shm_top + 63) & !63;
        let end = at.checked_add(len).ok_or(CL_OUT_OF_HOST_MEMORY)?;
        if end > self.shm.len() as u64 {
            self.grow(end)?;
        }
        self.shm_top = end;
        Ok(at)
    }

    fn grow(&mut self, need: u64) -> Result<(), i32> {
        let mut size = self.shm.len();
        while (size as u64) < need {
            size = size.saturating_mul(2);
        }
        if size > SHM_MAX {
            return Err(log_code(
                "transfer larger than the shared-memory limit",
                CL_OUT_OF_HOST_MEMORY,
            ));
        }
        let new = ShmRegion::create("hira-guest", size).map_err(|e| log_err("shm", e))?;
        // Keep what a call under construction already placed.
        if self.shm_top > 0 {
            // SAFETY: both regions are at least shm_top bytes long and distinct mappings.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.shm.as_ptr(),
                    new.as_ptr(),
                    self.shm_top as usize,
                )
            };
        }
        let mut w = Writer::with_header_room(HEADER_LEN);
        w.u64(size as u64);
        self.seq += 1;
        finish_frame(
            &mut w.buf,
            Kind::Control,
            control::SHM_GROW,
            self.seq,
            flags::ASYNC,
            0,
        );
        self.send_now(&w.buf, &[new.fd().as_fd()])?;
        self.shm = new;
        Ok(())
    }
}

impl Connection {
    /// An asynchronous control frame with one fd, in order after everything batched.
    pub fn send_control_fd(
        &mut self,
        opcode: u16,
        payload: &[u8],
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<(), i32> {
        let mut w = Writer::with_header_room(HEADER_LEN);
        w.buf.extend_from_slice(payload);
        self.seq += 1;
        finish_frame(&mut w.buf, Kind::Control, opcode, self.seq, flags::ASYNC, 0);
        self.send_now(&w.buf, &[fd])
    }
}

impl Connection {
    /// Sends the event board unless this connection did (in order before what follows).
    pub fn send_board_once(&mut self, b: &hira_transport::EventBoard) -> Result<(), i32> {
        if !self.board_sent {
            self.send_control_fd(control::EVENT_BOARD, &[], b.fd())?;
            self.board_sent = true;
        }
        Ok(())
    }
}

impl Connection {
    /// Before a call that waits, once the other threads' batches are sent: if other
    /// connections sent asynchronous requests since this one last looked, a FENCE naming how
    /// far each got goes first, and the server runs the call only after they ran (frames of
    /// different connections are run by different server threads). One atomic load when no
    /// other thread sent anything.
    fn fence(&mut self) {
        let own = lock(&self.out).sent_frames;
        let others = ASYNC_SENT.load(Ordering::SeqCst).saturating_sub(own);
        if others == self.others_seen {
            return;
        }
        self.others_seen = others;
        let all: Vec<_> = OUTBOXES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .filter(|o| !Arc::ptr_eq(o, &self.out))
            .collect();
        let mut w = Writer::with_header_room(HEADER_LEN);
        for o in &all {
            let (conn, sent) = {
                let o = lock(o);
                (o.conn_id, o.sent_async)
            };
            if conn == 0 {
                continue;
            }
            let seen = self.fenced.entry(conn).or_insert(0);
            if sent > *seen {
                *seen = sent;
                w.u64(conn);
                w.u64(sent);
            }
        }
        if w.buf.len() > HEADER_LEN {
            self.seq += 1;
            finish_frame(
                &mut w.buf,
                Kind::Control,
                control::FENCE,
                self.seq,
                flags::ASYNC,
                0,
            );
            self.push(&w.buf);
        }
    }
}

/// Sends this thread's batched asynchronous calls now, and every other thread's first.
pub fn flush_batch() -> Result<(), i32> {
    with_conn(|c| {
        flush_others(&c.out);
        c.flush()
    })
}

impl Drop for Connection {
    /// A thread that ends sends what it batched: natively its commands are enqueued.
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// A connection's batch of asynchronous frames and its sending end. Natively a command one
/// thread enqueued is there for every thread at once: before a call that waits for the
/// server, a thread sends the other threads' batches too (`flush_others`), each under its
/// lock, so every connection's frames still leave in order.
pub struct Outbox {
    sock: Conn,
    batch: Vec<u8>,
    /// The connection's id, as WELCOME named it (0 until then).
    conn_id: u64,
    /// Sequence number of the last asynchronous request batched, and of the last one sent.
    async_seq: u64,
    sent_async: u64,
    /// Asynchronous requests in the batch, and sent so far (its part of `ASYNC_SENT`).
    batched_async: u64,
    sent_frames: u64,
}

/// Every connection's outbox (dead ones are dropped as they are found).
static OUTBOXES: Mutex<Vec<std::sync::Weak<Mutex<Outbox>>>> = Mutex::new(Vec::new());
/// Outboxes holding frames.
static PENDING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Asynchronous requests sent by every connection of the process, ever.
static ASYNC_SENT: AtomicU64 = AtomicU64::new(0);

fn lock(o: &Mutex<Outbox>) -> std::sync::MutexGuard<'_, Outbox> {
    o.lock().unwrap_or_else(|e| e.into_inner())
}

impl Outbox {
    fn register(sock: Conn) -> Arc<Mutex<Outbox>> {
        let o = Arc::new(Mutex::new(Outbox {
            sock,
            batch: Vec::new(),
            conn_id: 0,
            async_seq: 0,
            sent_async: 0,
            batched_async: 0,
            sent_frames: 0,
        }));
        let mut all = OUTBOXES.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&o));
        o
    }

    fn push(&mut self, frame: &[u8]) -> usize {
        if self.batch.is_empty() && !frame.is_empty() {
            PENDING.fetch_add(1, Ordering::SeqCst);
        }
        if let Ok(h) = Header::parse(frame) {
            if h.kind == Kind::Request && h.flags & flags::ASYNC != 0 {
                self.async_seq = h.seq;
                self.batched_async += 1;
            }
        }
        self.batch.extend_from_slice(frame);
        self.batch.len()
    }

    fn flush(&mut self) -> Result<(), i32> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let r = self.sock.send(&self.batch, &[]);
        self.batch.clear();
        self.sent_async = self.async_seq;
        let n = std::mem::take(&mut self.batched_async);
        self.sent_frames += n;
        ASYNC_SENT.fetch_add(n, Ordering::SeqCst);
        PENDING.fetch_sub(1, Ordering::SeqCst);
        r.map_err(|e| log_err("send", e))
    }
}

/// Sends the batches of every connection but `own`; nothing to do (one atomic load) unless
/// another holds frames.
fn flush_others(own: &Arc<Mutex<Outbox>>) {
    let mine = usize::from(!lock(own).batch.is_empty());
    if PENDING.load(Ordering::SeqCst) <= mine {
        return;
    }
    let all: Vec<_> = OUTBOXES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .collect();
    for o in all.iter().filter(|o| !Arc::ptr_eq(o, own)) {
        let _ = lock(o).flush();
    }
}

/// The first error of an earlier asynchronous call this thread's connection heard of and has
/// not reported (0: none); a synchronizing call returns it instead of success.
pub fn take_deferred() -> Result<i32, i32> {
    let d = with_conn(|c| Ok(std::mem::take(&mut c.deferred)))?;
    Ok(if d != 0 {
        log_code("an earlier asynchronous call failed", d)
    } else {
        CL_SUCCESS
    })
}

fn finish_frame(buf: &mut [u8], kind: Kind, opcode: u16, seq: u64, fl: u8, bulk: u64) {
    let mut h = Header::new(kind, opcode, seq, buf.len() - HEADER_LEN);
    h.flags = fl;
    h.bulk = bulk;
    h.write_to(&mut buf[..HEADER_LEN]);
}

fn log_err(what: &str, e: impl std::fmt::Display) -> i32 {
    if std::env::var_os("HIRA_DEBUG").is_some() {
        eprintln!("hira: {what}: {e}");
    }
    CL_OUT_OF_RESOURCES
}

fn log_code(what: &str, code: i32) -> i32 {
    if std::env::var_os("HIRA_DEBUG").is_some() {
        eprintln!("hira: {what} ({code})");
    }
    code
}

thread_local! {
    static CONN: RefCell<Option<Connection>> = const { RefCell::new(None) };
}

/// Run `f` on this thread's connection, opening it on first use.
pub fn with_conn<T>(f: impl FnOnce(&mut Connection) -> Result<T, i32>) -> Result<T, i32> {
    CONN.with(|c| {
        let mut c = c.try_borrow_mut().map_err(|_| CL_OUT_OF_RESOURCES)?;
        if c.is_none() {
            *c = Some(Connection::open(control::ROLE_CALLS)?);
        }
        f(c.as_mut().expect("opened above"))
    })
}

/// Whether a router can be reached at all (for platform enumeration).
pub fn available() -> bool {
    with_conn(|_| Ok(())).is_ok()
}

// ---------------------------------------------------------------------------------------
// Calls

enum OutSlot {
    Null,
    Inline { ptr: *mut u8, cap: u64 },
    Shm { ptr: *mut u8, off: u64, cap: u64 },
}

/// A request under construction.
pub struct Call {
    op: u16,
    w: Writer,
    outs: Vec<OutSlot>,
    bulk: u64,
    saved_info: Option<Vec<u8>>,
    use_host_ptr: *mut c_void,
}

impl Drop for Call {
    fn drop(&mut self) {
        let _ = with_conn(|c| {
            c.building = c.building.saturating_sub(1);
            Ok(())
        });
    }
}

impl Call {
    pub fn new(op: u16) -> Call {
        let _ = with_conn(|c| {
            c.building += 1;
            Ok(())
        });
        Call {
            op,
            w: Writer::with_header_room(HEADER_LEN),
            outs: Vec::new(),
            bulk: 0,
            saved_info: None,
            use_host_ptr: std::ptr::null_mut(),
        }
    }

    pub fn u64(&mut self, v: u64) {
        self.w.u64(v);
    }

    pub fn handle(&mut self, h: *mut c_void) {
        self.w.u64(id_of(h));
    }

    fn blob(&mut self, p: *const u8, len: u64) -> Result<(), i32> {
        if p.is_null() {
            self.w.blob(Blob::Null);
            return Ok(());
        }
        // SAFETY: the application passes `len` readable bytes at `p` (API contract; the
        // length comes from the spec's descriptor for this parameter).
        let data = unsafe { std::slice::from_raw_parts(p, len as usize) };
        if len <= INLINE_MAX {
            self.w.blob(Blob::Inline(data));
            return Ok(());
        }
        let off = with_conn(|c| {
            let off = c.shm_alloc(len)?;
            c.shm
                .write_at(off, data)
                .map_err(|e| log_err("shm write", e))?;
            Ok(off)
        })?;
        self.bulk += len;
        self.w.blob(Blob::Shm { offset: off, len });
        Ok(())
    }

    /// # Safety
    /// `p` is null or points to `len` readable bytes.
    pub unsafe fn in_bytes(&mut self, p: *const u8, len: u64) {
        if self.blob(p, len).is_err() {
            self.w.blob(Blob::Null);
        }
    }

    /// # Safety
    /// `p` is null or points to `n` handles.
    pub unsafe fn in_handles(&mut self, p: *const *mut c_void, n: u64) {
        if p.is_null() {
            self.w.blob(Blob::Null);
            return;
        }
        let mut ids = Vec::with_capacity(n as usize * 8);
        for i in 0..n as usize {
            // SAFETY: the caller passes n handles.
            ids.extend_from_slice(&id_of(unsafe { *p.add(i) }).to_le_bytes());
        }
        self.w.blob(Blob::Inline(&ids));
    }

    /// # Safety
    /// `p` is null or a NUL-terminated string.
    pub unsafe fn string(&mut self, p: *const std::ffi::c_char) {
        if p.is_null() {
            self.w.blob(Blob::Null);
            return;
        }
        // SAFETY: NUL-terminated by contract.
        let s = unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes();
        // SAFETY: s is a live slice.
        unsafe { self.in_bytes(s.as_ptr(), s.len() as u64) };
    }

    /// `n` strings; a null or zero entry in `lengths` means NUL-terminated.
    ///
    /// # Safety
    /// `p` is null or points to `n` pointers to strings/buffers of the given lengths.
    pub unsafe fn strings(&mut self, p: *const *const u8, n: u64, lengths: *const usize) {
        if p.is_null() {
            self.w.u64(u64::MAX);
            return;
        }
        self.w.u64(n);
        for i in 0..n as usize {
            // SAFETY: the caller passes n entries.
            let s = unsafe { *p.add(i) };
            let given = if lengths.is_null() {
                0
            } else {
                // SAFETY: lengths, if given, has n entries.
                unsafe { *lengths.add(i) }
            };
            let len = if s.is_null() {
                0
            } else if given != 0 {
                given
            } else {
                // SAFETY: NUL-terminated by contract when no length is given.
                unsafe { std::ffi::CStr::from_ptr(s as *const std::ffi::c_char) }
                    .to_bytes()
                    .len()
            };
            // SAFETY: s has len readable bytes.
            unsafe { self.in_bytes(s, len as u64) };
        }
    }

    /// A zero-terminated property list (pairs of 64-bit values).
    ///
    /// # Safety
    /// `p` is null or a zero-terminated list of key/value pairs.
    pub unsafe fn properties(&mut self, p: *const u64, context: bool) {
        if p.is_null() {
            self.w.blob(Blob::Null);
            return;
        }
        let mut v = Vec::new();
        let mut i = 0;
        loop {
            // SAFETY: zero-terminated by contract.
            let key = unsafe { *p.add(i) };
            v.extend_from_slice(&key.to_le_bytes());
            if key == 0 || i > 1024 {
                break;
            }
            // SAFETY: every non-zero key has a value.
            let mut val = unsafe { *p.add(i + 1) };
            if context && key as i64 == CL_CONTEXT_PLATFORM {
                val = id_of(val as *mut c_void);
            }
            v.extend_from_slice(&val.to_le_bytes());
            i += 2;
        }
        self.w.blob(Blob::Inline(&v));
    }

    /// A host pointer read only when the flags ask the implementation to read it.
    ///
    /// # Safety
    /// When flags hold USE/COPY_HOST_PTR, `p` points to `len` readable bytes.
    pub unsafe fn host_buffer(&mut self, p: *const u8, flags: u64, len: u64) {
        if flags & CL_MEM_USE_HOST_PTR != 0 {
            self.use_host_ptr = p as *mut c_void;
            if self.svm_host_ptr(p, flags, len) {
                return;
            }
        }
        if flags & (CL_MEM_USE_HOST_PTR | CL_MEM_COPY_HOST_PTR) != 0 {
            // SAFETY: as above.
            unsafe { self.in_bytes(p, len) };
        } else {
            self.w.blob(if p.is_null() {
                Blob::Null
            } else {
                Blob::Inline(&[])
            });
        }
    }

    /// A CL_MEM_USE_HOST_PTR buffer inside an SVM mirror (`svm.rs`): the server creates it on
    /// its allocation, so the buffer aliases the SVM memory. The flags, written just before
    /// the size, get the marking bit and the host pointer travels as the server pointer.
    /// False (nothing written) for anything else.
    fn svm_host_ptr(&mut self, p: *const u8, flags: u64, len: u64) -> bool {
        use hira_opencl::{OP_CLCREATEBUFFER, OP_CLCREATEBUFFERWITHPROPERTIES};
        if !matches!(self.op, OP_CLCREATEBUFFER | OP_CLCREATEBUFFERWITHPROPERTIES) {
            return false;
        }
        let Some(server) = crate::svm::buffer_alias(p, len) else {
            return false;
        };
        let buf = &mut self.w.buf;
        let Some(at) = buf.len().checked_sub(16).filter(|&at| at >= HEADER_LEN) else {
            return false;
        };
        let word = |b: &[u8], i: usize| {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(v)
        };
        if word(buf, at) != flags || word(buf, at + 8) != len {
            return false;
        }
        buf[at..at + 8].copy_from_slice(&(flags | crate::svm::HOST_PTR_IS_SVM).to_le_bytes());
        self.w.blob(Blob::Inline(&server.to_le_bytes()));
        true
    }

    /// A `cl_image_desc` (72 bytes), its mem_object translated.
    ///
    /// # Safety
    /// `p` is null or points to a cl_image_desc.
    pub unsafe fn image_desc(&mut self, p: *const u8) {
        if p.is_null() {
            self.w.blob(Blob::Null);
            return;
        }
        let mut d = [0u8; 72];
        // SAFETY: a cl_image_desc is 72 bytes.
        unsafe { std::ptr::copy_nonoverlapping(p, d.as_mut_ptr(), 72) };
        let mut mem = [0u8; 8];
        mem.copy_from_slice(&d[64..72]);
        let id = id_of(u64::from_le_bytes(mem) as *mut c_void);
        d[64..72].copy_from_slice(&id.to_le_bytes());
        self.w.blob(Blob::Inline(&d));
    }

    /// A kernel argument: NULL (local memory), a handle (memory object, sampler, queue) or bytes.
    ///
    /// # Safety
    /// `p` is null or points to `size` readable bytes.
    pub unsafe fn kernel_arg(&mut self, p: *const u8, size: u64) {
        if p.is_null() {
            self.w.u8(0);
            return;
        }
        if size == 8 {
            // SAFETY: 8 readable bytes.
            let v = unsafe { std::ptr::read_unaligned(p as *const u64) };
            if let Some(s) = shell_ref(v as *mut c_void) {
                self.w.u8(2);
                self.w.u64(s.id);
                return;
            }
        }
        self.w.u8(1);
        // SAFETY: as above.
        unsafe { self.in_bytes(p, size) };
    }

    pub fn callback(&mut self, kind: CallbackKind, pfn: *mut c_void, user_data: *mut c_void) {
        let id = if pfn.is_null() {
            0
        } else {
            crate::callbacks::register(kind, pfn, user_data)
        };
        self.w.u64(id);
    }

    /// An object the call will create, named by the guest now.
    ///
    /// # Safety
    /// `p` is null or writable.
    pub unsafe fn new_handle(&mut self, p: *mut *mut c_void, kind: u8) {
        if p.is_null() {
            self.w.u64(0);
            return;
        }
        let id = guest_id();
        // SAFETY: writable by contract.
        unsafe { *p = shell(id, kind) };
        self.w.u64(id);
        if kind == K_EVENT && hira_opencl::op(self.op).is_some_and(|o| o.device_time) {
            crate::board::mark(p);
        }
    }

    /// Room for `cap` output bytes at `p`.
    pub fn out_bytes(&mut self, p: *mut u8, cap: u64) {
        if p.is_null() {
            self.w.out_spec(OutSpec::Null);
            self.outs.push(OutSlot::Null);
            return;
        }
        if cap > INLINE_MAX {
            if let Ok(off) = with_conn(|c| c.shm_alloc(cap)) {
                self.w.out_spec(OutSpec::Shm {
                    offset: off,
                    len: cap,
                });
                self.outs.push(OutSlot::Shm { ptr: p, off, cap });
                self.bulk += cap;
                return;
            }
        }
        self.w.out_spec(OutSpec::Inline { len: cap });
        self.outs.push(OutSlot::Inline { ptr: p, cap });
    }

    /// An info-query result; keeps what the guest answers itself.
    pub fn out_info(&mut self, param: u32, p: *mut u8, cap: u64) {
        if param == CL_PROGRAM_BINARIES && !p.is_null() {
            // SAFETY: cap bytes at p (API contract).
            self.saved_info = Some(unsafe { std::slice::from_raw_parts(p, cap as usize) }.to_vec());
        }
        self.out_bytes(p, cap);
    }

    fn frame(&mut self, fl: u8) -> Result<(), i32> {
        let bulk = self.bulk;
        let op = self.op;
        let buf = &mut self.w.buf;
        with_conn(|c| {
            c.seq += 1;
            finish_frame(buf, Kind::Request, op, c.seq, fl, bulk);
            Ok(())
        })
    }

    /// Forward without waiting; the frame joins the batch.
    pub fn send_async(mut self) -> Result<i32, i32> {
        self.frame(flags::ASYNC)?;
        let buf = std::mem::take(&mut self.w.buf);
        // Releasing a memory object, context or program may fire a destructor callback the
        // application waits for without making another call, releasing a queue flushes it,
        // and clFlush promises progress: these leave at once. Releasing an event, a kernel,
        // a sampler or a device has no such effect and waits for the next send (in a loop of
        // launch, wait, release, the release would otherwise cost a send of its own).
        let urgent = matches!(
            self.op,
            hira_opencl::OP_CLFLUSH
                | hira_opencl::OP_CLRELEASEMEMOBJECT
                | hira_opencl::OP_CLRELEASECONTEXT
                | hira_opencl::OP_CLRELEASEPROGRAM
                | hira_opencl::OP_CLRELEASECOMMANDQUEUE
        );
        with_conn(|c| {
            if c.push(&buf) >= BATCH_MAX || urgent {
                if self.op == hira_opencl::OP_CLFLUSH {
                    // The queue may hold commands other threads enqueued.
                    flush_others(&c.out);
                }
                c.flush()?;
            }
            Ok(CL_SUCCESS)
        })
    }

    /// Send (with the pending batch) and wait for the reply.
    pub fn sync(self) -> Result<Reply, i32> {
        self.send()?.wait()
    }

    /// Send (with the pending batch) without waiting: several requests of one thread may be
    /// outstanding (pipelined bulk transfers); their replies come back in order.
    pub fn send(mut self) -> Result<Sent, i32> {
        // Other threads' commands first (and a fence on them, which takes the next sequence
        // number: before this frame gets its own).
        with_conn(|c| {
            flush_others(&c.out);
            c.fence();
            Ok(())
        })?;
        self.frame(0)?;
        let buf = std::mem::take(&mut self.w.buf);
        let seq = with_conn(|c| {
            c.push(&buf);
            c.flush()?;
            c.outstanding += 1;
            Ok(c.seq)
        })?;
        Ok(Sent {
            seq,
            outs: std::mem::take(&mut self.outs),
            saved_info: self.saved_info.take(),
            use_host_ptr: self.use_host_ptr,
            op: self.op,
        })
    }
}

/// A request sent and not yet answered.
pub struct Sent {
    seq: u64,
    outs: Vec<OutSlot>,
    saved_info: Option<Vec<u8>>,
    use_host_ptr: *mut c_void,
    op: u16,
}

impl Sent {
    /// Wait for this request's reply.
    pub fn wait(self) -> Result<Reply, i32> {
        let seq = self.seq;
        let (h, payload) = with_conn(|c| loop {
            let (h, payload) = c.read_frame()?;
            if h.kind == Kind::Control && h.opcode == control::FAILED {
                let code = Reader::new(&payload).i32().unwrap_or(CL_OUT_OF_RESOURCES);
                if h.seq == seq || h.seq == 0 {
                    c.outstanding = c.outstanding.saturating_sub(1);
                    return Err(log_code("call failed in the router", code));
                }
                continue;
            }
            if h.kind == Kind::Reply && h.seq == seq {
                c.outstanding = c.outstanding.saturating_sub(1);
                // Every earlier frame has run: the shared memory is free again.
                if c.building <= 1 && c.outstanding == 0 {
                    c.shm_top = 0;
                }
                return Ok((h, payload));
            }
        })?;
        let mut r = Reply {
            payload,
            pos: 0,
            outs: self.outs,
            next: 0,
            saved_info: self.saved_info,
            use_host_ptr: self.use_host_ptr,
            op: self.op,
        };
        let status = {
            let mut rd = Reader::new(&r.payload);
            let s = rd.i32().map_err(|_| CL_OUT_OF_RESOURCES)?;
            if h.flags & flags::DEFERRED_ERROR != 0 {
                let d = rd.i32().map_err(|_| CL_OUT_OF_RESOURCES)?;
                let _ = with_conn(|c| {
                    if c.deferred == 0 {
                        c.deferred = d;
                    }
                    Ok(())
                });
                r.pos = 8;
            } else {
                r.pos = 4;
            }
            s
        };
        if status != 0 {
            return Err(status);
        }
        Ok(r)
    }
}

/// A decoded reply: `[status i32][deferred i32 if flagged][payload]`.
pub struct Reply {
    payload: Vec<u8>,
    pos: usize,
    outs: Vec<OutSlot>,
    next: usize,
    op: u16,
    saved_info: Option<Vec<u8>>,
    use_host_ptr: *mut c_void,
}

impl Reply {
    /// The shell of an object this call created.
    pub fn created(&self, id: u64, kind: u8) -> *mut c_void {
        let h = shell(id, kind);
        if !self.use_host_ptr.is_null() {
            set_host_ptr(h, self.use_host_ptr);
        }
        if matches!(
            self.op,
            hira_opencl::OP_CLCREATEBUFFER | hira_opencl::OP_CLCREATEBUFFERWITHPROPERTIES
        ) {
            // The server's reply ends with where it placed the buffer in the arena (0: not).
            let placed = self.reader().u64().unwrap_or(0);
            if let Some(s) = shell_ref(h).filter(|_| placed != 0) {
                s.in_arena.store(true, Ordering::Relaxed);
            }
        }
        h
    }

    fn reader(&self) -> Reader<'_> {
        Reader::new(&self.payload[self.pos..])
    }
    pub fn i32(&mut self) -> Result<i32, i32> {
        let v = self.reader().i32().map_err(|_| CL_OUT_OF_RESOURCES)?;
        self.pos += 4;
        Ok(v)
    }
    pub fn u64(&mut self) -> Result<u64, i32> {
        let v = self.reader().u64().map_err(|_| CL_OUT_OF_RESOURCES)?;
        self.pos += 8;
        Ok(v)
    }

    /// Copy the next output into place; returns the bytes written.
    ///
    /// # Safety
    /// `p` is the pointer registered for this output.
    pub unsafe fn out_bytes(&mut self, _p: *mut u8) -> Result<u64, i32> {
        let slot = self.outs.get(self.next).ok_or(CL_OUT_OF_RESOURCES)?;
        self.next += 1;
        match *slot {
            OutSlot::Null => Ok(0),
            OutSlot::Inline { ptr, cap } => {
                let mut rd = self.reader();
                let data = rd.bytes().map_err(|_| CL_OUT_OF_RESOURCES)?;
                let n = (data.len() as u64).min(cap);
                // SAFETY: ptr has cap writable bytes (API contract).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, n as usize) };
                self.pos += 4 + data.len();
                Ok(n)
            }
            OutSlot::Shm { ptr, off, cap } => {
                let n = self.u64()?.min(cap);
                // SAFETY: ptr has cap writable bytes; the region holds [off, off+cap).
                let dst = unsafe { std::slice::from_raw_parts_mut(ptr, n as usize) };
                with_conn(|c| c.shm.read_at(off, dst).map_err(|e| log_err("shm read", e)))?;
                Ok(n)
            }
        }
    }

    /// Translate handle ids in the next output into shells.
    ///
    /// # Safety
    /// `p` is the pointer registered for this output.
    pub unsafe fn out_handles(&mut self, p: *mut *mut c_void, kind: u8) -> Result<(), i32> {
        // SAFETY: forwarded contract.
        let n = unsafe { self.out_bytes(p as *mut u8)? } as usize / 8;
        for i in 0..n {
            // SAFETY: p has at least n entries (written above).
            unsafe {
                let slot = p.add(i);
                let id = *(slot as *const u64);
                *slot = shell(id, kind);
            }
        }
        Ok(())
    }

    /// Translate an info result the server returned in wire form.
    pub fn info(&mut self, op: u16, param: u32, obj: *mut c_void, p: *mut u8, written: u64) {
        if p.is_null() {
            return;
        }
        if op == hira_opencl::OP_CLGETMEMOBJECTINFO && param == CL_MEM_FLAGS && written >= 8 {
            // The server holds a copy of a USE_HOST_PTR buffer; the tenant asked for USE.
            if shell_ref(obj).is_some_and(|s| !s.host_ptr.load(Ordering::Relaxed).is_null()) {
                // SAFETY: at least 8 bytes were written at p.
                unsafe {
                    let f = p as *mut u64;
                    *f = (*f & !CL_MEM_COPY_HOST_PTR) | CL_MEM_USE_HOST_PTR;
                }
            }
            return;
        }
        let Some((mode, kind)) = hira_opencl::info_mode(op, param) else {
            return;
        };
        let words = (written / 8) as usize;
        let word = |i: usize| {
            // SAFETY: i < words, within the written output.
            unsafe { (p as *mut u64).add(i) }
        };
        match mode {
            InfoMode::Handle | InfoMode::Handles => {
                for i in 0..words {
                    // SAFETY: within the output.
                    unsafe { *word(i) = shell(*word(i), kind) as u64 };
                }
            }
            InfoMode::Properties => {
                let mut i = 0;
                while i + 1 < words {
                    // SAFETY: within the output.
                    unsafe {
                        if *word(i) as i64 == CL_CONTEXT_PLATFORM {
                            *word(i + 1) = shell(*word(i + 1), K_PLATFORM) as u64;
                        }
                    }
                    i += 2;
                }
            }
            InfoMode::Guest if param == CL_MEM_HOST_PTR && words >= 1 => {
                let hp = shell_ref(obj)
                    .map_or(std::ptr::null_mut(), |s| s.host_ptr.load(Ordering::Relaxed));
                // SAFETY: within the output.
                unsafe { *word(0) = hp as u64 };
            }
            InfoMode::Guest if param == CL_PROGRAM_BINARIES => {
                if let Some(saved) = self.saved_info.take() {
                    crate::custom::program_binaries(obj, p, &saved);
                }
            }
            InfoMode::Guest => {}
        }
    }

    /// The call's status; a synchronizing call (finish, wait, blocking transfer) that
    /// succeeded reports the first error of an earlier asynchronous call instead.
    pub fn status(&self, ret: i32) -> Result<i32, i32> {
        if ret == CL_SUCCESS && crate::staged::drains_after(self.op) {
            crate::staged::drain();
        }
        if ret != CL_SUCCESS || !is_synchronizing(self.op) {
            return Ok(ret);
        }
        take_deferred()
    }
}

/// Calls at which errors of earlier asynchronous calls surface (AvA §5.6.3.1).
fn is_synchronizing(opcode: u16) -> bool {
    use hira_opencl::*;
    matches!(
        opcode,
        OP_CLFINISH
            | OP_CLWAITFOREVENTS
            | OP_CLENQUEUEREADBUFFER
            | OP_CLENQUEUEREADBUFFERRECT
            | OP_CLENQUEUEREADIMAGE
            | OP_CLENQUEUEWRITEBUFFER
            | OP_CLENQUEUEWRITEBUFFERRECT
            | OP_CLENQUEUEWRITEIMAGE
            | OP_CLENQUEUESVMMEMCPY
            | OP_CLENQUEUESVMMAP
    )
}

// ---------------------------------------------------------------------------------------
// Entry guards

/// Run a status-returning call; a panic or transport failure becomes an OpenCL error.
pub fn status(_op: u16, f: impl FnOnce() -> Result<i32, i32>) -> i32 {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) | Ok(Err(v)) => v,
        Err(_) => CL_OUT_OF_HOST_MEMORY,
    }
}

/// Run an object-creating call: writes errcode_ret and returns the handle (or null).
pub fn create(
    errcode_ret: *mut i32,
    op: u16,
    f: impl FnOnce() -> Result<(*mut c_void, i32), i32>,
) -> *mut c_void {
    if matches!(
        op,
        hira_opencl::OP_CLCREATEBUFFER | hira_opencl::OP_CLCREATEBUFFERWITHPROPERTIES
    ) {
        // The server places buffers in the arena where the device allows (its `direct.rs`).
        crate::svm::ensure_arena();
    }
    let (h, err) = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok((h, err))) => (
            if err == CL_SUCCESS {
                h
            } else {
                std::ptr::null_mut()
            },
            err,
        ),
        Ok(Err(e)) => (std::ptr::null_mut(), e),
        Err(_) => (std::ptr::null_mut(), CL_OUT_OF_HOST_MEMORY),
    };
    if !errcode_ret.is_null() {
        // SAFETY: a non-null errcode_ret points to a cl_int (API contract).
        unsafe { *errcode_ret = err };
    }
    h
}

/// Log a call to a function hira does not forward.
pub fn unsupported(name: &str) {
    log_code(name, CL_INVALID_OPERATION);
}

/// Record the host pointer of a CL_MEM_USE_HOST_PTR buffer.
pub fn set_host_ptr(mem: *mut c_void, p: *mut c_void) {
    if let Some(s) = shell_ref(mem).filter(|s| s.kind == K_MEM) {
        s.host_ptr.store(p, Ordering::Relaxed);
    }
}

/// Runtime-library helpers that size buffers in the spec's expressions.
pub mod expr {
    use super::*;

    fn arr3(p: *const usize) -> [u64; 3] {
        if p.is_null() {
            return [0; 3];
        }
        // SAFETY: the spec describes these as 3-element arrays.
        unsafe { [*p as u64, *p.add(1) as u64, *p.add(2) as u64] }
    }

    /// Host bytes a rectangle transfer touches.
    pub fn rect_size(
        origin: *const usize,
        region: *const usize,
        row_pitch: u64,
        slice_pitch: u64,
    ) -> u64 {
        rect_bytes(arr3(origin), arr3(region), row_pitch, slice_pitch)
    }

    fn image_info(image: *mut c_void, param: u32) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: an 8-byte output for a size_t info value.
        let ret = unsafe {
            crate::stubs::clGetImageInfo(
                image,
                param,
                8,
                &mut v as *mut u64 as *mut c_void,
                std::ptr::null_mut(),
            )
        };
        if ret == CL_SUCCESS {
            v
        } else {
            0
        }
    }

    /// Host bytes of an image read/write of `region` with the given pitches.
    pub fn image_host_size(
        image: *mut c_void,
        region: *const usize,
        row_pitch: u64,
        slice_pitch: u64,
    ) -> u64 {
        image_host_bytes(
            image_info(image, CL_IMAGE_ELEMENT_SIZE),
            arr3(region),
            row_pitch,
            slice_pitch,
        )
    }

    /// The `n` bytes a sized argument points to; None for NULL.
    fn bytes<'a>(p: *const u8, n: usize) -> Option<&'a [u8]> {
        // SAFETY: the spec sizes this argument (a cl_image_format is 8 bytes, a
        // cl_image_desc 72) and it was checked non-null.
        (!p.is_null()).then(|| unsafe { std::slice::from_raw_parts(p, n) })
    }

    /// Bytes of host memory behind an image being created.
    pub fn image_size(format: *const u8, desc: *const u8) -> u64 {
        wire::image_size(bytes(format, 8), bytes(desc, 72)).unwrap_or(0)
    }

    pub fn image2d_size(format: *const u8, w: u64, h: u64, row_pitch: u64) -> u64 {
        wire::image2d_size(bytes(format, 8), w, h, row_pitch).unwrap_or(0)
    }

    pub fn image3d_size(
        format: *const u8,
        w: u64,
        h: u64,
        d: u64,
        row_pitch: u64,
        slice_pitch: u64,
    ) -> u64 {
        wire::image3d_size(bytes(format, 8), w, h, d, row_pitch, slice_pitch).unwrap_or(0)
    }
}
