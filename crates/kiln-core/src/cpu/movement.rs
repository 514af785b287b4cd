//! Pad and cat: the movement prims that write new buffers (views never reach a kernel).

use super::write_strided_from;
use crate::prim::OutMeta;
use crate::shape::Layout;
use crate::storage::CpuStorage;
use crate::Tensor;

pub(super) fn pad(x: &Tensor, pads: &[(usize, usize)], value: f64, shape: &[usize]) -> CpuStorage {
    let mut out = super::alloc::full(x.dtype(), shape.iter().product(), value);
    let mut interior = Layout::contiguous(shape);
    for (d, &(before, _)) in pads.iter().enumerate() {
        interior = interior.slice(d, before, before + x.shape()[d], 1);
    }
    if x.numel() > 0 {
        write_strided_from(&mut out, &interior, x);
    }
    out
}

pub(super) fn cat(xs: &[&Tensor], dim: usize, meta: &OutMeta) -> CpuStorage {
    // the parts cover the output: nothing to fill first
    let mut out = super::alloc::empty(meta.dtype, meta.shape.iter().product());
    let full = Layout::contiguous(&meta.shape);
    let mut at = 0;
    for x in xs {
        let len = x.shape()[dim];
        if x.numel() > 0 {
            write_strided_from(&mut out, &full.slice(dim, at, at + len, 1), x);
        }
        at += len;
    }
    out
}
