//! gather / scatter_add / index_select / embedding over the Gather and ScatterAdd prims.

use crate::dispatch::apply;
use crate::prim::Prim;
use crate::shape::norm_dim;
use crate::{DType, Error, Result, Tensor};

fn as_index(op: &'static str, index: &Tensor) -> Result<Tensor> {
    if index.dtype().is_float() || index.dtype() == DType::Bool {
        return Err(Error::dtype(
            op,
            index.dtype(),
            "index tensors must have an integer dtype",
        ));
    }
    index.to_dtype(DType::I64)
}

impl Tensor {
    /// `torch.gather(x, dim, index)`.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let d = norm_dim("gather", dim, self.rank())?;
        apply(
            Prim::Gather { dim: d },
            &[self, &as_index("gather", index)?],
        )
    }
    /// `x.scatter_add(dim, index, src)` (out of place).
    pub fn scatter_add(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let d = norm_dim("scatter_add", dim, self.rank())?;
        let src = src.to_dtype(self.dtype())?;
        apply(
            Prim::ScatterAdd { dim: d },
            &[self, &as_index("scatter_add", index)?, &src],
        )
    }
    /// `torch.index_select(x, dim, index)` with a 1-D index.
    pub fn index_select(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let d = norm_dim("index_select", dim, self.rank())?;
        if index.rank() != 1 {
            return Err(Error::shape(
                "index_select",
                format!("index must be 1-D, got {:?}", index.shape()),
            ));
        }
        let idx = as_index("index_select", index)?;
        let mut view = vec![1; self.rank()];
        view[d] = idx.numel();
        let mut full = self.shape().to_vec();
        full[d] = idx.numel();
        let idx = idx.reshape(view)?.broadcast_to(&full)?;
        apply(Prim::Gather { dim: d }, &[self, &idx])
    }
    /// `F.embedding(indices, weight)`: rows of `self` ([V, D]) for each index.
    pub fn embedding(&self, indices: &Tensor) -> Result<Tensor> {
        if self.rank() != 2 {
            return Err(Error::shape(
                "embedding",
                format!(
                    "weight must be [num_embeddings, dim], got {:?}",
                    self.shape()
                ),
            ));
        }
        let flat = indices.reshape([indices.numel()])?;
        let rows = self.index_select(0, &flat)?;
        let mut s = indices.shape().to_vec();
        s.push(self.shape()[1]);
        rows.reshape(s)
    }
}
