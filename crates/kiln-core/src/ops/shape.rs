//! Views and movement: reshape, permute, expand, slicing, squeeze, cat/stack/split, pad, casts.

use crate::dispatch::apply;
use crate::prim::Prim;
use crate::shape::{norm_dim, numel};
use crate::{DType, Error, Result, Tensor};

/// A shape as users write it: `&[2, 3]`, `vec![n, -1]` (one -1 is inferred), for several int types.
pub trait ShapeArg {
    fn dims_i64(&self) -> Vec<i64>;
    fn resolve(&self, op: &'static str, numel_in: usize) -> Result<Vec<usize>> {
        let d = self.dims_i64();
        let mut infer = None;
        let mut known = 1usize;
        for (i, &v) in d.iter().enumerate() {
            if v == -1 {
                if infer.replace(i).is_some() {
                    return Err(Error::shape(
                        op,
                        format!("only one dimension can be inferred in {d:?}"),
                    ));
                }
            } else if v < 0 {
                return Err(Error::shape(op, format!("invalid dimension {v} in {d:?}")));
            } else {
                known *= v as usize;
            }
        }
        let mut out: Vec<usize> = d.iter().map(|&v| v.max(0) as usize).collect();
        if let Some(i) = infer {
            if known == 0 || numel_in % known != 0 {
                return Err(Error::shape(
                    op,
                    format!("shape {d:?} is invalid for input of size {numel_in}"),
                ));
            }
            out[i] = numel_in / known;
        }
        Ok(out)
    }
}

macro_rules! shape_arg {
    ($($t:ty),*) => {$(
        impl ShapeArg for [$t] { fn dims_i64(&self) -> Vec<i64> { self.iter().map(|&v| v as i64).collect() } }
        impl<const N: usize> ShapeArg for [$t; N] { fn dims_i64(&self) -> Vec<i64> { self.iter().map(|&v| v as i64).collect() } }
        impl ShapeArg for Vec<$t> { fn dims_i64(&self) -> Vec<i64> { self.iter().map(|&v| v as i64).collect() } }
    )*};
}
shape_arg!(usize, isize, i32, i64);

impl<S: ShapeArg + ?Sized> ShapeArg for &S {
    fn dims_i64(&self) -> Vec<i64> {
        (**self).dims_i64()
    }
}

impl Tensor {
    /// `reshape`: a view when the layout allows, a copy otherwise.
    pub fn reshape(&self, shape: impl ShapeArg) -> Result<Tensor> {
        let s = shape.resolve("reshape", self.numel())?;
        if s == self.shape() {
            return Ok(self.clone());
        }
        apply(Prim::Reshape(s), &[self])
    }
    /// `view`: like reshape, but an error when it would need a copy.
    pub fn view(&self, shape: impl ShapeArg) -> Result<Tensor> {
        if !self.is_contiguous() {
            return Err(Error::shape(
                "view",
                format!(
                    "a view of shape {:?} with strides {:?} is not contiguous; use reshape",
                    self.shape(),
                    self.strides()
                ),
            ));
        }
        self.reshape(shape)
    }
    /// `torch.clone`: a new tensor holding a copy of the values (contiguous), differentiable.
    /// `Clone::clone` copies the handle, which shares the values.
    pub fn clone_data(&self) -> Result<Tensor> {
        apply(Prim::Contiguous, &[self])
    }
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        apply(Prim::Contiguous, &[self])
    }
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape([1usize]);
        }
        let (s, e) = (
            norm_dim("flatten", start, self.rank())?,
            norm_dim("flatten", end, self.rank())?,
        );
        if s > e {
            return Err(Error::arg(
                "flatten",
                format!("start dim {start} after end dim {end}"),
            ));
        }
        let mut shape = self.shape()[..s].to_vec();
        shape.push(numel(&self.shape()[s..=e]));
        shape.extend_from_slice(&self.shape()[e + 1..]);
        self.reshape(shape)
    }
    pub fn permute(&self, dims: &[isize]) -> Result<Tensor> {
        if dims.len() != self.rank() {
            return Err(Error::arg(
                "permute",
                format!(
                    "{dims:?} has {} dims, tensor {:?} has {}",
                    dims.len(),
                    self.shape(),
                    self.rank()
                ),
            ));
        }
        let p = dims
            .iter()
            .map(|&d| norm_dim("permute", d, self.rank()))
            .collect::<Result<Vec<_>>>()?;
        apply(Prim::Permute(p), &[self])
    }
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        if self.rank() < 2 {
            return Ok(self.clone());
        }
        let (a, b) = (
            norm_dim("transpose", d0, self.rank())?,
            norm_dim("transpose", d1, self.rank())?,
        );
        let mut p: Vec<usize> = (0..self.rank()).collect();
        p.swap(a, b);
        apply(Prim::Permute(p), &[self])
    }
    /// `.t()` / `.T` for matrices.
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() > 2 {
            return Err(Error::shape(
                "t",
                format!("expects a tensor with <= 2 dims, got {:?}", self.shape()),
            ));
        }
        self.transpose(0, 1)
    }
    /// `expand`/`broadcast_to`: right-aligned, -1 keeps a dim.
    pub fn expand(&self, shape: impl ShapeArg) -> Result<Tensor> {
        let want = shape.dims_i64();
        if want.len() < self.rank() {
            return Err(Error::shape(
                "expand",
                format!("cannot expand {:?} to fewer dims {want:?}", self.shape()),
            ));
        }
        let lead = want.len() - self.rank();
        let mut target = Vec::with_capacity(want.len());
        for (i, &w) in want.iter().enumerate() {
            let cur = if i >= lead { self.shape()[i - lead] } else { 1 };
            target.push(if w == -1 {
                if i < lead {
                    return Err(Error::shape(
                        "expand",
                        format!("-1 not allowed in a new leading dim of {want:?}"),
                    ));
                }
                cur
            } else if w < 0 {
                return Err(Error::shape(
                    "expand",
                    format!("invalid size {w} in {want:?}"),
                ));
            } else {
                w as usize
            });
        }
        self.broadcast_to(&target)
    }
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        if shape.len() < self.rank() {
            return Err(Error::shape(
                "broadcast_to",
                format!("cannot broadcast {:?} to {shape:?}", self.shape()),
            ));
        }
        // leading size-1 dims first, when the ranks differ (a traced number already has the
        // rank it meets: `ops::scalar_operand`)
        let x = if shape.len() != self.rank() {
            let mut s = vec![1; shape.len() - self.rank()];
            s.extend_from_slice(self.shape());
            self.reshape(s)?
        } else {
            self.clone()
        };
        apply(Prim::Expand(shape.to_vec()), &[&x])
    }
    pub fn expand_as(&self, other: &Tensor) -> Result<Tensor> {
        self.broadcast_to(other.shape())
    }
    /// `narrow(dim, start, length)`.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = norm_dim("narrow", dim, self.rank())?;
        if self.rank() == 0 || start + len > self.shape()[d] {
            return Err(Error::index(
                "narrow",
                format!(
                    "start {start} + length {len} exceeds dim {d} of {:?}",
                    self.shape()
                ),
            ));
        }
        apply(
            Prim::Slice {
                dim: d,
                start,
                end: start + len,
                step: 1,
            },
            &[self],
        )
    }
    /// `x[start:end:step]` along `dim`; ends clamp like Python slicing, negative indices count back.
    pub fn slice(&self, dim: isize, start: isize, end: isize, step: usize) -> Result<Tensor> {
        let d = norm_dim("slice", dim, self.rank())?;
        if self.rank() == 0 {
            return Err(Error::index("slice", "cannot slice a 0-dim tensor"));
        }
        if step == 0 {
            return Err(Error::arg("slice", "step must be positive"));
        }
        let n = self.shape()[d] as isize;
        let clamp = |i: isize| (if i < 0 { i + n } else { i }).clamp(0, n) as usize;
        let (s, e) = (clamp(start), clamp(end));
        apply(
            Prim::Slice {
                dim: d,
                start: s,
                end: e.max(s),
                step,
            },
            &[self],
        )
    }
    /// `x.select(dim, i)`: index one position and drop the dim.
    pub fn select(&self, dim: isize, index: isize) -> Result<Tensor> {
        let d = norm_dim("select", dim, self.rank())?;
        let n = self.shape().get(d).copied().unwrap_or(0) as isize;
        let i = if index < 0 { index + n } else { index };
        if i < 0 || i >= n {
            return Err(Error::index(
                "select",
                format!(
                    "index {index} out of range for dim {d} of {:?}",
                    self.shape()
                ),
            ));
        }
        self.narrow(d as isize, i as usize, 1)?
            .squeeze_dim(d as isize)
    }
    pub fn squeeze(&self) -> Result<Tensor> {
        let s: Vec<usize> = self.shape().iter().copied().filter(|&d| d != 1).collect();
        self.reshape(s)
    }
    pub fn squeeze_dim(&self, dim: isize) -> Result<Tensor> {
        let d = norm_dim("squeeze", dim, self.rank())?;
        if self.rank() == 0 || self.shape()[d] != 1 {
            return Ok(self.clone());
        }
        let mut s = self.shape().to_vec();
        s.remove(d);
        self.reshape(s)
    }
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = norm_dim("unsqueeze", dim, self.rank() + 1)?;
        let mut s = self.shape().to_vec();
        s.insert(d, 1);
        self.reshape(s)
    }
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        apply(Prim::Cast(dtype), &[self])
    }
    /// `torch.cat`.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::arg("cat", "expects a non-empty list of tensors"))?;
        let d = norm_dim("cat", dim, first.rank())?;
        let dtype = tensors
            .iter()
            .skip(1)
            .fold(first.dtype(), |a, t| DType::promote(a, t.dtype()));
        let cast = tensors
            .iter()
            .map(|t| t.to_dtype(dtype))
            .collect::<Result<Vec<_>>>()?;
        if cast.len() == 1 {
            return Ok(cast[0].clone());
        }
        let refs: Vec<&Tensor> = cast.iter().collect();
        apply(Prim::Cat { dim: d }, &refs)
    }
    /// `torch.stack`: cat along a new dim.
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::arg("stack", "expects a non-empty list of tensors"))?;
        if let Some(t) = tensors.iter().find(|t| t.shape() != first.shape()) {
            return Err(Error::shape(
                "stack",
                format!(
                    "all tensors must have one shape, got {:?} and {:?}",
                    first.shape(),
                    t.shape()
                ),
            ));
        }
        let d = norm_dim("stack", dim, first.rank() + 1)?;
        let us = tensors
            .iter()
            .map(|t| t.unsqueeze(d as isize))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&us.iter().collect::<Vec<_>>(), d as isize)
    }
    /// `split(split_size, dim)`: pieces of `size` (the last may be smaller).
    pub fn split(&self, size: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = norm_dim("split", dim, self.rank())?;
        if size == 0 {
            return Err(Error::arg("split", "split size must be positive"));
        }
        let n = self.shape()[d];
        (0..n)
            .step_by(size)
            .map(|s| self.narrow(d as isize, s, size.min(n - s)))
            .collect()
    }
    /// `chunk(chunks, dim)`.
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = norm_dim("chunk", dim, self.rank())?;
        if chunks == 0 {
            return Err(Error::arg("chunk", "number of chunks must be positive"));
        }
        self.split(self.shape()[d].div_ceil(chunks).max(1), dim)
    }
    /// `F.pad(x, pad, value=v)` with PyTorch's order: pairs for the last dim first.
    pub fn pad(&self, pad: &[usize], value: f64) -> Result<Tensor> {
        if pad.len() % 2 != 0 || pad.len() / 2 > self.rank() {
            return Err(Error::arg(
                "pad",
                format!(
                    "padding {pad:?} must be pairs for at most {} dims",
                    self.rank()
                ),
            ));
        }
        let mut pads = vec![(0, 0); self.rank()];
        for (i, p) in pad.chunks(2).enumerate() {
            pads[self.rank() - 1 - i] = (p[0], p[1]);
        }
        apply(Prim::Pad { pads, value }, &[self])
    }
}
