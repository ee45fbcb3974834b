//! The event board (`hira_transport::board`) between a real API server process and a tenant
//! speaking the wire protocol by hand: a launch whose event the tenant named is posted when
//! the device completes it; a launch the server refuses is posted as failed at once, and its
//! error is counted as unreported until a synchronous reply carries it; without a board the
//! server posts nothing.

mod common;

use common::{Client, Proc};
use hira_opencl::*;
use hira_transport::board::Seen;
use hira_transport::EventBoard;
use hira_wire::{control, flags, Blob, Header, Kind, Reader, Writer};
use std::time::{Duration, Instant};

const ENTRY: &str = "server_process_entry";
const ENTRY_ENV: &str = "HIRA_BOARD_TEST_SERVER";
const CL_INVALID_KERNEL: i32 = -48;

/// Not a test: the server process. Does nothing in a normal run.
#[test]
fn server_process_entry() {
    common::server_entry(ENTRY_ENV);
}

fn spawn() -> Proc {
    Proc::spawn_draining(ENTRY, ENTRY_ENV)
}

fn send_board(c: &mut Client, board: &EventBoard) {
    c.seq += 1;
    let mut h = Header::new(Kind::Control, control::EVENT_BOARD, c.seq, 0);
    h.flags = flags::ASYNC;
    c.conn
        .send(&h.to_bytes(), &[board.fd()])
        .expect("send board");
}

/// An asynchronous one-item launch of `kernel` whose event the guest names `event`.
fn launch(c: &mut Client, queue: u64, kernel: u64, event: u64) {
    let mut w = Writer::default();
    w.u64(queue);
    w.u64(kernel);
    w.u64(1);
    w.blob(Blob::Null);
    w.blob(Blob::Inline(&1u64.to_le_bytes()));
    w.blob(Blob::Null);
    w.u64(0);
    w.blob(Blob::Null);
    w.u64(event);
    c.send(OP_CLENQUEUENDRANGEKERNEL, &w.buf, flags::ASYNC);
}

/// clFinish: (status, the deferred error the reply carries, if any).
fn finish(c: &mut Client, queue: u64) -> (i32, Option<i32>) {
    let mut w = Writer::default();
    w.u64(queue);
    let (h, p) = c.call_raw(OP_CLFINISH, &w);
    let mut r = Reader::new(&p);
    let status = r.i32().expect("status");
    let deferred = (h.flags & flags::DEFERRED_ERROR != 0).then(|| r.i32().expect("code"));
    (status, deferred)
}

fn within(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

#[test]
fn launches_are_posted_refusals_fail_at_once_and_errors_stay_counted_until_reported() {
    let proc = spawn();
    let mut c = proc.attach();
    let cl = c.open("__kernel void nop(void) {}", "nop");
    let board = EventBoard::create().expect("board");

    // Before the board reaches the server, nothing is posted.
    let early = (1 << 63) | 1;
    launch(&mut c, cl.queue, cl.kernel, early);
    assert_eq!(finish(&mut c, cl.queue), (0, None));
    send_board(&mut c, &board);

    let done = (1 << 63) | 2;
    launch(&mut c, cl.queue, cl.kernel, done);
    assert_eq!(board.wait(done, within(10)), Seen::Done);
    assert_eq!(
        board.wait(early, Instant::now() + Duration::from_millis(50)),
        Seen::Ask
    );
    assert!(!board.has_deferred());

    // A launch of a kernel the tenant does not have: refused, posted as failed at once.
    let refused = (1 << 63) | 3;
    launch(&mut c, cl.queue, 0xdead, refused);
    let t = Instant::now();
    assert_eq!(board.wait(refused, within(10)), Seen::Ask);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "refusal posted at once"
    );
    assert!(board.has_deferred(), "the error is counted until reported");

    // The next synchronous reply reports it, and the count goes back to zero.
    assert_eq!(finish(&mut c, cl.queue), (0, Some(CL_INVALID_KERNEL)));
    assert!(!board.has_deferred());
    assert!(proc
        .log_with("asynchronous call failed", 1)
        .contains("asynchronous call failed"));

    // Later launches are posted as before.
    let after = (1 << 63) | 4;
    launch(&mut c, cl.queue, cl.kernel, after);
    assert_eq!(board.wait(after, within(10)), Seen::Done);
}
