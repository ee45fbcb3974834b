//! SVM pointers a tenant sends are checked against the allocations it made through its own
//! API server: forged ones (another tenant's, beside or past its own, freed, arbitrary) get
//! CL_INVALID_VALUE (CL_INVALID_ARG_VALUE as a kernel argument) and a log line, and nothing
//! is read or written. Real API server processes on the real OpenCL device; the tenants speak
//! the wire protocol by hand (as a hostile tenant that bypasses the guest library would).
//!
//! Each server process is this test executable run again with only `server_process_entry`
//! (which calls `hira_server::main_from_env`, as `hira server` does), so the server is always
//! the code under test. The test plays the router: it attaches one calls connection per
//! tenant and keeps the control socket.

mod common;

use common::{out, Cl, Client, Proc};
use hira_opencl::*;
use hira_transport::FrameReader;
use hira_wire::{Blob, Header, OutSpec, Reader, Writer, HEADER_LEN, MAX_FRAME};

const ENTRY: &str = "server_process_entry";
const ENTRY_ENV: &str = "HIRA_SVM_TEST_SERVER";

const CL_INVALID_VALUE: i32 = -30;
const CL_INVALID_ARG_VALUE: i32 = -50;
const CL_MEM_READ_WRITE: u64 = 1;
const CL_MEM_USE_HOST_PTR: u64 = 1 << 3;
/// The guest's mark for a USE_HOST_PTR buffer on SVM memory (`crates/server/src/svm.rs`).
const HOST_PTR_IS_SVM: u64 = 1 << 63;
const CL_DEVICE_SVM_CAPABILITIES: u64 = 0x1053;
const CL_KERNEL_EXEC_INFO_SVM_PTRS: u64 = 0x11B6;
/// Copy tags (`crates/server/src/svm.rs`).
const DST_SVM: u64 = 0;
const DST_REPLY: u64 = 1;
const SRC_SVM: u64 = 0;
const SRC_BYTES: u64 = 1;
const CL_MEM_OBJECT_ALLOCATION_FAILURE: i32 = -4;
const CL_MEM_SVM_FINE_GRAIN_BUFFER: u64 = 1 << 10;
/// `hira_wire::control::SVM_ARENA`.
const ARENA_LEN: usize = 4 << 20;
const REFUSED_LOG: &str = "SVM pointer outside this tenant's allocations refused";

/// Not a test: the server process (see the module doc). Does nothing in a normal run.
#[test]
fn server_process_entry() {
    common::server_entry(ENTRY_ENV);
}

/// One tenant's API server process; its control frames (USAGE) are read and dropped.
struct Server {
    proc: Proc,
}

impl Server {
    fn spawn() -> Server {
        let proc = Proc::spawn(ENTRY, ENTRY_ENV);
        let mut reader = FrameReader::new(proc.ctl.try_clone().expect("clone"));
        std::thread::spawn(move || {
            while let Ok(Some(_)) = reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {}
        });
        Server { proc }
    }

    /// A calls connection, as the router attaches it.
    fn attach(&self) -> Client {
        self.proc.attach()
    }

    /// How often `needle` is in the log, once it is there `times` times or after two
    /// seconds (stderr is read by another thread, behind the replies).
    fn log_count(&self, needle: &str, times: usize) -> usize {
        self.proc.log_with(needle, times).matches(needle).count()
    }
}

/// The end of every enqueue: no wait list, no event.
fn no_events(w: &mut Writer) {
    w.u64(0);
    w.blob(Blob::Null);
    w.u64(0);
}

impl Client {
    /// The call's error: the refusal status, else the API's return value.
    fn code(&mut self, op: u16, w: &Writer) -> i32 {
        let (status, rest) = self.call(op, w);
        if status != 0 {
            return status;
        }
        Reader::new(&rest).i32().expect("ret")
    }

    fn svm_alloc(&mut self, context: u64, size: u64) -> u64 {
        let mut w = Writer::default();
        w.u64(context);
        w.u64(CL_MEM_READ_WRITE);
        w.u64(size);
        w.u64(0);
        let rest = self.ok(OP_CLSVMALLOC, &w);
        let p = Reader::new(&rest).u64().expect("pointer");
        assert_ne!(p, 0, "clSVMAlloc");
        p
    }

    fn fill(&mut self, queue: u64, ptr: u64, pattern: u32, size: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(ptr);
        w.blob(Blob::Inline(&pattern.to_le_bytes()));
        w.u64(4);
        w.u64(size);
        no_events(&mut w);
        self.code(OP_CLENQUEUESVMMEMFILL, &w)
    }

    /// A blocking SVM-to-host copy: (error, bytes).
    fn read(&mut self, queue: u64, ptr: u64, size: u64) -> (i32, Vec<u8>) {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(1);
        w.u64(DST_REPLY);
        w.out_spec(out(size));
        w.u64(SRC_SVM);
        w.u64(ptr);
        w.u64(size);
        no_events(&mut w);
        let (status, rest) = self.call(OP_CLENQUEUESVMMEMCPY, &w);
        if status != 0 {
            return (status, Vec::new());
        }
        let mut r = Reader::new(&rest);
        let ret = r.i32().expect("ret");
        (ret, r.bytes().expect("data").to_vec())
    }

    /// A blocking host-to-SVM copy.
    fn write(&mut self, queue: u64, ptr: u64, data: &[u8]) -> i32 {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(1);
        w.u64(DST_SVM);
        w.u64(ptr);
        w.u64(SRC_BYTES);
        w.blob(Blob::Inline(data));
        w.u64(data.len() as u64);
        no_events(&mut w);
        self.code(OP_CLENQUEUESVMMEMCPY, &w)
    }

    fn svm_to_svm(&mut self, queue: u64, dst: u64, src: u64, size: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(1);
        w.u64(DST_SVM);
        w.u64(dst);
        w.u64(SRC_SVM);
        w.u64(src);
        w.u64(size);
        no_events(&mut w);
        self.code(OP_CLENQUEUESVMMEMCPY, &w)
    }

    fn map(&mut self, queue: u64, ptr: u64, size: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(1);
        w.u64(1); // CL_MAP_READ
        w.u64(ptr);
        w.u64(size);
        w.u64(DST_REPLY);
        w.out_spec(out(size));
        no_events(&mut w);
        self.code(OP_CLENQUEUESVMMAP, &w)
    }

    fn unmap(&mut self, queue: u64, ptr: u64, data: &[u8]) -> i32 {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(ptr);
        w.u64(data.len() as u64);
        w.blob(Blob::Inline(data));
        no_events(&mut w);
        self.code(OP_CLENQUEUESVMUNMAP, &w)
    }

    fn migrate(&mut self, queue: u64, ptr: u64, size: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(1);
        w.blob(Blob::Inline(&ptr.to_le_bytes()));
        w.blob(Blob::Inline(&size.to_le_bytes()));
        w.u64(0);
        no_events(&mut w);
        self.code(OP_CLENQUEUESVMMIGRATEMEM, &w)
    }

    fn kernel_arg(&mut self, kernel: u64, ptr: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(kernel);
        w.u64(0);
        w.u64(ptr);
        self.code(OP_CLSETKERNELARGSVMPOINTER, &w)
    }

    fn exec_info(&mut self, kernel: u64, ptr: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(kernel);
        w.u64(CL_KERNEL_EXEC_INFO_SVM_PTRS);
        w.u64(8);
        w.blob(Blob::Inline(&ptr.to_le_bytes()));
        self.code(OP_CLSETKERNELEXECINFO, &w)
    }

    /// clCreateBuffer on SVM memory, as the guest sends it: (error, buffer id).
    fn buffer_on(&mut self, context: u64, ptr: u64, size: u64) -> (i32, u64) {
        let mut w = Writer::default();
        w.u64(context);
        w.u64(CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR | HOST_PTR_IS_SVM);
        w.u64(size);
        w.blob(Blob::Inline(&ptr.to_le_bytes()));
        let (status, rest) = self.call(OP_CLCREATEBUFFER, &w);
        if status != 0 {
            return (status, 0);
        }
        let mut r = Reader::new(&rest);
        (r.i32().expect("errcode"), r.u64().expect("id"))
    }

    fn enqueue_free(&mut self, queue: u64, ptr: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(1);
        w.blob(Blob::Inline(&ptr.to_le_bytes()));
        no_events(&mut w);
        self.code(OP_CLENQUEUESVMFREE, &w)
    }

    /// A fine-grained clSVMAlloc: (ret, pointer, offered address).
    fn fine_alloc(&mut self, context: u64, size: u64) -> (i32, u64, u64) {
        let mut w = Writer::default();
        w.u64(context);
        w.u64(CL_MEM_READ_WRITE | CL_MEM_SVM_FINE_GRAIN_BUFFER);
        w.u64(size);
        w.u64(0);
        let (status, rest) = self.call(OP_CLSVMALLOC, &w);
        assert_eq!(status, 0);
        let mut r = Reader::new(&rest);
        let ret = r.i32().expect("ret");
        let p = r.u64().expect("pointer");
        (ret, p, r.u64().unwrap_or(0))
    }

    /// `control::SVM_ARENA`: the memfd and the address this process mapped it at.
    fn send_arena(&mut self, fd: std::os::fd::BorrowedFd<'_>, addr: usize, len: usize) {
        let mut w = Writer::default();
        w.u64(addr as u64);
        w.u64(len as u64);
        self.seq += 1;
        let mut h = Header::new(
            hira_wire::Kind::Control,
            hira_wire::control::SVM_ARENA,
            self.seq,
            w.buf.len(),
        );
        h.flags = hira_wire::flags::ASYNC;
        let mut buf = h.to_bytes().to_vec();
        buf.extend_from_slice(&w.buf);
        self.conn.send(&buf, &[fd]).expect("send arena");
    }

    fn launch(&mut self, queue: u64, kernel: u64, items: u64) {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(kernel);
        w.u64(1);
        w.blob(Blob::Null);
        w.blob(Blob::Inline(&items.to_le_bytes()));
        w.blob(Blob::Null);
        no_events(&mut w);
        self.ok(OP_CLENQUEUENDRANGEKERNEL, &w);
        let mut w = Writer::default();
        w.u64(queue);
        self.ok(OP_CLFINISH, &w);
    }

    fn svm_free(&mut self, context: u64, ptr: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(context);
        w.u64(ptr);
        self.code(OP_CLSVMFREE, &w)
    }

    /// A blocking read of a whole buffer object.
    fn read_buffer(&mut self, queue: u64, buf: u64, len: u64) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(buf);
        w.u64(1);
        w.u64(0);
        w.u64(len);
        w.out_spec(out(len));
        no_events(&mut w);
        let rest = self.ok(OP_CLENQUEUEREADBUFFER, &w);
        Reader::new(&rest).bytes().expect("data").to_vec()
    }
}

/// A tenant: its server, a connection, a context, a queue and a kernel with a pointer argument.
struct Tenant {
    server: Server,
    c: Client,
    device: u64,
    context: u64,
    queue: u64,
    kernel: u64,
}

fn tenant() -> Tenant {
    let server = Server::spawn();
    let mut c = server.attach();
    let Cl {
        device,
        context,
        queue,
        kernel,
    } = c.open(
        "__kernel void inc(__global uint *a) { a[get_global_id(0)] += 1; }",
        "inc",
    );
    Tenant {
        server,
        c,
        device,
        context,
        queue,
        kernel,
    }
}

/// What the `inc` kernel makes of `data`: every u32 plus one.
fn incremented(data: &[u8]) -> Vec<u8> {
    data.chunks(4)
        .flat_map(|c| {
            u32::from_le_bytes(c.try_into().expect("4 bytes"))
                .wrapping_add(1)
                .to_le_bytes()
        })
        .collect()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

#[test]
fn forged_svm_pointers_are_refused() {
    const A_SIZE: u64 = 1 << 16;
    const B_SIZE: u64 = 3 << 12;
    let mut a = tenant();
    let mut b = tenant();
    let secret = pattern(A_SIZE as usize, 7);
    let a_ptr = a.c.svm_alloc(a.context, A_SIZE);
    assert_eq!(a.c.write(a.queue, a_ptr, &secret), 0);
    let b_ptr = b.c.svm_alloc(b.context, B_SIZE);
    assert_eq!(b.c.fill(b.queue, b_ptr, 0x0101_0101, B_SIZE), 0);
    let freed = b.c.svm_alloc(b.context, 4096);
    assert_eq!(b.c.svm_free(b.context, freed), 0);

    // Pointers B may not name: A's (meaningless in B's server, maybe someone's memory there),
    // beside and past B's allocation, freed, arbitrary. A value that happens to fall inside
    // B's own allocation is B's memory: left out.
    let own = |p: u64, len: u64| p >= b_ptr && p.saturating_add(len) <= b_ptr + B_SIZE;
    let forged: Vec<u64> = [
        a_ptr,
        a_ptr + 64,
        b_ptr - 8,
        b_ptr + B_SIZE,
        b_ptr + (1 << 32),
        freed,
        0x1000,
        0x7fff_ffff_f000,
        u64::MAX - 7,
    ]
    .into_iter()
    .filter(|&p| !own(p, 8))
    .collect();
    let mut refused = 0;
    let mut wrong = Vec::new();
    let mut expect = |what: &str, p: u64, got: i32, want: i32| {
        refused += 1;
        if got != want {
            wrong.push(format!("{what}({p:#x}) -> {got}"));
        }
    };
    for &p in &forged {
        expect(
            "fill",
            p,
            b.c.fill(b.queue, p, 0xdead_beef, 8),
            CL_INVALID_VALUE,
        );
        expect("read", p, b.c.read(b.queue, p, 8).0, CL_INVALID_VALUE);
        expect(
            "write",
            p,
            b.c.write(b.queue, p, &[0xEE; 8]),
            CL_INVALID_VALUE,
        );
        expect(
            "copy to",
            p,
            b.c.svm_to_svm(b.queue, p, b_ptr, 8),
            CL_INVALID_VALUE,
        );
        expect(
            "copy from",
            p,
            b.c.svm_to_svm(b.queue, b_ptr, p, 8),
            CL_INVALID_VALUE,
        );
        expect("map", p, b.c.map(b.queue, p, 8), CL_INVALID_VALUE);
        expect(
            "unmap",
            p,
            b.c.unmap(b.queue, p, &[0xEE; 8]),
            CL_INVALID_VALUE,
        );
        expect("migrate", p, b.c.migrate(b.queue, p, 8), CL_INVALID_VALUE);
        expect("arg", p, b.c.kernel_arg(b.kernel, p), CL_INVALID_ARG_VALUE);
        expect("exec info", p, b.c.exec_info(b.kernel, p), CL_INVALID_VALUE);
        expect(
            "buffer",
            p,
            b.c.buffer_on(b.context, p, 8).0,
            CL_INVALID_VALUE,
        );
        expect(
            "enqueue free",
            p,
            b.c.enqueue_free(b.queue, p),
            CL_INVALID_VALUE,
        );
        expect("free", p, b.c.svm_free(b.context, p), CL_INVALID_VALUE);
    }
    // Ranges that start inside B's allocation and run past its end.
    let tail = b_ptr + B_SIZE - 4;
    expect(
        "fill past the end",
        tail,
        b.c.fill(b.queue, tail, 0, 8),
        CL_INVALID_VALUE,
    );
    expect(
        "read past the end",
        tail,
        b.c.read(b.queue, tail, 8).0,
        CL_INVALID_VALUE,
    );
    expect(
        "write past the end",
        tail,
        b.c.write(b.queue, tail, &[0; 8]),
        CL_INVALID_VALUE,
    );
    expect(
        "map past the end",
        tail,
        b.c.map(b.queue, tail, 8),
        CL_INVALID_VALUE,
    );
    expect(
        "copy past the end",
        b_ptr,
        b.c.svm_to_svm(b.queue, b_ptr + 8, b_ptr, B_SIZE),
        CL_INVALID_VALUE,
    );
    expect(
        "buffer past the end",
        tail,
        b.c.buffer_on(b.context, tail, 8).0,
        CL_INVALID_VALUE,
    );
    expect(
        "migrate past the end",
        tail,
        b.c.migrate(b.queue, tail, 8),
        CL_INVALID_VALUE,
    );
    // An interior pointer is not an allocation to free.
    expect(
        "free inside",
        b_ptr + 64,
        b.c.svm_free(b.context, b_ptr + 64),
        CL_INVALID_VALUE,
    );
    let wrong_count = wrong.len();
    let refusals = refused;

    let (ret_a, data_a) = a.c.read(a.queue, a_ptr, A_SIZE);
    let (ret_b, data_b) = b.c.read(b.queue, b_ptr, B_SIZE);
    // Refused frees log a line of their own.
    let named = refusals - 2 * forged.len() - 1;
    let logged = b.server.log_count(REFUSED_LOG, named);

    assert!(wrong_count == 0, "not refused as expected: {wrong:?}");
    assert_eq!(ret_a, 0);
    assert!(data_a == secret, "the other tenant's SVM data changed");
    assert_eq!(ret_b, 0);
    assert!(
        data_b.iter().all(|&x| x == 1),
        "the tenant's own SVM data changed"
    );
    assert!(logged >= named, "{logged} log lines for {named} refusals");
    assert_eq!(
        a.server.log_count(REFUSED_LOG, 0),
        0,
        "the other server saw nothing"
    );
}

#[test]
fn svm_pointers_inside_the_tenants_allocations_work() {
    const SIZE: u64 = 1 << 14;
    let mut t = tenant();
    let mut w = Writer::default();
    w.u64(t.device);
    w.u64(CL_DEVICE_SVM_CAPABILITIES);
    w.u64(8);
    w.out_spec(out(8));
    w.out_spec(OutSpec::Null);
    let rest = t.c.ok(OP_CLGETDEVICEINFO, &w);
    let caps = u64::from_le_bytes(
        Reader::new(&rest)
            .bytes()
            .expect("caps")
            .try_into()
            .expect("8 bytes"),
    );
    let p = t.c.svm_alloc(t.context, SIZE);
    let data = pattern(SIZE as usize, 3);
    let wrote = t.c.write(t.queue, p, &data);
    let copied = t.c.svm_to_svm(t.queue, p + SIZE / 2, p, SIZE / 4);
    let (ret, back) = t.c.read(t.queue, p, SIZE);
    let mut want = data.clone();
    want.copy_within(0..SIZE as usize / 4, SIZE as usize / 2);
    // A buffer on the allocation aliases it: the kernel's increments show in SVM.
    let (err, buf) = t.c.buffer_on(t.context, p + 4096, 4096);
    let arg = t.c.kernel_arg(t.kernel, p + 8);
    let info = t.c.exec_info(t.kernel, p);
    t.c.buffer_arg(t.kernel, buf);
    let mut w = Writer::default();
    w.u64(t.queue);
    w.u64(t.kernel);
    w.u64(1);
    w.blob(Blob::Null);
    w.blob(Blob::Inline(&1024u64.to_le_bytes()));
    w.blob(Blob::Null);
    no_events(&mut w);
    t.c.ok(OP_CLENQUEUENDRANGEKERNEL, &w);
    let via_buffer = t.c.read_buffer(t.queue, buf, 4096);
    let (_, after) = t.c.read(t.queue, p + 4096, 4096);
    let mut w = Writer::default();
    w.u64(buf);
    t.c.ok(OP_CLRELEASEMEMOBJECT, &w);
    let freed = t.c.svm_free(t.context, p);
    let use_after_free = t.c.fill(t.queue, p, 0, 4);

    assert_eq!(
        caps,
        1 | 2 | 8,
        "coarse-grained buffers, and on a CPU device fine-grained buffers and atomics \
         (never fine-grained system SVM)"
    );
    assert_eq!((wrote, copied, ret), (0, 0, 0));
    assert!(
        back == want,
        "SVM contents after host->SVM and SVM->SVM copies"
    );
    assert_eq!((err, arg, info), (0, 0, 0));
    let inc = incremented(&data[4096..8192]);
    assert!(via_buffer == inc, "the kernel ran on the aliasing buffer");
    assert!(after == inc, "the buffer aliases the SVM allocation");
    assert_eq!(freed, 0);
    assert_eq!(
        use_after_free, CL_INVALID_VALUE,
        "a freed allocation is gone"
    );
}

/// Fine-grained SVM: the tenant's arena is mapped by the server at the address the tenant
/// mapped it at, allocations come out of it, and a kernel's writes show in the tenant's own
/// mapping with no copy. Pointers outside the allocations stay refused; a second arena and
/// an arena the tenant could shrink are refused.
#[test]
fn fine_grained_svm_is_the_same_memory_at_the_same_address() {
    const SIZE: u64 = 1 << 16;
    let mut t = tenant();
    let before = t.c.fine_alloc(t.context, SIZE);
    let mut arena = hira_transport::ShmRegion::create("arena", ARENA_LEN).expect("memfd");
    t.c.send_arena(arena.fd(), arena.as_ptr() as usize, ARENA_LEN);
    let (mut ret, mut p, offer) = t.c.fine_alloc(t.context, SIZE);
    if p == 0 && offer != 0 {
        // The address was taken in the server: map the arena where it offers, as the guest does.
        arena = arena.map_again_at(offer as usize).expect("offered address");
        t.c.send_arena(arena.fd(), arena.as_ptr() as usize, ARENA_LEN);
        (ret, p, _) = t.c.fine_alloc(t.context, SIZE);
    }
    let base = arena.as_ptr() as u64;
    let inside = p >= base && p + SIZE <= base + ARENA_LEN as u64;
    let data = pattern(SIZE as usize, 7);
    arena.write_at(p - base, &data).expect("write");
    let arg = t.c.kernel_arg(t.kernel, p);
    t.c.launch(t.queue, t.kernel, SIZE / 4);
    let mut after = vec![0u8; SIZE as usize];
    arena.read_at(p - base, &mut after).expect("read");
    let inc = incremented(&data);
    let (copy_ret, copied) = t.c.read(t.queue, p + 4, 8);
    let past_end = t.c.kernel_arg(t.kernel, p + SIZE);
    let other = hira_transport::ShmRegion::create("arena2", ARENA_LEN).expect("memfd");
    t.c.send_arena(other.fd(), other.as_ptr() as usize, ARENA_LEN);
    let second = t.server.log_count("second SVM arena refused", 1);
    let freed = t.c.svm_free(t.context, p);
    let use_after_free = t.c.fill(t.queue, p, 0, 4);
    let (again, q, _) = t.c.fine_alloc(t.context, SIZE);

    // Another tenant sends an arena it could still shrink.
    let mut u = tenant();
    // SAFETY: memfd_create with a literal name; the fd is owned below.
    let raw = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0);
    // SAFETY: just created, owned by nobody else.
    let plain = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    // SAFETY: ftruncate on our fd.
    assert_eq!(unsafe { libc::ftruncate(raw, ARENA_LEN as i64) }, 0);
    use std::os::fd::AsFd;
    // An address a fresh process has nothing at: the refusal must be for the seal alone.
    u.c.send_arena(plain.as_fd(), 0x5000_0000_0000, ARENA_LEN);
    let unsealed = u.c.fine_alloc(u.context, SIZE);

    assert_eq!(
        before,
        (CL_MEM_OBJECT_ALLOCATION_FAILURE, 0, 0),
        "no arena yet"
    );
    assert_eq!(ret, 0);
    assert!(inside, "allocation {p:#x} outside the arena at {base:#x}");
    assert_eq!(arg, 0);
    assert!(after == inc, "the kernel wrote the tenant's own mapping");
    assert_eq!(copy_ret, 0);
    assert_eq!(copied, inc[4..12], "SVM copies read the arena too");
    assert_eq!(past_end, CL_INVALID_ARG_VALUE);
    assert_eq!(second, 1);
    assert_eq!((freed, use_after_free), (0, CL_INVALID_VALUE));
    assert_eq!((again, q), (0, p), "freed arena memory is reused");
    assert_eq!(unsealed, (CL_MEM_OBJECT_ALLOCATION_FAILURE, 0, 0));
    assert_eq!(u.server.log_count("SVM arena refused", 1), 1);
}

/// An arena whose address is taken in the server: the server offers a free address in the
/// shared window, and keeps offering it until an arena is placed; an arena sent at another
/// address of the window (where the guest goes when the offer is taken on its side) is
/// placed too, and allocations come out of it.
#[test]
fn a_taken_arena_address_gets_an_offer_and_any_free_address_is_placed() {
    let mut t = tenant();
    // Map the arena here at the start of one of the server's own mappings.
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", t.server.proc.pid())).unwrap();
    let arena = hira_transport::ShmRegion::create("arena", ARENA_LEN).expect("memfd");
    let taken = maps
        .lines()
        .filter_map(|l| usize::from_str_radix(l.split('-').next()?, 16).ok())
        .find_map(|at| arena.map_again_at(at).ok())
        .expect("a server address free here");
    t.c.send_arena(taken.fd(), taken.as_ptr() as usize, ARENA_LEN);
    let (ret, p, offer) = t.c.fine_alloc(t.context, 4096);
    let (_, _, offered_again) = t.c.fine_alloc(t.context, 4096);
    let logged = t
        .server
        .log_count("SVM arena address taken in the server", 1);
    // The guest's fallback: not the offer, another random address of the window.
    let elsewhere = arena.map_again_in_window().expect("a window address");
    t.c.send_arena(elsewhere.fd(), elsewhere.as_ptr() as usize, ARENA_LEN);
    let (placed_ret, placed, _) = t.c.fine_alloc(t.context, 4096);
    let base = elsewhere.as_ptr() as u64;

    assert_eq!((ret, p), (CL_MEM_OBJECT_ALLOCATION_FAILURE, 0));
    assert!(
        hira_transport::SHARED_WINDOW.contains(&(offer as usize)),
        "offer {offer:#x}"
    );
    assert_eq!(
        offered_again, offer,
        "the offer stands until an arena is placed"
    );
    assert_eq!(logged, 1);
    assert_eq!(placed_ret, 0);
    assert!(placed >= base && placed < base + ARENA_LEN as u64);
}

const CL_MEM_COPY_HOST_PTR: u64 = 1 << 5;
const CL_MEM_FLAGS: u64 = 0x1101;
const CL_MAP_READ: u64 = 1;
const CL_INVALID_MEM_OBJECT: i32 = -38;
const CL_QUEUE_PROFILING_ENABLE: u64 = 1 << 1;

impl Client {
    /// clCreateBuffer (COPY_HOST_PTR when `data` is given): (error, id, arena address).
    fn buffer(
        &mut self,
        context: u64,
        flags: u64,
        size: u64,
        data: Option<&[u8]>,
    ) -> (i32, u64, u64) {
        let mut w = Writer::default();
        w.u64(context);
        w.u64(flags);
        w.u64(size);
        w.blob(data.map_or(Blob::Null, Blob::Inline));
        let (status, rest) = self.call(OP_CLCREATEBUFFER, &w);
        assert_eq!(status, 0);
        let mut r = Reader::new(&rest);
        let (ret, id) = (r.i32().expect("errcode"), r.u64().expect("id"));
        (ret, id, r.u64().expect("placement"))
    }

    /// hiraEnqueueMapArena, blocking, no wait list or event: (error, mapped address); the
    /// map's QUEUED, SUBMIT and START times go to `started` when given.
    fn map_arena_timed(
        &mut self,
        queue: u64,
        buf: u64,
        flags: u64,
        offset: u64,
        size: u64,
        started: Option<&mut [u64; 3]>,
    ) -> (i32, u64) {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(buf);
        w.u64(1);
        w.u64(flags);
        w.u64(offset);
        w.u64(size);
        w.u64(0);
        w.blob(Blob::Null);
        w.u64(0);
        w.out_spec(out(8));
        w.out_spec(if started.is_some() {
            out(24)
        } else {
            OutSpec::Null
        });
        let (status, rest) = self.call(OP_HIRAENQUEUEMAPARENA, &w);
        if status != 0 {
            return (status, 0);
        }
        let mut r = Reader::new(&rest);
        let ret = r.i32().expect("ret");
        let b = r.bytes().expect("mapped");
        if let Some(t) = started {
            let times = r.bytes().expect("times");
            for (i, c) in times.chunks(8).take(3).enumerate() {
                t[i] = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        }
        (ret, u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn map_arena(
        &mut self,
        queue: u64,
        buf: u64,
        flags: u64,
        offset: u64,
        size: u64,
    ) -> (i32, u64) {
        self.map_arena_timed(queue, buf, flags, offset, size, None)
    }

    fn unmap_arena(&mut self, queue: u64, buf: u64, mapped: u64) -> i32 {
        let mut w = Writer::default();
        w.u64(queue);
        w.u64(buf);
        w.u64(mapped);
        no_events(&mut w);
        self.code(OP_HIRAENQUEUEUNMAPARENA, &w)
    }

    fn mem_flags(&mut self, mem: u64) -> u64 {
        let mut w = Writer::default();
        w.u64(mem);
        w.u64(CL_MEM_FLAGS);
        w.u64(8);
        w.out_spec(out(8));
        w.out_spec(out(8));
        let rest = self.ok(OP_CLGETMEMOBJECTINFO, &w);
        let b = Reader::new(&rest).bytes().expect("flags");
        u64::from_le_bytes(b.try_into().expect("8 bytes"))
    }

    /// clSetKernelArg(kernel, 0, buffer).
    fn buffer_arg(&mut self, kernel: u64, buf: u64) {
        let mut w = Writer::default();
        w.u64(kernel);
        w.u64(0);
        w.u64(8);
        w.u8(2);
        w.u64(buf);
        self.ok(OP_CLSETKERNELARG, &w);
    }

    fn release_mem(&mut self, mem: u64) {
        let mut w = Writer::default();
        w.u64(mem);
        self.ok(OP_CLRELEASEMEMOBJECT, &w);
    }
}

/// Buffers in the arena (`crates/server/src/direct.rs`): once the tenant's arena is in place,
/// a plain buffer is made in it. Its bytes are the arena's at the address the reply names (a
/// kernel's writes show there with no copy), a map hands out that address, the tenant's view
/// of its flags is unchanged, and a released buffer's range is used again. Maps and unmaps
/// of anything else are refused with the API's errors and a log line.
#[test]
fn buffers_live_in_the_arena_and_map_in_place() {
    const SIZE: u64 = 1 << 16;
    let mut t = tenant();
    let (none_ret, _, none) = t.c.buffer(t.context, CL_MEM_READ_WRITE, SIZE, None);
    let mut arena = hira_transport::ShmRegion::create("arena", ARENA_LEN).expect("memfd");
    t.c.send_arena(arena.fd(), arena.as_ptr() as usize, ARENA_LEN);
    let (_, p, offer) = t.c.fine_alloc(t.context, 4096);
    if p == 0 && offer != 0 {
        // The address was taken in the server: map the arena where it offers, as the guest does.
        arena = arena.map_again_at(offer as usize).expect("offered address");
        t.c.send_arena(arena.fd(), arena.as_ptr() as usize, ARENA_LEN);
    } else {
        assert_eq!(t.c.svm_free(t.context, p), 0);
    }
    let base = arena.as_ptr() as u64;
    let data = pattern(SIZE as usize, 3);
    let (ret, buf, placed) = t.c.buffer(
        t.context,
        CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
        SIZE,
        Some(&data),
    );
    let inside = placed >= base && placed + SIZE <= base + ARENA_LEN as u64;
    let mut initial = vec![0u8; SIZE as usize];
    arena.read_at(placed - base, &mut initial).expect("read");
    t.c.buffer_arg(t.kernel, buf);
    t.c.launch(t.queue, t.kernel, SIZE / 4);
    let mut after = vec![0u8; SIZE as usize];
    arena.read_at(placed - base, &mut after).expect("read");
    // The tenant's queue does not profile for it: no times. One that does: the map's.
    let mut unprofiled = [1u64; 3];
    let (map_ret, mapped) =
        t.c.map_arena_timed(t.queue, buf, CL_MAP_READ, 4096, 4096, Some(&mut unprofiled));
    let mut w = Writer::default();
    w.u64(t.context);
    w.u64(t.device);
    w.u64(CL_QUEUE_PROFILING_ENABLE);
    let profiling = t.c.create(OP_CLCREATECOMMANDQUEUE, &w);
    let mut started = [0u64; 3];
    let (timed_ret, timed) =
        t.c.map_arena_timed(profiling, buf, CL_MAP_READ, 0, 4096, Some(&mut started));
    let timed_unmapped = t.c.unmap_arena(profiling, buf, timed);
    let outside = t.c.unmap_arena(t.queue, buf, placed + 2 * SIZE);
    let outside_logged = t
        .server
        .log_count("unmap of a pointer outside the buffer refused", 1);
    let unmapped = t.c.unmap_arena(t.queue, buf, mapped);
    let past_end = t.c.map_arena(t.queue, buf, CL_MAP_READ, SIZE, 4096);
    let flags = t.c.mem_flags(buf);
    let through_api = t.c.read_buffer(t.queue, buf, SIZE);
    // A USE_HOST_PTR buffer lives in the server's own copy: not in the arena, no arena maps.
    let (own_ret, own, own_placed) = t.c.buffer(
        t.context,
        CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR,
        SIZE,
        Some(&data),
    );
    let not_placed = t.c.map_arena(t.queue, own, CL_MAP_READ, 0, 4096);
    let not_placed_unmap = t.c.unmap_arena(t.queue, own, placed);
    t.c.release_mem(buf);
    let (_, _, again) = t.c.buffer(t.context, CL_MEM_READ_WRITE, SIZE, None);

    assert_eq!((none_ret, none), (0, 0), "no arena, no placement");
    assert_eq!(ret, 0);
    assert!(
        inside,
        "buffer at {placed:#x} outside the arena at {base:#x}"
    );
    assert!(initial == data, "COPY_HOST_PTR bytes are in the arena");
    assert!(after == incremented(&data), "the kernel wrote the arena");
    assert_eq!((map_ret, mapped), (0, placed + 4096), "mapped in place");
    assert_eq!(unprofiled, [0; 3]);
    assert_eq!((timed_ret, timed_unmapped), (0, 0));
    assert!(
        started[0] > 0 && started[0] <= started[1] && started[1] <= started[2],
        "the map's queued, submit and start times: {started:?}"
    );
    assert_eq!((outside, outside_logged), (CL_INVALID_VALUE, 1));
    assert_eq!(unmapped, 0);
    assert_eq!(past_end.0, CL_INVALID_VALUE, "the vendor checks the region");
    assert_eq!(
        flags,
        CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
        "the tenant's own flags"
    );
    assert!(through_api == incremented(&data));
    assert_eq!((own_ret, own_placed), (0, 0));
    assert_eq!(not_placed.0, CL_INVALID_MEM_OBJECT);
    assert_eq!(not_placed_unmap, CL_INVALID_MEM_OBJECT);
    assert_eq!(again, placed, "a released buffer's range is used again");
}
