//! How each prim lowers to the loop IR: pointwise prims become expressions evaluated at an index,
//! movement prims become index maps (a read of the input at a transformed index), reductions become
//! loops with an accumulator, and everything else stays an extern call into the core's kernels.

use kiln_core::prim::{BinaryOp, Prim, ReduceOp, UnaryOp};
use kiln_core::DType;

use super::index::{Extents, Ix};
use kiln_compile::graph::{Graph, Node, Op};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A graph input: a buffer.
    Input,
    /// An elementwise computation, inlined into the kernels that read it.
    Pointwise,
    /// A view: reading it reads its operand at another index.
    Movement,
    /// A value with no operands (full, iota): inlined as an expression of the index.
    Constant,
    /// A loop with an accumulator, producing a buffer (a `Reduce`, or a small `Matmul` generated
    /// as a sum over k: `small_matmul`).
    Reduction,
    /// Run by the core's kernels (matmul, conv, gather, random, unsupported dtypes, ...).
    Extern,
}

/// Dtypes the C generator handles (the 16-bit floats stay on the core's kernels for now).
pub fn c_dtype(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::I32 => "int32_t",
        DType::I64 => "int64_t",
        DType::U8 | DType::Bool => "uint8_t",
        DType::F16 | DType::BF16 => return None,
    })
}

/// The sizes of a `Matmul([B,M,K] x [B,K,N])`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    pub b: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// The sizes of a matmul node, when it is one a generated kernel can compute: f32 or f64 (integer
/// matmuls would accumulate in a double and lose bits; 16-bit floats stay on the core's kernels).
pub fn matmul_dims(g: &Graph, n: &Node) -> Option<MatmulDims> {
    if !matches!(n.op, Op::Prim(Prim::Matmul)) || !matches!(n.dtype, DType::F32 | DType::F64) {
        return None;
    }
    let (a, b) = (
        &g.nodes[*n.args.first()?].shape,
        &g.nodes[*n.args.get(1)?].shape,
    );
    match (a.as_slice(), b.as_slice()) {
        (&[bs, m, k], &[_, _, nn]) => Some(MatmulDims { b: bs, m, n: nn, k }),
        _ => None,
    }
}

/// Longest reduced length of a generated matmul on a GPU: a thread (or a warp) walks it alone.
const SMALL_MATMUL_K: usize = 64;
/// Most multiply-adds of a generated matmul on a GPU.
const SMALL_MATMUL_MACS: usize = 1 << 16;

/// Whether a matmul on a GPU is small enough to be generated inline (a sum over k of
/// `a[b,m,k]·b[b,k,n]`, its operands' producers fused into the loads) rather than sent to
/// cuBLAS. A generated loop does no tiling, no register blocking and no shared-memory staging,
/// and every operand element is loaded (and its fused producers recomputed) once per output it
/// contributes to: good only where the whole product is a few thousand multiply-adds, which a
/// library call costs more to set up (a launch of a few µs) than to run. At 2^16 multiply-adds (a
/// 40x40x40 product) cuBLAS starts to pay, and K ≤ 64 keeps a thread's serial loop short.
pub fn small_matmul(d: MatmulDims) -> bool {
    d.k <= SMALL_MATMUL_K && d.b * d.m * d.n * d.k <= SMALL_MATMUL_MACS
}

/// Whether a matmul on the CPU is generated inline: `kiln_core::prim::small_cpu_matmul`, the
/// products whose order the eager kernel shares (so the generated one equals it bit for bit).
pub fn small_cpu_matmul(d: MatmulDims) -> bool {
    kiln_core::prim::small_cpu_matmul(d.b, d.m, d.n, d.k)
}

/// A node's kind, with a matmul the target generates (`inline_matmul`) a reduction.
pub fn kind_with(g: &Graph, n: &Node, inline_matmul: &dyn Fn(MatmulDims) -> bool) -> Kind {
    match matmul_dims(g, n) {
        Some(d) if n.args.iter().all(|&a| g.nodes[a].dtype == n.dtype) && inline_matmul(d) => {
            Kind::Reduction
        }
        _ => kind(g, n),
    }
}

pub fn kind(g: &Graph, n: &Node) -> Kind {
    let Op::Prim(p) = &n.op else {
        return Kind::Input;
    };
    let args_ok = n.args.iter().all(|&a| c_dtype(g.nodes[a].dtype).is_some());
    if c_dtype(n.dtype).is_none() || !args_ok {
        return Kind::Extern;
    }
    let arg_dtype = n.args.first().map(|&a| g.nodes[a].dtype);
    let float_in = arg_dtype.is_some_and(|d| d.is_float());
    match p {
        Prim::Unary(UnaryOp::Not) => Kind::Pointwise,
        Prim::Unary(_) if float_in => Kind::Pointwise,
        Prim::Binary(b) if b.is_logical() => Kind::Pointwise,
        // a comparison is exact on any dtype
        Prim::Binary(b) if b.is_comparison() => Kind::Pointwise,
        // integer sums and products wrap in the core as in `binary_c`'s unsigned arithmetic (a
        // batch norm's step count: its `+ 1` then written in place); C's integer division and
        // powers differ from the core's and are not generated
        Prim::Binary(BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul)
            if wrapping_c(arg_dtype.unwrap_or(n.dtype)).is_some() =>
        {
            Kind::Pointwise
        }
        Prim::Binary(_) if float_in => Kind::Pointwise,
        Prim::Where => Kind::Pointwise,
        // float -> int conversion saturates in Rust and is undefined out of range in C
        Prim::Cast(to) if to.is_float() || *to == DType::Bool || !float_in => Kind::Pointwise,
        Prim::Reshape(_)
        | Prim::Permute(_)
        | Prim::Expand(_)
        | Prim::Slice { .. }
        | Prim::Pad { .. }
        | Prim::Cat { .. }
        | Prim::Contiguous => Kind::Movement,
        Prim::Full { .. } | Prim::Iota { .. } => Kind::Constant,
        // squared deviations are generated in Welford's lane order (`codegen/c_sums.rs`), which
        // a reduction over no dims does not have
        Prim::Reduce {
            op: ReduceOp::SumSqDev,
            dims,
        } if dims.is_empty() => Kind::Extern,
        Prim::Reduce { .. } if float_in => Kind::Reduction,
        _ => Kind::Extern,
    }
}

/// Contiguous (row-major) strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1] as i64;
    }
    s
}

/// The flat offset of `idx` in a contiguous buffer of `shape`.
pub fn linear(idx: &[Ix], shape: &[usize]) -> Ix {
    strides(shape)
        .iter()
        .zip(idx)
        .fold(Ix::constant(0), |acc, (s, i)| acc.add(&i.mul(*s)))
}

/// For a movement prim that is a single index map (all but pad and cat): the operand index read for
/// output index `idx`.
pub fn view_index(
    p: &Prim,
    in_shape: &[usize],
    idx: &[Ix],
    out_shape: &[usize],
    ext: &Extents,
) -> Vec<Ix> {
    match p {
        Prim::Reshape(_) if in_shape.contains(&0) || out_shape.contains(&0) => {
            vec![Ix::constant(0); in_shape.len()] // nothing is read from an empty tensor
        }
        Prim::Reshape(_) => {
            let flat = linear(idx, out_shape);
            strides(in_shape)
                .iter()
                .zip(in_shape)
                .map(|(&s, &n)| flat.div(s, ext).rem(n as i64, ext))
                .collect()
        }
        Prim::Permute(perm) => {
            let mut v = vec![Ix::constant(0); in_shape.len()];
            for (d, &src) in perm.iter().enumerate() {
                v[src] = idx[d].clone();
            }
            v
        }
        Prim::Expand(_) => idx
            .iter()
            .zip(in_shape.iter().zip(out_shape))
            .map(|(i, (&from, &to))| {
                if from == 1 && to != 1 {
                    Ix::constant(0)
                } else {
                    i.clone()
                }
            })
            .collect(),
        Prim::Slice {
            dim, start, step, ..
        } => {
            let mut v = idx.to_vec();
            v[*dim] = idx[*dim].mul(*step as i64).add_const(*start as i64);
            v
        }
        _ => idx.to_vec(), // contiguous
    }
}

pub fn float_literal(v: f64, dtype: DType) -> String {
    if v.is_nan() {
        return "NAN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 {
            "INFINITY".into()
        } else {
            "(-INFINITY)".into()
        };
    }
    match dtype {
        DType::F32 => format!("{:?}f", v as f32),
        DType::F64 => format!("{v:?}"),
        DType::Bool => format!("{}", (v != 0.0) as u8),
        _ => format!("{}", v as i64),
    }
}

fn fsuffix(d: DType) -> &'static str {
    if d == DType::F32 {
        "f"
    } else {
        ""
    }
}

/// C for a unary op on a value `a` of dtype `d`.
pub fn unary_c(op: UnaryOp, a: &str, d: DType) -> String {
    let f = fsuffix(d);
    let ty = c_dtype(d).unwrap_or("double");
    match op {
        UnaryOp::Neg => format!("-{a}"),
        UnaryOp::Abs => format!("fabs{f}({a})"),
        UnaryOp::Exp => format!("exp{f}({a})"),
        UnaryOp::Log => format!("log{f}({a})"),
        UnaryOp::Log1p => format!("log1p{f}({a})"),
        UnaryOp::Sqrt => format!("sqrt{f}({a})"),
        // through names the translation unit's header maps to libmvec where it can (runtime/cc.rs);
        // a pointwise loop calls inline f32 ones where their range allows (codegen/c_trig.rs)
        UnaryOp::Sin => format!("kiln_sin{f}({a})"),
        UnaryOp::Cos => format!("kiln_cos{f}({a})"),
        UnaryOp::Tanh => format!("tanh{f}({a})"),
        UnaryOp::Erf => format!("erf{f}({a})"),
        UnaryOp::Floor => format!("floor{f}({a})"),
        UnaryOp::Sign => format!("({ty})(({a} > 0) - ({a} < 0))"),
        UnaryOp::Recip => format!("(({ty})1 / {a})"),
        UnaryOp::Not => format!("(uint8_t)!{a}"),
    }
}

/// The signed and unsigned C types of an integer dtype whose sums and products the generated code
/// computes: in the unsigned type, where C defines them to wrap as the core's do (signed overflow
/// is undefined in C), converted back (two's complement on every compiler kiln drives).
pub(crate) fn wrapping_c(d: DType) -> Option<(&'static str, &'static str)> {
    match d {
        DType::I32 => Some(("int32_t", "uint32_t")),
        DType::I64 => Some(("int64_t", "uint64_t")),
        _ => None,
    }
}

/// C for a binary op on values of dtype `d` (the operands' dtype).
pub fn binary_c(op: BinaryOp, a: &str, b: &str, d: DType) -> String {
    let f = fsuffix(d);
    if let (Some((s, u)), BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul) = (wrapping_c(d), op) {
        let sign = match op {
            BinaryOp::Add => '+',
            BinaryOp::Sub => '-',
            _ => '*',
        };
        return format!("({s})(({u}){a} {sign} ({u}){b})");
    }
    match op {
        BinaryOp::Add => format!("{a} + {b}"),
        BinaryOp::Sub => format!("{a} - {b}"),
        BinaryOp::Mul => format!("{a} * {b}"),
        BinaryOp::Div => format!("{a} / {b}"),
        BinaryOp::Pow => format!("pow{f}({a}, {b})"),
        BinaryOp::Max => format!("((isnan({a}) || {a} >= {b}) ? {a} : {b})"),
        BinaryOp::Min => format!("((isnan({a}) || {a} <= {b}) ? {a} : {b})"),
        BinaryOp::Eq => format!("(uint8_t)({a} == {b})"),
        BinaryOp::Ne => format!("(uint8_t)({a} != {b})"),
        BinaryOp::Lt => format!("(uint8_t)({a} < {b})"),
        BinaryOp::Le => format!("(uint8_t)({a} <= {b})"),
        BinaryOp::Gt => format!("(uint8_t)({a} > {b})"),
        BinaryOp::Ge => format!("(uint8_t)({a} >= {b})"),
        BinaryOp::And => format!("(uint8_t)({a} & {b})"),
        BinaryOp::Or => format!("(uint8_t)({a} | {b})"),
    }
}

/// Accumulator type, initial value, and the combine step `acc = f(acc, v)` of a reduction.
pub fn reduce_c(op: ReduceOp, d: DType) -> (&'static str, String, fn(&str, &str) -> String) {
    let acc_ty = match op {
        ReduceOp::Sum | ReduceOp::Prod | ReduceOp::SumSqDev => "double",
        ReduceOp::Max | ReduceOp::Min => c_dtype(d).unwrap_or("double"),
    };
    match op {
        // squared deviations are a sum of squares; no kernel takes them by this step: the C
        // target writes Welford's update in its lane loops (`codegen/c_sums.rs`), a GPU graph
        // has them as sums (`two_pass.rs`)
        ReduceOp::Sum | ReduceOp::SumSqDev => (acc_ty, "0.0".into(), |acc, v| {
            format!("{acc} + (double){v}")
        }),
        ReduceOp::Prod => (acc_ty, "1.0".into(), |acc, v| {
            format!("{acc} * (double){v}")
        }),
        ReduceOp::Max => (acc_ty, "(-INFINITY)".into(), |acc, v| {
            format!("((isnan({acc}) || (!isnan({v}) && {acc} >= {v})) ? {acc} : {v})")
        }),
        ReduceOp::Min => (acc_ty, "INFINITY".into(), |acc, v| {
            format!("((isnan({acc}) || (!isnan({v}) && {acc} <= {v})) ? {acc} : {v})")
        }),
    }
}
