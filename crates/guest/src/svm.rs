//! Shared virtual memory across the process boundary.
//!
//! Where the server's device is the CPU, every allocation (fine-grained, and coarse-grained
//! too: fine-grained memory keeps every coarse-grained promise) comes from an arena: a memfd this process maps and sends to the server, which maps it at the same
//! address (`control::SVM_ARENA`). The application, the server and its kernels then touch the
//! same bytes at the same addresses, pointers stored inside included; nothing is mirrored or
//! copied, and the pointer the server returns is the one the application gets.
//!
//! Elsewhere coarse-grained allocations are mirrored, as follows.
//!
//! The vendor allocates SVM memory inside the API server, where the application cannot see
//! it. Coarse-grained semantics make a mirror legal: the host touches SVM memory only between
//! clEnqueueSVMMap and clEnqueueSVMUnmap, and kernels see it only through the API. So
//! clSVMAlloc returns the address of a mirror (zeroed host memory of the same size, at least
//! the asked alignment) and remembers the server's pointer; every API that takes an SVM pointer
//! sends the server pointer at the same offset instead (the server checks it lies inside an
//! allocation of this tenant). A map copies the region from the server into the mirror, the
//! unmap of a writable map copies it back; memcpy and fill run in the server, with host sides
//! carried like buffer reads and writes (through shared memory when large). A buffer created
//! with CL_MEM_USE_HOST_PTR inside a mirror is created on the server's allocation itself.

use crate::rt::{self, Call};
use crate::stubs;
use hira_opencl::cl::*;
use hira_opencl::*;
use std::alloc::Layout;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// A `cl_mem_flags` bit no OpenCL flag uses, set on clCreateBuffer(WithProperties) whose
/// CL_MEM_USE_HOST_PTR host pointer lies in a mirror: the host_ptr blob is then the server
/// pointer. The same value is in `crates/server/src/svm.rs`.
pub(crate) const HOST_PTR_IS_SVM: u64 = 1 << 63;
/// Sent for a pointer outside every mirror where an SVM pointer is required: no allocation
/// holds it, so the server refuses it with the API's error.
const NOT_SVM: u64 = u64::MAX;
/// Mirrors are aligned at least like PoCL's allocations (CL_DEVICE_MEM_BASE_ADDR_ALIGN).
const MIRROR_ALIGN: usize = 128;
/// Wire tags of a copy's sides (the server's `svm.rs` reads them).
const DST_SVM: u64 = 0;
const DST_REPLY: u64 = 1;
const DST_STAGED: u64 = 2;
const SRC_SVM: u64 = 0;
const SRC_BYTES: u64 = 1;
const CL_MEM_SVM_FINE_GRAIN_BUFFER: u64 = 1 << 10;
const CL_MEM_SVM_ATOMICS: u64 = 1 << 11;
const CL_KERNEL_EXEC_INFO_SVM_PTRS: u32 = 0x11B6;

struct Alloc {
    size: usize,
    server: u64,
    /// The mirror's layout; `None` for a fine-grained allocation (no mirror: the arena's
    /// bytes are the allocation's, and `server` is its own address).
    layout: Option<Layout>,
}

/// Virtual address space reserved for a tenant's fine-grained SVM arena (pages are used only
/// when touched).
const ARENA_LEN: usize = 16 << 30;

/// This process's arena, once sent to the server.
struct GuestArena {
    region: hira_transport::ShmRegion,
    /// The process that made it: a forked child needs an arena (and a server) of its own.
    pid: u32,
}

fn arena() -> MutexGuard<'static, Option<GuestArena>> {
    static A: OnceLock<Mutex<Option<GuestArena>>> = OnceLock::new();
    A.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// clSVMAlloc in the server: (pointer or 0, the address it offers for the arena or 0).
fn alloc_on_server(
    context: *mut c_void,
    flags: u64,
    size: usize,
    alignment: u32,
) -> Result<(u64, u64), i32> {
    let mut c = Call::new(OP_CLSVMALLOC);
    c.handle(context);
    c.u64(flags);
    c.u64(size as u64);
    c.u64(u64::from(alignment));
    let mut r = c.sync()?;
    let _status = r.i32()?;
    let p = r.u64()?;
    Ok((p, r.u64().unwrap_or(0)))
}

/// Sends the arena (its fd and address) on this thread's connection.
fn send_arena(region: &hira_transport::ShmRegion) -> Result<(), i32> {
    let mut payload = Vec::with_capacity(16);
    payload.extend_from_slice(&(region.as_ptr() as u64).to_le_bytes());
    payload.extend_from_slice(&(region.len() as u64).to_le_bytes());
    rt::with_conn(|c| c.send_control_fd(hira_wire::control::SVM_ARENA, &payload, region.fd()))
}

/// Makes and sends this process's arena unless it has one; false when it cannot.
fn made(st: &mut Option<GuestArena>) -> bool {
    let pid = std::process::id();
    if st.as_ref().is_some_and(|a| a.pid != pid) {
        // Inherited from the parent, whose allocations still live in it: keep it mapped.
        std::mem::forget(st.take());
    }
    if st.is_none() {
        let made = hira_transport::ShmRegion::create_in_window("hira-svm", ARENA_LEN)
            .map_err(|e| log(&format!("no SVM arena: {e}")))
            .ok()
            .filter(|r| send_arena(r).is_ok());
        let Some(region) = made else {
            return false;
        };
        *st = Some(GuestArena { region, pid });
    }
    true
}

/// Before a buffer is created: the arena, where the server places buffers on devices that
/// allow it (its `direct.rs`), is in place. `HIRA_ARENA_BUFFERS=0` or `HIRA_FINE_SVM=0` in
/// the application's environment keep buffers out of it.
pub(crate) fn ensure_arena() {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF.get_or_init(|| {
        ["HIRA_ARENA_BUFFERS", "HIRA_FINE_SVM"]
            .iter()
            .any(|k| std::env::var_os(k).is_some_and(|v| v == "0"))
    });
    if !off {
        made(&mut arena());
    }
}

/// Whether `[p, p + len)` lies inside this process's arena.
pub(crate) fn in_arena(p: usize, len: usize) -> bool {
    arena().as_ref().is_some_and(|a| {
        let base = a.region.as_ptr() as usize;
        p >= base
            && p.checked_add(len)
                .is_some_and(|end| end <= base + a.region.len())
    })
}

/// A fine-grained allocation in the arena, which is made and sent on first use. When the
/// arena's address is taken in the server, the server offers a free one: the arena is mapped
/// there too (or, if that is taken here, at another random address of the shared window)
/// and sent again, a few times at most.
fn fine_alloc(context: *mut c_void, flags: u64, size: usize, alignment: u32) -> *mut c_void {
    let mut st = arena();
    if !made(&mut st) {
        return std::ptr::null_mut();
    }
    let pid = std::process::id();
    for _ in 0..8 {
        let (p, offer) = alloc_on_server(context, flags, size, alignment).unwrap_or((0, 0));
        if p != 0 {
            allocs().insert(
                p as usize,
                Alloc {
                    size,
                    server: p,
                    layout: None,
                },
            );
            return p as usize as *mut c_void;
        }
        let Some(cur) = st.as_ref() else { break };
        if offer == 0 {
            // The server has the arena (and refused for another reason), or refused it.
            break;
        }
        let twin = match cur.region.map_again_at(offer as usize) {
            Ok(twin) => Ok(twin),
            Err(_) => cur.region.map_again_in_window(),
        };
        match twin {
            Ok(twin) if send_arena(&twin).is_ok() => {
                log(&format!(
                    "clSVMAlloc: arena moved to {:#x} (offered {offer:#x})",
                    twin.as_ptr() as usize
                ));
                *st = Some(GuestArena { region: twin, pid });
            }
            _ => break,
        }
    }
    log("clSVMAlloc: no fine-grained SVM memory");
    std::ptr::null_mut()
}

/// Whether every device of `context` offers fine-grained buffer SVM (so hira serves SVM
/// from the arena there); asked once per context.
fn arena_context(context: *mut c_void) -> bool {
    const CL_CONTEXT_DEVICES: u32 = 0x1081;
    const CL_DEVICE_SVM_FINE_GRAIN_BUFFER: u64 = 2;
    static SEEN: OnceLock<Mutex<HashMap<usize, bool>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    if let Some(&v) = seen
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(context as usize))
    {
        return v;
    }
    let mut devs = [std::ptr::null_mut::<c_void>(); 16];
    let mut got = 0usize;
    // SAFETY: a context handle of the application; room for 16 device handles.
    let ok = unsafe {
        stubs::clGetContextInfo(
            context,
            CL_CONTEXT_DEVICES,
            std::mem::size_of_val(&devs),
            devs.as_mut_ptr() as *mut c_void,
            &mut got,
        )
    } == CL_SUCCESS;
    let n = got / std::mem::size_of::<*mut c_void>();
    let fine = ok
        && (1..=devs.len()).contains(&n)
        && devs[..n].iter().all(|&d| {
            let mut caps = 0u64;
            // SAFETY: a device of the context; an 8-byte cl_bitfield output.
            let r = unsafe {
                stubs::clGetDeviceInfo(
                    d,
                    CL_DEVICE_SVM_CAPABILITIES,
                    8,
                    &mut caps as *mut u64 as *mut c_void,
                    std::ptr::null_mut(),
                )
            };
            r == CL_SUCCESS && caps & CL_DEVICE_SVM_FINE_GRAIN_BUFFER != 0
        });
    seen.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(context as usize, fine);
    fine
}

/// Whether `p` lies in a fine-grained allocation.
fn is_fine(p: *const c_void) -> bool {
    let p = p as usize;
    let a = allocs();
    a.range(..=p)
        .next_back()
        .is_some_and(|(&base, al)| al.layout.is_none() && p - base < al.size.max(1))
}

fn allocs() -> MutexGuard<'static, BTreeMap<usize, Alloc>> {
    static A: OnceLock<Mutex<BTreeMap<usize, Alloc>>> = OnceLock::new();
    A.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A live map of a mirror region: its size and whether the application may write it.
struct Mapped {
    size: usize,
    writes: bool,
    /// A non-blocking map's staged copy into the mirror (0: none).
    staging: u64,
}

fn maps() -> MutexGuard<'static, HashMap<usize, Vec<Mapped>>> {
    static M: OnceLock<Mutex<HashMap<usize, Vec<Mapped>>>> = OnceLock::new();
    M.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The server pointer for a guest address inside a mirror, and the bytes from there to the
/// allocation's end.
fn lookup(p: *const c_void) -> Option<(u64, usize)> {
    let p = p as usize;
    let a = allocs();
    let (&base, al) = a.range(..=p).next_back()?;
    let off = p - base;
    (off < al.size.max(1)).then(|| {
        (
            al.server.wrapping_add(off as u64),
            al.size.saturating_sub(off),
        )
    })
}

/// The wire form of a pointer that must be an SVM pointer: 0 for NULL, the server pointer
/// inside a mirror, [`NOT_SVM`] otherwise.
fn wire_ptr(p: *const c_void) -> u64 {
    if p.is_null() {
        return 0;
    }
    lookup(p).map_or(NOT_SVM, |(s, _)| s)
}

/// clCreateBuffer(WithProperties) with CL_MEM_USE_HOST_PTR: if `[p, p + len)` lies inside
/// one mirror, the server pointer the buffer is to alias.
pub(crate) fn buffer_alias(p: *const u8, len: u64) -> Option<u64> {
    let (server, left) = lookup(p as *const c_void)?;
    (len <= left as u64).then_some(server)
}

fn null_on_panic(f: impl FnOnce() -> *mut c_void) -> *mut c_void {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(std::ptr::null_mut())
}

pub(crate) fn log(what: &str) {
    if std::env::var_os("HIRA_DEBUG").is_some() {
        eprintln!("hira: {what}");
    }
}

// ---- Allocation ---------------------------------------------------------------------------

/// # Safety
/// Standard `clSVMAlloc` contract.
pub unsafe extern "C" fn clSVMAlloc(
    context: *mut c_void,
    flags: u64,
    size: usize,
    alignment: u32,
) -> *mut c_void {
    null_on_panic(|| {
        if flags & (CL_MEM_SVM_FINE_GRAIN_BUFFER | CL_MEM_SVM_ATOMICS) != 0 {
            return fine_alloc(context, flags, size, alignment);
        }
        if arena_context(context) {
            // Where the device offers fine grain, coarse-grained allocations live in the arena
            // too: fine-grained memory keeps every coarse-grained promise, needs no mirror and
            // no copies, and pointers stored in it mean the same to kernels. What the arena
            // cannot hold (size 0, a bad alignment, a full arena) takes the mirror path, which
            // answers as the vendor does.
            let p = fine_alloc(
                context,
                flags | CL_MEM_SVM_FINE_GRAIN_BUFFER,
                size,
                alignment,
            );
            if !p.is_null() {
                return p;
            }
        }
        let server = alloc_on_server(context, flags, size, alignment).map_or(0, |(p, _)| p);
        if server == 0 {
            return std::ptr::null_mut();
        }
        let mirror = Layout::from_size_align(size.max(1), (alignment as usize).max(MIRROR_ALIGN))
            .ok()
            .map(|l| {
                // SAFETY: the layout has a non-zero size.
                (unsafe { std::alloc::alloc_zeroed(l) }, l)
            })
            .filter(|(p, _)| !p.is_null());
        let Some((p, layout)) = mirror else {
            log("clSVMAlloc: no host memory for the mirror");
            free_on_server(context, server);
            return std::ptr::null_mut();
        };
        allocs().insert(
            p as usize,
            Alloc {
                size,
                server,
                layout: Some(layout),
            },
        );
        p as *mut c_void
    })
}

fn free_on_server(context: *mut c_void, server: u64) {
    let r = (|| {
        let mut c = Call::new(OP_CLSVMFREE);
        c.handle(context);
        c.u64(server);
        let mut r = c.sync()?;
        r.i32()
    })();
    if r != Ok(CL_SUCCESS) {
        log("clSVMFree refused by the server");
    }
}

/// Forget a mirror's maps and release its memory; staged reads still headed there land in
/// scratch memory instead.
fn drop_mirror(base: usize, a: Alloc) {
    let end = base + a.size.max(1);
    maps().retain(|&p, _| p < base || p >= end);
    crate::staged::discard(base, end);
    if let Some(layout) = a.layout {
        // SAFETY: allocated in clSVMAlloc with this layout; removed from the table above, so
        // nothing of ours refers to it any more.
        unsafe { std::alloc::dealloc(base as *mut u8, layout) };
    }
}

/// # Safety
/// Standard `clSVMFree` contract.
pub unsafe extern "C" fn clSVMFree(context: *mut c_void, svm_pointer: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        if svm_pointer.is_null() {
            return;
        }
        let Some(a) = allocs().remove(&(svm_pointer as usize)) else {
            log("clSVMFree: not an SVM allocation");
            return;
        };
        free_on_server(context, a.server);
        drop_mirror(svm_pointer as usize, a);
    });
}

struct FreeCallback {
    pfn: usize,
    user_data: usize,
    queue: usize,
    ptrs: Vec<usize>,
    /// The marker's event is ours (the application did not ask for it).
    own_event: bool,
}

extern "C" fn free_callback(ev: *mut c_void, _status: i32, ud: *mut c_void) {
    // SAFETY: ud is the box made in clEnqueueSVMFree, handed over exactly once.
    let cb = unsafe { Box::from_raw(ud as *mut FreeCallback) };
    let mut ptrs: Vec<*mut c_void> = cb.ptrs.iter().map(|&p| p as *mut c_void).collect();
    // SAFETY: the application registered this function as a pfn_free_func.
    let f: extern "C" fn(*mut c_void, u32, *mut *mut c_void, *mut c_void) =
        unsafe { std::mem::transmute(cb.pfn) };
    f(
        cb.queue as *mut c_void,
        ptrs.len() as u32,
        ptrs.as_mut_ptr(),
        cb.user_data as *mut c_void,
    );
    if cb.own_event {
        // SAFETY: the marker event this guest created for the callback.
        unsafe { crate::events::clReleaseEvent(ev) };
    }
}

/// # Safety
/// Standard `clEnqueueSVMFree` contract.
pub unsafe extern "C" fn clEnqueueSVMFree(
    queue: *mut c_void,
    n: u32,
    svm_pointers: *mut *mut c_void,
    pfn_free_func: *mut c_void,
    user_data: *mut c_void,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    rt::status(OP_CLENQUEUESVMFREE, || {
        if n == 0 || svm_pointers.is_null() {
            return Ok(CL_INVALID_VALUE);
        }
        // SAFETY: n pointers (API contract).
        let list: Vec<usize> = (0..n as usize)
            .map(|i| unsafe { *svm_pointers.add(i) } as usize)
            .collect();
        if !pfn_free_func.is_null() {
            // The application's callback frees the memory (say with clSVMFree): run it once
            // everything before has completed, after a marker.
            let mut own: *mut c_void = std::ptr::null_mut();
            let evp = if event.is_null() {
                &mut own as *mut *mut c_void
            } else {
                event
            };
            // SAFETY: forwarded arguments; evp is writable.
            let ret = unsafe { stubs::clEnqueueMarkerWithWaitList(queue, nwait, wait, evp) };
            if ret != CL_SUCCESS {
                return Ok(ret);
            }
            // SAFETY: written by the marker above.
            let ev = unsafe { *evp };
            let cb = Box::into_raw(Box::new(FreeCallback {
                pfn: pfn_free_func as usize,
                user_data: user_data as usize,
                queue: queue as usize,
                ptrs: list,
                own_event: event.is_null(),
            }));
            // SAFETY: a live event; free_callback takes the box back exactly once.
            let ret = unsafe {
                crate::events::clSetEventCallback(
                    ev,
                    CL_COMPLETE,
                    free_callback as *mut c_void,
                    cb as _,
                )
            };
            if ret != CL_SUCCESS {
                // SAFETY: not handed over (the registration failed).
                drop(unsafe { Box::from_raw(cb) });
                if event.is_null() {
                    // SAFETY: our own marker event.
                    unsafe { crate::events::clReleaseEvent(ev) };
                }
            }
            return Ok(ret);
        }
        let server: Vec<u64> = {
            let a = allocs();
            list.iter()
                .map(|p| a.get(p).map_or(NOT_SVM, |al| al.server))
                .collect()
        };
        if server.contains(&NOT_SVM) {
            // Not an allocation's base: refused now rather than at the next sync call.
            return Ok(CL_INVALID_VALUE);
        }
        let bytes: Vec<u8> = server.iter().flat_map(|s| s.to_le_bytes()).collect();
        let mut c = Call::new(OP_CLENQUEUESVMFREE);
        c.handle(queue);
        c.u64(u64::from(n));
        // SAFETY: a local buffer of n pointers; the wait list and event follow the contract.
        unsafe {
            c.in_bytes(bytes.as_ptr(), bytes.len() as u64);
            c.u64(u64::from(nwait));
            c.in_handles(wait, u64::from(nwait));
            c.new_handle(event, K_EVENT);
        }
        let ret = c.send_async()?;
        // The application may not touch them any more; the server frees its side in order.
        for p in list {
            let a = allocs().remove(&p);
            if let Some(a) = a {
                drop_mirror(p, a);
            }
        }
        Ok(ret)
    })
}

// ---- Copies -------------------------------------------------------------------------------

/// The end of a copy request: the wait list and the event. A synchronous call names its event
/// in a local and hands it over on success; an asynchronous one names the application's.
///
/// # Safety
/// `wait` holds `nwait` handles; `event` is null or writable.
unsafe fn finish_call(
    c: &mut Call,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
    local: &mut *mut c_void,
    sync: bool,
) {
    c.u64(u64::from(nwait));
    // SAFETY: the caller's contract.
    unsafe {
        c.in_handles(wait, u64::from(nwait));
        if sync && !event.is_null() {
            c.new_handle(local, K_EVENT);
        } else {
            c.new_handle(event, K_EVENT);
        }
    }
}

/// Wait for a synchronous copy's reply: its status, the host destination filled in.
///
/// # Safety
/// `dst` is the destination registered for the call's output (or null if it has none);
/// `event` is null or writable.
unsafe fn sync_reply(
    c: Call,
    dst: *mut u8,
    event: *mut *mut c_void,
    local: *mut c_void,
) -> Result<i32, i32> {
    let mut r = c.sync()?;
    let ret = r.i32()?;
    if !dst.is_null() {
        // SAFETY: the output registered by the caller.
        unsafe { r.out_bytes(dst)? };
    }
    if ret == CL_SUCCESS && !event.is_null() {
        // SAFETY: writable by contract.
        unsafe { *event = local };
    }
    r.status(ret)
}

/// # Safety
/// Standard `clEnqueueSVMMemcpy` contract.
pub unsafe extern "C" fn clEnqueueSVMMemcpy(
    queue: *mut c_void,
    blocking: u32,
    dst: *mut c_void,
    src: *const c_void,
    size: usize,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    rt::status(OP_CLENQUEUESVMMEMCPY, || {
        if dst.is_null() || src.is_null() {
            return Ok(CL_INVALID_VALUE);
        }
        let d = lookup(dst).map(|(s, _)| s);
        let s = lookup(src).map(|(s, _)| s);
        let mut c = Call::new(OP_CLENQUEUESVMMEMCPY);
        c.handle(queue);
        c.u64(u64::from(blocking));
        let mut staging = 0;
        let mut reply_to = std::ptr::null_mut();
        match d {
            Some(sp) => {
                c.u64(DST_SVM);
                c.u64(sp);
            }
            None if blocking != 0 => {
                c.u64(DST_REPLY);
                c.out_bytes(dst as *mut u8, size as u64);
                reply_to = dst as *mut u8;
            }
            None => {
                // SVM to host without blocking: staged like a non-blocking buffer read.
                staging = crate::staged::next_id();
                c.u64(DST_STAGED);
                c.u64(staging);
            }
        }
        match s {
            Some(sp) => {
                c.u64(SRC_SVM);
                c.u64(sp);
            }
            None => {
                c.u64(SRC_BYTES);
                // SAFETY: size readable bytes at src (API contract), or null.
                unsafe { c.in_bytes(src as *const u8, size as u64) };
            }
        }
        c.u64(size as u64);
        let sync = blocking != 0 || !reply_to.is_null();
        let mut local = std::ptr::null_mut();
        // SAFETY: the API contract for the wait list and event.
        unsafe { finish_call(&mut c, nwait, wait, event, &mut local, sync) };
        if !sync {
            let ret = c.send_async()?;
            if staging != 0 {
                crate::staged::push(staging, dst as usize, size);
            }
            return Ok(ret);
        }
        // SAFETY: reply_to is the output registered above (or null).
        unsafe { sync_reply(c, reply_to, event, local) }
    })
}

/// # Safety
/// Standard `clEnqueueSVMMemFill` contract.
pub unsafe extern "C" fn clEnqueueSVMMemFill(
    queue: *mut c_void,
    svm_ptr: *mut c_void,
    pattern: *const c_void,
    pattern_size: usize,
    size: usize,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    rt::status(OP_CLENQUEUESVMMEMFILL, || {
        // What is sure to be refused is refused now, not at the next synchronizing call.
        let Some((server, _)) = lookup(svm_ptr) else {
            return Ok(CL_INVALID_VALUE);
        };
        if pattern.is_null() || pattern_size == 0 {
            return Ok(CL_INVALID_VALUE);
        }
        let mut c = Call::new(OP_CLENQUEUESVMMEMFILL);
        c.handle(queue);
        c.u64(server);
        // SAFETY: pattern_size readable bytes at pattern (API contract), or null.
        unsafe { c.in_bytes(pattern as *const u8, pattern_size as u64) };
        c.u64(pattern_size as u64);
        c.u64(size as u64);
        let mut local = std::ptr::null_mut();
        // SAFETY: the API contract for the wait list and event.
        unsafe { finish_call(&mut c, nwait, wait, event, &mut local, false) };
        c.send_async()
    })
}

/// # Safety
/// Standard `clEnqueueSVMMap` contract.
pub unsafe extern "C" fn clEnqueueSVMMap(
    queue: *mut c_void,
    blocking: u32,
    flags: u64,
    svm_ptr: *mut c_void,
    size: usize,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    rt::status(OP_CLENQUEUESVMMAP, || {
        let Some((server, left)) = lookup(svm_ptr) else {
            return Ok(CL_INVALID_VALUE);
        };
        if size == 0 || size > left {
            return Ok(CL_INVALID_VALUE);
        }
        let fine = is_fine(svm_ptr);
        // A fine-grained region has no mirror: its unmap has nothing to send back.
        let writes = !fine && flags & (CL_MAP_WRITE | CL_MAP_WRITE_INVALIDATE_REGION) != 0;
        let mut staging = 0;
        let ret = if fine {
            // The region is the allocation: a marker orders the map, and a blocking map
            // returns once it (so everything before it in the queue) has completed.
            // SAFETY: forwarded arguments.
            unsafe { ordered_marker(queue, blocking != 0, nwait, wait, event) }
        } else if flags & CL_MAP_WRITE_INVALIDATE_REGION != 0 {
            // Nothing to fetch: the mirror is the application's until the unmap (a
            // fine-grained region is the allocation itself). A blocking map still returns
            // only once what it waits for has completed.
            // SAFETY: forwarded arguments.
            unsafe { invalidate_map(queue, blocking, nwait, wait, event) }
        } else {
            let mut c = Call::new(OP_CLENQUEUESVMMAP);
            c.handle(queue);
            c.u64(u64::from(blocking));
            c.u64(flags);
            c.u64(server);
            c.u64(size as u64);
            if blocking != 0 {
                c.u64(DST_REPLY);
                c.out_bytes(svm_ptr as *mut u8, size as u64);
            } else {
                staging = crate::staged::next_id();
                c.u64(DST_STAGED);
                c.u64(staging);
            }
            let sync = blocking != 0;
            let mut local = std::ptr::null_mut();
            // SAFETY: the API contract for the wait list and event.
            unsafe { finish_call(&mut c, nwait, wait, event, &mut local, sync) };
            if sync {
                // SAFETY: the mirror region registered as the output above.
                unsafe { sync_reply(c, svm_ptr as *mut u8, event, local)? }
            } else {
                let ret = c.send_async()?;
                // The region reaches the mirror when the application synchronizes.
                crate::staged::push(staging, svm_ptr as usize, size);
                ret
            }
        };
        if ret == CL_SUCCESS {
            // SAFETY: the event (if any) written by the command above.
            unsafe { crate::infocache::command_type(event, CL_COMMAND_SVM_MAP) };
            maps().entry(svm_ptr as usize).or_default().push(Mapped {
                size,
                writes,
                staging,
            });
        }
        Ok(ret)
    })
}

/// A CL_MAP_WRITE_INVALIDATE_REGION map: a marker for the event and the ordering, waited
/// for when the map blocks (and it waits for something).
///
/// # Safety
/// As `clEnqueueMarkerWithWaitList`.
unsafe fn invalidate_map(
    queue: *mut c_void,
    blocking: u32,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    // SAFETY: forwarded arguments.
    unsafe { ordered_marker(queue, blocking != 0 && nwait != 0, nwait, wait, event) }
}

/// A marker after `wait` (or everything before it), waited for when `block`.
///
/// # Safety
/// As `clEnqueueMarkerWithWaitList`.
unsafe fn ordered_marker(
    queue: *mut c_void,
    block: bool,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    if !block {
        // SAFETY: forwarded arguments.
        return unsafe { stubs::clEnqueueMarkerWithWaitList(queue, nwait, wait, event) };
    }
    let mut own: *mut c_void = std::ptr::null_mut();
    let evp = if event.is_null() {
        &mut own as *mut *mut c_void
    } else {
        event
    };
    // SAFETY: forwarded arguments; evp is writable.
    let ret = unsafe { stubs::clEnqueueMarkerWithWaitList(queue, nwait, wait, evp) };
    if ret != CL_SUCCESS {
        return ret;
    }
    // SAFETY: the marker's event, written above.
    let ret = unsafe { stubs::clWaitForEvents(1, evp) };
    if event.is_null() {
        // SAFETY: our own marker event.
        unsafe { crate::events::clReleaseEvent(own) };
    }
    ret
}

/// # Safety
/// Standard `clEnqueueSVMUnmap` contract.
pub unsafe extern "C" fn clEnqueueSVMUnmap(
    queue: *mut c_void,
    svm_ptr: *mut c_void,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    rt::status(OP_CLENQUEUESVMUNMAP, || {
        let Some((server, _)) = lookup(svm_ptr) else {
            return Ok(CL_INVALID_VALUE);
        };
        let m = {
            let mut maps = maps();
            let m = maps.get_mut(&(svm_ptr as usize)).and_then(|v| v.pop());
            if maps.get(&(svm_ptr as usize)).is_some_and(|v| v.is_empty()) {
                maps.remove(&(svm_ptr as usize));
            }
            m
        };
        // A non-blocking map whose bytes never reached the mirror (the application did not
        // wait for it, so it cannot have written there): nothing to send back, and the late
        // bytes must not land in the mirror either.
        let untouched = m
            .as_ref()
            .is_some_and(|m| m.staging != 0 && crate::staged::cancel(m.staging));
        let ret = match m {
            Some(m) if m.writes && !untouched => {
                // The application is done writing: its bytes go to the allocation now.
                let mut c = Call::new(OP_CLENQUEUESVMUNMAP);
                c.handle(queue);
                c.u64(server);
                c.u64(m.size as u64);
                // SAFETY: the mapped mirror region (m.size bytes at svm_ptr, checked at map).
                unsafe { c.in_bytes(svm_ptr as *const u8, m.size as u64) };
                let mut local = std::ptr::null_mut();
                // SAFETY: the API contract for the wait list and event.
                unsafe { finish_call(&mut c, nwait, wait, event, &mut local, false) };
                c.send_async()
            }
            // Read-only (or not mapped): only the event and the ordering remain.
            // SAFETY: forwarded arguments.
            _ => Ok(unsafe { stubs::clEnqueueMarkerWithWaitList(queue, nwait, wait, event) }),
        };
        if ret == Ok(CL_SUCCESS) {
            // SAFETY: the event (if any) written by the command above.
            unsafe { crate::infocache::command_type(event, CL_COMMAND_SVM_UNMAP) };
        }
        ret
    })
}

// ---- Other commands -----------------------------------------------------------------------

/// # Safety
/// Standard `clEnqueueSVMMigrateMem` contract.
pub unsafe extern "C" fn clEnqueueSVMMigrateMem(
    queue: *mut c_void,
    n: u32,
    svm_pointers: *mut *mut c_void,
    sizes: *const usize,
    flags: u64,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    rt::status(OP_CLENQUEUESVMMIGRATEMEM, || {
        if n == 0 || svm_pointers.is_null() {
            return Ok(CL_INVALID_VALUE);
        }
        // SAFETY: n pointers (API contract).
        let server: Vec<u64> = (0..n as usize)
            .map(|i| wire_ptr(unsafe { *svm_pointers.add(i) }))
            .collect();
        if server.iter().any(|&p| p == 0 || p == NOT_SVM) {
            return Ok(CL_INVALID_VALUE);
        }
        let ptrs: Vec<u8> = server.iter().flat_map(|p| p.to_le_bytes()).collect();
        let mut c = Call::new(OP_CLENQUEUESVMMIGRATEMEM);
        c.handle(queue);
        c.u64(u64::from(n));
        // SAFETY: a local buffer; sizes is null or holds n size_t values (API contract).
        unsafe {
            c.in_bytes(ptrs.as_ptr(), ptrs.len() as u64);
            c.in_bytes(sizes as *const u8, u64::from(n) * 8);
        }
        c.u64(flags);
        let mut local = std::ptr::null_mut();
        // SAFETY: the API contract for the wait list and event.
        unsafe { finish_call(&mut c, nwait, wait, event, &mut local, false) };
        c.send_async()
    })
}

/// # Safety
/// Standard `clSetKernelArgSVMPointer` contract.
pub unsafe extern "C" fn clSetKernelArgSVMPointer(
    kernel: *mut c_void,
    index: u32,
    arg_value: *const c_void,
) -> i32 {
    rt::status(OP_CLSETKERNELARGSVMPOINTER, || {
        let ptr = wire_ptr(arg_value);
        if ptr == NOT_SVM {
            // No allocation holds it: refused now rather than at the next sync call.
            return Ok(CL_INVALID_ARG_VALUE);
        }
        let mut c = Call::new(OP_CLSETKERNELARGSVMPOINTER);
        c.handle(kernel);
        c.u64(u64::from(index));
        c.u64(ptr);
        c.send_async()
    })
}

/// # Safety
/// Standard `clSetKernelExecInfo` contract.
pub unsafe extern "C" fn clSetKernelExecInfo(
    kernel: *mut c_void,
    param: u32,
    size: usize,
    value: *const c_void,
) -> i32 {
    rt::status(OP_CLSETKERNELEXECINFO, || {
        let mut c = Call::new(OP_CLSETKERNELEXECINFO);
        c.handle(kernel);
        c.u64(u64::from(param));
        c.u64(size as u64);
        if param == CL_KERNEL_EXEC_INFO_SVM_PTRS && !value.is_null() {
            let value = value as *const *const c_void;
            let ptrs: Vec<u8> = (0..size / 8)
                .flat_map(|i| {
                    // SAFETY: size bytes of pointers at value (API contract).
                    let p = unsafe { *value.add(i) };
                    wire_ptr(p).to_le_bytes()
                })
                .collect();
            // SAFETY: a local buffer.
            unsafe { c.in_bytes(ptrs.as_ptr(), ptrs.len() as u64) };
        } else {
            // SAFETY: size readable bytes at value (API contract), or null.
            unsafe { c.in_bytes(value as *const u8, size as u64) };
        }
        let mut r = c.sync()?;
        let ret = r.i32()?;
        r.status(ret)
    })
}
