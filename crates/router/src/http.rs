//! A tiny HTTP/1.1 responder for Prometheus scrapes: `GET /metrics` answers the metrics
//! text, anything else 404. One short-lived thread per connection; requests are bounded.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// Largest request head read.
const MAX_HEAD: usize = 8 * 1024;

/// Serves `body()` for `GET /metrics` until `stopping()` is true after an accept.
pub(crate) fn serve(
    listener: TcpListener,
    body: impl Fn() -> String + Send + Sync + 'static,
    stopping: impl Fn() -> bool + Send + 'static,
) {
    let body = std::sync::Arc::new(body);
    for conn in listener.incoming() {
        if stopping() {
            return;
        }
        let Ok(conn) = conn else { continue };
        let body = std::sync::Arc::clone(&body);
        let _ = std::thread::Builder::new()
            .name("hira-http".into())
            .spawn(move || {
                let _ = answer(conn, &*body);
            });
    }
}

fn answer(mut conn: TcpStream, body: &dyn Fn() -> String) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (parts.next(), parts.next());
    let (status, ctype, text) = match (method, path) {
        (Some(b"GET"), Some(b"/metrics")) => {
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body())
        }
        (Some(b"GET"), _) => ("404 Not Found", "text/plain", "not found\n".to_string()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n".to_string(),
        ),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
    conn.write_all(resp.as_bytes())
}
