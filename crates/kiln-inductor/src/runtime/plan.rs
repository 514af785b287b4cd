//! The memory plan of a compiled graph: where each generated kernel writes.
//!
//! - A kernel whose value the caller receives (a graph output, or viewed by one) writes a new
//!   buffer: what is handed out must never be a buffer the graph will write again.
//! - A kernel whose value is the new contents of a graph input — the caller will `assign` it into
//!   that tensor (an optimizer's parameters and moments) — writes straight into the input's storage
//!   when nothing reads the old value afterwards (`inplace_target`); the caller's copy then finds
//!   source and destination the same tensor and does nothing.
//! - Every other kernel writes an intermediate buffer from the graph's pool (`runtime/pool.rs`):
//!   a buffer whose last reader has run backs a later value, and the pool is kept between calls.

use kiln_compile::graph::{Graph, NodeId, Op};

use crate::ir::lower::Kind;
use crate::schedule::Step;

/// Where a kernel step writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alloc {
    /// A new buffer (the value escapes to the caller).
    Output,
    /// A pooled intermediate buffer.
    Pooled,
    /// The storage of graph-input node `NodeId`, whose new value this is.
    InPlace(NodeId),
}

/// For each node, the node whose buffer it is a view of (itself for buffers): views made by the
/// core (`Step::Extern` of a movement prim) share their operand's storage.
pub fn alias_roots(g: &Graph, steps: &[Step], kinds: &[Kind]) -> Vec<NodeId> {
    let mut root: Vec<NodeId> = (0..g.nodes.len()).collect();
    for s in steps {
        if let Step::Extern { node } = s {
            let n = &g.nodes[*node];
            if kinds[*node] == Kind::Movement && n.args.len() == 1 {
                root[*node] = root[n.args[0]];
            }
        }
    }
    root
}

/// The nodes whose buffers the caller receives: graph outputs and what they are views of.
pub fn escaping(g: &Graph, roots: &[NodeId]) -> Vec<bool> {
    let mut esc = vec![false; g.nodes.len()];
    for &o in &g.outputs {
        esc[o] = true;
        esc[roots[o]] = true;
    }
    esc
}

/// Whether kernel step `at`, computing graph output `k`, may write into graph-input node `input`
/// (whose new value output `k` is), judged on the buffers each step reads (`reads[s]`, with the
/// ordinary kernel for step `at`). The kernel itself must also read the input only at the index it
/// writes; the code generator checks that when it builds the in-place variant.
pub fn inplace_allowed(
    g: &Graph,
    steps: &[Step],
    reads: &[Vec<NodeId>],
    roots: &[NodeId],
    at: usize,
    k: usize,
    input: NodeId,
) -> bool {
    let Some(&o) = g.outputs.get(k) else {
        return false;
    };
    let (on, inn) = (&g.nodes[o], &g.nodes[input]);
    if !matches!(inn.op, Op::Input(_)) || steps.get(at) != Some(&Step::Kernel { node: o }) {
        return false;
    }
    if on.shape != inn.shape || on.dtype != inn.dtype {
        return false; // the caller's assign broadcasts or casts: not a plain overwrite
    }
    // the caller receives no other handle on the input's storage or on the new value's: another
    // output that is either (or a view of either) would see the write, or become the parameter
    for (j, &out) in g.outputs.iter().enumerate() {
        if j != k && (roots[out] == input || roots[out] == o) {
            return false;
        }
    }
    // nothing reads the old value after the write: no later step reads the input or a view of it,
    // and the kernel itself reads no view of it (only the input, at the index it writes)
    for (s, r) in reads.iter().enumerate() {
        for &id in r {
            let old = roots[id] == input;
            if old && (s > at || (s == at && id != input)) {
                return false;
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compile::graph::Node;
    use kiln_core::prim::{BinaryOp, Prim};
    use kiln_core::DType;

    fn node(op: Op, args: Vec<NodeId>) -> Node {
        Node {
            op,
            args,
            shape: vec![4],
            dtype: DType::F32,
            grad_enabled: false,
            requires_grad: false,
            device: kiln_core::Device::Cpu,
        }
    }

    /// p, g inputs; new = p - g (step 0); optionally a later kernel reads p's old value.
    fn graph(late_read: bool) -> (Graph, Vec<Step>, Vec<Vec<NodeId>>) {
        let mut g = Graph::default();
        let p = g.push(node(Op::Input(0), vec![]));
        let x = g.push(node(Op::Input(1), vec![]));
        let new = g.push(node(Op::Prim(Prim::Binary(BinaryOp::Sub)), vec![p, x]));
        g.num_inputs = 2;
        g.outputs = vec![new];
        let mut steps = vec![Step::Kernel { node: new }];
        let mut reads = vec![vec![p, x]];
        if late_read {
            let other = g.push(node(Op::Prim(Prim::Binary(BinaryOp::Mul)), vec![p, x]));
            g.outputs.push(other);
            steps.push(Step::Kernel { node: other });
            reads.push(vec![p, x]);
        }
        (g, steps, reads)
    }

    #[test]
    fn a_later_reader_of_the_old_value_forbids_the_in_place_write() {
        let kinds = |g: &Graph| {
            let mut k = vec![Kind::Input, Kind::Input];
            k.resize(g.nodes.len(), Kind::Pointwise);
            k
        };
        let (g, steps, reads) = graph(false);
        let roots = alias_roots(&g, &steps, &kinds(&g));
        assert!(inplace_allowed(&g, &steps, &reads, &roots, 0, 0, 0));
        // only a graph input can be written in place
        assert!(!inplace_allowed(&g, &steps, &reads, &roots, 0, 0, 2));
        let (g, steps, reads) = graph(true);
        let roots = alias_roots(&g, &steps, &kinds(&g));
        assert!(!inplace_allowed(&g, &steps, &reads, &roots, 0, 0, 0));
    }
}
