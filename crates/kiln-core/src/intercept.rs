//! Hooks that let a layer above the core (the compiler's tracer) record prims instead of running
//! them. The core knows only this contract, not what records or why (DESIGN.md invariant 6).
//!
//! While an `Interceptor` is installed on a thread, `dispatch::apply` offers it every prim; the
//! interceptor returns *deferred* tensors whose values do not exist yet. Reading a deferred tensor's
//! values (`to_vec`, `item`, `assign` from it, printing) forces it through its `Deferred` hook: for
//! the tracer, that is a graph break.

use std::cell::RefCell;
use std::panic::Location;
use std::sync::Arc;

use crate::prim::{OutMeta, Prim};
use crate::{Device, Result, Tensor};

pub trait Interceptor: Send + Sync {
    /// Offered every prim while installed; `None` lets the core execute it eagerly. `device` is
    /// where the prim runs: its operands' device, or the device a creation prim was asked for. An
    /// operand may be a single-element CPU tensor meeting device operands (PyTorch's CPU-scalar
    /// rule); executed eagerly, it is copied to `device` first.
    fn apply(
        &self,
        prim: &Prim,
        inputs: &[&Tensor],
        meta: &OutMeta,
        device: Device,
    ) -> Option<Result<Tensor>>;
    /// Offered every in-place copy (`Tensor::assign`) while installed; `None` copies eagerly.
    fn assign(&self, dst: &Tensor, src: &Tensor) -> Option<Result<()>>;
    /// Whether the dispatcher records autograd nodes on the deferred tensors this interceptor
    /// returns (the compiler's joint forward+backward tracer wants them; the capture tracer does not).
    fn records_autograd(&self) -> bool {
        false
    }
    /// Told when traced code reads `owner.grad()` (and gets `grad`): the gradient is a different
    /// tensor after every backward pass, so it must be read from `owner` on each call.
    fn grad_read(&self, owner: &Tensor, grad: &Tensor) {
        let _ = (owner, grad);
    }
    /// Told when traced code depends on Rust state a replay cannot reproduce (`why` says which):
    /// the code must be traced again on every call.
    fn retrace_every_call(&self, why: &'static str) {
        let _ = why;
    }
    /// Told before the values of a tensor that is not deferred are read: a tensor the intercepted
    /// code wrote with `assign` holds its old values until the recorded write runs, so the
    /// interceptor must run it first.
    fn before_read(
        &self,
        t: &Tensor,
        why: &'static str,
        at: &'static Location<'static>,
    ) -> Result<()> {
        let _ = (t, why, at);
        Ok(())
    }
}

/// The producer of a deferred tensor's value.
pub trait Deferred: Send + Sync {
    /// Computes the values of `t` (and whatever else must be computed with it) and fills them in
    /// with `Tensor::fill_deferred`. `why` names the read that needs the values; `at` is its caller.
    fn force(&self, t: &Tensor, why: &'static str, at: &'static Location<'static>) -> Result<()>;
}

thread_local! {
    static INTERCEPTOR: RefCell<Option<Arc<dyn Interceptor>>> = const { RefCell::new(None) };
}

/// The interceptor installed on this thread, if any.
pub fn current() -> Option<Arc<dyn Interceptor>> {
    INTERCEPTOR.with(|i| i.borrow().clone())
}

/// Runs the installed interceptor's `before_read` hook (nothing, and no reference count traffic,
/// when none is installed: this is on the eager path of every op).
pub(crate) fn before_read(
    t: &Tensor,
    why: &'static str,
    at: &'static Location<'static>,
) -> Result<()> {
    match INTERCEPTOR.with(|i| i.borrow().as_ref().map(Arc::clone)) {
        Some(i) => i.before_read(t, why, at),
        None => Ok(()),
    }
}

/// Uninstalls (restores the previous interceptor) when dropped.
pub struct InterceptGuard {
    prev: Option<Arc<dyn Interceptor>>,
}

impl Drop for InterceptGuard {
    fn drop(&mut self) {
        let prev = self.prev.take();
        INTERCEPTOR.with(|i| *i.borrow_mut() = prev);
    }
}

/// Installs `i` on this thread (or clears the slot with `None`) until the guard drops.
pub fn install(i: Option<Arc<dyn Interceptor>>) -> InterceptGuard {
    let prev = INTERCEPTOR.with(|slot| std::mem::replace(&mut *slot.borrow_mut(), i));
    InterceptGuard { prev }
}
