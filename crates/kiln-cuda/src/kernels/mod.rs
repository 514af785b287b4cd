//! Generated CUDA C kernels, one file per prim family. This file holds what they share: the C types
//! of kiln's dtypes, half-precision conversions (inline PTX, so NVRTC needs no CUDA headers), and
//! the geometry struct that carries shapes and strides to a kernel by value.
//!
//! A kernel is specialized on what changes its code (op, dtypes, rank, which operands are
//! contiguous, whether 32-bit indexing suffices) and takes everything else (sizes, strides,
//! offsets, scalar values) as arguments, so one compiled kernel serves every shape of its signature.

pub(crate) mod argreduce;
pub(crate) mod elementwise;
pub(crate) mod index;
pub(crate) mod movement;
pub(crate) mod reduce;

use kiln_core::DType;

/// Highest rank a generated kernel handles; higher ranks take the host path (`fallback.rs`).
pub(crate) const MAX_RANK: usize = 8;
/// Operand slots in a geometry: up to three inputs (`where`) and the output.
pub(crate) const SLOTS: usize = 4;

/// Shapes and strides, passed to a kernel by value (the layout must match `GEO_C`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct Geo {
    pub n: i64,
    pub shape: [i64; MAX_RANK],
    pub st: [[i64; MAX_RANK]; SLOTS],
    pub off: [i64; SLOTS],
}

pub(crate) const PRELUDE: &str = r#"
#define MAXR 8
struct Geo { long long n; long long shape[MAXR]; long long st[4][MAXR]; long long off[4]; };
typedef unsigned short u16;
typedef unsigned char u8;
__device__ __forceinline__ float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ u16 f2bf(float f) { u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
"#;

/// The C type a buffer of `d` holds.
pub(crate) fn c_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 | DType::BF16 => "u16",
        DType::I32 => "int",
        DType::I64 => "long long",
        DType::U8 | DType::Bool => "u8",
    }
}

/// The C type values of `d` are computed in (half types in float, as the CPU kernels do).
pub(crate) fn compute_type(d: DType) -> &'static str {
    match d {
        DType::F16 | DType::BF16 => "float",
        d => c_type(d),
    }
}

/// A loaded element `x` (of storage type) as its compute type.
pub(crate) fn load(d: DType, x: &str) -> String {
    match d {
        DType::F16 => format!("h2f({x})"),
        DType::BF16 => format!("bf2f({x})"),
        _ => x.to_string(),
    }
}

/// A compute-type value `v` converted for storage in a buffer of `d`.
pub(crate) fn store(d: DType, v: &str) -> String {
    match d {
        DType::F16 => format!("f2h({v})"),
        DType::BF16 => format!("f2bf({v})"),
        DType::Bool => format!("(u8)(({v}) != 0)"),
        d => format!("({})({v})", c_type(d)),
    }
}

/// A C math function for the compute type of `d` (`expf` for float, `exp` for double).
pub(crate) fn math(d: DType, name: &str) -> String {
    match compute_type(d) {
        "float" => format!("{name}f"),
        _ => name.to_string(),
    }
}

/// Threads per block for elementwise work, and a grid that covers `n` with grid-stride loops.
pub(crate) fn grid_for(n: usize, sm_count: u32) -> (u32, u32) {
    let block = 256u32;
    let blocks = n.div_ceil(block as usize).max(1);
    (blocks.min(sm_count as usize * 32) as u32, block)
}
