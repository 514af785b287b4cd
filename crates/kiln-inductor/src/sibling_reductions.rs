//! Sibling reductions: reductions over the same iteration space — one operand shape, the same
//! reduced dims, one output shape — computed by one kernel with an accumulator each, so the
//! operands they share are loaded once (Inductor fuses such reductions too). Batch norm's
//! backward is the case that matters: the sums of the gradient, of the gradient times the
//! normalized input and of the gradient times the centered input all walk the same activation
//! and read the same two tensors; as separate kernels each reads both.
//!
//! A single-output reduction kernel moves up to join the earliest sibling group it may run
//! with, by `footprint.rs`'s rule (as `horizontal.rs` moves kernels): nothing it reads is
//! produced at or after that point, and no storage it reads or the steps between read is
//! overwritten in between. Only kernels move, and only earlier.

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::Prim;

use crate::backend::{Planned, Target};
use crate::footprint::Footprint;
use crate::ir::lower::Kind;
use crate::runtime::plan::Alloc;
use crate::schedule::Schedule;

/// How many steps back a reduction looks for its siblings (bounds planning time).
const LOOKBACK: usize = 64;
/// Most reductions one kernel computes (registers: an f64 accumulator each).
const MAX_SIBLINGS: usize = 8;

/// What siblings share: the operand's shape, the reduced dims and the output's shape.
type Space = (Vec<usize>, Vec<usize>, Vec<usize>);

/// The iteration space of the reduction a planned kernel computes, when it computes exactly one
/// `Reduce` (not a matmul) into a buffer of its own.
fn space_of<K>(g: &Graph, sched: &Schedule, p: &Planned<K>) -> Option<Space> {
    let Planned::Kernel { outs, .. } = p else {
        return None;
    };
    let [(node, Alloc::Pooled | Alloc::Output)] = outs[..] else {
        return None;
    };
    if sched.kinds[node] != Kind::Reduction {
        return None;
    }
    let n = &g.nodes[node];
    let Op::Prim(Prim::Reduce { dims, .. }) = &n.op else {
        return None;
    };
    Some((
        g.nodes[n.args[0]].shape.clone(),
        dims.clone(),
        n.shape.clone(),
    ))
}

struct Entry<K> {
    planned: Planned<K>,
    touches: Footprint,
    /// For a reduction kernel: its iteration space (its roots are its outputs).
    space: Option<Space>,
}

/// The planned steps with sibling reductions joined into one kernel each (unchanged for a
/// target without such kernels). `roots`: each node's storage (`plan::alias_roots`).
pub fn group<T: Target>(
    t: &T,
    g: &Graph,
    sched: &Schedule,
    roots: &[NodeId],
    planned: Vec<Planned<T::Kernel>>,
) -> Vec<Planned<T::Kernel>> {
    let mut entries: Vec<Entry<T::Kernel>> = Vec::with_capacity(planned.len());
    for p in planned {
        let touches = match &p {
            Planned::Kernel { kernel, outs } => Footprint::of_kernel(t.inputs(kernel), outs, roots),
            Planned::Extern { node } => Footprint::of_extern(g, *node, roots),
        };
        let space = space_of(g, sched, &p);
        let e = Entry {
            planned: p,
            touches,
            space,
        };
        if let Some(j) = sibling_group(&entries, &e) {
            if let Some(joined) = join(t, g, sched, &entries[j], &e) {
                entries[j].planned = joined;
                entries[j].touches.extend(e.touches);
                continue;
            }
        }
        entries.push(e);
    }
    entries.into_iter().map(|e| e.planned).collect()
}

/// The earliest entry `e` can join: a group of its space with room, with nothing between it
/// and `e` that `e` must follow (`footprint.rs`).
fn sibling_group<K>(entries: &[Entry<K>], e: &Entry<K>) -> Option<usize> {
    let space = e.space.as_ref()?;
    let mut at = None;
    for (j, earlier) in entries.iter().enumerate().rev().take(LOOKBACK) {
        if e.touches.must_follow(&earlier.touches) {
            break;
        }
        let room = match &earlier.planned {
            Planned::Kernel { outs, .. } => outs.len() < MAX_SIBLINGS,
            Planned::Extern { .. } => false,
        };
        if earlier.space.as_ref() == Some(space) && room {
            at = Some(j);
        }
    }
    at
}

/// The kernel computing `group`'s reductions and `e`'s, with their outputs; `None` where the
/// target has no such kernel.
fn join<T: Target>(
    t: &T,
    g: &Graph,
    sched: &Schedule,
    group: &Entry<T::Kernel>,
    e: &Entry<T::Kernel>,
) -> Option<Planned<T::Kernel>> {
    let (Planned::Kernel { outs: have, .. }, Planned::Kernel { outs: more, .. }) =
        (&group.planned, &e.planned)
    else {
        return None;
    };
    let outs: Vec<(NodeId, Alloc)> = have.iter().chain(more).copied().collect();
    let members: Vec<NodeId> = outs.iter().map(|o| o.0).collect();
    let kernel = t.sibling_reductions(g, sched, &members)?;
    Some(Planned::Kernel { kernel, outs })
}

#[cfg(test)]
mod tests {
    use kiln_core::prim::BinaryOp;

    use super::*;
    use crate::codegen::cuda::Cuda;
    // the graphs here are too large for one block: `sequential.rs` leaves them alone
    use crate::test_graphs::{binary, cuda_kernel_outputs, expand, input, kernels, sum};

    /// Whether a planned kernel of `g`, or a member of one, keeps several accumulators (a
    /// horizontal launch of independent reductions has several outputs, one accumulator each).
    fn any_sibling_kernel(g: &Graph) -> bool {
        kernels(&Cuda::new(2), g).iter().any(|(kernel, _)| {
            let members = kernel.device_fns.iter().map(|(_, f)| f.as_str());
            std::iter::once(kernel.source.as_str())
                .chain(members)
                .any(|src| src.contains("double acc1 ="))
        })
    }

    /// Batch norm's backward sums over one activation: the gradient, the gradient times the
    /// input, the gradient times the input squared. One kernel with three outputs, whose loads
    /// of the two tensors are shared.
    #[test]
    fn sums_over_one_space_share_a_kernel() {
        let mut g = Graph::default();
        let x = input(&mut g, &[4096, 64]);
        let grad = input(&mut g, &[4096, 64]);
        let gx = binary(&mut g, BinaryOp::Mul, grad, x);
        let gxx = binary(&mut g, BinaryOp::Mul, gx, x);
        g.outputs = vec![
            sum(&mut g, grad, &[0]),
            sum(&mut g, gx, &[0]),
            sum(&mut g, gxx, &[0]),
        ];
        assert_eq!(cuda_kernel_outputs(&g), vec![3]);
        assert!(any_sibling_kernel(&g));
        let planned = kernels(&Cuda::new(2), &g);
        let Some((kernel, _)) = planned.first() else {
            panic!("no kernel planned");
        };
        assert_eq!(kernel.inputs.len(), 2, "each tensor is one argument");
        // each operand loaded once per element, for all three accumulators
        assert_eq!(kernel.source.matches("b0[").count(), 1, "{}", kernel.source);
        assert_eq!(kernel.source.matches("b1[").count(), 1, "{}", kernel.source);
        assert!(kernel.source.contains("out2["));
    }

    /// A sum reading another's result (batch norm's second pass) runs after it, in a kernel
    /// of its own; sums over other dims are not siblings.
    #[test]
    fn dependent_or_differently_shaped_reductions_stay_apart() {
        let mut g = Graph::default();
        let x = input(&mut g, &[4096, 64]);
        let grad = input(&mut g, &[4096, 64]);
        let first = sum(&mut g, grad, &[0]);
        let wide = expand(&mut g, first, &[4096, 64]);
        let scaled = binary(&mut g, BinaryOp::Mul, x, wide);
        let second = sum(&mut g, scaled, &[0]);
        let rows = sum(&mut g, grad, &[1]);
        g.outputs = vec![first, second, rows];
        let k = cuda_kernel_outputs(&g);
        assert_eq!(k.iter().sum::<usize>(), 3);
        assert!(!any_sibling_kernel(&g), "{k:?}");
    }
}
