//! batch_norm, layer_norm, dropout.

use crate::autograd::no_grad;
use crate::prim::{Prim, RandDist};
use crate::{Error, Result, Tensor};

/// Running statistics a BatchNorm layer updates in training mode.
pub struct RunningStats<'a> {
    pub mean: &'a Tensor,
    pub var: &'a Tensor,
    pub momentum: f64,
}

impl Tensor {
    /// `F.batch_norm`. In training the batch statistics normalize and, when given, the running stats
    /// are updated in place (unbiased variance, as PyTorch). In eval the running stats normalize.
    pub fn batch_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        running: Option<RunningStats<'_>>,
        training: bool,
        eps: f64,
    ) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::shape(
                "batch_norm",
                format!("expects [N, C, ...], got {:?}", self.shape()),
            ));
        }
        let c = self.shape()[1];
        let mut stat_shape = vec![1; self.rank()];
        stat_shape[1] = c;
        let dims: Vec<isize> = (0..self.rank() as isize).filter(|&d| d != 1).collect();
        let (mean, var) = if training {
            let count = self.numel() / c.max(1);
            if count <= 1 {
                return Err(Error::shape(
                    "batch_norm",
                    format!(
                        "expected more than 1 value per channel when training, got input {:?}",
                        self.shape()
                    ),
                ));
            }
            let mean = self.mean(&dims, true)?;
            let var = self.var(&dims, 0, true)?;
            if let Some(r) = &running {
                no_grad(|| -> Result<()> {
                    let unbiased = var.mul(count as f64 / (count - 1) as f64)?.reshape([c])?;
                    let m = r.momentum;
                    r.mean
                        .assign(&r.mean.mul(1.0 - m)?.add(&mean.reshape([c])?.mul(m)?)?)?;
                    r.var.assign(&r.var.mul(1.0 - m)?.add(&unbiased.mul(m)?)?)
                })?;
            }
            (mean, var)
        } else {
            let r = running
                .ok_or_else(|| Error::arg("batch_norm", "eval mode needs running statistics"))?;
            let (mean, var) = (
                r.mean.reshape(stat_shape.clone())?,
                r.var.reshape(stat_shape.clone())?,
            );
            // fixed statistics fold with the affine into one scale and shift per channel (work on
            // [C]), so the activation is read and written twice (x * scale + shift), not four
            // times: cuDNN's inference batch norm does the same
            let mut scale = var.add(eps)?.rsqrt()?;
            if let Some(w) = weight {
                scale = scale.mul(&w.reshape(stat_shape.clone())?)?;
            }
            let mut shift = mean.mul(&scale)?.neg()?;
            if let Some(b) = bias {
                shift = shift.add(&b.reshape(stat_shape)?)?;
            }
            return self.mul(&scale)?.add(&shift);
        };
        let mut y = self.sub(&mean)?.mul(&var.add(eps)?.rsqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(&w.reshape(stat_shape.clone())?)?;
        }
        if let Some(b) = bias {
            y = y.add(&b.reshape(stat_shape)?)?;
        }
        Ok(y)
    }

    /// `F.layer_norm` over the trailing `normalized_shape`.
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let k = normalized_shape.len();
        if k == 0 || k > self.rank() || self.shape()[self.rank() - k..] != *normalized_shape {
            return Err(Error::shape("layer_norm", format!("normalized_shape {normalized_shape:?} does not match the end of input shape {:?}", self.shape())));
        }
        let dims: Vec<isize> = (1..=k as isize).map(|i| -i).collect();
        let mean = self.mean(&dims, true)?;
        let centered = self.sub(&mean)?;
        let var = self.var(&dims, 0, true)?;
        let mut y = centered.mul(&var.add(eps)?.rsqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(w)?;
        }
        if let Some(b) = bias {
            y = y.add(b)?;
        }
        Ok(y)
    }

    /// `F.dropout`: zeroes each element with probability `p` and scales the rest by 1/(1-p).
    /// The mask comes from the counter-based Rand prim, so it is reproducible from (seed, offset).
    pub fn dropout(&self, p: f64, training: bool) -> Result<Tensor> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::arg(
                "dropout",
                format!("probability has to be between 0 and 1, but got {p}"),
            ));
        }
        if !training || p == 0.0 {
            return Ok(self.clone());
        }
        if p == 1.0 {
            return self.mul(0.0);
        }
        let (seed, offset) = super::creation::default_draw(self.numel());
        let u = crate::dispatch::apply_on(
            Prim::Rand {
                shape: self.shape().to_vec(),
                dtype: self.dtype().to_float(),
                dist: RandDist::Uniform,
                seed,
                offset,
            },
            &[],
            self.device(),
        )?;
        let keep = u.ge(p)?;
        Tensor::where_(&keep, &self.mul(1.0 / (1.0 - p))?, 0.0)
    }
}
