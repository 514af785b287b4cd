//! The primitive ops. Every high-level op in `ops/` is defined once as a composition of these; eager
//! execution (`cpu/`), autograd (`autograd/vjp.rs`) and the compilers all work on this set alone.
//! Matmul and the conv family are "extern" prims: they stay whole so vendor libraries can run them.
//!
//! Prims are strict so backends stay simple: elementwise prims take operands of one shape and one
//! dtype (the high-level op broadcasts and promotes first), reductions keep their reduced dims.

use crate::shape::{numel, Layout};
use crate::{DType, Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Log1p,
    Sqrt,
    Sin,
    Cos,
    Tanh,
    Erf,
    Floor,
    Sign,
    Recip,
    Not,
}

impl UnaryOp {
    /// Ops that only make sense on floating-point values.
    pub fn float_only(self) -> bool {
        !matches!(
            self,
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Not | UnaryOp::Floor
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    And,
    Or,
}

impl BinaryOp {
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge
        )
    }
    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or)
    }
}

/// Accumulators of a float `ReduceOp::Sum`: its summation order, which every CPU implementation
/// (the eager kernel in `cpu/reduce.rs`, kiln-inductor's generated C) follows so their results
/// are bitwise equal. Element `k` of each run of the innermost reduced dim goes to accumulator
/// `k % SUM_LANES` (f64; every run into the same accumulators, in order), and the accumulators
/// are then folded in halves: `acc[l] += acc[l + h]` for `h = SUM_LANES/2, ..., 2, 1`.
pub const SUM_LANES: usize = 16;

/// A float sum with a single output element over at least `SUM_CHUNKED_FROM` elements is summed
/// in chunks (in parallel, by the eager kernel and by generated C alike), in this order: when the
/// innermost reduced dim's runs are at most `SUM_CHUNK` long, a chunk is `SUM_CHUNK / run` whole
/// runs (the last one fewer); longer runs are cut into pieces of `SUM_CHUNK` elements, each piece a
/// chunk. Each chunk is summed in `SUM_LANES`'s order on its own lanes (a piece's element k into
/// lane k % SUM_LANES); the chunks' sums are added in order, left to right.
pub const SUM_CHUNKED_FROM: usize = 1 << 15;
/// See `SUM_CHUNKED_FROM` (a multiple of `SUM_LANES`).
pub const SUM_CHUNK: usize = 4096;

/// Longest reduced length of a small CPU matmul (`small_cpu_matmul`).
pub const SMALL_CPU_MATMUL_K: usize = 64;
/// Most multiply-adds of a small CPU matmul (`small_cpu_matmul`): a 16x16x16 product.
pub const SMALL_CPU_MATMUL_MACS: usize = 1 << 12;

/// Whether an f32 or f64 `Matmul` of `[b, m, k] x [b, k, n]` on the CPU is small. A small product
/// has one order, which the eager kernel (`cpu/matmul.rs`) and kiln-inductor's generated C
/// (which computes it inline, its operands' producers fused into its loads) both follow, so
/// their results are bitwise equal: each output is the sum, in f64 from 0.0, of the products of
/// the operands' values widened to f64, in order of k, rounded once to the output's type.
/// Larger products go to the `gemm` crate, eager and compiled alike. The bound: a product of
/// 2^12 multiply-adds takes the eager loop a few microseconds, within about a microsecond of
/// gemm's dispatch and packing, while generated inline it costs no call at all; at 2^16 (a
/// 40x40x40 product) the loop takes six times gemm's time (BENCHMARKS.md).
pub fn small_cpu_matmul(b: usize, m: usize, n: usize, k: usize) -> bool {
    k <= SMALL_CPU_MATMUL_K
        && b.saturating_mul(m).saturating_mul(n).saturating_mul(k) <= SMALL_CPU_MATMUL_MACS
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Prod,
    Max,
    Min,
    /// The sum of squared deviations from the mean, `Σ (x - mean(x))²` over the reduced dims
    /// (Welford's M2: a variance is it divided by the count), in one walk over a float operand
    /// (`SqDevState`'s order).
    SumSqDev,
}

/// Welford's running moments: the count, mean and sum of squared deviations (`ReduceOp::SumSqDev`)
/// of the values pushed so far, in f64. Their one order, which every CPU implementation (the
/// eager kernel in `cpu/reduce.rs`, kiln-inductor's generated C) follows so results are bitwise
/// equal, follows `SUM_LANES`'s: each run of the innermost reduced dim is cut into full groups of
/// `SUM_LANES` elements and a shorter tail; element `l` of each full group (every run's, in
/// order) is pushed into lane `l`, element `j` of each run's tail into tail lane `j`; the lanes
/// are then merged in halves (`lane[l] = lane[l].merge(lane[l + h])` for `h = SUM_LANES/2, ...,
/// 1`), the tail lanes likewise, and the tail lanes' result merged into the lanes' last. A
/// single long row goes in `SUM_CHUNKED_FROM`'s chunks, each chunk's result then merged in
/// order, left to right. Every lane has seen as many values (every tail lane in use too: the
/// runs' tails are alike), so a vectorized walk computes the update's `1 / count` once per
/// group, not once per value. One walk reads each value once, where the mean and then the
/// squares around it read it twice; the deviations are taken from the running mean, so there
/// is no cancellation of large squares.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SqDevState {
    pub count: f64,
    pub mean: f64,
    pub m2: f64,
}

impl SqDevState {
    /// Welford's update with one more value (C: `codegen/c_sums.rs` writes the same operations).
    #[inline(always)]
    pub fn push(&mut self, x: f64) {
        self.count += 1.0;
        let inv = 1.0 / self.count;
        let d = x - self.mean;
        self.mean += d * inv;
        self.m2 += d * (x - self.mean);
    }

    /// Chan et al.'s combination of two disjoint parts' moments (an empty part leaves the
    /// other as it is).
    #[inline(always)]
    pub fn merge(self, b: SqDevState) -> SqDevState {
        if b.count == 0.0 {
            return self;
        }
        if self.count == 0.0 {
            return b;
        }
        let count = self.count + b.count;
        let d = b.mean - self.mean;
        SqDevState {
            count,
            mean: self.mean + d * (b.count / count),
            m2: self.m2 + b.m2 + d * d * (self.count * b.count / count),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgReduceOp {
    ArgMax,
    ArgMin,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RandDist {
    /// Uniform on [0, 1).
    Uniform,
    /// Standard normal.
    Normal,
}

/// What a `MatmulEpilogue` applies to `a @ b` before writing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Epilogue {
    /// `+ bias`, one value per output column (a third operand of shape `[N]`).
    pub bias: bool,
    pub act: Activation,
}

/// What a `Conv2dEpilogue` applies to the convolution's result `y` before writing it:
/// `act(y * scale + shift + residual)`, each part optional. `scale` and `shift` hold one value per
/// output channel (operands of shape `[C]`), `residual` is shaped as the output; the operands
/// follow the convolution's two in that order. What a Conv2d's bias (`shift`), an eval-mode batch
/// norm (`scale`, `shift`), a ResNet block's skip connection (`residual`) and a ReLU compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvEpilogue {
    pub scale: bool,
    pub shift: bool,
    pub residual: bool,
    pub act: Activation,
}

impl ConvEpilogue {
    /// How many operands the epilogue adds to the convolution's two.
    pub fn operands(&self) -> usize {
        usize::from(self.scale) + usize::from(self.shift) + usize::from(self.residual)
    }

    /// The epilogue's operands among `rest` (the prim's operands after `x` and `w`): scale,
    /// shift and residual, those it has, in that order — the one place that order is read.
    pub fn split<'a, T>(&self, rest: &'a [T]) -> ConvEpilogueOperands<&'a T> {
        let mut rest = rest.iter();
        let mut take = |present: bool| present.then(|| rest.next()).flatten();
        ConvEpilogueOperands {
            scale: take(self.scale),
            shift: take(self.shift),
            residual: take(self.residual),
        }
    }
}

/// A `Conv2dEpilogue`'s operands after the convolution's two (`ConvEpilogue::split`).
#[derive(Clone, Copy, Debug)]
pub struct ConvEpilogueOperands<T> {
    pub scale: Option<T>,
    pub shift: Option<T>,
    pub residual: Option<T>,
}

/// An activation a matmul or convolution applies to each element of its result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    None,
    /// `where(x <= 0, 0, x)`: the core's `relu`, so NaN passes through.
    Relu,
    /// GELU's tanh approximation, as the core's `gelu_tanh` composes it:
    /// `x * (tanh((x + x * x * x * 0.044715) * sqrt(2 / pi)) + 1) * 0.5`.
    GeluTanh,
}

impl Activation {
    /// `gelu_tanh`'s constants, as its composition writes them.
    pub const GELU_CUBE: f64 = 0.044715;
    pub fn gelu_scale() -> f64 {
        (2.0 / std::f64::consts::PI).sqrt()
    }
}

/// Geometry of a 2-D convolution (NCHW input, OIHW weight).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvParams {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
    /// Operands and result in channels-last order: input `[N, H, W, C]`, weight
    /// `[O, KH, KW, C/groups]`, output `[N, OH, OW, O]` (and the gradients' shapes likewise), each
    /// a tensor like any other. The same convolution as the NCHW form of the same values; the
    /// compiler's layout pass (`kiln-inductor/src/channels_last.rs`) writes it so that a GPU
    /// convolution reads and writes NHWC memory. User code builds the NCHW form.
    pub channels_last: bool,
}

/// The permutation taking an NCHW tensor to channels-last (NHWC) order.
pub const TO_CHANNELS_LAST: [usize; 4] = [0, 2, 3, 1];
/// The permutation taking a channels-last (NHWC) tensor back to NCHW order.
pub const FROM_CHANNELS_LAST: [usize; 4] = [0, 3, 1, 2];

impl Prim {
    /// The geometry of a convolution prim (forward or either gradient).
    pub fn conv_params(&self) -> Option<ConvParams> {
        match self {
            Prim::Conv2d(p) => Some(*p),
            Prim::Conv2dGradInput { params, .. } | Prim::Conv2dGradWeight { params, .. } => {
                Some(*params)
            }
            _ => None,
        }
    }
}

impl ConvParams {
    /// The same convolution in channels-last form.
    pub fn with_channels_last(self) -> ConvParams {
        ConvParams {
            channels_last: true,
            ..self
        }
    }

    /// `shape`, a 4-D operand or result shape in this convolution's order, in NCHW order.
    pub fn nchw(&self, shape: &[usize]) -> Vec<usize> {
        match self.channels_last && shape.len() == 4 {
            true => FROM_CHANNELS_LAST.iter().map(|&d| shape[d]).collect(),
            false => shape.to_vec(),
        }
    }

    /// `shape`, a 4-D shape in NCHW order, in this convolution's order.
    pub fn ordered(&self, shape: &[usize]) -> Vec<usize> {
        match self.channels_last && shape.len() == 4 {
            true => TO_CHANNELS_LAST.iter().map(|&d| shape[d]).collect(),
            false => shape.to_vec(),
        }
    }

    /// Output spatial size for an input size and kernel size along one axis.
    pub fn out_size(&self, axis: usize, input: usize, kernel: usize) -> Option<usize> {
        let span = self.dilation[axis] * (kernel.max(1) - 1) + 1;
        let padded = input + 2 * self.padding[axis];
        if padded < span {
            return None;
        }
        Some((padded - span) / self.stride[axis] + 1)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Prim {
    // elementwise
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// where(cond: bool, a, b)
    Where,
    Cast(DType),
    // reductions (keepdim)
    Reduce {
        op: ReduceOp,
        dims: Vec<usize>,
    },
    ArgReduce {
        op: ArgReduceOp,
        dim: usize,
    },
    // movement (views where the layout allows)
    Reshape(Vec<usize>),
    Permute(Vec<usize>),
    /// Same-rank broadcast of size-1 dims.
    Expand(Vec<usize>),
    Slice {
        dim: usize,
        start: usize,
        end: usize,
        step: usize,
    },
    /// Constant padding, (before, after) per dim.
    Pad {
        pads: Vec<(usize, usize)>,
        value: f64,
    },
    Cat {
        dim: usize,
    },
    /// Materializes a contiguous copy.
    Contiguous,
    // creation
    Full {
        shape: Vec<usize>,
        value: f64,
        dtype: DType,
    },
    Iota {
        n: usize,
        dtype: DType,
    },
    /// Counter-based random numbers: element i is a pure function of (seed, offset + i).
    Rand {
        shape: Vec<usize>,
        dtype: DType,
        dist: RandDist,
        seed: u64,
        offset: u64,
    },
    // indexing
    Gather {
        dim: usize,
    },
    /// scatter_add(self, index, src) along dim, out of place.
    ScatterAdd {
        dim: usize,
    },
    // extern
    /// [B, M, K] x [B, K, N] -> [B, M, N]
    Matmul,
    /// `act(a @ b + bias)`: `[B, M, K] x [B, K, N] (+ [N]) -> [B, M, N]`, the matmul and the
    /// pointwise ops after it as one extern call (cuBLASLt's epilogues on a GPU). Written only by
    /// the compiler (`kiln-inductor/src/epilogue.rs`), after autodiff, in place of the ops it
    /// computes, so it has no derivative; eager execution runs the same matmul and then the
    /// same elementwise ops, so it computes what they compute.
    MatmulEpilogue(Epilogue),
    Conv2d(ConvParams),
    /// `act(conv2d(x, w) * scale + shift + residual)` (`ConvEpilogue`): a convolution and the
    /// pointwise ops after it as one extern call (one cuDNN operation graph on a GPU). Like
    /// `MatmulEpilogue`, written only by the compiler (`kiln-inductor/src/conv_epilogue.rs`) after
    /// autodiff; eager execution runs the convolution and then the same elementwise ops.
    Conv2dEpilogue {
        params: ConvParams,
        epilogue: ConvEpilogue,
    },
    /// (grad_out, weight) -> grad_input of the given input shape
    Conv2dGradInput {
        params: ConvParams,
        input_shape: [usize; 4],
    },
    /// (grad_out, input) -> grad_weight of the given weight shape
    Conv2dGradWeight {
        params: ConvParams,
        weight_shape: [usize; 4],
    },
}

/// Shape and dtype of a prim's output.
#[derive(Clone, Debug, PartialEq)]
pub struct OutMeta {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

fn same_shapes(op: &'static str, shapes: &[&[usize]]) -> Result<()> {
    for s in &shapes[1..] {
        if *s != shapes[0] {
            return Err(Error::shape(
                op,
                format!("operands must have equal shapes, got {:?}", shapes),
            ));
        }
    }
    Ok(())
}

fn same_dtypes(op: &'static str, dtypes: &[DType]) -> Result<()> {
    for d in &dtypes[1..] {
        if *d != dtypes[0] {
            return Err(Error::DTypeMismatch {
                op,
                lhs: dtypes[0],
                rhs: *d,
            });
        }
    }
    Ok(())
}

/// The shape of `[B, M, K] x [B, K, N]`: `[B, M, N]`.
fn batched_product(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    if a.len() != 3 || b.len() != 3 || a[0] != b[0] || a[2] != b[1] {
        return Err(Error::shape(
            op,
            format!("cannot multiply {a:?} by {b:?} (want [B,M,K] x [B,K,N])"),
        ));
    }
    Ok(vec![a[0], a[1], b[2]])
}

fn arity(op: &'static str, n: usize, want: usize) -> Result<()> {
    if n != want {
        return Err(Error::arg(op, format!("expects {want} operands, got {n}")));
    }
    Ok(())
}

impl Prim {
    /// The layout of this prim's output when eager execution makes it a view of its input (the
    /// same storage), `None` when the output is a new buffer. Eager execution and the tracer (which
    /// must know which traced values alias which tensors) both decide views here.
    pub fn view_layout(&self, input: &Layout) -> Option<Layout> {
        match self {
            Prim::Permute(p) => Some(input.permute(p)),
            Prim::Expand(s) => Some(input.expand(s)),
            Prim::Slice {
                dim,
                start,
                end,
                step,
            } => Some(input.slice(*dim, *start, *end, *step)),
            Prim::Reshape(s) => input.reshape_view(s),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Prim::Unary(_) => "unary",
            Prim::Binary(_) => "binary",
            Prim::Where => "where",
            Prim::Cast(_) => "cast",
            Prim::Reduce { .. } => "reduce",
            Prim::ArgReduce { .. } => "arg_reduce",
            Prim::Reshape(_) => "reshape",
            Prim::Permute(_) => "permute",
            Prim::Expand(_) => "expand",
            Prim::Slice { .. } => "slice",
            Prim::Pad { .. } => "pad",
            Prim::Cat { .. } => "cat",
            Prim::Contiguous => "contiguous",
            Prim::Full { .. } => "full",
            Prim::Iota { .. } => "iota",
            Prim::Rand { .. } => "rand",
            Prim::Gather { .. } => "gather",
            Prim::ScatterAdd { .. } => "scatter_add",
            Prim::Matmul => "matmul",
            Prim::MatmulEpilogue(_) => "matmul_epilogue",
            Prim::Conv2d(_) => "conv2d",
            Prim::Conv2dEpilogue { .. } => "conv2d_epilogue",
            Prim::Conv2dGradInput { .. } => "conv2d_grad_input",
            Prim::Conv2dGradWeight { .. } => "conv2d_grad_weight",
        }
    }

    /// True for prims that only reinterpret their input's layout (no data movement in eager).
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Prim::Permute(_) | Prim::Expand(_) | Prim::Slice { .. }
        )
    }

    /// True for prims whose every output element is a function of the operands' elements at
    /// the same (broadcast) index: they commute with broadcasts and layout permutations.
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Prim::Unary(_) | Prim::Binary(_) | Prim::Where | Prim::Cast(_)
        )
    }

    /// Checks operands and computes the output shape and dtype. Eager and traced execution share this,
    /// so a shape error reads the same whether or not the code is compiled.
    pub fn infer(&self, shapes: &[&[usize]], dtypes: &[DType]) -> Result<OutMeta> {
        let op = self.name();
        let n = shapes.len();
        Ok(match self {
            Prim::Unary(u) => {
                arity(op, n, 1)?;
                let d = dtypes[0];
                if u.float_only() && !d.is_float() {
                    return Err(Error::dtype(
                        op,
                        d,
                        format!("{u:?} needs a floating-point input"),
                    ));
                }
                if *u == UnaryOp::Not && d != DType::Bool {
                    return Err(Error::dtype(op, d, "logical not needs a bool input"));
                }
                if *u != UnaryOp::Not && d == DType::Bool {
                    return Err(Error::dtype(op, d, format!("{u:?} is not defined on bool")));
                }
                OutMeta {
                    shape: shapes[0].to_vec(),
                    dtype: d,
                }
            }
            Prim::Binary(b) => {
                arity(op, n, 2)?;
                same_shapes(op, shapes)?;
                same_dtypes(op, dtypes)?;
                let d = dtypes[0];
                if b.is_logical() && d != DType::Bool {
                    return Err(Error::dtype(op, d, format!("{b:?} needs bool operands")));
                }
                if !b.is_logical() && !b.is_comparison() && d == DType::Bool {
                    return Err(Error::dtype(op, d, format!("{b:?} is not defined on bool")));
                }
                let dtype = if b.is_comparison() { DType::Bool } else { d };
                OutMeta {
                    shape: shapes[0].to_vec(),
                    dtype,
                }
            }
            Prim::Where => {
                arity(op, n, 3)?;
                same_shapes(op, shapes)?;
                if dtypes[0] != DType::Bool {
                    return Err(Error::dtype(op, dtypes[0], "condition must be bool"));
                }
                same_dtypes(op, &dtypes[1..])?;
                OutMeta {
                    shape: shapes[0].to_vec(),
                    dtype: dtypes[1],
                }
            }
            Prim::Cast(d) => {
                arity(op, n, 1)?;
                OutMeta {
                    shape: shapes[0].to_vec(),
                    dtype: *d,
                }
            }
            Prim::Reduce { op: r, dims } => {
                arity(op, n, 1)?;
                let mut shape = shapes[0].to_vec();
                for &d in dims {
                    if d >= shape.len() {
                        return Err(Error::index(
                            op,
                            format!("dim {d} out of range for shape {shape:?}"),
                        ));
                    }
                    if matches!(r, ReduceOp::Max | ReduceOp::Min) && shape[d] == 0 {
                        return Err(Error::shape(
                            op,
                            format!(
                                "{r:?} over dim {d} of size 0 in shape {:?} has no identity",
                                shapes[0]
                            ),
                        ));
                    }
                    shape[d] = 1;
                }
                if dtypes[0] == DType::Bool {
                    return Err(Error::dtype(
                        op,
                        dtypes[0],
                        "reductions need a numeric input",
                    ));
                }
                if *r == ReduceOp::SumSqDev && !dtypes[0].is_float() {
                    return Err(Error::dtype(
                        op,
                        dtypes[0],
                        "squared deviations need a float input",
                    ));
                }
                OutMeta {
                    shape,
                    dtype: dtypes[0],
                }
            }
            Prim::ArgReduce { dim, .. } => {
                arity(op, n, 1)?;
                let mut shape = shapes[0].to_vec();
                if *dim >= shape.len() {
                    return Err(Error::index(
                        op,
                        format!("dim {dim} out of range for shape {shape:?}"),
                    ));
                }
                if shape[*dim] == 0 {
                    return Err(Error::shape(
                        op,
                        format!("argmax/argmin over an empty dim in {:?}", shapes[0]),
                    ));
                }
                shape[*dim] = 1;
                OutMeta {
                    shape,
                    dtype: DType::I64,
                }
            }
            Prim::Reshape(s) => {
                arity(op, n, 1)?;
                if numel(s) != numel(shapes[0]) {
                    return Err(Error::shape(
                        op,
                        format!(
                            "cannot reshape {:?} ({} elements) into {s:?}",
                            shapes[0],
                            numel(shapes[0])
                        ),
                    ));
                }
                OutMeta {
                    shape: s.clone(),
                    dtype: dtypes[0],
                }
            }
            Prim::Permute(p) => {
                arity(op, n, 1)?;
                let r = shapes[0].len();
                let mut seen = vec![false; r];
                if p.len() != r
                    || p.iter()
                        .any(|&i| i >= r || std::mem::replace(&mut seen[i], true))
                {
                    return Err(Error::arg(
                        op,
                        format!("{p:?} is not a permutation of the dims of {:?}", shapes[0]),
                    ));
                }
                OutMeta {
                    shape: p.iter().map(|&i| shapes[0][i]).collect(),
                    dtype: dtypes[0],
                }
            }
            Prim::Expand(s) => {
                arity(op, n, 1)?;
                let ok = s.len() == shapes[0].len()
                    && shapes[0].iter().zip(s).all(|(&a, &b)| a == b || a == 1);
                if !ok {
                    return Err(Error::shape(
                        op,
                        format!("cannot expand {:?} to {s:?}", shapes[0]),
                    ));
                }
                OutMeta {
                    shape: s.clone(),
                    dtype: dtypes[0],
                }
            }
            Prim::Slice {
                dim,
                start,
                end,
                step,
            } => {
                arity(op, n, 1)?;
                let s = shapes[0];
                if *dim >= s.len() || start > end || *end > s[*dim] || *step == 0 {
                    return Err(Error::index(
                        op,
                        format!("slice dim {dim} [{start}..{end} step {step}] out of range for shape {s:?}"),
                    ));
                }
                let mut shape = s.to_vec();
                shape[*dim] = (end - start).div_ceil(*step);
                OutMeta {
                    shape,
                    dtype: dtypes[0],
                }
            }
            Prim::Pad { pads, .. } => {
                arity(op, n, 1)?;
                if pads.len() != shapes[0].len() {
                    return Err(Error::arg(
                        op,
                        format!(
                            "{} pad pairs for rank-{} input",
                            pads.len(),
                            shapes[0].len()
                        ),
                    ));
                }
                let shape = shapes[0]
                    .iter()
                    .zip(pads)
                    .map(|(&d, &(a, b))| d + a + b)
                    .collect();
                OutMeta {
                    shape,
                    dtype: dtypes[0],
                }
            }
            Prim::Cat { dim } => {
                if n == 0 {
                    return Err(Error::arg(op, "needs at least one tensor"));
                }
                same_dtypes(op, dtypes)?;
                let first = shapes[0];
                if *dim >= first.len() {
                    return Err(Error::index(
                        op,
                        format!("dim {dim} out of range for shape {first:?}"),
                    ));
                }
                let mut shape = first.to_vec();
                shape[*dim] = 0;
                for s in shapes {
                    let ok = s.len() == first.len()
                        && s.iter()
                            .zip(first)
                            .enumerate()
                            .all(|(i, (a, b))| i == *dim || a == b);
                    if !ok {
                        return Err(Error::shape(
                            op,
                            format!("shapes {shapes:?} differ outside dim {dim}"),
                        ));
                    }
                    shape[*dim] += s[*dim];
                }
                OutMeta {
                    shape,
                    dtype: dtypes[0],
                }
            }
            Prim::Contiguous => {
                arity(op, n, 1)?;
                OutMeta {
                    shape: shapes[0].to_vec(),
                    dtype: dtypes[0],
                }
            }
            Prim::Full { shape, dtype, .. } | Prim::Rand { shape, dtype, .. } => {
                arity(op, n, 0)?;
                OutMeta {
                    shape: shape.clone(),
                    dtype: *dtype,
                }
            }
            Prim::Iota { n: len, dtype } => {
                arity(op, n, 0)?;
                OutMeta {
                    shape: vec![*len],
                    dtype: *dtype,
                }
            }
            Prim::Gather { dim } => {
                arity(op, n, 2)?;
                let (x, idx) = (shapes[0], shapes[1]);
                if dtypes[1] != DType::I64 {
                    return Err(Error::dtype(op, dtypes[1], "index must be int64"));
                }
                if x.len() != idx.len() || *dim >= x.len() {
                    return Err(Error::shape(
                        op,
                        format!("input {x:?} and index {idx:?} must have equal rank > dim {dim}"),
                    ));
                }
                if x.iter()
                    .zip(idx)
                    .enumerate()
                    .any(|(i, (a, b))| i != *dim && b > a)
                {
                    return Err(Error::shape(
                        op,
                        format!("index {idx:?} larger than input {x:?} outside dim {dim}"),
                    ));
                }
                OutMeta {
                    shape: idx.to_vec(),
                    dtype: dtypes[0],
                }
            }
            Prim::ScatterAdd { dim } => {
                arity(op, n, 3)?;
                let (x, idx, src) = (shapes[0], shapes[1], shapes[2]);
                if dtypes[1] != DType::I64 {
                    return Err(Error::dtype(op, dtypes[1], "index must be int64"));
                }
                if dtypes[0] != dtypes[2] {
                    return Err(Error::DTypeMismatch {
                        op,
                        lhs: dtypes[0],
                        rhs: dtypes[2],
                    });
                }
                if idx != src || x.len() != idx.len() || *dim >= x.len() {
                    return Err(Error::shape(op, format!("self {x:?}, index {idx:?}, src {src:?}: index and src must match, ranks equal")));
                }
                if x.iter()
                    .zip(idx)
                    .enumerate()
                    .any(|(i, (a, b))| i != *dim && b > a)
                {
                    return Err(Error::shape(
                        op,
                        format!("index {idx:?} larger than self {x:?} outside dim {dim}"),
                    ));
                }
                OutMeta {
                    shape: x.to_vec(),
                    dtype: dtypes[0],
                }
            }
            Prim::Matmul => {
                arity(op, n, 2)?;
                same_dtypes(op, dtypes)?;
                let shape = batched_product(op, shapes[0], shapes[1])?;
                if dtypes[0] == DType::Bool {
                    return Err(Error::dtype(op, dtypes[0], "matmul needs numeric operands"));
                }
                OutMeta {
                    shape,
                    dtype: dtypes[0],
                }
            }
            Prim::MatmulEpilogue(e) => {
                arity(op, n, 2 + usize::from(e.bias))?;
                same_dtypes(op, dtypes)?;
                let (a, b) = (shapes[0], shapes[1]);
                let shape = batched_product(op, a, b)?;
                if e.bias && shapes[2] != [b[2]] {
                    return Err(Error::shape(
                        op,
                        format!(
                            "bias {:?} for {} output columns: expected [{}]",
                            shapes[2], b[2], b[2]
                        ),
                    ));
                }
                if !dtypes[0].is_float() {
                    return Err(Error::dtype(
                        op,
                        dtypes[0],
                        "a matmul epilogue needs floating-point operands",
                    ));
                }
                OutMeta {
                    shape,
                    dtype: dtypes[0],
                }
            }
            Prim::Conv2d(p) => {
                arity(op, n, 2)?;
                same_dtypes(op, dtypes)?;
                if !dtypes[0].is_float() {
                    return Err(Error::dtype(
                        op,
                        dtypes[0],
                        "conv2d needs floating-point operands",
                    ));
                }
                let (x, w) = (p.nchw(shapes[0]), p.nchw(shapes[1]));
                conv_out_shape(p, &x, &w)?
                    .map(|shape| OutMeta {
                        shape: p.ordered(&shape),
                        dtype: dtypes[0],
                    })
                    .ok_or_else(|| {
                        Error::shape(op, format!("kernel {w:?} larger than padded input {x:?}"))
                    })?
            }
            Prim::Conv2dEpilogue { params, epilogue } => {
                arity(op, n, 2 + epilogue.operands())?;
                same_dtypes(op, dtypes)?;
                let out = Prim::Conv2d(*params).infer(&shapes[..2], &dtypes[..2])?;
                let channels = params.nchw(&out.shape)[1];
                let parts = epilogue.split(&shapes[2..]);
                for (name, s) in [("scale", parts.scale), ("shift", parts.shift)] {
                    if let Some(s) = s.filter(|s| **s != [channels]) {
                        return Err(Error::shape(
                            op,
                            format!(
                                "{name} {s:?} for {channels} output channels: expected \
                                 [{channels}]"
                            ),
                        ));
                    }
                }
                if let Some(r) = parts.residual.filter(|r| **r != out.shape.as_slice()) {
                    return Err(Error::shape(
                        op,
                        format!(
                            "residual {r:?} for output {:?}: expected the output's shape",
                            out.shape
                        ),
                    ));
                }
                out
            }
            Prim::Conv2dGradInput { input_shape, .. } => {
                arity(op, n, 2)?;
                OutMeta {
                    shape: input_shape.to_vec(),
                    dtype: dtypes[0],
                }
            }
            Prim::Conv2dGradWeight { weight_shape, .. } => {
                arity(op, n, 2)?;
                OutMeta {
                    shape: weight_shape.to_vec(),
                    dtype: dtypes[0],
                }
            }
        })
    }
}

/// Output shape of conv2d, checking ranks, channels and groups. `None` when the kernel does not fit.
pub fn conv_out_shape(p: &ConvParams, x: &[usize], w: &[usize]) -> Result<Option<Vec<usize>>> {
    let op = "conv2d";
    if x.len() != 4 || w.len() != 4 {
        return Err(Error::shape(
            op,
            format!("input {x:?} must be [N,C,H,W] and weight {w:?} [O,C/groups,KH,KW]"),
        ));
    }
    let g = p.groups;
    if g == 0 || x[1] % g != 0 || w[0] % g != 0 || w[1] * g != x[1] {
        return Err(Error::shape(
            op,
            format!("input {x:?} and weight {w:?} do not match with groups={g}"),
        ));
    }
    if p.stride.contains(&0) || p.dilation.contains(&0) {
        return Err(Error::arg(op, "stride and dilation must be positive"));
    }
    let (Some(oh), Some(ow)) = (p.out_size(0, x[2], w[2]), p.out_size(1, x[3], w[3])) else {
        return Ok(None);
    };
    Ok(Some(vec![x[0], w[0], oh, ow]))
}
