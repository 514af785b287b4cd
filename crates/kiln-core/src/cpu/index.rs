//! Gather and scatter-add along one dim. Index values are checked: an out-of-range index is an `Err`
//! naming the value and the dim size, never a panic or a wild read.

use super::{contig, materialize, typed};
use crate::shape::contiguous_strides;
use crate::storage::{CpuStorage, StorageElement};
use crate::{with_storage, Error, Result, Tensor};

/// For each position of `index` (row-major), the storage position in a contiguous tensor of `shape`
/// that it addresses along `dim`.
fn targets(
    idx: &[i64],
    idx_shape: &[usize],
    shape: &[usize],
    dim: usize,
    op: &'static str,
) -> Result<Vec<usize>> {
    let strides = contiguous_strides(shape);
    let mut out = Vec::with_capacity(idx.len());
    let mut pos = vec![0usize; idx_shape.len()];
    for &i in idx {
        if i < 0 || i as usize >= shape[dim] {
            return Err(Error::index(
                op,
                format!(
                    "index {i} out of range for dim {dim} of size {}",
                    shape[dim]
                ),
            ));
        }
        let mut off = 0;
        for d in 0..pos.len() {
            off += if d == dim { i as usize } else { pos[d] } * strides[d];
        }
        out.push(off);
        for d in (0..pos.len()).rev() {
            pos[d] += 1;
            if pos[d] < idx_shape[d] {
                break;
            }
            pos[d] = 0;
        }
    }
    Ok(out)
}

pub(super) fn gather(x: &Tensor, index: &Tensor, dim: usize) -> Result<CpuStorage> {
    let si = index.storage();
    let idx = typed::<i64>(&si, index.layout());
    let t = targets(&idx, index.shape(), x.shape(), dim, "gather")?;
    // read a contiguous source in place: an embedding lookup gathers a few rows of a large table
    // on every call, and copying the whole table first cost more than the lookup itself
    let s = x.storage();
    Ok(with_storage!(&*s, v => {
        let src = contig(v, x.layout());
        StorageElement::wrap(t.iter().map(|&o| src[o]).collect())
    }))
}

pub(super) fn scatter_add(
    x: &Tensor,
    index: &Tensor,
    src: &Tensor,
    dim: usize,
) -> Result<CpuStorage> {
    let si = index.storage();
    let idx = typed::<i64>(&si, index.layout());
    let t = targets(&idx, index.shape(), x.shape(), dim, "scatter_add")?;
    let mut out = materialize(x);
    let src_vals = materialize(src);
    macro_rules! acc {
        ($o:expr, $s:expr, $add:expr) => {{
            for (k, &p) in t.iter().enumerate() {
                $o[p] = $add($o[p], $s[k]);
            }
        }};
    }
    match (&mut out, &src_vals) {
        (CpuStorage::F32(o), CpuStorage::F32(s)) => acc!(o, s, |a: f32, b| a + b),
        (CpuStorage::F64(o), CpuStorage::F64(s)) => acc!(o, s, |a: f64, b| a + b),
        (CpuStorage::F16(o), CpuStorage::F16(s)) => {
            acc!(o, s, |a: half::f16, b: half::f16| half::f16::from_f32(
                a.to_f32() + b.to_f32()
            ))
        }
        (CpuStorage::BF16(o), CpuStorage::BF16(s)) => {
            acc!(o, s, |a: half::bf16, b: half::bf16| half::bf16::from_f32(
                a.to_f32() + b.to_f32()
            ))
        }
        (CpuStorage::I32(o), CpuStorage::I32(s)) => acc!(o, s, |a: i32, b| a.wrapping_add(b)),
        (CpuStorage::I64(o), CpuStorage::I64(s)) => acc!(o, s, |a: i64, b| a.wrapping_add(b)),
        (CpuStorage::U8(o), CpuStorage::U8(s)) => acc!(o, s, |a: u8, b| a.wrapping_add(b)),
        (CpuStorage::Bool(o), CpuStorage::Bool(s)) => acc!(o, s, |a: bool, b| a | b),
        _ => {
            return Err(Error::DTypeMismatch {
                op: "scatter_add",
                lhs: x.dtype(),
                rhs: src.dtype(),
            })
        }
    }
    Ok(out)
}
