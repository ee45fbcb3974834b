//! OpenCL constants used by hand-written code (values from the Khronos headers).
#![allow(missing_docs)]

pub const CL_SUCCESS: i32 = 0;
pub const CL_DEVICE_NOT_AVAILABLE: i32 = -2;
pub const CL_MEM_OBJECT_ALLOCATION_FAILURE: i32 = -4;
pub const CL_OUT_OF_RESOURCES: i32 = -5;
pub const CL_OUT_OF_HOST_MEMORY: i32 = -6;
pub const CL_MAP_FAILURE: i32 = -12;
pub const CL_INVALID_VALUE: i32 = -30;
pub const CL_INVALID_PLATFORM: i32 = -32;
pub const CL_INVALID_DEVICE: i32 = -33;
pub const CL_INVALID_CONTEXT: i32 = -34;
pub const CL_INVALID_COMMAND_QUEUE: i32 = -36;
pub const CL_INVALID_HOST_PTR: i32 = -37;
pub const CL_INVALID_MEM_OBJECT: i32 = -38;
pub const CL_INVALID_IMAGE_FORMAT_DESCRIPTOR: i32 = -39;
pub const CL_INVALID_PROGRAM: i32 = -44;
pub const CL_INVALID_KERNEL: i32 = -48;
pub const CL_INVALID_ARG_VALUE: i32 = -50;
pub const CL_INVALID_ARG_SIZE: i32 = -51;
pub const CL_INVALID_EVENT: i32 = -58;
pub const CL_INVALID_OPERATION: i32 = -59;

pub const CL_TRUE: u32 = 1;
pub const CL_FALSE: u32 = 0;
pub const CL_COMPLETE: i32 = 0;

pub const CL_MEM_READ_WRITE: u64 = 1;
pub const CL_MEM_USE_HOST_PTR: u64 = 1 << 3;
pub const CL_MEM_ALLOC_HOST_PTR: u64 = 1 << 4;
pub const CL_MEM_COPY_HOST_PTR: u64 = 1 << 5;

pub const CL_MAP_READ: u64 = 1;
pub const CL_MAP_WRITE: u64 = 2;
pub const CL_MAP_WRITE_INVALIDATE_REGION: u64 = 4;
pub const CL_COMMAND_READ_BUFFER: u32 = 0x11F3;
pub const CL_COMMAND_WRITE_BUFFER: u32 = 0x11F4;
pub const CL_COMMAND_MAP_BUFFER: u32 = 0x11FB;
pub const CL_COMMAND_MAP_IMAGE: u32 = 0x11FC;
pub const CL_COMMAND_UNMAP_MEM_OBJECT: u32 = 0x11FD;
pub const CL_COMMAND_SVM_MAP: u32 = 0x120C;
pub const CL_COMMAND_SVM_UNMAP: u32 = 0x120D;

pub const CL_CONTEXT_PLATFORM: i64 = 0x1084;
pub const CL_QUEUE_PROPERTIES: u64 = 0x1093;
pub const CL_QUEUE_PROFILING_ENABLE: u64 = 1 << 1;

pub const CL_DEVICE_GLOBAL_MEM_SIZE: u32 = 0x101F;
pub const CL_DEVICE_MAX_MEM_ALLOC_SIZE: u32 = 0x1010;
pub const CL_DEVICE_SVM_CAPABILITIES: u32 = 0x1053;
pub const CL_DEVICE_PLATFORM: u32 = 0x1031;

pub const CL_MEM_TYPE: u32 = 0x1100;
pub const CL_MEM_FLAGS: u32 = 0x1101;
pub const CL_MEM_SIZE: u32 = 0x1102;
pub const CL_MEM_HOST_PTR: u32 = 0x1103;
pub const CL_MEM_OFFSET: u32 = 0x1108;
pub const CL_MEM_ASSOCIATED_MEMOBJECT: u32 = 0x1107;

pub const CL_IMAGE_FORMAT: u32 = 0x1110;
pub const CL_IMAGE_ELEMENT_SIZE: u32 = 0x1111;
pub const CL_IMAGE_ROW_PITCH: u32 = 0x1112;
pub const CL_IMAGE_SLICE_PITCH: u32 = 0x1113;

pub const CL_PROGRAM_NUM_DEVICES: u32 = 0x1162;
pub const CL_PROGRAM_BINARY_SIZES: u32 = 0x1165;
pub const CL_PROGRAM_BINARIES: u32 = 0x1166;

pub const CL_PROFILING_COMMAND_START: u32 = 0x1282;
pub const CL_PROFILING_COMMAND_END: u32 = 0x1283;

pub const CL_MEM_OBJECT_BUFFER: u32 = 0x10F0;
pub const CL_MEM_OBJECT_IMAGE2D: u32 = 0x10F1;
pub const CL_MEM_OBJECT_IMAGE3D: u32 = 0x10F2;
pub const CL_MEM_OBJECT_IMAGE2D_ARRAY: u32 = 0x10F3;
pub const CL_MEM_OBJECT_IMAGE1D: u32 = 0x10F4;
pub const CL_MEM_OBJECT_IMAGE1D_ARRAY: u32 = 0x10F5;
pub const CL_MEM_OBJECT_IMAGE1D_BUFFER: u32 = 0x10F6;

/// Bytes per pixel of an image format (`cl_image_format` = {channel order, channel type}),
/// or None for an unknown one.
pub fn image_element_size(order: u32, ty: u32) -> Option<u64> {
    let channels: u64 = match order {
        0x10B0 | 0x10B1 | 0x10B2 | 0x10B8 | 0x10B9 | 0x10BF | 0x10BE => 1, // R A INTENSITY LUMINANCE Rx DEPTH DEPTH_STENCIL
        0x10B3 | 0x10B4 | 0x10BA => 2,                                     // RG RA RGx
        0x10B6 | 0x10BB | 0x10BC => 3,                                     // RGB RGBx sRGB
        0x10B5 | 0x10B7 | 0x10BD | 0x10C0 | 0x10C1 | 0x10C2 | 0x10C3 => 4, // RGBA BGRA ARGB sRGBA sRGBx sBGRA ABGR
        _ => return None,
    };
    let bytes: u64 = match ty {
        0x10D0 | 0x10D2 | 0x10D7 | 0x10DA => 1, // SNORM_INT8 UNORM_INT8 SIGNED_INT8 UNSIGNED_INT8
        0x10D1 | 0x10D3 | 0x10D8 | 0x10DB | 0x10DD => 2, // SNORM_INT16 UNORM_INT16 SIGNED_INT16 UNSIGNED_INT16 HALF_FLOAT
        0x10D9 | 0x10DC | 0x10DE => 4,                   // SIGNED_INT32 UNSIGNED_INT32 FLOAT
        0x10D4 | 0x10D5 => return Some(2),               // UNORM_SHORT_565 / 555: packed
        0x10D6 | 0x10E0 | 0x10E1 => return Some(4),      // UNORM_INT_101010 / 24 / 101010_2: packed
        _ => return None,
    };
    Some(channels * bytes)
}

/// Host bytes a rectangle transfer touches (`clEnqueue{Read,Write}BufferRect`); zero pitches
/// mean tightly packed, as the API defines.
pub fn rect_bytes(origin: [u64; 3], region: [u64; 3], row_pitch: u64, slice_pitch: u64) -> u64 {
    if region.contains(&0) {
        return 0;
    }
    let row = if row_pitch == 0 { region[0] } else { row_pitch };
    let slice = if slice_pitch == 0 {
        row.saturating_mul(region[1])
    } else {
        slice_pitch
    };
    let first = origin[2]
        .saturating_mul(slice)
        .saturating_add(origin[1].saturating_mul(row))
        .saturating_add(origin[0]);
    first
        .saturating_add((region[2] - 1).saturating_mul(slice))
        .saturating_add((region[1] - 1).saturating_mul(row))
        .saturating_add(region[0])
}

/// Host bytes of an image read or write of `region` with `elem`-byte pixels.
pub fn image_host_bytes(elem: u64, region: [u64; 3], row_pitch: u64, slice_pitch: u64) -> u64 {
    if region.contains(&0) {
        return 0;
    }
    let row = if row_pitch == 0 {
        region[0].saturating_mul(elem)
    } else {
        row_pitch
    };
    let slice = if slice_pitch == 0 {
        row.saturating_mul(region[1])
    } else {
        slice_pitch
    };
    (region[2] - 1)
        .saturating_mul(slice)
        .saturating_add((region[1] - 1).saturating_mul(row))
        .saturating_add(region[0].saturating_mul(elem))
}

/// Host bytes behind an image being created from a `cl_image_desc`'s fields.
pub fn image_desc_bytes(
    image_type: u32,
    dims: [u64; 4],
    row_pitch: u64,
    slice_pitch: u64,
    elem: u64,
) -> u64 {
    let [w, h, depth, array] = dims;
    let (h, depth, array) = (h.max(1), depth.max(1), array.max(1));
    let row = if row_pitch == 0 {
        w.saturating_mul(elem)
    } else {
        row_pitch
    };
    let or_slice = |s: u64| if slice_pitch == 0 { s } else { slice_pitch };
    match image_type {
        CL_MEM_OBJECT_IMAGE1D | CL_MEM_OBJECT_IMAGE1D_BUFFER => row,
        CL_MEM_OBJECT_IMAGE2D => row.saturating_mul(h),
        CL_MEM_OBJECT_IMAGE1D_ARRAY => or_slice(row).saturating_mul(array),
        CL_MEM_OBJECT_IMAGE2D_ARRAY => or_slice(row.saturating_mul(h)).saturating_mul(array),
        _ => or_slice(row.saturating_mul(h)).saturating_mul(depth),
    }
}

/// The spec's size helpers over values as they travel on the wire (the router's view of a
/// request): `None` when an argument is missing or not inline.
pub mod wire {
    use super::*;

    /// The bytes of an inline blob.
    pub fn inline<'a>(b: &hira_wire::Blob<'a>) -> Option<&'a [u8]> {
        match *b {
            hira_wire::Blob::Inline(d) => Some(d),
            _ => None,
        }
    }

    /// The handle ids of an inline array of handles (empty when the array is not inline).
    pub fn ids(b: &hira_wire::Blob<'_>) -> Vec<u64> {
        inline(b).map_or_else(Vec::new, |d| {
            d.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                .collect()
        })
    }

    fn u32_at(b: &[u8], i: usize) -> Option<u32> {
        Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?))
    }

    fn u64_at(b: &[u8], i: usize) -> Option<u64> {
        Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
    }

    fn elem(format: Option<&[u8]>) -> Option<u64> {
        let f = format?;
        image_element_size(u32_at(f, 0)?, u32_at(f, 4)?)
    }

    /// Bytes of an image created from a wire `cl_image_format` and `cl_image_desc`.
    pub fn image_size(format: Option<&[u8]>, desc: Option<&[u8]>) -> Option<u64> {
        let d = desc?;
        let dims = [
            u64_at(d, 8)?,
            u64_at(d, 16)?,
            u64_at(d, 24)?,
            u64_at(d, 32)?,
        ];
        Some(image_desc_bytes(
            u32_at(d, 0)?,
            dims,
            u64_at(d, 40)?,
            u64_at(d, 48)?,
            elem(format)?,
        ))
    }

    pub fn image2d_size(format: Option<&[u8]>, w: u64, h: u64, row_pitch: u64) -> Option<u64> {
        Some(image_desc_bytes(
            CL_MEM_OBJECT_IMAGE2D,
            [w, h, 0, 0],
            row_pitch,
            0,
            elem(format)?,
        ))
    }

    pub fn image3d_size(
        format: Option<&[u8]>,
        w: u64,
        h: u64,
        d: u64,
        row_pitch: u64,
        slice_pitch: u64,
    ) -> Option<u64> {
        Some(image_desc_bytes(
            CL_MEM_OBJECT_IMAGE3D,
            [w, h, d, 0],
            row_pitch,
            slice_pitch,
            elem(format)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_rectangle_is_its_volume() {
        assert_eq!(rect_bytes([0; 3], [4, 3, 2], 0, 0), 24);
    }

    #[test]
    fn rectangle_with_origin_and_pitches_reaches_its_last_byte() {
        assert_eq!(
            rect_bytes([1, 1, 1], [2, 2, 2], 8, 32),
            32 + 8 + 1 + 32 + 8 + 2
        );
    }

    #[test]
    fn image_sizes_follow_the_descriptor() {
        assert_eq!(
            image_desc_bytes(CL_MEM_OBJECT_IMAGE2D, [16, 8, 0, 0], 0, 0, 4),
            512
        );
        assert_eq!(image_host_bytes(4, [16, 8, 1], 0, 0), 512);
        assert_eq!(image_element_size(0x10B5, 0x10DE), Some(16));
    }
}
