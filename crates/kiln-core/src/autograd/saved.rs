//! How much memory an autograd graph keeps alive for its backward pass.

use std::collections::HashSet;
use std::sync::Arc;

use super::{Node, NodeKind, SavedOutput};
use crate::Tensor;

/// Bytes held by the tape behind some outputs, counted once per storage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SavedBytes {
    /// Everything but parameters: intermediate values, and inputs that do not require grad.
    pub activations: usize,
    /// Leaf tensors that require grad (parameters) the tape also references; alive anyway.
    pub leaves: usize,
}

/// Walks the nodes behind `roots` and sums the storages they hold: prim nodes hold their operands
/// and output, `Function` nodes what they report as saved.
pub fn saved_bytes(roots: &[Tensor]) -> SavedBytes {
    let mut seen_nodes = HashSet::new();
    let mut held: Vec<(Tensor, bool)> = Vec::new();
    let mut stack: Vec<Arc<Node>> = roots
        .iter()
        .filter_map(|r| r.grad_fn().map(|e| e.node.clone()))
        .collect();
    while let Some(n) = stack.pop() {
        if !seen_nodes.insert(Arc::as_ptr(&n) as usize) {
            continue;
        }
        for i in &n.inputs {
            held.push((i.clone(), i.is_leaf() && i.requires_grad()));
            if let Some(e) = i.grad_fn() {
                stack.push(e.node.clone());
            }
        }
        match &n.kind {
            NodeKind::Prim { output, .. } => {
                if let SavedOutput::Detached(t) = output {
                    held.push((t.clone(), false));
                }
            }
            NodeKind::Function(f) => held.extend(f.saved_tensors().into_iter().map(|t| {
                let leaf = t.is_leaf() && t.requires_grad();
                (t, leaf)
            })),
        }
    }
    // a storage referenced by any leaf counts as a leaf's
    let leaf_storages: HashSet<usize> = held
        .iter()
        .filter(|(_, leaf)| *leaf)
        .map(|(t, _)| t.0.storage.key())
        .collect();
    let mut counted = HashSet::new();
    let mut out = SavedBytes::default();
    for (t, _) in &held {
        let key = t.0.storage.key();
        if !counted.insert(key) {
            continue;
        }
        let bytes = t.0.storage.len() * t.dtype().size_in_bytes();
        if leaf_storages.contains(&key) {
            out.leaves += bytes;
        } else {
            out.activations += bytes;
        }
    }
    out
}
