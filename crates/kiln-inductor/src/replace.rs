//! Replacing matched patterns by one call each: the rewriting the epilogue passes share
//! (`epilogue.rs`'s matmuls, `conv_epilogue.rs`'s convolutions). A pattern ends at one node (its
//! last op); the graph is copied in order, each such node written as the call that computes its
//! value, and the nodes the patterns absorbed — which nothing written out reads any more — pruned.

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::prim::Prim;

use crate::matchers::Uses;

/// `g` with each pattern `found` reports (the node it ends at, and what it matched, for each
/// node it starts at, given who reads what in `g`) replaced by what `emit` writes: given the graph being written, the map
/// from `g`'s nodes to it, and the last node, the node holding that node's value. `None` when
/// nothing is found.
pub(crate) fn replace<P>(
    g: &Graph,
    found: impl Fn(&Uses, NodeId) -> Option<(NodeId, P)>,
    mut emit: impl FnMut(&mut Graph, &[NodeId], &Node, P) -> NodeId,
) -> Option<Graph> {
    let uses = Uses::of(g);
    let mut at_last: Vec<Option<P>> = (0..g.nodes.len()).map(|_| None).collect();
    for start in 0..g.nodes.len() {
        if let Some((last, p)) = found(&uses, start) {
            // two patterns ending at one node would both absorb it: the first keeps it
            if at_last[last].is_none() {
                at_last[last] = Some(p);
            }
        }
    }
    if at_last.iter().all(Option::is_none) {
        return None;
    }
    let mut out = g.empty_like(g.nodes.len());
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for (id, node) in g.nodes.iter().enumerate() {
        let written = match at_last[id].take() {
            Some(p) => emit(&mut out, &map, node, p),
            // a node a pattern absorbed is read by no node written out: pruned below
            None => {
                let args = node.args.iter().map(|&a| map[a]).collect();
                out.push(Node {
                    args,
                    ..node.clone()
                })
            }
        };
        map.push(written);
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    Some(prune(&out))
}

/// Node `v` of `out`, holding `n` values, as a vector `[n]`: itself, or a reshape of it.
pub(crate) fn as_vector(out: &mut Graph, v: NodeId, n: usize) -> NodeId {
    match out.nodes[v].shape == [n] {
        true => v,
        // a prim of the value (an input, perhaps, which may require grad)
        false => out.push(Node {
            op: Op::Prim(Prim::Reshape(vec![n])),
            args: vec![v],
            shape: vec![n],
            requires_grad: false,
            ..out.nodes[v].clone()
        }),
    }
}

/// `g` without the nodes no output depends on (inputs stay: they are the call's arguments).
fn prune(g: &Graph) -> Graph {
    let mut live = vec![false; g.nodes.len()];
    for &o in &g.outputs {
        live[o] = true;
    }
    for id in (0..g.nodes.len()).rev() {
        if matches!(g.nodes[id].op, Op::Input(_)) {
            live[id] = true;
        }
        if live[id] {
            for &a in &g.nodes[id].args {
                live[a] = true;
            }
        }
    }
    let mut out = g.empty_like(g.nodes.len());
    let mut map = vec![usize::MAX; g.nodes.len()];
    for (id, node) in g.nodes.iter().enumerate() {
        if live[id] {
            let args = node.args.iter().map(|&a| map[a]).collect();
            map[id] = out.push(Node {
                args,
                ..node.clone()
            });
        }
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    out
}
