//! High-level ops: each is defined exactly once here, as a composition of prims through
//! `dispatch::apply`. Eager execution, autograd and (later) tracing all derive from these definitions.

mod activation;
mod conv;
mod creation;
mod elementwise;
pub mod epilogue;
mod index;
mod linalg;
mod loss;
pub mod norm;
pub mod reduce;
mod shape;

pub use creation::{default_draw, manual_seed, set_default_generator_state, Generator};
pub use loss::Reduction;
pub use shape::ShapeArg;

use crate::storage::CpuStorage;
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

/// The dtype a Rust number takes against a tensor, as a Python scalar does in PyTorch: a float
/// keeps a float tensor's dtype and makes an integer or bool tensor float32; an integer keeps an
/// integer or float tensor's dtype and makes a bool tensor int64.
fn scalar_dtype(float_scalar: bool, like: DType) -> DType {
    match like {
        d if d.is_float() => d,
        _ if float_scalar => DType::F32,
        DType::Bool => DType::I64,
        d => d,
    }
}

/// A Rust number as an operand against `like`. Eagerly it is a CPU scalar made without a
/// dispatch; against a device tensor the runtime takes it by value where it can
/// (`takes_host_scalar`; else dispatch copies it over): no device buffer and no fill launch per
/// number, as PyTorch passes its wrapped numbers. While an interceptor records (a trace), it is
/// a `full` on `like`'s device, so the graph holds the constant where its consumers run, made
/// with `like`'s rank of ones: the broadcast that follows is then one `expand`, not a `reshape`
/// of a 0-dim value and an `expand` (a third fewer prims for each number a trace records, of
/// which batch norm's statistics have eight).
fn scalar_operand(value: f64, dtype: DType, like: &Tensor) -> Result<Tensor> {
    match crate::intercept::current() {
        Some(_) => Tensor::full_on(&vec![1; like.rank()], value, dtype, like.device()),
        None => Ok(Tensor::from_storage(
            CpuStorage::from_f64s(dtype, std::iter::once(value)),
            &[],
        )?),
    }
}

macro_rules! scalar_operand {
    ($float:expr; $($t:ty),*) => {$(
        impl Operand for $t {
            fn to_operand(self, like: &Tensor) -> Result<Tensor> {
                scalar_operand(self as f64, scalar_dtype($float, like.dtype()), like)
            }
            fn is_scalar(&self) -> bool {
                true
            }
        }
    )*};
}
scalar_operand!(true; f64, f32);
scalar_operand!(false; i32, i64, usize);
