//! Common subexpressions: a node that repeats an earlier one (the same prim on the same operands,
//! with the same shape, dtype and device) is that node. Prims are pure functions of their
//! operands (a `Rand` of its seed and offset too), so the two values are equal and one
//! computation serves both readers. What repeats in practice is what autograd writes again: a
//! derivative rule that needs a value the forward computed (a norm's mean, in the rule of its
//! squared deviations) computes it the way the forward did, and the joint graph keeps one.
//!
//! For graphs whose derivatives are already taken (a joint graph, a graph a backend prepares).
//! A backward's nodes are traced under no_grad, a forward's with grad: a reduction repeated
//! across the two is one node (grad-enabled if either was), so the forward sums once what its
//! backward needs; elementwise values stay apart across them, since AOT's partition would save
//! a merged one for the backward (an activation written and read) where it recomputes the
//! backward's own inside a kernel that reads the same operands anyway (`kiln/tests/
//! fusion_traffic.rs`: merging them all cost batch norm's forward one more activation written).

use std::collections::HashMap;

use kiln_core::prim::Prim;

use crate::codec;
use crate::graph::{Graph, Node, NodeId, Op};

/// `g` with each repeated node replaced by its first occurrence (readers remapped, the repeat
/// dropped); `None` when nothing repeats.
pub fn cse(g: &Graph) -> Option<Graph> {
    let mut first: HashMap<Vec<u8>, NodeId> = HashMap::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    let mut out = g.empty_like(g.nodes.len());
    let mut repeats = 0usize;
    for node in &g.nodes {
        let args: Vec<NodeId> = node.args.iter().map(|&a| map[a]).collect();
        if let Op::Input(_) = node.op {
            map.push(out.push(Node {
                args,
                ..node.clone()
            }));
            continue;
        }
        // the op's stored form holds every field (a literal by its bits, a draw's seed); the
        // grad mode keeps elementwise values apart (the module's doc says why)
        let reduction = matches!(node.op, Op::Prim(Prim::Reduce { .. }));
        let key = node_key(node, &args, reduction || node.grad_enabled);
        match first.get(&key) {
            Some(&earlier) => {
                repeats += 1;
                out.nodes[earlier].grad_enabled |= node.grad_enabled;
                map.push(earlier);
            }
            None => {
                let id = out.push(Node {
                    args,
                    ..node.clone()
                });
                first.insert(key, id);
                map.push(id);
            }
        }
    }
    if repeats == 0 {
        return None;
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    Some(out)
}

/// What makes two prim nodes one value, as bytes: the prim (`codec::prim`, seeds kept), its
/// remapped operands, shape, dtype, device and the grad-mode flag.
fn node_key(node: &Node, args: &[NodeId], grad: bool) -> Vec<u8> {
    let mut w = codec::Writer::default();
    if let Op::Prim(p) = &node.op {
        codec::prim(&mut w, p, codec::Seeds::Keep);
    }
    w.usizes(args);
    w.usizes(&node.shape);
    codec::dtype(&mut w, node.dtype);
    codec::device(&mut w, node.device);
    w.bool(grad);
    w.bytes
}

#[cfg(test)]
mod tests {
    use kiln_core::prim::{BinaryOp, Prim, ReduceOp, UnaryOp};
    use kiln_core::{DType, Device};

    use super::*;

    fn node(op: Op, args: Vec<NodeId>, shape: &[usize]) -> Node {
        Node {
            op,
            args,
            shape: shape.to_vec(),
            dtype: DType::F32,
            grad_enabled: false,
            requires_grad: false,
            device: Device::Cpu,
        }
    }

    /// A sum computed twice over one input is computed once, its readers remapped; a sum over
    /// other dims, the same op on another operand and a node with another dtype stay apart.
    #[test]
    fn repeated_nodes_are_computed_once() {
        let sum = |dims: Vec<usize>| {
            Op::Prim(Prim::Reduce {
                op: ReduceOp::Sum,
                dims,
            })
        };
        let mut g = Graph {
            num_inputs: 2,
            ..Graph::default()
        };
        let x = g.push(node(Op::Input(0), vec![], &[4, 3]));
        let y = g.push(node(Op::Input(1), vec![], &[4, 3]));
        let s1 = g.push(node(sum(vec![1]), vec![x], &[4, 1]));
        let s2 = g.push(node(sum(vec![1]), vec![x], &[4, 1]));
        let s0 = g.push(node(sum(vec![0]), vec![x], &[1, 3]));
        let sy = g.push(node(sum(vec![1]), vec![y], &[4, 1]));
        let mut s64 = node(sum(vec![1]), vec![x], &[4, 1]);
        s64.dtype = DType::F64;
        let s64 = g.push(s64);
        let e1 = g.push(node(Op::Prim(Prim::Unary(UnaryOp::Exp)), vec![s1], &[4, 1]));
        let e2 = g.push(node(Op::Prim(Prim::Unary(UnaryOp::Exp)), vec![s2], &[4, 1]));
        let add = g.push(node(
            Op::Prim(Prim::Binary(BinaryOp::Add)),
            vec![e1, e2],
            &[4, 1],
        ));
        g.outputs = vec![add, e2, s0, sy, s64];
        let c = cse(&g).expect("repeats");
        // the second sum and the exp of it are gone
        assert_eq!(c.nodes.len(), g.nodes.len() - 2);
        let out = &c.nodes[c.outputs[0]];
        assert_eq!(out.args[0], out.args[1], "both operands are the one exp");
        assert_eq!(c.outputs[1], out.args[0]);
        let sums = c
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Prim(Prim::Reduce { .. })))
            .count();
        assert_eq!(sums, 4, "sum over x (once), over dim 0, over y, in f64");
        assert!(cse(&c).is_none(), "nothing repeats any more");
    }

    /// Literals are told apart by their bits (0.0 and -0.0 are two values) and draws by their
    /// seeds; equal ones are one node.
    #[test]
    fn literals_and_draws_by_their_exact_values() {
        let full = |value: f64| {
            Op::Prim(Prim::Full {
                shape: vec![2],
                value,
                dtype: DType::F32,
            })
        };
        let rand = |seed: u64| {
            Op::Prim(Prim::Rand {
                shape: vec![2],
                dtype: DType::F32,
                dist: kiln_core::prim::RandDist::Uniform,
                seed,
                offset: 0,
            })
        };
        let mut g = Graph::default();
        let ops = [
            full(1.0),
            full(1.0),
            full(0.0),
            full(-0.0),
            rand(1),
            rand(1),
            rand(2),
        ];
        g.outputs = ops
            .into_iter()
            .map(|op| g.push(node(op, vec![], &[2])))
            .collect();
        let c = cse(&g).expect("repeats");
        assert_eq!(c.nodes.len(), 5, "1.0 once, 0.0, -0.0, seed 1 once, seed 2");
        assert_eq!(c.outputs[0], c.outputs[1]);
        assert_ne!(c.outputs[2], c.outputs[3]);
        assert_eq!(c.outputs[4], c.outputs[5]);
        assert_ne!(c.outputs[4], c.outputs[6]);
    }
}
