//! The server's loops: the control socket from the router (new connections arrive as ATTACH
//! with their socket and shared memory) and one shadow thread per connection.

use crate::ctx::{Ctx, Shared};
use crate::Api;
use anyhow::Context;
use hira_opencl::cl::*;
use hira_transport::{Conn, EventBoard, FrameReader, ShmRegion};
use hira_wire::{control, flags, Header, Kind, Reader, Writer, HEADER_LEN, MAX_FRAME};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Entry point of `hira server`: the control socket is the fd in HIRA_CONTROL_FD.
pub fn main_from_env() -> anyhow::Result<()> {
    let fd: i32 = std::env::var("HIRA_CONTROL_FD")
        .context("HIRA_CONTROL_FD not set")?
        .parse()?;
    // SAFETY: the router passed this fd to us and nothing else owns it.
    let conn = Conn::from_owned(unsafe { OwnedFd::from_raw_fd(fd) });
    serve_control(conn)
}

fn load_api() -> anyhow::Result<&'static Api> {
    let name = std::env::var("HIRA_VENDOR_LIB").unwrap_or_else(|_| "libOpenCL.so.1".into());
    // SAFETY: loading the system's OpenCL loader runs its initialisers, which is the point.
    let lib =
        unsafe { libloading::Library::new(&name) }.with_context(|| format!("loading {name}"))?;
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    let api: &'static Api = Box::leak(Box::new(Api::load(lib)));
    crate::expr::set_api(api);
    Ok(api)
}

/// Serve one tenant: read ATTACH frames from the router until it closes the control socket.
pub fn serve_control(control_conn: Conn) -> anyhow::Result<()> {
    let api = load_api()?;
    let shared = Shared::new(api);
    *shared.control.lock().unwrap_or_else(|e| e.into_inner()) = Some(control_conn.try_clone()?);
    let usage_shared = shared.clone();
    std::thread::Builder::new()
        .name("usage".into())
        .spawn(move || report_usage(usage_shared))?;
    // Evictions run on their own thread: a long one must not hold up ATTACH frames.
    let (evict_tx, evict_rx) = std::sync::mpsc::channel();
    let evict_shared = shared.clone();
    std::thread::Builder::new()
        .name("evict".into())
        .spawn(move || crate::swap::evictor(evict_shared, evict_rx))?;
    let mut reader = FrameReader::new(control_conn);
    while let Some(frame) = reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len)? {
        let h = Header::parse(frame)?;
        let payload = &frame[HEADER_LEN..];
        if h.kind == Kind::Control && h.opcode == control::SET_QUOTA {
            match Reader::new(payload).u64() {
                Ok(q) => {
                    shared.quota.store(q, Ordering::Relaxed);
                    tracing::info!(quota = q, "device-memory quota set");
                }
                Err(e) => tracing::warn!("malformed SET_QUOTA: {e}"),
            }
            continue;
        }
        if h.kind == Kind::Control && h.opcode == control::SWAP_MODE {
            match Reader::new(payload).u8() {
                Ok(on) => {
                    shared.swap.set_mode(on != 0);
                    tracing::info!(on, "over-subscription mode set");
                }
                Err(e) => tracing::warn!("malformed SWAP_MODE: {e}"),
            }
            continue;
        }
        if h.kind == Kind::Control && h.opcode == control::DONE_PAGE {
            match reader
                .take_fd()
                .map(hira_transport::CompletionPage::from_fd)
            {
                Some(Ok(page)) => {
                    if shared.done_page.set(page).is_err() {
                        tracing::warn!("second completion page ignored");
                    }
                }
                Some(Err(e)) => tracing::warn!("completion page refused: {e}"),
                None => tracing::warn!("DONE_PAGE without a page"),
            }
            continue;
        }
        if h.kind == Kind::Control && h.opcode == control::EVICT {
            if evict_tx.send((h.seq, payload.to_vec())).is_err() {
                tracing::warn!("eviction thread gone; EVICT dropped");
            }
            continue;
        }
        if h.kind != Kind::Control || h.opcode != control::ATTACH {
            tracing::warn!(opcode = h.opcode, "unexpected control frame");
            continue;
        }
        let mut r = Reader::new(&frame[HEADER_LEN..]);
        let (conn_id, role, shm_len) = (r.u64()?, r.u32()?, r.u64()?);
        let options = r.u32().unwrap_or(0);
        let sock = reader.take_fd().context("ATTACH without a socket")?;
        let shm = if shm_len > 0 {
            let fd = reader
                .take_fd()
                .context("ATTACH without its shared memory")?;
            Some(ShmRegion::from_fd(fd, shm_len as usize)?)
        } else {
            None
        };
        let direct = if options & control::OPT_DIRECT != 0 {
            let fd = reader
                .take_fd()
                .context("ATTACH announces a direct reply socket but carries none")?;
            // Replies only: commands reach the server through the router and nowhere else,
            // so the guest's end may not write to this one.
            // SAFETY: shutdown(2) on a socket we own.
            unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&fd), libc::SHUT_RD) };
            Some(Conn::from_owned(fd))
        } else {
            None
        };
        let conn = Conn::from_owned(sock);
        if role == control::ROLE_CALLBACKS {
            shared.attach_callbacks(conn);
            continue;
        }
        let shared = shared.clone();
        let progress = shared.progress.register(conn_id);
        std::thread::Builder::new()
            .name(format!("shadow-{conn_id}"))
            .spawn(move || {
                let s = Arc::clone(&shared);
                if let Err(e) = shadow(conn, direct, Ctx::new(shared, shm), &progress) {
                    tracing::warn!(conn_id, "connection ended: {e:#}");
                }
                s.progress.unregister(conn_id);
            })?;
    }
    // A short-lived tenant may end before the next periodic sample: the router learns of
    // the replies it did not see (their bytes) now.
    send_usage(&shared, usage_of(&shared));
    tracing::info!("router closed the control socket; exiting");
    Ok(())
}

fn report_usage(shared: Arc<Shared>) {
    let mut last = None;
    loop {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let now = usage_of(&shared);
        if last == Some(now) {
            continue;
        }
        last = Some(now);
        if !send_usage(&shared, now) {
            return;
        }
    }
}

fn usage_of(shared: &Shared) -> (u64, u64, u64, u64) {
    (
        shared.device_ns.load(Ordering::Relaxed),
        shared.mem_bytes.load(Ordering::Relaxed),
        shared.objects(),
        shared.direct_bytes.load(Ordering::Relaxed),
    )
}

/// Sends one USAGE sample; false once the router is gone.
fn send_usage(shared: &Shared, (dev, mem, objects, direct): (u64, u64, u64, u64)) -> bool {
    let mut w = Writer::with_header_room(HEADER_LEN);
    w.u64(dev);
    w.u64(mem);
    w.u64(objects);
    w.u64(direct);
    let len = w.buf.len() - HEADER_LEN;
    Header::new(Kind::Control, control::USAGE, 0, len).write_to(&mut w.buf[..HEADER_LEN]);
    // One writer at a time on the control socket (kernel completions share it).
    let control = shared.control.lock().unwrap_or_else(|e| e.into_inner());
    control
        .as_ref()
        .is_some_and(|c| c.send(&w.buf, &[]).is_ok())
}

/// A launch refused before the vendor saw it: its event posted as failed on the board.
fn post_refused(cx: &Ctx, named: u64) {
    if let (true, Some(b)) = (named != 0, cx.shared.board.get()) {
        b.post(named, false);
    }
}

/// A request's outcome: the refusal's code, or the `ret` its reply starts with.
fn reply_code(result: &Result<Writer, crate::Fail>) -> i32 {
    match result {
        Ok(w) if w.buf.len() >= 4 => i32::from_le_bytes([w.buf[0], w.buf[1], w.buf[2], w.buf[3]]),
        Ok(_) => CL_SUCCESS,
        Err(e) => e.code(),
    }
}

/// A connection's unreported error of an asynchronous call, as counted on the event board: the
/// guest's waits on the board ask the server while any is, and the server's reply reports it.
struct DeferredCount<'a>(&'a Shared, bool);

impl DeferredCount<'_> {
    fn set(&mut self, on: bool) {
        if on != self.1 {
            if let Some(b) = self.0.board.get() {
                b.deferred(on);
                self.1 = on;
            }
        }
    }
}

impl Drop for DeferredCount<'_> {
    fn drop(&mut self) {
        self.set(false);
    }
}

/// Publishes, when dropped, that the connection has run its frames up to `.2`.
struct Ran<'a>(&'a Shared, &'a std::sync::atomic::AtomicU64, u64);

impl Drop for Ran<'_> {
    fn drop(&mut self) {
        self.0.progress.advance(self.1, self.2);
    }
}

/// `control::FENCE`: waits until the connections named have run their frames that far.
fn fence(shared: &Shared, payload: &[u8]) {
    let mut r = Reader::new(payload);
    while let (Ok(conn), Ok(seq)) = (r.u64(), r.u64()) {
        if !shared.progress.wait(conn, seq, crate::fence::FENCE_WAIT) {
            tracing::info!(conn, seq, "fence not reached in time; the call runs anyway");
        }
    }
}

/// A shadow thread: run this connection's requests in order.
fn shadow(
    conn: Conn,
    direct: Option<Conn>,
    mut cx: Ctx,
    progress: &std::sync::atomic::AtomicU64,
) -> anyhow::Result<()> {
    let out = conn.try_clone()?;
    let mut reader = FrameReader::new(conn);
    let mut deferred: i32 = 0;
    // The deferred error as counted on the event board (uncounted when the connection ends).
    let shared = cx.shared.clone();
    let mut counted = DeferredCount(&shared, false);
    // The guest's id for the event of a launch refused before the vendor saw it.
    let mut refused_launch = 0u64;
    // No polling here (unlike the guest): on two cores a polling server starves the router.
    while let Some(frame) = reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len)? {
        let h = Header::parse(frame)?;
        let payload = &frame[HEADER_LEN..];
        let is_async = h.flags & flags::ASYNC != 0;
        if !is_async {
            // Everything before this call has run: a fence of another connection need not
            // wait for the call itself (it may block for long).
            shared.progress.advance(progress, h.seq.saturating_sub(1));
        }
        // Published once the frame has run, however this iteration ends.
        let _ran = Ran(&shared, progress, h.seq);
        let result = match (h.kind, h.opcode) {
            (Kind::Control, control::FENCE) => {
                fence(&cx.shared, payload);
                continue;
            }
            (Kind::Request, op) => {
                cx.async_frame = is_async;
                let res = crate::swap::dispatch(&mut cx, op, payload);
                let tracked = cx.tracked();
                let named = cx.named_event;
                cx.reset();
                let info = hira_opencl::op(op);
                if let Err(e) = &res {
                    tracing::debug!(op = info.map_or("?", |o| o.name), "request refused: {e}");
                    if !tracked && info.is_some_and(|o| o.device_time || (o.resident && cx.gated()))
                    {
                        // Refused before the vendor saw it: free the router's device slot.
                        cx.shared.report_done(0, false);
                    }
                    if !tracked && info.is_some_and(|o| o.device_time) {
                        // The guest asks the server about this launch's event (posted once
                        // the error is counted, below).
                        refused_launch = named;
                    }
                }
                if named != 0 && reply_code(&res) != CL_SUCCESS {
                    cx.shared.unborn(named);
                }
                res
            }
            (Kind::Control, control::PING) => Ok(Writer::default()),
            (Kind::Control, control::SVM_ARENA) => {
                let mut rd = Reader::new(payload);
                match (rd.u64(), rd.u64(), reader.take_fd()) {
                    (Ok(addr), Ok(len), Some(fd)) => cx.shared.svm.take_arena(fd, addr, len),
                    _ => tracing::warn!("malformed SVM_ARENA refused"),
                }
                continue;
            }
            (Kind::Control, control::EVENT_BOARD) => {
                match reader.take_fd().map(EventBoard::from_fd) {
                    Some(Ok(b)) => {
                        // One board per tenant; every connection sends it once.
                        let _ = cx.shared.board.set(b);
                        counted.set(deferred != 0);
                    }
                    Some(Err(e)) => tracing::warn!("EVENT_BOARD refused: {e}"),
                    None => tracing::warn!("EVENT_BOARD without a board refused"),
                }
                continue;
            }
            (Kind::Control, control::SHM_GROW) => {
                let len = Reader::new(payload).u64()?;
                let fd = reader.take_fd().context("SHM_GROW without a region")?;
                cx.shm = Some(ShmRegion::from_fd(fd, len as usize)?);
                continue;
            }
            (kind, op) => {
                tracing::warn!(?kind, op, "unexpected frame");
                Err(crate::Fail::Cl(CL_INVALID_OPERATION))
            }
        };
        if is_async {
            let code = reply_code(&result);
            if code != CL_SUCCESS && deferred == 0 {
                let name = hira_opencl::op(h.opcode).map_or("?", |o| o.name);
                tracing::info!(
                    op = name,
                    code,
                    "asynchronous call failed; reported at the next sync call"
                );
                deferred = code;
                // The guest's waits on the board then ask the server, which reports it.
                counted.set(true);
            }
            post_refused(&cx, std::mem::take(&mut refused_launch));
            continue;
        }
        post_refused(&cx, std::mem::take(&mut refused_launch));
        let mut w = Writer::with_header_room(HEADER_LEN);
        let mut fl = 0;
        match &result {
            Ok(_) => w.i32(0),
            Err(e) => w.i32(e.code()),
        }
        if deferred != 0 {
            fl |= flags::DEFERRED_ERROR;
            w.i32(deferred);
            deferred = 0;
            counted.set(false);
        }
        if let Ok(body) = &result {
            w.buf.extend_from_slice(&body.buf);
        }
        let direct = direct
            .as_ref()
            .filter(|_| h.kind == Kind::Request && hira_opencl::reply_skips_router(h.opcode));
        let mut rh = Header::new(Kind::Reply, h.opcode, h.seq, w.buf.len() - HEADER_LEN);
        rh.flags = fl;
        if direct.is_none() {
            // Device time rides on replies the router reads (USAGE samples carry the rest).
            let total = cx.shared.device_ns.load(Ordering::Relaxed);
            let before = cx.shared.device_ns_reported.swap(total, Ordering::Relaxed);
            rh.device_ns = total.saturating_sub(before);
        }
        rh.write_to(&mut w.buf[..HEADER_LEN]);
        match direct {
            Some(d) => {
                d.send(&w.buf, &[])?;
                cx.shared
                    .direct_bytes
                    .fetch_add(w.buf.len() as u64, Ordering::Relaxed);
            }
            None => out.send(&w.buf, &[])?,
        }
    }
    Ok(())
}
