//! Runtime-library helpers of the spec's size expressions, server side: the same formulas
//! the guest uses, over validated arguments.

use hira_opencl::cl::*;
use std::ffi::c_void;
use std::sync::OnceLock;

static API: OnceLock<&'static crate::Api> = OnceLock::new();

pub fn set_api(api: &'static crate::Api) {
    let _ = API.set(api);
}

fn arr3(p: *const usize) -> [u64; 3] {
    if p.is_null() {
        return [0; 3];
    }
    // SAFETY: these parameters were decoded as 3-element arrays.
    unsafe { [*p as u64, *p.add(1) as u64, *p.add(2) as u64] }
}

pub fn rect_size(
    origin: *const usize,
    region: *const usize,
    row_pitch: u64,
    slice_pitch: u64,
) -> u64 {
    rect_bytes(arr3(origin), arr3(region), row_pitch, slice_pitch)
}

fn image_elem(image: *mut c_void) -> u64 {
    let Some(f) = API.get().and_then(|a| a.clGetImageInfo) else {
        return 0;
    };
    let mut v: usize = 0;
    // SAFETY: image is a validated handle; 8-byte output.
    let r = unsafe {
        f(
            image,
            CL_IMAGE_ELEMENT_SIZE,
            8,
            &mut v as *mut usize as *mut c_void,
            std::ptr::null_mut(),
        )
    };
    if r == CL_SUCCESS {
        v as u64
    } else {
        0
    }
}

pub fn image_host_size(
    image: *mut c_void,
    region: *const usize,
    row_pitch: u64,
    slice_pitch: u64,
) -> u64 {
    image_host_bytes(image_elem(image), arr3(region), row_pitch, slice_pitch)
}

fn elem_size(format: *const u8) -> u64 {
    if format.is_null() {
        return 0;
    }
    // SAFETY: decoded as 8 bytes (two cl_uints).
    let (o, t) = unsafe {
        (
            std::ptr::read_unaligned(format as *const u32),
            std::ptr::read_unaligned((format as *const u32).add(1)),
        )
    };
    image_element_size(o, t).unwrap_or(0)
}

pub fn image_size(format: *const u8, desc: *const u64) -> u64 {
    if desc.is_null() {
        return 0;
    }
    // SAFETY: decoded as nine u64 words.
    let d = unsafe { std::slice::from_raw_parts(desc, 9) };
    image_desc_bytes(
        d[0] as u32,
        [d[1], d[2], d[3], d[4]],
        d[5],
        d[6],
        elem_size(format),
    )
}

pub fn image2d_size(format: *const u8, w: u64, h: u64, row_pitch: u64) -> u64 {
    image_desc_bytes(
        CL_MEM_OBJECT_IMAGE2D,
        [w, h, 0, 0],
        row_pitch,
        0,
        elem_size(format),
    )
}

pub fn image3d_size(
    format: *const u8,
    w: u64,
    h: u64,
    d: u64,
    row_pitch: u64,
    slice_pitch: u64,
) -> u64 {
    image_desc_bytes(
        CL_MEM_OBJECT_IMAGE3D,
        [w, h, d, 0],
        row_pitch,
        slice_pitch,
        elem_size(format),
    )
}
