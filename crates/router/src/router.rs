//! Admission, forwarding and accounting.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hira_opencl::{
    cl, K_MEM, OP_CLCREATEBUFFER, OP_CLCREATEBUFFERWITHPROPERTIES, OP_CLCREATESUBBUFFER,
    OP_CLRELEASEMEMOBJECT, OP_CLRETAINMEMOBJECT, OP_CLSETKERNELARG,
};
use hira_transport::{CompletionPage, Conn, FrameReader, Listener};
use hira_wire::{control, flags, Header, Kind, Reader, Writer, HEADER_LEN, MAX_FRAME};
use tracing::{debug, error, info, warn};

use crate::config::{Config, TenantPatch, SERVER_GRACE};
use crate::ctl::{self, Request, Response};
use crate::dispatch::{DeviceStats, Dispatcher, TenantSched};
use crate::memory::{self, MemAccounts};
use crate::metrics::{
    prometheus_memory, prometheus_with_device, MemoryStats, TenantMetrics, TenantStats,
};
use crate::supervise::{self, ServerProc};
use crate::swap::{Evicted, Evictor, SwapConfig, Swapper, EVICT_TIMEOUT};
use crate::Result;

/// A guest must say HELLO within this time.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Frames at least this large are sent straight from the read buffer, never copied.
const DIRECT_MIN: usize = 64 * 1024;
/// A batch of small frames is sent once it reaches this size.
const BATCH_MAX: usize = 256 * 1024;
/// Finished tenants kept for the control API.
const HISTORY: usize = 64;
/// How often the watchdog looks for runaway kernels.
const WATCHDOG: Duration = Duration::from_millis(100);
/// Why a tenant stopped by the watchdog is stopped.
const RUNAWAY: &str = "runaway kernel";

/// Runs a router until it is stopped (control API `shutdown`, or `idle_exit`).
pub fn serve(cfg: Config) -> Result<()> {
    start(cfg)?.wait()
}

/// Binds the router's sockets and starts serving on background threads.
pub fn start(cfg: Config) -> Result<Handle> {
    cfg.validate()?;
    let listener = Listener::bind(&cfg.socket)?;
    let ctl_listener = Listener::bind(&ctl::ctl_path(&cfg.socket))?;
    info!(socket = %cfg.socket.display(), "router listening");
    let policy = cfg.scheduler.kind()?;
    let dispatch = Arc::new(Dispatcher::new(
        policy,
        &cfg.scheduler.knobs,
        cfg.scheduler.max_inflight,
    ));
    info!(%policy, max_inflight = cfg.scheduler.max_inflight, "device scheduler ready");
    let metrics_listener = match &cfg.metrics_addr {
        Some(addr) => {
            let l = std::net::TcpListener::bind(addr)?;
            info!(addr = %l.local_addr()?, "metrics served over HTTP at /metrics");
            Some(l)
        }
        None => None,
    };
    let memory = MemAccounts::new(cfg.memory.capacity, cfg.memory.overcommit)
        .map_err(|e| crate::Error::Config(e.to_string()))?;
    if cfg.memory.quota.is_some() || cfg.memory.capacity.is_some() {
        info!(
            quota = cfg.memory.quota.map(memory::format_size),
            capacity = cfg.memory.capacity.map(memory::format_size),
            overcommit = cfg.memory.overcommit,
            "device-memory accounting ready"
        );
    }
    let swap = if cfg.memory.overcommit > 1.0 {
        let capacity = cfg
            .memory
            .capacity
            .expect("validated: over-commit needs a capacity");
        let sw = Swapper::new(SwapConfig {
            capacity,
            slots: cfg.memory.slots,
            placement: cfg.memory.placement,
            monitor: hira_policy::mem::MonitorConfig {
                idle_threshold: cfg.memory.idle_after.as_nanos() as u64,
                period: cfg.memory.replace_every.as_nanos() as u64,
            },
        })
        .map_err(|e| crate::Error::Config(e.to_string()))?;
        info!(
            capacity = memory::format_size(capacity),
            overcommit = cfg.memory.overcommit,
            slots = cfg.memory.slots,
            placement = %cfg.memory.placement,
            "over-subscription on: buffers swap to host memory"
        );
        Some(Arc::new(sw))
    } else {
        None
    };
    let router = Arc::new(Router {
        dispatch,
        swap,
        memory: Arc::new(Mutex::new(memory)),
        alloc_refused: Arc::new(AtomicU64::new(0)),
        registered: Mutex::new(HashMap::new()),
        metrics_addr: metrics_listener.as_ref().and_then(|l| l.local_addr().ok()),
        cfg,
        state: Mutex::new(State {
            live: HashMap::new(),
            history: VecDeque::new(),
            ctl_clients: 0,
            idle_since: Instant::now(),
        }),
        idle_cv: Condvar::new(),
        next_tenant: AtomicU64::new(1),
        next_conn: AtomicU64::new(1),
        stopping: AtomicBool::new(false),
    });
    let r = Arc::clone(&router);
    std::thread::Builder::new()
        .name("hira-ctl".into())
        .spawn(move || r.ctl_loop(ctl_listener))?;
    if let Some(limit) = router.cfg.idle_exit {
        let r = Arc::clone(&router);
        std::thread::Builder::new()
            .name("hira-idle".into())
            .spawn(move || r.idle_watch(limit))?;
    }
    {
        let r = Arc::clone(&router);
        std::thread::Builder::new()
            .name("hira-watchdog".into())
            .spawn(move || r.watchdog())?;
    }
    if let Some(sw) = &router.swap {
        let (sw, r) = (Arc::clone(sw), Arc::clone(&router));
        std::thread::Builder::new()
            .name("hira-placement".into())
            .spawn(move || {
                while !r.stopping.load(SeqCst) {
                    std::thread::sleep(Duration::from_millis(250));
                    sw.tick();
                }
            })?;
    }
    if let Some(l) = metrics_listener {
        let (r, r2) = (Arc::clone(&router), Arc::clone(&router));
        std::thread::Builder::new()
            .name("hira-metrics".into())
            .spawn(move || {
                crate::http::serve(l, move || r.prometheus(), move || r2.stopping.load(SeqCst))
            })?;
    }
    let r = Arc::clone(&router);
    let accept = std::thread::Builder::new()
        .name("hira-accept".into())
        .spawn(move || r.accept_loop(listener))?;
    Ok(Handle {
        router,
        accept: Some(accept),
    })
}

/// A running router; dropping the handle stops it.
#[derive(Debug)]
pub struct Handle {
    router: Arc<Router>,
    accept: Option<JoinHandle<()>>,
}

impl Handle {
    /// Asks the router to stop; [`Handle::wait`] returns once it has.
    pub fn stop(&self) {
        self.router.stop();
    }

    /// Snapshots of live and recently finished tenants.
    pub fn stats(&self) -> Vec<TenantStats> {
        self.router.stats()
    }

    /// The guest socket.
    pub fn socket(&self) -> &Path {
        &self.router.cfg.socket
    }

    /// The device scheduler's state.
    pub fn device(&self) -> DeviceStats {
        self.router.dispatch.device()
    }

    /// The device's memory accounting.
    pub fn memory(&self) -> MemoryStats {
        self.router.memory_stats()
    }

    /// Switches the device's scheduling policy.
    pub fn set_policy(&self, name: &str) -> Result<()> {
        self.router.set_policy(name)
    }

    /// Changes a live tenant's settings (`tenant`: id, or `pid:<pid>`).
    pub fn set_tenant(&self, tenant: &str, patch: &TenantPatch) -> Result<()> {
        self.router.set_tenant(tenant, patch)
    }

    /// Settings for tenants of process `pid` or its descendants, applied when they are
    /// admitted (and now, if one is live); kept until [`Handle::unregister`].
    pub fn register(&self, pid: i32, patch: TenantPatch) {
        self.router.register(pid, patch);
    }

    /// Forgets a registration.
    pub fn unregister(&self, pid: i32) {
        lock(&self.router.registered).remove(&pid);
    }

    /// The address metrics are served on over HTTP, if any.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.router.metrics_addr
    }

    /// Waits until the router has stopped and its servers are gone.
    pub fn wait(mut self) -> Result<()> {
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        Ok(())
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Some(accept) = self.accept.take() {
            self.router.stop();
            let _ = accept.join();
        }
    }
}

#[derive(Debug)]
struct Router {
    cfg: Config,
    /// The device's dispatcher (one device).
    dispatch: Arc<Dispatcher>,
    /// Over-subscription (buffer swapping and slot placement), when configured.
    swap: Option<Arc<Swapper>>,
    /// Device-memory accounting of every tenant.
    memory: Arc<Mutex<MemAccounts>>,
    /// Allocations refused since start.
    alloc_refused: Arc<AtomicU64>,
    /// Settings registered for a process and its descendants (`hira run --weight`).
    registered: Mutex<HashMap<i32, TenantPatch>>,
    metrics_addr: Option<std::net::SocketAddr>,
    state: Mutex<State>,
    /// Signalled when the number of clients changes or the router stops.
    idle_cv: Condvar,
    next_tenant: AtomicU64,
    next_conn: AtomicU64,
    stopping: AtomicBool,
}

#[derive(Debug)]
struct State {
    /// Tenants with open connections, by process id.
    live: HashMap<i32, Arc<Tenant>>,
    history: VecDeque<Arc<TenantMetrics>>,
    ctl_clients: usize,
    /// When the last client left.
    idle_since: Instant,
}

impl State {
    fn clients(&self) -> usize {
        self.live.len() + self.ctl_clients
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking thread cannot leave these maps inconsistent: keep serving.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Router {
    fn accept_loop(self: Arc<Self>, listener: Listener) {
        loop {
            let accepted = listener.accept();
            if self.stopping.load(SeqCst) {
                break;
            }
            match accepted {
                Ok(conn) => {
                    let r = Arc::clone(&self);
                    let spawned = std::thread::Builder::new()
                        .name("hira-guest".into())
                        .spawn(move || r.handle_guest(conn));
                    if let Err(e) = spawned {
                        warn!(error = %e, "cannot start a connection thread");
                    }
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        self.shutdown_all();
        let _ = std::fs::remove_file(&self.cfg.socket);
        let _ = std::fs::remove_file(ctl::ctl_path(&self.cfg.socket));
        info!("router stopped");
    }

    fn stop(&self) {
        if self.stopping.swap(true, SeqCst) {
            return;
        }
        info!("router stopping");
        self.idle_cv.notify_all();
        // Wake the blocking accepts.
        if let Some(addr) = self.metrics_addr {
            let _ = std::net::TcpStream::connect(addr);
        }
        let _ = Conn::connect(&self.cfg.socket);
        let _ = Conn::connect(&ctl::ctl_path(&self.cfg.socket));
    }

    fn shutdown_all(&self) {
        let tenants: Vec<Arc<Tenant>> = lock(&self.state).live.values().cloned().collect();
        for t in &tenants {
            for link in lock(&t.links).values() {
                link.guest_ctl.shutdown();
                link.server_ctl.shutdown();
            }
            t.retiring.store(true, SeqCst);
            t.control.shutdown();
        }
        for t in &tenants {
            if let Some(p) = &t.proc {
                p.kill_after(SERVER_GRACE);
            }
        }
    }

    fn idle_watch(&self, limit: Duration) {
        let mut st = lock(&self.state);
        loop {
            if self.stopping.load(SeqCst) {
                return;
            }
            if st.clients() > 0 {
                st = self.idle_cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let idle = st.idle_since.elapsed();
            if idle >= limit {
                drop(st);
                info!(idle_ms = idle.as_millis() as u64, "no tenants; exiting");
                self.stop();
                return;
            }
            st = self
                .idle_cv
                .wait_timeout(st, limit - idle)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn stats(&self) -> Vec<TenantStats> {
        let st = lock(&self.state);
        let mut v: Vec<TenantStats> = st
            .history
            .iter()
            .map(|m| m.snapshot())
            .chain(st.live.values().map(|t| {
                let mut s = t.m.snapshot();
                if let Some(view) = self.dispatch.view(t.m.id) {
                    s.sched = view;
                }
                s
            }))
            .collect();
        v.sort_by_key(|t| t.id);
        v
    }

    fn memory_stats(&self) -> MemoryStats {
        let mem = lock(&self.memory);
        let limit = mem.commit_limit();
        MemoryStats {
            capacity: self.cfg.memory.capacity,
            limit: (limit != u64::MAX).then_some(limit),
            committed: mem.committed(),
            refused: self.alloc_refused.load(Relaxed),
            swap: self.swap.as_ref().map(|sw| Box::new(sw.view())),
        }
    }

    fn prometheus(&self) -> String {
        prometheus_with_device(&self.stats(), &self.dispatch.device())
            + &prometheus_memory(&self.memory_stats())
    }

    // ---- scheduling ----

    fn set_policy(&self, name: &str) -> Result<()> {
        let kind = name
            .parse()
            .map_err(|e: hira_policy::sched::SchedError| crate::Error::Refused(e.to_string()))?;
        self.dispatch.set_policy(kind);
        info!(policy = name, "scheduling policy changed");
        Ok(())
    }

    fn set_placement(&self, name: &str) -> Result<()> {
        let algo: hira_policy::mem::PlacementAlgo = name
            .parse()
            .map_err(|e: hira_policy::mem::MemError| crate::Error::Config(e.to_string()))?;
        let sw = self.swap.as_ref().ok_or_else(|| {
            crate::Error::Config("over-subscription is off (memory.overcommit is 1)".into())
        })?;
        sw.set_placement(algo);
        info!(placement = %algo, "placement algorithm switched");
        Ok(())
    }

    fn find_tenant(&self, spec: &str) -> Option<Arc<Tenant>> {
        let st = lock(&self.state);
        let by_pid = |pid: i32| st.live.get(&pid).cloned();
        if let Some(pid) = spec.strip_prefix("pid:") {
            return by_pid(pid.parse().ok()?);
        }
        let n: u64 = spec.parse().ok()?;
        st.live
            .values()
            .find(|t| t.m.id == n)
            .cloned()
            .or_else(|| by_pid(i32::try_from(n).ok()?))
    }

    fn set_tenant(&self, spec: &str, patch: &TenantPatch) -> Result<()> {
        let t = self
            .find_tenant(spec)
            .ok_or_else(|| crate::Error::Refused(format!("no live tenant {spec:?}")))?;
        if patch.touches_sched() {
            let mut s = self.dispatch.settings(t.m.id).ok_or_else(|| {
                crate::Error::Refused(format!("tenant {spec:?} is not scheduled"))
            })?;
            patch.apply(&mut s)?;
            self.dispatch.set(t.m.id, s);
        }
        if let Some(q) = patch.memory_quota {
            t.set_mem_quota((q > 0).then_some(q));
        }
        info!(tenant = t.m.id, ?patch, "tenant settings changed");
        Ok(())
    }

    fn register(&self, pid: i32, patch: TenantPatch) {
        lock(&self.registered).insert(pid, patch.clone());
        let live = lock(&self.state).live.get(&pid).cloned();
        if let Some(t) = live {
            if let Some(mut s) = self.dispatch.settings(t.m.id) {
                if patch.apply(&mut s).is_ok() {
                    self.dispatch.set(t.m.id, s);
                }
            }
            if let Some(q) = patch.memory_quota {
                t.set_mem_quota((q > 0).then_some(q));
            }
        }
    }

    /// The registration of process `pid` or of its nearest registered ancestor.
    fn registration(&self, pid: i32) -> Option<TenantPatch> {
        let reg = lock(&self.registered);
        if reg.is_empty() {
            return None;
        }
        let mut p = pid;
        for _ in 0..64 {
            if let Some(patch) = reg.get(&p) {
                return Some(patch.clone());
            }
            match parent_pid(p) {
                Some(pp) if pp > 1 => p = pp,
                _ => break,
            }
        }
        None
    }

    /// The configured settings and device-memory quota of a new tenant, with any
    /// registration of it or of an ancestor process applied.
    fn settings_for(&self, pid: i32, command: &str) -> (TenantSched, Option<u64>) {
        let mut s = self.cfg.tenant_settings(command);
        let mut quota = self.cfg.memory_quota(command);
        if let Some(patch) = self.registration(pid) {
            if let Err(e) = patch.apply(&mut s) {
                warn!(pid, error = %e, "registered settings refused");
            }
            if let Some(q) = patch.memory_quota {
                quota = (q > 0).then_some(q);
            }
        }
        (s, quota)
    }

    /// Stops tenants whose device-time command has not finished within its
    /// `kernel_timeout`.
    fn watchdog(&self) {
        while !self.stopping.load(SeqCst) {
            std::thread::sleep(WATCHDOG);
            while let Some((id, ran)) = self.dispatch.take_runaway(RUNAWAY) {
                let t = lock(&self.state)
                    .live
                    .values()
                    .find(|t| t.m.id == id)
                    .cloned();
                error!(
                    tenant = id,
                    ran_ms = ran.as_millis() as u64,
                    "kernel ran past the tenant's kernel_timeout; stopping the tenant"
                );
                match t {
                    Some(t) => t.stop(RUNAWAY),
                    None => {
                        self.dispatch.remove(id);
                    }
                }
            }
        }
    }

    // ---- guest connections ----

    fn handle_guest(self: Arc<Self>, conn: Conn) {
        let cred = match conn.peer_cred() {
            Ok(c) => c,
            Err(e) => {
                debug!(error = %e, "no peer credentials");
                return;
            }
        };
        let guest_tx = match conn.try_clone() {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "cannot clone guest socket");
                return;
            }
        };
        let mut reader = FrameReader::new(conn);
        let _ = reader.conn().set_read_timeout(Some(HELLO_TIMEOUT));
        let hello = match read_hello(&mut reader) {
            Ok(Some(h)) => h,
            Ok(None) => {
                debug!(pid = cred.pid, "connection closed before HELLO");
                return;
            }
            Err(reason) => {
                warn!(pid = cred.pid, %reason, "bad HELLO; closing");
                let _ = guest_tx.send(&failed_frame(0, cl::CL_INVALID_VALUE), &[]);
                return;
            }
        };
        let _ = reader.conn().set_read_timeout(None);
        let key = if self.cfg.tenant_by_hello_pid {
            hello.pid as i32
        } else {
            cred.pid
        };
        let (tenant, link, r_end, d_guest) = match self.admit(key, &hello, guest_tx) {
            Ok(x) => x,
            Err((guest_tx, reason)) => {
                warn!(pid = key, %reason, "connection refused");
                let _ = guest_tx.send(
                    &welcome_frame(hello.seq, 0, 0, cl::CL_OUT_OF_RESOURCES, false),
                    &[],
                );
                return;
            }
        };
        let tid = tenant.m.id;
        debug!(
            tenant = tid,
            conn = link.id,
            role = hello.role,
            tid = hello.tid,
            "connection attached"
        );
        let welcome = welcome_frame(hello.seq, tid, link.id, 0, d_guest.is_some());
        let fds: Vec<_> = d_guest.iter().map(|d| d.as_fd()).collect();
        let sent = lock(&link.guest_tx).send(&welcome, &fds);
        drop(d_guest);
        if let Err(e) = sent {
            debug!(tenant = tid, error = %e, "guest left before WELCOME");
        } else {
            let s2g = {
                let (t, l) = (Arc::clone(&tenant), Arc::clone(&link));
                r_end
                    .try_clone()
                    .map_err(std::io::Error::other)
                    .and_then(|c| {
                        std::thread::Builder::new()
                            .name("hira-s2g".into())
                            .spawn(move || server_to_guest(&t, &l, FrameReader::new(c)))
                    })
            };
            match s2g {
                Ok(s2g) => {
                    // A bug in the router must not leave the application waiting forever:
                    // whatever happens, the connection is closed below and its call fails.
                    let forwarded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        guest_to_server(&tenant, &link, &mut reader, &r_end)
                    }));
                    if forwarded.is_err() {
                        tracing::error!(
                            tenant = tid,
                            conn = link.id,
                            "forwarding thread panicked; closing the connection"
                        );
                    }
                    link.closing.store(true, SeqCst);
                    r_end.shutdown();
                    let _ = s2g.join();
                }
                Err(e) => warn!(tenant = tid, error = %e, "cannot start a forwarding thread"),
            }
        }
        link.guest_ctl.shutdown();
        r_end.shutdown();
        self.detach(&tenant, link.id);
    }

    /// Finds or creates the tenant and attaches a new connection to its server.
    fn admit(
        &self,
        key: i32,
        hello: &Hello,
        guest_tx: Conn,
    ) -> std::result::Result<(Arc<Tenant>, Arc<Link>, Conn, Option<Conn>), (Conn, String)> {
        let (r_end, s_end) = match Conn::pair() {
            Ok(p) => p,
            Err(e) => return Err((guest_tx, format!("socketpair: {e}"))),
        };
        // The direct reply socket: the guest's end goes out with WELCOME, the server's with
        // ATTACH; the router keeps neither (the guest must see EOF when the server dies).
        let direct = if hello.direct {
            match Conn::pair() {
                Ok(p) => Some(p),
                Err(e) => return Err((guest_tx, format!("socketpair: {e}"))),
            }
        } else {
            None
        };
        let clones = guest_tx
            .try_clone()
            .and_then(|g| Ok((g, r_end.try_clone()?)));
        let (guest_ctl, server_ctl) = match clones {
            Ok(c) => c,
            Err(e) => return Err((guest_tx, format!("dup: {e}"))),
        };
        let tenant = {
            let mut st = lock(&self.state);
            if self.stopping.load(SeqCst) {
                return Err((guest_tx, "router is stopping".into()));
            }
            let tenant = match st.live.get(&key) {
                Some(t) => Arc::clone(t),
                None => match self.new_tenant(key) {
                    Ok(t) => {
                        st.live.insert(key, Arc::clone(&t));
                        self.idle_cv.notify_all();
                        t
                    }
                    Err(e) => return Err((guest_tx, format!("cannot start API server: {e}"))),
                },
            };
            if tenant.dead.load(SeqCst) {
                return Err((guest_tx, "tenant's API server is gone".into()));
            }
            tenant
        };
        let link = Arc::new(Link {
            id: self.next_conn.fetch_add(1, Relaxed),
            guest_tx: Mutex::new(guest_tx),
            guest_ctl,
            server_ctl,
            pending: Mutex::new(Pending::default()),
            refused: Mutex::new(HashMap::new()),
            closing: AtomicBool::new(false),
            direct: direct.is_some(),
        });
        lock(&tenant.links).insert(link.id, Arc::clone(&link));
        tenant.m.connections.fetch_add(1, Relaxed);
        let (d_guest, d_server) = direct.unzip();
        if let Err(e) = tenant.attach(link.id, hello, s_end, d_server.as_ref()) {
            self.detach(&tenant, link.id);
            let guest_tx = std::mem::replace(&mut *lock(&link.guest_tx), link.guest_ctl_clone());
            return Err((guest_tx, format!("ATTACH failed: {e}")));
        }
        Ok((tenant, link, r_end, d_guest))
    }

    /// Creates a tenant and spawns its server; called with the state locked.
    fn new_tenant(&self, key: i32) -> Result<Arc<Tenant>> {
        let id = self.next_tenant.fetch_add(1, Relaxed);
        let command = std::fs::read_to_string(format!("/proc/{key}/comm"))
            .map(|s| s.trim_end().to_string())
            .unwrap_or_default();
        let cell: Arc<OnceLock<Weak<Tenant>>> = Arc::new(OnceLock::new());
        let on_exit = {
            let cell = Arc::clone(&cell);
            move |status: String| {
                if let Some(t) = cell.get().and_then(Weak::upgrade) {
                    t.server_died(&format!("API server exited ({status})"));
                } else {
                    info!(tenant = id, %status, "API server exited");
                }
            }
        };
        let (sched, quota) = self.settings_for(key, &command);
        let (control, proc) = supervise::spawn(&self.cfg, id, on_exit)?;
        let control_rx = control.try_clone()?;
        self.dispatch.add(id, sched);
        lock(&self.memory).add_tenant(id, quota);
        let tenant = Arc::new(Tenant {
            key,
            dispatch: Arc::clone(&self.dispatch),
            memory: Arc::clone(&self.memory),
            alloc_refused: Arc::clone(&self.alloc_refused),
            swap: self.swap.clone(),
            evicted: Mutex::new(HashMap::new()),
            evicted_cv: Condvar::new(),
            next_evict: AtomicU64::new(1),
            evict_gone: AtomicBool::new(false),
            m: Arc::new(TenantMetrics::new(id, key, command)),
            control,
            control_tx: Mutex::new(()),
            links: Mutex::new(HashMap::new()),
            dead: AtomicBool::new(false),
            retiring: AtomicBool::new(false),
            proc,
        });
        let _ = cell.set(Arc::downgrade(&tenant));
        tenant.m.mem_quota.store(quota.unwrap_or(0), Relaxed);
        tenant.send_visible_mem(false);
        if let Some(sw) = &self.swap {
            // Before any ATTACH: the server schedules its buffer commands from the start.
            let frame = control_frame(control::SWAP_MODE, 0, &[1]);
            tenant.send_control(&frame)?;
            sw.add_tenant(id, quota, Arc::clone(&tenant) as Arc<dyn Evictor>);
        } else if std::env::var_os("HIRA_DONE_PAGE").is_none_or(|v| v != "0") {
            // Completions counted in shared memory, announced only while someone waits.
            // (Over-subscription measures each tenant's busy time from DONE messages, so it
            // keeps them.) Before any ATTACH, so before any kernel.
            let page = Arc::new(CompletionPage::create()?);
            let frame = control_frame(control::DONE_PAGE, 0, &[]);
            {
                let _g = lock(&tenant.control_tx);
                tenant.control.send(&frame, &[page.fd()])?;
            }
            self.dispatch.attach_page(id, page);
        }
        let t = Arc::clone(&tenant);
        std::thread::Builder::new()
            .name(format!("hira-control-{id}"))
            .spawn(move || control_loop(&t, FrameReader::new(control_rx)))?;
        info!(
            tenant = id,
            pid = key,
            command = %tenant.m.command,
            memory_quota = quota.map(memory::format_size),
            "tenant admitted"
        );
        Ok(tenant)
    }

    /// Removes a closed connection; the tenant's last one retires the tenant.
    fn detach(&self, tenant: &Arc<Tenant>, link: u64) {
        let last = {
            let mut st = lock(&self.state);
            let mut links = lock(&tenant.links);
            if links.remove(&link).is_some() {
                tenant.m.connections.fetch_sub(1, Relaxed);
            }
            tenant.mem(|mem, id| mem.drop_conn(id, link));
            let last = links.is_empty();
            drop(links);
            if last
                && st
                    .live
                    .get(&tenant.key)
                    .is_some_and(|t| Arc::ptr_eq(t, tenant))
            {
                st.live.remove(&tenant.key);
                st.history.push_back(Arc::clone(&tenant.m));
                if st.history.len() > HISTORY {
                    st.history.pop_front();
                }
                if st.clients() == 0 {
                    st.idle_since = Instant::now();
                    self.idle_cv.notify_all();
                }
            }
            last
        };
        if last {
            tenant.retire();
        }
    }

    // ---- control API ----

    fn ctl_loop(self: Arc<Self>, listener: Listener) {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        loop {
            let accepted = listener.accept();
            if self.stopping.load(SeqCst) {
                return;
            }
            let conn = match accepted {
                Ok(c) => c,
                Err(e) => {
                    warn!(error = %e, "control accept failed");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            match conn.peer_cred() {
                Ok(c) if c.uid == me || c.uid == 0 => {}
                other => {
                    warn!(cred = ?other, "control client of another user refused");
                    continue;
                }
            }
            let pid = conn.peer_cred().map_or(0, |c| c.pid);
            let r = Arc::clone(&self);
            let _ = std::thread::Builder::new()
                .name("hira-ctl-client".into())
                .spawn(move || {
                    lock(&r.state).ctl_clients += 1;
                    r.idle_cv.notify_all();
                    let registered = r.ctl_client(UnixStream::from(OwnedFd::from(conn)), pid);
                    if registered {
                        lock(&r.registered).remove(&pid);
                    }
                    let mut st = lock(&r.state);
                    st.ctl_clients -= 1;
                    if st.clients() == 0 {
                        st.idle_since = Instant::now();
                        r.idle_cv.notify_all();
                    }
                });
        }
    }

    /// Serves one control client; true if it registered settings for its process.
    fn ctl_client(&self, stream: UnixStream, pid: i32) -> bool {
        let mut registered = false;
        let Ok(mut out) = stream.try_clone() else {
            return registered;
        };
        let mut reader = BufReader::new(stream);
        loop {
            let mut line = String::new();
            match (&mut reader).take(ctl::MAX_LINE).read_line(&mut line) {
                Ok(0) | Err(_) => return registered,
                Ok(_) => {}
            }
            if !line.ends_with('\n') && line.len() as u64 >= ctl::MAX_LINE {
                let _ = write_json(
                    &mut out,
                    &Response::Error {
                        message: "request too long".into(),
                    },
                );
                return registered;
            }
            let req = serde_json::from_str::<Request>(line.trim());
            let done = |r: Result<()>| match r {
                Ok(()) => Response::Ok,
                Err(e) => Response::Error {
                    message: match e {
                        crate::Error::Refused(m) => m,
                        e => e.to_string(),
                    },
                },
            };
            let resp = match &req {
                Ok(Request::Stats) => Response::Stats {
                    tenants: self.stats(),
                    device: Some(self.dispatch.device()),
                    memory: Some(self.memory_stats()),
                },
                Ok(Request::Metrics) => Response::Metrics {
                    text: self.prometheus(),
                },
                Ok(Request::Shutdown) => Response::Ok,
                Ok(Request::Policy { name }) => done(self.set_policy(name)),
                Ok(Request::Placement { name }) => done(self.set_placement(name)),
                Ok(Request::Set { tenant, patch }) => done(self.set_tenant(tenant, patch)),
                Ok(Request::Register { patch }) if pid > 0 => {
                    let mut probe = self.cfg.tenant_settings("");
                    match patch.apply(&mut probe) {
                        Ok(()) => {
                            self.register(pid, patch.clone());
                            registered = true;
                            Response::Ok
                        }
                        Err(e) => done(Err(e)),
                    }
                }
                Ok(Request::Register { .. }) => Response::Error {
                    message: "cannot tell the caller's process id".into(),
                },
                Err(e) => Response::Error {
                    message: format!("bad request: {e}"),
                },
            };
            if write_json(&mut out, &resp).is_err() {
                return registered;
            }
            if matches!(req, Ok(Request::Shutdown)) {
                self.stop();
                return registered;
            }
        }
    }
}

fn write_json(out: &mut UnixStream, resp: &Response) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(resp).map_err(std::io::Error::other)?;
    line.push(b'\n');
    out.write_all(&line)
}

// ---- tenants and connections ----

#[derive(Debug)]
struct Tenant {
    /// Process id the tenant is known by.
    key: i32,
    /// The device's dispatcher: kernel launches wait for it.
    dispatch: Arc<Dispatcher>,
    /// The router's device-memory accounting (all tenants).
    memory: Arc<Mutex<MemAccounts>>,
    /// The router's count of refused allocations.
    alloc_refused: Arc<AtomicU64>,
    /// Over-subscription, when on: buffer-touching commands wait for the dispatcher too.
    swap: Option<Arc<Swapper>>,
    /// EVICTED replies by sequence number, for the thread waiting in `evict`.
    evicted: Mutex<HashMap<u64, Evicted>>,
    evicted_cv: Condvar,
    next_evict: AtomicU64,
    /// The server is dying or being stopped: evictions fail at once.
    evict_gone: AtomicBool,
    m: Arc<TenantMetrics>,
    /// Router end of the server's control socket.
    control: Conn,
    /// Serializes ATTACH frames (each carries fds).
    control_tx: Mutex<()>,
    links: Mutex<HashMap<u64, Arc<Link>>>,
    /// The server is gone; every call fails.
    dead: AtomicBool,
    /// The router is letting the server go (last connection closed or shutdown).
    retiring: AtomicBool,
    proc: Option<Arc<ServerProc>>,
}

impl Tenant {
    fn attach(
        &self,
        conn_id: u64,
        hello: &Hello,
        s_end: Conn,
        direct: Option<&Conn>,
    ) -> Result<()> {
        let mut w = Writer::with_header_room(HEADER_LEN);
        w.u64(conn_id);
        w.u32(hello.role);
        w.u64(hello.shm_len);
        w.u32(if direct.is_some() {
            control::OPT_DIRECT
        } else {
            0
        });
        let mut frame = w.buf;
        Header::new(
            Kind::Control,
            control::ATTACH,
            conn_id,
            frame.len() - HEADER_LEN,
        )
        .write_to(&mut frame);
        let mut fds = vec![s_end.as_fd()];
        if let Some(shm) = &hello.shm {
            fds.push(shm.as_fd());
        }
        if let Some(d) = direct {
            fds.push(d.as_fd());
        }
        let _guard = lock(&self.control_tx);
        self.control.send(&frame, &fds)?;
        Ok(())
    }

    /// Takes the tenant out of the device's scheduler, keeping its last view for stats, and
    /// frees the device memory charged to it.
    fn unschedule(&self) {
        if let Some(view) = self.dispatch.remove(self.m.id) {
            *self.m.final_sched.lock().unwrap_or_else(|e| e.into_inner()) = Some(view);
        }
        self.mem(|mem, id| mem.remove_tenant(id));
        if let Some(sw) = &self.swap {
            sw.remove_tenant(self.m.id);
        }
    }

    /// The server is going: an eviction waiting for it gives up at once (before anything
    /// takes the swapper, which that eviction may hold).
    fn no_more_evictions(&self) {
        self.evict_gone.store(true, SeqCst);
        drop(lock(&self.evicted));
        self.evicted_cv.notify_all();
    }

    fn send_control(&self, frame: &[u8]) -> hira_transport::Result<()> {
        let _guard = lock(&self.control_tx);
        self.control.send(frame, &[])
    }

    /// Whether `opcode` must wait for the dispatcher: launches always, buffer commands
    /// while over-subscription is on.
    fn scheduled(&self, opcode: u16) -> bool {
        hira_opencl::op(opcode)
            .is_some_and(|o| o.device_time || (o.resident && self.swap.is_some()))
    }

    /// Sees a request on its way to the server: the swapper learns kernel arguments and
    /// makes a scheduled command's buffers resident.
    fn before_forward(&self, h: &Header, payload: &[u8], scheduled: bool) {
        let Some(sw) = &self.swap else { return };
        if scheduled {
            sw.before_run(self.m.id, h.opcode, payload);
        } else if h.opcode == OP_CLSETKERNELARG {
            if let Some((kernel, index, mem)) = kernel_arg(payload) {
                sw.kernel_arg(self.m.id, kernel, index, mem);
            }
        }
    }

    // ---- device memory ----

    /// Runs `f` on the memory accounts and publishes what the tenant now holds.
    fn mem<R>(&self, f: impl FnOnce(&mut MemAccounts, u64) -> R) -> R {
        let mut mem = lock(&self.memory);
        let r = f(&mut mem, self.m.id);
        self.m.mem_held.store(mem.used(self.m.id), Relaxed);
        r
    }

    /// Accounts for a memory-object request before it is forwarded: charges an allocation,
    /// notes a sub-buffer's parent, counts a retain or release. Some(error code) when the
    /// allocation is refused: it must not reach the server.
    fn mem_request(&self, link: u64, h: &Header, payload: &[u8]) -> Option<i32> {
        let info = hira_opencl::op(h.opcode)?;
        if info.allocates {
            let Some(bytes) = memory::request_bytes(h.opcode, payload) else {
                // The guest library always sends sizes the router can read; anything else
                // would be an allocation that escapes the quota.
                info!(
                    tenant = self.m.id,
                    op = info.name,
                    "allocation whose size cannot be read refused"
                );
                self.m.alloc_refused.fetch_add(1, Relaxed);
                return Some(hira_opencl::cl::CL_INVALID_VALUE);
            };
            self.m.alloc_requested.fetch_add(bytes, Relaxed);
            let refused = self
                .mem(|mem, id| mem.reserve(id, link, h.seq, bytes))
                .err()?;
            self.m.alloc_refused.fetch_add(1, Relaxed);
            self.alloc_refused.fetch_add(1, Relaxed);
            info!(
                tenant = self.m.id,
                command = %self.m.command,
                op = info.name,
                requested = bytes,
                held = self.m.mem_held.load(Relaxed),
                why = %refused,
                "allocation refused"
            );
            return Some(memory::refusal_code(&refused));
        }
        let object = || hira_wire::Reader::new(payload).u64().ok();
        match h.opcode {
            OP_CLCREATESUBBUFFER => {
                if let Some(parent) = object() {
                    self.mem(|mem, id| mem.expect_sub(id, link, h.seq, parent));
                }
            }
            OP_CLRETAINMEMOBJECT => {
                if let Some(obj) = object() {
                    self.mem(|mem, id| mem.retain(id, obj));
                }
            }
            OP_CLRELEASEMEMOBJECT => {
                if let Some(obj) = object() {
                    let freed = self.mem(|mem, id| mem.release(id, obj));
                    if let Some(sw) = &self.swap {
                        for id in freed {
                            sw.freed(self.m.id, id);
                        }
                    }
                }
            }
            _ => {}
        }
        None
    }

    /// A creating call's reply came back (`delivered`: it goes to the guest): binds or
    /// returns the call's reservation.
    fn mem_reply(&self, link: u64, h: &Header, payload: &[u8], delivered: bool) {
        let created = delivered
            .then(|| memory::created_id(payload, h.flags & flags::DEFERRED_ERROR != 0))
            .flatten();
        let bound = self.mem(|mem, id| mem.reply(id, link, h.seq, created));
        if let (Some(sw), Some(id), Some(bytes)) = (&self.swap, created, bound) {
            if matches!(
                h.opcode,
                OP_CLCREATEBUFFER | OP_CLCREATEBUFFERWITHPROPERTIES
            ) {
                sw.created(self.m.id, id, bytes);
            }
        }
    }

    /// Sets the tenant's quota (None: none) and tells its server.
    fn set_mem_quota(&self, quota: Option<u64>) {
        self.mem(|mem, id| mem.set_quota(id, quota));
        if let Some(sw) = &self.swap {
            sw.set_quota(self.m.id, quota);
        }
        self.m.mem_quota.store(quota.unwrap_or(0), Relaxed);
        info!(
            tenant = self.m.id,
            quota = quota.map(memory::format_size),
            held = self.m.mem_held.load(Relaxed),
            "memory quota set"
        );
        self.send_visible_mem(true);
    }

    /// Sends SET_QUOTA with the memory the tenant is to see: its quota, at most the
    /// configured capacity (0: the device's own sizes). Without `always`, only when there
    /// is something to limit.
    fn send_visible_mem(&self, always: bool) {
        let visible = lock(&self.memory).visible(self.m.id);
        if visible.is_none() && !always {
            return;
        }
        let frame = control_frame(control::SET_QUOTA, 0, &visible.unwrap_or(0).to_le_bytes());
        if let Err(e) = self.send_control(&frame) {
            debug!(tenant = self.m.id, error = %e, "cannot send SET_QUOTA");
        }
    }

    /// The router stops the tenant (a runaway kernel): its server is killed, so its calls
    /// fail with CL_OUT_OF_RESOURCES, and its device slots are returned.
    fn stop(&self, why: &str) {
        self.no_more_evictions();
        self.unschedule();
        match &self.proc {
            Some(p) => {
                let p = Arc::clone(p);
                let _ = std::thread::Builder::new()
                    .name("hira-stop".into())
                    .spawn(move || p.kill_after(Duration::ZERO));
            }
            None => {
                self.control.shutdown();
                for l in lock(&self.links).values() {
                    l.server_ctl.shutdown();
                }
            }
        }
        self.server_died(&format!("stopped: {why}"));
    }

    /// The server is gone: fail every outstanding call of every connection.
    fn server_died(&self, why: &str) {
        self.no_more_evictions();
        self.unschedule();
        if self.dead.swap(true, SeqCst) {
            return;
        }
        self.m.alive.store(false, Relaxed);
        if self.retiring.load(SeqCst) {
            info!(tenant = self.m.id, %why, "API server finished");
        } else {
            warn!(tenant = self.m.id, %why, "API server died; failing the tenant's calls");
        }
        self.control.shutdown();
        let links: Vec<Arc<Link>> = lock(&self.links).values().cloned().collect();
        for l in links {
            l.fail_all(&self.m);
        }
    }

    /// Lets the server go after the last connection closed: close its control socket and
    /// kill it if it has not exited within [`SERVER_GRACE`].
    fn retire(&self) {
        self.unschedule();
        self.retiring.store(true, SeqCst);
        // The server reads EOF and exits; its last USAGE sample (the bytes of the replies it
        // sent straight to the guest) still comes in until it does.
        self.control.shutdown_write();
        info!(tenant = self.m.id, "tenant's last connection closed");
        if let Some(p) = &self.proc {
            let p = Arc::clone(p);
            let _ = std::thread::Builder::new()
                .name("hira-retire".into())
                .spawn(move || p.kill_after(SERVER_GRACE));
        }
    }
}

impl Evictor for Tenant {
    fn evict(&self, ids: &[u64]) -> std::result::Result<Evicted, String> {
        if self.evict_gone.load(SeqCst) {
            return Err("the API server is gone".into());
        }
        let seq = self.next_evict.fetch_add(1, Relaxed);
        let mut w = Writer::default();
        w.u32(ids.len() as u32);
        for &id in ids {
            w.u64(id);
        }
        self.send_control(&control_frame(control::EVICT, seq, &w.buf))
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + EVICT_TIMEOUT;
        let mut replies = lock(&self.evicted);
        loop {
            if let Some(ev) = replies.remove(&seq) {
                return Ok(ev);
            }
            let now = Instant::now();
            if self.evict_gone.load(SeqCst) || now >= deadline {
                return Err(format!("no EVICTED within {}s", EVICT_TIMEOUT.as_secs()));
            }
            replies = self
                .evicted_cv
                .wait_timeout(replies, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// `clSetKernelArg(kernel, index, size, value)`: the kernel, the index, and the memory
/// object the value names (None for plain bytes or local memory).
fn kernel_arg(payload: &[u8]) -> Option<(u64, u32, Option<u64>)> {
    let mut r = Reader::new(payload);
    let (kernel, index, _size) = (r.u64().ok()?, r.u64().ok()?, r.u64().ok()?);
    let mem = match r.u8().ok()? {
        2 => Some(r.u64().ok()?),
        _ => None,
    };
    Some((kernel, u32::try_from(index).ok()?, mem))
}

/// One guest connection and its socket to the server.
#[derive(Debug)]
struct Link {
    id: u64,
    /// Writes to the guest (replies, callbacks, FAILED) are serialized here.
    guest_tx: Mutex<Conn>,
    /// Shuts the guest socket down without taking the write lock.
    guest_ctl: Conn,
    /// Shuts the server socket (r_end) down.
    server_ctl: Conn,
    pending: Mutex<Pending>,
    /// Refused allocations by sequence number (their opcode and error code), answered when
    /// the PING sent in their place returns.
    refused: Mutex<HashMap<u64, (u16, i32)>>,
    /// The guest side has ended; nothing more is sent to it.
    closing: AtomicBool,
    /// Replies that `hira_opencl::reply_skips_router` names go from the server straight to
    /// the guest: the router neither sees nor tracks them.
    direct: bool,
}

#[derive(Debug, Default)]
struct Pending {
    /// Sequence numbers of synchronous frames awaiting an answer.
    seqs: HashSet<u64>,
    /// The server side of this connection is gone.
    gone: bool,
}

impl Link {
    fn guest_ctl_clone(&self) -> Conn {
        self.guest_ctl
            .try_clone()
            .unwrap_or_else(|_| Conn::pair().expect("socketpair for a dead end").0)
    }

    fn send_guest(&self, data: &[u8]) -> hira_transport::Result<()> {
        lock(&self.guest_tx).send(data, &[])
    }

    /// Records an outstanding synchronous frame; false if the server is gone.
    fn track(&self, seq: u64) -> bool {
        let mut p = lock(&self.pending);
        if p.gone {
            return false;
        }
        p.seqs.insert(seq);
        true
    }

    fn is_gone(&self) -> bool {
        lock(&self.pending).gone
    }

    /// An answer arrived for `seq`; false if the connection has failed (drop the answer).
    fn complete(&self, seq: u64) -> bool {
        let mut p = lock(&self.pending);
        p.seqs.remove(&seq);
        !p.gone
    }

    /// Marks the server side gone and answers every outstanding call with FAILED.
    fn fail_all(&self, m: &TenantMetrics) {
        let seqs: Vec<u64> = {
            let mut p = lock(&self.pending);
            p.gone = true;
            p.seqs.drain().collect()
        };
        if seqs.is_empty() || self.closing.load(SeqCst) {
            return;
        }
        m.failed.fetch_add(seqs.len() as u64, Relaxed);
        let mut batch = Vec::with_capacity(seqs.len() * (HEADER_LEN + 4));
        for seq in seqs {
            batch.extend_from_slice(&failed_frame(seq, cl::CL_OUT_OF_RESOURCES));
        }
        let _ = self.send_guest(&batch);
    }
}

#[derive(Debug)]
struct Hello {
    seq: u64,
    role: u32,
    pid: u32,
    tid: u64,
    shm_len: u64,
    shm: Option<OwnedFd>,
    /// The guest takes replies on a direct socket (`control::OPT_DIRECT`).
    direct: bool,
}

fn read_hello(reader: &mut FrameReader) -> std::result::Result<Option<Hello>, String> {
    let frame = match reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {
        Ok(Some(f)) => f,
        Ok(None) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let h = Header::parse(frame).map_err(|e| e.to_string())?;
    if h.kind != Kind::Control || h.opcode != control::HELLO {
        return Err(format!(
            "expected HELLO, got {:?} opcode {}",
            h.kind, h.opcode
        ));
    }
    let mut r = Reader::new(&frame[HEADER_LEN..]);
    let fields = (|| Ok::<_, hira_wire::Error>((r.u32()?, r.u32()?, r.u64()?, r.u64()?)))();
    let (role, pid, tid, shm_len) = fields.map_err(|e| format!("HELLO payload: {e}"))?;
    let options = r.u32().unwrap_or(0);
    if role != control::ROLE_CALLS && role != control::ROLE_CALLBACKS {
        return Err(format!("unknown role {role}"));
    }
    let shm = reader.take_fd();
    if shm_len > 0 && shm.is_none() {
        return Err("HELLO announces shared memory but carries no fd".into());
    }
    Ok(Some(Hello {
        seq: h.seq,
        role,
        pid,
        tid,
        shm_len,
        shm: if shm_len > 0 { shm } else { None },
        direct: options & control::OPT_DIRECT != 0 && role == control::ROLE_CALLS,
    }))
}

/// The parent of `pid`, from `/proc/<pid>/stat`.
fn parent_pid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may contain spaces and parentheses: the fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// EVICTED's payload: bytes, time, then the ids the server kept.
fn parse_evicted(payload: &[u8]) -> Option<Evicted> {
    let mut r = Reader::new(payload);
    let (bytes, ns, n) = (r.u64().ok()?, r.u64().ok()?, r.u32().ok()?);
    let kept = (0..n.min(1 << 20))
        .map(|_| r.u64().ok())
        .collect::<Option<Vec<u64>>>()?;
    Some(Evicted { bytes, ns, kept })
}

fn control_frame(opcode: u16, seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; HEADER_LEN];
    Header::new(Kind::Control, opcode, seq, payload.len()).write_to(&mut f);
    f.extend_from_slice(payload);
    f
}

fn failed_frame(seq: u64, code: i32) -> Vec<u8> {
    control_frame(control::FAILED, seq, &code.to_le_bytes())
}

/// The answer to a refused call, built from the reply to the PING sent in its place: status
/// `code`, and the PING reply's deferred error of earlier asynchronous calls, if any.
fn refusal_reply(ping: &Header, opcode: u16, code: i32, payload: &[u8]) -> Vec<u8> {
    let deferred = (ping.kind == Kind::Reply && ping.flags & flags::DEFERRED_ERROR != 0)
        .then(|| payload.get(4..8))
        .flatten();
    let mut w = Writer::with_header_room(HEADER_LEN);
    w.i32(code);
    if let Some(d) = deferred {
        w.buf.extend_from_slice(d);
    }
    let mut h = Header::new(Kind::Reply, opcode, ping.seq, w.buf.len() - HEADER_LEN);
    h.device_ns = ping.device_ns;
    if deferred.is_some() {
        h.flags = flags::DEFERRED_ERROR;
    }
    h.write_to(&mut w.buf[..HEADER_LEN]);
    w.buf
}

fn welcome_frame(seq: u64, tenant: u64, conn: u64, status: i32, direct: bool) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(tenant);
    w.u64(conn);
    w.i32(status);
    w.u32(if direct { control::OPT_DIRECT } else { 0 });
    control_frame(control::WELCOME, seq, &w.buf)
}

fn flush(to: &Conn, batch: &mut Vec<u8>) -> hira_transport::Result<()> {
    if batch.is_empty() {
        return Ok(());
    }
    let r = to.send(batch, &[]);
    batch.clear();
    r
}

/// Why a guest's frame is refused.
fn refuse(h: &Header) -> Option<String> {
    match (h.kind, h.opcode) {
        (Kind::Request, _) => None,
        (
            Kind::Control,
            control::PING
            | control::SHM_GROW
            | control::SVM_ARENA
            | control::EVENT_BOARD
            | control::FENCE,
        ) => None,
        (kind, op) => Some(format!(
            "{kind:?} frame with opcode {op} not allowed from a guest"
        )),
    }
}

/// Forwards guest → server until the guest disconnects or misbehaves.
fn guest_to_server(t: &Tenant, link: &Link, reader: &mut FrameReader, r_end: &Conn) {
    let m = &t.m;
    let mut batch: Vec<u8> = Vec::new();
    let mut last_seq = 0u64;
    let mut server_ok = true;
    loop {
        let frame = match reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) if e.is_peer_fault() => {
                bad_frame(m, link, last_seq, &e.to_string(), r_end, &mut batch);
                return;
            }
            Err(e) => {
                debug!(tenant = m.id, conn = link.id, error = %e, "guest read failed");
                break;
            }
        };
        let h = match Header::parse(frame) {
            Ok(h) => h,
            Err(e) => {
                bad_frame(m, link, last_seq, &e.to_string(), r_end, &mut batch);
                return;
            }
        };
        if let Some(reason) = refuse(&h) {
            bad_frame(m, link, last_seq, &reason, r_end, &mut batch);
            return;
        }
        m.bytes_in.fetch_add(u64::from(h.len), Relaxed);
        m.bulk.fetch_add(h.bulk, Relaxed);
        if h.opcode == hira_opencl::OP_HIRAENQUEUEMAPARENA {
            // A map of a buffer in the arena: the guest moves the bytes in place.
            m.bulk
                .fetch_add(arena_map_bytes(&frame[HEADER_LEN..]), Relaxed);
        }
        let mut refused = None;
        if h.kind == Kind::Request {
            m.count_call(h.opcode);
            if hira_opencl::op(h.opcode)
                .is_some_and(|o| o.allocates || o.creates == K_MEM || o.retains || o.releases)
            {
                refused = t.mem_request(link.id, &h, &frame[HEADER_LEN..]);
            }
        }
        let sync = h.flags & flags::ASYNC == 0;
        if sync {
            // A reply the server sends straight to the guest is not tracked here (a dead
            // server's EOF on the direct socket fails it in the guest); a refused request
            // is answered by the router, so it is.
            let untracked = link.direct
                && h.kind == Kind::Request
                && refused.is_none()
                && hira_opencl::reply_skips_router(h.opcode);
            let live = if untracked {
                !link.is_gone()
            } else {
                link.track(h.seq)
            };
            if !live {
                m.failed.fetch_add(1, Relaxed);
                let _ = link.send_guest(&failed_frame(h.seq, cl::CL_OUT_OF_RESOURCES));
                continue;
            }
        } else if link.is_gone() || refused.is_some() {
            m.dropped.fetch_add(1, Relaxed);
            continue;
        }
        // A refused allocation never reaches the server. It is answered once every earlier
        // frame has run (the guest then reuses its shared memory): a PING takes its place
        // and its reply is turned into the refusal.
        let substitute;
        let frame = match refused {
            Some(code) => {
                lock(&link.refused).insert(h.seq, (h.opcode, code));
                substitute = control_frame(control::PING, h.seq, &[]);
                &substitute[..]
            }
            None => frame,
        };
        last_seq = h.seq;
        let device_time = h.kind == Kind::Request && refused.is_none() && t.scheduled(h.opcode);
        if h.kind == Kind::Request && refused.is_none() && !device_time {
            t.before_forward(&h, &frame[HEADER_LEN..], false);
        }
        let sent = if device_time {
            // A launch granted at once joins the batch; one that must wait for the
            // scheduler first lets everything before it go.
            let mut before = Ok(());
            let granted = match t.dispatch.try_acquire(m.id) {
                Ok(granted) => granted,
                Err(ticket) => {
                    before = flush(r_end, &mut batch);
                    t.dispatch.wait_grant(ticket)
                }
            };
            if !granted {
                // Stopped or gone: the launch is not run.
                if sync {
                    link.fail_all(m);
                } else {
                    m.dropped.fetch_add(1, Relaxed);
                }
                continue;
            }
            t.before_forward(&h, &frame[HEADER_LEN..], true);
            batch.extend_from_slice(frame);
            let r = before.and_then(|()| {
                if reader.buffered() < HEADER_LEN || batch.len() >= BATCH_MAX {
                    flush(r_end, &mut batch)
                } else {
                    Ok(())
                }
            });
            if r.is_err() {
                t.dispatch.cancel(m.id);
            }
            r
        } else if h.kind == Kind::Control
            && matches!(
                h.opcode,
                control::SHM_GROW | control::SVM_ARENA | control::EVENT_BOARD
            )
        {
            let frame = frame.to_vec();
            match reader.take_fd() {
                Some(fd) => {
                    flush(r_end, &mut batch).and_then(|()| r_end.send(&frame, &[fd.as_fd()]))
                }
                None => {
                    bad_frame(
                        m,
                        link,
                        last_seq,
                        "SHM_GROW, SVM_ARENA or EVENT_BOARD without an fd",
                        r_end,
                        &mut batch,
                    );
                    return;
                }
            }
        } else if frame.len() >= DIRECT_MIN {
            let r = if batch.is_empty() {
                Ok(())
            } else {
                // The batch must go first; send it, then the large frame straight from
                // the read buffer.
                r_end.send(&batch, &[]).map(|()| batch.clear())
            };
            r.and_then(|()| r_end.send(frame, &[]))
        } else {
            batch.extend_from_slice(frame);
            if reader.buffered() < HEADER_LEN || batch.len() >= BATCH_MAX {
                flush(r_end, &mut batch)
            } else {
                Ok(())
            }
        };
        if let Err(e) = sent {
            batch.clear();
            if server_ok {
                server_ok = false;
                debug!(tenant = m.id, conn = link.id, error = %e, "server socket closed");
            }
            link.fail_all(m);
        }
    }
    let _ = flush(r_end, &mut batch);
}

fn bad_frame(
    m: &TenantMetrics,
    link: &Link,
    last_seq: u64,
    reason: &str,
    r_end: &Conn,
    batch: &mut Vec<u8>,
) {
    warn!(tenant = m.id, conn = link.id, %reason, "bad frame from guest; closing the connection");
    m.bad_frames.fetch_add(1, Relaxed);
    let _ = flush(r_end, batch);
    let _ = link.send_guest(&failed_frame(last_seq, cl::CL_INVALID_VALUE));
}

/// Forwards server → guest until either side closes.
fn server_to_guest(t: &Tenant, link: &Link, mut reader: FrameReader) {
    let m = &t.m;
    let mut batch: Vec<u8> = Vec::new();
    loop {
        // The server sends no fds to guests; drop any it did.
        while reader.take_fd().is_some() {}
        let frame = match reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                if !link.closing.load(SeqCst) {
                    warn!(tenant = m.id, conn = link.id, error = %e, "bad frame from API server");
                }
                break;
            }
        };
        let Ok(h) = Header::parse(frame) else { break };
        let refusal = if h.opcode == control::PING && matches!(h.kind, Kind::Reply | Kind::Control)
        {
            lock(&link.refused).remove(&h.seq)
        } else {
            None
        };
        let forward = match h.kind {
            Kind::Reply => {
                m.device_ns.fetch_add(h.device_ns, Relaxed);
                let launch_failed = hira_opencl::op(h.opcode).is_some_and(|o| o.device_time)
                    && frame
                        .get(HEADER_LEN..HEADER_LEN + 4)
                        .is_some_and(|b| b != [0, 0, 0, 0]);
                if launch_failed {
                    // A refused launch never reaches the device: no DONE will come.
                    t.dispatch.cancel(m.id);
                }
                let delivered = link.complete(h.seq);
                if hira_opencl::op(h.opcode).is_some_and(|o| o.creates == K_MEM) {
                    t.mem_reply(link.id, &h, &frame[HEADER_LEN..], delivered);
                }
                delivered
            }
            Kind::Control => link.complete(h.seq),
            Kind::Callback => !link.is_gone(),
            Kind::Request => {
                warn!(
                    tenant = m.id,
                    conn = link.id,
                    "API server sent a request frame"
                );
                break;
            }
        };
        if !forward {
            continue;
        }
        let substitute;
        let frame = match refusal {
            Some((opcode, code)) => {
                substitute = refusal_reply(&h, opcode, code, &frame[HEADER_LEN..]);
                &substitute[..]
            }
            None => frame,
        };
        m.bytes_out.fetch_add(u64::from(h.len), Relaxed);
        let sent = if frame.len() >= DIRECT_MIN {
            let guest = lock(&link.guest_tx);
            flush(&guest, &mut batch).and_then(|()| guest.send(frame, &[]))
        } else {
            batch.extend_from_slice(frame);
            if reader.buffered() < HEADER_LEN || batch.len() >= BATCH_MAX {
                flush(&lock(&link.guest_tx), &mut batch)
            } else {
                Ok(())
            }
        };
        if sent.is_err() {
            break;
        }
    }
    if !link.closing.load(SeqCst) {
        if !t.dead.load(SeqCst) {
            warn!(
                tenant = m.id,
                conn = link.id,
                "API server closed the connection; failing its calls"
            );
        }
        link.fail_all(m);
    }
}

/// Reads the server's control socket: USAGE samples; EOF means the server is gone.
fn control_loop(t: &Tenant, mut reader: FrameReader) {
    loop {
        while reader.take_fd().is_some() {}
        let frame = match reader.read_frame(HEADER_LEN, MAX_FRAME, Header::frame_len) {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                if !t.retiring.load(SeqCst) {
                    warn!(tenant = t.m.id, error = %e, "bad frame on control socket");
                }
                break;
            }
        };
        let Ok(h) = Header::parse(frame) else { break };
        if h.kind == Kind::Control && h.opcode == control::USAGE {
            let mut r = Reader::new(&frame[HEADER_LEN..]);
            if let (Ok(dev), Ok(mem), Ok(obj)) = (r.u64(), r.u64(), r.u64()) {
                t.m.usage_device_ns.store(dev, Relaxed);
                t.m.mem_bytes.store(mem, Relaxed);
                t.m.objects.store(obj, Relaxed);
                if let Ok(direct) = r.u64() {
                    t.m.bytes_out_direct.store(direct, Relaxed);
                }
            }
        } else if h.kind == Kind::Control && h.opcode == control::DONE {
            let mut r = Reader::new(&frame[HEADER_LEN..]);
            if let (Ok(ns), Ok(_measured)) = (r.u64(), r.u8()) {
                t.dispatch.complete(t.m.id, ns);
                if let Some(sw) = &t.swap {
                    sw.note_busy(t.m.id, ns);
                }
            }
        } else if h.kind == Kind::Control && h.opcode == control::EVICTED {
            match parse_evicted(&frame[HEADER_LEN..]) {
                Some(ev) => {
                    lock(&t.evicted).insert(h.seq, ev);
                    t.evicted_cv.notify_all();
                }
                None => warn!(tenant = t.m.id, "malformed EVICTED from the API server"),
            }
        } else if h.kind == Kind::Control && h.opcode == control::RESTORED {
            let mut r = Reader::new(&frame[HEADER_LEN..]);
            if let (Ok(id), Ok(bytes), Ok(ns), Some(sw)) = (r.u64(), r.u64(), r.u64(), &t.swap) {
                sw.note_restored(t.m.id, id, bytes, ns);
            }
        } else {
            debug!(tenant = t.m.id, kind = ?h.kind, opcode = h.opcode, "ignored control frame");
        }
    }
    t.server_died("control socket closed");
}

/// The size a `hiraEnqueueMapArena` request maps (its sixth word; 0 if it cannot be read).
fn arena_map_bytes(payload: &[u8]) -> u64 {
    let mut r = hira_wire::Reader::new(payload);
    for _ in 0..5 {
        if r.u64().is_err() {
            return 0;
        }
    }
    r.u64().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    /// `hiraEnqueueMapArena` as the guest encodes it (the spec's order): queue, buffer,
    /// blocking, flags, offset, size, then the wait list and the outputs.
    #[test]
    fn an_arena_map_counts_the_bytes_it_maps() {
        let mut w = hira_wire::Writer::default();
        for v in [7u64, 8, 1, 4, 4096, 1 << 20, 0] {
            w.u64(v);
        }
        w.blob(hira_wire::Blob::Null);
        assert_eq!(super::arena_map_bytes(&w.buf), 1 << 20);
        assert_eq!(super::arena_map_bytes(&w.buf[..40]), 0, "truncated");
    }
}
