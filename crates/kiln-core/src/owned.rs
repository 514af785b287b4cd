//! Moving a tensor's buffer out without a copy, for interop (ndarray, safetensors).

use std::sync::Arc;

use crate::storage::StorageElement;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// The elements as a row-major `Vec<T>`. Moves the buffer out without copying when this handle is
    /// the only one on a contiguous storage it covers exactly and the dtype is `T`; copies otherwise.
    #[track_caller]
    pub fn into_vec<T: StorageElement>(self) -> Result<Vec<T>> {
        self.ready("into_vec", std::panic::Location::caller())?;
        if self.dtype() != T::DTYPE {
            return Err(Error::DTypeMismatch {
                op: "into_vec",
                lhs: self.dtype(),
                rhs: T::DTYPE,
            });
        }
        if self.device() != crate::Device::Cpu {
            return self.to_vec(); // a download; the device buffer stays with any other handle
        }
        let whole =
            self.is_contiguous() && self.offset() == 0 && self.storage().len() == self.numel();
        if whole && self.is_leaf() && !self.is_deferred() {
            let Tensor(inner) = self;
            match Arc::try_unwrap(inner) {
                Ok(t) => match t.storage {
                    crate::storage::Storage::Cpu(lock) => match Arc::try_unwrap(lock) {
                        Ok(lock) => {
                            let mut s = lock.into_inner().unwrap_or_else(|e| e.into_inner());
                            if let Some(v) = T::view_mut(&mut s) {
                                return Ok(std::mem::take(v));
                            }
                            return Err(Error::DTypeMismatch {
                                op: "into_vec",
                                lhs: s.dtype(),
                                rhs: T::DTYPE,
                            });
                        }
                        Err(shared) => {
                            let shared = crate::storage::Storage::Cpu(shared);
                            let t = Tensor::from_parts(shared, t.layout, t.dtype, None);
                            return t.to_vec();
                        }
                    },
                    device => return Tensor::from_parts(device, t.layout, t.dtype, None).to_vec(),
                },
                Err(shared) => return Tensor(shared).to_vec(),
            }
        }
        self.to_vec()
    }
}

/// A handle that does not keep a tensor alive (the tracer uses it to learn which traced values the
/// user still holds when a graph ends: only those become graph outputs).
#[derive(Clone)]
pub struct WeakTensor(std::sync::Weak<crate::tensor::TensorImpl>);

impl WeakTensor {
    pub fn upgrade(&self) -> Option<Tensor> {
        self.0.upgrade().map(Tensor)
    }
}

impl Tensor {
    pub fn downgrade(&self) -> WeakTensor {
        WeakTensor(Arc::downgrade(&self.0))
    }
    /// True when both handles are the same tensor (not merely the same storage).
    pub fn same_tensor(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
