//! kiln-core: the tensor, the primitive op set, eager CPU execution of prims, and autograd.
//!
//! Layering (DESIGN.md invariant 6): this crate knows nothing of compilation, `nn` or CUDA codegen.
//! Everything a user computes passes through `dispatch::apply` with a `Prim`; high-level ops in
//! `ops/` are compositions of prims, defined once.

pub mod autograd;
pub mod backends;
pub mod cache;
pub mod cpu;
pub mod device;
pub mod dispatch;
mod display;
mod dtype;
mod error;
pub mod host_memory;
pub mod intercept;
pub mod ops;
mod owned;
pub mod prim;
pub mod profiler;
mod raw;
pub mod shape;
pub mod storage;
mod tensor;

pub use autograd::{no_grad, GradModeGuard};
pub use device::{synchronize, Device};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use ops::norm::RunningStats;
pub use ops::{manual_seed, Generator, Operand, Reduction, ShapeArg};
pub use owned::WeakTensor;
pub use tensor::Tensor;

impl Tensor {
    /// `loss.backward()`.
    #[track_caller]
    pub fn backward(&self) -> Result<()> {
        self.backward_at(None, std::panic::Location::caller())
    }
    /// `out.backward(gradient)`.
    #[track_caller]
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        self.backward_at(Some(grad), std::panic::Location::caller())
    }
    /// Inside traced code, `backward` ends the graph (a graph break, as in torch.compile): the graph
    /// runs — a compiled graph records its own backward on the tape — and the backward pass then
    /// runs eagerly, outside the trace, into the leaves' `.grad`.
    fn backward_at(
        &self,
        grad: Option<&Tensor>,
        at: &'static std::panic::Location<'static>,
    ) -> Result<()> {
        self.ready("backward", at)?;
        if let Some(g) = grad {
            g.ready("backward", at)?;
        }
        let _outside = intercept::install(None);
        autograd::backward(self, grad)
    }
}
