//! Reverse-mode autograd over primitive ops. Each differentiable prim executed with grad enabled
//! records a `Node`; `backward` walks the nodes in reverse topological order and applies each prim's
//! VJP rule (`vjp.rs`). Because high-level ops are compositions of prims, every op gets its backward
//! from the prims' rules — there is no per-op backward code.
//!
//! Besides prims, a node can hold a `Function`: a whole computation with its own backward (the
//! compiler records one such node per compiled graph, whose backward is itself a compiled graph).

mod engine;
mod function;
mod saved;
mod vjp;

use std::cell::Cell;
use std::sync::Arc;

use crate::prim::Prim;
use crate::{Result, Tensor, WeakTensor};

pub use engine::{backward, grad};
pub use function::{apply_function, Function};
pub use saved::{saved_bytes, SavedBytes};

/// One recorded step of the forward computation.
pub struct Node {
    pub(crate) kind: NodeKind,
    /// The operands; gradients flow back to those that require grad.
    pub(crate) inputs: Vec<Tensor>,
    pub(crate) num_outputs: usize,
}

pub(crate) enum NodeKind {
    Prim { prim: Prim, output: SavedOutput },
    Function(Arc<dyn Function>),
}

/// A prim node's output, as its VJP rule reads it. The node must not own a handle that points back
/// at itself, so eager outputs are kept as a detached alias of the storage and traced outputs (which
/// have no storage yet) weakly: a traced value is alive while any later node reads it.
pub(crate) enum SavedOutput {
    Detached(Tensor),
    Traced(WeakTensor),
}

impl SavedOutput {
    fn get(&self) -> Result<Tensor> {
        match self {
            SavedOutput::Detached(t) => Ok(t.clone()),
            SavedOutput::Traced(w) => w.upgrade().ok_or_else(|| {
                crate::Error::Autograd("a traced output read by a backward rule was dropped".into())
            }),
        }
    }
}

/// Where a tensor's gradient goes: output `index` of `node`.
#[derive(Clone)]
pub(crate) struct GradEdge {
    pub(crate) node: Arc<Node>,
    pub(crate) index: usize,
}

impl Node {
    pub(crate) fn prim(prim: Prim, inputs: &[&Tensor], output: SavedOutput) -> Arc<Node> {
        Arc::new(Node {
            kind: NodeKind::Prim { prim, output },
            inputs: inputs.iter().map(|t| (*t).clone()).collect(),
            num_outputs: 1,
        })
    }
}

/// Whether applying `prim` to `inputs` records a node (grad mode on, differentiable, an operand
/// that requires grad).
pub(crate) fn needs_grad(prim: &Prim, inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && is_differentiable(prim) && inputs.iter().any(|t| t.requires_grad())
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the previous grad mode when dropped.
pub struct GradModeGuard {
    prev: bool,
}

impl GradModeGuard {
    pub fn new(enabled: bool) -> Self {
        let prev = GRAD_ENABLED.with(|g| g.replace(enabled));
        GradModeGuard { prev }
    }
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}

/// Runs `f` with gradient recording off (`with torch.no_grad():`).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _g = GradModeGuard::new(false);
    f()
}

/// Prims whose outputs carry gradient to their inputs.
pub fn is_differentiable(p: &Prim) -> bool {
    !matches!(
        p,
        Prim::ArgReduce { .. }
            | Prim::Full { .. }
            | Prim::Iota { .. }
            | Prim::Rand { .. }
            | Prim::Conv2dGradInput { .. }
            | Prim::Conv2dGradWeight { .. }
            | Prim::MatmulEpilogue(_)
            | Prim::Conv2dEpilogue { .. }
    ) && !matches!(p, Prim::Binary(b) if b.is_comparison() || b.is_logical())
        && !matches!(p, Prim::Cast(d) if !d.is_float())
}
