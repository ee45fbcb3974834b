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

/// The `n` bytes a sized argument points to; None for NULL.
fn bytes<'a>(p: *const u8, n: usize) -> Option<&'a [u8]> {
    // SAFETY: the spec sizes this argument (a cl_image_format is 8 bytes, a
    // cl_image_desc 72) and it was checked non-null.
    (!p.is_null()).then(|| unsafe { std::slice::from_raw_parts(p, n) })
}

/// Bytes of host memory behind an image being created.
pub fn image_size(format: *const u8, desc: *const u64) -> u64 {
    wire::image_size(bytes(format, 8), bytes(desc as *const u8, 72)).unwrap_or(0)
}

pub fn image2d_size(format: *const u8, w: u64, h: u64, row_pitch: u64) -> u64 {
    wire::image2d_size(bytes(format, 8), w, h, row_pitch).unwrap_or(0)
}

pub fn image3d_size(
    format: *const u8,
    w: u64,
    h: u64,
    d: u64,
    row_pitch: u64,
    slice_pitch: u64,
) -> u64 {
    wire::image3d_size(bytes(format, 8), w, h, d, row_pitch, slice_pitch).unwrap_or(0)
}
