//! Squared deviations as two sums, for the GPU target: `SumSqDev(x)` (Welford's walk, which the
//! C target generates in the eager kernel's lane order) is written as the mean, then the sum of
//! the squares around it — `kiln_core::ops::reduce::sum_sq_dev_as_ops`, the prims kiln-cuda's
//! eager runtime runs for it. The GPU's reductions fuse a pointwise producer into their walk and
//! a norm's normalization reads the same mean, so this is the graph the GPU target was tuned on;
//! its values equal the prim's up to rounding (on a GPU compiled sums are compared to a
//! tolerance, ARCHITECTURE.md invariant 2). The mean's sum repeats the one the norm computes
//! for its normalization, so the graph is then freed of repeats (`kiln_compile::cse`).

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::prim::{BinaryOp, Prim, ReduceOp};

/// `g` with every `SumSqDev` written as two sums; `None` when it has none.
pub(crate) fn two_pass(g: &Graph) -> Option<Graph> {
    let is_sqdev = |n: &Node| {
        matches!(
            n.op,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::SumSqDev,
                ..
            })
        )
    };
    if !g.nodes.iter().any(is_sqdev) {
        return None;
    }
    let mut out = g.empty_like(g.nodes.len() + 8);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for node in &g.nodes {
        let args: Vec<NodeId> = node.args.iter().map(|&a| map[a]).collect();
        let id = match &node.op {
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
