//! `ndarray` interop, kiln's NumPy analog: arrays in and out, without a copy where the layout allows.

use kiln_core::storage::StorageElement;
use kiln_core::{Result, Tensor};
use ndarray::{ArrayD, IxDyn};

/// Conversions between `Tensor` and `ndarray::ArrayD`.
pub trait NdarrayExt: Sized {
    /// Takes ownership of an array; a standard-layout array's buffer becomes the tensor's storage as is.
    fn from_ndarray<T: StorageElement>(a: ArrayD<T>) -> Result<Self>;
    /// A copy of the tensor as an array of `T` (the values are converted if the dtype differs).
    fn to_ndarray<T: StorageElement>(&self) -> Result<ArrayD<T>>;
    /// Moves the tensor into an array, without a copy when the tensor is the sole owner of its buffer.
    fn into_ndarray<T: StorageElement>(self) -> Result<ArrayD<T>>;
}

fn shape_err(e: ndarray::ShapeError) -> kiln_core::Error {
    kiln_core::Error::shape("ndarray", e.to_string())
}

impl NdarrayExt for Tensor {
    fn from_ndarray<T: StorageElement>(a: ArrayD<T>) -> Result<Tensor> {
        let shape = a.shape().to_vec();
        let a = if a.is_standard_layout() {
            a
        } else {
            a.as_standard_layout().into_owned()
        };
        let (v, offset) = a.into_raw_vec_and_offset();
        let v = match offset {
            Some(o) if o > 0 => v[o..].to_vec(),
            _ => v,
        };
        let n: usize = shape.iter().product();
        let v = if v.len() == n {
            v
        } else {
            v.into_iter().take(n).collect()
        };
        Tensor::from_vec(v, &shape)
    }
    fn to_ndarray<T: StorageElement>(&self) -> Result<ArrayD<T>> {
        ArrayD::from_shape_vec(IxDyn(self.shape()), self.to_vec::<T>()?).map_err(shape_err)
    }
    fn into_ndarray<T: StorageElement>(self) -> Result<ArrayD<T>> {
        let shape = self.shape().to_vec();
        let v = if self.dtype() == T::DTYPE {
            self.into_vec::<T>()?
        } else {
            self.to_vec::<T>()?
        };
        ArrayD::from_shape_vec(IxDyn(&shape), v).map_err(shape_err)
    }
}
