//! What the server's process-level tests share: the server process (this test executable run
//! again with only its entry test, so the server is always the code under test), its log, and
//! a calls connection spoken by hand. Each test plays the router.

#![allow(dead_code)] // each test file uses its own part

use hira_transport::{Conn, FrameReader, ShmRegion};
use hira_wire::{
    control, flags, Blob, Header, Kind, OutSpec, Reader, Writer, HEADER_LEN, MAX_FRAME,
};
use std::io::BufRead;
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The body of a test file's entry test `entry`: when `env` is set this process is a server
/// (`hira_server::main_from_env`, as `hira server` does) and never returns; otherwise nothing.
pub fn server_entry(env: &str) {
    if std::env::var_os(env).is_none() {
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(tracing_subscriber::EnvFilter::new("info,hira_server=debug"))
        .try_init();
    let code = match hira_server::main_from_env() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("server failed: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

/// One API server process, our end of its control socket, and its log (stderr).
pub struct Proc {
    child: Child,
    pub ctl: Conn,
    pub log: Arc<Mutex<String>>,
}

impl Proc {
    /// Starts this executable's test `entry` with `env` set, as a server on a new control
    /// socket.
    pub fn spawn(entry: &str, env: &str) -> Proc {
        let (ours, theirs) = Conn::pair().expect("socketpair");
        let fd = theirs.as_raw_fd();
        let mut cmd = Command::new(std::env::current_exe().expect("test executable"));
        cmd.args([entry, "--exact", "--nocapture", "--test-threads=1", "-q"])
            .env(env, "1")
            .env("HIRA_CONTROL_FD", fd.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: runs in the forked child before exec and only calls the async-signal-safe
        // fcntl on an fd the parent keeps open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                let fl = libc::fcntl(fd, libc::F_GETFD);
                if fl < 0 || libc::fcntl(fd, libc::F_SETFD, fl & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("server process");
        drop(theirs);
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[server] {line}");
                let mut l = sink.lock().unwrap_or_else(|e| e.into_inner());
                l.push_str(&line);
                l.push('\n');
            }
        });
        Proc {
            child,
            ctl: ours,
            log,
        }
    }

    /// The server's process id.
    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// [`Proc::spawn`], its control frames (USAGE, DONE) read and dropped.
    #[allow(dead_code)]
    pub fn spawn_draining(entry: &str, env: &str) -> Proc {
        let proc = Proc::spawn(entry, env);
        let mut reader = FrameReader::new(proc.ctl.try_clone().expect("clone"));
        std::thread::spawn(move || {
            while let Ok(Some(_)) = reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {}
        });
        proc
    }

    /// A calls connection, as the router attaches it (1 MiB of shared memory).
    pub fn attach(&self) -> Client {
        self.attach_with(1, None)
    }

    /// A calls connection the router numbered `conn_id`.
    #[allow(dead_code)]
    pub fn attach_as(&self, conn_id: u64) -> Client {
        self.attach_with(conn_id, None)
    }

    /// The callback connection (`control::ROLE_CALLBACKS`, no shared memory), as the router
    /// attaches it: callback frames arrive on the returned reader.
    #[allow(dead_code)] // not every test binary takes callbacks
    pub fn attach_callbacks(&self) -> FrameReader {
        let (ours, theirs) = Conn::pair().expect("socketpair");
        let mut w = Writer::with_header_room(HEADER_LEN);
        w.u64(2);
        w.u32(control::ROLE_CALLBACKS);
        w.u64(0);
        let len = w.buf.len() - HEADER_LEN;
        Header::new(Kind::Control, control::ATTACH, 0, len).write_to(&mut w.buf[..HEADER_LEN]);
        self.ctl.send(&w.buf, &[theirs.as_fd()]).expect("attach");
        FrameReader::new(ours)
    }

    /// A calls connection whose direct-reply replies (`control::OPT_DIRECT`) come on the
    /// returned reader.
    pub fn attach_direct(&self) -> (Client, FrameReader) {
        let (ours, theirs) = Conn::pair().expect("socketpair");
        let c = self.attach_with(1, Some(theirs));
        (c, FrameReader::new(ours))
    }

    fn attach_with(&self, conn_id: u64, direct: Option<Conn>) -> Client {
        let (ours, theirs) = Conn::pair().expect("socketpair");
        let shm = ShmRegion::create("server-test", 1 << 20).expect("shm");
        let mut w = Writer::with_header_room(HEADER_LEN);
        w.u64(conn_id);
        w.u32(control::ROLE_CALLS);
        w.u64(shm.len() as u64);
        if direct.is_some() {
            w.u32(control::OPT_DIRECT);
        }
        let len = w.buf.len() - HEADER_LEN;
        Header::new(Kind::Control, control::ATTACH, 0, len).write_to(&mut w.buf[..HEADER_LEN]);
        let mut fds = vec![theirs.as_fd(), shm.fd()];
        if let Some(d) = &direct {
            fds.push(d.as_fd());
        }
        self.ctl.send(&w.buf, &fds).expect("attach");
        let reader = FrameReader::new(ours.try_clone().expect("clone"));
        Client {
            conn: ours,
            reader,
            seq: 0,
            _shm: shm,
        }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The log once `needle` is in it `times` times (stderr is read by another thread,
    /// behind the replies), or after two seconds.
    pub fn log_with(&self, needle: &str, times: usize) -> String {
        let until = Instant::now() + Duration::from_secs(2);
        loop {
            let log = self.log();
            if log.matches(needle).count() >= times || Instant::now() > until {
                return log;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.ctl.shutdown();
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A calls connection spoken by hand.
pub struct Client {
    pub conn: Conn,
    pub reader: FrameReader,
    pub seq: u64,
    _shm: ShmRegion,
}

pub fn out(len: u64) -> OutSpec {
    OutSpec::Inline { len }
}

impl Client {
    /// Sends a request with header flags `fl` (e.g. ASYNC), without waiting.
    pub fn send(&mut self, op: u16, payload: &[u8], fl: u8) {
        self.seq += 1;
        let mut h = Header::new(Kind::Request, op, self.seq, payload.len());
        h.flags = fl;
        let mut buf = h.to_bytes().to_vec();
        buf.extend_from_slice(payload);
        self.conn.send(&buf, &[]).expect("send");
    }

    /// A synchronous call (asynchronous ones too: without the flag the server answers):
    /// (status, rest of the reply).
    pub fn call(&mut self, op: u16, w: &Writer) -> (i32, Vec<u8>) {
        let (h, p) = self.call_raw(op, w);
        let status = Reader::new(&p).i32().expect("status");
        let skip = if h.flags & flags::DEFERRED_ERROR != 0 {
            8
        } else {
            4
        };
        (status, p[skip..].to_vec())
    }

    /// A synchronous call: its reply's header and whole payload.
    pub fn call_raw(&mut self, op: u16, w: &Writer) -> (Header, Vec<u8>) {
        self.send(op, &w.buf, 0);
        self.reply()
    }

    /// The reply to the last frame sent (other frames before it are skipped).
    pub fn reply(&mut self) -> (Header, Vec<u8>) {
        loop {
            let f = self
                .reader
                .read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len)
                .expect("reply")
                .expect("server closed the connection");
            let h = Header::parse(f).expect("header");
            if h.kind == Kind::Reply && h.seq == self.seq {
                return (h, f[HEADER_LEN..].to_vec());
            }
        }
    }

    /// A call whose reply is status 0 and `ret` 0: the reply after `ret`.
    pub fn ok(&mut self, op: u16, w: &Writer) -> Vec<u8> {
        let (status, rest) = self.call(op, w);
        let mut r = Reader::new(&rest);
        assert_eq!((status, r.i32()), (0, Ok(0)), "op {op}");
        rest[4..].to_vec()
    }

    /// Creates something: its id.
    pub fn create(&mut self, op: u16, w: &Writer) -> u64 {
        let rest = self.ok(op, w);
        Reader::new(&rest).u64().expect("id")
    }
}

/// A device's context and queue, and one kernel built on it.
pub struct Cl {
    pub device: u64,
    pub context: u64,
    pub queue: u64,
    pub kernel: u64,
}

impl Client {
    /// The first device of the first platform, a context and queue on it, and kernel `name`
    /// built from `src`.
    pub fn open(&mut self, src: &str, name: &str) -> Cl {
        let mut w = Writer::default();
        w.u64(1);
        w.out_spec(out(8));
        w.out_spec(out(4));
        let rest = self.ok(hira_opencl::OP_CLGETPLATFORMIDS, &w);
        let platform = u64::from_le_bytes(
            Reader::new(&rest)
                .bytes()
                .expect("platform")
                .try_into()
                .expect("8 bytes"),
        );
        let mut w = Writer::default();
        w.u64(platform);
        w.u64(0xFFFF_FFFF);
        w.u64(1);
        w.out_spec(out(8));
        w.out_spec(out(4));
        let rest = self.ok(hira_opencl::OP_CLGETDEVICEIDS, &w);
        let device_b = Reader::new(&rest).bytes().expect("device").to_vec();
        let device = u64::from_le_bytes(device_b.as_slice().try_into().expect("8 bytes"));
        let mut w = Writer::default();
        w.blob(Blob::Null);
        w.u64(1);
        w.blob(Blob::Inline(&device_b));
        w.u64(0);
        let context = self.create(hira_opencl::OP_CLCREATECONTEXT, &w);
        let mut w = Writer::default();
        w.u64(context);
        w.u64(device);
        w.u64(0);
        let queue = self.create(hira_opencl::OP_CLCREATECOMMANDQUEUE, &w);
        let mut w = Writer::default();
        w.u64(context);
        w.u64(1);
        w.u64(1);
        w.blob(Blob::Inline(src.as_bytes()));
        w.blob(Blob::Null);
        let prog = self.create(hira_opencl::OP_CLCREATEPROGRAMWITHSOURCE, &w);
        let mut w = Writer::default();
        w.u64(prog);
        w.u64(0);
        w.blob(Blob::Null);
        w.blob(Blob::Null);
        w.u64(0);
        self.ok(hira_opencl::OP_CLBUILDPROGRAM, &w);
        let mut w = Writer::default();
        w.u64(prog);
        w.blob(Blob::Inline(name.as_bytes()));
        let kernel = self.create(hira_opencl::OP_CLCREATEKERNEL, &w);
        Cl {
            device,
            context,
            queue,
            kernel,
        }
    }
}
