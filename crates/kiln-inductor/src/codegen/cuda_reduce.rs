//! A reduction's CUDA kernel: each output element gets a thread, a warp or a block by the length
//! of what it reduces (a thread when short, or when it is an outer reduction with rows enough to
//! fill the device: its threads then read consecutive kept elements). Accumulation in the
//! accumulator type of `reduce_c` (f64 for float sums), warp shuffles, a shared-memory pass for
//! the warps of a block.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId};

use super::c::{
    many_reduction_parts, reduction_parts, split_index, ty, Accumulator, Builder, ReductionParts,
    ReductionShape,
};
use super::cuda::{finish, parameters, Cuda, CudaKernel};
use crate::schedule::Schedule;
use crate::split_reduction::is_outer;

/// Reduced lengths from which a warp (then a block) reduces each output element.
const WARP_FROM: usize = 32;
const BLOCK_FROM: usize = 4096;
/// An outer reduction (`split_reduction::is_outer`) has a thread per output element when it has
/// this many rows per multiprocessor.
const OUTER_ROWS_PER_SM: usize = 128;

pub(super) fn reduction(t: &Cuda, g: &Graph, sched: &Schedule, root: NodeId) -> CudaKernel {
    let ReductionParts {
        b,
        value,
        acc_t,
        init,
        step,
        out_offset,
        kept,
        reduced,
        ..
    } = reduction_parts(g, sched, root);
    let acc = Accumulator {
        root,
        value,
        acc_t,
        init,
        step,
    };
    let shape = ReductionShape {
        out_offset,
        kept,
        reduced,
    };
    generate(t, g, b, &[acc], &shape)
}

/// Several reductions of one loop nest (`c::many_reduction_parts`) in one kernel, an
/// accumulator each, their outputs in `roots`' order; `None` where they do not share one.
pub(super) fn reductions(
    t: &Cuda,
    g: &Graph,
    sched: &Schedule,
    roots: &[NodeId],
) -> Option<CudaKernel> {
    let (b, accs, shape) = many_reduction_parts(g, sched, roots)?;
    Some(generate(t, g, b, &accs, &shape))
}

/// The kernel of `accs` walking `shape`'s loops. One accumulator is named `acc` and writes
/// `out` (the text one reduction has always had); several are `acc<k>` writing `out<k>`.
fn generate(
    t: &Cuda,
    g: &Graph,
    b: Builder<'_>,
    accs: &[Accumulator],
    shape: &ReductionShape,
) -> CudaKernel {
    let ReductionShape {
        out_offset: off,
        kept,
        reduced,
    } = shape;
    let one = accs.len() == 1;
    let name = |base: &str, k: usize| match one {
        true => base.to_string(),
        false => format!("{base}{k}"),
    };
    let rows: usize = kept.iter().map(|k| k.1).product();
    let red: usize = reduced.iter().map(|k| k.1).product();
    let mut declare = String::new();
    let mut accumulate = b.body.clone();
    let mut stores = Vec::new();
    for (k, a) in accs.iter().enumerate() {
        let acc = name("acc", k);
        let out_t = ty(g.nodes[a.root].dtype);
        let _ = writeln!(declare, "    {} {acc} = {};", a.acc_t, a.init);
        let _ = writeln!(accumulate, "      {acc} = {};", (a.step)(&acc, &a.value));
        stores.push(format!("{}[{off}] = ({out_t}){acc};", name("out", k)));
    }
    let store_all = match one {
        true => stores[0].clone(),
        false => format!("{{ {} }}", stores.join(" ")),
    };
    let mut text = b.pre.clone();
    // an outer reduction (its reduced dims lie outside a run of kept ones: channels-last
    // batch norm's per-channel sums): consecutive threads own consecutive kept elements, so
    // a warp's load is one contiguous run, where lanes over the reduced elements would read
    // a run's length apart. Given enough rows to fill the device (`split_reduction.rs` cuts
    // the reduced extent into chunks to make them).
    let outer = is_outer(kept, reduced) && rows >= t.sm_count as usize * OUTER_ROWS_PER_SM;
    let (grid, block) = if red < WARP_FROM || outer {
        // a thread per output element, its reduced elements in a loop nest
        let _ = writeln!(
            text,
            "  for (long long row = kbid * blockDim.x + threadIdx.x; row < {rows}; \
             row += knblk * blockDim.x) {{"
        );
        split_index(&mut text, "row", kept, "    ", "rem");
        text.push_str(&declare);
        for &(v, n) in reduced {
            let _ = writeln!(text, "    for (long long i{v} = 0; i{v} < {n}; i{v}++)");
        }
        let _ = writeln!(text, "    {{\n{accumulate}    }}\n    {store_all}\n  }}");
        (t.blocks(rows, t.cfg.block as usize), t.cfg.block)
    } else {
        // a warp (or a block) per output element: strided partial sums, then shuffles
        let per_block = red < BLOCK_FROM;
        let row_block = t.cfg.row_block;
        let (lanes, rows_per_block, block) = if per_block {
            (32, t.cfg.warp_rows as usize, t.cfg.warp_rows * 32)
        } else {
            (row_block as usize, 1, row_block)
        };
        let (first_row, lane) = if per_block {
            (
                format!("kbid * {rows_per_block} + threadIdx.x / 32"),
                "threadIdx.x % 32",
            )
        } else {
            ("kbid".to_string(), "threadIdx.x")
        };
        if !per_block {
            for (k, a) in accs.iter().enumerate() {
                let _ = writeln!(
                    text,
                    "  __shared__ {} {}[{}];",
                    a.acc_t,
                    name("partial", k),
                    row_block / 32
                );
            }
        }
        let _ = writeln!(
            text,
            "  for (long long row = {first_row}; row < {rows}; \
             row += knblk * {rows_per_block}) {{"
        );
        split_index(&mut text, "row", kept, "    ", "rem_row");
        text.push_str(&declare);
        let _ = writeln!(
            text,
            "    for (long long r = {lane}; r < {red}; r += {lanes}) {{"
        );
        split_index(&mut text, "r", reduced, "      ", "rem");
        let _ = writeln!(text, "{accumulate}    }}");
        for (k, a) in accs.iter().enumerate() {
            let acc = name("acc", k);
            let _ = writeln!(
                text,
                "    for (int s = 16; s > 0; s >>= 1) {{ {t} other = \
                 __shfl_down_sync(0xffffffffu, {acc}, s); {acc} = {}; }}",
                (a.step)(&acc, "other"),
                t = a.acc_t
            );
        }
        if per_block {
            let _ = writeln!(text, "    if ({lane} == 0) {store_all}");
        } else {
            let w = row_block / 32;
            let mut keep = String::new();
            let mut combine = String::new();
            for (k, a) in accs.iter().enumerate() {
                let (acc, partial) = (name("acc", k), name("partial", k));
                let _ = write!(keep, "{partial}[threadIdx.x / 32] = {acc}; ");
                let _ = write!(
                    combine,
                    "      {acc} = threadIdx.x < {w} ? {partial}[threadIdx.x] : ({t})({init});\n      \
                     for (int s = 16; s > 0; s >>= 1) {{ {t} other = __shfl_down_sync(0xffffffffu, \
                     {acc}, s); {acc} = {}; }}\n",
                    (a.step)(&acc, "other"),
                    t = a.acc_t,
                    init = a.init
                );
            }
            let keep = match one {
                true => keep.trim_end().to_string(),
                false => format!("{{ {}}}", keep),
            };
            let _ = writeln!(
                text,
                "    if (threadIdx.x % 32 == 0) {keep}\n    __syncthreads();\n    if (threadIdx.x < \
                 32) {{\n{combine}      if (threadIdx.x == 0) {store_all}\n    }}\n    \
                 __syncthreads();"
            );
        }
        let _ = writeln!(text, "  }}");
        (t.blocks(rows, rows_per_block), block)
    };
    let outputs: Vec<(NodeId, String)> = accs
        .iter()
        .enumerate()
        .map(|(k, a)| (a.root, name("out", k)))
        .collect();
    let text = t.narrow_index(
        g,
        b.params.iter().copied().chain(accs.iter().map(|a| a.root)),
        rows * red,
        text,
    );
    let params = parameters(&b, g, &outputs);
    finish(b.params, params, text, grid, block)
}

#[cfg(test)]
mod tests {
    use kiln_compile::graph::{Graph, NodeId, Op};
    use kiln_core::prim::{BinaryOp, Prim, ReduceOp};

    use crate::backend::{plan_graph, Planned};
    use crate::codegen::cuda::{Cuda, CudaKernel};
    use crate::test_graphs::{binary, input, push};

    fn sum(g: &mut Graph, x: NodeId, dims: Vec<usize>, shape: &[usize]) -> NodeId {
        push(
            g,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::Sum,
                dims,
            }),
            vec![x],
            shape,
        )
    }

    fn kernels(g: &Graph) -> Vec<(CudaKernel, usize)> {
        plan_graph(&Cuda::new(132), g)
            .into_iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, outs } => Some((kernel, outs.len())),
                Planned::Extern { .. } => None,
            })
            .collect()
    }

    /// Batch norm's backward sums: Σ g and Σ g·x over the batch of [8192, 64] (a warp per
    /// channel) are one kernel, two accumulators, `g` loaded once per element; a sum over other
    /// dims, and a sum reading another sum's result, keep kernels of their own.
    #[test]
    fn sums_over_the_same_loops_share_one_kernel() {
        let mut g = Graph::default();
        let x = input(&mut g, &[8192, 64]);
        let gr = input(&mut g, &[8192, 64]);
        let s1 = sum(&mut g, gr, vec![0], &[1, 64]);
        let gx = binary(&mut g, BinaryOp::Mul, gr, x);
        let s2 = sum(&mut g, gx, vec![0], &[1, 64]);
        let rows = sum(&mut g, gx, vec![1], &[8192, 1]);
        g.outputs = vec![s1, s2, rows];
        let ks = kernels(&g);
        let (k, outs) = ks
            .iter()
            .find(|(_, n)| *n == 2)
            .expect("the two column sums together");
        assert_eq!(*outs, 2);
        assert!(k.source.contains("acc0 = acc0 + ") && k.source.contains("acc1 = acc1 + "));
        assert!(k.source.contains("out0[") && k.source.contains("out1["));
        // one load of g per element: both operands read it at the same index
        let g_param = k.inputs.iter().position(|&i| i == gr).expect("reads g");
        let load = format!("b{g_param}[");
        assert_eq!(k.source.matches(&load).count(), 1, "{}", k.source);
        assert_eq!(ks.len(), 2, "the row sums apart");

        // a sum of another sum's output: not beside it
        let mut g = Graph::default();
        let x = input(&mut g, &[8192, 64]);
        let s1 = sum(&mut g, x, vec![0], &[1, 64]);
        let e = push(
            &mut g,
            Op::Prim(Prim::Expand(vec![8192, 64])),
            vec![s1],
            &[8192, 64],
        );
        let d = binary(&mut g, BinaryOp::Sub, x, e);
        let s2 = sum(&mut g, d, vec![0], &[1, 64]);
        g.outputs = vec![s2];
        assert!(kernels(&g).iter().all(|(_, n)| *n == 1));
    }
}
