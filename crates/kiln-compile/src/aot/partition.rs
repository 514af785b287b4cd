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

use super::joint::Joint;
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

/// Too expensive to recompute in the backward (functorch bans the same families).
fn banned_from_recompute(p: &Prim) -> bool {
    matches!(
        p,
        Prim::Matmul
            | Prim::Conv2d { .. }
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

/// Chooses the saved values; returns them in node order.
fn min_cut_saved(j: &Joint) -> Result<Vec<NodeId>> {
    let g = &j.graph;
    let n = g.nodes.len();
    let first_grad = j.num_fwd_outputs;
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
            Op::Input(i) => i >= j.num_primals,
            Op::Prim(_) => node.args.iter().any(|&a| tangent_dep[a]),
        };
    }
    let materialized = materialized_backwards(g, &tangent_dep);
    let (source, sink) = (2 * n, 2 * n + 1);
    let mut net = FlowNet::new(2 * n + 2);
    for (id, node) in g.nodes.iter().enumerate() {
        if !bw_needed[id] {
            continue;
        }
        let (vin, vout) = (2 * id, 2 * id + 1);
        let in_backward = tangent_dep[id] || is_grad_out[id];
        if in_backward {
            net.add_edge(vin, sink, INF);
        } else {
            net.add_edge(vin, vout, bytes(node));
            let from_source = match &node.op {
                Op::Input(_) => true,
                Op::Prim(p) => banned_from_recompute(p) || materialized[id],
            };
            if from_source {
                net.add_edge(source, vin, INF);
            }
        }
        for &a in &node.args {
            net.add_edge(2 * a + 1, vin, INF);
        }
    }
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

/// Copies the part of `g` that computes `outputs` from `inputs` (which become the new graph's
/// inputs, in order) into a new graph.
fn extract(g: &Graph, inputs: &[NodeId], outputs: &[NodeId]) -> Result<Graph> {
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
    let mut out = Graph {
        num_inputs: inputs.len(),
        rng_span: g.rng_span,
        ..Graph::default()
    };
    let mut remap = vec![usize::MAX; n];
    for (k, &id) in inputs.iter().enumerate() {
        let src = &g.nodes[id];
        remap[id] = out.push(Node {
            op: Op::Input(k),
            args: vec![],
            shape: src.shape.clone(),
            dtype: src.dtype,
            grad_enabled: false,
            requires_grad: src.requires_grad,
            device: src.device,
        });
    }
    for (id, node) in g.nodes.iter().enumerate() {
        if !needed[id] || as_input[id] != usize::MAX {
            continue;
        }
        if let Op::Input(i) = node.op {
            return Err(Error::arg(
                "aot autograd",
                format!("internal error: partition reads joint input {i}, which it was not given"),
            ));
        }
        let mut c = node.clone();
        c.args.iter_mut().for_each(|a| *a = remap[*a]);
        remap[id] = out.push(c);
    }
    out.outputs = outputs.iter().map(|&o| remap[o]).collect();
    if !out
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::Prim(Prim::Rand { .. })))
    {
        out.rng_span = 0;
    }
    Ok(out)
}

pub fn partition(j: &Joint) -> Result<Partition> {
    let g = &j.graph;
    let saved = min_cut_saved(j)?;
    let inputs = g.input_nodes();
    let (primals, tangents) = inputs.split_at(j.num_primals);
    let fwd_outputs: Vec<NodeId> = g.outputs[..j.num_fwd_outputs]
        .iter()
        .chain(&saved)
        .copied()
        .collect();
    let forward = extract(g, primals, &fwd_outputs)?;
    let bw_inputs: Vec<NodeId> = saved.iter().chain(tangents).copied().collect();
    let backward = extract(g, &bw_inputs, &g.outputs[j.num_fwd_outputs..])?;
    let saved_bytes = saved.iter().map(|&id| bytes(&g.nodes[id]) as usize).sum();
    Ok(Partition {
        forward,
        backward,
        num_saved: saved.len(),
        saved_bytes,
    })
}
