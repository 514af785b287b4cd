//! The tensor maps Hopper's convolutions hand the tensor memory accelerator (`conv_wgmma.rs`,
//! `conv_wgmma_wgrad.rs`): how a copy walks an f32 tensor in global memory and lays its box into
//! shared memory, in 128-byte swizzled rows of 32 channels (the layout the warpgroup MMA reads).
//! The driver encodes each map on the host at every launch; the kernels take them by value.

use std::ffi::c_void;

use cudarc::driver::sys;

use kiln_core::prim::ConvParams;
use kiln_core::Result;

use crate::device::{cu_err, CudaDevice};

/// Channels a copy takes: one 128-byte row of f32.
pub(crate) const CHANNELS: usize = 32;

/// Whether the im2col map can walk the windows of filter `w` (NCHW order) under `p`: its window
/// corners (-padding, padding - reach) are 8-bit for a 4-d tensor, and the taps' offsets (up to
/// the reach) are kept as small; its walk's strides are at most 8.
pub(crate) fn im2col_fits(p: &ConvParams, w: [usize; 4]) -> bool {
    (0..2).all(|i| {
        let reach = (w[2 + i] - 1) * p.dilation[i];
        p.stride[i] <= 8 && p.padding[i] <= 127 && reach <= 127
    })
}

/// The input `x` (NCHW order of a channels-last tensor at `xp`, its pixels `row` elements apart:
/// its channel count when packed, more for a channel slice of a wider tensor) as the im2col map
/// walks it for filter `w` under `p`: dims (C, W, H, N) innermost first; each copy takes CHANNELS
/// channels of `pixels` output pixels' window corners, which step by the stride through the box
/// from (-padding) to (padding - reach) on each side, so one walk covers P x Q pixels per image
/// and goes on into the next image; past the last one, and in the padding, it reads zeros.
pub(crate) fn im2col(
    dev: &CudaDevice,
    p: &ConvParams,
    x: [usize; 4],
    w: [usize; 4],
    xp: u64,
    row: usize,
    pixels: usize,
) -> Result<sys::CUtensorMap> {
    let [n, c, h, wd] = x.map(|d| d as u64);
    let row = row as u64;
    let dims = [c, wd, h, n];
    let strides = [row * 4, wd * row * 4, h * wd * row * 4];
    let reach = |i: usize| ((w[2 + i] - 1) * p.dilation[i]) as i32;
    let (ph, pw) = (p.padding[0] as i32, p.padding[1] as i32);
    let lower = [-pw, -ph];
    let upper = [pw - reach(1), ph - reach(0)];
    let steps = [1, p.stride[1] as u32, p.stride[0] as u32, 1];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    use sys::*;
    // SAFETY: every array has the rank's length (4, 3 strides, 2 corners); the map is 64-byte
    // aligned (cudarc's type); the address is the caller's live buffer
    let r = unsafe {
        cuTensorMapEncodeIm2col(
            &mut map,
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            4,
            xp as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            lower.as_ptr(),
            upper.as_ptr(),
            CHANNELS as u32,
            pixels as u32,
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result()
        .map_err(|e| cu_err("cuTensorMapEncodeIm2col", dev.ordinal, e))?;
    Ok(map)
}

/// A contiguous f32 tensor at `ptr` of `dims` (innermost first, the innermost a multiple of 4) in
/// boxes of `boxes` (the innermost CHANNELS at most): each copy lands one box; past the tensor's
/// edges it reads zeros.
pub(crate) fn tiled<const RANK: usize>(
    dev: &CudaDevice,
    ptr: u64,
    dims: [u64; RANK],
    boxes: [u32; RANK],
) -> Result<sys::CUtensorMap> {
    // the byte strides of the dims past the first
    let mut strides = [0u64; RANK];
    let mut stride = 4;
    for i in 1..RANK {
        stride *= dims[i - 1];
        strides[i - 1] = stride;
    }
    strided(dev, ptr, dims, strides, boxes)
}

/// A matrix of `dims[1]` rows of `dims[0]` f32 at `ptr`, its rows `row` elements apart (`row` at
/// least `dims[0]`, a multiple of 4), in boxes of `boxes` (the innermost CHANNELS at most).
pub(crate) fn matrix(
    dev: &CudaDevice,
    ptr: u64,
    dims: [u64; 2],
    row: usize,
    boxes: [u32; 2],
) -> Result<sys::CUtensorMap> {
    strided(dev, ptr, dims, [row as u64 * 4, 0], boxes)
}

/// `tiled` and `matrix`: the map of an f32 tensor at `ptr` with `dims` (innermost first) whose
/// dims past the first lie `strides` bytes apart (the first RANK - 1 entries).
fn strided<const RANK: usize>(
    dev: &CudaDevice,
    ptr: u64,
    dims: [u64; RANK],
    strides: [u64; RANK],
    boxes: [u32; RANK],
) -> Result<sys::CUtensorMap> {
    let steps = [1u32; RANK];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    use sys::*;
    // SAFETY: the arrays have the rank's length (the driver reads RANK - 1 strides); the map is
    // 64-byte aligned (cudarc's type); the address is the caller's live buffer
    let r = unsafe {
        cuTensorMapEncodeTiled(
            &mut map,
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            RANK as u32,
            ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result()
        .map_err(|e| cu_err("cuTensorMapEncodeTiled", dev.ordinal, e))?;
    Ok(map)
}
