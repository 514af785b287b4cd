//! `torch.optim`: SGD, Adam, AdamW, and the StepLR / CosineAnnealingLR schedulers.
//!
//! Each optimizer has two implementations of one update rule: a per-parameter loop, and a
//! multi-tensor ("foreach") form that concatenates every parameter, gradient and state of a dtype into
//! one flat tensor and does the arithmetic once. Both call the same math function (`sgd::update`,
//! `adam::update`), so they cannot drift apart. Updates run under `no_grad` and write parameters with
//! `assign`, so parameters keep their identity.

mod adam;
mod flat;
mod flat_update;
mod scheduler;
mod sgd;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::collections::HashSet;

use kiln_core::{no_grad, Error, Result, Tensor};

pub use adam::{Adam, AdamConfig, AdamW, AdamWConfig};
pub use scheduler::{CosineAnnealingLR, LrScheduler, StepLR};
pub use sgd::{SGDConfig, SGD};

pub trait Optimizer {
    /// One update of every parameter that has a gradient; parameters without one are skipped.
    fn step(&mut self) -> Result<()>;
    /// Clears the gradients of every parameter (`set_to_none=True`, PyTorch's default).
    fn zero_grad(&self);
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);
    /// A shared handle to the learning rate, through which a scheduler drives this optimizer.
    fn lr_handle(&self) -> LrHandle;
}

/// The learning rate, shared between an optimizer and its schedulers (PyTorch's `param_group['lr']`).
#[derive(Clone, Debug)]
pub struct LrHandle(Arc<LrCell>);

#[derive(Debug)]
struct LrCell {
    bits: AtomicU64,
    /// The same value as a 0-dim f64 tensor, written in place by `set`.
    tensor: Tensor,
}

impl LrHandle {
    pub fn new(lr: f64) -> Self {
        LrHandle(Arc::new(LrCell {
            bits: AtomicU64::new(lr.to_bits()),
            tensor: Tensor::scalar(lr),
        }))
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.bits.load(Ordering::Relaxed))
    }
    pub fn set(&self, lr: f64) {
        self.0.bits.store(lr.to_bits(), Ordering::Relaxed);
        // a 0-dim f64 into a 0-dim f64 cannot fail
        let _ = no_grad(|| self.0.tensor.assign(&Tensor::scalar(lr)));
    }
    /// The learning rate as a 0-dim f64 tensor that `set` updates in place. An optimizer whose step
    /// is compiled reads it as a graph input, so a scheduler's change reaches the replays (a Rust
    /// `f64` would be baked into the graph as a constant).
    pub fn tensor(&self) -> &Tensor {
        &self.0.tensor
    }
}

/// Checks an optimizer's parameter list: non-empty, floating-point leaves. Duplicates are dropped so a
/// tied parameter is updated once.
pub(crate) fn check_params(op: &'static str, params: Vec<Tensor>) -> Result<Vec<Tensor>> {
    if params.is_empty() {
        return Err(Error::arg(op, "optimizer got an empty parameter list"));
    }
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(params.len());
    for p in params {
        if !p.is_leaf() {
            return Err(Error::arg(
                op,
                format!("can't optimize a non-leaf Tensor (shape {:?})", p.shape()),
            ));
        }
        if !p.dtype().is_float() {
            return Err(Error::dtype(
                op,
                p.dtype(),
                "optimizers update floating-point parameters only",
            ));
        }
        if seen.insert(p.id()) {
            out.push(p);
        }
    }
    Ok(out)
}

pub(crate) fn check_hyper(op: &'static str, name: &str, v: f64, ok: bool) -> Result<()> {
    if !ok || v.is_nan() {
        return Err(Error::arg(op, format!("Invalid {name} value: {v}")));
    }
    Ok(())
}

/// A parameter's gradient in the parameter's dtype, or None when backward has not reached it.
pub(crate) fn grad_of(p: &Tensor) -> Result<Option<Tensor>> {
    match p.grad() {
        None => Ok(None),
        Some(g) if g.shape() != p.shape() => Err(Error::shape(
            "optimizer",
            format!(
                "gradient of shape {:?} for a parameter of shape {:?}",
                g.shape(),
                p.shape()
            ),
        )),
        Some(g) => Ok(Some(g.to_dtype(p.dtype())?)),
    }
}
