//! Split reductions (Inductor's `split_reduction`): a reduction with few output elements over
//! many input elements — batch norm's per-channel sums of an `[N, C, H, W]` activation, a full
//! sum — gives the GPU one block per output element, a few dozen blocks each walking megabytes,
//! while the device has room for thousands. The graph is rewritten so that a first reduction
//! sums `S` chunks of each row into `[S, rows]` partials (S·rows blocks, each a chunk long) and a
//! second, short one sums the partials in order. The chunks come from viewing one reduced
//! dimension of size `n` as `[S, n / S]`, so the pointwise producers of the reduction stay fused
//! into its first half: nothing new is written but the partials.
//!
//! An outer reduction (channels-last batch norm: the sum over N, H, W of `[N, H, W, C]`) has a
//! thread per output element in the CUDA generator, so it wants tens of thousands of rows: its
//! reduced run is cut into chunks by the thousand (`split_outer`), for threads, not blocks.
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

/// Shortest chunk of an outer reduction: a thread's loop.
const OUTER_MIN_CHUNK: usize = 16;
/// Input elements from which an outer reduction is split.
const OUTER_SPLIT_FROM: usize = 1 << 20;
/// Kept elements an outer reduction's reads need in a run.
const OUTER_RUN: usize = 16;

/// Whether a reduction with these kept and reduced (dim, extent) pairs is an outer one: its
/// reduced dims come before a run of at least `OUTER_RUN` kept elements (channels-last batch
/// norm's sums over N, H, W of `[N, H, W, C]`), so threads that own consecutive kept elements
/// read consecutive memory. The CUDA generator gives such a reduction a thread per output element
/// (`codegen/cuda_reduce.rs`); this pass splits it for that.
pub(crate) fn is_outer(kept: &[(usize, usize)], reduced: &[(usize, usize)]) -> bool {
    let Some(last) = reduced.iter().map(|r| r.0).max() else {
        return false;
    };
    let run: usize = kept.iter().filter(|k| k.0 > last).map(|k| k.1).product();
    run >= OUTER_RUN
}

/// An outer reduction (`is_outer`) whose reduced dims are one consecutive run `[first, last]`: the
/// run this pass can cut into chunks. Its threads own kept elements, so it wants rows by the tens
/// of thousands, not blocks.
fn outer_run(in_shape: &[usize], dims: &[usize]) -> Option<(usize, usize)> {
    let (&first, &last) = (dims.iter().min()?, dims.iter().max()?);
    let pairs = |reduced: bool| -> Vec<(usize, usize)> {
        (0..in_shape.len())
            .filter(|d| dims.contains(d) == reduced)
            .map(|d| (d, in_shape[d]))
            .collect()
    };
    let consecutive = dims.len() == last - first + 1;
    (consecutive && is_outer(&pairs(false), &pairs(true))).then_some((first, last))
}

/// How an outer reduction of `rows` outputs over the run `[first, last]` of `in_shape` is split:
/// into about 2048 threads per multiprocessor (`policy.few_rows` is two per multiprocessor):
/// what one holds, so that enough loads are in flight to reach the memory's bandwidth (at 512,
/// the per-channel sums of ResNet-18's activations ran at a third of it), with chunks of at
/// least `OUTER_MIN_CHUNK`. The chunks are whole leading dims of the run and a divisor of the
/// next one, which is viewed as `[d, n / d]`: a dim split in two keeps a load's
/// index a sum of the loop variables, where chunks of the run flattened would cost a division
/// and a modulo per dim at every load.
fn split_outer(
    policy: &ReduceSplit,
    rows: usize,
    in_shape: &[usize],
    (first, last): (usize, usize),
) -> Option<Split> {
    let threads = policy.few_rows * 1024;
    let red: usize = in_shape[first..=last].iter().product();
    // a reduction of fewer elements than a few per thread takes microseconds whole
    let small = rows * red < OUTER_SPLIT_FROM;
    if rows == 0 || 2 * rows >= threads || red < 2 * OUTER_MIN_CHUNK || small {
        return None;
    }
    let most = threads / rows;
    let mut chunks = 1;
    for k in first..=last {
        let n = in_shape[k];
        let rest: usize = in_shape[k + 1..=last].iter().product();
        let d = (1..=n)
            .rev()
            .find(|&d| n % d == 0 && chunks * d <= most && (n / d) * rest >= OUTER_MIN_CHUNK)?;
        if d < n || k == last {
            if chunks * d < 2 {
                return None;
            }
            // dim k as [d, n / d]: the chunks are dims first..k and the d part
            let mut view = in_shape[..k].to_vec();
            view.extend([d, n / d]);
            view.extend_from_slice(&in_shape[k + 1..]);
            return Some(Split {
                view,
                first_dims: (k + 1..=last + 1).collect(),
                second_dims: (first..=k).collect(),
            });
        }
        chunks *= n;
    }
    None
}

/// A reduction's split: its operand viewed as `view`, a first reduction over `first_dims` of the
/// view (within each chunk), a second over `second_dims` (across the chunks).
#[derive(Clone, Debug)]
struct Split {
    view: Vec<usize>,
    first_dims: Vec<usize>,
    second_dims: Vec<usize>,
}

/// The block-per-chunk split of the reduced dims `dims` of `in_shape` along `dim`, viewed as
/// `[s, n / s]`.
fn split_one_dim(in_shape: &[usize], dims: &[usize], dim: usize, s: usize) -> Split {
    let mut view = in_shape.to_vec();
    view[dim] = in_shape[dim] / s;
    view.insert(dim, s);
    // dims after `dim` move one place on
    let first_dims = dims
        .iter()
        .map(|&d| if d >= dim { d + 1 } else { d })
        .collect();
    Split {
        view,
        first_dims,
        second_dims: vec![dim],
    }
}

/// `g` with its long reductions split as `policy` says, or `None` when none is.
pub fn split_reductions(g: &Graph, policy: ReduceSplit) -> Option<Graph> {
    let plans: Vec<Option<Split>> = g
        .nodes
        .iter()
        .map(|node| {
            let Op::Prim(Prim::Reduce { dims, .. }) = &node.op else {
                return None;
            };
            let in_shape = &g.nodes[node.args[0]].shape;
            let rows: usize = node.shape.iter().product();
            if let Some(run) = outer_run(in_shape, dims) {
                return split_outer(&policy, rows, in_shape, run);
            }
            let reduced: Vec<(usize, usize)> = dims.iter().map(|&d| (d, in_shape[d])).collect();
            let red: usize = reduced.iter().map(|r| r.1).product();
            let (dim, s) = split(&policy, rows, red, &reduced)?;
            Some(split_one_dim(in_shape, dims, dim, s))
        })
        .collect();
    if plans.iter().all(Option::is_none) {
        return None;
    }
    let mut out = g.empty_like(g.nodes.len() + 3);
    // where each old node's value is in the new graph
    let mut at: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for (node, plan) in g.nodes.iter().zip(plans) {
        let args: Vec<NodeId> = node.args.iter().map(|&a| at[a]).collect();
        let id = match (plan, &node.op) {
            (Some(split), Op::Prim(Prim::Reduce { op, .. })) => {
                let like = |op: Prim, args: Vec<NodeId>, shape: Vec<usize>| Node {
                    op: Op::Prim(op),
                    args,
                    shape,
                    ..node.clone()
                };
                let Split {
                    view: viewed,
                    first_dims,
                    second_dims,
                } = split;
                let mut partial_shape = viewed.clone();
                for &d in &first_dims {
                    partial_shape[d] = 1;
                }
                let mut summed_shape = partial_shape.clone();
                for &d in &second_dims {
                    summed_shape[d] = 1;
                }
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
                        dims: second_dims,
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
    fn an_outer_reduction_is_split_over_its_whole_run_into_many_rows() {
        // channels-last batch norm: the sum over N, H, W of [N, H, W, C], C innermost
        let shape = [64, 32, 16, 32];
        let g = graph(&shape, ReduceOp::Sum, &[0, 1, 2]);
        let split = split_reductions(&g, ReduceSplit::for_gpu(132)).expect("a split");
        let view = split
            .nodes
            .iter()
            .find(|n| matches!(n.op, Op::Prim(Prim::Reshape(_))))
            .expect("the chunked view");
        // 67584 / 32 = 2112 chunks per row at most: the batch whole (64) and 32 of the second
        // dim's 32, chunks of 16 (the third dim)
        assert_eq!(view.shape, vec![64, 32, 1, 16, 32]);
        let x = Tensor::randn(&shape, kiln_core::DType::F64).unwrap();
        let (a, b) = (run(&g, &x), run(&split, &x));
        assert_eq!(a[0].shape(), b[0].shape());
        let (a, b) = (a[0].to_vec::<f64>().unwrap(), b[0].to_vec::<f64>().unwrap());
        for (u, v) in a.iter().zip(&b) {
            assert!((u - v).abs() <= 1e-12 * u.abs().max(1.0), "{u} vs {v}");
        }
        // a run of kept elements too short for coalesced reads, or reduced dims not in one run:
        // the block-per-chunk split of the other tests
        assert!(outer_run(&[8, 6, 4, 8], &[0, 1, 2]).is_none());
        assert!(outer_run(&[8, 6, 4, 32], &[0, 2]).is_none());
        assert_eq!(outer_run(&[8, 6, 4, 32], &[1, 2]), Some((1, 2)));
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
