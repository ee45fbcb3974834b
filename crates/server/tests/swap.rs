//! Buffer eviction and restore (device-memory over-subscription) with a real API server
//! process on the real OpenCL device. The test plays the router: it holds the server's
//! control socket (sends SWAP_MODE and EVICT; reads EVICTED, RESTORED, DONE and USAGE) and
//! attaches one calls connection on which it speaks the wire protocol by hand.
//!
//! The server process is this test executable run again with only `server_process_entry`
//! (which calls `hira_server::main_from_env`, as `hira server` does), so the server is
//! always the code under test, never a `hira` binary left by an earlier build.

mod common;

use common::{out, Cl, Client, Proc};
use hira_opencl::*;
use hira_transport::FrameReader;
use hira_wire::{control, flags, Blob, Header, Kind, Reader, Writer, HEADER_LEN, MAX_FRAME};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

const ENTRY: &str = "server_process_entry";
const ENTRY_ENV: &str = "HIRA_SWAP_TEST_SERVER";
const WAIT: Duration = Duration::from_secs(20);

const CL_MEM_READ_WRITE: u64 = 1;
const CL_MEM_USE_HOST_PTR: u64 = 1 << 3;
const CL_MEM_COPY_HOST_PTR: u64 = 1 << 5;
const CL_MEM_HOST_READ_ONLY: u64 = 1 << 8;
const CL_MEM_HOST_NO_ACCESS: u64 = 1 << 9;
const CL_BUFFER_CREATE_TYPE_REGION: u64 = 0x1220;
const CL_INVALID_MEM_OBJECT: i32 = -38;

/// Not a test: the server process (see the module doc). Does nothing in a normal run.
#[test]
fn server_process_entry() {
    common::server_entry(ENTRY_ENV);
}

/// The API server process and our end of its control socket.
struct Server {
    proc: Proc,
    frames: Receiver<(Header, Vec<u8>)>,
    /// Control frames read but not yet asked for (USAGE excluded).
    backlog: Vec<(Header, Vec<u8>)>,
    /// The latest USAGE: device ns, memory bytes, objects.
    usage: Option<(u64, u64, u64)>,
    seq: u64,
}

impl Server {
    fn spawn() -> Server {
        let proc = Proc::spawn(ENTRY, ENTRY_ENV);
        let (tx, frames) = std::sync::mpsc::channel();
        let mut reader = FrameReader::new(proc.ctl.try_clone().expect("clone"));
        std::thread::spawn(move || {
            while let Ok(Some(f)) = reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {
                let Ok(h) = Header::parse(f) else { break };
                if tx.send((h, f[HEADER_LEN..].to_vec())).is_err() {
                    break;
                }
            }
        });
        Server {
            proc,
            frames,
            backlog: Vec::new(),
            usage: None,
            seq: 0,
        }
    }

    /// A calls connection, as the router attaches it.
    fn attach(&self) -> Client {
        self.proc.attach()
    }

    fn control(&mut self, op: u16, payload: &[u8]) -> u64 {
        self.seq += 1;
        let mut buf = Header::new(Kind::Control, op, self.seq, payload.len())
            .to_bytes()
            .to_vec();
        buf.extend_from_slice(payload);
        self.proc.ctl.send(&buf, &[]).expect("control send");
        self.seq
    }

    fn next_frame(&mut self, until: Instant) -> Option<(Header, Vec<u8>)> {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.frames.recv_timeout(left) {
                Ok((h, p)) if h.opcode == control::USAGE => {
                    let mut r = Reader::new(&p);
                    if let (Ok(a), Ok(b), Ok(c)) = (r.u64(), r.u64(), r.u64()) {
                        self.usage = Some((a, b, c));
                    }
                }
                Ok(f) => return Some(f),
                Err(RecvTimeoutError::Timeout) => return None,
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("the server closed its control socket")
                }
            }
        }
    }

    /// The first control frame (read or still to come) that `pred` accepts.
    fn take(&mut self, what: &str, pred: impl Fn(&Header, &[u8]) -> bool) -> (Header, Vec<u8>) {
        if let Some(i) = self.backlog.iter().position(|(h, p)| pred(h, p)) {
            return self.backlog.remove(i);
        }
        let until = Instant::now() + WAIT;
        while let Some((h, p)) = self.next_frame(until) {
            if pred(&h, &p) {
                return (h, p);
            }
            self.backlog.push((h, p));
        }
        panic!("no {what} from the server within {WAIT:?}");
    }

    /// Read control frames for `d` into the backlog.
    fn pump(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while let Some(f) = self.next_frame(until) {
            self.backlog.push(f);
        }
    }

    /// RESTORED frames received so far (taken out of the backlog): (id, bytes).
    fn restored(&mut self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        self.backlog.retain(|(h, p)| {
            if h.opcode != control::RESTORED {
                return true;
            }
            let mut r = Reader::new(p);
            out.push((r.u64().expect("id"), r.u64().expect("bytes")));
            false
        });
        out
    }

    fn wait_restored(&mut self, id: u64, bytes: u64) {
        let (_, p) = self.take("RESTORED", |h, p| {
            h.opcode == control::RESTORED && Reader::new(p).u64() == Ok(id)
        });
        let mut r = Reader::new(&p);
        assert_eq!(r.u64(), Ok(id));
        assert_eq!(r.u64(), Ok(bytes), "RESTORED bytes of {id}");
        r.u64().expect("time ns");
        r.finish().expect("RESTORED payload length");
    }

    /// EVICT → (bytes evicted, kept ids).
    fn evict_raw(&mut self, payload: &[u8]) -> (u64, Vec<u64>) {
        let seq = self.control(control::EVICT, payload);
        let (_, p) = self.take("EVICTED", |h, _| {
            h.opcode == control::EVICTED && h.seq == seq
        });
        let mut r = Reader::new(&p);
        let bytes = r.u64().expect("bytes");
        let _ns = r.u64().expect("ns");
        let n = r.u32().expect("kept count");
        let kept = (0..n).map(|_| r.u64().expect("kept id")).collect();
        r.finish().expect("EVICTED payload length");
        (bytes, kept)
    }

    fn evict(&mut self, ids: &[u64]) -> (u64, Vec<u64>) {
        let mut w = Writer::default();
        w.u32(ids.len() as u32);
        for id in ids {
            w.u64(*id);
        }
        self.evict_raw(&w.buf)
    }

    /// Wait until USAGE reports `mem` bytes.
    fn wait_mem_bytes(&mut self, mem: u64) {
        let until = Instant::now() + WAIT;
        while self.usage.map(|u| u.1) != Some(mem) {
            assert!(
                Instant::now() < until,
                "USAGE never reported {mem} bytes (last {:?})",
                self.usage
            );
            // Short slices: USAGE frames update `usage` without ending next_frame.
            if let Some(f) = self.next_frame(Instant::now() + Duration::from_millis(50)) {
                self.backlog.push(f);
            }
        }
    }

    fn log(&self) -> String {
        self.proc.log()
    }

    fn log_with(&self, needle: &str, times: usize) -> String {
        self.proc.log_with(needle, times)
    }
}

impl Client {
    fn buffer(&mut self, context: u64, fl: u64, data: &[u8]) -> u64 {
        let mut w = Writer::default();
        w.u64(context);
        w.u64(fl);
        w.u64(data.len() as u64);
        w.blob(if fl & (CL_MEM_USE_HOST_PTR | CL_MEM_COPY_HOST_PTR) != 0 {
            Blob::Inline(data)
        } else {
            Blob::Null
        });
        self.create(OP_CLCREATEBUFFER, &w)
    }

    /// (status or API error, contents) of a blocking read of the whole buffer.
    fn read(&mut self, queue: u64, buf: u64, len: u64) -> (i32, Vec<u8>) {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(buf);
        w.u64(1);
        w.u64(0);
        w.u64(len);
        w.out_spec(out(len));
        w.u64(0);
        w.blob(Blob::Null);
        w.u64(0);
        let (status, rest) = self.call(OP_CLENQUEUEREADBUFFER, &w);
        if status != 0 {
            return (status, Vec::new());
        }
        let mut r = Reader::new(&rest);
        let ret = r.i32().expect("ret");
        (ret, r.bytes().expect("data").to_vec())
    }

    fn write(&mut self, queue: u64, buf: u64, data: &[u8]) {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(buf);
        w.u64(1);
        w.u64(0);
        w.u64(data.len() as u64);
        w.blob(Blob::Inline(data));
        w.u64(0);
        w.blob(Blob::Null);
        w.u64(0);
        self.ok(OP_CLENQUEUEWRITEBUFFER, &w);
    }

    fn arg_mem(&mut self, kernel: u64, index: u64, mem: u64) {
        let mut w = Writer::default();
        w.u64(kernel);
        w.u64(index);
        w.u64(8);
        w.u8(2);
        w.u64(mem);
        self.send(OP_CLSETKERNELARG, &w.buf, flags::ASYNC);
    }

    fn arg_u32(&mut self, kernel: u64, index: u64, v: u32) {
        let mut w = Writer::default();
        w.u64(kernel);
        w.u64(index);
        w.u64(4);
        w.u8(1);
        w.blob(Blob::Inline(&v.to_le_bytes()));
        self.send(OP_CLSETKERNELARG, &w.buf, flags::ASYNC);
    }

    fn launch(&mut self, queue: u64, kernel: u64, n: u64) {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(kernel);
        w.u64(1);
        w.blob(Blob::Null);
        w.blob(Blob::Inline(&n.to_le_bytes()));
        w.blob(Blob::Null);
        w.u64(0);
        w.blob(Blob::Null);
        w.u64(0);
        self.send(OP_CLENQUEUENDRANGEKERNEL, &w.buf, flags::ASYNC);
    }

    /// clFinish: (status, ret), with any deferred error of the asynchronous calls before.
    fn finish(&mut self, queue: u64) {
        let mut w = Writer::default();
        w.u64(queue);
        self.send(OP_CLFINISH, &w.buf, 0);
        let f = self
            .reader
            .read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len)
            .expect("reply")
            .expect("server closed the connection");
        let h = Header::parse(f).expect("header");
        assert_eq!(h.seq, self.seq);
        assert_eq!(
            h.flags & flags::DEFERRED_ERROR,
            0,
            "an asynchronous call failed: {:?}",
            Reader::new(&f[HEADER_LEN + 4..]).i32()
        );
        let mut r = Reader::new(&f[HEADER_LEN..]);
        assert_eq!((r.i32(), r.i32()), (Ok(0), Ok(0)), "clFinish");
    }

    fn release_mem(&mut self, mem: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(mem);
        let (status, rest) = self.call(OP_CLRELEASEMEMOBJECT, &w);
        assert_eq!(status, 0);
        Reader::new(&rest).i32().expect("ret")
    }

    fn retain_mem(&mut self, mem: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(mem);
        let (status, rest) = self.call(OP_CLRETAINMEMOBJECT, &w);
        assert_eq!(status, 0);
        Reader::new(&rest).i32().expect("ret")
    }
}

const SRC: &str = "__kernel void inc(__global uint *a, __global uint *b, uint na, uint nb) {
    size_t i = get_global_id(0);
    if (i < na) a[i] += 1;
    if (i < nb) b[i] += 1;
}";

fn setup(c: &mut Client) -> Cl {
    c.open(SRC, "inc")
}

fn pattern(n: usize, seed: u32) -> Vec<u8> {
    (0..n / 4)
        .flat_map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed)
                .to_le_bytes()
        })
        .collect()
}

/// `data` with `k` added to every u32.
fn plus(data: &[u8], k: u32) -> Vec<u8> {
    data.chunks_exact(4)
        .flat_map(|c| {
            u32::from_le_bytes(c.try_into().expect("4 bytes"))
                .wrapping_add(k)
                .to_le_bytes()
        })
        .collect()
}

fn same(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: {:#x} != {:#x}",
            got[i], want[i]
        );
    }
}

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

#[test]
fn evicted_buffers_come_back_bit_for_bit_and_kernels_are_bound_again() {
    let mut s = Server::spawn();
    let mut c = s.attach();
    let cl = setup(&mut c);
    let q = cl.queue;

    let (pa, pb, pc) = (pattern(MIB, 1), pattern(3 * MIB, 2), pattern(64 * KIB, 3));
    let a = c.buffer(cl.context, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, &pa);
    let b = c.buffer(cl.context, CL_MEM_READ_WRITE, &pb);
    c.write(q, b, &pb);
    let cbuf = c.buffer(cl.context, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, &pc);
    let used = c.buffer(
        cl.context,
        CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR,
        &pattern(4 * KIB, 4),
    );
    let total = (MIB + 3 * MIB + 64 * KIB + 4 * KIB) as u64;
    s.wait_mem_bytes(total);

    c.arg_mem(cl.kernel, 0, a);
    c.arg_mem(cl.kernel, 1, b);
    c.arg_u32(cl.kernel, 2, (MIB / 4) as u32);
    c.arg_u32(cl.kernel, 3, (3 * MIB / 4) as u32);
    c.finish(q);

    // Two buffers out; the accounting keeps counting them (the tenant's footprint).
    assert_eq!(s.evict(&[a, b]), ((4 * MIB) as u64, vec![]));
    // Unknown ids and pinned buffers are kept; an evicted buffer is done already.
    let unknown = 0xdead_beef;
    assert_eq!(s.evict(&[unknown, used, a]), (0, vec![unknown, used]));
    // A handle of another kind is no buffer either.
    assert_eq!(s.evict(&[cl.kernel]), (0, vec![cl.kernel]));

    // Reading an evicted buffer restores it, bit for bit.
    let (ret, got) = c.read(q, a, MIB as u64);
    assert_eq!(ret, 0);
    same("a after restore", &got, &pa);
    s.wait_restored(a, MIB as u64);

    // The kernel's arguments name a (restored: a new vendor object) and b (still out):
    // the launch restores b and binds both again.
    let n = (3 * MIB / 4) as u64;
    c.launch(q, cl.kernel, n);
    c.finish(q);
    s.wait_restored(b, (3 * MIB) as u64);
    let (ret, got) = c.read(q, a, MIB as u64);
    assert_eq!(ret, 0);
    same("a after the kernel", &got, &plus(&pa, 1));
    let (ret, got) = c.read(q, b, (3 * MIB) as u64);
    assert_eq!(ret, 0);
    same("b after the kernel", &got, &plus(&pb, 1));

    // Again, after the kernel ran: out, and the next launch brings both back.
    assert_eq!(s.evict(&[b, a]), ((4 * MIB) as u64, vec![]));
    c.launch(q, cl.kernel, n);
    c.finish(q);
    s.wait_restored(a, MIB as u64);
    s.wait_restored(b, (3 * MIB) as u64);
    let (ret, got) = c.read(q, a, MIB as u64);
    assert_eq!(ret, 0);
    same("a after two kernels", &got, &plus(&pa, 2));
    let (ret, got) = c.read(q, b, (3 * MIB) as u64);
    assert_eq!(ret, 0);
    same("b after two kernels", &got, &plus(&pb, 2));

    // An evicted buffer passed to clSetKernelArg is bound as NULL, and the launch restores
    // and binds it.
    assert_eq!(s.evict(&[cbuf]), ((64 * KIB) as u64, vec![]));
    c.arg_mem(cl.kernel, 1, cbuf);
    c.arg_u32(cl.kernel, 3, (64 * KIB / 4) as u32);
    c.launch(q, cl.kernel, n);
    c.finish(q);
    s.wait_restored(cbuf, (64 * KIB) as u64);
    let (ret, got) = c.read(q, cbuf, (64 * KIB) as u64);
    assert_eq!(ret, 0);
    same("c after the kernel", &got, &plus(&pc, 1));
    let (ret, got) = c.read(q, a, MIB as u64);
    assert_eq!(ret, 0);
    same("a after three kernels", &got, &plus(&pa, 3));

    // Retain and release of an evicted buffer only count: no restore.
    assert_eq!(s.evict(&[cbuf]), ((64 * KIB) as u64, vec![]));
    assert_eq!(c.retain_mem(cbuf), 0);
    assert_eq!(c.release_mem(cbuf), 0);
    // Releasing an evicted buffer for good: no restore, the memory leaves the accounting.
    assert_eq!(s.evict(&[b]), ((3 * MIB) as u64, vec![]));
    assert_eq!(c.release_mem(b), 0);
    c.finish(q);
    s.pump(Duration::from_millis(300));
    assert_eq!(s.restored(), vec![], "retain/release restored a buffer");
    s.wait_mem_bytes(total - (3 * MIB) as u64);
    let (ret, _) = c.read(q, b, 16);
    assert_eq!(ret, CL_INVALID_MEM_OBJECT, "a released buffer is gone");
    assert_eq!(s.evict(&[b]), (0, vec![b]));
    // The retained-and-released one still holds one reference and its contents.
    let (ret, got) = c.read(q, cbuf, (64 * KIB) as u64);
    assert_eq!(ret, 0);
    same("c after retain/release", &got, &plus(&pc, 1));
    s.wait_restored(cbuf, (64 * KIB) as u64);
    // And a restored buffer released normally.
    assert_eq!(c.release_mem(cbuf), 0);
    s.wait_mem_bytes(total - (3 * MIB + 64 * KIB) as u64);
    // The kernel's b argument (c, released) is the tenant's business; a is still bound.
    c.arg_mem(cl.kernel, 1, a);
    c.arg_u32(cl.kernel, 3, 0);
    assert_eq!(s.evict(&[a]), (MIB as u64, vec![]));
    c.launch(q, cl.kernel, (MIB / 4) as u64);
    c.finish(q);
    let (ret, got) = c.read(q, a, MIB as u64);
    assert_eq!(ret, 0);
    same("a at the end", &got, &plus(&pa, 4));
    assert!(!s.log().contains("panicked"), "server panicked");
}

#[test]
fn malformed_evicts_pins_clones_and_gated_transfers() {
    let mut s = Server::spawn();
    let mut c = s.attach();
    let cl = setup(&mut c);
    let q = cl.queue;
    let data = pattern(256 * KIB, 9);
    let a = c.buffer(cl.context, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, &data);

    // Three ids announced, one present: nothing evicted, the one read is kept.
    let mut w = Writer::default();
    w.u32(3);
    w.u64(a);
    assert_eq!(s.evict_raw(&w.buf), (0, vec![a]));
    // Not even a count.
    assert_eq!(s.evict_raw(&[1, 2]), (0, vec![]));
    // Trailing bytes.
    let mut w = Writer::default();
    w.u32(1);
    w.u64(a);
    w.u8(0);
    assert_eq!(s.evict_raw(&w.buf), (0, vec![a]));
    let log = s.log_with("malformed EVICT", 3);
    assert!(
        log.matches("malformed EVICT").count() >= 3,
        "malformed EVICTs not logged:\n{log}"
    );
    // Still serving, and the buffer is intact.
    let (ret, got) = c.read(q, a, data.len() as u64);
    assert_eq!(ret, 0);
    same("a after bad EVICTs", &got, &data);

    // Pinned: host cannot read it back; under a sub-buffer; with a destructor callback.
    let no_access = c.buffer(cl.context, CL_MEM_READ_WRITE | CL_MEM_HOST_NO_ACCESS, &data);
    let parent = c.buffer(cl.context, CL_MEM_READ_WRITE, &data);
    let mut w = Writer::default();
    w.u64(parent);
    w.u64(CL_MEM_READ_WRITE);
    w.u64(CL_BUFFER_CREATE_TYPE_REGION);
    let mut region = Vec::new();
    region.extend_from_slice(&0u64.to_le_bytes());
    region.extend_from_slice(&(4 * KIB as u64).to_le_bytes());
    w.blob(Blob::Inline(&region));
    let sub = c.create(OP_CLCREATESUBBUFFER, &w);
    let watched = c.buffer(cl.context, CL_MEM_READ_WRITE, &data);
    let mut w = Writer::default();
    w.u64(watched);
    w.u64(1);
    c.ok(OP_CLSETMEMOBJECTDESTRUCTORCALLBACK, &w);
    assert_eq!(
        s.evict(&[no_access, parent, sub, watched]),
        (0, vec![no_access, parent, sub, watched])
    );
    // HOST_READ_ONLY can be read back and is restored without a host write.
    let read_only = c.buffer(
        cl.context,
        CL_MEM_READ_WRITE | CL_MEM_HOST_READ_ONLY | CL_MEM_COPY_HOST_PTR,
        &data,
    );
    assert_eq!(s.evict(&[read_only]), (data.len() as u64, vec![]));
    let (ret, got) = c.read(q, read_only, data.len() as u64);
    assert_eq!(ret, 0);
    same("HOST_READ_ONLY buffer", &got, &data);
    s.wait_restored(read_only, data.len() as u64);

    // A clone inherits the source kernel's buffer arguments.
    c.arg_mem(cl.kernel, 0, a);
    c.arg_mem(cl.kernel, 1, a);
    c.arg_u32(cl.kernel, 2, (data.len() / 4) as u32);
    c.arg_u32(cl.kernel, 3, 0);
    let mut w = Writer::default();
    w.u64(cl.kernel);
    let clone = c.create(OP_CLCLONEKERNEL, &w);
    let mut w = Writer::default();
    w.u64(cl.kernel);
    c.ok(OP_CLRELEASEKERNEL, &w);
    assert_eq!(s.evict(&[a]), (data.len() as u64, vec![]));
    c.launch(q, clone, (data.len() / 4) as u64);
    c.finish(q);
    s.wait_restored(a, data.len() as u64);
    let (ret, got) = c.read(q, a, data.len() as u64);
    assert_eq!(ret, 0);
    same("a after the cloned kernel", &got, &plus(&data, 1));

    // Over-subscribed: buffer transfers report their completion like kernels, refused ones
    // at once.
    s.control(control::SWAP_MODE, &[1]);
    s.pump(Duration::from_millis(100));
    s.backlog.clear();
    let (ret, _) = c.read(q, a, data.len() as u64);
    assert_eq!(ret, 0);
    s.take("DONE of a read", |h, _| h.opcode == control::DONE);
    let (ret, _) = c.read(q, 0x7777, 16);
    assert_ne!(ret, 0);
    s.take("DONE of a refused read", |h, _| h.opcode == control::DONE);
    // A read of an evicted buffer under the gate: restored, done.
    assert_eq!(s.evict(&[a]), (data.len() as u64, vec![]));
    let (ret, got) = c.read(q, a, data.len() as u64);
    assert_eq!(ret, 0);
    same("a restored while gated", &got, &plus(&data, 1));
    s.wait_restored(a, data.len() as u64);
    s.take("DONE of a restoring read", |h, _| h.opcode == control::DONE);
    s.control(control::SWAP_MODE, &[0]);
    s.pump(Duration::from_millis(100));
    s.backlog.clear();
    let (ret, _) = c.read(q, a, data.len() as u64);
    assert_eq!(ret, 0);
    s.pump(Duration::from_millis(300));
    assert!(
        !s.backlog.iter().any(|(h, _)| h.opcode == control::DONE),
        "DONE for a transfer while not over-subscribed"
    );
}
