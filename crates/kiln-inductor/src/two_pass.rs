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
//! Both forms are `kiln_core::ops::reduce::sum_sq_dev_as_ops`, recorded into the graph
//! (`kiln_compile::record::splice`): the definition kiln-cuda's eager runtime runs (its moment
//! sums fused there, the same values added in the same order), so a GPU's compiled results
//! compute what its eager ones do.

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::{Prim, ReduceOp};
use kiln_core::Result;

/// `g` with every `SumSqDev` written with sums; `None` when it has none.
pub(crate) fn two_pass(g: &Graph) -> Result<Option<Graph>> {
    if !has_sqdev(g) {
        return Ok(None);
    }
    let mut out = g.empty_like(g.nodes.len() + 16);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for node in &g.nodes {
        let args: Vec<NodeId> = node.args.iter().map(|&a| map[a]).collect();
        let id = match &node.op {
            Op::Prim(Prim::Reduce {
                op: ReduceOp::SumSqDev,
                dims,
            }) => {
                let sums = kiln_compile::record::splice(&mut out, &args, node.grad_enabled, |x| {
                    Ok(vec![kiln_core::ops::reduce::sum_sq_dev_as_ops(
                        &x[0], dims,
                    )?])
                })?;
                sums[0]
            }
            _ => out.push(kiln_compile::graph::Node {
                args,
                ..node.clone()
            }),
        };
        map.push(id);
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    Ok(Some(kiln_compile::cse::cse(&out).unwrap_or(out)))
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
        let two = super::two_pass(&g)?.expect("a rewrite");
        assert_eq!(reduces(&two, ReduceOp::SumSqDev), 0);
        assert_eq!(reduces(&two, ReduceOp::Sum), 2, "the mean's sum is shared");
        use kiln_compile::CompiledGraph;
        let got =
            kiln_compile::backends::Interpreter::new(two.clone()).run(std::slice::from_ref(&x))?;
        let want = x.layer_norm(&[40], None, None, 1e-5)?;
        let diff = got[0].sub(&want)?.abs()?.max(&[], false)?.item::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        assert!(super::two_pass(&two)?.is_none());
        Ok(())
    }
}
