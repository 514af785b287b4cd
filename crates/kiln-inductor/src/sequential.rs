//! Sequential composition: a whole small graph as one launch. When every value of a graph is
//! small and every step is a generated kernel, a GPU spends its time launching kernels, not
//! running them (64 layers of 10x10 Linears: ~130 launches of a few µs each for ~100 µs of
//! work in total). `Target::sequential` runs the planned kernels in order inside one block,
//! each member called with block index 0 of 1 so its grid-stride loops cover its whole output
//! with the block's threads, and a barrier between a member and the first later member that
//! reads what it wrote (or overwrites what an earlier member since the last barrier reads).
//!
//! Every member's output is allocated before the launch (the executor allocates a step's
//! outputs together, each a distinct buffer: none is reused while the step runs); a member
//! reading a value produced inside the step gets that value's output buffer as its argument
//! (`Arg::Out`), so the composed kernel's inputs are only what the graph had before it.
//! Planning here is target-neutral; the CUDA text is `codegen/cuda_sequential.rs`.

use kiln_compile::graph::{Graph, NodeId};
use kiln_core::DType;

use crate::backend::{Planned, Target};
use crate::footprint::Footprint;
use crate::runtime::plan::Alloc;

/// Most elements of any value of a graph composed into one launch: a block of a few hundred
/// threads covers each in a few passes of its loops.
const MAX_ELEMS: usize = 4096;

/// Where a member finds one of its buffer arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arg {
    /// The composed kernel's input `i`.
    In(usize),
    /// The composed kernel's output `i` (written by this or an earlier member).
    Out(usize),
}

/// One member of a composition: its kernel, its arguments (its inputs then its outputs, in its
/// own parameter order), and whether a barrier comes before it.
pub struct Member<'k, K> {
    pub kernel: &'k K,
    pub args: Vec<Arg>,
    pub barrier_before: bool,
}

/// A planned kernel and the values it writes.
pub type Step<'k, K> = (&'k K, &'k [(NodeId, Alloc)]);

/// What the composed kernel knows of one of its inputs: a target may read a read-only input
/// from a copy made at the start of the launch (the CUDA target stages them in shared memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputInfo {
    /// Elements the members read, from the buffer's first (a kernel's input is a dense buffer
    /// of its node's shape).
    pub numel: usize,
    pub dtype: DType,
    /// Whether a member writes its storage during the launch (an in-place update): a copy of
    /// it would go stale.
    pub written: bool,
}

/// The members in order, reading `inputs` and writing `outs` (every member's outputs, in order).
pub struct Sequence<'k, K> {
    pub members: Vec<Member<'k, K>>,
    pub inputs: Vec<NodeId>,
    /// `inputs`' sizes, dtypes and whether they are written, in the same order.
    pub input_info: Vec<InputInfo>,
    pub outs: Vec<(NodeId, Alloc)>,
}

/// The planned steps as one composed kernel when the graph qualifies (every step a kernel,
/// every value small and not empty, the target able to compose them), else unchanged.
/// `roots`: each node's storage (`plan::alias_roots`).
pub fn compose<T: Target>(
    t: &T,
    g: &Graph,
    roots: &[NodeId],
    planned: Vec<Planned<T::Kernel>>,
) -> Vec<Planned<T::Kernel>> {
    let small = g.nodes.iter().all(|n| {
        let numel: usize = n.shape.iter().product();
        (1..=MAX_ELEMS).contains(&numel)
    });
    let kernels: Option<Vec<Step<'_, T::Kernel>>> = planned
        .iter()
        .map(|p| match p {
            Planned::Kernel { kernel, outs } => Some((kernel, outs.as_slice())),
            Planned::Extern { .. } => None,
        })
        .collect();
    let Some(kernels) = kernels.filter(|k| small && k.len() >= 2) else {
        return planned;
    };
    let seq = sequence(t, g, roots, &kernels);
    match t.sequential(&seq) {
        Some(kernel) => vec![Planned::Kernel {
            kernel,
            outs: seq.outs,
        }],
        None => planned,
    }
}

/// Arguments and barriers of `kernels` run in order.
pub fn sequence<'k, T: Target>(
    t: &T,
    g: &Graph,
    roots: &[NodeId],
    kernels: &[Step<'k, T::Kernel>],
) -> Sequence<'k, T::Kernel> {
    let mut inputs: Vec<NodeId> = Vec::new();
    let mut outs: Vec<(NodeId, Alloc)> = Vec::new();
    // what the members since the last barrier touch
    let mut since = Footprint::default();
    let mut members = Vec::with_capacity(kernels.len());
    for &(kernel, kouts) in kernels {
        let reads = t.inputs(kernel);
        let mut args = Vec::with_capacity(reads.len() + kouts.len());
        for &r in reads {
            args.push(match outs.iter().position(|o| o.0 == r) {
                Some(i) => Arg::Out(i),
                None => Arg::In(match inputs.iter().position(|&i| i == r) {
                    Some(i) => i,
                    None => {
                        inputs.push(r);
                        inputs.len() - 1
                    }
                }),
            });
        }
        let touches = Footprint::of_kernel(reads, kouts, roots);
        let barrier_before = touches.must_follow(&since);
        if barrier_before {
            since = Footprint::default();
        }
        since.extend(touches);
        for &o in kouts {
            args.push(Arg::Out(outs.len()));
            outs.push(o);
        }
        members.push(Member {
            kernel,
            args,
            barrier_before,
        });
    }
    let written = crate::footprint::overwritten_roots(&outs, roots);
    let input_info = inputs
        .iter()
        .map(|&i| InputInfo {
            numel: g.nodes[i].shape.iter().product(),
            dtype: g.nodes[i].dtype,
            written: written.contains(&roots[i]),
        })
        .collect();
    Sequence {
        members,
        inputs,
        input_info,
        outs,
    }
}

#[cfg(test)]
mod tests {
    use kiln_compile::graph::Op;
    use kiln_core::prim::{BinaryOp, Prim, UnaryOp};
    use kiln_core::DType;

    use super::*;
    use crate::backend::plan_graph;
    use crate::codegen::cuda::{Cuda, CudaKernel};
    use crate::test_graphs::{binary, input, push};

    /// `layers` × (x @ wᵀ + b, tanh) on an [n, n] input, each matmul `[1,n,n] x [1,n,n]`.
    fn mlp(layers: usize, n: usize) -> Graph {
        let mut g = Graph::default();
        let mut x = input(&mut g, &[1, n, n]);
        for _ in 0..layers {
            let w = input(&mut g, &[1, n, n]);
            let wt = push(
                &mut g,
                Op::Prim(Prim::Permute(vec![0, 2, 1])),
                vec![w],
                &[1, n, n],
            );
            let mm = push(&mut g, Op::Prim(Prim::Matmul), vec![x, wt], &[1, n, n]);
            let b = input(&mut g, &[1, n, n]);
            let y = binary(&mut g, BinaryOp::Add, mm, b);
            x = push(
                &mut g,
                Op::Prim(Prim::Unary(UnaryOp::Tanh)),
                vec![y],
                &[1, n, n],
            );
        }
        g.outputs = vec![x];
        g
    }

    fn kernels(g: &Graph) -> Vec<(CudaKernel, Vec<(NodeId, Alloc)>)> {
        plan_graph(&Cuda::new(2), g)
            .into_iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, outs } => Some((kernel, outs)),
                Planned::Extern { .. } => None,
            })
            .collect()
    }

    /// The member calls of a composed kernel's body, and the barriers before them (not the one
    /// after the inputs are staged).
    fn calls(k: &CudaKernel) -> (usize, usize) {
        let body = k.source.split_once('{').map_or("", |b| b.1);
        let lines: Vec<&str> = body.lines().collect();
        let is_call = |l: &str| l.contains(", 0, 1);");
        let barriers = lines
            .windows(2)
            .filter(|w| w[1].contains("__syncthreads();") && w[0].trim() != "}")
            .count();
        (lines.iter().filter(|l| is_call(l)).count(), barriers)
    }

    /// The composed kernel's inputs copied into shared memory (their indices, once each), and
    /// whether any member is handed an input's global pointer.
    fn staged(k: &CudaKernel) -> (Vec<usize>, bool) {
        let body = k.source.split_once('{').map_or("", |b| b.1);
        let mut copies: Vec<usize> = body
            .lines()
            .filter_map(|l| l.split_once(" ? x"))
            .filter_map(|(_, i)| i.split('[').next()?.parse().ok())
            .collect();
        copies.dedup();
        let global = body.lines().filter(|l| l.contains(", 0, 1);")).any(|l| {
            l.split(|c: char| !c.is_alphanumeric())
                .any(|w| w.len() > 1 && w.starts_with('x') && w[1..].parse::<usize>().is_ok())
        });
        (copies, global)
    }

    /// Every input (x, weights, biases: 17 of 100 f32) is copied into shared memory before the
    /// first member, in 16-byte aligned regions, and the members read only those copies; with
    /// room for two, the other fifteen are read from global memory.
    #[test]
    fn a_composition_reads_its_inputs_from_shared_memory() {
        let g = mlp(8, 10);
        let (k, _) = &kernels(&g)[0];
        assert_eq!(k.shared, 17 * 400);
        assert_eq!(staged(k), ((0..17).collect(), false));
        let small = Cuda {
            shared_per_block: (8 << 10) + 1000,
            ..Cuda::new(2)
        };
        let Planned::Kernel { kernel, .. } = &plan_graph(&small, &g)[0] else {
            panic!("an extern step");
        };
        assert_eq!(kernel.shared, 800);
        assert_eq!(staged(kernel), (vec![0, 1], true));
        // 40x40 inputs: seven rounds of the block's 256 threads each, the loads of a batch of
        // 32 before its stores
        let g = mlp(2, 40);
        let (k, _) = &kernels(&g)[0];
        assert!(k.source.contains("x0[e + 1536]") && !k.source.contains("x0[e + 1792]"));
        let first_store = k.source.find("if (e + ").expect("stores");
        let loads_before = k.source[..first_store].matches(" ? x").count();
        // 35 copies (5 inputs x 7 rounds): the first batch holds 32
        assert_eq!(loads_before, 32, "a batch of loads, then stores");
    }

    /// Adam's shape: the step counts and parameters updated in place are the members' outputs
    /// (read and written through global memory), never staged; what the members only read
    /// (the constant one, the gradients) is.
    #[test]
    fn buffers_updated_in_place_stay_in_global_memory() {
        let mut g = Graph::default();
        crate::test_graphs::counted_updates(&mut g, kiln_core::Device::Cuda(0), &[&[4, 4], &[8]]);
        let ks = kernels(&g);
        assert_eq!(ks.len(), 1, "one launch");
        let (k, outs) = &ks[0];
        let in_place = outs
            .iter()
            .filter(|o| matches!(o.1, Alloc::InPlace(_)))
            .count();
        assert_eq!(in_place, 4, "two counts and two parameters in place");
        assert!(k
            .inputs
            .iter()
            .all(|i| !outs.iter().any(|o| o.1 == Alloc::InPlace(*i))));
        assert_eq!(staged(k), ((0..k.inputs.len()).collect(), false));
        assert_eq!(k.inputs.len(), 3, "the constant one and two gradients");
    }

    /// Eight 10x10 layers: eight generated matmuls (each reading the previous layer's bias add
    /// and tanh in its loads) and the output's bias add and tanh, one launch with a barrier
    /// before every member but the first (each reads the one before).
    #[test]
    fn a_small_mlp_is_one_launch_with_a_barrier_per_dependency() {
        let g = mlp(8, 10);
        let ks = kernels(&g);
        assert_eq!(ks.len(), 1, "one launch");
        let (k, outs) = &ks[0];
        assert_eq!(outs.len(), 9, "every kernel's value is the step's output");
        assert_eq!(calls(k), (9, 8));
        assert_eq!((k.grid, k.block), ([1, 1, 1], 256));
        // the members read the graph's inputs (x, weights, biases), nothing produced inside
        assert!(k
            .inputs
            .iter()
            .all(|&i| matches!(g.nodes[i].op, Op::Input(_))));
        assert!(!k.device_fns.iter().any(|(_, d)| d.contains("__restrict__")));
        assert_eq!(outs.last().map(|o| o.1), Some(Alloc::Output));
        assert!(outs[..8].iter().all(|o| o.1 == Alloc::Pooled));
    }

    /// Kernels reading only graph inputs need no barrier between them; the one reading both
    /// of their values gets one, and its arguments are their output buffers.
    #[test]
    fn barriers_only_where_a_member_reads_an_earlier_one() {
        let mut g = Graph::default();
        let a = input(&mut g, &[4, 6]);
        let b = input(&mut g, &[6, 4]);
        let x = push(
            &mut g,
            Op::Prim(Prim::Unary(UnaryOp::Exp)),
            vec![a],
            &[4, 6],
        );
        let y = push(
            &mut g,
            Op::Prim(Prim::Unary(UnaryOp::Exp)),
            vec![b],
            &[6, 4],
        );
        let yt = push(
            &mut g,
            Op::Prim(Prim::Permute(vec![1, 0])),
            vec![y],
            &[4, 6],
        );
        let z = binary(&mut g, BinaryOp::Mul, x, yt);
        g.outputs = vec![x, y, z];
        let t = Cuda::new(2);
        let planned = plan_graph(&t, &g);
        let ks = kernels(&g);
        assert_eq!(ks.len(), 1, "{} steps", planned.len());
        assert_eq!(calls(&ks[0].0), (3, 1));
        // the barrier sits before the reader, which reads outputs 0 and 1
        let body = ks[0]
            .0
            .source
            .split_once('{')
            .map_or("", |b| b.1)
            .to_string();
        let last_call = body.lines().rfind(|l| l.contains(", 0, 1);")).unwrap_or("");
        assert!(body.find("__syncthreads()") < body.find(last_call));
        assert!(
            last_call.contains("y0") && last_call.contains("y1"),
            "{last_call}"
        );
        // and the planning says so, in member order
        let ks2 = [(&ks[0].0, ks[0].1.as_slice())];
        let seq = sequence(&t, &g, &(0..g.nodes.len()).collect::<Vec<_>>(), &ks2);
        assert!(!seq.members[0].barrier_before);
    }

    /// The graph `kiln-bench regional`'s model (here 4 blocks) traces to under no_grad, planned
    /// for a GPU: every matmul generated, one launch.
    #[test]
    fn the_traced_regional_model_is_one_launch() -> kiln_core::Result<()> {
        use kiln_core::Tensor;
        let lin = || -> kiln_core::Result<(Tensor, Tensor)> {
            Ok((
                Tensor::randn(&[10, 10], DType::F32)?,
                Tensor::randn(&[10], DType::F32)?,
            ))
        };
        let first = lin()?;
        let blocks: Vec<((Tensor, Tensor), (Tensor, Tensor))> = (0..4)
            .map(|_| Ok((lin()?, lin()?)))
            .collect::<kiln_core::Result<_>>()?;
        let model = move |a: &[Tensor]| -> kiln_core::Result<Vec<Tensor>> {
            let mut h = a[0].linear(&first.0, Some(&first.1))?;
            for ((w1, b1), (w2, b2)) in &blocks {
                let x = h.linear(w1, Some(b1))?.relu()?.sigmoid()?;
                h = x.linear(w2, Some(b2))?.relu()?;
            }
            Ok(vec![h])
        };
        let x = Tensor::randn(&[10, 10], DType::F32)?;
        let graph = crate::test_graphs::traced(model, &[x])?;
        let planned = plan_graph(&Cuda::new(2), &graph);
        assert_eq!(planned.len(), 1, "one step");
        let Planned::Kernel { kernel, outs } = &planned[0] else {
            panic!("an extern step");
        };
        // 9 matmuls and the output's bias add and ReLU, each after the one it reads
        assert_eq!(calls(kernel), (outs.len(), outs.len() - 1));
        assert_eq!(outs.len(), 10);
        Ok(())
    }

    /// 200 layers: 201 outputs and 401 inputs (x, weights, biases), over the 512 parameters
    /// a launch takes: a launch per kernel instead.
    #[test]
    fn a_composition_over_the_parameter_limit_is_not_made() {
        assert_eq!(kernels(&mlp(100, 4)).len(), 1);
        assert!(kernels(&mlp(200, 4)).len() > 1);
    }

    #[test]
    fn large_values_and_extern_steps_keep_their_own_launches() {
        // a 100x100 value: too large for one block
        let ks = kernels(&mlp(2, 100));
        assert!(ks.len() > 1, "{} launches", ks.len());
        // K = 128: the matmuls stay cuBLAS calls, so the kernels between them stay apart
        let mut g = Graph::default();
        let x = input(&mut g, &[1, 4, 128]);
        let w = input(&mut g, &[1, 128, 4]);
        let e = push(
            &mut g,
            Op::Prim(Prim::Unary(UnaryOp::Exp)),
            vec![x],
            &[1, 4, 128],
        );
        let mm = push(&mut g, Op::Prim(Prim::Matmul), vec![e, w], &[1, 4, 4]);
        let y = push(
            &mut g,
            Op::Prim(Prim::Unary(UnaryOp::Tanh)),
            vec![mm],
            &[1, 4, 4],
        );
        g.outputs = vec![y];
        let planned = plan_graph(&Cuda::new(2), &g);
        assert_eq!(planned.len(), 3);
        assert!(matches!(planned[1], Planned::Extern { .. }));
    }
}
