//! The control API: one JSON [`Request`] per line on `<socket>.ctl`, answered by one JSON
//! [`Response`] line. Only the router's own user (or root) is served.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::TenantPatch;
use crate::dispatch::DeviceStats;
use crate::metrics::{MemoryStats, TenantStats};
use crate::{Error, Result};

/// Longest request line accepted.
pub const MAX_LINE: u64 = 64 * 1024;

/// Everything the control API can be asked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// Per-tenant metrics (live tenants and recently finished ones).
    Stats,
    /// The same, in the Prometheus text format.
    Metrics,
    /// Stop the router: servers are told to exit, then killed.
    Shutdown,
    /// Switch the device's scheduling policy (fifo, rr, credit, band, accc, slaf, wfq,
    /// wfq-fixed, wfq-aimd).
    Policy { name: String },
    /// Switch the slot placement algorithm of over-subscription (lls, size, util).
    Placement { name: String },
    /// Change a live tenant's settings (scheduling, `memory_quota`); `tenant` is its id, or
    /// `pid:<pid>` (a bare number that is no tenant id is tried as a pid).
    Set { tenant: String, patch: TenantPatch },
    /// Settings for tenants started by the calling process (or its descendants), for as
    /// long as this control connection stays open (`hira run --weight ...
    /// --memory-quota ...`).
    Register { patch: TenantPatch },
}

/// Answers of the control API.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Response {
    Stats {
        tenants: Vec<TenantStats>,
        #[serde(default)]
        device: Option<DeviceStats>,
        /// The device's memory accounting.
        #[serde(default)]
        memory: Option<MemoryStats>,
    },
    Metrics {
        text: String,
    },
    Ok,
    Error {
        message: String,
    },
}

/// `<socket>.ctl`.
pub fn ctl_path(socket: &Path) -> PathBuf {
    let mut s = OsString::from(socket.as_os_str());
    s.push(".ctl");
    PathBuf::from(s)
}

/// A connection to a router's control API.
#[derive(Debug)]
pub struct Client {
    reader: BufReader<UnixStream>,
}

impl Client {
    /// Connects to the control API of the router listening on `socket` (the guest socket's
    /// path; `.ctl` is appended).
    pub fn connect(socket: &Path) -> Result<Client> {
        let stream = UnixStream::connect(ctl_path(socket))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Client {
            reader: BufReader::new(stream),
        })
    }

    /// Sends one request and waits for its answer; an [`Response::Error`] becomes
    /// [`Error::Refused`].
    pub fn call(&mut self, req: &Request) -> Result<Response> {
        let mut line = serde_json::to_vec(req)?;
        line.push(b'\n');
        self.reader.get_mut().write_all(&line)?;
        let mut answer = String::new();
        (&mut self.reader).take(64 << 20).read_line(&mut answer)?;
        if answer.is_empty() {
            return Err(Error::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        match serde_json::from_str(&answer)? {
            Response::Error { message } => Err(Error::Refused(message)),
            r => Ok(r),
        }
    }
}

/// One request on a fresh connection.
pub fn request(socket: &Path, req: &Request) -> Result<Response> {
    Client::connect(socket)?.call(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_json_strings() {
        assert_eq!(serde_json::to_string(&Request::Stats).unwrap(), "\"stats\"");
        assert_eq!(
            serde_json::from_str::<Request>("\"shutdown\"").unwrap(),
            Request::Shutdown
        );
    }

    #[test]
    fn set_request_is_json() {
        let req = Request::Set {
            tenant: "3".into(),
            patch: TenantPatch {
                weight: Some(2),
                ..TenantPatch::default()
            },
        };

        let text = serde_json::to_string(&req).unwrap();

        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), req);
    }

    #[test]
    fn ctl_path_appends_suffix() {
        assert_eq!(
            ctl_path(Path::new("/tmp/r.sock")),
            PathBuf::from("/tmp/r.sock.ctl")
        );
    }
}
