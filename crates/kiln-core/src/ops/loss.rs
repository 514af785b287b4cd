//! Losses, as PyTorch defines them.

use crate::{DType, Error, Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Reduction {
    None,
    #[default]
    Mean,
    Sum,
}

fn reduce(x: &Tensor, r: Reduction) -> Result<Tensor> {
    match r {
        Reduction::None => Ok(x.clone()),
        Reduction::Mean => x.mean_all(),
        Reduction::Sum => x.sum_all(),
    }
}

/// Moves the class dim last and flattens: [N, C, d1..] -> [N*d1.., C]; targets [N, d1..] -> [N*d1..].
fn flatten_classes(op: &'static str, logits: &Tensor, target: &Tensor) -> Result<(Tensor, Tensor)> {
    if logits.rank() < 2 {
        return Err(Error::shape(
            op,
            format!("input must be [N, C, ...], got {:?}", logits.shape()),
        ));
    }
    let mut want = logits.shape().to_vec();
    let c = want.remove(1);
    if target.shape() != want.as_slice() {
        return Err(Error::shape(
            op,
            format!(
                "target shape {:?} does not match input {:?} (expected {want:?})",
                target.shape(),
                logits.shape()
            ),
        ));
    }
    if target.dtype().is_float() || target.dtype() == DType::Bool {
        return Err(Error::dtype(
            op,
            target.dtype(),
            "class-index targets must be integers",
        ));
    }
    let mut perm: Vec<isize> = vec![0];
    perm.extend(2..logits.rank() as isize);
    perm.push(1);
    let l = logits.permute(&perm)?.reshape([-1, c as isize])?;
    Ok((l, target.reshape([-1isize])?.to_dtype(DType::I64)?))
}

impl Tensor {
    /// `F.nll_loss(log_probs, target, ignore_index, reduction)`; mean divides by the non-ignored count.
    pub fn nll_loss(
        &self,
        target: &Tensor,
        ignore_index: Option<i64>,
        reduction: Reduction,
    ) -> Result<Tensor> {
        let (lp, t) = flatten_classes("nll_loss", self, target)?;
        let (picked, valid) = pick(&lp, &t, ignore_index)?;
        let losses = picked.neg()?.mul(&valid)?;
        finish(&losses, &valid, reduction, target.shape())
    }

    /// `F.cross_entropy(logits, target, ignore_index, label_smoothing, reduction)` on class indices.
    pub fn cross_entropy(
        &self,
        target: &Tensor,
        ignore_index: Option<i64>,
        label_smoothing: f64,
        reduction: Reduction,
    ) -> Result<Tensor> {
        if !(0.0..=1.0).contains(&label_smoothing) {
            return Err(Error::arg(
                "cross_entropy",
                format!("label_smoothing must be in [0, 1], got {label_smoothing}"),
            ));
        }
        let (logits, t) = flatten_classes("cross_entropy", self, target)?;
        let lp = logits.log_softmax(1)?;
        let (picked, valid) = pick(&lp, &t, ignore_index)?;
        let mut losses = picked.neg()?;
        if label_smoothing > 0.0 {
            let smooth = lp.mean(&[1], false)?.neg()?;
            losses = losses
                .mul(1.0 - label_smoothing)?
                .add(&smooth.mul(label_smoothing)?)?;
        }
        let losses = losses.mul(&valid)?;
        finish(&losses, &valid, reduction, target.shape())
    }

    /// `F.mse_loss`.
    pub fn mse_loss(&self, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
        if self.shape() != target.shape() {
            return Err(Error::shape(
                "mse_loss",
                format!(
                    "input {:?} and target {:?} must have one shape",
                    self.shape(),
                    target.shape()
                ),
            ));
        }
        reduce(&self.sub(target)?.square()?, reduction)
    }

    /// `F.binary_cross_entropy_with_logits`: `max(x,0) - x*y + log1p(exp(-|x|))`, stable for any x.
    pub fn binary_cross_entropy_with_logits(
        &self,
        target: &Tensor,
        reduction: Reduction,
    ) -> Result<Tensor> {
        if self.shape() != target.shape() {
            return Err(Error::shape(
                "binary_cross_entropy_with_logits",
                format!(
                    "input {:?} and target {:?} must have one shape",
                    self.shape(),
                    target.shape()
                ),
            ));
        }
        let x = self;
        // max(x, 0) and |x| both take the x >= 0 branch at 0, so the gradient there is
        // 1 - y - 0.5 = sigmoid(0) - y (relu and abs would each give 0 at the kink)
        let pos = x.ge(0.0)?;
        let max0 = Tensor::where_(&pos, x, 0.0)?;
        let abs = Tensor::where_(&pos, x, &x.neg()?)?;
        let l = max0
            .sub(&x.mul(target)?)?
            .add(&abs.neg()?.exp()?.log1p()?)?;
        reduce(&l, reduction)
    }
}

/// log-prob of each row's target class, and a 0/1 mask of rows that count.
fn pick(lp: &Tensor, t: &Tensor, ignore_index: Option<i64>) -> Result<(Tensor, Tensor)> {
    let valid = match ignore_index {
        Some(ig) => t.ne(ig)?,
        None => Tensor::full_on(t.shape(), 1.0, DType::Bool, t.device())?,
    };
    let safe_t = Tensor::where_(&valid, t, 0i64)?;
    // out-of-range targets are caught by the gather kernel, which names the index and the size
    let picked = lp.gather(1, &safe_t.unsqueeze(1)?)?.squeeze_dim(1)?;
    Ok((picked, valid.to_dtype(lp.dtype())?))
}

fn finish(
    losses: &Tensor,
    valid: &Tensor,
    reduction: Reduction,
    target_shape: &[usize],
) -> Result<Tensor> {
    match reduction {
        Reduction::None => losses.reshape(target_shape),
        Reduction::Sum => losses.sum_all(),
        Reduction::Mean => losses.sum_all()?.div(&valid.sum_all()?),
    }
}
