//! Splitting the joint graph into a forward graph (outputs + values saved for backward) and a
//! backward graph (saved values + tangents -> gradients), choosing what to save by a minimum cut
//! over bytes, as functorch's `min_cut_rematerialization_partition` does: the backward may recompute
//! any cheap value from saved ones, so saving a small value and recomputing the elementwise chain
//! after it beats saving every intermediate.
//!
//! The flow network has two vertices per joint node, `in` and `out`, joined by an edge whose
//! capacity is the node's size in bytes (cutting it = saving the value). Values available in the
//! forward (primal inputs, and values too costly to recompute: matmul, conv, reductions) hang off the
//! source; values the backward computes for certain (anything depending on a tangent, and the
//! gradients) drain into the sink; every use is an uncuttable edge. Nodes without operands (full,
//! iota, random with the forward's seed and offset) are recomputed for free.

use kiln_core::prim::Prim;
use kiln_core::{Error, Result};

use super::maxflow::{FlowNet, INF};
use crate::graph::{Graph, Node, NodeId, Op};

/// The result: two graphs and the values passed from one to the other.
pub struct Partition {
    /// Inputs: the primals. Outputs: the forward outputs, then the saved values.
    pub forward: Graph,
    /// Inputs: the saved values, then the tangents. Outputs: the gradients.
    pub backward: Graph,
    pub num_saved: usize,
    /// Bytes of the saved values (what the compiled forward keeps alive for backward).
    pub saved_bytes: usize,
}

/// The nodes of `g` that computing `outputs` from `inputs` reaches: for each node its input
/// position (`usize::MAX` for none), and whether it is needed (inputs included, nothing above
/// them).
fn cone(g: &Graph, inputs: &[NodeId], outputs: &[NodeId]) -> (Vec<usize>, Vec<bool>) {
    let n = g.nodes.len();
    let mut as_input = vec![usize::MAX; n];
    for (k, &id) in inputs.iter().enumerate() {
        as_input[id] = k;
    }
    let mut needed = vec![false; n];
    for &o in outputs {
        needed[o] = true;
    }
    for id in (0..n).rev() {
        if needed[id] && as_input[id] == usize::MAX {
            for &a in &g.nodes[id].args {
                needed[a] = true;
            }
        }
    }
    (as_input, needed)
}

/// Input `k` of a half, standing for joint node `src` (a primal, a tangent, a saved value).
fn input_node(k: usize, src: &Node) -> Node {
    Node {
        op: Op::Input(k),
        args: vec![],
        shape: src.shape.clone(),
        dtype: src.dtype,
        grad_enabled: false,
        requires_grad: src.requires_grad,
        device: src.device,
    }
}

/// Too expensive to recompute in the backward (functorch bans the same families).
fn banned_from_recompute(p: &Prim) -> bool {
    matches!(
        p,
        Prim::Matmul
            | Prim::MatmulEpilogue(_)
            | Prim::Conv2d { .. }
            | Prim::Conv2dEpilogue { .. }
            | Prim::Conv2dGradInput { .. }
            | Prim::Conv2dGradWeight { .. }
            | Prim::Reduce { .. }
            | Prim::ArgReduce { .. }
            | Prim::ScatterAdd { .. }
    )
}

fn bytes(n: &Node) -> u64 {
    n.nbytes() as u64
}

/// The forward values a backward call (a convolution's or a matmul's gradient) reads, directly
/// or through views: the backward must hold them in memory, so recomputing one there costs a
/// write and a read of the whole value, where saving it costs only memory (functorch bans
/// recomputing them for the same reason). ResNet's ReLU outputs: each convolution's weight
/// gradient reads its input, which the backward otherwise rebuilt from the batch norm's input
/// in one pass over every layer's activation.
fn materialized_backwards(g: &Graph, tangent_dep: &[bool]) -> Vec<bool> {
    let mut out = vec![false; g.nodes.len()];
    for (id, node) in g.nodes.iter().enumerate() {
        let Op::Prim(p) = &node.op else { continue };
        if !tangent_dep[id] || !banned_from_recompute(p) {
            continue;
        }
        for &a in &node.args {
            let mut v = a;
            // a view of a value reads the value's memory (traced values are contiguous, so
            // the core's rule makes a reshape of one a view too)
            while !tangent_dep[v] && g.is_view(v) {
                v = g.nodes[v].args[0];
            }
            if !tangent_dep[v] {
                out[v] = true;
            }
        }
    }
    out
}

/// Chooses the saved values of joint graph `g` (`num_primals` primal inputs, then tangents;
/// `first_grad` forward outputs, then gradients); returns them in node order.
fn min_cut_saved(g: &Graph, num_primals: usize, first_grad: usize) -> Result<Vec<NodeId>> {
    let n = g.nodes.len();
    // the values the backward needs: ancestors of the gradient outputs
    let mut bw_needed = vec![false; n];
    for &o in &g.outputs[first_grad..] {
        bw_needed[o] = true;
    }
    for id in (0..n).rev() {
        if bw_needed[id] {
            for &a in &g.nodes[id].args {
                bw_needed[a] = true;
            }
        }
    }
    let mut tangent_dep = vec![false; n];
    let mut is_grad_out = vec![false; n];
    for &o in &g.outputs[first_grad..] {
        is_grad_out[o] = true;
    }
    for (id, node) in g.nodes.iter().enumerate() {
        tangent_dep[id] = match node.op {
            Op::Input(i) => i >= num_primals,
            Op::Prim(_) => node.args.iter().any(|&a| tangent_dep[a]),
        };
    }
    let materialized = materialized_backwards(g, &tangent_dep);
    let (source, sink) = (2 * n, 2 * n + 1);
    // (from, to, capacity); DenseNet-121's joint graph has about 1.6 per node
    let mut edges: Vec<(usize, usize, u64)> = Vec::with_capacity(2 * n);
    for (id, node) in g.nodes.iter().enumerate() {
        if !bw_needed[id] {
            continue;
        }
        let (vin, vout) = (2 * id, 2 * id + 1);
        let in_backward = tangent_dep[id] || is_grad_out[id];
        if in_backward {
            edges.push((vin, sink, INF));
        } else {
            edges.push((vin, vout, bytes(node)));
            let from_source = match &node.op {
                Op::Input(_) => true,
                Op::Prim(p) => banned_from_recompute(p) || materialized[id],
            };
            if from_source {
                edges.push((source, vin, INF));
            }
        }
        for &a in &node.args {
            edges.push((2 * a + 1, vin, INF));
        }
    }
    let mut net = FlowNet::new(2 * n + 2, &edges);
    if net.max_flow(source, sink) >= INF {
        return Err(Error::arg(
            "aot autograd",
            "internal error: the backward needs a value that can neither be saved nor recomputed",
        ));
    }
    let side = net.source_side(source);
    Ok((0..n)
        .filter(|&id| bw_needed[id] && side[2 * id] && !side[2 * id + 1])
        .collect())
}

/// One half of the split, built by moving joint nodes into it: which joint nodes it computes,
/// their ids in the half, and the graph so far.
struct Half {
    computes: Vec<bool>,
    /// Joint node id -> this half's node id (for its inputs and the nodes added so far).
    remap: Vec<NodeId>,
    graph: Graph,
}

impl Half {
    /// The part of `g` that computes `outputs` from `inputs` (which become the half's inputs, in
    /// order): the input nodes are made now; `take` adds the nodes it `computes`, in order.
    fn new(g: &Graph, inputs: &[NodeId], outputs: &[NodeId]) -> Result<Half> {
        let n = g.nodes.len();
        let (as_input, needed) = cone(g, inputs, outputs);
        // what the half computes: the needed nodes short of its inputs
        let mut computes = needed;
        let mut count = 0;
        for (id, node) in g.nodes.iter().enumerate() {
            if as_input[id] != usize::MAX {
                computes[id] = false;
            } else if computes[id] {
                if let Op::Input(i) = node.op {
                    return Err(Error::arg(
                        "aot autograd",
                        format!(
                            "internal error: partition reads joint input {i}, which it was not given"
                        ),
                    ));
                }
                count += 1;
            }
        }
        let mut graph = Graph {
            nodes: Vec::with_capacity(inputs.len() + count),
            num_inputs: inputs.len(),
            rng_span: g.rng_span,
            ..Graph::default()
        };
        let mut remap = vec![usize::MAX; n];
        for (k, &id) in inputs.iter().enumerate() {
            let src = &g.nodes[id];
            remap[id] = graph.push(input_node(k, src));
        }
        Ok(Half {
            computes,
            remap,
            graph,
        })
    }

    /// Adds joint node `id` (one of those it computes), its operands renumbered.
    fn take(&mut self, id: NodeId, mut node: Node) {
        node.args.iter_mut().for_each(|a| *a = self.remap[*a]);
        self.remap[id] = self.graph.push(node);
    }

    /// The half's graph, returning `outputs` (joint node ids).
    fn finish(self, outputs: &[NodeId]) -> Graph {
        let mut out = self.graph;
        out.outputs = outputs.iter().map(|&o| self.remap[o]).collect();
        if !out
            .nodes
            .iter()
            .any(|n| matches!(n.op, Op::Prim(Prim::Rand { .. })))
        {
            out.rng_span = 0;
        }
        out
    }
}

/// Splits a joint graph (`num_primals` primal inputs, then the tangents; `num_fwd_outputs`
/// forward outputs, then the gradients) into forward and backward graphs. The joint graph is
/// consumed: each of its nodes moves into the half that computes it, and is copied only when both
/// do (a value the backward recomputes), so the split makes no per-node copies of the rest.
pub fn partition(g: Graph, num_primals: usize, num_fwd_outputs: usize) -> Result<Partition> {
    let saved = min_cut_saved(&g, num_primals, num_fwd_outputs)?;
    let inputs = g.input_nodes();
    let (primals, tangents) = inputs.split_at(num_primals);
    let fwd_outputs: Vec<NodeId> = g.outputs[..num_fwd_outputs]
        .iter()
        .chain(&saved)
        .copied()
        .collect();
    let bw_inputs: Vec<NodeId> = saved.iter().chain(tangents).copied().collect();
    let mut forward = Half::new(&g, primals, &fwd_outputs)?;
    let mut backward = Half::new(&g, &bw_inputs, &g.outputs[num_fwd_outputs..])?;
    let saved_bytes = saved.iter().map(|&id| bytes(&g.nodes[id]) as usize).sum();
    // both halves add their nodes in joint order, as copying each half out on its own would
    for (id, node) in g.nodes.into_iter().enumerate() {
        match (forward.computes[id], backward.computes[id]) {
            (true, true) => {
                forward.take(id, node.clone());
                backward.take(id, node);
            }
            (true, false) => forward.take(id, node),
            (false, true) => backward.take(id, node),
            (false, false) => {}
        }
    }
    Ok(Partition {
        forward: forward.finish(&fwd_outputs),
        backward: backward.finish(&g.outputs[num_fwd_outputs..]),
        num_saved: saved.len(),
        saved_bytes,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use kiln_core::{DType, Reduction, Tensor};

    use super::*;
    use crate::aot::joint;
    use crate::backends::{Backend, BackendContext, CompiledGraph, Interpreter};
    use crate::{compile_fn, CompileOptions};

    /// Keeps the graphs it is given.
    struct Capture(Mutex<Vec<Graph>>);

    impl Backend for Capture {
        fn name(&self) -> &str {
            "capture"
        }
        fn compile(&self, graph: &Graph, _: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
            self.0.lock().unwrap().push(graph.clone());
            Ok(Arc::new(Interpreter::new(graph.clone())))
        }
    }

    /// The forward graph of a small training step: convolution, batch norm, ReLU, max-pool,
    /// dropout, a linear layer, tanh, cross-entropy.
    fn training_graph() -> Result<Graph> {
        let capture = Arc::new(Capture(Mutex::new(Vec::new())));
        let f = compile_fn(
            |a: &[Tensor]| {
                let y = a[0].conv2d(&a[1], None, [1, 1], [1, 1], [1, 1], 1)?;
                let y = y.batch_norm(None, None, None, true, 1e-5)?.relu()?;
                let y = y.max_pool2d([2, 2], [2, 2], [0, 0])?.dropout(0.25, true)?;
                let y = y.reshape([4, 64])?.matmul(&a[2])?.tanh()?;
                Ok(vec![y.cross_entropy(&a[3], None, 0.0, Reduction::Mean)?])
            },
            CompileOptions::default().custom_backend(capture.clone()),
        )?;
        let w = Tensor::randn(&[4, 2, 3, 3], DType::F32)?;
        w.set_requires_grad(true)?;
        let lin = Tensor::randn(&[64, 10], DType::F32)?;
        lin.set_requires_grad(true)?;
        let x = Tensor::randn(&[4, 2, 8, 8], DType::F32)?;
        let target = Tensor::from_vec(vec![1i64, 0, 3, 9], &[4])?;
        f.call(&[x, w, lin, target])?;
        let graphs = capture.0.lock().unwrap();
        assert_eq!(graphs.len(), 1, "one graph, no breaks");
        Ok(graphs[0].clone())
    }

    /// The split as first written: one half of `g` copied out (the part computing `outputs` from
    /// `inputs`), and which joint nodes it computes.
    fn copied_out(g: &Graph, inputs: &[NodeId], outputs: &[NodeId]) -> (Graph, Vec<bool>) {
        let n = g.nodes.len();
        let (as_input, needed) = cone(g, inputs, outputs);
        let mut out = Graph {
            num_inputs: inputs.len(),
            rng_span: g.rng_span,
            ..Graph::default()
        };
        let mut remap = vec![usize::MAX; n];
        for (k, &id) in inputs.iter().enumerate() {
            let src = &g.nodes[id];
            remap[id] = out.push(input_node(k, src));
        }
        let mut computed = vec![false; n];
        for (id, node) in g.nodes.iter().enumerate() {
            if !needed[id] || as_input[id] != usize::MAX {
                continue;
            }
            let mut c = node.clone();
            c.args.iter_mut().for_each(|a| *a = remap[*a]);
            remap[id] = out.push(c);
            computed[id] = true;
        }
        out.outputs = outputs.iter().map(|&o| remap[o]).collect();
        if !out
            .nodes
            .iter()
            .any(|n| matches!(n.op, Op::Prim(Prim::Rand { .. })))
        {
            out.rng_span = 0;
        }
        (out, computed)
    }

    /// Moving the joint graph's nodes into the two halves gives the graphs that copying each half
    /// out of it gave: the same nodes in the same order, inputs, outputs and saved values, where
    /// the backward recomputes forward values (both halves compute those) and draws random
    /// numbers again.
    #[test]
    fn moving_nodes_into_the_halves_splits_as_copying_them_out_did() -> Result<()> {
        kiln_core::manual_seed(3);
        let fwd = training_graph()?;
        let j = joint::build(&fwd)?.expect("a graph with gradients");
        let g = &j.graph;
        let saved = min_cut_saved(g, j.num_primals, j.num_fwd_outputs)?;
        let inputs = g.input_nodes();
        let (primals, tangents) = inputs.split_at(j.num_primals);
        let fwd_outputs: Vec<NodeId> = g.outputs[..j.num_fwd_outputs]
            .iter()
            .chain(&saved)
            .copied()
            .collect();
        let bw_inputs: Vec<NodeId> = saved.iter().chain(tangents).copied().collect();
        let (forward, in_fwd) = copied_out(g, primals, &fwd_outputs);
        let (backward, in_bwd) = copied_out(g, &bw_inputs, &g.outputs[j.num_fwd_outputs..]);
        let both = (0..g.nodes.len()).filter(|&i| in_fwd[i] && in_bwd[i]);
        assert!(both.count() > 0, "the backward recomputes nothing");
        assert!(
            backward.rng_span > 0,
            "the backward draws no random numbers"
        );

        let p = partition(g.clone(), j.num_primals, j.num_fwd_outputs)?;
        assert_eq!(p.num_saved, saved.len());
        let bytes: usize = saved.iter().map(|&id| g.nodes[id].nbytes()).sum();
        assert_eq!(p.saved_bytes, bytes);
        assert_eq!(p.forward.to_code("f"), forward.to_code("f"));
        assert_eq!(p.forward, forward);
        assert_eq!(p.backward.to_code("b"), backward.to_code("b"));
        assert_eq!(p.backward, backward);
        Ok(())
    }
}
