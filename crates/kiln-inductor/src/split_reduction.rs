//! Split reductions (Inductor's `split_reduction`): a reduction with few output elements over
//! many input elements — batch norm's per-channel sums of an `[N, C, H, W]` activation, a full
//! sum — gives the GPU one block per output element, a few dozen blocks each walking megabytes,
//! while the device has room for thousands. The graph is rewritten so that a first reduction
//! sums `S` chunks of each row into `[S, rows]` partials (S·rows blocks, each a chunk long) and a
//! second, short one sums the partials in order. The chunks come from viewing one reduced
//! dimension of size `n` as `[S, n / S]`, so the pointwise producers of the reduction stay fused
//! into its first half: nothing new is written but the partials.
//!
//! Sums change in the last bits (partials are rounded to the value's dtype, as in Inductor); max
//! and min are exact. Only the CUDA target splits: the C target keeps compiled sums equal to eager
//! ones bit for bit (ARCHITECTURE.md invariant 2), and its threads are few enough that one row
//! each keeps them busy.

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::device::ReduceSplit;
use kiln_core::prim::Prim;

/// How many chunks a reduction of `rows` outputs over `red` elements, whose reduced dimensions
/// have the extents `reduced` (outermost first), is split into, and along which of them: the
/// largest divisor `S` of a reduced extent within `policy`'s most chunks (the outermost
/// dimension on a tie; a divisor, so the dimension can be viewed as `[S, n / S]`). `None`: leave
/// it whole.
fn split(
    policy: &ReduceSplit,
    rows: usize,
    red: usize,
    reduced: &[(usize, usize)],
) -> Option<(usize, usize)> {
    let most = policy.most_chunks(rows, red)?;
    reduced
        .iter()
        .filter_map(|&(dim, n)| {
            let s = (2..=most.min(n)).rev().find(|s| n % s == 0)?;
            Some((dim, s))
        })
        .max_by_key(|&(dim, s)| (s, std::cmp::Reverse(dim)))
}

/// `g` with its long reductions split as `policy` says, or `None` when none is.
pub fn split_reductions(g: &Graph, policy: ReduceSplit) -> Option<Graph> {
    let plans: Vec<Option<(usize, usize)>> = g
        .nodes
        .iter()
        .map(|node| {
            let Op::Prim(Prim::Reduce { dims, .. }) = &node.op else {
                return None;
            };
            let in_shape = &g.nodes[node.args[0]].shape;
            let reduced: Vec<(usize, usize)> = dims.iter().map(|&d| (d, in_shape[d])).collect();
            let red: usize = reduced.iter().map(|r| r.1).product();
            let rows: usize = node.shape.iter().product();
            split(&policy, rows, red, &reduced)
        })
        .collect();
    if plans.iter().all(Option::is_none) {
        return None;
    }
    let mut out = Graph {
        nodes: Vec::with_capacity(g.nodes.len() + 3),
        ..g.clone()
    };
    // where each old node's value is in the new graph
    let mut at: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for (node, plan) in g.nodes.iter().zip(plans) {
        let args: Vec<NodeId> = node.args.iter().map(|&a| at[a]).collect();
        let id = match (plan, &node.op) {
            (Some((dim, s)), Op::Prim(Prim::Reduce { op, dims })) => {
                let in_shape = &g.nodes[node.args[0]].shape;
                let like = |op: Prim, args: Vec<NodeId>, shape: Vec<usize>| Node {
                    op: Op::Prim(op),
                    args,
                    shape,
                    ..node.clone()
                };
                // [.., n, ..] viewed as [.., S, n / S, ..]: dims after `dim` move one place on
                let mut viewed = in_shape.clone();
                viewed[dim] = in_shape[dim] / s;
                viewed.insert(dim, s);
                let first_dims: Vec<usize> = dims
                    .iter()
                    .map(|&d| if d >= dim { d + 1 } else { d })
                    .collect();
                let mut partial_shape = viewed.clone();
                for &d in &first_dims {
                    partial_shape[d] = 1;
                }
                let mut summed_shape = partial_shape.clone();
                summed_shape[dim] = 1;
                let view = out.push(like(Prim::Reshape(viewed.clone()), args, viewed));
                let partial = out.push(like(
                    Prim::Reduce {
                        op: *op,
                        dims: first_dims,
                    },
                    vec![view],
                    partial_shape,
                ));
                let summed = out.push(like(
                    Prim::Reduce {
                        op: *op,
                        dims: vec![dim],
                    },
                    vec![partial],
                    summed_shape,
                ));
                out.push(like(
                    Prim::Reshape(node.shape.clone()),
                    vec![summed],
                    node.shape.clone(),
                ))
            }
            _ => out.push(Node {
                args,
                ..node.clone()
            }),
        };
        at.push(id);
    }
    out.outputs = g.outputs.iter().map(|&o| at[o]).collect();
    Some(out)
}

#[cfg(test)]
mod tests {
    use kiln_compile::backends::Interpreter;
    use kiln_compile::CompiledGraph;
    use kiln_core::prim::{ReduceOp, UnaryOp};
    use kiln_core::Tensor;

    use super::*;
    use crate::test_graphs::cpu::{input, push};

    const SMALL: ReduceSplit = ReduceSplit {
        few_rows: 8,
        long_row: 64,
        min_chunk: 8,
    };

    /// `op` over `dims` of `exp(x)` (a producer the first half keeps fused), and `x`'s sum of
    /// squares as a second output.
    fn graph(shape: &[usize], op: ReduceOp, dims: &[usize]) -> Graph {
        let mut g = Graph::default();
        let x = input(&mut g, shape);
        let e = push(&mut g, Op::Prim(Prim::Unary(UnaryOp::Exp)), vec![x], shape);
        let mut out_shape = shape.to_vec();
        for &d in dims {
            out_shape[d] = 1;
        }
        let r = push(
            &mut g,
            Op::Prim(Prim::Reduce {
                op,
                dims: dims.to_vec(),
            }),
            vec![e],
            &out_shape,
        );
        g.outputs = vec![r, x];
        g
    }

    fn run(g: &Graph, x: &Tensor) -> Vec<Tensor> {
        Interpreter::new(g.clone())
            .run(std::slice::from_ref(x))
            .expect("interpreter run")
    }

    #[test]
    fn a_per_channel_sum_is_split_along_the_batch_and_keeps_its_value() {
        // batch norm's sum over [N, H, W] of an [N, C, H, W] activation: 3 rows of 8·4·4, split
        // 4 ways (the largest divisor within 2 · 8 / 3 blocks; the batch wins the tie)
        let shape = [8, 3, 4, 4];
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let g = graph(&shape, op, &[0, 2, 3]);
            let split = split_reductions(&g, SMALL).expect("a split");
            assert_eq!(split.nodes.len(), g.nodes.len() + 3, "{op:?}");
            // the first half: chunks along the batch, 3·S rows
            let partial = split
                .nodes
                .iter()
                .find(|n| matches!(&n.op, Op::Prim(Prim::Reduce { dims, .. }) if dims.len() == 3))
                .expect("first half");
            assert_eq!(
                partial.shape[1], 1,
                "{op:?}: the batch's inner part is reduced"
            );
            assert!(partial.shape[0] >= 2, "{op:?}: {:?}", partial.shape);
            let x = Tensor::randn(&shape, kiln_core::DType::F64).expect("randn");
            let (a, b) = (run(&g, &x), run(&split, &x));
            assert_eq!(a[0].shape(), b[0].shape());
            let (a, b) = (a[0].to_vec::<f64>().unwrap(), b[0].to_vec::<f64>().unwrap());
            for (u, v) in a.iter().zip(&b) {
                assert!(
                    (u - v).abs() <= 1e-12 * u.abs().max(1.0),
                    "{op:?}: {u} vs {v}"
                );
            }
        }
    }

    #[test]
    fn a_full_sum_is_split_and_short_or_wide_reductions_are_not() {
        let full = graph(&[1024], ReduceOp::Sum, &[0]);
        let split = split_reductions(&full, SMALL).expect("a full sum splits");
        let x = Tensor::randn(&[1024], kiln_core::DType::F64).unwrap();
        let (a, b) = (run(&full, &x), run(&split, &x));
        let (a, b) = (a[0].item::<f64>().unwrap(), b[0].item::<f64>().unwrap());
        assert!((a - b).abs() <= 1e-10 * a.abs(), "{a} vs {b}");
        // rows enough for the device, or rows too short to be worth it
        assert!(split_reductions(&graph(&[16, 64], ReduceOp::Sum, &[1]), SMALL).is_none());
        assert!(split_reductions(&graph(&[2, 32], ReduceOp::Sum, &[1]), SMALL).is_none());
        // a prime extent has no chunks
        assert!(split_reductions(&graph(&[2, 67], ReduceOp::Sum, &[1]), SMALL).is_none());
    }

    #[test]
    fn policy_targets_a_few_blocks_per_multiprocessor() {
        let p = ReduceSplit::for_gpu(132);
        // ResNet-18's first batch norm at batch 64: 64 channels of 64·112·112
        let (dim, s) = split(&p, 64, 64 * 112 * 112, &[(0, 64), (2, 112), (3, 112)]).unwrap();
        assert!(64 * s >= 2 * 132, "{dim} {s}");
        assert!(64 * 112 * 112 / s >= p.min_chunk);
        // 512 channels already fill the device
        assert!(split(&p, 512, 64 * 49, &[(0, 64), (2, 7), (3, 7)]).is_none());
    }
}
