//! Reductions over any set of dims, with keepdim; softmax family.

use crate::dispatch::apply;
use crate::prim::{ArgReduceOp, Prim, ReduceOp};
use crate::shape::norm_dim;
use crate::{DType, Result, Tensor};

/// Normalized, sorted, deduplicated dims; empty means every dim.
fn reduce_dims(op: &'static str, x: &Tensor, dims: &[isize]) -> Result<Vec<usize>> {
    if dims.is_empty() {
        return Ok((0..x.rank()).collect());
    }
    let mut d = dims
        .iter()
        .map(|&i| norm_dim(op, i, x.rank()))
        .collect::<Result<Vec<_>>>()?;
    d.sort_unstable();
    d.dedup();
    if x.rank() == 0 {
        d.clear();
    }
    Ok(d)
}

fn drop_dims(x: &Tensor, dims: &[usize], keepdim: bool) -> Result<Tensor> {
    if keepdim {
        return Ok(x.clone());
    }
    let s: Vec<usize> = x
        .shape()
        .iter()
        .enumerate()
        .filter(|(i, _)| !dims.contains(i))
        .map(|(_, &d)| d)
        .collect();
    x.reshape(s)
}

/// `Σ (x - mean(x))²` over the normalized dims `d`, kept (`ReduceOp::SumSqDev`) of a float `x`:
/// what a variance divides by its count. A norm's variance, in one walk where the mean and the
/// squares around it took two.
fn sum_sq_dev(x: &Tensor, d: &[usize]) -> Result<Tensor> {
    if d.is_empty() {
        // one value per output (a scalar): no deviation (NaN for an infinite value, as Welford's)
        return x.sub(x)?.square();
    }
    apply(
        Prim::Reduce {
            op: ReduceOp::SumSqDev,
            dims: d.to_vec(),
        },
        &[x],
    )
}

/// Longest trailing row whose squared deviations a device takes as two sums
/// (`sum_sq_dev_as_ops`): a GPU's row kernel holds a row this long in registers, where the
/// second sum reads it again for free (kiln-inductor's `rows::MAX_COLS`).
pub const SQDEV_TWO_SUMS_ROW: usize = 4096;

/// Whether a device takes the squared deviations of an operand of `shape` and `dtype` over
/// `dims` (normalized, ascending) as moment sums — `Σx²` and `Σx` in f64, one walk — rather
/// than as the mean and then the squares around it: any 16-bit or f32 operand but a trailing
/// row of at most `SQDEV_TWO_SUMS_ROW` elements (layer norm); an f64 operand has no wider type
/// to sum its squares in.
pub fn sq_dev_in_moment_sums(shape: &[usize], dtype: DType, dims: &[usize]) -> bool {
    let rank = shape.len();
    let cols: usize = dims.iter().map(|&d| shape[d]).product();
    let trailing = !dims.is_empty() && dims.iter().copied().eq(rank - dims.len()..rank);
    dtype != DType::F64 && !(trailing && (2..=SQDEV_TWO_SUMS_ROW).contains(&cols))
}

/// `ReduceOp::SumSqDev` of `x` over `dims` (kept) as other prims, what a device without a
/// Welford kernel computes: kiln-cuda's eager runtime runs these, and kiln-inductor rewrites a
/// GPU graph's `SumSqDev` into the same prims (`two_pass.rs`), so a device's compiled results
/// compute what its eager ones do. Equal to the prim's value up to rounding. Moment sums where
/// `sq_dev_in_moment_sums` says so — `Σx² - (Σx)² / n` in f64, clamped at zero (rounding may
/// leave a constant row's value a hair below), rounded to `x`'s dtype; what cancellation loses
/// is the digits of mean² / variance out of f64's sixteen, nothing an f32 result holds for any
/// batch norm's input — else the mean, then the sum of the squares around it (two walks).
pub fn sum_sq_dev_as_ops(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    sum_sq_dev_with(x, dims, |x| moment_sums(x, dims))
}

/// `sum_sq_dev_as_ops` with its moment sums — `(Σx, Σx²)` over `dims` (kept) of `x` in f64,
/// each value widened to f64 before it is squared and added — computed by `moments`: a device
/// may take both in one fused kernel of its own (kiln-cuda's eager runtime does) where the prims
/// (`moment_sums`) write x in f64 and its square first. The sums must equal the prims' to the
/// bit (same values, added in the device's order for a sum), so the result does too.
pub fn sum_sq_dev_with(
    x: &Tensor,
    dims: &[usize],
    moments: impl FnOnce(&Tensor) -> Result<(Tensor, Tensor)>,
) -> Result<Tensor> {
    if sq_dev_in_moment_sums(x.shape(), x.dtype(), dims) {
        let count: usize = dims.iter().map(|&d| x.shape()[d]).product();
        let (s1, s2) = moments(x)?;
        let m2 = s2.sub(&s1.mul(&s1)?.div(count as f64)?)?;
        return m2.clamp(Some(0.0), None)?.to_dtype(x.dtype());
    }
    sum_over(&x.sub(&mean_over(x, dims)?)?.square()?, dims)
}

/// `(Σx, Σx²)` over `dims` (kept) of `x` in f64, as prims: x widened, then squared.
fn moment_sums(x: &Tensor, dims: &[usize]) -> Result<(Tensor, Tensor)> {
    let xd = x.to_dtype(DType::F64)?;
    Ok((sum_over(&xd, dims)?, sum_over(&xd.mul(&xd)?, dims)?))
}

/// The mean over `dims` (normalized, kept) as the sum prim and a division: written one way for
/// every rule that needs it (squared deviations' two-sums form, their derivative), so a graph
/// holding several has the same nodes, which `kiln_compile::cse` computes once.
pub(crate) fn mean_over(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let count: usize = dims.iter().map(|&d| x.shape()[d]).product();
    sum_over(x, dims)?.div(count as f64)
}

/// The sum prim over `dims` (normalized, kept).
pub(crate) fn sum_over(t: &Tensor, dims: &[usize]) -> Result<Tensor> {
    apply(
        Prim::Reduce {
            op: ReduceOp::Sum,
            dims: dims.to_vec(),
        },
        &[t],
    )
}

fn reduce(
    x: &Tensor,
    op: ReduceOp,
    dims: &[isize],
    keepdim: bool,
    name: &'static str,
) -> Result<Tensor> {
    let d = reduce_dims(name, x, dims)?;
    let was_bool = x.dtype() == DType::Bool;
    // sums and products of integers and bools accumulate in int64, as in PyTorch
    let x = if matches!(op, ReduceOp::Sum | ReduceOp::Prod) && !x.dtype().is_float() {
        x.to_dtype(DType::I64)?
    } else if x.dtype() == DType::Bool {
        x.to_dtype(DType::U8)?
    } else {
        x.clone()
    };
    let r = if d.is_empty() {
        x.clone()
    } else {
        apply(
            Prim::Reduce {
                op,
                dims: d.clone(),
            },
            &[&x],
        )?
    };
    // amax/amin of a bool tensor stay bool, as in PyTorch
    let r = if was_bool && matches!(op, ReduceOp::Max | ReduceOp::Min) {
        r.to_dtype(DType::Bool)?
    } else {
        r
    };
    drop_dims(&r, &d, keepdim)
}

impl Tensor {
    /// Sum over `dims` (all dims when empty).
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        reduce(self, ReduceOp::Sum, dims, keepdim, "sum")
    }
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(&[], false)
    }
    pub fn prod(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        reduce(self, ReduceOp::Prod, dims, keepdim, "prod")
    }
    /// `amax`: the largest value over `dims`.
    pub fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        reduce(self, ReduceOp::Max, dims, keepdim, "max")
    }
    pub fn min(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        reduce(self, ReduceOp::Min, dims, keepdim, "min")
    }
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        let d = reduce_dims("mean", &x, dims)?;
        let count: usize = d.iter().map(|&i| x.shape()[i]).product();
        x.sum(dims, keepdim)?.div(count as f64)
    }
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(&[], false)
    }
    /// Variance with Bessel's `correction` (1 = unbiased, PyTorch's default): the sum of squared
    /// deviations from the mean (Welford's, one walk: `sum_sq_dev`) over the count less it.
    pub fn var(&self, dims: &[isize], correction: usize, keepdim: bool) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        let d = reduce_dims("var", &x, dims)?;
        let count: usize = d.iter().map(|&i| x.shape()[i]).product();
        let denom = count as f64 - correction as f64;
        drop_dims(&sum_sq_dev(&x, &d)?.div(denom.max(0.0))?, &d, keepdim)
    }
    pub fn std(&self, dims: &[isize], correction: usize, keepdim: bool) -> Result<Tensor> {
        self.var(dims, correction, keepdim)?.sqrt()
    }
    fn arg_reduce(
        &self,
        op: ArgReduceOp,
        dim: Option<isize>,
        keepdim: bool,
        name: &'static str,
    ) -> Result<Tensor> {
        match dim {
            None => {
                let flat = self.reshape([self.numel()])?;
                flat.arg_reduce(op, Some(0), false, name)
            }
            Some(dim) => {
                let d = norm_dim(name, dim, self.rank())?;
                let x = if self.rank() == 0 {
                    self.reshape([1usize])?
                } else {
                    self.clone()
                };
                let r = apply(Prim::ArgReduce { op, dim: d }, &[&x])?;
                if self.rank() == 0 {
                    return r.reshape(Vec::<usize>::new());
                }
                drop_dims(&r, &[d], keepdim)
            }
        }
    }
    /// Index of the largest value along `dim` (of the flattened tensor when `None`).
    pub fn argmax(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg_reduce(ArgReduceOp::ArgMax, dim, keepdim, "argmax")
    }
    pub fn argmin(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg_reduce(ArgReduceOp::ArgMin, dim, keepdim, "argmin")
    }
    /// `log(sum(exp(x)))` over `dims`, shifted by the (detached) max for stability.
    pub fn logsumexp(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        let d = reduce_dims("logsumexp", &x, dims)?;
        let m = if d.iter().any(|&i| x.shape()[i] == 0) {
            // an empty slice has no max; its logsumexp is log(0) = -inf
            let mut keep = x.shape().to_vec();
            d.iter().for_each(|&i| keep[i] = 1);
            Tensor::zeros_on(&keep, x.dtype(), x.device())?
        } else {
            x.max(dims, true)?.detach()
        };
        // an all -inf (or +inf) slice must not produce inf - inf
        let m = Tensor::where_(&m.abs()?.eq(f64::INFINITY)?, 0.0, &m)?;
        let s = x.sub(&m)?.exp()?.sum(dims, true)?.log()?.add(&m)?;
        drop_dims(&s, &d, keepdim)
    }
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        norm_dim("softmax", dim, x.rank())?;
        if x.numel() == 0 {
            return Ok(x);
        }
        let m = x.max(&[dim], true)?.detach();
        let e = x.sub(&m)?.exp()?;
        e.div(&e.sum(&[dim], true)?)
    }
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        norm_dim("log_softmax", dim, x.rank())?;
        x.sub(&x.logsumexp(&[dim], true)?)
    }
}
