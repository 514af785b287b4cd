//! Sentence embeddings from token states, as sentence-transformers computes them for models such as
//! all-MiniLM-L6-v2: the mean of the token states over the attention mask, then L2 normalization.

use kiln_core::{Error, Result, Tensor};

/// Mean over the tokens the mask keeps: `hidden` [batch, seq, hidden], `attention_mask`
/// [batch, seq] of 1/0 (any numeric or bool dtype) → [batch, hidden]. A row with no kept token
/// divides by 1e-9 instead of 0 (sentence-transformers' clamp), giving zeros rather than NaN.
pub fn mean_pooling(hidden: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
    if hidden.rank() != 3 || attention_mask.shape() != &hidden.shape()[..2] {
        return Err(Error::shape(
            "mean_pooling",
            format!(
                "expects hidden [batch, seq, dim] and attention_mask [batch, seq], got {:?} and {:?}",
                hidden.shape(),
                attention_mask.shape()
            ),
        ));
    }
    let mask = attention_mask.to_dtype(hidden.dtype())?.unsqueeze(-1)?;
    let summed = hidden.mul(&mask)?.sum(&[1], false)?;
    let counts = mask.sum(&[1], false)?.clamp(Some(1e-9), None)?;
    summed.div(&counts)
}

/// `F.normalize(x, p=2, dim=-1)`: each row divided by max(its L2 norm, 1e-12).
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    if x.rank() == 0 {
        return Err(Error::shape(
            "l2_normalize",
            "expects at least one dim, got a scalar",
        ));
    }
    let norm = x
        .square()?
        .sum(&[-1], true)?
        .sqrt()?
        .clamp(Some(1e-12), None)?;
    x.div(&norm)
}

/// `mean_pooling` then `l2_normalize`: unit-length sentence embeddings, [batch, hidden].
pub fn sentence_embedding(hidden: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
    l2_normalize(&mean_pooling(hidden, attention_mask)?)
}
