//! Matmul epilogues: a linear layer's bias and the ReLU or tanh-GELU after it computed by the
//! matmul call itself (`Prim::MatmulEpilogue`: cuBLASLt's `BIAS` / `RELU_BIAS` / `GELU_BIAS`
//! epilogues). PyTorch's Inductor sends a linear layer to `addmm`, whose bias cuBLASLt adds; a
//! ReLU after it it generates. Here both ride on the GEMM, so a `Linear -> ReLU` stack runs one
//! call per layer and no pointwise kernel.
//!
//! The pattern, in the prims `linear` and `relu` trace to: `matmul(a, b)` (one batch: `linear`
//! folds its batch dims into M), reshapes that keep the last dim N, `add(_, expand(bias))` where
//! the bias is N values broadcast along the rows, then `where(le(_, 0), 0, _)` or the nine ops
//! of `gelu_tanh` (the exact, erf-based `gelu` has no cuBLASLt form). Each part is optional but
//! the matmul, and at least a bias or an activation must be there. A value inside the pattern
//! that anything else reads, or that the graph returns, ends it (a training forward whose
//! backward reads the pre-activation's mask keeps its ReLU apart: `relu_mask.rs` points the
//! backward at the output's mask instead).
//!
//! What it computes: an f32 result equals eager's where cuBLASLt's heuristic picks the kernel
//! cuBLAS's GEMM picks (BERT's and the MLP workload's GEMMs: equal bit for bit), but cuBLASLt
//! adds the bias to the f32 sum before a half-precision result's one rounding, where eager
//! execution rounds the product and then the sum: f16 and bf16 results can differ from eager by
//! a rounding (closer to the exact value).
//!
//! Applied to each device graph the code generators take (`backend::prepare`), after autodiff:
//! the prim has no derivative. A CPU graph keeps the generated kernel after its gemm: the gemm
//! crate has no epilogue hook, and a pass over each row of its result is that kernel's own work
//! (the prim's CPU kernel, for an interpreted graph, runs the ops it stands for). A matmul the
//! target would generate inline (`small_matmul`) keeps its fused pointwise readers instead.
//! `KILN_MATMUL_EPILOGUES=0` turns the pass off (to measure it; part of the plan cache's key).

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::prim::{Activation, BinaryOp, Epilogue, Prim, UnaryOp};
use kiln_core::DType;

use crate::ir::lower::{matmul_dims, small_matmul};
use crate::matchers::{is_constant, relu_parts, Uses};
use crate::replace::{as_vector, replace};

/// Fewest rows of a matmul given an epilogue. With fewer, the product streams the weights
/// (a GEMV in all but name), and cuBLAS's own GEMM picks kernels for that shape which cuBLASLt's
/// heuristics do not offer with an epilogue: BERT-base at one sequence of 9 tokens replayed from
/// a CUDA graph (nvidia-h200, alternating builds) took 0.997 / 0.998 ms with its 72 linear
/// layers' biases in cuBLASLt's GEMMs against 0.978 / 0.979 ms with cuBLAS's GEMMs and generated
/// bias adds. One 128-row tile of cuBLASLt's usual tiles is where the two choose alike (BERT at
/// 32 x 128 tokens and the MLP workload: the same results bit for bit, the same time or less).
const MIN_ROWS: usize = 128;

/// One matmul and what it absorbs.
struct Fused {
    /// The value the epilogue call produces: the add or the ReLU's `where`.
    last: NodeId,
    a: NodeId,
    b: NodeId,
    /// A node of N elements whose linear order is the bias's (reshaped to `[N]` if need be).
    bias: Option<NodeId>,
    act: Activation,
    /// `[1, M, N]`
    shape: Vec<usize>,
}

/// The node holding N values that `id` broadcasts along every dim but the last (of size N),
/// when it is such a broadcast: `expand(v)` where `v` is `[1, .., 1, N]`.
pub(crate) fn bias_of(g: &Graph, id: NodeId, n: usize) -> Option<NodeId> {
    let node = &g.nodes[id];
    let Op::Prim(Prim::Expand(_)) = node.op else {
        return None;
    };
    let v = node.args[0];
    let s = &g.nodes[v].shape;
    let rows_of_one = s.split_last().is_some_and(|(&last, rest)| {
        last == n && rest.iter().all(|&d| d == 1) && node.shape.last() == Some(&n)
    });
    rows_of_one.then_some(v)
}

/// The epilogue pattern that starts at matmul `mm`, if there is one.
fn pattern(g: &Graph, uses: &Uses, mm: NodeId) -> Option<Fused> {
    let node = &g.nodes[mm];
    // cuBLASLt's epilogues take f32, f16 and bf16
    if !matches!(node.op, Op::Prim(Prim::Matmul))
        || !matches!(node.dtype, DType::F32 | DType::F16 | DType::BF16)
        || node.shape.first() != Some(&1)
    {
        return None;
    }
    if matmul_dims(g, node).is_some_and(small_matmul) {
        return None;
    }
    let (m, n) = (node.shape[1], node.shape[2]);
    if m < MIN_ROWS {
        return None;
    }
    let mut cur = mm;
    while let Some(r) = uses.only_reader(cur) {
        let reshape = matches!(g.nodes[r].op, Op::Prim(Prim::Reshape(_)));
        if !reshape || g.nodes[r].shape.last() != Some(&n) {
            break;
        }
        cur = r;
    }
    let mut bias = None;
    if let Some(add) = uses.only_reader(cur) {
        let add_node = &g.nodes[add];
        if matches!(add_node.op, Op::Prim(Prim::Binary(BinaryOp::Add))) {
            let other = match add_node.args[..] {
                [x, o] if x == cur => o,
                [o, x] if x == cur => o,
                _ => return None,
            };
            let v = bias_of(g, other, n)
                .filter(|&v| g.nodes[v].dtype == node.dtype && g.nodes[v].device == node.device)?;
            bias = Some(v);
            cur = add;
        }
    }
    let (act, last) = activation_of(g, uses, cur);
    if bias.is_none() && act == Activation::None {
        return None;
    }
    Some(Fused {
        last,
        a: node.args[0],
        b: node.args[1],
        bias,
        act,
        shape: node.shape.clone(),
    })
}

/// The activation applied to `x` and its last node, when one is all that reads `x`: a ReLU or
/// tanh-GELU; else `(Activation::None, x)`.
pub(crate) fn activation_of(g: &Graph, uses: &Uses, x: NodeId) -> (Activation, NodeId) {
    match relu_of(g, uses, x) {
        Some(r) => (Activation::Relu, r),
        None => match gelu_tanh_of(g, uses, x) {
            Some(r) => (Activation::GeluTanh, r),
            None => (Activation::None, x),
        },
    }
}

/// The ReLU `where(le(x, 0), 0, x)` when it is all that reads `x` (its two nodes) and the
/// graph returns neither `x` nor the mask: its `where` node.
fn relu_of(g: &Graph, uses: &Uses, x: NodeId) -> Option<NodeId> {
    let readers = uses.readers(x);
    if uses.is_output(x) || readers.len() != 2 {
        return None;
    }
    let sel = *readers
        .iter()
        .find(|&&u| relu_parts(g, u).is_some_and(|(_, v)| v == x))?;
    let (le, _) = relu_parts(g, sel)?;
    (readers.contains(&le) && uses.only_reader(le) == Some(sel)).then_some(sel)
}

/// GELU's tanh approximation of `x`, as `Tensor::gelu_tanh` composes it, when it is all that
/// reads `x` and the graph returns none of its inner values: its last node.
/// `x * (tanh((x + x * x * x * c) * k) + 1) * 0.5`: nine ops, four of them reading `x`.
fn gelu_tanh_of(g: &Graph, uses: &Uses, x: NodeId) -> Option<NodeId> {
    let only_reader = |id: NodeId| uses.only_reader(id);
    // `id` is `op(a, b)` with operands `a` and `b` in either order
    let is = |id: NodeId, op: BinaryOp, a: NodeId, b: &dyn Fn(NodeId) -> bool| {
        let n = &g.nodes[id];
        matches!(n.op, Op::Prim(Prim::Binary(o)) if o == op)
            && matches!(n.args[..], [p, q] if (p == a && b(q)) || (q == a && b(p)))
    };
    let node = |n: NodeId| move |id: NodeId| id == n;
    let constant = |v: f64| move |id: NodeId| is_constant(g, id, v);
    if uses.is_output(x) {
        return None;
    }
    let square = *uses
        .readers(x)
        .iter()
        .find(|&&u| is(u, BinaryOp::Mul, x, &node(x)))?;
    let cube = only_reader(square).filter(|&c| is(c, BinaryOp::Mul, square, &node(x)))?;
    let scaled = only_reader(cube)
        .filter(|&c| is(c, BinaryOp::Mul, cube, &constant(Activation::GELU_CUBE)))?;
    let sum = only_reader(scaled).filter(|&c| is(c, BinaryOp::Add, scaled, &node(x)))?;
    let inner = only_reader(sum)
        .filter(|&c| is(c, BinaryOp::Mul, sum, &constant(Activation::gelu_scale())))?;
    let tanh = only_reader(inner).filter(|&t| {
        matches!(g.nodes[t].op, Op::Prim(Prim::Unary(UnaryOp::Tanh))) && g.nodes[t].args == [inner]
    })?;
    let plus_one = only_reader(tanh).filter(|&c| is(c, BinaryOp::Add, tanh, &constant(1.0)))?;
    let times_x = only_reader(plus_one).filter(|&c| is(c, BinaryOp::Mul, plus_one, &node(x)))?;
    let half = only_reader(times_x).filter(|&c| is(c, BinaryOp::Mul, times_x, &constant(0.5)))?;
    let mut readers = uses.readers(x).to_vec();
    readers.sort_unstable();
    let mut want = vec![square, cube, sum, times_x];
    want.sort_unstable();
    (readers == want).then_some(half)
}

/// Whether the pass runs (and `relu_mask.rs`, which serves it): unless
/// `KILN_MATMUL_EPILOGUES=0`.
pub(crate) fn enabled() -> bool {
    std::env::var("KILN_MATMUL_EPILOGUES").as_deref() != Ok("0")
}

/// `g` with its matmul epilogues fused, or `None` when it has none (or the pass is off).
pub fn fuse(g: &Graph) -> Option<Graph> {
    if !enabled() {
        return None;
    }
    let found = |uses: &Uses, mm: NodeId| pattern(g, uses, mm).map(|f| (f.last, f));
    replace(g, found, |out, map, node, f: Fused| {
        let mut args = vec![map[f.a], map[f.b]];
        if let Some(v) = f.bias {
            args.push(as_vector(out, map[v], *f.shape.last().unwrap_or(&0)));
        }
        let epilogue = Epilogue {
            bias: f.bias.is_some(),
            act: f.act,
        };
        let call = out.push(Node {
            op: Op::Prim(Prim::MatmulEpilogue(epilogue)),
            args,
            shape: f.shape.clone(),
            ..node.clone()
        });
        match node.shape == f.shape {
            true => call,
            false => out.push(Node {
                op: Op::Prim(Prim::Reshape(node.shape.clone())),
                args: vec![call],
                ..node.clone()
            }),
        }
    })
}

#[cfg(test)]
mod tests {
    use kiln_core::{Result, Tensor};

    use super::*;
    use crate::test_graphs::rewritten_bitwise;

    fn epilogues(g: &Graph) -> Vec<Epilogue> {
        g.nodes
            .iter()
            .filter_map(|n| match n.op {
                Op::Prim(Prim::MatmulEpilogue(e)) => Some(e),
                _ => None,
            })
            .collect()
    }

    /// `f`'s graph with its epilogues fused, after checking that the fused graph computes what
    /// `f` computes eagerly, bit for bit (the CPU's epilogue rounds as the separate ops do).
    fn fused(
        f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + Clone + 'static,
        args: &[Tensor],
    ) -> Result<Option<Graph>> {
        let g = rewritten_bitwise(f, args, |g| fuse(g).unwrap_or_else(|| g.clone()))?;
        Ok((!epilogues(&g).is_empty()).then_some(g))
    }

    fn mlp_args() -> Result<Vec<Tensor>> {
        Ok(vec![
            Tensor::randn(&[4, 32, 64], DType::F32)?,
            Tensor::randn(&[128, 64], DType::F32)?,
            Tensor::randn(&[128], DType::F32)?,
            Tensor::randn(&[32, 128], DType::F32)?,
            Tensor::randn(&[32], DType::F32)?,
        ])
    }

    /// `linear -> relu -> linear` on a [4, 32, 64] batch: two calls, the first with its bias
    /// and ReLU, the second with its bias; no pointwise op is left.
    #[test]
    fn a_linear_relu_stack_is_one_call_per_layer() -> Result<()> {
        let fused = fused(
            |a: &[Tensor]| {
                let h = a[0].linear(&a[1], Some(&a[2]))?.relu()?;
                Ok(vec![h.linear(&a[3], Some(&a[4]))?])
            },
            &mlp_args()?,
        )?
        .expect("two epilogues");
        let relu = Epilogue {
            bias: true,
            act: Activation::Relu,
        };
        let bias = Epilogue {
            bias: true,
            act: Activation::None,
        };
        assert_eq!(epilogues(&fused), [relu, bias]);
        let pointwise = fused
            .nodes
            .iter()
            .filter(|n| matches!(&n.op, Op::Prim(p) if p.is_elementwise()))
            .count();
        assert_eq!(pointwise, 0, "{}", fused.to_code("fused"));
        assert_eq!(fused.nodes[fused.outputs[0]].shape, [4, 32, 32]);
        Ok(())
    }

    /// A tanh-approximated GELU joins the GEMM as cuBLASLt's `GELU_BIAS`; the exact (erf) GELU,
    /// which cuBLASLt has not, leaves the call the bias alone.
    #[test]
    fn tanh_gelu_joins_and_exact_gelu_stays() -> Result<()> {
        let fused = fused(
            |a: &[Tensor]| {
                let h = a[0].linear(&a[1], Some(&a[2]))?.gelu_tanh()?;
                let exact = a[0].linear(&a[1], Some(&a[2]))?.gelu()?;
                Ok(vec![h.linear(&a[3], Some(&a[4]))?, exact])
            },
            &mlp_args()?,
        )?
        .expect("three epilogues");
        let with = |act| Epilogue { bias: true, act };
        assert_eq!(
            epilogues(&fused),
            [
                with(Activation::GeluTanh),
                with(Activation::None),
                with(Activation::None)
            ]
        );
        let tanhs = fused
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Prim(Prim::Unary(UnaryOp::Tanh))))
            .count();
        assert_eq!(tanhs, 0, "{}", fused.to_code("fused"));
        Ok(())
    }

    /// A pre-activation the graph returns (as a training step's forward saves what its
    /// backward reads) keeps the ReLU out of the call; the bias still joins it. A matmul with
    /// no bias or ReLU after it, or a residual (full-size) add, stays a plain matmul.
    #[test]
    fn values_read_elsewhere_end_the_pattern() -> Result<()> {
        let mut args = mlp_args()?;
        args.push(Tensor::randn(&[128, 128], DType::F32)?);
        let fused = fused(
            |a: &[Tensor]| {
                let pre = a[0].linear(&a[1], Some(&a[2]))?;
                let h = pre.relu()?;
                let plain = h.matmul(&a[3].t()?)?;
                let residual = h.linear(&a[5], None)?.add(&h)?;
                Ok(vec![pre, plain, residual])
            },
            &args,
        )?
        .expect("the first layer's bias");
        assert_eq!(
            epilogues(&fused),
            [Epilogue {
                bias: true,
                act: Activation::None
            }]
        );
        let selects = fused
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Prim(Prim::Where)))
            .count();
        assert_eq!(selects, 1, "the ReLU stays");
        Ok(())
    }

    /// A ReLU straight after a matmul (no bias) joins it; a matmul small enough to be generated
    /// inline keeps its readers.
    #[test]
    fn relu_alone_joins_and_small_matmuls_stay() -> Result<()> {
        let args = vec![
            Tensor::randn(&[128, 64], DType::F32)?,
            Tensor::randn(&[64, 128], DType::F32)?,
            Tensor::randn(&[4, 8], DType::F32)?,
            Tensor::randn(&[8, 8], DType::F32)?,
            Tensor::randn(&[8], DType::F32)?,
        ];
        let fused = fused(
            |a: &[Tensor]| {
                Ok(vec![
                    a[0].matmul(&a[1])?.relu()?,
                    a[2].linear(&a[3], Some(&a[4]))?.relu()?,
                ])
            },
            &args,
        )?
        .expect("the large matmul's ReLU");
        assert_eq!(
            epilogues(&fused),
            [Epilogue {
                bias: false,
                act: Activation::Relu
            }]
        );
        Ok(())
    }

    /// A matmul of fewer than `MIN_ROWS` rows keeps cuBLAS's GEMM and its bias add; from that
    /// many rows on, the bias joins the call. f64 stays with cuBLAS (cuBLASLt's epilogues take
    /// no f64).
    #[test]
    fn matmuls_of_few_rows_or_f64_keep_their_bias_add() {
        use crate::test_graphs::{binary, expand, input, push};
        let bias_add = |m: usize, dtype: DType| {
            let mut g = Graph::default();
            let a = input(&mut g, &[1, m, 256]);
            let b = input(&mut g, &[1, 256, 64]);
            let bias = input(&mut g, &[1, 1, 64]);
            let mm = push(&mut g, Op::Prim(Prim::Matmul), vec![a, b], &[1, m, 64]);
            let e = expand(&mut g, bias, &[1, m, 64]);
            let y = binary(&mut g, BinaryOp::Add, mm, e);
            for node in &mut g.nodes {
                node.dtype = dtype;
            }
            g.outputs = vec![y];
            fuse(&g).map(|f| epilogues(&f))
        };
        let bias = Epilogue {
            bias: true,
            act: Activation::None,
        };
        assert_eq!(bias_add(MIN_ROWS - 1, DType::F32), None);
        assert_eq!(bias_add(MIN_ROWS, DType::F32), Some(vec![bias]));
        assert_eq!(bias_add(MIN_ROWS, DType::BF16), Some(vec![bias]));
        assert_eq!(bias_add(MIN_ROWS, DType::F64), None);
    }
}
