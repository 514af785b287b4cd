//! matmul with PyTorch's 1-D, batched and broadcast semantics over the [B,M,K]x[B,K,N] prim; linear.

use crate::dispatch::apply;
use crate::prim::Prim;
use crate::shape::broadcast_shapes;
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// `torch.matmul`.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let (a, b) = (self, other);
        if a.rank() == 0 || b.rank() == 0 {
            return Err(Error::shape(
                "matmul",
                format!(
                    "both arguments need at least 1 dim, got {:?} and {:?}",
                    a.shape(),
                    b.shape()
                ),
            ));
        }
        let dtype = DType::promote(a.dtype(), b.dtype());
        let a = a.to_dtype(dtype)?;
        let b = b.to_dtype(dtype)?;
        let a2 = if a.rank() == 1 {
            a.unsqueeze(0)?
        } else {
            a.clone()
        };
        let b2 = if b.rank() == 1 {
            b.unsqueeze(1)?
        } else {
            b.clone()
        };
        let (m, k) = (a2.shape()[a2.rank() - 2], a2.shape()[a2.rank() - 1]);
        let (k2, n) = (b2.shape()[b2.rank() - 2], b2.shape()[b2.rank() - 1]);
        if k != k2 {
            return Err(Error::shape(
                "matmul",
                format!(
                    "mat1 and mat2 shapes cannot be multiplied ({:?} and {:?})",
                    self.shape(),
                    other.shape()
                ),
            ));
        }
        let batch_a = &a2.shape()[..a2.rank() - 2];
        let batch_b = &b2.shape()[..b2.rank() - 2];
        let batch = broadcast_shapes("matmul", batch_a, batch_b)?;
        let bsz: usize = batch.iter().product();
        let out = if batch_b.iter().product::<usize>() == 1 && a2.rank() > 2 && a2.is_contiguous() {
            // [.., M, K] @ [K, N]: fold the batch into M, one big gemm
            let a3 = a2.reshape([1, bsz * m, k])?;
            let b3 = b2.reshape([1, k, n])?;
            apply(Prim::Matmul, &[&a3, &b3])?
        } else {
            let mut sa = batch.clone();
            sa.extend([m, k]);
            let mut sb = batch.clone();
            sb.extend([k, n]);
            let a3 = a2.broadcast_to(&sa)?.reshape([bsz, m, k])?;
            let b3 = b2.broadcast_to(&sb)?.reshape([bsz, k, n])?;
            apply(Prim::Matmul, &[&a3, &b3])?
        };
        let mut shape = batch;
        if self.rank() > 1 {
            shape.push(m);
        }
        if other.rank() > 1 {
            shape.push(n);
        }
        out.reshape(shape)
    }
    /// `F.linear(x, w, b)`: `x @ w.T + b`; the transpose is a view gemm reads directly.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if weight.rank() != 2 {
            return Err(Error::shape(
                "linear",
                format!("weight must be [out, in], got {:?}", weight.shape()),
            ));
        }
        let y = self.matmul(&weight.t()?)?;
        match bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}
