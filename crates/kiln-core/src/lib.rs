//! kiln-core: the tensor, the primitive op set, eager CPU execution of prims, and autograd.
//!
//! Layering (DESIGN.md invariant 6): this crate knows nothing of compilation, `nn` or CUDA codegen.
//! Everything a user computes passes through `dispatch::apply` with a `Prim`; high-level ops in
//! `ops/` are compositions of prims, defined once.

pub mod autograd;
pub mod cpu;
mod device;
pub mod dispatch;
mod display;
mod dtype;
mod error;
pub mod intercept;
pub mod ops;
mod owned;
pub mod prim;
pub mod shape;
pub mod storage;
mod tensor;

pub use autograd::{no_grad, GradModeGuard};
pub use device::Device;
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use ops::norm::RunningStats;
pub use ops::{manual_seed, Generator, Operand, Reduction, ShapeArg};
pub use owned::WeakTensor;
pub use tensor::Tensor;

impl Tensor {
    /// `loss.backward()`.
    pub fn backward(&self) -> Result<()> {
        autograd::backward(self, None)
    }
    /// `out.backward(gradient)`.
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        autograd::backward(self, Some(grad))
    }
}
