//! A ReLU's mask read from its output. `relu(x) = where(le(x, 0), 0, x)`, and autodiff of the
//! `where` selects the gradient by the same mask `le(x, 0)`, so a training step's backward reads
//! the pre-activation's mask: the forward half must save it (or `x`), and its ReLU stays out of
//! the matmul call before it (`epilogue.rs` fuses only a ReLU nothing else reads). The mask of
//! the output is the same mask — `relu(x) <= 0` exactly where `x <= 0`, NaN included (a NaN
//! passes through the ReLU and compares false both ways) — and the output is saved anyway
//! wherever a matmul reads it (its weight's gradient). This pass points the backward's reads of
//! the mask at `le(relu(x), 0)`, computed after the ReLU, so the forward's ReLU joins its matmul
//! and the backward recomputes the mask from what it already holds, as PyTorch's
//! `threshold_backward` reads the ReLU's result.
//!
//! Applied to a device's joint graph before AOT autograd partitions it
//! (`backend::prepare_joint`; the CPU fuses no epilogues), to the ReLUs a matmul epilogue could
//! take (a matmul's value, after a bias or not): elsewhere (a
//! convolution network's batch norm) the scheduler already recomputes the mask from the values
//! the backward reads. Off with the epilogues (`KILN_MATMUL_EPILOGUES=0`).

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::prim::{BinaryOp, Prim};

use crate::epilogue::bias_of;
use crate::matchers::{relu_parts, Uses};

/// Whether `x` is a matmul's value, reshaped, with or without a bias broadcast added: what a
/// matmul epilogue could end in.
fn matmul_fed(g: &Graph, mut x: NodeId) -> bool {
    let node = &g.nodes[x];
    if let (Op::Prim(Prim::Binary(BinaryOp::Add)), &[p, q]) = (&node.op, node.args.as_slice()) {
        let n = node.shape.last().copied().unwrap_or(0);
        x = match (bias_of(g, q, n), bias_of(g, p, n)) {
            (Some(_), _) => p,
            (_, Some(_)) => q,
            _ => return false,
        };
    }
    while let Op::Prim(Prim::Reshape(_)) = g.nodes[x].op {
        x = g.nodes[x].args[0];
    }
    matches!(g.nodes[x].op, Op::Prim(Prim::Matmul))
}

/// The ReLUs to rewrite, by their mask: the ReLU `where(mask, 0, x)` over a matmul's value whose
/// mask other nodes read too, all after the ReLU, and the graph does not return.
fn relus(g: &Graph, uses: &Uses) -> Vec<Option<NodeId>> {
    let mut relu_of_mask = vec![None; g.nodes.len()];
    for relu in 0..g.nodes.len() {
        let Some((le, x)) = relu_parts(g, relu) else {
            continue;
        };
        let readers = uses.readers(le);
        let others_after = readers.iter().all(|&u| u >= relu);
        let read_elsewhere = readers.len() > 1 && !uses.is_output(le);
        if others_after && read_elsewhere && matmul_fed(g, x) {
            relu_of_mask[le] = Some(relu);
        }
    }
    relu_of_mask
}

/// `g` with the backward's reads of matmul-fed ReLUs' masks taken from their outputs, or `None`
/// when there is none to rewrite.
pub fn relu_masks_from_outputs(g: &Graph) -> Option<Graph> {
    if !crate::epilogue::enabled() {
        return None;
    }
    let relu_of_mask = relus(g, &Uses::of(g));
    if relu_of_mask.iter().all(Option::is_none) {
        return None;
    }
    // the mask each ReLU's output gives, once written
    let mut mask_of_relu: Vec<Option<NodeId>> = vec![None; g.nodes.len()];
    let mut out_mask: Vec<Option<NodeId>> = vec![None; g.nodes.len()];
    for (le, relu) in relu_of_mask.iter().enumerate() {
        if let Some(r) = relu {
            mask_of_relu[*r] = Some(le);
        }
    }
    let mut out = g.empty_like(g.nodes.len() + 8);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for (id, node) in g.nodes.iter().enumerate() {
        let args = node
            .args
            .iter()
            // set once the ReLU is written out: a later reader takes the output's mask
            .map(|&a| out_mask[a].unwrap_or(map[a]))
            .collect();
        let new = out.push(Node {
            args,
            ..node.clone()
        });
        map.push(new);
        if let Some(le) = mask_of_relu[id] {
            let mask = &g.nodes[le];
            let zero = map[mask.args[1]];
            out_mask[le] = Some(out.push(Node {
                args: vec![new, zero],
                ..mask.clone()
            }));
        }
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    Some(out)
}

#[cfg(test)]
mod tests {
    use kiln_compile::backends::Interpreter;
    use kiln_compile::CompiledGraph;
    use kiln_core::{DType, Result, Tensor};

    use super::*;
    use crate::test_graphs::cpu::{input, push};

    /// `relu(a @ b)` and a gradient selected by its mask (as autodiff of the ReLU's `where`
    /// writes it): the selection reads the output's mask after the rewrite, and both values
    /// are the same bit for bit, NaN, -0.0 and +0.0 included.
    #[test]
    fn the_backward_reads_the_mask_of_the_output() -> Result<()> {
        let mut g = Graph::default();
        let a = input(&mut g, &[1, 6, 1]);
        let b = input(&mut g, &[1, 1, 3]);
        let grad = input(&mut g, &[1, 6, 3]);
        let shape = [1, 6, 3];
        let mm = push(&mut g, Op::Prim(Prim::Matmul), vec![a, b], &shape);
        let zeros = |g: &mut Graph| {
            let full = Prim::Full {
                shape: shape.to_vec(),
                value: 0.0,
                dtype: DType::F32,
            };
            push(g, Op::Prim(full), vec![], &shape)
        };
        let (z1, z2, z3) = (zeros(&mut g), zeros(&mut g), zeros(&mut g));
        let le = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Le)),
            vec![mm, z1],
            &shape,
        );
        g.nodes[le].dtype = DType::Bool;
        let relu = push(&mut g, Op::Prim(Prim::Where), vec![le, z2, mm], &shape);
        let selected = push(&mut g, Op::Prim(Prim::Where), vec![le, z3, grad], &shape);
        g.outputs = vec![relu, selected];
        let r = relu_masks_from_outputs(&g).expect("a mask to move");
        let sel = &r.nodes[r.outputs[1]];
        let mask = &r.nodes[sel.args[0]];
        assert_eq!(mask.args[0], r.outputs[0], "{}", r.to_code("rewritten"));
        let args = [
            Tensor::from_vec(vec![f32::NAN, -0.0, 0.0, -1.0, 2.0, 1e-30], &[1, 6, 1])?,
            Tensor::from_vec(vec![1.0f32, -1.0, 0.5], &[1, 1, 3])?,
            Tensor::randn(&[1, 6, 3], DType::F32)?,
        ];
        let want = Interpreter::new(g.clone()).run(&args)?;
        let got = Interpreter::new(r).run(&args)?;
        for (w, o) in want.iter().zip(&got) {
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.to_vec::<f32>()?.iter().map(|x| x.to_bits()).collect())
            };
            assert_eq!(bits(w)?, bits(o)?);
        }
        // a ReLU over a value no matmul made is left alone
        let mut plain = g.clone();
        plain.nodes[mm].op = Op::Prim(Prim::Binary(BinaryOp::Add));
        plain.nodes[mm].args = vec![grad, grad];
        plain.nodes[mm].shape = shape.to_vec();
        assert!(relu_masks_from_outputs(&plain).is_none());
        Ok(())
    }
}
