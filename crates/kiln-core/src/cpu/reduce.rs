//! Reductions. The reduced dims are permuted innermost and gathered contiguous, so every reduction is
//! a loop over rows; rows run in parallel when there are many, a single long row is split in chunks.

use rayon::prelude::*;

use super::num::Num;
use super::{as_f32, from_f32_like, typed, PAR_THRESHOLD};
use crate::prim::{ArgReduceOp, ReduceOp};
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

fn reduce_typed<T: Num>(op: ReduceOp, x: &[T], row: usize, outer: usize) -> Vec<T> {
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
        ReduceOp::Sum => reduce_rows(
            x,
            row,
            outer,
            0f64,
            |a, v| a + v.to_f64(),
            |a, b| a + b,
            T::from_f64,
        ),
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
        _ => reduce_typed(op, x, row, outer),
    }
}

pub(super) fn reduce(op: ReduceOp, dims: &[usize], x: &Tensor) -> CpuStorage {
    let (l, row) = rows_layout(x.layout(), dims);
    let outer = match l.numel().checked_div(row) {
        Some(n) => n,
        None => l.shape[..l.rank() - dims.len()].iter().product(), // empty rows
    };
    let s = x.storage();
    match x.dtype() {
        DType::F32 => CpuStorage::F32(reduce_typed(op, &typed::<f32>(&s, &l), row, outer)),
        DType::F64 => CpuStorage::F64(reduce_typed(op, &typed::<f64>(&s, &l), row, outer)),
        DType::F16 | DType::BF16 => {
            from_f32_like(x.dtype(), reduce_typed(op, &as_f32(&s, &l), row, outer))
        }
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
