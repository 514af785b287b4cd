//! Batched matmul [B,M,K] x [B,K,N] on the `gemm` crate, which reads strided operands directly, so
//! transposed views cost no copy. Many small matrices run in parallel over the batch; large ones let
//! gemm parallelise inside.

use gemm::{gemm, Parallelism};
use rayon::prelude::*;

use super::num::{Float, Num};
use super::{as_f32, contig_f64, from_f32_like, typed};
use crate::prim::{Activation, Epilogue};
use crate::shape::Layout;
use crate::storage::CpuStorage;
use crate::{DType, Tensor};

/// `dst[b] = a[b] @ b[b]` for strided f32/f64 operands. Safety rests on the layouts addressing only
/// inside their buffers, which `Layout` guarantees for every tensor.
fn gemm_batched<T: Num + 'static>(a: &[T], la: &Layout, b: &[T], lb: &Layout) -> Vec<T> {
    let (bs, m, k, n) = (la.shape[0], la.shape[1], la.shape[2], lb.shape[2]);
    let mut out = vec![T::ZERO; bs * m * n];
    if m * n == 0 {
        return out;
    }
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
    if k == 0 {
        return out;
    }
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
    let (ca, cb) = (Layout::contiguous(&la.shape), Layout::contiguous(&lb.shape));
    match (a.dtype(), &*sa, &*sb) {
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

/// `act(a @ b + bias)` (`Prim::MatmulEpilogue`): the matmul as `matmul` runs it, then each row's
/// bias and activation in place, each op rounded as the separate elementwise ops round it (a
/// half result is rounded, then the bias added in f32 and rounded again, ...), so a compiled
/// graph that runs it computes what eager execution of the ops it replaced computes, bit for
/// bit. The gemm crate has no epilogue hook, and accumulating onto a destination filled with the
/// bias would add the bias at another point of the sum.
pub(super) fn matmul_epilogue(inputs: &[&Tensor], e: Epilogue) -> CpuStorage {
    let mut out = matmul(inputs[0], inputs[1]);
    let n = inputs[1].shape()[2];
    if n == 0 || (!e.bias && e.act == Activation::None) {
        return out;
    }
    let bias: Option<Vec<f64>> = inputs
        .get(2)
        .filter(|_| e.bias)
        .map(|t| contig_f64(&t.storage(), t.layout()));
    let bias = bias.as_deref();
    match &mut out {
        CpuStorage::F32(v) => epilogue_rows(v, n, bias, e.act),
        CpuStorage::F64(v) => epilogue_rows(v, n, bias, e.act),
        CpuStorage::F16(v) => epilogue_rows(v, n, bias, e.act),
        CpuStorage::BF16(v) => epilogue_rows(v, n, bias, e.act),
        // Prim::infer admits floating-point operands only
        _ => {}
    }
    out
}

/// Each `n`-wide row of `v` plus `bias`, then `act`, in place, in parallel over rows.
fn epilogue_rows<T: EpilogueMath>(v: &mut [T], n: usize, bias: Option<&[f64]>, act: Activation) {
    // constants as a scalar operand of the tensor's dtype holds them (`Tensor::full`)
    let bias: Option<Vec<T>> = bias.map(|b| b.iter().map(|&x| T::constant(x)).collect());
    let gelu = [Activation::GELU_CUBE, Activation::gelu_scale(), 1.0, 0.5].map(T::constant);
    let zero = T::constant(0.0);
    // rows of at least 16 KiB per task
    let rows_per_task = (4096 / n).max(1);
    v.par_chunks_mut(n * rows_per_task).for_each(|rows| {
        for row in rows.chunks_mut(n) {
            for (j, x) in row.iter_mut().enumerate() {
                let y = bias.as_ref().map_or(*x, |b| x.add(b[j]));
                *x = match act {
                    Activation::None => y,
                    Activation::Relu if y.le_zero() => zero,
                    Activation::Relu => y,
                    Activation::GeluTanh => gelu_tanh(y, gelu),
                };
            }
        }
    })
}

/// `Tensor::gelu_tanh`'s ops in its order: `x * (tanh((x + x * x * x * c) * k) + 1) * 0.5`.
fn gelu_tanh<T: EpilogueMath>(x: T, [c, k, one, half]: [T; 4]) -> T {
    let cube = x.mul(x).mul(x);
    let inner = x.add(cube.mul(c)).mul(k);
    x.mul(inner.tanh().add(one)).mul(half)
}

/// The arithmetic of the core's elementwise kernels on one dtype: f32 and f64 natively, the
/// half types in f32 with each result rounded.
trait EpilogueMath: Copy + Send + Sync {
    fn constant(v: f64) -> Self;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn tanh(self) -> Self;
    fn le_zero(self) -> bool;
}

macro_rules! float_math {
    ($t:ty) => {
        impl EpilogueMath for $t {
            fn constant(v: f64) -> Self {
                v as $t
            }
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn mul(self, o: Self) -> Self {
                self * o
            }
            fn tanh(self) -> Self {
                Float::tanh(self)
            }
            fn le_zero(self) -> bool {
                self <= 0.0
            }
        }
    };
}
float_math!(f32);
float_math!(f64);

macro_rules! half_math {
    ($t:ty) => {
        impl EpilogueMath for $t {
            fn constant(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            fn add(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() + o.to_f32())
            }
            fn mul(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() * o.to_f32())
            }
            fn tanh(self) -> Self {
                <$t>::from_f32(Float::tanh(self.to_f32()))
            }
            fn le_zero(self) -> bool {
                self.to_f32() <= 0.0
            }
        }
    };
}
half_math!(half::f16);
half_math!(half::bf16);
