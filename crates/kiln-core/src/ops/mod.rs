//! High-level ops: each is defined exactly once here, as a composition of prims through
//! `dispatch::apply`. Eager execution, autograd and (later) tracing all derive from these definitions.

mod activation;
mod conv;
mod creation;
mod elementwise;
mod index;
mod linalg;
mod loss;
pub mod norm;
mod reduce;
mod shape;

pub use creation::{default_draw, manual_seed, set_default_generator_state, Generator};
pub use loss::Reduction;
pub use shape::ShapeArg;

use crate::{DType, Result, Tensor};

/// Something that can stand on the right of a binary op: a tensor or a Rust number.
/// Numbers behave like Python scalars in PyTorch: they take the tensor's dtype unless that would lose
/// their value (a fractional number against an integer tensor gives float32).
pub trait Operand {
    fn to_operand(self, like: &Tensor) -> Result<Tensor>;
    /// True for Rust numbers (Python scalars), which take their dtype from the tensor they meet.
    fn is_scalar(&self) -> bool {
        false
    }
}

impl Operand for &Tensor {
    fn to_operand(self, _: &Tensor) -> Result<Tensor> {
        Ok(self.clone())
    }
}

impl Operand for Tensor {
    fn to_operand(self, _: &Tensor) -> Result<Tensor> {
        Ok(self)
    }
}

fn scalar_dtype(v: f64, like: DType) -> DType {
    let integral = v.fract() == 0.0 && v.is_finite();
    match like {
        d if d.is_float() => d,
        DType::Bool if integral => DType::I64,
        d if integral => d,
        _ => DType::F32,
    }
}

macro_rules! scalar_operand {
    ($($t:ty),*) => {$(
        impl Operand for $t {
            fn to_operand(self, like: &Tensor) -> Result<Tensor> {
                let v = self as f64;
                Tensor::full(&[], v, scalar_dtype(v, like.dtype()))
            }
            fn is_scalar(&self) -> bool {
                true
            }
        }
    )*};
}
scalar_operand!(f64, f32, i32, i64, usize);
