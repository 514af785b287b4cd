//! Reductions over any set of dims (keepdim), as block reductions: one block per output element,
//! its threads striding over the reduced elements, then a warp-shuffle tree and one shared-memory
//! step across warps. Rows too short to fill a warp are reduced one output per thread instead.
//!
//! Accumulation follows the CPU kernels: float sums and products in double, integer ones wrapping
//! in their own type; max/min propagate NaN.

use std::ffi::c_void;
use std::fmt::Write;
use std::sync::Arc;

use kiln_core::device::ReduceSplit;
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

/// The dtype a reduction accumulates in (and a split reduction keeps its partials in): sums
/// and products of floats in f64, everything of u8/bool in i32 (warp shuffles move 32-bit words
/// at least; a u8 sum wraps the same way modulo 256), the rest in the compute dtype.
fn acc_dtype(op: ReduceOp, d: DType) -> DType {
    match (op, d) {
        (ReduceOp::Sum | ReduceOp::Prod, d) if d.is_float() => DType::F64,
        (_, DType::U8 | DType::Bool) => DType::I32,
        (_, DType::F16 | DType::BF16) => DType::F32,
        (_, d) => d,
    }
}

fn acc_type(op: ReduceOp, d: DType) -> &'static str {
    compute_type(acc_dtype(op, d))
}

// `ReduceOp::SumSqDev` never comes here: the runtime computes it as sums
// (`kiln_core::ops::reduce::sum_sq_dev_with`, its moment sums by `launch_f64_sum`), and `launch`
// refuses it.
fn init(op: ReduceOp, d: DType) -> &'static str {
    match (op, d) {
        (ReduceOp::Sum | ReduceOp::SumSqDev, _) => "0",
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
        ReduceOp::Sum | ReduceOp::SumSqDev => format!("return ({acc})(a + b);"),
        ReduceOp::Prod => format!("return ({acc})(a * b);"),
        ReduceOp::Max => "return (a != a || (b == b && a >= b)) ? a : b;".into(),
        ReduceOp::Min => "return (a != a || (b == b && a <= b)) ? a : b;".into(),
    }
}

/// Kept and reduced dims of `layout` (`dims` reduced), each run of neighbouring dims of one kind
/// whose strides let them be walked as one merged into one: a batch norm's `[N, C, H, W]` sum over
/// `[0, 2, 3]` walks `[N, H·W]`, two index divisions per element instead of three.
fn geometry(layout: &Layout, dims: &[usize]) -> (RGeo, usize, usize) {
    let mut g = RGeo {
        off: layout.offset as i64,
        nout: 1,
        nred: 1,
        ..RGeo::default()
    };
    let (mut kr, mut rr) = (0usize, 0usize);
    let mut last: Option<bool> = None;
    for d in 0..layout.rank() {
        let (s, st) = (layout.shape[d] as i64, layout.strides[d] as i64);
        let reduced = dims.contains(&d);
        if s == 1 {
            // a unit dim moves nothing: leave it out (and keep the neighbours mergeable)
            continue;
        }
        let (shape, strides, n) = match reduced {
            true => (&mut g.rshape, &mut g.rst, &mut rr),
            false => (&mut g.kshape, &mut g.kst, &mut kr),
        };
        if last == Some(reduced) && *n > 0 && strides[*n - 1] == s * st {
            shape[*n - 1] *= s;
            strides[*n - 1] = st;
        } else {
            shape[*n] = s;
            strides[*n] = st;
            *n += 1;
        }
        last = Some(reduced);
        match reduced {
            true => g.nred *= s,
            false => g.nout *= s,
        }
    }
    (g, kr, rr)
}

/// Reduces `x` (viewed by `layout`) over `dims` into `out` (contiguous, keepdim shape).
///
/// A few long rows (batch norm's per-channel sums, a full sum) would leave most of the device
/// idle with a block per row, so they go in two passes: blocks reduce fixed chunks of each row into
/// partials kept in the accumulator's type, then one thread per row combines its partials in
/// chunk order. The chunking depends only on the shapes and the device, so results do not vary
/// from run to run.
pub(crate) fn launch(
    dev: &Arc<CudaDevice>,
    op: ReduceOp,
    dims: &[usize],
    x: &CudaBuffer,
    layout: &Layout,
    out: &CudaBuffer,
) -> Result<()> {
    launch_with(dev, op, Term::Value, dims, x, layout, out)
}

/// A float `x`'s sum over `dims` (`Term::Value`) or sum of squares (`Term::Square`), each value
/// widened to f64 before it is squared and added, into `out` (f64, contiguous, keepdim shape):
/// what `x.to_dtype(F64)`, its square and a sum compute, added in the same order (the sum's
/// chunks and threads walk the reduced elements alike whatever the operand's dtype), without
/// writing either. Squared deviations' moment sums (`kiln_core::ops::reduce::sum_sq_dev_with`).
pub(crate) fn launch_f64_sum(
    dev: &Arc<CudaDevice>,
    term: Term,
    dims: &[usize],
    x: &CudaBuffer,
    layout: &Layout,
    out: &CudaBuffer,
) -> Result<()> {
    if !x.dtype.is_float() || out.dtype != DType::F64 {
        return Err(kiln_core::Error::arg(
            "reduce",
            format!(
                "f64 moment sums take a float operand into f64, not {} into {}",
                x.dtype, out.dtype
            ),
        ));
    }
    launch_with(dev, ReduceOp::Sum, term, dims, x, layout, out)
}

/// What a sum adds for each element: its value, or its square (in the accumulator's type).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Term {
    Value,
    Square,
}

fn launch_with(
    dev: &Arc<CudaDevice>,
    op: ReduceOp,
    term: Term,
    dims: &[usize],
    x: &CudaBuffer,
    layout: &Layout,
    out: &CudaBuffer,
) -> Result<()> {
    if op == ReduceOp::SumSqDev {
        return Err(kiln_core::Error::arg(
            "reduce",
            "squared deviations have no CUDA kernel (the runtime computes them as two sums)",
        ));
    }
    let (mut g, kr, rr) = geometry(layout, dims);
    if g.nout == 0 {
        return Ok(());
    }
    let d = x.dtype;
    let (nout, nred) = (g.nout as usize, g.nred as usize);
    let narrow = nred <= i32::MAX as usize;
    // `ReduceSplit`'s most chunks, the last one shorter (an eager kernel bounds-checks its chunks)
    let chunks = ReduceSplit::for_gpu(dev.sm_count)
        .most_chunks(nout, nred)
        .map_or(1, |c| c.max(1));
    let per_thread = nred < THREAD_ROW;
    let threads: u32 = if per_thread {
        128
    } else {
        nred.next_power_of_two().clamp(32, 256) as u32
    };
    let kind = Kind {
        op,
        d,
        out: out.dtype,
        term,
        kr,
        rr,
        narrow,
    };
    if chunks > 1 {
        let chunk = nred.div_ceil(chunks) as i64;
        let partials = dev.alloc(nout * chunks, acc_dtype(op, d))?;
        let sig = format!("{}:part", kind.sig());
        let f = crate::nvrtc::kernel(dev, &sig, || source(&kind, Pass::Partial))?;
        let (mut o, mut i, mut c, mut n) = (partials.ptr, x.ptr, chunk, chunks as i64);
        let mut params: Vec<*mut c_void> = vec![
            (&mut o as *mut u64).cast(),
            (&mut i as *mut u64).cast(),
            (&mut g as *mut RGeo).cast(),
            (&mut c as *mut i64).cast(),
            (&mut n as *mut i64).cast(),
        ];
        let grid = (nout * chunks).min(1 << 30) as u32;
        dev.launch(f, grid, 256, 0, &mut params)?;
        let sig = format!("{}:fin", kind.sig());
        let f = crate::nvrtc::kernel(dev, &sig, || source(&kind, Pass::Finish))?;
        let (mut o, mut p, mut rows) = (out.ptr, partials.ptr, g.nout);
        let mut params: Vec<*mut c_void> = vec![
            (&mut o as *mut u64).cast(),
            (&mut p as *mut u64).cast(),
            (&mut rows as *mut i64).cast(),
            (&mut n as *mut i64).cast(),
        ];
        let grid = nout.div_ceil(128).min(1 << 30) as u32;
        // the partials go back to the pool after the launch is queued: the stream orders their
        // reuse after this kernel
        return dev.launch(f, grid, 128, 0, &mut params);
    }
    let pass = match per_thread {
        true => Pass::PerThread,
        false => Pass::Block,
    };
    let sig = format!("{}:{}", kind.sig(), per_thread as u8);
    let f = crate::nvrtc::kernel(dev, &sig, || source(&kind, pass))?;
    let (mut o, mut i) = (out.ptr, x.ptr);
    let mut params: Vec<*mut c_void> = vec![
        (&mut o as *mut u64).cast(),
        (&mut i as *mut u64).cast(),
        (&mut g as *mut RGeo).cast(),
    ];
    let grid = if per_thread {
        nout.div_ceil(threads as usize)
    } else {
        nout
    }
    .min(1 << 30) as u32;
    dev.launch(f, grid, threads, 0, &mut params)
}

/// What a reduction kernel's code depends on.
struct Kind {
    op: ReduceOp,
    /// The operand's dtype, and the output's: the operand's, or the accumulator's
    /// (`launch_f64_sum`).
    d: DType,
    out: DType,
    term: Term,
    kr: usize,
    rr: usize,
    /// Reduced element numbers fit 32 bits: the index divisions are 32-bit ones.
    narrow: bool,
}

impl Kind {
    fn sig(&self) -> String {
        format!(
            "red:{:?}:{}:{}:{:?}:k{}:r{}:n{}",
            self.op,
            self.d.tag(),
            self.out.tag(),
            self.term,
            self.kr,
            self.rr,
            self.narrow as u8
        )
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Pass {
    /// One thread per output element.
    PerThread,
    /// One block per output element.
    Block,
    /// One block per (output element, chunk), into partials.
    Partial,
    /// One thread per output element over its partials, in chunk order.
    Finish,
}

fn source(k: &Kind, pass: Pass) -> String {
    let (op, d) = (k.op, k.d);
    let acc = acc_type(op, d);
    let mut s = String::from(PRELUDE);
    s.push_str(RGEO_C);
    let _ = writeln!(
        s,
        "__device__ __forceinline__ {acc} comb({acc} a, {acc} b) {{ {} }}",
        combine(op, acc)
    );
    // what each element adds (no FMA: NVRTC compiles with --fmad=false)
    let _ = writeln!(
        s,
        "__device__ __forceinline__ {acc} term({acc} v) {{ return {}; }}",
        match k.term {
            Term::Value => "v",
            Term::Square => "v * v",
        }
    );
    let init = init(op, d);
    // the output in the operand's dtype, or in the accumulator's
    let (out_c, store_a) = match k.out == d {
        true => (c_type(d), store(d, "a")),
        false => (acc, "a".to_string()),
    };
    if pass == Pass::Finish {
        let _ = writeln!(
            s,
            "extern \"C\" __global__ void k({out_c}* __restrict__ out, const {acc}* __restrict__ p, long long nout, long long chunks) {{
  for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < nout; o += (long long)gridDim.x * blockDim.x) {{
    {acc} a = {init};
    for (long long c = 0; c < chunks; ++c) a = comb(a, p[o * chunks + c]);
    out[o] = {store_a};
  }}
}}"
        );
        return s;
    }
    // offset of output element o's first input element, and of reduced element r within a row
    let _ = writeln!(s, "__device__ __forceinline__ long long kbase(const RGeo& g, long long o) {{ long long off = g.off;");
    for j in (0..k.kr).rev() {
        let _ = writeln!(
            s,
            "  off += (o % g.kshape[{j}]) * g.kst[{j}]; o /= g.kshape[{j}];"
        );
    }
    s.push_str("  return off; }\n");
    let it = if k.narrow { "unsigned" } else { "long long" };
    let _ = writeln!(
        s,
        "__device__ __forceinline__ long long roff(const RGeo& g, long long r_) {{ long long off = 0; {it} r = ({it})r_;"
    );
    for j in (0..k.rr).rev() {
        if j == 0 {
            let _ = writeln!(s, "  off += (long long)r * g.rst[0];");
        } else {
            let _ = writeln!(
                s,
                "  off += (long long)(r % ({it})g.rshape[{j}]) * g.rst[{j}]; r /= ({it})g.rshape[{j}];"
            );
        }
    }
    s.push_str("  return off; }\n");
    let load_x = format!("term(({acc}){})", load(d, "x[base + roff(g, r)]"));
    let (out_t, params) = match pass {
        Pass::Partial => (acc, ", long long chunk, long long chunks"),
        _ => (out_c, ""),
    };
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void k({out_t}* __restrict__ out, const {}* __restrict__ x, RGeo g{params}) {{",
        c_type(d)
    );
    if pass == Pass::PerThread {
        let _ = writeln!(
            s,
            "  for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < g.nout; o += (long long)gridDim.x * blockDim.x) {{\n    long long base = kbase(g, o); {acc} a = {init};\n    for (long long r = 0; r < g.nred; ++r) a = comb(a, {load_x});\n    out[o] = {store_a};\n  }}\n}}"
        );
        return s;
    }
    // Block: block b reduces row b; Partial: block b reduces chunk b % chunks of row b / chunks
    let (units, row, lo, hi, st) = match pass {
        Pass::Partial => (
            "g.nout * chunks",
            "b / chunks",
            "(b % chunks) * chunk",
            "min(g.nred, (b % chunks + 1) * chunk)",
            "a".to_string(),
        ),
        _ => ("g.nout", "b", "0", "g.nred", store_a.clone()),
    };
    let _ = writeln!(
        s,
        "  __shared__ {acc} part[32];
  for (long long b = blockIdx.x; b < {units}; b += gridDim.x) {{
    long long base = kbase(g, {row});
    long long hi = {hi};
    {acc} a = {init};
    for (long long r = {lo} + threadIdx.x; r < hi; r += blockDim.x) a = comb(a, {load_x});
    for (int m = 16; m > 0; m >>= 1) a = comb(a, __shfl_xor_sync(0xffffffffu, a, m));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) part[warp] = a;
    __syncthreads();
    if (warp == 0) {{
      a = lane < nw ? part[lane] : ({acc}){init};
      for (int m = 16; m > 0; m >>= 1) a = comb(a, __shfl_xor_sync(0xffffffffu, a, m));
      if (lane == 0) out[b] = {st};
    }}
    __syncthreads();
  }}
}}"
    );
    s
}
