//! Reductions over any set of dims (keepdim), as block reductions: one block per output element,
//! its threads striding over the reduced elements, then a warp-shuffle tree and one shared-memory
//! step across warps. Rows too short to fill a warp are reduced one output per thread instead.
//!
//! Accumulation follows the CPU kernels: float sums and products in double, integer ones wrapping
//! in their own type; max/min propagate NaN.

use std::ffi::c_void;
use std::fmt::Write;
use std::sync::Arc;

use kiln_core::prim::ReduceOp;
use kiln_core::shape::Layout;
use kiln_core::{DType, Result};

use super::{c_type, compute_type, load, store, PRELUDE};
use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;

const R: usize = 8;

/// Kept and reduced dims of the input, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RGeo {
    nout: i64,
    nred: i64,
    kshape: [i64; R],
    kst: [i64; R],
    rshape: [i64; R],
    rst: [i64; R],
    off: i64,
}

const RGEO_C: &str = "struct RGeo { long long nout, nred; long long kshape[8], kst[8], rshape[8], rst[8]; long long off; };\n";

/// Rows shorter than this are reduced by one thread each.
const THREAD_ROW: usize = 32;

fn acc_type(op: ReduceOp, d: DType) -> &'static str {
    match (op, d) {
        (ReduceOp::Sum | ReduceOp::Prod, d) if d.is_float() => "double",
        // warp shuffles move 32-bit words at least; a u8 sum wraps the same way modulo 256
        (_, DType::U8 | DType::Bool) => "int",
        (_, d) => compute_type(d),
    }
}

fn init(op: ReduceOp, d: DType) -> &'static str {
    match (op, d) {
        (ReduceOp::Sum, _) => "0",
        (ReduceOp::Prod, _) => "1",
        (ReduceOp::Max, DType::F64) => "__longlong_as_double(0xfff0000000000000ULL)",
        (ReduceOp::Min, DType::F64) => "__longlong_as_double(0x7ff0000000000000ULL)",
        (ReduceOp::Max, d) if d.is_float() => "__int_as_float(0xff800000)",
        (ReduceOp::Min, d) if d.is_float() => "__int_as_float(0x7f800000)",
        (ReduceOp::Max, DType::I32) => "(-2147483647 - 1)",
        (ReduceOp::Min, DType::I32) => "2147483647",
        (ReduceOp::Max, DType::I64) => "(-9223372036854775807LL - 1)",
        (ReduceOp::Min, DType::I64) => "9223372036854775807LL",
        (ReduceOp::Max, _) => "0",
        (ReduceOp::Min, _) => "255",
    }
}

fn combine(op: ReduceOp, acc: &str) -> String {
    match op {
        ReduceOp::Sum => format!("return ({acc})(a + b);"),
        ReduceOp::Prod => format!("return ({acc})(a * b);"),
        ReduceOp::Max => "return (a != a || (b == b && a >= b)) ? a : b;".into(),
        ReduceOp::Min => "return (a != a || (b == b && a <= b)) ? a : b;".into(),
    }
}

/// Reduces `x` (viewed by `layout`) over `dims` into `out` (contiguous, keepdim shape).
pub(crate) fn launch(
    dev: &Arc<CudaDevice>,
    op: ReduceOp,
    dims: &[usize],
    x: &CudaBuffer,
    layout: &Layout,
    out: &CudaBuffer,
) -> Result<()> {
    let mut g = RGeo {
        off: layout.offset as i64,
        nout: 1,
        nred: 1,
        ..RGeo::default()
    };
    let (mut kr, mut rr) = (0, 0);
    for d in 0..layout.rank() {
        let (s, st) = (layout.shape[d] as i64, layout.strides[d] as i64);
        if dims.contains(&d) {
            g.rshape[rr] = s;
            g.rst[rr] = st;
            g.nred *= s;
            rr += 1;
        } else {
            g.kshape[kr] = s;
            g.kst[kr] = st;
            g.nout *= s;
            kr += 1;
        }
    }
    if g.nout == 0 {
        return Ok(());
    }
    let d = x.dtype;
    let per_thread = (g.nred as usize) < THREAD_ROW;
    let threads: u32 = if per_thread {
        128
    } else {
        (g.nred as usize).next_power_of_two().clamp(32, 256) as u32
    };
    let sig = format!("red:{op:?}:{}:k{kr}:r{rr}:t{}", d.tag(), per_thread as u8);
    let f = crate::nvrtc::kernel(dev, &sig, || source(op, d, kr, rr, per_thread))?;
    let (mut o, mut i) = (out.ptr, x.ptr);
    let mut params: Vec<*mut c_void> = vec![
        (&mut o as *mut u64).cast(),
        (&mut i as *mut u64).cast(),
        (&mut g as *mut RGeo).cast(),
    ];
    let nout = g.nout as usize;
    let grid = if per_thread {
        nout.div_ceil(threads as usize)
    } else {
        nout
    }
    .min(1 << 30) as u32;
    dev.launch(f, grid, threads, 0, &mut params)
}

fn source(op: ReduceOp, d: DType, kr: usize, rr: usize, per_thread: bool) -> String {
    let acc = acc_type(op, d);
    let mut s = String::from(PRELUDE);
    s.push_str(RGEO_C);
    let _ = writeln!(
        s,
        "__device__ __forceinline__ {acc} comb({acc} a, {acc} b) {{ {} }}",
        combine(op, acc)
    );
    // offset of output element o's first input element, and of reduced element r within a row
    let _ = writeln!(s, "__device__ __forceinline__ long long kbase(const RGeo& g, long long o) {{ long long off = g.off;");
    for k in (0..kr).rev() {
        let _ = writeln!(
            s,
            "  off += (o % g.kshape[{k}]) * g.kst[{k}]; o /= g.kshape[{k}];"
        );
    }
    s.push_str("  return off; }\n");
    s.push_str("__device__ __forceinline__ long long roff(const RGeo& g, long long r) { long long off = 0;\n");
    for k in (0..rr).rev() {
        let _ = writeln!(
            s,
            "  off += (r % g.rshape[{k}]) * g.rst[{k}]; r /= g.rshape[{k}];"
        );
    }
    s.push_str("  return off; }\n");
    let load_x = load(d, "x[base + roff(g, r)]");
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void k({}* __restrict__ out, const {}* __restrict__ x, RGeo g) {{",
        c_type(d),
        c_type(d)
    );
    if per_thread {
        let _ = writeln!(
            s,
            "  for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < g.nout; o += (long long)gridDim.x * blockDim.x) {{\n    long long base = kbase(g, o); {acc} a = {};\n    for (long long r = 0; r < g.nred; ++r) a = comb(a, ({acc}){load_x});\n    out[o] = {};\n  }}\n}}",
            init(op, d),
            store(d, "a")
        );
        return s;
    }
    let _ = writeln!(
        s,
        "  __shared__ {acc} part[32];
  for (long long o = blockIdx.x; o < g.nout; o += gridDim.x) {{
    long long base = kbase(g, o);
    {acc} a = {init};
    for (long long r = threadIdx.x; r < g.nred; r += blockDim.x) a = comb(a, ({acc}){load_x});
    for (int m = 16; m > 0; m >>= 1) a = comb(a, __shfl_xor_sync(0xffffffffu, a, m));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) part[warp] = a;
    __syncthreads();
    if (warp == 0) {{
      a = lane < nw ? part[lane] : ({acc}){init};
      for (int m = 16; m > 0; m >>= 1) a = comb(a, __shfl_xor_sync(0xffffffffu, a, m));
      if (lane == 0) out[o] = {st};
    }}
    __syncthreads();
  }}
}}",
        init = init(op, d),
        st = store(d, "a")
    );
    s
}
