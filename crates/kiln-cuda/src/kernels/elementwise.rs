//! Elementwise kernels: unary, binary, where, cast, copies (contiguous, strided, into a strided
//! destination), and the creation prims (full, iota, rand). One generator: a grid-stride loop over
//! the output's elements, each operand addressed through its own strides (or directly when it is
//! contiguous), the op's C expression over the loaded values `x0, x1, x2`.

use std::ffi::c_void;
use std::fmt::Write;
use std::sync::Arc;

use kiln_core::prim::{BinaryOp, RandDist, UnaryOp};
use kiln_core::shape::Layout;
use kiln_core::{DType, Result};

use super::{c_type, compute_type, grid_for, load, math, store, Geo, MAX_RANK, PRELUDE};
use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;

/// What an elementwise kernel computes. Its C expression is written only when a kernel of its
/// signature is first built: a launch formats nothing but the signature it looks the kernel up by.
#[derive(Clone, Copy)]
pub(crate) enum Op {
    Unary(UnaryOp, DType),
    Binary(BinaryOp, DType),
    Where,
    /// Copies and casts (the store converts to the output's dtype).
    Identity,
    Full,
    Iota,
    Rand(RandDist),
}

impl Op {
    /// The op's part of a kernel signature (the operands' and output's dtypes are the rest).
    fn tag(&self, sig: &mut String) {
        let _ = match self {
            Op::Unary(op, _) => write!(sig, "u{op:?}"),
            Op::Binary(op, _) => write!(sig, "b{op:?}"),
            Op::Where => write!(sig, "where"),
            Op::Identity => write!(sig, "id"),
            Op::Full => write!(sig, "full"),
            Op::Iota => write!(sig, "iota"),
            Op::Rand(dist) => write!(sig, "rand{dist:?}"),
        };
    }

    /// The C expression of the loaded operands `x0, x1, x2` (and the arguments `v`, `i`, ...).
    fn expr(&self) -> String {
        match *self {
            Op::Unary(op, d) => unary_expr(op, d),
            Op::Binary(op, d) => binary_expr(op, d),
            Op::Where => "(x0 ? x1 : x2)".into(),
            Op::Identity => "x0".into(),
            Op::Full => "v".into(),
            Op::Iota => "(double)i".into(),
            // the core's counter-based generator (`cpu/random.rs`), bit for bit: splitmix64 of
            // (seed, offset + i), so a device draws the CPU's values for one (seed, offset)
            Op::Rand(RandDist::Uniform) => {
                "(double)(rbits(seed, roff + i) >> 11) * (1.0 / 9007199254740992.0)".into()
            }
            Op::Rand(RandDist::Normal) => "rnormal(rbits(seed, roff + i))".into(),
        }
    }
}

/// Scalar arguments every elementwise kernel takes (unused ones are ignored).
#[derive(Clone, Copy, Default)]
pub(crate) struct Scalars {
    pub value: f64,
    pub seed: u64,
    pub offset: u64,
    /// An operand given by value: `value`, of this dtype, is operand `.0` of the op (a CPU
    /// scalar, `takes_host_scalar`); the launch's buffers are the other operands, in order.
    pub operand: Option<(usize, DType)>,
}

/// One operand slot of a kernel: a buffer (contiguous or addressed through strides) or the
/// launch's `value` argument.
#[derive(Clone, Copy)]
enum Slot {
    Buffer { dtype: DType, contig: bool },
    Value(DType),
}

fn unary_expr(op: UnaryOp, d: DType) -> String {
    let ct = compute_type(d);
    let float = d.is_float();
    let f = |name: &str| format!("{}(x0)", math(d, name));
    match op {
        UnaryOp::Neg if float => "-x0".to_string(),
        UnaryOp::Neg => format!("({ct})(0 - x0)"),
        UnaryOp::Abs if float => f("fabs"),
        UnaryOp::Abs => format!("(x0 < 0 ? ({ct})(0 - x0) : x0)"),
        UnaryOp::Exp => f("exp"),
        UnaryOp::Log => f("log"),
        UnaryOp::Log1p => f("log1p"),
        UnaryOp::Sqrt => f("sqrt"),
        UnaryOp::Sin => f("sin"),
        UnaryOp::Cos => f("cos"),
        UnaryOp::Tanh => f("tanh"),
        UnaryOp::Erf => f("erf"),
        UnaryOp::Floor if float => f("floor"),
        UnaryOp::Floor => "x0".to_string(),
        // NaN keeps its sign's place: sign(NaN) is NaN, as on the CPU
        UnaryOp::Sign => {
            format!("(x0 > 0 ? ({ct})1 : (x0 < 0 ? ({ct})(0 - 1) : (x0 != x0 ? x0 : ({ct})0)))")
        }
        UnaryOp::Recip => format!("(({ct})1 / x0)"),
        UnaryOp::Not => "(u8)(!x0)".to_string(),
    }
}

fn binary_expr(op: BinaryOp, d: DType) -> String {
    let ct = compute_type(d);
    let float = d.is_float();
    match op {
        BinaryOp::Add => format!("({ct})(x0 + x1)"),
        BinaryOp::Sub => format!("({ct})(x0 - x1)"),
        BinaryOp::Mul => format!("({ct})(x0 * x1)"),
        BinaryOp::Div if float => "(x0 / x1)".to_string(),
        // integer division by zero is 0 on the CPU too (no trap)
        BinaryOp::Div => format!("(x1 == 0 ? ({ct})0 : ({ct})(x0 / x1))"),
        BinaryOp::Pow if float => format!("{}(x0, x1)", math(d, "pow")),
        BinaryOp::Pow => format!("ipow<{ct}>(x0, x1)"),
        // NaN in the first operand wins, as in the CPU kernels
        BinaryOp::Max => "((x0 != x0 || x0 >= x1) ? x0 : x1)".to_string(),
        BinaryOp::Min => "((x0 != x0 || x0 <= x1) ? x0 : x1)".to_string(),
        BinaryOp::Eq => "(x0 == x1)".to_string(),
        BinaryOp::Ne => "(x0 != x1)".to_string(),
        BinaryOp::Lt => "(x0 < x1)".to_string(),
        BinaryOp::Le => "(x0 <= x1)".to_string(),
        BinaryOp::Gt => "(x0 > x1)".to_string(),
        BinaryOp::Ge => "(x0 >= x1)".to_string(),
        BinaryOp::And => "(x0 & x1)".to_string(),
        BinaryOp::Or => "(x0 | x1)".to_string(),
    }
}

const HELPERS: &str = r#"
template <typename T> __device__ __forceinline__ T ipow(T a, T b) {
  if ((long long)b < 0) return 0;
  T r = 1; unsigned long long e = (unsigned long long)b;
  while (e) { if (e & 1) r = (T)(r * a); a = (T)(a * a); e >>= 1; }
  return r;
}
__device__ __forceinline__ unsigned long long rmix(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
__device__ __forceinline__ unsigned long long rbits(unsigned long long s, unsigned long long c) {
  return rmix(rmix(s) + c * 0x9e3779b97f4a7c15ULL);
}
__device__ __forceinline__ double rnormal(unsigned long long b) {
  double u1 = ((double)(b >> 32) + 0.5) / 4294967296.0;
  double u2 = (double)(b & 0xffffffffULL) / 4294967296.0;
  return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.141592653589793 * u2);
}
"#;

/// The largest element offset a layout reaches (for the 32-bit indexing decision).
fn max_offset(l: &Layout) -> usize {
    l.offset
        + l.shape
            .iter()
            .zip(&l.strides)
            .map(|(&d, &s)| d.saturating_sub(1) * s)
            .sum::<usize>()
}

/// Merges adjacent dims that every layout in `strided` walks as one (outer stride = inner size x
/// inner stride) and drops size-1 dims; the row-major order of the elements is unchanged, so
/// contiguous operands, indexed by the element number, are unaffected. Returns the merged shape
/// and, per merged dim, the original dim whose strides it takes (its innermost).
fn coalesce(shape: &[usize], strided: &[&Layout]) -> (Vec<usize>, Vec<usize>) {
    let mut merged: Vec<usize> = Vec::new();
    let mut keep: Vec<usize> = Vec::new();
    for d in (0..shape.len()).rev() {
        if shape[d] == 1 {
            continue;
        }
        match (merged.last_mut(), keep.last()) {
            (Some(size), Some(&inner))
                if strided
                    .iter()
                    .all(|l| l.strides[d] == *size * l.strides[inner]) =>
            {
                *size *= shape[d];
            }
            _ => {
                merged.push(shape[d]);
                keep.push(d);
            }
        }
    }
    merged.reverse();
    keep.reverse();
    (merged, keep)
}

/// Runs `op` over `inputs` (each with the output's shape; `scalars.operand` places a by-value
/// operand among them), writing `out` at `out_layout`'s positions (a fresh contiguous buffer, or
/// an `assign` destination).
pub(crate) fn launch(
    dev: &Arc<CudaDevice>,
    op: &Op,
    inputs: &[(&CudaBuffer, &Layout)],
    out: &CudaBuffer,
    out_layout: &Layout,
    scalars: Scalars,
) -> Result<()> {
    let n = out_layout.numel();
    if n == 0 {
        return Ok(());
    }
    // the op's operands in order: each buffer, with the by-value operand in its place
    let mut slots: Vec<(Slot, Option<&Layout>, u64)> = inputs
        .iter()
        .map(|(b, l)| {
            let contig = l.is_contiguous();
            let slot = Slot::Buffer {
                dtype: b.dtype,
                contig,
            };
            (slot, Some(*l), b.ptr)
        })
        .collect();
    if let Some((j, dtype)) = scalars.operand {
        slots.insert(j.min(slots.len()), (Slot::Value(dtype), None, 0));
    }
    let out_contig = out_layout.is_contiguous();
    // the strided operands' geometry with mergeable dims merged: fewer divisions per element
    let strided: Vec<&Layout> = slots
        .iter()
        .filter(|(s, _, _)| matches!(s, Slot::Buffer { contig: false, .. }))
        .filter_map(|(_, l, _)| *l)
        .chain((!out_contig).then_some(out_layout))
        .collect();
    let (shape, keep) = coalesce(&out_layout.shape, &strided);
    let rank = shape.len();
    let small = n < (1 << 31)
        && inputs.iter().all(|(_, l)| max_offset(l) < (1 << 31))
        && max_offset(out_layout) < (1 << 31);
    let mut sig = String::with_capacity(48);
    sig.push_str("ew:");
    op.tag(&mut sig);
    let _ = write!(sig, ":{}:r{rank}:{}:", out.dtype.tag(), small as u8);
    for (slot, _, _) in &slots {
        let _ = match slot {
            Slot::Buffer { dtype, contig } => write!(sig, "{}{},", dtype.tag(), *contig as u8),
            Slot::Value(dtype) => write!(sig, "{}v,", dtype.tag()),
        };
    }
    let _ = write!(sig, "o{}", out_contig as u8);
    let f = crate::nvrtc::kernel(dev, &sig, || {
        let kinds: Vec<Slot> = slots.iter().map(|(s, _, _)| *s).collect();
        source(op, &kinds, out.dtype, out_contig, rank, small)
    })?;
    let mut geo = Geo {
        n: n as i64,
        ..Geo::default()
    };
    for (d, &s) in shape.iter().enumerate() {
        geo.shape[d] = s as i64;
    }
    let layouts = slots
        .iter()
        .map(|(_, l, _)| *l)
        .chain(std::iter::once(Some(out_layout)));
    for (j, l) in layouts.enumerate() {
        let Some(l) = l else { continue };
        let j = if j == slots.len() { 3 } else { j };
        geo.off[j] = l.offset as i64;
        // a merged dim's stride is its innermost original dim's
        for (d, &orig) in keep.iter().enumerate() {
            geo.st[j][d] = l.strides[orig] as i64;
        }
    }
    let mut ptrs: Vec<u64> = Vec::with_capacity(4);
    ptrs.push(out.ptr);
    ptrs.extend(slots.iter().map(|(_, _, p)| *p));
    let Scalars {
        mut value,
        mut seed,
        mut offset,
        ..
    } = scalars;
    let mut params: Vec<*mut c_void> = ptrs
        .iter_mut()
        .map(|p| (p as *mut u64).cast::<c_void>())
        .collect();
    params.push((&mut geo as *mut Geo).cast());
    params.push((&mut value as *mut f64).cast());
    params.push((&mut seed as *mut u64).cast());
    params.push((&mut offset as *mut u64).cast());
    let (grid, block) = grid_for(n, dev.sm_count);
    dev.launch(f, grid, block, 0, &mut params)
}

fn source(
    op: &Op,
    slots: &[Slot],
    out: DType,
    out_contig: bool,
    rank: usize,
    small: bool,
) -> String {
    let idx = if small {
        "unsigned int"
    } else {
        "unsigned long long"
    };
    let mut s = String::from(PRELUDE);
    s.push_str(HELPERS);
    let _ = write!(
        s,
        "extern \"C\" __global__ void k({}* __restrict__ out",
        c_type(out)
    );
    for (j, slot) in slots.iter().enumerate() {
        let d = match slot {
            Slot::Buffer { dtype, .. } | Slot::Value(dtype) => *dtype,
        };
        // a by-value operand keeps its (null) pointer slot: one parameter list for every kernel
        let _ = write!(s, ", const {}* __restrict__ in{j}", c_type(d));
    }
    s.push_str(", Geo g, double v, unsigned long long seed, unsigned long long roff) {\n");
    let _ = writeln!(s, "  typedef {idx} idx;");
    s.push_str("  for (unsigned long long i0 = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i0 < (unsigned long long)g.n; i0 += (unsigned long long)gridDim.x * blockDim.x) {\n");
    s.push_str("    idx i = (idx)i0;\n");
    // operand slots addressed by strides: inputs that are not contiguous, and a strided output
    let mut strided: Vec<usize> = (0..slots.len())
        .filter(|&j| matches!(slots[j], Slot::Buffer { contig: false, .. }))
        .collect();
    if !out_contig {
        strided.push(3);
    }
    for (j, slot) in slots.iter().enumerate() {
        match slot {
            Slot::Buffer { contig: true, .. } => {
                let _ = writeln!(s, "    idx o{j} = (idx)g.off[{j}] + i;");
            }
            Slot::Buffer { contig: false, .. } => {
                let _ = writeln!(s, "    idx o{j} = (idx)g.off[{j}];");
            }
            Slot::Value(_) => {}
        }
    }
    if out_contig {
        s.push_str("    idx o3 = (idx)g.off[3] + i;\n");
    } else {
        s.push_str("    idx o3 = (idx)g.off[3];\n");
    }
    if !strided.is_empty() && rank > 0 {
        s.push_str("    { idx r = i;\n");
        for d in (0..rank.min(MAX_RANK)).rev() {
            if d == 0 {
                // the outermost coordinate is what is left (i < n): no division
                s.push_str("      { idx c = r;");
            } else {
                let _ = write!(
                    s,
                    "      {{ idx c = r % (idx)g.shape[{d}]; r /= (idx)g.shape[{d}];"
                );
            }
            for &j in &strided {
                let _ = write!(s, " o{j} += c * (idx)g.st[{j}][{d}];");
            }
            s.push_str(" }\n");
        }
        s.push_str("    }\n");
    }
    for (j, slot) in slots.iter().enumerate() {
        let _ = match slot {
            Slot::Buffer { dtype, .. } => writeln!(
                s,
                "    {} x{j} = {};",
                compute_type(*dtype),
                load(*dtype, &format!("in{j}[o{j}]"))
            ),
            // the host rounded `v` to the operand's dtype: the conversion is exact
            Slot::Value(dtype) => {
                writeln!(s, "    {ct} x{j} = ({ct})v;", ct = compute_type(*dtype))
            }
        };
    }
    let _ = writeln!(s, "    out[o3] = {};", store(out, &op.expr()));
    s.push_str("  }\n}\n");
    s
}

/// A contiguous copy of the elements `layout` addresses in `buf`.
pub(crate) fn copy_strided(
    dev: &Arc<CudaDevice>,
    buf: &CudaBuffer,
    layout: &Layout,
) -> Result<CudaBuffer> {
    let out = dev.alloc(layout.numel(), buf.dtype)?;
    let dst = Layout::contiguous(&layout.shape);
    launch(
        dev,
        &Op::Identity,
        &[(buf, layout)],
        &out,
        &dst,
        Scalars::default(),
    )?;
    Ok(out)
}
