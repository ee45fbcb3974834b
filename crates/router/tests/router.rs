//! The router over real sockets, with an in-process fake API server.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hira_opencl::cl;
use hira_router::{Config, Handle, Request, Response, SpawnMode};
use hira_transport::{Conn, FrameReader, ShmRegion};
use hira_wire::{control, flags, Header, Kind, Reader, Writer, HEADER_LEN, MAX_FRAME};

/// Opcode that makes the fake server die.
const DIE: u16 = 0xfffe;
const DEVICE_NS_PER_REPLY: u64 = 1000;

fn frame(kind: Kind, opcode: u16, seq: u64, fl: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = Header::new(kind, opcode, seq, payload.len());
    h.flags = fl;
    if kind == Kind::Reply {
        h.device_ns = DEVICE_NS_PER_REPLY;
    }
    let mut f = h.to_bytes().to_vec();
    f.extend_from_slice(payload);
    f
}

fn read(reader: &mut FrameReader) -> Option<(Header, Vec<u8>)> {
    let f = reader
        .read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len)
        .ok()??;
    Some((Header::parse(f).unwrap(), f[HEADER_LEN..].to_vec()))
}

/// A fake API server: answers every synchronous request with a Reply carrying status 0
/// (clCreateBuffer: errcode 0 and a new id), answers PING, ignores SET_QUOTA and the
/// completion page, sends one
/// USAGE sample per ATTACH, and dies on opcode [`DIE`].
fn fake_server(control_conn: Conn) {
    let control_tx = Arc::new(control_conn.try_clone().unwrap());
    let conns: Arc<Mutex<Vec<Conn>>> = Arc::new(Mutex::new(Vec::new()));
    let mut reader = FrameReader::new(control_conn);
    fake_control(&mut reader, &control_tx, &conns);
    // The router let us go: a last USAGE sample, as the real server sends, with the bytes of
    // replies it sent straight to guests.
    let mut usage = Writer::default();
    usage.u64(7);
    usage.u64(4096);
    usage.u64(3);
    usage.u64(FINAL_DIRECT_BYTES);
    let _ = control_tx.send(&frame(Kind::Control, control::USAGE, 0, 0, &usage.buf), &[]);
}

/// Direct reply bytes the fake server reports when it is let go.
const FINAL_DIRECT_BYTES: u64 = 1 << 20;

fn fake_control(reader: &mut FrameReader, control_tx: &Arc<Conn>, conns: &Arc<Mutex<Vec<Conn>>>) {
    while let Some((h, payload)) = read(reader) {
        if (h.kind, h.opcode) == (Kind::Control, control::SET_QUOTA) {
            continue;
        }
        if (h.kind, h.opcode) == (Kind::Control, control::DONE_PAGE) {
            // The completion page: this server runs no kernels, so it never counts any.
            assert!(reader.take_fd().is_some(), "DONE_PAGE carries the page");
            continue;
        }
        assert_eq!((h.kind, h.opcode), (Kind::Control, control::ATTACH));
        let mut r = Reader::new(&payload);
        let (_conn_id, _role, shm_len) = (r.u64().unwrap(), r.u32().unwrap(), r.u64().unwrap());
        let options = r.u32().unwrap_or(0);
        let conn = Conn::from_owned(reader.take_fd().unwrap());
        if shm_len > 0 {
            assert!(reader.take_fd().is_some());
        }
        let direct = (options & control::OPT_DIRECT != 0)
            .then(|| Conn::from_owned(reader.take_fd().expect("direct reply socket")));
        let mut usage = Writer::default();
        usage.u64(7);
        usage.u64(4096);
        usage.u64(3);
        control_tx
            .send(&frame(Kind::Control, control::USAGE, 0, 0, &usage.buf), &[])
            .unwrap();
        conns.lock().unwrap().push(conn.try_clone().unwrap());
        let (control_tx, conns) = (Arc::clone(control_tx), Arc::clone(conns));
        std::thread::spawn(move || {
            let tx = conn.try_clone().unwrap();
            let mut r = FrameReader::new(conn);
            while let Some((h, _)) = read(&mut r) {
                if h.opcode == DIE {
                    control_tx.shutdown();
                    conns.lock().unwrap().iter().for_each(Conn::shutdown);
                    return;
                }
                if h.flags & flags::ASYNC != 0 {
                    continue;
                }
                let reply = match h.kind {
                    Kind::Request if h.opcode == hira_opencl::OP_CLCREATEBUFFER => {
                        let mut w = Writer::default();
                        w.i32(0);
                        w.i32(0);
                        w.u64(1000 + h.seq);
                        frame(Kind::Reply, h.opcode, h.seq, 0, &w.buf)
                    }
                    Kind::Request => frame(Kind::Reply, h.opcode, h.seq, 0, &0i32.to_le_bytes()),
                    _ => frame(Kind::Control, h.opcode, h.seq, 0, &[]),
                };
                let to = match &direct {
                    Some(d)
                        if h.kind == Kind::Request && hira_opencl::reply_skips_router(h.opcode) =>
                    {
                        d
                    }
                    _ => &tx,
                };
                if to.send(&reply, &[]).is_err() {
                    return;
                }
            }
        });
    }
}

fn start(by_hello_pid: bool) -> (Handle, PathBuf) {
    start_with(by_hello_pid, |_| {})
}

fn start_with(by_hello_pid: bool, tweak: impl FnOnce(&mut Config)) -> (Handle, PathBuf) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let socket = std::env::temp_dir().join(format!(
        "hira-rt-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let mut cfg = Config {
        socket: socket.clone(),
        spawn: SpawnMode::InProcess(Arc::new(fake_server)),
        tenant_by_hello_pid: by_hello_pid,
        ..Config::default()
    };
    tweak(&mut cfg);
    (hira_router::start(cfg).unwrap(), socket)
}

struct Guest {
    tx: Conn,
    rx: FrameReader,
}

impl Guest {
    fn connect(socket: &Path) -> Guest {
        let conn = Conn::connect(socket).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Guest {
            tx: conn.try_clone().unwrap(),
            rx: FrameReader::new(conn),
        }
    }

    fn hello_frame(pid: u32) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(control::ROLE_CALLS);
        w.u32(pid);
        w.u64(1);
        w.u64(0);
        frame(Kind::Control, control::HELLO, 1, 0, &w.buf)
    }

    /// Connects and says HELLO; returns the guest and WELCOME's (tenant, conn, status).
    fn admitted(socket: &Path, pid: u32) -> (Guest, (u64, u64, i32)) {
        let mut g = Guest::connect(socket);
        g.send(&Guest::hello_frame(pid));
        let (h, payload) = g.recv().unwrap();
        assert_eq!(
            (h.kind, h.opcode, h.seq),
            (Kind::Control, control::WELCOME, 1)
        );
        let mut r = Reader::new(&payload);
        let welcome = (r.u64().unwrap(), r.u64().unwrap(), r.i32().unwrap());
        (g, welcome)
    }

    fn send(&self, bytes: &[u8]) {
        self.tx.send(bytes, &[]).unwrap();
    }

    fn recv(&mut self) -> Option<(Header, Vec<u8>)> {
        read(&mut self.rx)
    }

    fn call(&mut self, opcode: u16, seq: u64, payload: &[u8]) -> (Header, Vec<u8>) {
        self.send(&frame(Kind::Request, opcode, seq, 0, payload));
        self.recv().unwrap()
    }
}

fn create_buffer_payload(size: u64) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(7);
    w.u64(0);
    w.u64(size);
    w.blob(hira_wire::Blob::Null);
    w.buf
}

fn status(payload: &[u8]) -> i32 {
    Reader::new(payload).i32().unwrap()
}

/// Stats once `ready` holds (the control socket is read on its own thread).
fn stats_when(
    socket: &Path,
    ready: impl Fn(&Vec<hira_router::TenantStats>) -> bool,
) -> Vec<hira_router::TenantStats> {
    (0..1000)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(2));
            stats(socket)
        })
        .find(ready)
        .expect("condition reached within 2 s")
}

/// Stats once tenant `id`'s server is known to be gone (the guest may see FAILED from the
/// closed connection before the router has processed the control socket's EOF).
fn stats_after_death(socket: &Path, id: u64) -> Vec<hira_router::TenantStats> {
    stats_when(socket, |s| s.iter().any(|t| t.id == id && !t.alive))
}

fn stats(socket: &Path) -> Vec<hira_router::TenantStats> {
    match hira_router::request(socket, &Request::Stats).unwrap() {
        Response::Stats { tenants, .. } => tenants,
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn hello_gets_welcome() {
    let (_router, socket) = start(false);

    let (_g, (tenant, conn, st)) = Guest::admitted(&socket, 1);

    assert!(tenant > 0);
    assert!(conn > 0);
    assert_eq!(st, 0);
}

#[test]
fn hello_with_shm_is_attached() {
    let (_router, socket) = start(false);
    let shm = ShmRegion::create("test", 4096).unwrap();
    let mut w = Writer::default();
    w.u32(control::ROLE_CALLS);
    w.u32(1);
    w.u64(1);
    w.u64(4096);
    let g = Guest::connect(&socket);
    g.tx.send(
        &frame(Kind::Control, control::HELLO, 9, 0, &w.buf),
        &[shm.fd()],
    )
    .unwrap();
    let mut g = g;

    let (h, payload) = g.recv().unwrap();
    let (reply, _) = g.call(hira_opencl::OP_CLFINISH, 2, &[0; 8]);

    assert_eq!((h.opcode, h.seq), (control::WELCOME, 9));
    assert_eq!(status(&payload[16..]), 0);
    assert_eq!((reply.kind, reply.seq), (Kind::Reply, 2));
}

#[test]
fn sync_request_gets_reply_and_is_accounted() {
    let (_router, socket) = start(false);
    let (mut g, _) = Guest::admitted(&socket, 1);

    g.send(&frame(
        Kind::Request,
        hira_opencl::OP_CLFLUSH,
        4,
        flags::ASYNC,
        &[0; 8],
    ));
    let (h, payload) = g.call(
        hira_opencl::OP_CLCREATEBUFFER,
        5,
        &create_buffer_payload(4096),
    );
    let (ping, _) = {
        g.send(&frame(Kind::Control, control::PING, 6, 0, &[]));
        g.recv().unwrap()
    };
    let t = stats(&socket).remove(0);

    assert_eq!((h.kind, h.seq), (Kind::Reply, 5));
    assert_eq!(status(&payload), 0);
    assert_eq!(
        (ping.kind, ping.opcode, ping.seq),
        (Kind::Control, control::PING, 6)
    );
    assert_eq!(t.calls, 2);
    assert_eq!(t.calls_by_op.get("clCreateBuffer"), Some(&1));
    assert_eq!(t.alloc_requested, 4096);
    assert_eq!(t.device_ns, DEVICE_NS_PER_REPLY);
    assert_eq!(t.pid, std::process::id() as i32);
    assert!(t.alive);
}

#[test]
fn allocation_past_the_quota_is_refused_and_release_frees() {
    let (_router, socket) = start_with(false, |c| c.memory.quota = Some(8192));
    let (mut g, _) = Guest::admitted(&socket, 1);
    let op = hira_opencl::OP_CLCREATEBUFFER;

    let (_, first) = g.call(op, 2, &create_buffer_payload(6000));
    let (over_h, over) = g.call(op, 3, &create_buffer_payload(4096));
    let held = stats(&socket).remove(0).mem_held;
    let id = Reader::new(&first[8..]).u64().unwrap();
    g.send(&frame(
        Kind::Request,
        hira_opencl::OP_CLRELEASEMEMOBJECT,
        4,
        flags::ASYNC,
        &id.to_le_bytes(),
    ));
    let (_, again) = g.call(op, 5, &create_buffer_payload(4096));
    let t = stats(&socket).remove(0);

    assert_eq!(status(&first), 0);
    assert_eq!(
        (over_h.kind, over_h.opcode, over_h.seq),
        (Kind::Reply, op, 3)
    );
    assert_eq!(over, cl::CL_MEM_OBJECT_ALLOCATION_FAILURE.to_le_bytes());
    assert_eq!(held, 6000);
    assert_eq!(status(&again), 0);
    assert_eq!(t.mem_held, 4096);
    assert_eq!(t.mem_quota, 8192);
    assert_eq!(t.alloc_refused, 1);
    assert_eq!(t.alloc_requested, 6000 + 4096 + 4096);
}

#[test]
fn usage_samples_are_kept() {
    let (_router, socket) = start(false);
    let (_g, _) = Guest::admitted(&socket, 1);

    let t = stats_when(&socket, |s| s.iter().any(|t| t.objects > 0)).remove(0);

    assert_eq!(t.mem_bytes, 4096);
    assert_eq!(t.objects, 3);
}

#[test]
fn pipelined_requests_all_get_replies_in_order() {
    let (_router, socket) = start(false);
    let (mut g, _) = Guest::admitted(&socket, 1);
    let batch: Vec<u8> = (1..=500u64)
        .flat_map(|seq| frame(Kind::Request, hira_opencl::OP_CLFINISH, seq, 0, &[0; 8]))
        .collect();

    g.send(&batch);
    let seqs: Vec<u64> = (0..500).map(|_| g.recv().unwrap().0.seq).collect();

    assert_eq!(seqs, (1..=500).collect::<Vec<u64>>());
}

#[test]
fn two_tenants_are_isolated() {
    let (_router, socket) = start(true);
    let (mut a, (ta, _, _)) = Guest::admitted(&socket, 1001);
    let (mut b, (tb, _, _)) = Guest::admitted(&socket, 1002);
    let (mut a2, (ta2, _, _)) = Guest::admitted(&socket, 1001);

    a.call(hira_opencl::OP_CLFINISH, 2, &[0; 8]);
    a2.call(hira_opencl::OP_CLFINISH, 2, &[0; 8]);
    b.call(hira_opencl::OP_CLFINISH, 2, &[0; 8]);
    b.send(&frame(Kind::Request, DIE, 3, 0, &[]));
    let (died, _) = b.recv().unwrap();
    let (still, _) = a.call(hira_opencl::OP_CLFINISH, 3, &[0; 8]);
    let s = stats_after_death(&socket, tb);
    let by_id = |id| s.iter().find(|t| t.id == id).unwrap().clone();

    assert_ne!(ta, tb);
    assert_eq!(ta, ta2);
    assert_eq!(died.opcode, control::FAILED);
    assert_eq!(still.kind, Kind::Reply);
    assert_eq!(by_id(ta).calls, 3);
    assert_eq!(by_id(ta).pid, 1001);
    assert!(by_id(ta).alive);
    assert_eq!(by_id(tb).calls, 2);
    assert!(!by_id(tb).alive);
}

#[test]
fn garbage_gets_failed_and_router_carries_on() {
    let (_router, socket) = start(false);
    let (mut g, _) = Guest::admitted(&socket, 1);
    g.call(hira_opencl::OP_CLFINISH, 2, &[0; 8]);

    g.send(&[0xa5; 64]);
    let (h, payload) = g.recv().unwrap();
    let eof = g.recv();
    let (_again, (_, _, st)) = Guest::admitted(&socket, 1);

    assert_eq!(
        (h.kind, h.opcode, h.seq),
        (Kind::Control, control::FAILED, 2)
    );
    assert_eq!(status(&payload), cl::CL_INVALID_VALUE);
    assert!(eof.is_none());
    assert_eq!(st, 0);
}

#[test]
fn oversized_frame_gets_failed() {
    let (_router, socket) = start(false);
    let (mut g, _) = Guest::admitted(&socket, 1);
    let mut header = Header::new(Kind::Request, hira_opencl::OP_CLFINISH, 2, 0).to_bytes();
    header[12..16].copy_from_slice(&((MAX_FRAME + 1) as u32).to_le_bytes());

    g.send(&header);
    let (h, payload) = g.recv().unwrap();

    assert_eq!((h.opcode, h.seq), (control::FAILED, 0));
    assert_eq!(status(&payload), cl::CL_INVALID_VALUE);
    assert!(g.recv().is_none());
}

#[test]
fn disallowed_kind_gets_failed() {
    let (_router, socket) = start(false);
    let (mut g, _) = Guest::admitted(&socket, 1);

    g.send(&frame(Kind::Reply, 1, 3, 0, &[]));
    let (h, _) = g.recv().unwrap();

    assert_eq!(h.opcode, control::FAILED);
    assert!(g.recv().is_none());
}

#[test]
fn bad_hello_gets_failed() {
    let (_router, socket) = start(false);
    let mut g = Guest::connect(&socket);

    g.send(&frame(Kind::Request, 1, 1, 0, &[]));
    let (h, payload) = g.recv().unwrap();

    assert_eq!(h.opcode, control::FAILED);
    assert_eq!(status(&payload), cl::CL_INVALID_VALUE);
}

#[test]
fn direct_replies_skip_the_router_and_end_with_the_server() {
    let (_router, socket) = start(false);
    let mut g = Guest::connect(&socket);
    let mut w = Writer::default();
    w.u32(control::ROLE_CALLS);
    w.u32(1);
    w.u64(1);
    w.u64(0);
    w.u32(control::OPT_DIRECT);
    g.send(&frame(Kind::Control, control::HELLO, 1, 0, &w.buf));
    let (h, payload) = g.recv().unwrap();
    let mut r = Reader::new(&payload);
    let welcome = (r.u64(), r.u64(), r.i32(), r.u32());
    let direct = Conn::from_owned(g.rx.take_fd().expect("WELCOME carries the direct socket"));
    direct
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut direct = FrameReader::new(direct);

    g.send(&frame(
        Kind::Request,
        hira_opencl::OP_CLFINISH,
        2,
        0,
        &[0; 8],
    ));
    let finish = read(&mut direct).unwrap();
    let (created, _) = g.call(
        hira_opencl::OP_CLCREATEBUFFER,
        3,
        &create_buffer_payload(4096),
    );
    g.send(&frame(Kind::Request, DIE, 4, 0, &[]));
    let after_death = read(&mut direct);
    let t = stats(&socket).remove(0);

    assert_eq!(h.opcode, control::WELCOME);
    assert_eq!(welcome.2, Ok(0));
    assert_eq!(welcome.3, Ok(control::OPT_DIRECT));
    assert_eq!((finish.0.kind, finish.0.seq), (Kind::Reply, 2));
    // A new buffer's id is read by the router (device-memory accounting): not direct.
    assert_eq!((created.kind, created.seq), (Kind::Reply, 3));
    assert_eq!(t.alloc_requested, 4096);
    // The dead server's end closes: the guest's pending call ends there.
    assert!(after_death.is_none());
}

#[test]
fn bytes_the_server_reports_as_it_retires_are_counted() {
    let (_router, socket) = start(false);
    let (mut g, (id, _, _)) = Guest::admitted(&socket, 1);
    g.call(hira_opencl::OP_CLFINISH, 2, &[0; 8]);
    drop(g);

    let t = stats_when(&socket, |s| {
        s.iter()
            .any(|t| t.id == id && t.bytes_out >= FINAL_DIRECT_BYTES)
    });

    assert!(t.iter().any(|t| t.id == id && !t.alive));
}

#[test]
fn server_death_fails_pending_and_later_calls() {
    let (_router, socket) = start(false);
    let (mut g, (id, _, _)) = Guest::admitted(&socket, 1);
    let (mut other, _) = Guest::admitted(&socket, 1);
    // A call answered first: the server has taken the other connection (WELCOME can come
    // before the server's ATTACH is done, and the fake server's death ends only the
    // connections it has taken).
    let (alive, _) = other.call(hira_opencl::OP_CLFINISH, 2, &[0; 8]);

    g.send(&frame(Kind::Request, DIE, 7, 0, &[]));
    let (h, payload) = g.recv().unwrap();
    let (later, later_payload) = g.call(hira_opencl::OP_CLFINISH, 8, &[0; 8]);
    let (other_h, _) = other.call(hira_opencl::OP_CLFINISH, 3, &[0; 8]);
    g.send(&frame(
        Kind::Request,
        hira_opencl::OP_CLFLUSH,
        9,
        flags::ASYNC,
        &[0; 8],
    ));
    let (last, _) = g.call(hira_opencl::OP_CLFINISH, 10, &[0; 8]);
    let t = stats_after_death(&socket, id).remove(0);

    assert_eq!(
        (h.kind, h.opcode, h.seq),
        (Kind::Control, control::FAILED, 7)
    );
    assert_eq!(status(&payload), cl::CL_OUT_OF_RESOURCES);
    assert_eq!((later.opcode, later.seq), (control::FAILED, 8));
    assert_eq!(status(&later_payload), cl::CL_OUT_OF_RESOURCES);
    assert_eq!(alive.kind, Kind::Reply);
    assert_eq!(other_h.opcode, control::FAILED);
    assert_eq!(last.seq, 10);
    assert_eq!(t.dropped, 1);
    assert!(!t.alive);
}

#[test]
fn last_connection_retires_tenant_and_new_one_gets_fresh_server() {
    let (router, socket) = start(false);
    let (mut g, (t1, _, _)) = Guest::admitted(&socket, 1);
    g.send(&frame(Kind::Request, DIE, 2, 0, &[]));
    g.recv().unwrap();
    drop(g);

    let fresh = (0..200).find_map(|_| {
        std::thread::sleep(Duration::from_millis(10));
        let (mut g, (t, _, st)) = Guest::admitted(&socket, 1);
        (st == 0).then(|| (t, g.call(hira_opencl::OP_CLFINISH, 2, &[0; 8]).0))
    });
    let (t2, reply) = fresh.unwrap();

    assert_ne!(t1, t2);
    assert_eq!(reply.kind, Kind::Reply);
    assert_eq!(router.stats().len(), 2);
}

#[test]
fn ctl_shutdown_stops_router() {
    let (router, socket) = start(false);
    let (_g, _) = Guest::admitted(&socket, 1);

    let resp = hira_router::request(&socket, &Request::Shutdown).unwrap();
    router.wait().unwrap();

    assert_eq!(resp, Response::Ok);
    assert!(!socket.exists());
}

#[test]
fn idle_exit_stops_an_unused_router() {
    static N: AtomicUsize = AtomicUsize::new(0);
    let socket = std::env::temp_dir().join(format!(
        "hira-rt-idle-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let cfg = Config {
        socket: socket.clone(),
        spawn: SpawnMode::InProcess(Arc::new(fake_server)),
        idle_exit: Some(Duration::from_millis(200)),
        ..Config::default()
    };
    let router = hira_router::start(cfg).unwrap();
    let (g, _) = Guest::admitted(&socket, 1);
    std::thread::sleep(Duration::from_millis(400));
    let still_up = Conn::connect(&socket).is_ok();
    drop(g);

    router.wait().unwrap();

    assert!(still_up);
    assert!(!socket.exists());
}

#[test]
fn metrics_are_prometheus_text() {
    let (_router, socket) = start(false);
    let (mut g, _) = Guest::admitted(&socket, 1);
    g.call(hira_opencl::OP_CLFINISH, 2, &[0; 8]);

    let text = match hira_router::request(&socket, &Request::Metrics).unwrap() {
        Response::Metrics { text } => text,
        other => panic!("unexpected {other:?}"),
    };

    assert!(text.contains("hira_tenant_calls_total{tenant="));
    assert!(text.contains("op=\"clFinish\"} 1"));
}
