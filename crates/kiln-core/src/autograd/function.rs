//! `Function`: a computation recorded on the tape as one node with its own backward, as
//! `torch.autograd.Function` is. The compiler uses it for compiled graphs: the forward ran as one
//! graph, the backward is another.

use std::sync::Arc;

use super::{is_grad_enabled, Node, NodeKind};
use crate::{Result, Tensor};

pub trait Function: Send + Sync {
    /// Shown in errors and reports.
    fn name(&self) -> &str;
    /// Given one gradient per output (`None`: that output did not reach the loss), returns one
    /// gradient per input (`None`: no gradient for that input). Runs with grad mode off.
    fn backward(&self, grad_outputs: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>>;
    /// The tensors this node keeps alive for its backward (for memory reports).
    fn saved_tensors(&self) -> Vec<Tensor> {
        Vec::new()
    }
}

/// Records `f` as the producer of `outputs` from `inputs`: returns the outputs as new handles whose
/// gradients flow into `f.backward`. Outputs that cannot carry gradients (integer, bool) and calls
/// made without grad mode or without an input that requires grad come back unchanged.
pub fn apply_function(f: Arc<dyn Function>, inputs: &[Tensor], outputs: &[Tensor]) -> Vec<Tensor> {
    if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
        return outputs.to_vec();
    }
    let node = Arc::new(Node {
        kind: NodeKind::Function(f),
        inputs: inputs.to_vec(),
        num_outputs: outputs.len(),
    });
    outputs
        .iter()
        .enumerate()
        .map(|(k, o)| {
            if o.dtype().is_float() {
                o.with_grad_fn(node.clone(), k)
            } else {
                o.clone()
            }
        })
        .collect()
}
