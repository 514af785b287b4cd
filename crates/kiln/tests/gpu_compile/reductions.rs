//! Reductions on the GPU in every strategy the CUDA code generator has (`cuda_reduce.rs`: a
//! thread, a warp or a block per output element, columns, split passes, sibling accumulators),
//! each equal to eager and to float64.

use super::{differential, Outcome};

pub fn reductions_every_strategy() -> Outcome {
    // short rows (a thread each), medium (a warp each), long (a block each), all dims
    differential(
        "reductions_every_strategy",
        &[&[1000, 7], &[300, 200], &[3, 20000]],
        1e-5,
        |x| {
            Ok(vec![
                x[0].exp()?.sum(&[1], false)?,
                x[1].mul(&x[1])?.mean(&[1], true)?,
                x[2].abs()?.max(&[1], false)?,
                x[1].sum(&[0], false)?,
                x[2].sum_all()?,
            ])
        },
    )
}

/// Outer reductions with too few rows for a thread each (`cuda_reduce.rs`'s columns: a block
/// per four rows, warps over the reduced elements): a per-channel sum and max of [3000, 64],
/// a sum and a sum of squares side by side (sibling accumulators), and a channels-last
/// per-channel sum large enough to be split first (its second pass is such a reduction; of
/// positive terms, as in `split_reductions_few_long_rows`: the first pass's partials are f32,
/// so a sum that cancels to a small value differs from eager's float64 sum in the sixth digit),
/// each equal to eager and to float64; rows not a multiple of four (66) leave lanes idle.
pub fn column_reductions() -> Outcome {
    differential(
        "column_reductions",
        &[&[3000, 64], &[16, 28, 28, 128], &[1500, 66]],
        1e-5,
        |x| {
            Ok(vec![
                x[0].sum(&[0], false)?,
                x[0].max(&[0], false)?,
                x[0].mul(&x[0])?.sum(&[0], false)?,
                x[1].abs()?.sum(&[0, 1, 2], false)?,
                x[2].abs()?.sum(&[0], true)?,
            ])
        },
    )
}

/// Few long rows are split (`split_reduction.rs`): batch norm's per-channel statistics of a
/// [64, 3, 40, 40] activation (three rows of 102400) and a full sum of 2^18, each a chunked first
/// pass over partials and a short second pass, equal to eager (sums of positive terms: the f32
/// partials move only the last bits) and to float64.
pub fn split_reductions_few_long_rows() -> Outcome {
    differential(
        "split_reductions",
        &[&[64, 3, 40, 40], &[1 << 18]],
        1e-5,
        |x| {
            let mean = x[0].mean(&[0, 2, 3], true)?;
            let centered = x[0].sub(&mean)?;
            Ok(vec![
                x[0].exp()?.sum(&[0, 2, 3], false)?,
                centered.square()?.mean(&[0, 2, 3], false)?,
                x[0].abs()?.max(&[0, 2, 3], false)?,
                x[1].exp()?.sum_all()?,
            ])
        },
    )
}

/// Sibling reductions (`sibling_reductions.rs`): several reductions over the same dims of the
/// same operands in one kernel, an accumulator each (sums and a max), in every strategy: a
/// thread, a warp and a block per output element, and an outer reduction split into chunks
/// (channels-last batch norm's backward sums over N, H, W of a [32, 32, 32, 64] gradient and
/// activation). Terms are positive, so the split's f32 partials move only the last bits.
pub fn sibling_reductions_every_strategy() -> Outcome {
    differential(
        "sibling_reductions",
        &[
            &[1000, 7],
            &[300, 200],
            &[3, 20000],
            &[32, 32, 32, 64],
            &[32, 32, 32, 64],
        ],
        1e-5,
        |x| {
            let mut out = Vec::new();
            for t in &x[..3] {
                out.push(t.exp()?.sum(&[1], false)?);
                out.push(t.square()?.sum(&[1], false)?);
                out.push(t.abs()?.max(&[1], false)?);
            }
            let (act, grad) = (&x[3], x[4].exp()?);
            let dims = [0, 1, 2];
            out.push(grad.sum(&dims, false)?);
            out.push(grad.mul(&act.square()?)?.sum(&dims, false)?);
            out.push(act.abs()?.max(&dims, false)?);
            Ok(out)
        },
    )
}
