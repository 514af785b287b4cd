//! Unary, binary, where and cast kernels. Operands arrive with equal shapes and dtypes (the prims are
//! strict); non-contiguous operands are gathered once, then the loop runs over flat slices.

use super::num::{Float, Num};
use super::{alloc, as_f32, from_f32_like, typed};
use crate::prim::{BinaryOp, UnaryOp};
use crate::storage::{CpuStorage, StorageElement};
use crate::{DType, Tensor};

/// Elements per task of an elementwise loop.
const CHUNK: usize = 4096;

fn map<A: Copy + Send + Sync, B: StorageElement + Send + Sync>(
    x: &[A],
    f: impl Fn(A) -> B + Sync + Send,
) -> Vec<B> {
    alloc::filled(x.len(), CHUNK, |c, o| {
        for (o, &a) in o.iter_mut().zip(&x[c * CHUNK..]) {
            o.write(f(a));
        }
    })
}

fn zip<A: Copy + Send + Sync, B: Copy + Send + Sync, C: StorageElement + Send + Sync>(
    x: &[A],
    y: &[B],
    f: impl Fn(A, B) -> C + Sync + Send,
) -> Vec<C> {
    alloc::filled(x.len().min(y.len()), CHUNK, |c, o| {
        let start = c * CHUNK;
        for ((o, &a), &b) in o.iter_mut().zip(&x[start..]).zip(&y[start..]) {
            o.write(f(a, b));
        }
    })
}

fn unary_float<T: Float>(op: UnaryOp, x: &[T]) -> Vec<T> {
    match op {
        UnaryOp::Exp => map(x, T::exp),
        UnaryOp::Log => map(x, T::ln),
        UnaryOp::Log1p => map(x, T::ln_1p),
        UnaryOp::Sqrt => map(x, T::sqrt),
        UnaryOp::Sin => map(x, T::sin),
        UnaryOp::Cos => map(x, T::cos),
        UnaryOp::Tanh => map(x, T::tanh),
        UnaryOp::Erf => map(x, T::erf),
        UnaryOp::Recip => map(x, |a| T::ONE.div(a)),
        _ => unary_num(op, x),
    }
}

fn unary_num<T: Num>(op: UnaryOp, x: &[T]) -> Vec<T> {
    match op {
        UnaryOp::Neg => map(x, T::neg),
        UnaryOp::Abs => map(x, T::abs),
        UnaryOp::Sign => map(x, T::sign),
        UnaryOp::Floor => map(x, T::floor),
        _ => x.to_vec(), // float-only ops never reach integer inputs (Prim::infer)
    }
}

pub(super) fn unary(op: UnaryOp, x: &Tensor) -> CpuStorage {
    let s = x.storage();
    let l = x.layout();
    match x.dtype() {
        DType::F32 => CpuStorage::F32(unary_float(op, &typed::<f32>(&s, l))),
        DType::F64 => CpuStorage::F64(unary_float(op, &typed::<f64>(&s, l))),
        DType::F16 | DType::BF16 => from_f32_like(x.dtype(), unary_float(op, &as_f32(&s, l))),
        DType::I32 => CpuStorage::I32(unary_num(op, &typed::<i32>(&s, l))),
        DType::I64 => CpuStorage::I64(unary_num(op, &typed::<i64>(&s, l))),
        DType::U8 => CpuStorage::U8(unary_num(op, &typed::<u8>(&s, l))),
        DType::Bool => CpuStorage::Bool(map(&typed::<bool>(&s, l), |b: bool| !b)),
    }
}

fn binary_num<T: Num>(op: BinaryOp, a: &[T], b: &[T]) -> CpuStorage {
    let wrap = T::wrap;
    match op {
        BinaryOp::Add => wrap(zip(a, b, T::add)),
        BinaryOp::Sub => wrap(zip(a, b, T::sub)),
        BinaryOp::Mul => wrap(zip(a, b, T::mul)),
        BinaryOp::Div => wrap(zip(a, b, T::div)),
        BinaryOp::Pow => wrap(zip(a, b, T::pow)),
        // NaN propagates through maximum/minimum, as in PyTorch.
        BinaryOp::Max => wrap(zip(a, b, |x, y| if x.is_nan() || x >= y { x } else { y })),
        BinaryOp::Min => wrap(zip(a, b, |x, y| if x.is_nan() || x <= y { x } else { y })),
        BinaryOp::Eq => CpuStorage::Bool(zip(a, b, |x, y| x == y)),
        BinaryOp::Ne => CpuStorage::Bool(zip(a, b, |x, y| x != y)),
        BinaryOp::Lt => CpuStorage::Bool(zip(a, b, |x, y| x < y)),
        BinaryOp::Le => CpuStorage::Bool(zip(a, b, |x, y| x <= y)),
        BinaryOp::Gt => CpuStorage::Bool(zip(a, b, |x, y| x > y)),
        BinaryOp::Ge => CpuStorage::Bool(zip(a, b, |x, y| x >= y)),
        BinaryOp::And | BinaryOp::Or => wrap(Vec::new()), // bool-only, handled by the caller
    }
}

fn binary_bool(op: BinaryOp, a: &[bool], b: &[bool]) -> CpuStorage {
    CpuStorage::Bool(match op {
        BinaryOp::And => zip(a, b, |x, y| x & y),
        BinaryOp::Or => zip(a, b, |x, y| x | y),
        BinaryOp::Eq => zip(a, b, |x, y| x == y),
        BinaryOp::Ne => zip(a, b, |x, y| x != y),
        BinaryOp::Lt => zip(a, b, |x, y| !x & y),
        BinaryOp::Le => zip(a, b, |x, y| x <= y),
        BinaryOp::Gt => zip(a, b, |x, y| x & !y),
        BinaryOp::Ge => zip(a, b, |x, y| x >= y),
        _ => Vec::new(), // arithmetic on bool is rejected by Prim::infer
    })
}

pub(super) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> CpuStorage {
    let (sa, sb) = (a.storage(), b.storage());
    let (la, lb) = (a.layout(), b.layout());
    match a.dtype() {
        DType::F32 => binary_num::<f32>(op, &typed(&sa, la), &typed(&sb, lb)),
        DType::F64 => binary_num::<f64>(op, &typed(&sa, la), &typed(&sb, lb)),
        DType::F16 | DType::BF16 => {
            let mut out = binary_num::<f32>(op, &as_f32(&sa, la), &as_f32(&sb, lb));
            // taken by `&mut`: a storage cannot be moved out of (it returns to the buffer cache)
            match &mut out {
                CpuStorage::F32(v) => from_f32_like(a.dtype(), std::mem::take(v)),
                _ => out,
            }
        }
        DType::I32 => binary_num::<i32>(op, &typed(&sa, la), &typed(&sb, lb)),
        DType::I64 => binary_num::<i64>(op, &typed(&sa, la), &typed(&sb, lb)),
        DType::U8 => binary_num::<u8>(op, &typed(&sa, la), &typed(&sb, lb)),
        DType::Bool => binary_bool(op, &typed(&sa, la), &typed(&sb, lb)),
    }
}

pub(super) fn where_(c: &Tensor, a: &Tensor, b: &Tensor) -> CpuStorage {
    fn go<T: StorageElement>(c: &[bool], a: &[T], b: &[T]) -> CpuStorage {
        T::wrap(alloc::filled(c.len(), CHUNK, |k, o| {
            let start = k * CHUNK;
            let abc = a[start..].iter().zip(&b[start..]).zip(&c[start..]);
            for (o, ((&a, &b), &c)) in o.iter_mut().zip(abc) {
                o.write(if c { a } else { b });
            }
        }))
    }
    let (sc, sa, sb) = (c.storage(), a.storage(), b.storage());
    let cond = typed::<bool>(&sc, c.layout());
    let (la, lb) = (a.layout(), b.layout());
    crate::with_storage!(&*sa, v => {
        fn tag<T: StorageElement>(_: &[T], c: &[bool], sa: &CpuStorage, la: &crate::shape::Layout, sb: &CpuStorage, lb: &crate::shape::Layout) -> CpuStorage {
            go::<T>(c, &typed::<T>(sa, la), &typed::<T>(sb, lb))
        }
        tag(v, &cond, &sa, la, &sb, lb)
    })
}

pub(super) fn cast(x: &Tensor, to: DType) -> CpuStorage {
    let s = x.storage();
    let l = x.layout();
    fn conv<A: StorageElement, B: StorageElement>(x: &[A]) -> CpuStorage {
        B::wrap(map(x, |a| B::from_f64(a.to_f64())))
    }
    // f64 is an exact intermediate for every pair except i64 above 2^53, which stays exact below:
    if let (CpuStorage::I64(v), DType::I32) = (&*s, to) {
        return CpuStorage::I32(map(&super::contig(v, l), |a| a as i32));
    }
    crate::with_storage!(&*s, v => {
        let v = super::contig(v, l);
        match to {
            DType::F32 => conv::<_, f32>(&v),
            DType::F64 => conv::<_, f64>(&v),
            DType::F16 => conv::<_, half::f16>(&v),
            DType::BF16 => conv::<_, half::bf16>(&v),
            DType::I32 => conv::<_, i32>(&v),
            DType::I64 => conv::<_, i64>(&v),
            DType::U8 => conv::<_, u8>(&v),
            DType::Bool => conv::<_, bool>(&v),
        }
    })
}
