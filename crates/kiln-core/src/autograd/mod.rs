//! Reverse-mode autograd over primitive ops. Each differentiable prim executed with grad enabled
//! records a `Node`; `backward` walks the nodes in reverse topological order and applies each prim's
//! VJP rule (`vjp.rs`). Because high-level ops are compositions of prims, every op gets its backward
//! from the prims' rules — there is no per-op backward code.

mod engine;
mod vjp;

use std::cell::Cell;

use crate::prim::Prim;
use crate::Tensor;

pub use engine::backward;

/// One recorded prim application.
pub struct Node {
    pub(crate) prim: Prim,
    pub(crate) inputs: Vec<Tensor>,
    /// The output, detached (the node must not own a handle that points back at itself).
    pub(crate) output: Tensor,
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
pub(crate) fn is_differentiable(p: &Prim) -> bool {
    !matches!(
        p,
        Prim::ArgReduce { .. }
            | Prim::Full { .. }
            | Prim::Iota { .. }
            | Prim::Rand { .. }
            | Prim::Conv2dGradInput { .. }
            | Prim::Conv2dGradWeight { .. }
    ) && !matches!(p, Prim::Binary(b) if b.is_comparison() || b.is_logical())
        && !matches!(p, Prim::Cast(d) if !d.is_float())
}
