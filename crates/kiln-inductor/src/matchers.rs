//! Small graph patterns the rewriting passes recognize alike: a constant broadcast (`one_hot.rs`'s
//! zero rows, `epilogue.rs`'s GELU constants), a ReLU as `relu` traces it (`epilogue.rs`,
//! `relu_mask.rs`), and each node's readers.

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::{BinaryOp, Prim};

/// Whether `id` is the constant `v` broadcast: a `Full` of `v` under reshapes, expands and
/// permutes (the channels-last pass reads an NCHW constant through a permute).
pub(crate) fn is_constant(g: &Graph, mut id: NodeId, v: f64) -> bool {
    loop {
        match &g.nodes[id].op {
            Op::Prim(Prim::Reshape(_) | Prim::Expand(_) | Prim::Permute(_)) => {
                id = g.nodes[id].args[0]
            }
            Op::Prim(Prim::Full { value, .. }) => return *value == v,
            _ => return false,
        }
    }
}

/// The mask and the operand of a ReLU, `where(le(x, 0), 0, x)`, when `sel` is one: `(le, x)`.
pub(crate) fn relu_parts(g: &Graph, sel: NodeId) -> Option<(NodeId, NodeId)> {
    let n = &g.nodes[sel];
    let (Op::Prim(Prim::Where), &[le, zero, x]) = (&n.op, n.args.as_slice()) else {
        return None;
    };
    let mask = &g.nodes[le];
    let is_mask = matches!(mask.op, Op::Prim(Prim::Binary(BinaryOp::Le)))
        && matches!(mask.args[..], [v, z] if v == x && is_constant(g, z, 0.0));
    (is_mask && is_constant(g, zero, 0.0)).then_some((le, x))
}

/// Each node's readers, in node order, each once.
pub(crate) fn readers(g: &Graph) -> Vec<Vec<NodeId>> {
    let mut users = vec![Vec::new(); g.nodes.len()];
    for (id, node) in g.nodes.iter().enumerate() {
        for &a in &node.args {
            if !users[a].contains(&id) {
                users[a].push(id);
            }
        }
    }
    users
}
