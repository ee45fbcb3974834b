//! What a handler works with: the tenant's shared state (vendor table, handle table,
//! callback sink, usage counters) and the connection's shared memory. Every wire value is
//! validated here before it becomes an argument of a vendor call.

use crate::Api;
use hira_opencl::cl::*;
use hira_opencl::{info_mode, InfoMode, INVALID_HANDLE, K_EVENT, K_MEM, K_QUEUE, K_SAMPLER};
use hira_transport::{Conn, ShmRegion};
use hira_wire::{Blob, Header, Kind, OutSpec, Reader, Writer, HEADER_LEN};
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Largest output returned inside a reply frame.
const MAX_INLINE_OUT: u64 = 16 << 20;

/// Why a request was not executed; answered with the code, never a panic.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Fail {
    /// The API's own error (bad handle, bad size, unsupported).
    #[error("OpenCL error {0}")]
    Cl(i32),
    /// The frame did not decode.
    #[error("malformed request: {0}")]
    Wire(#[from] hira_wire::Error),
}

impl Fail {
    pub fn code(&self) -> i32 {
        match self {
            Fail::Cl(c) => *c,
            Fail::Wire(_) => CL_INVALID_VALUE,
        }
    }
}

/// Callback signatures the server can relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // the names of the spec's callback kinds
pub enum CallbackKind {
    ContextNotify,
    ProgramNotify,
    EventNotify,
    ObjectNotify,
}

pub(crate) struct Entry {
    /// The vendor object; 0 for a buffer evicted to host memory (see `swap`).
    pub(crate) raw: usize,
    pub(crate) kind: u8,
    /// The tenant's references (the vendor's reference count mirrors it).
    pub(crate) refs: u32,
    /// Bytes counted in `Shared::mem_bytes` (evicted buffers included).
    pub(crate) bytes: u64,
}

/// The tenant's handle table: ids on the wire, vendor pointers inside.
#[derive(Default)]
pub struct Table {
    pub(crate) by_id: HashMap<u64, Entry>,
    pub(crate) by_raw: HashMap<(usize, u8), u64>,
    next: u64,
    /// Events the guest named for asynchronous enqueues that failed: never bound, so a call
    /// naming one is answered at once instead of waiting for it (`Ctx::handle`).
    unborn: std::collections::HashSet<u64>,
}

/// Longest a call waits for an event the guest named on another connection to be made there.
const UNBOUND_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
/// Most failed guest-named events remembered.
const MAX_UNBORN: usize = 1 << 16;

/// Most callbacks kept while the guest's callback connection is on its way.
const MAX_PENDING_CALLBACKS: usize = 4096;

/// State shared by all of a tenant's connections.
pub struct Shared {
    pub api: &'static Api,
    table: Mutex<Table>,
    /// Where callbacks go (the guest's ROLE_CALLBACKS connection).
    pub callbacks: Mutex<Option<Conn>>,
    /// Callbacks that fired before that connection was attached, in order: the guest opens
    /// it before it registers its first callback, but its ATTACH reaches this process on the
    /// control socket and may come after the registration and the event it waits for.
    pending_callbacks: Mutex<Vec<Vec<u8>>>,
    pub device_ns: AtomicU64,
    pub device_ns_reported: AtomicU64,
    /// Bytes of replies sent straight to the guest (the router counts them from USAGE).
    pub direct_bytes: AtomicU64,
    /// Bytes of the tenant's buffers, evicted ones included (`swap::Swap::evicted_bytes`
    /// tells how many of them live in host memory).
    pub mem_bytes: AtomicU64,
    /// The control socket to the router (kernel completions go there).
    pub control: Mutex<Option<Conn>>,
    /// The tenant's device-memory quota in bytes (0 = none), as the router set it.
    pub quota: AtomicU64,
    /// Staged non-blocking reads: guest-chosen id → (data, event).
    staged_reads: Mutex<HashMap<u64, (Vec<u8>, usize)>>,
    /// Device-memory over-subscription: the gate, evicted buffers, kernel bindings.
    pub(crate) swap: crate::swap::Swap,
    /// The tenant's SVM allocations: the only server pointers it may name.
    pub(crate) svm: crate::svm::Table,
    /// The tenant's buffers placed in its arena (`direct.rs`).
    pub(crate) direct: crate::direct::Buffers,
    /// Queues the tenant made without CL_QUEUE_PROFILING_ENABLE (by id): hira profiles
    /// every queue for itself, the tenant is told what it asked for.
    pub(crate) unprofiled: Mutex<std::collections::HashSet<u64>>,
    /// Where kernel completions are counted for the router (`control::DONE_PAGE`); until it
    /// comes, every completion is a DONE message.
    pub(crate) done_page: std::sync::OnceLock<hira_transport::CompletionPage>,
    /// Calls waiting for a guest-named event to be bound (`Ctx::handle`), and how many.
    bound: std::sync::Condvar,
    bound_waiters: std::sync::atomic::AtomicUsize,
    /// Where the completions of launches whose events the guest named are posted for it
    /// (`control::EVENT_BOARD`): its waits for them need no round trip.
    pub(crate) board: std::sync::OnceLock<hira_transport::EventBoard>,
    /// How far each connection has run its frames (`control::FENCE`).
    pub(crate) progress: crate::fence::Progress,
}

impl Shared {
    pub fn new(api: &'static Api) -> Arc<Shared> {
        Arc::new(Shared {
            api,
            table: Mutex::new(Table::default()),
            callbacks: Mutex::new(None),
            pending_callbacks: Mutex::new(Vec::new()),
            device_ns: AtomicU64::new(0),
            device_ns_reported: AtomicU64::new(0),
            direct_bytes: AtomicU64::new(0),
            mem_bytes: AtomicU64::new(0),
            control: Mutex::new(None),
            staged_reads: Mutex::new(HashMap::new()),
            quota: AtomicU64::new(0),
            swap: crate::swap::Swap::default(),
            svm: crate::svm::Table::default(),
            direct: crate::direct::Buffers::default(),
            unprofiled: Mutex::new(std::collections::HashSet::new()),
            done_page: std::sync::OnceLock::new(),
            board: std::sync::OnceLock::new(),
            bound: std::sync::Condvar::new(),
            bound_waiters: std::sync::atomic::AtomicUsize::new(0),
            progress: crate::fence::Progress::default(),
        })
    }

    /// Whether the tenant made the queue behind vendor pointer `queue` without profiling.
    pub(crate) fn unprofiled(&self, queue: *mut c_void) -> bool {
        let id = self.table().by_raw.get(&(queue as usize, K_QUEUE)).copied();
        id.is_some_and(|id| {
            self.unprofiled
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&id)
        })
    }

    pub(crate) fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An asynchronous enqueue that named event `id` failed: the event will never exist.
    pub(crate) fn unborn(&self, id: u64) {
        if id & (1 << 63) == 0 {
            return;
        }
        let mut t = self.table();
        if t.unborn.len() >= MAX_UNBORN {
            t.unborn.clear();
        }
        t.unborn.insert(id);
        drop(t);
        self.wake_bound();
    }

    fn wake_bound(&self) {
        if self.bound_waiters.load(Ordering::SeqCst) != 0 {
            // Under the table's lock: a waiter between its check and its sleep holds it.
            let _t = self.table();
            self.bound.notify_all();
        }
    }

    /// Event `id`, which the guest named for an enqueue that may still be on its way on
    /// another connection (the application may wait for an event another thread's launch
    /// made: natively it exists as soon as that launch returned; here the launch and the wait
    /// travel on different connections, served by different threads). Waits for it to be
    /// bound, for at most `UNBOUND_WAIT`.
    fn await_bound(&self, id: u64) -> Option<usize> {
        let deadline = std::time::Instant::now() + UNBOUND_WAIT;
        let mut t = self.table();
        self.bound_waiters.fetch_add(1, Ordering::SeqCst);
        let found = loop {
            if let Some(e) = t.by_id.get(&id).filter(|e| e.kind == K_EVENT) {
                break Some(e.raw);
            }
            let now = std::time::Instant::now();
            if t.unborn.contains(&id) || now >= deadline {
                break None;
            }
            t = self
                .bound
                .wait_timeout(t, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        self.bound_waiters.fetch_sub(1, Ordering::SeqCst);
        found
    }

    pub fn objects(&self) -> u64 {
        self.table().by_id.len() as u64
    }

    /// Id of a vendor object, registering it if new.
    pub fn id_for(&self, raw: *mut c_void, kind: u8) -> u64 {
        if raw.is_null() {
            return 0;
        }
        let mut t = self.table();
        if let Some(id) = t.by_raw.get(&(raw as usize, kind)) {
            return *id;
        }
        t.next += 1;
        let id = t.next;
        t.by_id.insert(
            id,
            Entry {
                raw: raw as usize,
                kind,
                refs: 1,
                bytes: 0,
            },
        );
        t.by_raw.insert((raw as usize, kind), id);
        id
    }

    /// Tell the router a kernel finished (its scheduler charges the device time): counted on
    /// the completion page, and sent as a message only while the router asks for one.
    pub fn report_done(&self, device_ns: u64, measured: bool) {
        if let Some(page) = self.done_page.get() {
            if !page.record(device_ns) {
                return;
            }
        }
        let mut w = Writer::with_header_room(HEADER_LEN);
        w.u64(device_ns);
        w.u8(measured as u8);
        self.send_control(hira_wire::control::DONE, 0, w);
    }

    /// Send a control frame to the router; `w` was made with header room.
    pub(crate) fn send_control(&self, opcode: u16, seq: u64, mut w: Writer) {
        let len = w.buf.len() - HEADER_LEN;
        Header::new(Kind::Control, opcode, seq, len).write_to(&mut w.buf[..HEADER_LEN]);
        if let Some(c) = self
            .control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            if let Err(e) = c.send(&w.buf, &[]) {
                tracing::debug!(opcode, "control frame lost: {e}");
            }
        }
    }

    /// The tenant dropped a reference; the last one removes the handle. True if it did.
    pub(crate) fn released(&self, id: u64) -> bool {
        let mut t = self.table();
        let gone = match t.by_id.get_mut(&id) {
            Some(e) => {
                e.refs = e.refs.saturating_sub(1);
                e.refs == 0
            }
            None => false,
        };
        if gone {
            if let Some(e) = t.by_id.remove(&id) {
                if e.raw != 0 {
                    t.by_raw.remove(&(e.raw, e.kind));
                }
                self.mem_bytes.fetch_sub(
                    e.bytes.min(self.mem_bytes.load(Ordering::Relaxed)),
                    Ordering::Relaxed,
                );
            }
        }
        gone
    }

    /// Send a callback frame to the guest.
    pub fn send_callback(&self, payload: &[u8]) {
        let mut buf = vec![0u8; HEADER_LEN];
        buf.extend_from_slice(payload);
        Header::new(Kind::Callback, 0, 0, payload.len()).write_to(&mut buf[..HEADER_LEN]);
        let sink = self.callbacks.lock().unwrap_or_else(|e| e.into_inner());
        match sink.as_ref() {
            Some(c) => {
                if let Err(e) = c.send(&buf, &[]) {
                    tracing::warn!("callback lost: {e}");
                }
            }
            None => {
                let mut pending = self
                    .pending_callbacks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if pending.len() < MAX_PENDING_CALLBACKS {
                    pending.push(buf);
                } else {
                    tracing::warn!("callback lost: no callback connection");
                }
            }
        }
    }

    /// The guest's callback connection arrived: it takes the callbacks that waited for it.
    pub fn attach_callbacks(&self, conn: Conn) {
        let mut sink = self.callbacks.lock().unwrap_or_else(|e| e.into_inner());
        let pending = std::mem::take(
            &mut *self
                .pending_callbacks
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for buf in pending {
            if let Err(e) = conn.send(&buf, &[]) {
                tracing::warn!("callback lost: {e}");
            }
        }
        *sink = Some(conn);
    }
}

/// One connection's view while running a request.
pub struct Ctx {
    pub shared: Arc<Shared>,
    pub api: &'static Api,
    pub shm: Option<ShmRegion>,
    /// The request is asynchronous (nobody waits for its reply).
    pub async_frame: bool,
    /// Inputs of a non-blocking write, handed to its completion callback.
    staged: Vec<Vec<u8>>,
    /// This request holds the read side of the swap gate (taken at the first buffer it
    /// resolves, given back in `reset`).
    gate_held: Cell<bool>,
    /// `track_event` ran: the command's completion (or failure) is already reported.
    tracked: bool,
    /// The buffer a clSetKernelArg passed: (id, evicted so the vendor got NULL).
    pub(crate) arg_mem: Option<(u64, bool)>,
    /// The guest's id for the event the request being run makes (0: none): if the request
    /// fails, the event will never exist (`Shared::unborn`), and a launch's is posted on the
    /// event board as failed.
    pub named_event: u64,
}

/// An input the vendor reads: a pointer valid for the handler's duration.
pub struct In<T> {
    ptr: *const T,
    _keep: Option<Vec<T>>,
}

impl<T> In<T> {
    pub fn ptr(&self) -> *const T {
        self.ptr
    }
    fn null() -> In<T> {
        In {
            ptr: std::ptr::null(),
            _keep: None,
        }
    }
}

/// Several byte strings (program sources, binaries) and the pointer array to them.
pub struct InStrings {
    _data: Vec<Vec<u8>>,
    ptrs: Option<Vec<*const u8>>,
}

impl InStrings {
    pub fn ptr(&self) -> *const *const u8 {
        self.ptrs.as_ref().map_or(std::ptr::null(), |p| p.as_ptr())
    }
}

/// An output the vendor writes.
pub enum OutBuf {
    Null,
    Inline(Vec<u8>),
    Shm { ptr: *mut u8, len: u64 },
}

impl OutBuf {
    pub fn ptr(&mut self) -> *mut c_void {
        match self {
            OutBuf::Null => std::ptr::null_mut(),
            OutBuf::Inline(v) => v.as_mut_ptr() as *mut c_void,
            OutBuf::Shm { ptr, .. } => *ptr as *mut c_void,
        }
    }
    pub fn emit(&self, w: &mut Writer) {
        match self {
            OutBuf::Null => {}
            OutBuf::Inline(v) => w.bytes(v),
            OutBuf::Shm { len, .. } => w.u64(*len),
        }
    }
    fn words(&mut self) -> Option<&mut [u8]> {
        match self {
            OutBuf::Inline(v) => Some(v.as_mut_slice()),
            _ => None,
        }
    }
}

fn get_u64(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i * 8..i * 8 + 8]);
    u64::from_le_bytes(a)
}

fn put_u64(b: &mut [u8], i: usize, v: u64) {
    b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
}

impl Ctx {
    pub fn new(shared: Arc<Shared>, shm: Option<ShmRegion>) -> Ctx {
        let api = shared.api;
        Ctx {
            shared,
            api,
            shm,
            async_frame: false,
            staged: Vec::new(),
            gate_held: Cell::new(false),
            tracked: false,
            named_event: 0,
            arg_mem: None,
        }
    }

    /// Called after each request.
    pub fn reset(&mut self) {
        self.staged.clear();
        self.tracked = false;
        self.arg_mem = None;
        self.named_event = 0;
        if self.gate_held.replace(false) {
            self.shared.swap.gate.read_done();
        }
    }

    /// Hold the read side of the swap gate until `reset`: no eviction while this request
    /// works with buffers.
    pub(crate) fn hold_gate(&self) {
        if !self.gate_held.get() {
            self.shared.swap.gate.read();
            self.gate_held.set(true);
        }
    }

    /// Over-subscription is on: resident calls report their completions (DONE).
    pub fn gated(&self) -> bool {
        self.shared.swap.gated()
    }

    /// Before a launch: the kernel's buffer arguments are restored and re-bound.
    pub fn prepare_kernel(&mut self, kernel_id: u64) -> Result<(), Fail> {
        crate::swap::prepare_kernel(self, kernel_id)
    }

    /// `track_event` ran for this request (its DONE, if any, is taken care of).
    pub(crate) fn tracked(&self) -> bool {
        self.tracked
    }

    /// The vendor pointer behind a handle id of `kind` (0 is NULL).
    pub fn handle(&self, id: u64, kind: u8) -> Result<*mut c_void, Fail> {
        if id == 0 {
            return Ok(std::ptr::null_mut());
        }
        if kind == K_MEM {
            self.hold_gate();
        }
        let t = self.shared.table();
        match t.by_id.get(&id) {
            Some(e) if e.kind == kind => {
                if e.raw == 0 {
                    // An evicted buffer: bring it back before the vendor sees it.
                    drop(t);
                    return crate::swap::restore(&self.shared, id);
                }
                Ok(e.raw as *mut c_void)
            }
            None if kind == K_EVENT && id & (1 << 63) != 0 => {
                drop(t);
                match self.shared.await_bound(id) {
                    Some(raw) => Ok(raw as *mut c_void),
                    None => {
                        tracing::debug!(id, "event the guest named never made");
                        Err(Fail::Cl(CL_INVALID_EVENT))
                    }
                }
            }
            _ => {
                tracing::debug!(id, kind, "bad handle");
                Err(Fail::Cl(
                    INVALID_HANDLE
                        .get(kind as usize)
                        .copied()
                        .unwrap_or(CL_INVALID_VALUE),
                ))
            }
        }
    }

    /// A kernel argument's object and its kind; an evicted buffer is NULL (not restored).
    fn any_handle(&self, id: u64) -> Option<(*mut c_void, u8)> {
        self.hold_gate();
        let t = self.shared.table();
        t.by_id
            .get(&id)
            .filter(|e| matches!(e.kind, K_MEM | K_SAMPLER | K_QUEUE))
            .map(|e| (e.raw as *mut c_void, e.kind))
    }

    /// Register a new vendor object; returns its id (0 for NULL).
    pub fn register(&self, raw: *mut c_void, kind: u8) -> u64 {
        if kind == K_MEM && !raw.is_null() {
            // Its swap bookkeeping (tracking, pins) completes before any eviction.
            self.hold_gate();
        }
        let id = self.shared.id_for(raw, kind);
        if kind == K_MEM && id != 0 {
            self.account_mem(id, raw);
        }
        id
    }

    fn account_mem(&self, id: u64, raw: *mut c_void) {
        let Some(f) = self.api.clGetMemObjectInfo else {
            return;
        };
        let mut size: usize = 0;
        // SAFETY: raw is a live memory object; size is an 8-byte output.
        let ret = unsafe {
            f(
                raw,
                CL_MEM_SIZE,
                8,
                &mut size as *mut usize as *mut c_void,
                std::ptr::null_mut(),
            )
        };
        let mut parent: *mut c_void = std::ptr::null_mut();
        // SAFETY: as above; sub-buffers share their parent's memory.
        unsafe {
            f(
                raw,
                CL_MEM_ASSOCIATED_MEMOBJECT,
                8,
                &mut parent as *mut *mut c_void as *mut c_void,
                std::ptr::null_mut(),
            )
        };
        if ret == CL_SUCCESS && parent.is_null() {
            if let Some(e) = self.shared.table().by_id.get_mut(&id) {
                e.bytes = size as u64;
            }
            self.shared
                .mem_bytes
                .fetch_add(size as u64, Ordering::Relaxed);
        }
        if ret == CL_SUCCESS {
            crate::swap::registered(&self.shared, id, raw, size as u64, parent);
        }
    }

    /// Bind an object the guest named in advance (events of asynchronous enqueues).
    pub fn bind(&self, id: u64, raw: *mut c_void, kind: u8) -> Result<(), Fail> {
        let mut t = self.shared.table();
        if id & (1 << 63) == 0 || t.by_id.contains_key(&id) {
            tracing::warn!(id, "guest-chosen id refused");
            return Err(Fail::Cl(CL_INVALID_VALUE));
        }
        t.by_id.insert(
            id,
            Entry {
                raw: raw as usize,
                kind,
                refs: 1,
                bytes: 0,
            },
        );
        t.by_raw.insert((raw as usize, kind), id);
        drop(t);
        self.shared.wake_bound();
        Ok(())
    }

    pub fn retained(&self, id: u64) {
        if let Some(e) = self.shared.table().by_id.get_mut(&id) {
            e.refs += 1;
        }
    }

    /// The tenant dropped a reference; the last one removes the handle.
    pub fn released(&self, id: u64) {
        self.shared.released(id);
    }

    fn bytes_of<'a>(&self, b: Blob<'a>, need: u64) -> Result<Option<*const u8>, Fail> {
        match b {
            Blob::Null => Ok(None),
            Blob::Inline(d) if d.len() as u64 >= need => Ok(Some(d.as_ptr())),
            Blob::Shm { offset, len } if len >= need => {
                let shm = self.shm.as_ref().ok_or(Fail::Cl(CL_INVALID_VALUE))?;
                shm.range(offset, len)
                    .map(|p| Some(p as *const u8))
                    .ok_or(Fail::Cl(CL_INVALID_VALUE))
            }
            _ => {
                tracing::debug!(need, "input shorter than the spec says");
                Err(Fail::Cl(CL_INVALID_VALUE))
            }
        }
    }

    /// Raw input bytes, at least `need` of them.
    pub fn in_bytes(&self, b: Blob<'_>, need: u64) -> Result<In<u8>, Fail> {
        Ok(match self.bytes_of(b, need)? {
            Some(p) => In {
                ptr: p,
                _keep: None,
            },
            None => In::null(),
        })
    }

    /// `n` values of T, copied so they are aligned.
    pub fn in_array<T: Copy + Default>(&self, b: Blob<'_>, n: u64) -> Result<In<T>, Fail> {
        let size = std::mem::size_of::<T>() as u64;
        let bytes = n
            .checked_mul(size)
            .filter(|&b| b <= MAX_INLINE_OUT)
            .ok_or(Fail::Cl(CL_INVALID_VALUE))?;
        let Some(p) = self.bytes_of(b, bytes)? else {
            return Ok(In::null());
        };
        let mut v = vec![T::default(); n as usize];
        // SAFETY: p has `bytes` readable bytes (checked), v has room for them.
        unsafe { std::ptr::copy_nonoverlapping(p, v.as_mut_ptr() as *mut u8, bytes as usize) };
        Ok(In {
            ptr: v.as_ptr(),
            _keep: Some(v),
        })
    }

    /// `n` handle ids of `kind`, translated.
    pub fn in_handles(&self, b: Blob<'_>, n: u64, kind: u8) -> Result<In<*mut c_void>, Fail> {
        let ids = self.in_array::<u64>(b, n)?;
        if ids.ptr.is_null() {
            return Ok(In::null());
        }
        let mut v = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            // SAFETY: ids holds n values.
            v.push(self.handle(unsafe { *ids.ptr.add(i) }, kind)?);
        }
        Ok(In {
            ptr: v.as_ptr(),
            _keep: Some(v),
        })
    }

    /// A string, NUL-terminated here whatever arrived.
    pub fn in_string(&self, b: Blob<'_>) -> Result<In<u8>, Fail> {
        let len = match b {
            Blob::Null => return Ok(In::null()),
            Blob::Inline(d) => d.len() as u64,
            Blob::Shm { len, .. } => len,
        };
        let p = self.bytes_of(b, len)?.ok_or(Fail::Cl(CL_INVALID_VALUE))?;
        let mut v = vec![0u8; len as usize + 1];
        // SAFETY: p has len readable bytes.
        unsafe { std::ptr::copy_nonoverlapping(p, v.as_mut_ptr(), len as usize) };
        Ok(In {
            ptr: v.as_ptr(),
            _keep: Some(v),
        })
    }

    pub fn read_strings<'a>(&self, r: &mut Reader<'a>) -> Result<Option<Vec<Blob<'a>>>, Fail> {
        let n = r.u64()?;
        if n == u64::MAX {
            return Ok(None);
        }
        if n > 1 << 16 {
            return Err(Fail::Cl(CL_INVALID_VALUE));
        }
        (0..n)
            .map(|_| r.blob().map_err(Fail::from))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    pub fn in_strings(&self, v: Option<Vec<Blob<'_>>>, count: u64) -> Result<InStrings, Fail> {
        let Some(v) = v else {
            return Ok(InStrings {
                _data: Vec::new(),
                ptrs: None,
            });
        };
        if v.len() as u64 != count {
            return Err(Fail::Cl(CL_INVALID_VALUE));
        }
        let mut data = Vec::with_capacity(v.len());
        for b in v {
            let s = self.in_string(b)?;
            data.push(s._keep.unwrap_or_default());
        }
        let ptrs = data
            .iter()
            .map(|d| {
                if d.is_empty() {
                    std::ptr::null()
                } else {
                    d.as_ptr()
                }
            })
            .collect();
        Ok(InStrings {
            _data: data,
            ptrs: Some(ptrs),
        })
    }

    /// A zero-terminated property list; CL_CONTEXT_PLATFORM values translated for contexts.
    pub fn in_properties(&self, b: Blob<'_>, context: bool) -> Result<In<u64>, Fail> {
        let n = match b {
            Blob::Null => return Ok(In::null()),
            Blob::Inline(d) => d.len() as u64 / 8,
            Blob::Shm { .. } => return Err(Fail::Cl(CL_INVALID_VALUE)),
        };
        let words = self.in_array::<u64>(b, n)?;
        let mut v: Vec<u64> = words._keep.unwrap_or_default();
        if v.last() != Some(&0) {
            return Err(Fail::Cl(CL_INVALID_VALUE));
        }
        if context {
            let mut i = 0;
            while i + 1 < v.len() {
                if v[i] as i64 == CL_CONTEXT_PLATFORM {
                    v[i + 1] = self.handle(v[i + 1], hira_opencl::K_PLATFORM)? as u64;
                }
                i += 2;
            }
        }
        Ok(In {
            ptr: v.as_ptr(),
            _keep: Some(v),
        })
    }

    /// A host pointer's contents, read only when the flags say the vendor reads it.
    pub fn in_host_buffer(&self, b: Blob<'_>, flags: u64, len: u64) -> Result<In<u8>, Fail> {
        if flags & crate::svm::HOST_PTR_IS_SVM != 0 {
            // The host pointer lies in an SVM allocation: the object uses that memory itself.
            return Ok(In {
                ptr: crate::svm::buffer_host_ptr(self, b, flags, len)?,
                _keep: None,
            });
        }
        if flags & (CL_MEM_USE_HOST_PTR | CL_MEM_COPY_HOST_PTR) == 0 {
            return Ok(match b {
                // A non-null pointer without USE/COPY: let the vendor reject it.
                Blob::Inline(_) => In {
                    ptr: std::ptr::dangling::<u8>(),
                    _keep: None,
                },
                _ => In::null(),
            });
        }
        self.in_bytes(b, len)
    }

    /// USE_HOST_PTR cannot share the guest's memory: the server copies instead, and the guest
    /// keeps the application's pointer in step at map and unmap.
    /// An SVM host pointer (checked by `in_host_buffer`) is used as it is.
    pub fn host_ptr_flags(flags: u64) -> u64 {
        if flags & crate::svm::HOST_PTR_IS_SVM != 0 {
            flags & !crate::svm::HOST_PTR_IS_SVM
        } else if flags & CL_MEM_USE_HOST_PTR != 0 {
            (flags & !CL_MEM_USE_HOST_PTR) | CL_MEM_COPY_HOST_PTR
        } else {
            flags
        }
    }

    pub fn in_image_desc(&self, b: Blob<'_>) -> Result<In<u64>, Fail> {
        let d = self.in_array::<u64>(b, 9)?;
        if d.ptr.is_null() {
            return Ok(d);
        }
        let mut v = d._keep.unwrap_or_default();
        v[8] = self.handle(v[8], K_MEM)? as u64;
        Ok(In {
            ptr: v.as_ptr(),
            _keep: Some(v),
        })
    }

    pub fn read_kernel_arg<'a>(&self, r: &mut Reader<'a>) -> Result<KernelArg<'a>, Fail> {
        Ok(match r.u8()? {
            0 => KernelArg::Local,
            1 => KernelArg::Bytes(r.blob()?),
            2 => KernelArg::Handle(r.u64()?),
            t => return Err(Fail::Wire(hira_wire::Error::BadTag(t))),
        })
    }

    pub fn in_kernel_arg(&mut self, k: KernelArg<'_>, size: u64) -> Result<In<u8>, Fail> {
        match k {
            KernelArg::Local => Ok(In::null()),
            KernelArg::Bytes(b) => self.in_bytes(b, size),
            KernelArg::Handle(id) => {
                let (raw, kind) = self.any_handle(id).ok_or(Fail::Cl(CL_INVALID_MEM_OBJECT))?;
                if size != 8 {
                    return Err(Fail::Cl(CL_INVALID_ARG_SIZE));
                }
                if kind == K_MEM {
                    // An evicted buffer is bound as NULL (legal for buffer arguments) and
                    // re-bound when a launch needs it (`swap::prepare_kernel`).
                    self.arg_mem = Some((id, raw.is_null()));
                }
                // The vendor reads the cl_mem value through this pointer during the call.
                let bytes = (raw as u64).to_ne_bytes().to_vec();
                Ok(In {
                    ptr: bytes.as_ptr(),
                    _keep: Some(bytes),
                })
            }
        }
    }

    /// A relay for a guest callback: the trampoline and its user data (0 = none).
    pub fn callback(&self, kind: CallbackKind, id: u64) -> (*mut c_void, *mut c_void) {
        if id == 0 {
            return (std::ptr::null_mut(), std::ptr::null_mut());
        }
        let ctx = Box::new(CallbackCtx {
            shared: self.shared.clone(),
            id,
            kind,
        });
        let f = match kind {
            CallbackKind::ContextNotify => context_tramp as *mut c_void,
            CallbackKind::ProgramNotify => program_tramp as *mut c_void,
            CallbackKind::EventNotify => event_tramp as *mut c_void,
            CallbackKind::ObjectNotify => object_tramp as *mut c_void,
        };
        (f, Box::into_raw(ctx) as *mut c_void)
    }

    /// Output room: `need` bytes at least.
    pub fn out(&self, o: OutSpec, need: u64) -> Result<OutBuf, Fail> {
        match o {
            OutSpec::Null => Ok(OutBuf::Null),
            OutSpec::Inline { len } if len >= need && len <= MAX_INLINE_OUT => {
                Ok(OutBuf::Inline(vec![0u8; len as usize]))
            }
            OutSpec::Shm { offset, len } if len >= need => {
                let shm = self.shm.as_ref().ok_or(Fail::Cl(CL_INVALID_VALUE))?;
                let p = shm.range(offset, len).ok_or(Fail::Cl(CL_INVALID_VALUE))?;
                Ok(OutBuf::Shm { ptr: p, len })
            }
            _ => {
                tracing::debug!(need, "output smaller than the spec says");
                Err(Fail::Cl(CL_INVALID_VALUE))
            }
        }
    }

    /// Vendor pointers in an output array become ids.
    pub fn out_handles_to_ids(&self, o: &mut OutBuf, kind: u8, ret: i32) -> Result<(), Fail> {
        if ret != CL_SUCCESS {
            return Ok(());
        }
        let Some(b) = o.words() else { return Ok(()) };
        for i in 0..b.len() / 8 {
            let raw = get_u64(b, i) as *mut c_void;
            let id = self.register(raw, kind);
            put_u64(b, i, id);
        }
        Ok(())
    }

    /// Keep a non-blocking read's destination until the guest fetches it.
    /// On refusal the data comes back: the vendor may still be writing into it.
    pub(crate) fn stage(
        &self,
        id: u64,
        data: Vec<u8>,
        ev: *mut c_void,
    ) -> Result<(), (Fail, Vec<u8>)> {
        let mut st = self
            .shared
            .staged_reads
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if st.len() > 4096 || st.contains_key(&id) {
            return Err((Fail::Cl(CL_OUT_OF_RESOURCES), data));
        }
        st.insert(id, (data, ev as usize));
        Ok(())
    }

    /// Copy a completed staged read into `out`: CL_SUCCESS, the command's error, or 1 (running).
    pub(crate) fn fetch_staged(&self, id: u64, out: &mut OutBuf, size: u64) -> Result<i32, Fail> {
        let mut st = self
            .shared
            .staged_reads
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (data, ev) = st.get(&id).ok_or(Fail::Cl(CL_INVALID_VALUE))?;
        let ev = *ev as *mut c_void;
        let info = self
            .api
            .clGetEventInfo
            .ok_or(Fail::Cl(CL_INVALID_OPERATION))?;
        let mut status: i32 = 1;
        // SAFETY: the staging entry holds a reference to this event; 4-byte output.
        let r = unsafe {
            info(
                ev,
                0x11D3,
                4,
                &mut status as *mut i32 as *mut c_void,
                std::ptr::null_mut(),
            )
        };
        if r != CL_SUCCESS {
            return Err(Fail::Cl(r));
        }
        if status > 0 {
            return Ok(1);
        }
        if status == CL_COMPLETE {
            let n = (data.len() as u64).min(size) as usize;
            // SAFETY: out has at least `size` bytes (checked by Ctx::out).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), out.ptr() as *mut u8, n) };
        }
        st.remove(&id);
        if let Some(rel) = self.api.clReleaseEvent {
            // SAFETY: dropping the staging entry's reference.
            unsafe { rel(ev) };
        }
        Ok(if status == CL_COMPLETE {
            CL_SUCCESS
        } else {
            status
        })
    }

    /// Where the vendor writes an info result: nowhere for results the guest answers itself
    /// (CL_PROGRAM_BINARIES holds pointers into the guest; the vendor would write through them).
    pub fn info_ptr(&self, op: u16, param: u32, o: &mut OutBuf) -> *mut c_void {
        match info_mode(op, param) {
            Some((InfoMode::Guest, _)) => std::ptr::null_mut(),
            _ => o.ptr(),
        }
    }

    /// Translate handle-valued info results (the spec's `info` declarations).
    pub fn info_out(&self, op: u16, param: u32, o: &mut OutBuf, ret: i32) -> Result<(), Fail> {
        if ret != CL_SUCCESS {
            return Ok(());
        }
        let Some((mode, kind)) = info_mode(op, param) else {
            return Ok(());
        };
        let Some(b) = o.words() else { return Ok(()) };
        let n = b.len() / 8;
        match mode {
            InfoMode::Handle | InfoMode::Handles => {
                for i in 0..n {
                    let id = self.shared.id_for(get_u64(b, i) as *mut c_void, kind);
                    put_u64(b, i, id);
                }
            }
            InfoMode::Properties => {
                let mut i = 0;
                while i + 1 < n {
                    if get_u64(b, i) as i64 == CL_CONTEXT_PLATFORM {
                        let id = self
                            .shared
                            .id_for(get_u64(b, i + 1) as *mut c_void, hira_opencl::K_PLATFORM);
                        put_u64(b, i + 1, id);
                    }
                    i += 2;
                }
            }
            // Server addresses mean nothing to the guest, which answers these itself.
            InfoMode::Guest => b.iter_mut().for_each(|x| *x = 0),
        }
        Ok(())
    }

    /// Input bytes of a non-blocking write: copied out of the frame and shared memory (which
    /// the guest reuses at once) and held until the command's event completes.
    pub fn in_bytes_staged(&mut self, b: Blob<'_>, need: u64, stage: bool) -> Result<In<u8>, Fail> {
        let direct = self.in_bytes(b, need)?;
        if !stage || direct.ptr.is_null() {
            return Ok(direct);
        }
        // SAFETY: in_bytes checked that `need` bytes are readable at ptr.
        let copy = unsafe { std::slice::from_raw_parts(direct.ptr, need as usize) }.to_vec();
        let p = copy.as_ptr();
        self.staged.push(copy);
        Ok(In {
            ptr: p,
            _keep: None,
        })
    }

    /// Whether an enqueue the guest asked no event of needs one for the server itself: to
    /// charge device time, or to free the inputs staged for it when it completes.
    pub fn wants_event(&self, device_time: bool) -> bool {
        device_time || !self.staged.is_empty()
    }

    /// After an enqueue: charge its device time (kernels) and keep staged inputs alive until
    /// its event completes; release the event if the server made it for itself. `post`: the
    /// guest's id for the event, when the guest waits for it on the event board (launches).
    pub(crate) fn track_event(
        &mut self,
        ret: i32,
        ev: *mut c_void,
        ours: bool,
        device_time: bool,
        post: u64,
    ) {
        let staged = std::mem::take(&mut self.staged);
        self.tracked = true;
        let board = (post != 0).then(|| self.shared.board.get()).flatten();
        let untracked = |shared: &Shared| {
            if device_time {
                // The router holds a device slot for every launch it let through.
                shared.report_done(0, false);
            }
            if let Some(b) = board {
                // Failed, or nobody will post it: the guest asks the server.
                b.post(post, false);
            }
        };
        if ret != CL_SUCCESS || ev.is_null() {
            untracked(&self.shared);
            return;
        }
        let Some(set_cb) = self.api.clSetEventCallback else {
            untracked(&self.shared);
            return;
        };
        let ctx = Box::new(DeviceTimeCtx {
            shared: self.shared.clone(),
            ours,
            device_time,
            post: if board.is_some() { post } else { 0 },
            enqueued: std::time::Instant::now(),
            _staged: staged,
        });
        // SAFETY: ev is a live event; the trampoline takes back the box exactly once.
        let r = unsafe {
            set_cb(
                ev,
                CL_COMPLETE,
                device_time_tramp as *mut c_void,
                Box::into_raw(ctx) as *mut c_void,
            )
        };
        if r != CL_SUCCESS {
            tracing::debug!(r, "no completion callback");
            untracked(&self.shared);
        }
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // A connection that ends mid-request must not keep evictions out.
        self.reset();
    }
}

/// A kernel argument as it arrived.
pub enum KernelArg<'a> {
    Local,
    Bytes(Blob<'a>),
    Handle(u64),
}

struct CallbackCtx {
    shared: Arc<Shared>,
    id: u64,
    kind: CallbackKind,
}

struct DeviceTimeCtx {
    shared: Arc<Shared>,
    ours: bool,
    device_time: bool,
    /// The guest's id for the event, to post on the event board (0: none).
    post: u64,
    enqueued: std::time::Instant,
    _staged: Vec<Vec<u8>>,
}

extern "C" fn device_time_tramp(ev: *mut c_void, status: i32, ud: *mut c_void) {
    // SAFETY: ud is the box made in device_time, handed over exactly once.
    let ctx = unsafe { Box::from_raw(ud as *mut DeviceTimeCtx) };
    let api = ctx.shared.api;
    if ctx.device_time {
        let (mut start, mut end) = (0u64, 0u64);
        let measured = api.clGetEventProfilingInfo.is_some_and(|prof| {
            // SAFETY: ev is the completed event; 8-byte outputs.
            unsafe {
                prof(
                    ev,
                    CL_PROFILING_COMMAND_START,
                    8,
                    &mut start as *mut u64 as *mut c_void,
                    std::ptr::null_mut(),
                ) == 0
                    && prof(
                        ev,
                        CL_PROFILING_COMMAND_END,
                        8,
                        &mut end as *mut u64 as *mut c_void,
                        std::ptr::null_mut(),
                    ) == 0
            }
        }) && end >= start;
        let ns = if measured {
            end - start
        } else {
            ctx.enqueued.elapsed().as_nanos() as u64
        };
        ctx.shared.device_ns.fetch_add(ns, Ordering::Relaxed);
        ctx.shared.report_done(ns, measured);
    }
    if ctx.post != 0 {
        if let Some(b) = ctx.shared.board.get() {
            b.post(ctx.post, status == CL_COMPLETE);
        }
    }
    if ctx.ours {
        if let Some(rel) = api.clReleaseEvent {
            // SAFETY: the server created this event for accounting and holds its only reference.
            unsafe { rel(ev) };
        }
    }
}

fn relay(ud: *mut c_void, once: bool, fill: impl FnOnce(&Shared, &mut Writer)) {
    // SAFETY: ud is a CallbackCtx box made in Ctx::callback.
    let ctx = unsafe { &*(ud as *const CallbackCtx) };
    let mut w = Writer::default();
    w.u64(ctx.id);
    fill(&ctx.shared, &mut w);
    ctx.shared.send_callback(&w.buf);
    let _ = ctx.kind;
    if once {
        // SAFETY: one-shot callbacks fire once; reclaim the box.
        drop(unsafe { Box::from_raw(ud as *mut CallbackCtx) });
    }
}

extern "C" fn event_tramp(ev: *mut c_void, status: i32, ud: *mut c_void) {
    relay(ud, true, |s, w| {
        w.u64(s.id_for(ev, hira_opencl::K_EVENT));
        w.i32(status);
    });
}

extern "C" fn program_tramp(prog: *mut c_void, ud: *mut c_void) {
    relay(ud, true, |s, w| {
        w.u64(s.id_for(prog, hira_opencl::K_PROGRAM))
    });
}

extern "C" fn object_tramp(obj: *mut c_void, ud: *mut c_void) {
    relay(ud, true, |s, w| {
        let (kind, id) = {
            let t = s.table();
            t.by_raw
                .iter()
                .find(|((raw, _), _)| *raw == obj as usize)
                .map_or((0, 0), |((_, k), id)| (*k, *id))
        };
        w.u64(id);
        w.u8(kind);
    });
}

extern "C" fn context_tramp(
    errinfo: *const std::ffi::c_char,
    _p: *const c_void,
    _cb: usize,
    ud: *mut c_void,
) {
    relay(ud, false, |_, w| {
        let msg = if errinfo.is_null() {
            Vec::new()
        } else {
            // SAFETY: the vendor passes a NUL-terminated message.
            unsafe { std::ffi::CStr::from_ptr(errinfo) }
                .to_bytes()
                .to_vec()
        };
        w.bytes(&msg);
    });
}
