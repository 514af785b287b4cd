//! The backward pass: topological order over recorded nodes, gradient accumulation, and delivery
//! either into leaves' `.grad` (`backward`) or back to the caller (`grad`).

use std::collections::HashMap;
use std::sync::Arc;

use super::{vjp::vjp, GradModeGuard, Node, NodeKind};
use crate::{Error, Result, Tensor};

fn node_key(n: &Arc<Node>) -> usize {
    Arc::as_ptr(n) as usize
}

/// Nodes reachable from `roots`, each after every node that consumes one of its outputs.
fn topo_order(roots: &[Arc<Node>]) -> Vec<Arc<Node>> {
    let mut order = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // iterative post-order DFS (deep graphs must not overflow the stack)
    let mut stack: Vec<(Arc<Node>, bool)> = roots.iter().map(|r| (r.clone(), false)).collect();
    while let Some((n, expanded)) = stack.pop() {
        if expanded {
            order.push(n);
            continue;
        }
        if !seen.insert(node_key(&n)) {
            continue;
        }
        stack.push((n.clone(), true));
        for i in &n.inputs {
            if let Some(e) = i.grad_fn() {
                if !seen.contains(&node_key(&e.node)) {
                    stack.push((e.node.clone(), false));
                }
            }
        }
    }
    order.reverse();
    order
}

fn accumulate(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        Some(prev) => prev.add(&g)?,
        None => g,
    });
    Ok(())
}

/// The gradient seed for `root`: `grad` checked against it, or ones for a scalar.
fn seed_for(root: &Tensor, grad: Option<&Tensor>) -> Result<Tensor> {
    if !root.requires_grad() {
        return Err(Error::Autograd(
            "element 0 of tensors does not require grad and does not have a grad_fn".into(),
        ));
    }
    match grad {
        Some(g) => {
            if g.shape() != root.shape() {
                return Err(Error::shape(
                    "backward",
                    format!(
                        "gradient shape {:?} does not match output shape {:?}",
                        g.shape(),
                        root.shape()
                    ),
                ));
            }
            g.to_dtype(root.dtype())
        }
        None => {
            if root.numel() != 1 {
                return Err(Error::Autograd(format!(
                    "grad can be implicitly created only for scalar outputs, got shape {:?}",
                    root.shape()
                )));
            }
            Tensor::ones_like(root)
        }
    }
}

/// Where gradients that reach a tensor end up.
enum Sink<'a> {
    /// Leaves accumulate into `.grad`.
    LeafGrads,
    /// Gradients of the listed tensors (by id, to their position) are returned; `.grad` untouched.
    Capture(&'a HashMap<u64, usize>, &'a mut Vec<Option<Tensor>>),
}

/// Hands `g`, the gradient of `t`, on: into pending node gradients, a leaf's `.grad`, or the capture.
fn deliver(
    t: &Tensor,
    g: Tensor,
    pending: &mut HashMap<usize, Vec<Option<Tensor>>>,
    sink: &mut Sink,
) -> Result<()> {
    if let Sink::Capture(targets, out) = sink {
        if let Some(&k) = targets.get(&t.id()) {
            accumulate(&mut out[k], g.clone())?;
        }
    }
    match t.grad_fn() {
        Some(e) => {
            let slots = pending
                .entry(node_key(&e.node))
                .or_insert_with(|| vec![None; e.node.num_outputs]);
            accumulate(&mut slots[e.index], g)
        }
        None => {
            if let Sink::LeafGrads = sink {
                let mut slot = t.grad();
                accumulate(&mut slot, g)?;
                t.set_grad(slot);
            }
            Ok(())
        }
    }
}

fn run(roots: &[(Tensor, Tensor)], mut sink: Sink) -> Result<()> {
    let _mode = GradModeGuard::new(false);
    let mut pending: HashMap<usize, Vec<Option<Tensor>>> = HashMap::new();
    for (root, seed) in roots {
        deliver(root, seed.clone(), &mut pending, &mut sink)?;
    }
    let root_nodes: Vec<Arc<Node>> = roots
        .iter()
        .filter_map(|(r, _)| r.grad_fn().map(|e| e.node.clone()))
        .collect();
    for node in topo_order(&root_nodes) {
        let Some(gs) = pending.remove(&node_key(&node)) else {
            continue;
        };
        let grads = match &node.kind {
            NodeKind::Prim { prim, output } => match &gs[0] {
                Some(g) => vjp(prim, &node.inputs, &output.get()?, g)?,
                None => continue,
            },
            NodeKind::Function(f) => {
                let grads = f.backward(&gs)?;
                if grads.len() != node.inputs.len() {
                    return Err(Error::Autograd(format!(
                        "{}: backward returned {} gradients for {} inputs",
                        f.name(),
                        grads.len(),
                        node.inputs.len()
                    )));
                }
                grads
            }
        };
        for (input, gi) in node.inputs.iter().zip(grads) {
            let Some(gi) = gi else { continue };
            if !input.requires_grad() {
                continue;
            }
            if gi.shape() != input.shape() {
                return Err(Error::Autograd(format!(
                    "backward produced a gradient of shape {:?} for an input of shape {:?}",
                    gi.shape(),
                    input.shape()
                )));
            }
            deliver(input, gi, &mut pending, &mut sink)?;
        }
    }
    Ok(())
}

/// `tensor.backward(gradient)`: accumulates d(root)/d(leaf) into every leaf that requires grad.
pub fn backward(root: &Tensor, grad: Option<&Tensor>) -> Result<()> {
    let seed = seed_for(root, grad)?;
    run(&[(root.clone(), seed)], Sink::LeafGrads)
}

/// `torch.autograd.grad(outputs, inputs, grad_outputs)`: the gradients of `outputs` (weighted by
/// `grad_outputs`, ones for scalars when `None`) with respect to each of `inputs`, returned rather than
/// accumulated; `.grad` fields are not touched. `None` where an input is not reached.
pub fn grad(
    outputs: &[Tensor],
    inputs: &[Tensor],
    grad_outputs: &[Option<Tensor>],
) -> Result<Vec<Option<Tensor>>> {
    if grad_outputs.len() != outputs.len() {
        return Err(Error::arg(
            "autograd::grad",
            format!(
                "{} grad_outputs for {} outputs",
                grad_outputs.len(),
                outputs.len()
            ),
        ));
    }
    let roots = outputs
        .iter()
        .zip(grad_outputs)
        .map(|(o, g)| Ok((o.clone(), seed_for(o, g.as_ref())?)))
        .collect::<Result<Vec<_>>>()?;
    let targets: HashMap<u64, usize> = inputs
        .iter()
        .enumerate()
        .map(|(k, t)| (t.id(), k))
        .collect();
    let mut out = vec![None; inputs.len()];
    run(&roots, Sink::Capture(&targets, &mut out))?;
    Ok(out)
}
