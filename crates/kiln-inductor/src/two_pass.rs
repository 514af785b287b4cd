//! Squared deviations as sums, for the GPU target: `SumSqDev(x)` (Welford's walk, which the C
//! target generates in the eager kernel's lane order) is written with `Reduce(Sum)`s, which the
//! GPU's reductions generate (a pointwise producer fused into their walk, split across blocks
//! where rows are few and long). Its values equal the prim's up to rounding (on a GPU compiled
//! sums are compared to a tolerance, ARCHITECTURE.md invariant 2). Two forms:
//! - a warp's row (layer norm: the row kernel holds the row in registers) or an f64 operand: the
//!   mean, then the sum of the squares around it; the mean's sum is the norm's own (the graph is
//!   freed of repeats, `kiln_compile::cse`);
//! - otherwise (a batch norm's per-channel statistics): `Σx²` and `Σx` in f64, sibling sums of one
//!   walk with the norm's mean, so the input is read once for its statistics, not twice.
//!
//! The choice and both forms are `kiln_core::ops::reduce::sum_sq_dev_as_ops`' (the prims
//! kiln-cuda's eager runtime runs), so a GPU's compiled results compute what its eager ones do.

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::prim::{BinaryOp, Prim, ReduceOp};
use kiln_core::DType;

/// `g` with every `SumSqDev` written with sums (`as_moment_sums` or `as_two_sums`); `None` when
/// it has none.
pub(crate) fn two_pass(g: &Graph) -> Option<Graph> {
    if !has_sqdev(g) {
        return None;
    }
    let mut out = g.empty_like(g.nodes.len() + 8);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for (id, node) in g.nodes.iter().enumerate() {
        let args: Vec<NodeId> = node.args.iter().map(|&a| map[a]).collect();
        let id = match &node.op {
            Op::Prim(Prim::Reduce {
                op: ReduceOp::SumSqDev,
                dims,
            }) if in_one_pass(g, id) => as_moment_sums(&mut out, node, args[0], dims),
            Op::Prim(Prim::Reduce {
                op: ReduceOp::SumSqDev,
                dims,
            }) => as_two_sums(&mut out, node, args[0], dims),
            _ => out.push(Node {
                args,
                ..node.clone()
            }),
        };
        map.push(id);
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    Some(kiln_compile::cse::cse(&out).unwrap_or(out))
}

/// Whether `g` has a `SumSqDev` (which a target that does not generate it must not plan).
pub(crate) fn has_sqdev(g: &Graph) -> bool {
    g.nodes.iter().any(|n| {
        matches!(
            n.op,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::SumSqDev,
                ..
            })
        )
    })
}

/// Whether the squared deviations `id` of `g` are taken as moment sums: the rule kiln-cuda's
/// eager runtime follows too (`kiln_core::ops::reduce::sq_dev_in_moment_sums`).
fn in_one_pass(g: &Graph, id: NodeId) -> bool {
    let Op::Prim(Prim::Reduce { dims, .. }) = &g.nodes[id].op else {
        return false;
    };
    let x = &g.nodes[g.nodes[id].args[0]];
    kiln_core::ops::reduce::sq_dev_in_moment_sums(&x.shape, x.dtype, dims)
}

/// `Σx² - (Σx)² / n` over `dims` of `x` (kept), both sums in f64 — one walk over `x` (sibling
/// reductions, and beside a norm's own mean a third) — clamped at zero and rounded to the node
/// `sqdev`'s dtype, written into `out`: `sum_sq_dev_as_ops`' moment sums, the same operations.
fn as_moment_sums(out: &mut Graph, sqdev: &Node, x: NodeId, dims: &[usize]) -> NodeId {
    let in_shape = out.nodes[x].shape.clone();
    let kept = sqdev.shape.clone();
    let count: usize = dims.iter().map(|&d| in_shape[d]).product();
    let at = |op: Prim, args: Vec<NodeId>, shape: &[usize], dtype: DType| Node {
        op: Op::Prim(op),
        args,
        shape: shape.to_vec(),
        dtype,
        ..sqdev.clone()
    };
    let f64_at = |op: Prim, args: Vec<NodeId>, shape: &[usize]| at(op, args, shape, DType::F64);
    let sum = || Prim::Reduce {
        op: ReduceOp::Sum,
        dims: dims.to_vec(),
    };
    let full = |v: f64| Prim::Full {
        shape: kept.clone(),
        value: v,
        dtype: DType::F64,
    };
    let xd = out.push(f64_at(Prim::Cast(DType::F64), vec![x], &in_shape));
    let sq = out.push(f64_at(Prim::Binary(BinaryOp::Mul), vec![xd, xd], &in_shape));
    let s1 = out.push(f64_at(sum(), vec![xd], &kept));
    let s2 = out.push(f64_at(sum(), vec![sq], &kept));
    let n = out.push(f64_at(full(count as f64), vec![], &kept));
    let s1s1 = out.push(f64_at(Prim::Binary(BinaryOp::Mul), vec![s1, s1], &kept));
    let shift = out.push(f64_at(Prim::Binary(BinaryOp::Div), vec![s1s1, n], &kept));
    let m2 = out.push(f64_at(Prim::Binary(BinaryOp::Sub), vec![s2, shift], &kept));
    // `clamp(Some(0.0), None)`: where(m2 < 0, 0, m2)
    let zero = out.push(f64_at(full(0.0), vec![], &kept));
    let below = out.push(at(
        Prim::Binary(BinaryOp::Lt),
        vec![m2, zero],
        &kept,
        DType::Bool,
    ));
    let m2 = out.push(f64_at(Prim::Where, vec![below, zero, m2], &kept));
    out.push(at(Prim::Cast(sqdev.dtype), vec![m2], &kept, sqdev.dtype))
}

/// `Σ (x - Σx / n)²` over `dims` of `x` (kept), written into `out` for the node `sqdev`.
fn as_two_sums(out: &mut Graph, sqdev: &Node, x: NodeId, dims: &[usize]) -> NodeId {
    let in_shape = out.nodes[x].shape.clone();
    let count: usize = dims.iter().map(|&d| in_shape[d]).product();
    let at = |op: Prim, args: Vec<NodeId>, shape: &[usize]| Node {
        op: Op::Prim(op),
        args,
        shape: shape.to_vec(),
        ..sqdev.clone()
    };
    let sum = |dims: &[usize]| Prim::Reduce {
        op: ReduceOp::Sum,
        dims: dims.to_vec(),
    };
    let kept = &sqdev.shape;
    let total = out.push(at(sum(dims), vec![x], kept));
    let n = out.push(at(
        Prim::Full {
            shape: kept.clone(),
            value: count as f64,
            dtype: sqdev.dtype,
        },
        vec![],
        kept,
    ));
    let mean = out.push(at(Prim::Binary(BinaryOp::Div), vec![total, n], kept));
    let mean = out.push(at(Prim::Expand(in_shape.clone()), vec![mean], &in_shape));
    let dev = out.push(at(Prim::Binary(BinaryOp::Sub), vec![x, mean], &in_shape));
    let sq = out.push(at(Prim::Binary(BinaryOp::Mul), vec![dev, dev], &in_shape));
    out.push(at(sum(dims), vec![sq], kept))
}

#[cfg(test)]
mod tests {
    use kiln_core::{DType, Result, Tensor};

    use crate::test_graphs::traced;

    /// A layer norm's squared deviations become two sums, the first of them the very sum its
    /// mean takes (one node after the rewrite); the rewritten graph computes what eager does.
    #[test]
    fn squared_deviations_become_the_mean_and_the_squares_around_it() -> Result<()> {
        use kiln_compile::graph::Op;
        use kiln_core::prim::{Prim, ReduceOp};
        let x = Tensor::randn(&[6, 40], DType::F32)?;
        let g = traced(
            |a: &[Tensor]| Ok(vec![a[0].layer_norm(&[40], None, None, 1e-5)?]),
            std::slice::from_ref(&x),
        )?;
        let reduces = |g: &kiln_compile::graph::Graph, want: ReduceOp| {
            g.nodes
                .iter()
                .filter(|n| matches!(&n.op, Op::Prim(Prim::Reduce { op, .. }) if *op == want))
                .count()
        };
        assert_eq!(reduces(&g, ReduceOp::SumSqDev), 1);
        assert_eq!(reduces(&g, ReduceOp::Sum), 1);
        let two = super::two_pass(&g).expect("a rewrite");
        assert_eq!(reduces(&two, ReduceOp::SumSqDev), 0);
        assert_eq!(reduces(&two, ReduceOp::Sum), 2, "the mean's sum is shared");
        use kiln_compile::CompiledGraph;
        let got =
            kiln_compile::backends::Interpreter::new(two.clone()).run(std::slice::from_ref(&x))?;
        let want = x.layer_norm(&[40], None, None, 1e-5)?;
        let diff = got[0].sub(&want)?.abs()?.max(&[], false)?.item::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        assert!(super::two_pass(&two).is_none());
        Ok(())
    }
}
