//! Steps that compute the same thing on other buffers generate one kernel. A model of 64
//! identical blocks has 64 copies of each block's steps: the same fused ops over the same shapes,
//! reading buffers of the same shapes and dtypes in the same pattern. Their kernels are the same
//! text (a kernel names its buffers by argument position, `b0, b1, ...`), so the first is
//! generated and the others are that kernel with their own buffers bound to its arguments. The
//! text-hash dedup further down (one NVRTC build per distinct kernel) already made the builds
//! happen once; this makes the generation happen once too (the 64-layer model's planning was
//! 70% kernel generation).

use std::collections::HashMap;
use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId, Op};

use crate::schedule::Schedule;
use kiln_compile::fast_hash::Fast;

/// What a step's kernel is generated from: the fused ops from its root down to the buffers it
/// reads, in a canonical order — each op with its parameters, shape, dtype, kind and operands
/// (as canonical positions), each buffer with its shape and dtype — and the buffers themselves
/// in that order. Two steps with equal keys generate equal kernels, reading the buffers at
/// equal positions.
pub(crate) struct Cone {
    pub(crate) key: Vec<u8>,
    pub(crate) buffers: Vec<NodeId>,
}

impl Cone {
    /// The cone of the kernel rooted at `root` (a pointwise value or a reduction) under
    /// `sched`: nodes the kernel computes are those not realized (and the root), the rest are
    /// buffers it loads. Written as bytes, not text: every kernel step of DenseNet-121's
    /// graphs takes one, and formatted shapes made it a fifth of their planning.
    pub(crate) fn of(g: &Graph, sched: &Schedule, root: NodeId) -> Cone {
        let mut key = Vec::new();
        let mut canonical: HashMap<NodeId, u32, Fast> = HashMap::default();
        let mut buffers = Vec::new();
        let mut op = String::new();
        let shape = |key: &mut Vec<u8>, dims: &[usize]| {
            key.push(dims.len() as u8);
            for &d in dims {
                key.extend_from_slice(&(d as u64).to_le_bytes());
            }
        };
        // an explicit post-order walk: fused chains can be deep
        let mut stack = vec![(root, false)];
        while let Some((id, expanded)) = stack.pop() {
            if canonical.contains_key(&id) {
                continue;
            }
            let n = &g.nodes[id];
            let buffer = id != root && (sched.realized[id] || matches!(n.op, Op::Input(_)));
            if buffer {
                key.extend_from_slice(&[b'b', n.dtype as u8]);
                shape(&mut key, &n.shape);
                canonical.insert(id, canonical.len() as u32);
                buffers.push(id);
                continue;
            }
            if !expanded {
                stack.push((id, true));
                stack.extend(n.args.iter().rev().map(|&a| (a, false)));
                continue;
            }
            op.clear();
            let _ = write!(op, "{:?}", n.op);
            key.extend_from_slice(&[b'n', n.dtype as u8, sched.kinds[id] as u8]);
            key.extend_from_slice(&(op.len() as u32).to_le_bytes());
            key.extend_from_slice(op.as_bytes());
            shape(&mut key, &n.shape);
            key.extend_from_slice(&(n.args.len() as u32).to_le_bytes());
            for a in &n.args {
                key.extend_from_slice(&canonical[a].to_le_bytes());
            }
            canonical.insert(id, canonical.len() as u32);
        }
        Cone { key, buffers }
    }
}

/// Distinct kernels from which one thread is given others to generate: below this, spawning
/// costs more than it saves (a kernel takes tens of microseconds to generate).
const PARALLEL_FROM: usize = 64;
/// Distinct kernels per generating thread at least.
const PER_THREAD: usize = 32;

/// The kernel of each step (`None` where `cones` has none: an extern step). Each distinct cone's
/// kernel is generated once (`generate`, by step index), on several threads when there are
/// many (steps are independent: DenseNet-121's training step has ~500); a step repeating an
/// earlier cone gets that kernel rebound to its own buffers (`rebind`, with `inputs` telling
/// which buffers a kernel reads).
pub(crate) fn kernels<K: Clone + Send>(
    cones: &[Option<Cone>],
    generate: impl Fn(usize) -> K + Sync,
    inputs: impl Fn(&K) -> &[NodeId],
    rebind: impl Fn(&K, Vec<NodeId>) -> K,
) -> Vec<Option<K>> {
    let mut first: HashMap<&[u8], usize, Fast> = HashMap::default();
    let mut distinct = Vec::new();
    for (i, c) in cones.iter().enumerate() {
        if let Some(c) = c {
            first.entry(c.key.as_slice()).or_insert_with(|| {
                distinct.push(i);
                i
            });
        }
    }
    let mut made: Vec<Option<K>> = vec![None; cones.len()];
    for (i, k) in generate_all(&distinct, &generate) {
        made[i] = Some(k);
    }
    let mut out = Vec::with_capacity(cones.len());
    for (i, c) in cones.iter().enumerate() {
        let Some(c) = c else {
            out.push(None);
            continue;
        };
        let j = first[c.key.as_slice()];
        let k = match (&made[j], &cones[j]) {
            (Some(k), _) if i == j => k.clone(),
            (Some(k), Some(from)) => {
                let at: Option<Vec<NodeId>> = inputs(k)
                    .iter()
                    .map(|id| from.buffers.iter().position(|b| b == id))
                    .map(|p| p.map(|p| c.buffers[p]))
                    .collect();
                match at {
                    Some(at) => rebind(k, at),
                    // an input outside the cone's buffers: generated for itself
                    None => generate(i),
                }
            }
            _ => generate(i),
        };
        out.push(Some(k));
    }
    out
}

/// `generate` for each of `steps`, with each step: on one thread, or on several taking every
/// n-th step (neighbours differ most in size: a block's convolution glue, then its norm).
fn generate_all<K: Send>(
    steps: &[usize],
    generate: &(impl Fn(usize) -> K + Sync),
) -> Vec<(usize, K)> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (steps.len() / PER_THREAD).min(cores);
    if steps.len() < PARALLEL_FROM || threads < 2 {
        return steps.iter().map(|&i| (i, generate(i))).collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    steps
                        .iter()
                        .skip(t)
                        .step_by(threads)
                        .map(|&i| (i, generate(i)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use kiln_compile::graph::Graph;
    use kiln_core::{DType, Tensor};

    use crate::backend::{kernels_of, prepare, schedule_for, Target};
    use crate::codegen::cuda::Cuda;
    use crate::ir::lower::Kind;
    use crate::schedule::Step;
    use crate::test_graphs::{traced, C_TARGET};

    /// Three blocks, two alike and one over other shapes, each a pointwise chain, a padded
    /// read, a softmax-like reduction pair and a value reading one buffer twice: every step's
    /// kernel must be the one generated for it directly, text and inputs.
    fn blocks(x: &[Tensor]) -> kiln_core::Result<Vec<Tensor>> {
        let mut outs = Vec::new();
        for (a, b) in [(&x[0], &x[1]), (&x[2], &x[3]), (&x[4], &x[5])] {
            let h = a.mul(b)?.add(1.0)?.tanh()?;
            let p = h.pad(&[1, 1, 0, 0], 0.0)?.narrow(1, 1, h.shape()[1])?;
            let s = p.sub(&p.max(&[1], true)?)?.exp()?;
            let y = s.div(&s.sum(&[1], true)?)?.mul(a)?.add(a)?;
            outs.push(y);
        }
        Ok(outs)
    }

    /// Every kernel step of `g` planned by `t` against a direct generation; the number of
    /// kernels compared and of distinct cones.
    fn compare<T: Target>(
        t: &T,
        g: &Graph,
        name: &str,
        text: impl Fn(&T::Kernel) -> String,
    ) -> (usize, usize) {
        let g = prepare(g).expect("a traced graph is prepared");
        let sched = schedule_for(t, &g);
        let (steps, kernels) = kernels_of(t, &g, &sched);
        let (mut compared, mut keys) = (0, std::collections::HashSet::new());
        for (s, k) in steps.iter().zip(&kernels) {
            let (Step::Kernel { node }, Some(k)) = (s, k) else {
                continue;
            };
            keys.insert(super::Cone::of(&g, &sched, *node).key);
            let direct = match sched.kinds[*node] {
                Kind::Reduction => t.reduction(&g, &sched, *node),
                _ => t.pointwise(&g, &sched, &[(*node, None)]).0,
            };
            assert_eq!(text(k), text(&direct), "{name}: step {node}'s text");
            assert_eq!(
                t.inputs(k),
                t.inputs(&direct),
                "{name}: step {node}'s inputs"
            );
            compared += 1;
        }
        (compared, keys.len())
    }

    fn check<T: Target>(t: &T, g: &Graph, name: &str, text: impl Fn(&T::Kernel) -> String) {
        let (compared, cones) = compare(t, g, name, text);
        assert!(compared >= 9, "{name}: only {compared} kernels compared");
        // the second block's kernels were rebound from the first's
        assert!(
            compared - cones >= 3,
            "{name}: {compared} kernels of {cones} cones"
        );
    }

    #[test]
    fn repeated_steps_get_the_kernels_generated_for_them() {
        let shapes = [[4, 6], [4, 6], [4, 6], [4, 6], [3, 5], [3, 5]];
        let args: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::randn(s, DType::F32))
            .collect::<kiln_core::Result<_>>()
            .expect("inputs");
        // traced once: a second trace of the same function is served by the graph cache
        let g = traced(blocks, &args).expect("a graph");
        check(&C_TARGET, &g, "C", |k| k.source.clone());
        check(&Cuda::new(132), &g, "CUDA", |k| k.source.clone());
    }

    /// Enough distinct kernels to be generated on several threads (`PARALLEL_FROM`): each
    /// still the one generated for its step, in step order.
    #[test]
    fn many_distinct_kernels_generated_in_parallel_are_the_same() {
        let n = super::PARALLEL_FROM + 16;
        let args: Vec<Tensor> = (1..=n)
            .map(|i| Tensor::randn(&[i, 3], DType::F32))
            .collect::<kiln_core::Result<_>>()
            .expect("inputs");
        let chains = |x: &[Tensor]| -> kiln_core::Result<Vec<Tensor>> {
            x.iter()
                .map(|a| a.mul(a)?.add(1.0)?.sum(&[1], false))
                .collect()
        };
        let g = traced(chains, &args).expect("a graph");
        let (compared, cones) = compare(&Cuda::new(132), &g, "CUDA", |k| k.source.clone());
        assert!(
            cones >= super::PARALLEL_FROM,
            "{cones} distinct cones of {compared}"
        );
    }
}
