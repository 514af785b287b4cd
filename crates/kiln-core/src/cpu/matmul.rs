//! Batched matmul [B,M,K] x [B,K,N] on the `gemm` crate, which reads strided operands directly, so
//! transposed views cost no copy. Many small matrices run in parallel over the batch; large ones let
//! gemm parallelise inside. A small f32 or f64 product (`prim::small_cpu_matmul`) is summed in the
//! order generated code sums it instead (`small_product`).

use gemm::{gemm, Parallelism};
use rayon::prelude::*;

use super::num::Num;
use super::{as_f32, from_f32_like, typed};
use crate::shape::Layout;
use crate::storage::CpuStorage;
use crate::{DType, Tensor};

/// `dst[b] = a[b] @ b[b]` for strided f32/f64 operands. Safety rests on the layouts addressing only
/// inside their buffers, which `Layout` guarantees for every tensor.
fn gemm_batched<T: Num + 'static>(a: &[T], la: &Layout, b: &[T], lb: &Layout) -> Vec<T> {
    let (bs, m, k, n) = (la.shape[0], la.shape[1], la.shape[2], lb.shape[2]);
    if m * n == 0 || k == 0 {
        return vec![T::ZERO; bs * m * n];
    }
    // every element is written by a GEMM that does not read it: a cached buffer's pages are
    // mapped already
    let len = bs * m * n;
    let mut out = super::alloc::take_vec(len).unwrap_or_else(|| vec![T::ZERO; len]);
    let flops = m * n * k;
    let run = |dst: &mut [T], i: usize, par: Parallelism| unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr().add(la.offset + i * la.strides[0]),
            la.strides[2] as isize,
            la.strides[1] as isize,
            b.as_ptr().add(lb.offset + i * lb.strides[0]),
            lb.strides[2] as isize,
            lb.strides[1] as isize,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            par,
        )
    };
    if bs > 1 && flops < (1 << 21) {
        out.par_chunks_mut(m * n)
            .enumerate()
            .for_each(|(i, dst)| run(dst, i, Parallelism::None));
    } else {
        let par = if flops >= (1 << 15) {
            Parallelism::Rayon(rayon::current_num_threads())
        } else {
            Parallelism::None
        };
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            run(dst, i, par);
        }
    }
    out
}

/// A small product (`prim::small_cpu_matmul`) in its one order: each output the f64 sum, from 0.0,
/// of the operands' values widened to f64 and multiplied, in order of k, rounded once — what
/// kiln-inductor's generated matmul computes, bit for bit. The operands are read through their
/// layouts (any strides, broadcasts included); a row's outputs accumulate side by side with k
/// outermost, so the adds run across the row while each output keeps its own order.
fn small_product<T: Num>(a: &[T], la: &Layout, b: &[T], lb: &Layout) -> Vec<T> {
    let (bs, m, k, n) = (la.shape[0], la.shape[1], la.shape[2], lb.shape[2]);
    let (sa, sb) = (&la.strides, &lb.strides);
    if bs * m * n == 0 {
        // no output (an empty operand's offsets may lie past its buffer)
        return Vec::new();
    }
    let mut out = Vec::with_capacity(bs * m * n);
    let mut acc = vec![0f64; n];
    for i in 0..bs {
        let (a0, b0) = (la.offset + i * sa[0], lb.offset + i * sb[0]);
        if sa[2] == 1 && sb[1] == 1 && k > 0 {
            // a's rows and b's columns contiguous (a linear layer's `x @ w.t()`): each output a
            // dot product of two slices, four outputs at a time so that their chains overlap
            for r in 0..m {
                let x = &a[a0 + r * sa[1]..][..k];
                let col = |c: usize| &b[b0 + c * sb[2]..][..k];
                let mut c = 0;
                while c + 4 <= n {
                    let (w0, w1, w2, w3) = (col(c), col(c + 1), col(c + 2), col(c + 3));
                    let mut s = [0f64; 4];
                    for p in 0..k {
                        let xv = x[p].to_f64();
                        s[0] += xv * w0[p].to_f64();
                        s[1] += xv * w1[p].to_f64();
                        s[2] += xv * w2[p].to_f64();
                        s[3] += xv * w3[p].to_f64();
                    }
                    out.extend(s.iter().map(|&v| T::from_f64(v)));
                    c += 4;
                }
                for c in c..n {
                    let w = col(c);
                    let mut s = 0f64;
                    for p in 0..k {
                        s += x[p].to_f64() * w[p].to_f64();
                    }
                    out.push(T::from_f64(s));
                }
            }
            continue;
        }
        for r in 0..m {
            acc.fill(0.0);
            for p in 0..k {
                let av = a[a0 + r * sa[1] + p * sa[2]].to_f64();
                let row = b0 + p * sb[1];
                match sb[2] {
                    // a contiguous row of b: one slice, the adds vectorized
                    1 => {
                        for (s, bv) in acc.iter_mut().zip(&b[row..row + n]) {
                            *s += av * bv.to_f64();
                        }
                    }
                    st => {
                        for (c, s) in acc.iter_mut().enumerate() {
                            *s += av * b[row + c * st].to_f64();
                        }
                    }
                }
            }
            out.extend(acc.iter().map(|&s| T::from_f64(s)));
        }
    }
    out
}

/// Integer matmul: rare, so a plain loop over contiguous copies.
fn naive<T: Num>(a: &[T], b: &[T], bs: usize, m: usize, k: usize, n: usize) -> Vec<T> {
    let mut out = vec![T::ZERO; bs * m * n];
    for i in 0..bs {
        for r in 0..m {
            for p in 0..k {
                let av = a[i * m * k + r * k + p];
                for c in 0..n {
                    let o = &mut out[i * m * n + r * n + c];
                    *o = o.add(av.mul(b[i * k * n + p * n + c]));
                }
            }
        }
    }
    out
}

/// Strides of 0 (broadcast views) inside a matrix are materialized; gemm wants real strides there.
fn gemm_ready(l: &Layout) -> bool {
    l.strides[1] != 0 && l.strides[2] != 0
}

pub(super) fn matmul(a: &Tensor, b: &Tensor) -> CpuStorage {
    let (bs, m, k, n) = (a.shape()[0], a.shape()[1], a.shape()[2], b.shape()[2]);
    let (sa, sb) = (a.storage(), b.storage());
    let (la, lb) = (a.layout().clone(), b.layout().clone());
    let direct = gemm_ready(&la) && gemm_ready(&lb);
    let small = crate::prim::small_cpu_matmul(bs, m, n, k);
    let (ca, cb) = (Layout::contiguous(&la.shape), Layout::contiguous(&lb.shape));
    match (a.dtype(), &*sa, &*sb) {
        (DType::F32, CpuStorage::F32(va), CpuStorage::F32(vb)) if small => {
            CpuStorage::F32(small_product(va, &la, vb, &lb))
        }
        (DType::F64, CpuStorage::F64(va), CpuStorage::F64(vb)) if small => {
            CpuStorage::F64(small_product(va, &la, vb, &lb))
        }
        (DType::F32, CpuStorage::F32(va), CpuStorage::F32(vb)) if direct => {
            CpuStorage::F32(gemm_batched(va, &la, vb, &lb))
        }
        (DType::F64, CpuStorage::F64(va), CpuStorage::F64(vb)) if direct => {
            CpuStorage::F64(gemm_batched(va, &la, vb, &lb))
        }
        (DType::F32 | DType::F16 | DType::BF16, _, _) => {
            let out = gemm_batched(&as_f32(&sa, &la), &ca, &as_f32(&sb, &lb), &cb);
            from_f32_like(a.dtype(), out)
        }
        (DType::F64, _, _) => {
            CpuStorage::F64(gemm_batched(&typed(&sa, &la), &ca, &typed(&sb, &lb), &cb))
        }
        (DType::I32, _, _) => {
            CpuStorage::I32(naive(&typed(&sa, &la), &typed(&sb, &lb), bs, m, k, n))
        }
        (DType::I64, _, _) => {
            CpuStorage::I64(naive(&typed(&sa, &la), &typed(&sb, &lb), bs, m, k, n))
        }
        (DType::U8, _, _) => CpuStorage::U8(naive(&typed(&sa, &la), &typed(&sb, &lb), bs, m, k, n)),
        (DType::Bool, _, _) => CpuStorage::Bool(Vec::new()), // rejected by Prim::infer
    }
}
