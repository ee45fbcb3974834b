//! The hand-written halves: ICD entry points answered in the guest, and map/unmap, which
//! the guest emulates with reads and writes into memory of its own (a server pointer means
//! nothing in the application's address space).

use crate::rt::{self, shell_ref};
use crate::stubs;
use hira_opencl::cl::*;
use hira_opencl::K_PLATFORM;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Mutex, OnceLock};

pub use crate::board::clWaitForEvents;
pub use crate::events::{clReleaseEvent, clRetainEvent, clSetEventCallback};
pub use crate::staged::{clEnqueueReadBuffer, clEnqueueWriteBuffer};
pub use crate::svm::{
    clEnqueueSVMFree, clEnqueueSVMMap, clEnqueueSVMMemFill, clEnqueueSVMMemcpy,
    clEnqueueSVMMigrateMem, clEnqueueSVMUnmap, clSVMAlloc, clSVMFree, clSetKernelArgSVMPointer,
    clSetKernelExecInfo,
};

const CL_PLATFORM_NOT_FOUND_KHR: i32 = -1001;

/// # Safety
/// Standard `clIcdGetPlatformIDsKHR` contract.
#[no_mangle]
pub unsafe extern "C" fn clIcdGetPlatformIDsKHR(
    num_entries: u32,
    platforms: *mut *mut c_void,
    num_platforms: *mut u32,
) -> i32 {
    if !rt::available() {
        if !num_platforms.is_null() {
            // SAFETY: caller-provided output.
            unsafe { *num_platforms = 0 };
        }
        return CL_PLATFORM_NOT_FOUND_KHR;
    }
    // SAFETY: same contract as clGetPlatformIDs.
    let ret = unsafe { stubs::clGetPlatformIDs(num_entries, platforms, num_platforms) };
    if ret == CL_SUCCESS {
        ret
    } else {
        CL_PLATFORM_NOT_FOUND_KHR
    }
}

fn lookup(name: *const c_char) -> *mut c_void {
    if name.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: NUL-terminated by contract.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    match name.as_ref() {
        "clIcdGetPlatformIDsKHR" => clIcdGetPlatformIDsKHR as *mut c_void,
        n => crate::function_address(n).unwrap_or(std::ptr::null_mut()),
    }
}

/// # Safety
/// Standard contract; `func_name` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn clGetExtensionFunctionAddress(func_name: *const c_char) -> *mut c_void {
    lookup(func_name)
}

/// # Safety
/// Standard contract; `func_name` is NUL-terminated.
pub unsafe extern "C" fn clGetExtensionFunctionAddressForPlatform(
    _platform: *mut c_void,
    func_name: *const c_char,
) -> *mut c_void {
    lookup(func_name)
}

/// # Safety
/// No arguments.
pub unsafe extern "C" fn clUnloadCompiler() -> i32 {
    CL_SUCCESS
}

// ---- Map and unmap ------------------------------------------------------------------------

struct Mapping {
    mem: usize,
    offset: usize,
    size: usize,
    flags: u64,
    /// Image mappings: origin and region, and the pitches handed out.
    image: Option<([usize; 3], [usize; 3], usize, usize)>,
    /// Memory we allocated (not the application's USE_HOST_PTR memory).
    owned: Option<std::alloc::Layout>,
}

fn mappings() -> &'static Mutex<HashMap<usize, Mapping>> {
    static M: OnceLock<Mutex<HashMap<usize, Mapping>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

fn host_memory(
    mem: *mut c_void,
    offset: usize,
    size: usize,
) -> Result<(*mut u8, Option<std::alloc::Layout>), i32> {
    if let Some(s) = shell_ref(mem) {
        let hp = s.host_ptr.load(std::sync::atomic::Ordering::Relaxed);
        if !hp.is_null() {
            // Sub-buffers of USE_HOST_PTR buffers map into the parent's memory; offsets
            // here are relative to this object's host pointer.
            return Ok(((hp as *mut u8).wrapping_add(offset), None));
        }
    }
    let layout =
        std::alloc::Layout::from_size_align(size.max(1), 4096).map_err(|_| CL_INVALID_VALUE)?;
    // SAFETY: layout has non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(CL_OUT_OF_HOST_MEMORY);
    }
    Ok((p, Some(layout)))
}

fn set_err(errcode_ret: *mut i32, e: i32) {
    if !errcode_ret.is_null() {
        // SAFETY: caller-provided output.
        unsafe { *errcode_ret = e };
    }
}

/// # Safety
/// Standard `clEnqueueMapBuffer` contract.
pub unsafe extern "C" fn clEnqueueMapBuffer(
    queue: *mut c_void,
    buffer: *mut c_void,
    blocking: u32,
    flags: u64,
    offset: usize,
    size: usize,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
    errcode_ret: *mut i32,
) -> *mut c_void {
    if crate::direct::placed(buffer) {
        // In the arena: the vendor maps it in place, and the application gets that address.
        // SAFETY: forwarded contract.
        let r = unsafe {
            crate::direct::app_map(
                queue, buffer, blocking, flags, offset, size, nwait, wait, event,
            )
        };
        set_err(errcode_ret, r.err().unwrap_or(CL_SUCCESS));
        return r.map_or(std::ptr::null_mut(), |p| p as *mut c_void);
    }
    let (p, owned) = match host_memory(buffer, offset, size) {
        Ok(v) => v,
        Err(e) => {
            set_err(errcode_ret, e);
            return std::ptr::null_mut();
        }
    };
    let ret = if flags & CL_MAP_WRITE_INVALIDATE_REGION != 0 {
        // SAFETY: forwarded arguments.
        unsafe { stubs::clEnqueueMarkerWithWaitList(queue, nwait, wait, event) }
    } else {
        // SAFETY: p has size writable bytes.
        unsafe {
            stubs::clEnqueueReadBuffer(
                queue,
                buffer,
                CL_TRUE,
                offset,
                size,
                p as *mut c_void,
                nwait,
                wait,
                event,
            )
        }
    };
    if ret != CL_SUCCESS {
        if let Some(l) = owned {
            // SAFETY: allocated above with this layout.
            unsafe { std::alloc::dealloc(p, l) };
        }
        set_err(errcode_ret, ret);
        return std::ptr::null_mut();
    }
    // SAFETY: the event (if any) written by the command above.
    unsafe { crate::infocache::command_type(event, CL_COMMAND_MAP_BUFFER) };
    mappings().lock().unwrap_or_else(|e| e.into_inner()).insert(
        p as usize,
        Mapping {
            mem: buffer as usize,
            offset,
            size,
            flags,
            image: None,
            owned,
        },
    );
    set_err(errcode_ret, CL_SUCCESS);
    p as *mut c_void
}

fn image_size_info(image: *mut c_void, param: u32) -> usize {
    let mut v: usize = 0;
    // SAFETY: 8-byte output.
    unsafe {
        stubs::clGetImageInfo(
            image,
            param,
            8,
            &mut v as *mut usize as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    v
}

/// # Safety
/// Standard `clEnqueueMapImage` contract.
pub unsafe extern "C" fn clEnqueueMapImage(
    queue: *mut c_void,
    image: *mut c_void,
    _blocking: u32,
    flags: u64,
    origin: *const usize,
    region: *const usize,
    row_pitch: *mut usize,
    slice_pitch: *mut usize,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
    errcode_ret: *mut i32,
) -> *mut c_void {
    if origin.is_null() || region.is_null() || row_pitch.is_null() {
        set_err(errcode_ret, CL_INVALID_VALUE);
        return std::ptr::null_mut();
    }
    // SAFETY: 3-element arrays by contract.
    let (o, r) = unsafe {
        (
            [*origin, *origin.add(1), *origin.add(2)],
            [*region, *region.add(1), *region.add(2)],
        )
    };
    let elem = image_size_info(image, CL_IMAGE_ELEMENT_SIZE);
    let row = r[0] * elem;
    let slice = row * r[1].max(1);
    let size = slice * r[2].max(1);
    let (p, owned) = match host_memory(std::ptr::null_mut(), 0, size) {
        Ok(v) => v,
        Err(e) => {
            set_err(errcode_ret, e);
            return std::ptr::null_mut();
        }
    };
    let ret = if flags & CL_MAP_WRITE_INVALIDATE_REGION != 0 {
        // SAFETY: forwarded arguments.
        unsafe { stubs::clEnqueueMarkerWithWaitList(queue, nwait, wait, event) }
    } else {
        // SAFETY: p has size writable bytes laid out with these pitches.
        unsafe {
            stubs::clEnqueueReadImage(
                queue,
                image,
                CL_TRUE,
                origin,
                region,
                row,
                slice,
                p as *mut c_void,
                nwait,
                wait,
                event,
            )
        }
    };
    if ret != CL_SUCCESS {
        if let Some(l) = owned {
            // SAFETY: allocated above with this layout.
            unsafe { std::alloc::dealloc(p, l) };
        }
        set_err(errcode_ret, ret);
        return std::ptr::null_mut();
    }
    // SAFETY: the event (if any) written by the command above.
    unsafe { crate::infocache::command_type(event, CL_COMMAND_MAP_IMAGE) };
    // SAFETY: checked non-null above; slice_pitch may be null for 2D images.
    unsafe {
        *row_pitch = row;
        if !slice_pitch.is_null() {
            *slice_pitch = slice;
        }
    }
    mappings().lock().unwrap_or_else(|e| e.into_inner()).insert(
        p as usize,
        Mapping {
            mem: image as usize,
            offset: 0,
            size,
            flags,
            image: Some((o, r, row, slice)),
            owned,
        },
    );
    set_err(errcode_ret, CL_SUCCESS);
    p as *mut c_void
}

/// # Safety
/// Standard `clEnqueueUnmapMemObject` contract.
pub unsafe extern "C" fn clEnqueueUnmapMemObject(
    queue: *mut c_void,
    memobj: *mut c_void,
    mapped_ptr: *mut c_void,
    nwait: u32,
    wait: *const *mut c_void,
    event: *mut *mut c_void,
) -> i32 {
    let m = {
        let mut map = mappings().lock().unwrap_or_else(|e| e.into_inner());
        match map.get(&(mapped_ptr as usize)) {
            Some(m) if m.mem == memobj as usize => map.remove(&(mapped_ptr as usize)),
            _ => None,
        }
    };
    let Some(m) = m else {
        if crate::direct::placed(memobj) {
            // SAFETY: forwarded contract.
            return unsafe {
                crate::direct::app_unmap(queue, memobj, mapped_ptr, nwait, wait, event)
            };
        }
        return CL_INVALID_VALUE;
    };
    let writes = m.flags & (CL_MAP_WRITE | CL_MAP_WRITE_INVALIDATE_REGION) != 0;
    let ret = match (writes, m.image) {
        // SAFETY: forwarded arguments; the mapping's memory is still ours.
        (true, None) => unsafe {
            stubs::clEnqueueWriteBuffer(
                queue, memobj, CL_TRUE, m.offset, m.size, mapped_ptr, nwait, wait, event,
            )
        },
        // SAFETY: as above.
        (true, Some((o, r, row, slice))) => unsafe {
            stubs::clEnqueueWriteImage(
                queue,
                memobj,
                CL_TRUE,
                o.as_ptr(),
                r.as_ptr(),
                row,
                slice,
                mapped_ptr,
                nwait,
                wait,
                event,
            )
        },
        // SAFETY: as above.
        (false, _) => unsafe { stubs::clEnqueueMarkerWithWaitList(queue, nwait, wait, event) },
    };
    if let Some(l) = m.owned {
        // SAFETY: allocated in map with this layout.
        unsafe { std::alloc::dealloc(mapped_ptr as *mut u8, l) };
    }
    if ret == CL_SUCCESS {
        // SAFETY: the event (if any) written by the command above.
        unsafe { crate::infocache::command_type(event, CL_COMMAND_UNMAP_MEM_OBJECT) };
    }
    ret
}

/// CL_PROGRAM_BINARIES: fetch each device's binary into the caller's buffers.
pub fn program_binaries(program: *mut c_void, out: *mut u8, saved: &[u8]) {
    let n = saved.len() / 8;
    let mut sizes = vec![0usize; n];
    // SAFETY: n size_t outputs.
    let ret = unsafe {
        stubs::clGetProgramInfo(
            program,
            CL_PROGRAM_BINARY_SIZES,
            n * 8,
            sizes.as_mut_ptr() as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    for i in 0..n {
        let mut p = [0u8; 8];
        p.copy_from_slice(&saved[i * 8..i * 8 + 8]);
        let dst = u64::from_le_bytes(p) as *mut c_void;
        // Restore the caller's pointer array.
        // SAFETY: out has n pointer slots.
        unsafe { *(out as *mut u64).add(i) = dst as u64 };
        if ret == CL_SUCCESS && !dst.is_null() {
            // SAFETY: the caller sized dst from CL_PROGRAM_BINARY_SIZES.
            unsafe { crate::hiraGetProgramBinary(program, i as u32, sizes[i], dst) };
        }
    }
}

#[allow(dead_code)]
const _: u8 = K_PLATFORM;
