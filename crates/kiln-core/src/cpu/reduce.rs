//! Reductions. The reduced dims are permuted innermost and gathered contiguous, so every reduction is
//! a loop over rows; rows run in parallel when there are many, a single long row is split in chunks.
//!
//! Float sums have one summation order, `prim::SUM_LANES`'s, shared with the C code generator
//! (kiln-inductor's `codegen/c.rs`, `reduction_kernel`) so compiled sums stay bitwise equal to
//! eager ones: 16 f64 accumulators, element `k` of each run of the innermost reduced dim
//! added to lane `k % 16` (the runs, in order, all into the same lanes), then the lanes
//! folded in halves (`lane[l] += lane[l + h]` for h = 8, 4, 2, 1). Independent lanes are what a
//! vectorizing compiler turns into SIMD adds without reassociating anything (a single sequential
//! accumulator is one add per FP-add latency); the error bound is also smaller than a sequential
//! sum's (each lane sums ~n/16 elements).

use rayon::prelude::*;

use super::num::Num;
use super::{as_f32, from_f32_like, typed, PAR_THRESHOLD};
use crate::prim::{ArgReduceOp, ReduceOp, SqDevState, SUM_CHUNK, SUM_CHUNKED_FROM, SUM_LANES};
use crate::shape::Layout;
use crate::storage::CpuStorage;
use crate::{DType, Tensor};

/// The input layout with kept dims first and `dims` last, and the row length.
fn rows_layout(l: &Layout, dims: &[usize]) -> (Layout, usize) {
    let mut perm: Vec<usize> = (0..l.rank()).filter(|d| !dims.contains(d)).collect();
    perm.extend(dims.iter().copied());
    let row: usize = dims.iter().map(|&d| l.shape[d]).product();
    (l.permute(&perm), row)
}

/// The float sum of one row in the shared lane order: `inner` is the extent of the innermost
/// reduced dim (the row is runs of `inner` elements).
fn lane_sum<T: Num>(row: &[T], inner: usize) -> f64 {
    let mut acc = [0f64; SUM_LANES];
    for run in row.chunks(inner.max(1)) {
        let mut full = run.chunks_exact(SUM_LANES);
        for c in &mut full {
            for (a, v) in acc.iter_mut().zip(c) {
                *a += v.to_f64();
            }
        }
        for (a, v) in acc.iter_mut().zip(full.remainder()) {
            *a += v.to_f64();
        }
    }
    fold_halves(acc, |a, b| a + b)
}

/// Lanes folded in halves into lane 0 (`lane[l] = merge(lane[l], lane[l + h])` for
/// `h = SUM_LANES/2, ..., 1`): the end of every lane order (sums', squared deviations').
fn fold_halves<S: Copy>(mut acc: [S; SUM_LANES], merge: impl Fn(S, S) -> S) -> S {
    let mut h = SUM_LANES / 2;
    while h > 0 {
        for l in 0..h {
            acc[l] = merge(acc[l], acc[l + h]);
        }
        h /= 2;
    }
    acc[0]
}

/// Welford's moments of one row in their shared order (`prim::SqDevState`): full groups of each
/// run into the lanes, the runs' tails into the tail lanes, merged last.
fn lane_sqdev<T: Num>(row: &[T], inner: usize) -> SqDevState {
    let mut lanes = [SqDevState::default(); SUM_LANES];
    let mut tails = [SqDevState::default(); SUM_LANES];
    for run in row.chunks(inner.max(1)) {
        let mut full = run.chunks_exact(SUM_LANES);
        for c in &mut full {
            for (a, v) in lanes.iter_mut().zip(c) {
                a.push(v.to_f64());
            }
        }
        for (a, v) in tails.iter_mut().zip(full.remainder()) {
            a.push(v.to_f64());
        }
    }
    fold_halves(lanes, SqDevState::merge).merge(fold_halves(tails, SqDevState::merge))
}

/// A single long row in `prim::SUM_CHUNKED_FROM`'s chunks: chunks of whole runs (or pieces of
/// one long run) each reduced by `lane` in parallel, their results in order.
fn chunks<T: Num, S: Send>(
    row: &[T],
    inner: usize,
    lane: impl Fn(&[T], usize) -> S + Sync,
) -> Vec<S> {
    let inner = inner.max(1);
    if inner <= SUM_CHUNK {
        row.par_chunks(SUM_CHUNK / inner * inner)
            .map(|c| lane(c, inner))
            .collect()
    } else {
        row.par_chunks(inner)
            .flat_map_iter(|run| run.chunks(SUM_CHUNK).map(|p| lane(p, p.len())))
            .collect()
    }
}

/// Each row of `x` reduced in the shared lane order by `lane` (a single long row in chunks
/// merged in order by `merge`), finished by `fin`.
fn lane_rows<T: Num, S: Send + Default>(
    (x, row, outer, inner): (&[T], usize, usize, usize),
    lane: impl Fn(&[T], usize) -> S + Sync + Send,
    merge: impl Fn(S, S) -> S,
    fin: impl Fn(S) -> f64 + Sync + Send,
) -> Vec<T> {
    if row == 0 {
        return vec![T::from_f64(fin(S::default())); outer];
    }
    if outer == 1 && row >= SUM_CHUNKED_FROM {
        // from the empty state, as the generated C's total starts (a sum from 0.0, so a row of
        // -0.0 sums to 0.0 in both)
        let total = chunks(x, inner, &lane)
            .into_iter()
            .fold(S::default(), merge);
        return vec![T::from_f64(fin(total))];
    }
    let f = |r: &[T]| T::from_f64(fin(lane(r, inner)));
    if outer * row >= PAR_THRESHOLD {
        x.par_chunks(row).map(f).collect()
    } else {
        x.chunks(row).map(f).collect()
    }
}

/// Float sums of each row in the shared lane order (a single long row in chunks added in order).
fn sum_rows<T: Num>(x: &[T], row: usize, outer: usize, inner: usize) -> Vec<T> {
    lane_rows((x, row, outer, inner), lane_sum, |a, b| a + b, |s| s)
}

/// Sums of squared deviations of each row (`ReduceOp::SumSqDev`) in `prim::SqDevState`'s order.
fn sqdev_rows<T: Num>(x: &[T], row: usize, outer: usize, inner: usize) -> Vec<T> {
    lane_rows((x, row, outer, inner), lane_sqdev, SqDevState::merge, |s| {
        s.m2
    })
}

/// Reduces each row of `x` with an accumulator type `A` (f64 for floats: sums stay accurate).
fn reduce_rows<T: Num, A: Num>(
    x: &[T],
    row: usize,
    outer: usize,
    init: A,
    step: impl Fn(A, T) -> A + Sync + Send,
    combine: impl Fn(A, A) -> A + Sync + Send,
    fin: impl Fn(A) -> T + Sync + Send,
) -> Vec<T> {
    if row == 0 {
        return vec![fin(init); outer];
    }
    let fold_row = |r: &[T]| r.iter().fold(init, |a, &v| step(a, v));
    if outer == 1 && row >= PAR_THRESHOLD {
        let acc = x.par_chunks(4096).map(fold_row).reduce(|| init, &combine);
        return vec![fin(acc)];
    }
    if outer * row >= PAR_THRESHOLD {
        x.par_chunks(row).map(|r| fin(fold_row(r))).collect()
    } else {
        x.chunks(row).map(|r| fin(fold_row(r))).collect()
    }
}

/// `inner`: the extent of the innermost reduced dim (float sums' lane order).
fn reduce_typed<T: Num>(op: ReduceOp, x: &[T], row: usize, outer: usize, inner: usize) -> Vec<T> {
    let nan_max = |a: T, v: T| {
        if a.is_nan() || (!v.is_nan() && a >= v) {
            a
        } else {
            v
        }
    };
    let nan_min = |a: T, v: T| {
        if a.is_nan() || (!v.is_nan() && a <= v) {
            a
        } else {
            v
        }
    };
    match op {
        ReduceOp::Sum => sum_rows(x, row, outer, inner),
        ReduceOp::SumSqDev => sqdev_rows(x, row, outer, inner),
        ReduceOp::Prod => reduce_rows(
            x,
            row,
            outer,
            1f64,
            |a, v| a * v.to_f64(),
            |a, b| a * b,
            T::from_f64,
        ),
        ReduceOp::Max => reduce_rows(x, row, outer, T::MIN, nan_max, nan_max, |a| a),
        ReduceOp::Min => reduce_rows(x, row, outer, T::MAX, nan_min, nan_min, |a| a),
    }
}

/// Integer sums must not round through f64 above 2^53: they accumulate in their own type.
fn reduce_int<T: Num>(op: ReduceOp, x: &[T], row: usize, outer: usize) -> Vec<T> {
    match op {
        ReduceOp::Sum => reduce_rows(x, row, outer, T::ZERO, T::add, T::add, |a| a),
        ReduceOp::Prod => reduce_rows(x, row, outer, T::ONE, T::mul, T::mul, |a| a),
        _ => reduce_typed(op, x, row, outer, 1),
    }
}

pub(super) fn reduce(op: ReduceOp, dims: &[usize], x: &Tensor) -> CpuStorage {
    let (l, row) = rows_layout(x.layout(), dims);
    let outer = match l.numel().checked_div(row) {
        Some(n) => n,
        None => l.shape[..l.rank() - dims.len()].iter().product(), // empty rows
    };
    let inner = dims.last().map_or(1, |&d| x.shape()[d]);
    let s = x.storage();
    match x.dtype() {
        DType::F32 => CpuStorage::F32(reduce_typed(op, &typed::<f32>(&s, &l), row, outer, inner)),
        DType::F64 => CpuStorage::F64(reduce_typed(op, &typed::<f64>(&s, &l), row, outer, inner)),
        DType::F16 | DType::BF16 => from_f32_like(
            x.dtype(),
            reduce_typed(op, &as_f32(&s, &l), row, outer, inner),
        ),
        DType::I32 => CpuStorage::I32(reduce_int(op, &typed::<i32>(&s, &l), row, outer)),
        DType::I64 => CpuStorage::I64(reduce_int(op, &typed::<i64>(&s, &l), row, outer)),
        DType::U8 => CpuStorage::U8(reduce_int(op, &typed::<u8>(&s, &l), row, outer)),
        DType::Bool => CpuStorage::Bool(Vec::new()), // rejected by Prim::infer
    }
}

fn arg_typed<T: Num>(op: ArgReduceOp, x: &[T], row: usize) -> Vec<i64> {
    let pick = |r: &[T]| {
        let mut best = 0usize;
        for (i, &v) in r.iter().enumerate().skip(1) {
            let b = r[best];
            if b.is_nan() {
                break; // the first NaN wins, as in PyTorch
            }
            let better = match op {
                ArgReduceOp::ArgMax => v > b || v.is_nan(),
                ArgReduceOp::ArgMin => v < b || v.is_nan(),
            };
            if better {
                best = i;
            }
        }
        best as i64
    };
    if x.len() >= PAR_THRESHOLD {
        x.par_chunks(row).map(pick).collect()
    } else {
        x.chunks(row).map(pick).collect()
    }
}

pub(super) fn arg_reduce(op: ArgReduceOp, dim: usize, x: &Tensor) -> CpuStorage {
    let (l, row) = rows_layout(x.layout(), &[dim]);
    let s = x.storage();
    CpuStorage::I64(match x.dtype() {
        DType::F32 => arg_typed(op, &typed::<f32>(&s, &l), row),
        DType::F64 => arg_typed(op, &typed::<f64>(&s, &l), row),
        DType::F16 | DType::BF16 => arg_typed(op, &as_f32(&s, &l), row),
        DType::I32 => arg_typed(op, &typed::<i32>(&s, &l), row),
        DType::I64 => arg_typed(op, &typed::<i64>(&s, &l), row),
        DType::U8 => arg_typed(op, &typed::<u8>(&s, &l), row),
        DType::Bool => {
            let v: Vec<u8> = typed::<bool>(&s, &l).iter().map(|&b| b as u8).collect();
            arg_typed(op, &v, row)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A compensated (Neumaier) sum: the float64 reference, exact to about one rounding.
    fn reference(x: &[f64]) -> f64 {
        let (mut s, mut c) = (0f64, 0f64);
        for &v in x {
            let t = s + v;
            c += if s.abs() >= v.abs() {
                (s - t) + v
            } else {
                (v - t) + s
            };
            s = t;
        }
        s + c
    }

    /// A small LCG from `state`: values of mixed signs and magnitudes, all 53 bits used.
    fn values(mut state: u64) -> impl FnMut() -> f64 {
        move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 1e3 / 7.0
        }
    }

    #[test]
    fn lane_sums_are_within_their_error_bound_of_a_compensated_sum() {
        let mut next = values(0x2545_f491_4f6c_dd1d);
        for (n, inner) in [
            (1, 1),
            (15, 15),
            (16, 16),
            (1000, 1000),
            (999, 37),
            (4096, 64),
        ] {
            let x: Vec<f64> = (0..n).map(|_| next()).collect();
            let got = lane_sum(&x, inner);
            let abs: f64 = x.iter().map(|v| v.abs()).sum();
            // each lane adds at most ceil(n/16) terms, the fold 4 more levels
            let bound = ((n / SUM_LANES + 1 + 4) as f64) * f64::EPSILON * abs;
            let err = (got - reference(&x)).abs();
            assert!(
                err <= bound,
                "n {n} inner {inner}: error {err:e} > {bound:e}"
            );
        }
        // element k of a run of `inner` goes to lane k % 16: with inner 3, lanes 0..3 only
        let x = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
        assert_eq!(lane_sum(&x, 3), 63.0);
        assert_eq!(sum_rows(&x, 3, 2, 3), vec![7.0, 56.0]);
    }

    /// `prim::SUM_CHUNKED_FROM`'s order written out element by element, one chunk after another.
    fn chunked_by_definition(row: &[f64], inner: usize) -> f64 {
        let mut chunks: Vec<(usize, usize)> = Vec::new(); // (start, end) in the row
        if inner <= SUM_CHUNK {
            let span = SUM_CHUNK / inner * inner;
            let mut s = 0;
            while s < row.len() {
                chunks.push((s, (s + span).min(row.len())));
                s += span;
            }
        } else {
            for run in (0..row.len()).step_by(inner) {
                let mut s = run;
                while s < run + inner {
                    chunks.push((s, (s + SUM_CHUNK).min(run + inner)));
                    s += SUM_CHUNK;
                }
            }
        }
        let mut total = 0.0;
        for (start, end) in chunks {
            let mut acc = [0f64; SUM_LANES];
            for (i, v) in row[start..end].iter().enumerate() {
                // position in its run (a whole-run chunk) or in its piece (a piece starts a run
                // or a multiple of SUM_CHUNK into it)
                let k = if inner <= SUM_CHUNK { i % inner } else { i };
                acc[k % SUM_LANES] += v;
            }
            let mut h = SUM_LANES / 2;
            while h > 0 {
                for l in 0..h {
                    acc[l] += acc[l + h];
                }
                h /= 2;
            }
            total += acc[0];
        }
        total
    }

    #[test]
    fn single_long_rows_sum_in_the_chunked_order_whatever_the_threads() {
        let mut next = values(0x9e37_79b9_7f4a_7c15);
        for (n, inner) in [
            (SUM_CHUNKED_FROM, 200),
            (SUM_CHUNKED_FROM + 17, 3),
            (50_000, 50_000),
            (4 * 9000, 9000),
            (SUM_CHUNKED_FROM, SUM_CHUNK),
        ] {
            let x: Vec<f64> = (0..n).map(|_| next()).collect();
            let want = chunked_by_definition(&x, inner);
            assert_eq!(sum_rows(&x, n, 1, inner), vec![want], "n {n} inner {inner}");
            // the same on one thread: the order does not depend on how rayon splits the work
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            assert_eq!(pool.install(|| sum_rows(&x, n, 1, inner)), vec![want]);
        }
        // below the threshold: one lane-ordered row, as before
        let x: Vec<f64> = (0..1000).map(|_| next()).collect();
        assert_eq!(sum_rows(&x, 1000, 1, 10), vec![lane_sum(&x, 10)]);
    }

    /// Sums of squared deviations (Welford's M2) against the two-pass definition in f64: rows
    /// short and long (chunked), runs shorter and longer than the lanes, values far from zero
    /// (a large mean: squares around zero would cancel), empty rows; a single long row gives
    /// the same bits on one thread as on many.
    #[test]
    fn squared_deviations_match_the_two_pass_definition() {
        let mut next = values(0x2545_f491_4f6c_dd1d);
        let two_pass = |r: &[f64]| {
            let mean = r.iter().sum::<f64>() / r.len() as f64;
            r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>()
        };
        for (outer, row, inner, shift) in [
            (3, 37, 37, 0.0),
            (4, 48, 3, 0.0),
            (2, 1, 1, 0.0),
            (5, 100, 10, 1e6),
            (1, SUM_CHUNKED_FROM + 33, 1000, 1e4),
            (1, 3 * 20_000, 20_000, 0.0),
        ] {
            let x: Vec<f64> = (0..outer * row).map(|_| next() + shift).collect();
            let got = sqdev_rows(&x, row, outer, inner);
            for (r, g) in x.chunks(row).zip(&got) {
                let want = two_pass(r);
                assert!(
                    (g - want).abs() <= 1e-12 * want.abs().max(1.0),
                    "{outer}x{row} (runs {inner}, shift {shift}): {g} vs {want}"
                );
            }
            if outer == 1 {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .unwrap();
                assert_eq!(pool.install(|| sqdev_rows(&x, row, 1, inner)), got);
            }
        }
        assert_eq!(sqdev_rows::<f64>(&[], 0, 3, 1), vec![0.0; 3]);
    }
}
