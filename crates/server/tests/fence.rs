//! Order across a tenant's connections (`control::FENCE`, `crates/server/src/fence.rs`),
//! with a real API server process and two connections speaking the wire protocol by hand: a
//! call behind a fence runs only once the other connection has run its frames that far, and
//! a fence on a connection that ended does not hold anything up.

mod common;

use common::{Client, Proc};
use hira_wire::{control, flags, Header, Kind, Writer};
use std::time::{Duration, Instant};

const ENTRY: &str = "server_process_entry";
const ENTRY_ENV: &str = "HIRA_FENCE_TEST_SERVER";

/// Not a test: the server process. Does nothing in a normal run.
#[test]
fn server_process_entry() {
    common::server_entry(ENTRY_ENV);
}

fn spawn() -> Proc {
    Proc::spawn_draining(ENTRY, ENTRY_ENV)
}

/// A control frame (asynchronous: no reply) or, with `fl` 0, a PING that is answered.
fn control(c: &mut Client, opcode: u16, payload: &[u8], fl: u8) {
    c.seq += 1;
    let mut h = Header::new(Kind::Control, opcode, c.seq, payload.len());
    h.flags = fl;
    let mut buf = h.to_bytes().to_vec();
    buf.extend_from_slice(payload);
    c.conn.send(&buf, &[]).expect("send");
}

fn fence(c: &mut Client, conn: u64, seq: u64) {
    let mut w = Writer::default();
    w.u64(conn);
    w.u64(seq);
    control(c, control::FENCE, &w.buf, flags::ASYNC);
}

/// A PING that waits for its reply: how long the reply took.
fn ping(c: &mut Client) -> Duration {
    let start = Instant::now();
    control(c, control::PING, &[], 0);
    c.reply();
    start.elapsed()
}

#[test]
fn a_call_behind_a_fence_waits_for_the_other_connection() {
    let server = spawn();
    let mut a = server.attach_as(5);
    let mut b = server.attach_as(6);
    let unfenced = ping(&mut b);

    // B's call must come after A's third frame, which A has not sent yet.
    fence(&mut b, 5, 3);
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        for _ in 0..3 {
            control(&mut a, control::PING, &[], flags::ASYNC);
        }
        a
    });
    let fenced = ping(&mut b);
    let a = sender.join().expect("sender");
    // A ends: a fence on it holds nothing up.
    drop(a);
    std::thread::sleep(Duration::from_millis(100));
    fence(&mut b, 5, 1000);
    let on_gone = ping(&mut b);

    assert!(unfenced < Duration::from_millis(250), "{unfenced:?}");
    assert!(
        fenced >= Duration::from_millis(300),
        "answered after {fenced:?}, before A's frames"
    );
    assert!(
        fenced < Duration::from_secs(4),
        "{fenced:?}: the fence timed out"
    );
    assert!(on_gone < Duration::from_secs(1), "{on_gone:?}");
}
