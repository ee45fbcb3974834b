//! Isolation between tenants, with real API server processes on the real OpenCL device.
//! The tenants here speak the wire protocol directly (as a hostile tenant that bypasses the
//! guest library would), so they can forge handle ids and send malformed frames.

use hira_opencl::*;
use hira_transport::{Conn, FrameReader, ShmRegion};
use hira_wire::{
    control, flags, Blob, Header, Kind, OutSpec, Reader, Writer, HEADER_LEN, MAX_FRAME,
};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const CL_INVALID_MEM_OBJECT: i32 = -38;
const CL_OUT_OF_RESOURCES: i32 = -5;

/// The `hira` executable next to this test's target directory.
fn hira_exe() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>");
    let p = dir.join("hira");
    assert!(
        p.exists(),
        "{} missing: build the workspace first",
        p.display()
    );
    p
}

fn start_router(name: &str) -> (hira_router::Handle, PathBuf) {
    let dir = std::env::temp_dir().join(format!("hira-iso-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let socket = dir.join("router.sock");
    let cfg = hira_router::Config {
        socket: socket.clone(),
        server_exe: Some(hira_exe()),
        tenant_by_hello_pid: true,
        ..Default::default()
    };
    (hira_router::start(cfg).expect("router starts"), socket)
}

/// A tenant speaking the wire protocol by hand.
struct Raw {
    conn: Conn,
    reader: FrameReader,
    seq: u64,
    tenant: u64,
    _shm: ShmRegion,
}

enum Answer {
    Reply(Vec<u8>),
    Failed(i32),
}

impl Raw {
    fn connect(socket: &std::path::Path, pid: u32) -> Raw {
        let conn = Conn::connect(socket).expect("connect");
        let shm = ShmRegion::create("iso", 1 << 20).expect("shm");
        let mut w = Writer::with_header_room(HEADER_LEN);
        w.u32(control::ROLE_CALLS);
        w.u32(pid);
        w.u64(0);
        w.u64(shm.len() as u64);
        let len = w.buf.len() - HEADER_LEN;
        Header::new(Kind::Control, control::HELLO, 1, len).write_to(&mut w.buf[..HEADER_LEN]);
        conn.send(&w.buf, &[shm.fd()]).expect("hello");
        let reader = FrameReader::new(conn.try_clone().expect("clone"));
        let mut raw = Raw {
            conn,
            reader,
            seq: 1,
            tenant: 0,
            _shm: shm,
        };
        let (h, payload) = raw.frame().expect("welcome");
        assert_eq!(h.opcode, control::WELCOME);
        let mut r = Reader::new(&payload);
        raw.tenant = r.u64().expect("tenant id");
        raw
    }

    fn frame(&mut self) -> Option<(Header, Vec<u8>)> {
        let f = self
            .reader
            .read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len)
            .ok()??;
        let h = Header::parse(f).ok()?;
        Some((h, f[HEADER_LEN..].to_vec()))
    }

    fn send(&mut self, op: u16, payload: &[u8], fl: u8) {
        self.seq += 1;
        let mut h = Header::new(Kind::Request, op, self.seq, payload.len());
        h.flags = fl;
        let mut buf = h.to_bytes().to_vec();
        buf.extend_from_slice(payload);
        self.conn.send(&buf, &[]).expect("send");
    }

    /// A synchronous call: the reply payload after its status, or the router's failure.
    fn call(&mut self, op: u16, w: &Writer) -> Answer {
        self.send(op, &w.buf, 0);
        loop {
            let Some((h, payload)) = self.frame() else {
                return Answer::Failed(i32::MIN);
            };
            if h.kind == Kind::Control && h.opcode == control::FAILED {
                return Answer::Failed(Reader::new(&payload).i32().unwrap_or(0));
            }
            if h.kind == Kind::Reply && h.seq == self.seq {
                return Answer::Reply(payload);
            }
        }
    }

    /// Status of the call (0 = executed) and the rest of the reply.
    fn ok(&mut self, op: u16, w: &Writer) -> (i32, Vec<u8>) {
        match self.call(op, w) {
            Answer::Reply(p) => {
                let status = Reader::new(&p).i32().expect("status");
                (status, p[4..].to_vec())
            }
            Answer::Failed(code) => panic!("call {op} failed in the router: {code}"),
        }
    }

    /// Create something: (errcode, id).
    fn create(&mut self, op: u16, w: &Writer) -> u64 {
        let (status, rest) = self.ok(op, w);
        let mut r = Reader::new(&rest);
        let err = r.i32().expect("errcode");
        assert_eq!((status, err), (0, 0), "op {op}");
        r.u64().expect("id")
    }
}

/// A tenant with a context, a queue, and a buffer holding `data`.
struct Setup {
    raw: Raw,
    queue: u64,
    buf: u64,
    context: u64,
}

fn out(len: u64) -> OutSpec {
    OutSpec::Inline { len }
}

fn setup(socket: &std::path::Path, pid: u32, data: &[u8]) -> Setup {
    let mut raw = Raw::connect(socket, pid);
    let mut w = Writer::default();
    w.u64(1);
    w.out_spec(out(8));
    w.out_spec(out(4));
    let (_, rest) = raw.ok(OP_CLGETPLATFORMIDS, &w);
    let mut r = Reader::new(&rest);
    assert_eq!(r.i32(), Ok(0));
    let platform = u64::from_le_bytes(r.bytes().expect("platform").try_into().expect("8 bytes"));
    let mut w = Writer::default();
    w.u64(platform);
    w.u64(0xFFFF_FFFF);
    w.u64(1);
    w.out_spec(out(8));
    w.out_spec(out(4));
    let (_, rest) = raw.ok(OP_CLGETDEVICEIDS, &w);
    let mut r = Reader::new(&rest);
    assert_eq!(r.i32(), Ok(0));
    let device = r.bytes().expect("device").to_vec();
    let mut w = Writer::default();
    w.blob(Blob::Null);
    w.u64(1);
    w.blob(Blob::Inline(&device));
    w.u64(0);
    let context = raw.create(OP_CLCREATECONTEXT, &w);
    let mut w = Writer::default();
    w.u64(context);
    w.u64(u64::from_le_bytes(
        device.as_slice().try_into().expect("8 bytes"),
    ));
    w.u64(0);
    let queue = raw.create(OP_CLCREATECOMMANDQUEUE, &w);
    let mut w = Writer::default();
    w.u64(context);
    w.u64(1 | 32); // READ_WRITE | COPY_HOST_PTR
    w.u64(data.len() as u64);
    w.blob(Blob::Inline(data));
    let buf = raw.create(OP_CLCREATEBUFFER, &w);
    Setup {
        raw,
        queue,
        buf,
        context,
    }
}

impl Setup {
    /// Read `len` bytes of buffer `buf` (any id): (status or OpenCL error, data).
    fn read(&mut self, buf: u64, len: u64) -> (i32, Vec<u8>) {
        let mut w = Writer::default();
        w.u64(self.queue);
        w.u64(buf);
        w.u64(1);
        w.u64(0);
        w.u64(len);
        w.out_spec(out(len));
        w.u64(0);
        w.blob(Blob::Null);
        w.u64(0);
        let (status, rest) = self.raw.ok(OP_CLENQUEUEREADBUFFER, &w);
        if status != 0 {
            return (status, Vec::new());
        }
        let mut r = Reader::new(&rest);
        let ret = r.i32().expect("ret");
        (ret, r.bytes().expect("data").to_vec())
    }

    /// Build `src` and return kernel `name`.
    fn kernel(&mut self, src: &str, name: &str) -> u64 {
        let mut w = Writer::default();
        w.u64(self.context);
        w.u64(1);
        w.u64(1);
        w.blob(Blob::Inline(src.as_bytes()));
        w.blob(Blob::Null);
        let prog = self.raw.create(OP_CLCREATEPROGRAMWITHSOURCE, &w);
        let mut w = Writer::default();
        w.u64(prog);
        w.u64(0);
        w.blob(Blob::Null);
        w.blob(Blob::Null);
        w.u64(0);
        let (status, rest) = self.raw.ok(OP_CLBUILDPROGRAM, &w);
        assert_eq!((status, Reader::new(&rest).i32()), (0, Ok(0)), "build");
        let mut w = Writer::default();
        w.u64(prog);
        w.blob(Blob::Inline(name.as_bytes()));
        self.raw.create(OP_CLCREATEKERNEL, &w)
    }

    /// kernel(buf, extra int) over `n` items, asynchronously.
    fn launch(&mut self, kernel: u64, n: u64, extra: i32) {
        let mut w = Writer::default();
        w.u64(kernel);
        w.u64(0);
        w.u64(8);
        w.u8(2);
        w.u64(self.buf);
        self.raw.send(OP_CLSETKERNELARG, &w.buf, flags::ASYNC);
        let mut w = Writer::default();
        w.u64(kernel);
        w.u64(1);
        w.u64(4);
        w.u8(1);
        w.blob(Blob::Inline(&extra.to_le_bytes()));
        self.raw.send(OP_CLSETKERNELARG, &w.buf, flags::ASYNC);
        let mut w = Writer::default();
        w.u64(self.queue);
        w.u64(kernel);
        w.u64(1);
        w.blob(Blob::Null);
        w.blob(Blob::Inline(&n.to_le_bytes()));
        w.blob(Blob::Null);
        w.u64(0);
        w.blob(Blob::Null);
        w.u64(0);
        self.raw
            .send(OP_CLENQUEUENDRANGEKERNEL, &w.buf, flags::ASYNC);
    }

    fn finish(&mut self) -> Answer {
        let mut w = Writer::default();
        w.u64(self.queue);
        self.raw.call(OP_CLFINISH, &w)
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn a_tenant_cannot_name_another_tenants_objects() {
    let (router, socket) = start_router("forge");
    let secret = pattern(4096, 7);
    let mut victim = setup(&socket, 1_000_001, &secret);
    let mut attacker = setup(&socket, 1_000_002, &[0u8; 16]);

    // Every small id (the victim's buffer among them) and some high ones, as a buffer.
    let forged: Vec<u64> = (1..=64)
        .chain([1 << 63 | 1, u64::MAX])
        .filter(|&id| id != attacker.buf)
        .collect();
    let reads: Vec<i32> = forged.iter().map(|&id| attacker.read(id, 4096).0).collect();
    let releases: Vec<i32> = forged
        .iter()
        .map(|&id| {
            let mut w = Writer::default();
            w.u64(id);
            attacker
                .raw
                .ok(OP_CLGETMEMOBJECTINFO, &{
                    w.u64(0x1102); // CL_MEM_SIZE
                    w.u64(8);
                    w.out_spec(out(8));
                    w.out_spec(OutSpec::Null);
                    w
                })
                .0
        })
        .collect();
    let (ret, data) = victim.read(victim.buf, 4096);

    assert!(
        reads.iter().all(|&e| e == CL_INVALID_MEM_OBJECT),
        "forged reads: {reads:?}"
    );
    assert!(
        releases.iter().all(|&e| e == CL_INVALID_MEM_OBJECT),
        "forged queries: {releases:?}"
    );
    assert_eq!(ret, 0);
    assert!(data == secret, "the victim's data changed");
    router.stop();
}

#[test]
fn killing_one_tenants_server_mid_kernel_leaves_the_other_correct() {
    let (router, socket) = start_router("kill");
    let n = 1 << 16;
    let mut good = setup(&socket, 1_000_011, &vec![0u8; n * 4]);
    let mut doomed = setup(&socket, 1_000_012, &[0u8; 64]);
    let add = good.kernel(
        "__kernel void add(__global int *x, int v) { x[get_global_id(0)] += v; }",
        "add",
    );
    let spin = doomed.kernel(
        // A recurrence the compiler cannot fold into a closed form: it really spins.
        "__kernel void spin(__global int *x, int v) { for (int i = 0; i < 2000000000; i++) { x[0] = x[0] * 1103515245 + v; } }",
        "spin",
    );
    doomed.launch(spin, 1, 1);
    let (_, rest) = doomed.raw.ok(OP_CLFLUSH, &{
        let mut w = Writer::default();
        w.u64(doomed.queue);
        w
    });
    drop(rest);
    std::thread::sleep(Duration::from_millis(300));
    let server = server_pid(doomed.raw.tenant).expect("the doomed tenant's server process");
    let server_env = std::fs::read(format!("/proc/{server}/environ")).unwrap_or_default();

    // SAFETY: sending SIGKILL to a child process this test's router spawned.
    unsafe { libc_kill(server) };
    let doomed_finish = doomed.finish();
    for v in 1..=10 {
        good.launch(add, n as u64, v);
    }
    let good_finish = good.finish();
    let (ret, data) = good.read(good.buf, (n * 4) as u64);
    let mut later = Raw::connect(&socket, 1_000_013);
    let mut w = Writer::default();
    w.u64(0);
    w.out_spec(OutSpec::Null);
    w.out_spec(out(4));
    let (status, _) = later.ok(OP_CLGETPLATFORMIDS, &w);

    assert!(
        matches!(doomed_finish, Answer::Failed(CL_OUT_OF_RESOURCES)),
        "the dead tenant's call fails"
    );
    assert!(matches!(good_finish, Answer::Reply(_)));
    assert_eq!(ret, 0);
    assert!(
        data.chunks(4)
            .all(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) == 55),
        "sum of 1..=10 everywhere"
    );
    assert_eq!(status, 0, "the router keeps serving new tenants");
    if std::env::var_os("POCL_AFFINITY").is_none() {
        assert!(
            server_env
                .split(|&b| b == 0)
                .any(|v| v == b"POCL_AFFINITY=1"),
            "servers pin PoCL's worker threads"
        );
    }
    router.stop();
}

#[test]
fn malformed_payloads_get_errors_and_the_server_carries_on() {
    let (router, socket) = start_router("garbage");
    let mut t = setup(&socket, 1_000_021, &pattern(256, 3));
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut answers = Vec::new();
    for op in 1..=OPS.len() as u16 {
        if matches!(op, OP_CLFINISH | OP_CLWAITFOREVENTS) {
            continue; // valid-looking garbage could name a real queue and legitimately wait
        }
        for len in [0usize, 3, 17, 64] {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let w = Writer { buf: junk };
            answers.push(matches!(t.raw.call(op, &w), Answer::Reply(_)));
        }
    }
    let (ret, data) = t.read(t.buf, 256);

    assert!(
        answers.iter().all(|&a| a),
        "every malformed request is answered"
    );
    assert_eq!(ret, 0);
    assert!(data == pattern(256, 3), "the tenant's own data is intact");
    router.stop();
}

/// The pid of the `hira server` process serving tenant `tenant`.
fn server_pid(tenant: u64) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let env = std::fs::read(entry.path().join("environ")).unwrap_or_default();
            let want = format!("HIRA_TENANT={tenant}");
            let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if env.split(|&b| b == 0).any(|v| v == want.as_bytes())
                && cmd.windows(6).any(|w| w == b"server")
            {
                return Some(pid);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

/// # Safety
/// Sends SIGKILL to `pid`.
unsafe fn libc_kill(pid: i32) {
    // SAFETY: the caller names a process it may kill.
    unsafe { kill(pid, 9) };
}
