//! Pointwise arithmetic on broadcast values, done before the broadcast. Autodiff of a
//! normalization produces chains like `mul(expand(g_var), expand(rstd))`: values that are the
//! same along every broadcast dim, computed at the full shape. Fused, such a chain costs its ops
//! at every element; realized (read by several kernels), it costs a full tensor written and read
//! back (a per-channel value of batch norm's backward stored for all 64 x 56 x 56 x 64 elements).
//! This pass rewrites `op(expand(a), expand(b), ...)` into `expand(op(a', b', ...))`, where the
//! operands are broadcast only as far as their common shape, so the chain runs on that small
//! shape and every reader sees a broadcast view of it.
//!
//! The values are the same (the same ops on the same operands); what changes is where they are
//! computed. Graph outputs keep their node (a caller gets the dense tensor eager would give, not
//! a broadcast view), and operands on another device (a CPU scalar read by a device graph) stay
//! as they are.

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::prim::Prim;

/// The shape every operand of `args` is broadcast from, when each is an `Expand` (or a constant)
/// on `node`'s device and together they leave at least one broadcast dim: the operands' source
/// shapes combined dim by dim. `None` when the node is not such an op.
fn common_source(g: &Graph, node: &Node, args: &[NodeId]) -> Option<Vec<usize>> {
    let mut shape = vec![1usize; node.shape.len()];
    let mut expanded = false;
    for &a in args {
        let n = &g.nodes[a];
        let src = match &n.op {
            Op::Prim(Prim::Expand(_)) => {
                expanded = true;
                &g.nodes[n.args[0]]
            }
            Op::Prim(Prim::Full { .. }) => continue,
            _ => return None,
        };
        if src.device != node.device || src.shape.len() != shape.len() {
            return None;
        }
        for (s, &d) in shape.iter_mut().zip(&src.shape) {
            *s = (*s).max(d);
        }
    }
    (expanded && shape != node.shape).then_some(shape)
}

/// `g` with pointwise ops over broadcast operands moved before the broadcast, or `None` when
/// there is none to move.
pub fn sink_expands(g: &Graph) -> Option<Graph> {
    let mut is_output = vec![false; g.nodes.len()];
    for &o in &g.outputs {
        is_output[o] = true;
    }
    let mut out = g.empty_like(g.nodes.len());
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    let mut changed = false;
    for (id, node) in g.nodes.iter().enumerate() {
        let args: Vec<NodeId> = node.args.iter().map(|&a| map[a]).collect();
        let small = match &node.op {
            Op::Prim(p) if p.is_elementwise() && !is_output[id] => common_source(&out, node, &args),
            _ => None,
        };
        let Some(small) = small else {
            map.push(out.push(Node {
                args,
                ..node.clone()
            }));
            continue;
        };
        let small_args: Vec<NodeId> = args
            .iter()
            .map(|&a| {
                let n = out.nodes[a].clone();
                let src = match &n.op {
                    Op::Prim(Prim::Full { value, dtype, .. }) => {
                        return out.push(Node {
                            op: Op::Prim(Prim::Full {
                                shape: small.clone(),
                                value: *value,
                                dtype: *dtype,
                            }),
                            shape: small.clone(),
                            ..n
                        });
                    }
                    _ => n.args[0],
                };
                if out.nodes[src].shape == small {
                    return src;
                }
                out.push(Node {
                    op: Op::Prim(Prim::Expand(small.clone())),
                    args: vec![src],
                    shape: small.clone(),
                    ..n
                })
            })
            .collect();
        let inner = out.push(Node {
            args: small_args,
            shape: small.clone(),
            ..node.clone()
        });
        map.push(out.push(Node {
            op: Op::Prim(Prim::Expand(node.shape.clone())),
            args: vec![inner],
            ..node.clone()
        }));
        changed = true;
    }
    if !changed {
        return None;
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    Some(out)
}

#[cfg(test)]
mod tests {
    use kiln_compile::backends::Interpreter;
    use kiln_compile::CompiledGraph;
    use kiln_core::prim::{BinaryOp, UnaryOp};
    use kiln_core::{DType, Tensor};

    use super::*;
    use crate::test_graphs::cpu::{input, push};

    /// `exp(expand(a) * expand(b) + 2) * x`: a per-channel [1,3,1] chain (a per-channel value
    /// times a scalar one, plus a constant) read at the full shape [2,3,4] with `x`.
    fn graph() -> Graph {
        let mut g = Graph::default();
        let x = input(&mut g, &[2, 3, 4]);
        let a = input(&mut g, &[1, 3, 1]);
        let b = input(&mut g, &[1, 1, 1]);
        let full = [2, 3, 4];
        let ea = push(
            &mut g,
            Op::Prim(Prim::Expand(full.to_vec())),
            vec![a],
            &full,
        );
        let eb = push(
            &mut g,
            Op::Prim(Prim::Expand(full.to_vec())),
            vec![b],
            &full,
        );
        let two = push(
            &mut g,
            Op::Prim(Prim::Full {
                shape: full.to_vec(),
                value: 2.0,
                dtype: DType::F32,
            }),
            vec![],
            &full,
        );
        let m = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Mul)),
            vec![ea, eb],
            &full,
        );
        let s = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Add)),
            vec![m, two],
            &full,
        );
        let e = push(&mut g, Op::Prim(Prim::Unary(UnaryOp::Exp)), vec![s], &full);
        let y = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Mul)),
            vec![e, x],
            &full,
        );
        g.outputs = vec![y, e];
        g
    }

    /// The per-channel chain runs on [1,3,1]; the product with `x` stays at [2,3,4]; the
    /// graph's outputs keep their dense nodes; the values are unchanged, bit for bit.
    #[test]
    fn broadcast_chains_run_on_the_small_shape() -> kiln_core::Result<()> {
        let g = graph();
        let s = sink_expands(&g).expect("a chain to move");
        let small_ops = s
            .nodes
            .iter()
            .filter(|n| matches!(&n.op, Op::Prim(p) if p.is_elementwise()) && n.shape == [1, 3, 1])
            .count();
        assert_eq!(small_ops, 2, "mul and add on [1, 3, 1]");
        // `e` is an output: computed at the full shape, as eager hands it back
        let e_out = &s.nodes[s.outputs[1]];
        assert!(matches!(e_out.op, Op::Prim(Prim::Unary(UnaryOp::Exp))));
        assert_eq!(e_out.shape, [2, 3, 4]);
        let args = vec![
            Tensor::randn(&[2, 3, 4], DType::F32)?,
            Tensor::randn(&[1, 3, 1], DType::F32)?,
            Tensor::randn(&[1, 1, 1], DType::F32)?,
        ];
        let want = Interpreter::new(g).run(&args)?;
        let got = Interpreter::new(s).run(&args)?;
        for (w, o) in want.iter().zip(&got) {
            assert_eq!(w.to_vec::<f32>()?, o.to_vec::<f32>()?);
        }
        Ok(())
    }

    #[test]
    fn graphs_without_broadcast_chains_are_left_alone() {
        let mut g = Graph::default();
        let x = input(&mut g, &[2, 3]);
        let y = push(
            &mut g,
            Op::Prim(Prim::Unary(UnaryOp::Exp)),
            vec![x],
            &[2, 3],
        );
        g.outputs = vec![y];
        assert!(sink_expands(&g).is_none());
    }
}
