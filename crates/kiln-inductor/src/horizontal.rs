//! Horizontal fusion: independent kernels launched as one. On a GPU every launch costs a few
//! microseconds of host and device time whatever it computes, so an optimizer step over many
//! parameters, or the small scalar kernels of a graph, cost their launches more than their
//! bytes; `Target::horizontal` runs several kernels' blocks in one launch (the multi-tensor
//! kernel PyTorch's fused optimizers hand-write, here for any independent kernels).
//!
//! A planned kernel moves up to join the earliest kernel it can run beside: nothing it
//! reads is produced at or after that point, it overwrites no storage read there, and no step
//! there overwrites storage it reads. Extern steps keep their order (random ops draw in order),
//! only kernels move, and only earlier: a value is never needed before it is computed. The
//! earliest, not the closest: a chain of small kernels each feeding one large one (an
//! optimizer's scalar bias corrections, each read by its parameter's update) then gathers into
//! two launches, where joining the closest would pair each update with the next scalar.

use kiln_compile::graph::{Graph, NodeId};

use crate::backend::{Planned, Side, Target};
use crate::codegen::cuda::STATIC_SHARED_MAX;
use crate::footprint::Footprint;
use crate::runtime::plan::Alloc;

/// How many steps back a kernel looks for a launch to join (bounds planning time).
const LOOKBACK: usize = 64;
/// Most kernels in one launch. A launch's kernels compile as one unit (they are its device
/// functions), so its size bounds how finely a cold compile spreads over threads: 64 made two
/// 190 KB units of DenseNet-121's backward that took 6-9 s each under NVRTC (the compile's
/// critical path); at 16 its cold compile went 9.7 → 8.4 s and its compiled optimizer's 19.2 →
/// 11.9 s, with the same step times.
const MAX_MEMBERS: usize = 16;
/// Most parameters of one launch (4 KiB of pointers: what every CUDA driver accepts).
const MAX_PARAMS: usize = kiln_core::device::MAX_KERNEL_PARAMS;

/// A step being planned: an extern, or the kernels one launch will run.
struct Entry<K> {
    step: Step<K>,
    touches: Footprint,
    /// What the launch holds for its kernels, for kernels that can share one: their block size,
    /// parameters and static shared memory, summed over its members.
    side: Option<Side>,
}

enum Step<K> {
    Extern(NodeId),
    Kernels(Vec<(K, Vec<(NodeId, Alloc)>)>),
}

impl<K> Entry<K> {
    fn new<T: Target<Kernel = K>>(t: &T, g: &Graph, roots: &[NodeId], p: Planned<K>) -> Self {
        match p {
            Planned::Extern { node } => Entry {
                touches: Footprint::of_extern(g, node, roots),
                side: None,
                step: Step::Extern(node),
            },
            Planned::Kernel { kernel, outs } => {
                // a launch with an empty output is skipped whole (`runtime/exec.rs`)
                let empty = outs.iter().any(|&(n, _)| g.nodes[n].shape.contains(&0));
                Entry {
                    side: if empty { None } else { t.side_by_side(&kernel) },
                    touches: Footprint::of_kernel(t.inputs(&kernel), &outs, roots),
                    step: Step::Kernels(vec![(kernel, outs)]),
                }
            }
        }
    }

    fn joins(&self, other: &Entry<K>) -> bool {
        let (Some(a), Some(b), Step::Kernels(members)) = (self.side, other.side, &self.step) else {
            return false;
        };
        // the members' `__shared__` arrays are all declared in the launch: past CUDA's 48 KiB
        // its unit fails to compile, and with it every kernel of the unit (max-autotune's
        // 1024-thread candidates of DenseNet-121's backward joined column reductions into 80 KiB,
        // and its whole backward ran on the interpreter)
        a.block == b.block
            && a.params + b.params <= MAX_PARAMS
            && a.shared.saturating_add(b.shared) <= STATIC_SHARED_MAX
            && members.len() < MAX_MEMBERS
    }

    fn absorb(&mut self, other: Entry<K>) {
        let (Step::Kernels(members), Step::Kernels(more)) = (&mut self.step, other.step) else {
            return;
        };
        members.extend(more);
        self.touches.extend(other.touches);
        if let (Some(a), Some(b)) = (&mut self.side, other.side) {
            a.params += b.params;
            a.shared = a.shared.saturating_add(b.shared);
        }
    }

    fn finish<T: Target<Kernel = K>>(self, t: &T) -> Vec<Planned<K>> {
        let members = match self.step {
            Step::Extern(node) => return vec![Planned::Extern { node }],
            Step::Kernels(m) => m,
        };
        if members.len() > 1 {
            let refs: Vec<&K> = members.iter().map(|m| &m.0).collect();
            if let Some(kernel) = t.horizontal(&refs) {
                let outs = members.into_iter().flat_map(|m| m.1).collect();
                return vec![Planned::Kernel { kernel, outs }];
            }
        }
        // one kernel, or members no launch can hold together: independent, in any order
        members
            .into_iter()
            .map(|(kernel, outs)| Planned::Kernel { kernel, outs })
            .collect()
    }
}

/// The planned steps with independent kernels joined into shared launches (unchanged for a
/// target without horizontal kernels). `roots`: each node's storage (`plan::alias_roots`).
pub fn fuse<T: Target>(
    t: &T,
    g: &Graph,
    roots: &[NodeId],
    planned: Vec<Planned<T::Kernel>>,
) -> Vec<Planned<T::Kernel>> {
    let mut entries: Vec<Entry<T::Kernel>> = Vec::with_capacity(planned.len());
    for p in planned {
        let e = Entry::new(t, g, roots, p);
        let mut at = None;
        if e.side.is_some() {
            for j in (0..entries.len()).rev().take(LOOKBACK) {
                if e.touches.must_follow(&entries[j].touches) {
                    break;
                }
                if entries[j].joins(&e) {
                    at = Some(j);
                }
            }
        }
        match at {
            Some(j) => entries[j].absorb(e),
            None => entries.push(e),
        }
    }
    entries.into_iter().flat_map(|e| e.finish(t)).collect()
}

#[cfg(test)]
mod tests {
    use kiln_compile::graph::Op;
    use kiln_core::prim::{BinaryOp, Prim, ReduceOp};

    use super::*;
    use crate::backend::plan_graph;
    use crate::codegen::cuda::Cuda;
    use crate::test_graphs::{binary, input, push};

    /// (kernel launches, values each computes) of a graph planned for a GPU. The graphs here
    /// have a value too large for the whole graph to run in one block (`sequential.rs`).
    fn launches(g: &Graph) -> Vec<usize> {
        crate::test_graphs::cuda_kernel_outputs(g)
    }

    /// An optimizer-like step: each parameter of its own shape updated in place from its
    /// gradient. The updates are independent: one launch.
    #[test]
    fn independent_updates_share_one_launch() {
        let mut g = Graph::default();
        for shape in [&[128usize, 64][..], &[10], &[5, 5, 5]] {
            let index = g.num_inputs;
            let p = input(&mut g, shape);
            let grad = input(&mut g, shape);
            let new = binary(&mut g, BinaryOp::Sub, p, grad);
            g.mutated_inputs.push((g.outputs.len(), index));
            g.outputs.push(new);
        }
        assert_eq!(launches(&g), vec![3]);
        let planned = plan_graph(&Cuda::new(2), &g);
        let Some(Planned::Kernel { kernel, outs }) = planned.first() else {
            panic!("no kernel planned");
        };
        assert!(outs.iter().all(|o| matches!(o.1, Alloc::InPlace(_))));
        // three shapes, three member functions, one dispatcher branch each
        assert_eq!(kernel.device_fns.len(), 3);
        assert_eq!(kernel.source.matches("if (kbid <").count(), 3);
    }

    /// Adam's shape: each parameter's step count bumped in place (a scalar kernel), then the
    /// parameter updated reading the new count. The counts gather in one launch and the
    /// updates in another; joining the closest launch instead would pair each update with the
    /// next count, a launch per parameter.
    #[test]
    fn scalar_then_update_chains_gather_in_two_launches() {
        let mut g = Graph::default();
        let shapes: [&[usize]; 4] = [&[128, 64], &[10], &[5, 5, 5], &[7]];
        crate::test_graphs::counted_updates(&mut g, kiln_core::Device::Cuda(0), &shapes);
        assert_eq!(launches(&g), vec![4, 4]);
    }

    /// Kernels join a launch only while their `__shared__` arrays fit in it together: 16
    /// independent column sums (channels-last batch norm's second pass) at max-autotune's
    /// 1024-thread candidate declare 4 KiB each, 64 KiB in all, over the 48 KiB a launch may
    /// declare; they share launches that each stay within it.
    #[test]
    fn launches_hold_their_members_static_shared_memory() {
        use crate::codegen::cuda::{static_shared_bytes, TuneConfig};
        let mut g = Graph::default();
        // channels of 16 sizes: no two sums are one kernel's siblings
        for i in 0..16 {
            let c = 64 + 4 * i;
            let x = input(&mut g, &[4096, c]);
            let r = push(
                &mut g,
                Op::Prim(Prim::Reduce {
                    op: ReduceOp::Sum,
                    dims: vec![0],
                }),
                vec![x],
                &[1, c],
            );
            g.outputs.push(r);
        }
        let cfg = TuneConfig {
            block: 1024,
            waves: 4,
            ..TuneConfig::default()
        };
        let t = Cuda {
            cfg,
            ..Cuda::new(132)
        };
        let alone = Cuda {
            horizontal: false,
            ..t
        };
        let each: Vec<u32> = plan_graph(&alone, &g)
            .iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, .. } => Some(static_shared_bytes(kernel)),
                Planned::Extern { .. } => None,
            })
            .collect();
        assert_eq!(each.len(), 16);
        assert!(each.iter().sum::<u32>() > STATIC_SHARED_MAX, "{each:?}");
        let launched: Vec<(u32, usize)> = plan_graph(&t, &g)
            .iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, outs } => Some((static_shared_bytes(kernel), outs.len())),
                Planned::Extern { .. } => None,
            })
            .collect();
        assert!(launched.len() > 1 && launched.len() < 16, "{launched:?}");
        assert_eq!(launched.iter().map(|l| l.1).sum::<usize>(), 16);
        assert!(
            launched.iter().all(|l| l.0 <= STATIC_SHARED_MAX),
            "{launched:?}"
        );
    }

    /// A kernel reading another's value stays after it.
    #[test]
    fn a_reader_of_a_value_waits_for_it() {
        let mut g = Graph::default();
        let a = input(&mut g, &[80, 64]);
        let b = input(&mut g, &[80, 64]);
        let c = input(&mut g, &[64]);
        let x = binary(&mut g, BinaryOp::Mul, a, b);
        // a broadcast read of x: not the same loop as x, and it needs x computed
        let xt = push(
            &mut g,
            Op::Prim(Prim::Permute(vec![1, 0])),
            vec![x],
            &[64, 80],
        );
        let s = push(
            &mut g,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::Sum,
                dims: vec![1],
            }),
            vec![xt],
            &[64],
        );
        let y = binary(&mut g, BinaryOp::Add, s, c);
        g.outputs = vec![x, y];
        assert_eq!(launches(&g).len(), 3);
    }

    /// A kernel overwriting a parameter in place does not run beside a kernel still reading the
    /// parameter's old values.
    #[test]
    fn an_in_place_write_waits_for_readers_of_the_old_value() {
        let mut g = Graph::default();
        let p = input(&mut g, &[128, 64]);
        let grad = input(&mut g, &[128, 64]);
        let norm = push(
            &mut g,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::Sum,
                dims: vec![1],
            }),
            vec![p],
            &[128],
        );
        let new = binary(&mut g, BinaryOp::Sub, p, grad);
        g.outputs = vec![norm, new];
        g.mutated_inputs = vec![(1, 0)];
        assert_eq!(launches(&g), vec![1, 1]);
        let planned = plan_graph(&Cuda::new(2), &g);
        assert!(planned.iter().any(|s| matches!(
            s,
            Planned::Kernel { outs, .. } if matches!(outs[0].1, Alloc::InPlace(_))
        )));
    }
}
