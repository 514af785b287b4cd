//! The backward pass: topological order over recorded nodes, gradient accumulation, leaf `.grad`.

use std::collections::HashMap;
use std::sync::Arc;

use super::{vjp::vjp, GradModeGuard, Node};
use crate::{Error, Result, Tensor};

fn node_key(n: &Arc<Node>) -> usize {
    Arc::as_ptr(n) as usize
}

/// Nodes reachable from `root`, each after every node that consumes its output.
fn topo_order(root: &Arc<Node>) -> Vec<Arc<Node>> {
    let mut order = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // iterative post-order DFS (deep graphs must not overflow the stack)
    let mut stack: Vec<(Arc<Node>, bool)> = vec![(root.clone(), false)];
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
            if let Some(f) = i.grad_fn() {
                if !seen.contains(&node_key(f)) {
                    stack.push((f.clone(), false));
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

/// `tensor.backward(gradient)`: accumulates d(root)/d(leaf) into every leaf that requires grad.
pub fn backward(root: &Tensor, grad: Option<&Tensor>) -> Result<()> {
    if !root.requires_grad() {
        return Err(Error::Autograd(
            "element 0 of tensors does not require grad and does not have a grad_fn".into(),
        ));
    }
    let seed = match grad {
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
            g.to_dtype(root.dtype())?
        }
        None => {
            if root.numel() != 1 {
                return Err(Error::Autograd(format!(
                    "grad can be implicitly created only for scalar outputs, got shape {:?}",
                    root.shape()
                )));
            }
            Tensor::ones_like(root)?
        }
    };
    let _mode = GradModeGuard::new(false);
    let Some(root_fn) = root.grad_fn() else {
        // the root is itself a leaf
        let mut slot = root.grad();
        accumulate(&mut slot, seed)?;
        root.set_grad(slot);
        return Ok(());
    };
    let mut pending: HashMap<usize, Tensor> = HashMap::new();
    pending.insert(node_key(root_fn), seed);
    for node in topo_order(root_fn) {
        let Some(g) = pending.remove(&node_key(&node)) else {
            continue;
        };
        let grads = vjp(&node, &g)?;
        for (input, gi) in node.inputs.iter().zip(grads) {
            let Some(gi) = gi else { continue };
            if !input.requires_grad() {
                continue;
            }
            debug_assert_eq!(gi.shape(), input.shape(), "vjp of {:?}", node.prim);
            match input.grad_fn() {
                Some(f) => {
                    let mut slot = pending.remove(&node_key(f));
                    accumulate(&mut slot, gi)?;
                    if let Some(s) = slot {
                        pending.insert(node_key(f), s);
                    }
                }
                None => {
                    let mut slot = input.grad();
                    accumulate(&mut slot, gi)?;
                    input.set_grad(slot);
                }
            }
        }
    }
    Ok(())
}
