//! Direct replies (`control::OPT_DIRECT`): on a connection attached with a direct reply
//! socket, the API server sends every reply the router has no use for straight to the guest,
//! and the rest (a new memory object's id, which device-memory accounting reads) the usual
//! way. A real API server process on the real OpenCL device.

mod common;

use common::{out, Proc};
use hira_opencl::*;
use hira_transport::FrameReader;
use hira_wire::{Blob, Header, Kind, Reader, Writer, HEADER_LEN, MAX_FRAME};

const ENTRY: &str = "server_process_entry";
const ENTRY_ENV: &str = "HIRA_DIRECT_TEST_SERVER";

/// Not a test: the server process. Does nothing in a normal run.
#[test]
fn server_process_entry() {
    common::server_entry(ENTRY_ENV);
}

fn next(r: &mut FrameReader) -> (Header, i32) {
    let f = r
        .read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len)
        .expect("frame")
        .expect("socket open");
    let h = Header::parse(f).expect("header");
    (h, Reader::new(&f[HEADER_LEN..]).i32().expect("status"))
}

#[test]
fn replies_the_router_does_not_read_go_straight_to_the_guest() {
    let proc = Proc::spawn(ENTRY, ENTRY_ENV);
    let mut usage = FrameReader::new(proc.ctl.try_clone().expect("clone"));
    std::thread::spawn(move || {
        while let Ok(Some(_)) = usage.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {}
    });
    let (mut c, mut direct) = proc.attach_direct();

    // Platform ids: direct.
    let mut w = Writer::default();
    w.u64(1);
    w.out_spec(out(8));
    w.out_spec(out(4));
    c.send(OP_CLGETPLATFORMIDS, &w.buf, 0);
    let (platforms, status) = next(&mut direct);
    assert_eq!((platforms.kind, platforms.seq, status), (Kind::Reply, 1, 0));

    // A forged buffer handle's refusal: direct too (its opcode's replies always are).
    let mut w = Writer::default();
    w.u64(0x7777);
    w.u64(0x4444);
    w.u64(1);
    w.u64(0);
    w.u64(4);
    w.out_spec(out(4));
    w.u64(0);
    w.blob(Blob::Null);
    w.u64(0);
    c.send(OP_CLENQUEUEREADBUFFER, &w.buf, 0);
    let (refused, status) = next(&mut direct);
    assert_eq!(refused.seq, 2);
    assert!(status != 0, "a forged handle is refused");

    // Any other call's reply, whatever the vendor answers: direct.
    let mut w = Writer::default();
    w.blob(Blob::Null);
    w.u64(0);
    w.blob(Blob::Null);
    w.u64(0);
    c.send(OP_CLCREATECONTEXT, &w.buf, 0);
    let (ctx_reply, _) = next(&mut direct);
    assert_eq!(ctx_reply.seq, 3, "context creation is not memory: direct");

    // A new buffer's id (here a refusal, without a context): through the router's socket,
    // which charges the buffer to the id.
    let mut w = Writer::default();
    w.u64(0);
    w.u64(1);
    w.u64(64);
    w.blob(Blob::Null);
    c.send(OP_CLCREATEBUFFER, &w.buf, 0);
    let (buf_reply, _) = next(&mut c.reader);
    assert_eq!((buf_reply.kind, buf_reply.seq), (Kind::Reply, 4));

    // The direct socket carries replies only: what a guest writes to it is refused.
    let sent = direct
        .conn()
        .send(b"a request that must not reach the server", &[]);
    assert!(sent.is_err(), "the server's end does not read");
}

/// A callback that fires before the guest's callback connection is attached (its ATTACH
/// comes on the control socket, the registration on the calls connection, and either may be
/// first) is kept and delivered once the connection arrives, not lost.
#[test]
fn callbacks_that_fire_before_their_connection_is_attached_are_delivered() {
    const CL_COMPLETE: u64 = 0;
    let proc = Proc::spawn(ENTRY, ENTRY_ENV);
    let mut usage = FrameReader::new(proc.ctl.try_clone().expect("clone"));
    std::thread::spawn(move || {
        while let Ok(Some(_)) = usage.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {}
    });
    let mut c = proc.attach();
    let cl = c.open("__kernel void k(__global int *a) { a[0] = 1; }", "k");
    let mut w = Writer::default();
    w.u64(cl.context);
    let event = c.create(OP_CLCREATEUSEREVENT, &w);
    let mut w = Writer::default();
    w.u64(event);
    w.u64(CL_COMPLETE);
    w.u64(77); // the guest's callback id
    c.ok(OP_CLSETEVENTCALLBACK, &w);
    let mut w = Writer::default();
    w.u64(event);
    w.u64(CL_COMPLETE);
    c.ok(OP_CLSETUSEREVENTSTATUS, &w);
    // The callback has fired (the vendor runs it on completion) with nowhere to go yet.
    std::thread::sleep(std::time::Duration::from_millis(200));

    let mut callbacks = proc.attach_callbacks();
    callbacks
        .conn()
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    let f = callbacks
        .read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len)
        .expect("callback frame")
        .expect("connection open");
    let h = Header::parse(f).expect("header");
    let payload = f[HEADER_LEN..].to_vec();

    assert_eq!(h.kind, Kind::Callback);
    assert!(
        payload.windows(8).any(|b| b == 77u64.to_le_bytes()),
        "the callback names the guest's id"
    );
    assert!(!proc.log().contains("callback lost"));
}
