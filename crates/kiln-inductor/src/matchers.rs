//! Small graph patterns the rewriting passes recognize alike: a constant broadcast (`one_hot.rs`'s
//! zero rows, `epilogue.rs`'s GELU constants), a ReLU as `relu` traces it (`epilogue.rs`,
//! `relu_mask.rs`), and who reads each node (`Uses`).

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

/// Who reads each node of a graph, and which nodes the graph returns: what a pattern checks
/// before absorbing a value into a call (nothing else may see it).
pub(crate) struct Uses {
    readers: Vec<Vec<NodeId>>,
    is_output: Vec<bool>,
}

impl Uses {
    pub(crate) fn of(g: &Graph) -> Uses {
        let mut readers = vec![Vec::new(); g.nodes.len()];
        for (id, node) in g.nodes.iter().enumerate() {
            for &a in &node.args {
                if !readers[a].contains(&id) {
                    readers[a].push(id);
                }
            }
        }
        let mut is_output = vec![false; g.nodes.len()];
        for &o in &g.outputs {
            is_output[o] = true;
        }
        Uses { readers, is_output }
    }

    /// `id`'s readers, in node order, each once.
    pub(crate) fn readers(&self, id: NodeId) -> &[NodeId] {
        &self.readers[id]
    }

    pub(crate) fn is_output(&self, id: NodeId) -> bool {
        self.is_output[id]
    }

    /// The one node that reads `id`, when `id` is read by exactly one and not returned.
    pub(crate) fn only_reader(&self, id: NodeId) -> Option<NodeId> {
        match self.readers[id].as_slice() {
            [r] if !self.is_output[id] => Some(*r),
            _ => None,
        }
    }
}
