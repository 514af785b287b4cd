//! Unary, binary, where and cast kernels. Operands arrive with equal shapes and dtypes (the prims are
//! strict); non-contiguous operands are gathered once, then the loop runs over flat slices.

use std::borrow::Cow;

use super::num::{Float, Num};
use super::walk::{In, Walk};
use super::{alloc, as_f32, contig, from_f32_like, typed};
use crate::prim::{BinaryOp, UnaryOp};
use crate::shape::Layout;
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

fn zip_slices<A: Copy + Send + Sync, B: Copy + Send + Sync, C: StorageElement + Send + Sync>(
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

/// Two operands of one shape as a kernel reads them: contiguous (strided ones copied), or
/// walked in place (`walk.rs`: broadcast and strided views with long enough rows).
enum Two<'a, A: Clone, B: Clone> {
    Flat(Cow<'a, [A]>, Cow<'a, [B]>),
    Walked(Walk, In<'a, A>, In<'a, B>),
}

impl<'a, A: StorageElement, B: StorageElement> Two<'a, A, B> {
    fn new(a: &'a [A], la: &Layout, b: &'a [B], lb: &Layout) -> Self {
        match Walk::new(&[la, lb]) {
            Some(w) => {
                let (a, b) = (w.operand(a, la), w.operand(b, lb));
                Two::Walked(w, a, b)
            }
            None => Two::Flat(contig(a, la), contig(b, lb)),
        }
    }
}

fn zip<A: StorageElement, B: StorageElement, C: StorageElement + Send + Sync>(
    t: &Two<'_, A, B>,
    f: impl Fn(A, B) -> C + Sync + Send,
) -> Vec<C> {
    match t {
        Two::Flat(a, b) => zip_slices(a, b, f),
        Two::Walked(w, a, b) => w.fill(
            || (Vec::new(), Vec::new()),
            |(ba, bb), at, out| {
                let x = a.piece(w, at, out.len(), ba);
                let y = b.piece(w, at, out.len(), bb);
                for ((o, &a), &b) in out.iter_mut().zip(x).zip(y) {
                    o.write(f(a, b));
                }
            },
        ),
    }
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

fn binary_num<T: Num>(op: BinaryOp, t: &Two<'_, T, T>) -> CpuStorage {
    let wrap = T::wrap;
    match op {
        BinaryOp::Add => wrap(zip(t, T::add)),
        BinaryOp::Sub => wrap(zip(t, T::sub)),
        BinaryOp::Mul => wrap(zip(t, T::mul)),
        BinaryOp::Div => wrap(zip(t, T::div)),
        BinaryOp::Pow => wrap(zip(t, T::pow)),
        // NaN propagates through maximum/minimum, as in PyTorch.
        BinaryOp::Max => wrap(zip(t, |x, y| if x.is_nan() || x >= y { x } else { y })),
        BinaryOp::Min => wrap(zip(t, |x, y| if x.is_nan() || x <= y { x } else { y })),
        BinaryOp::Eq => CpuStorage::Bool(zip(t, |x, y| x == y)),
        BinaryOp::Ne => CpuStorage::Bool(zip(t, |x, y| x != y)),
        BinaryOp::Lt => CpuStorage::Bool(zip(t, |x, y| x < y)),
        BinaryOp::Le => CpuStorage::Bool(zip(t, |x, y| x <= y)),
        BinaryOp::Gt => CpuStorage::Bool(zip(t, |x, y| x > y)),
        BinaryOp::Ge => CpuStorage::Bool(zip(t, |x, y| x >= y)),
        BinaryOp::And | BinaryOp::Or => wrap(Vec::new()), // bool-only, handled by the caller
    }
}

fn binary_bool(op: BinaryOp, t: &Two<'_, bool, bool>) -> CpuStorage {
    CpuStorage::Bool(match op {
        BinaryOp::And => zip(t, |x, y| x & y),
        BinaryOp::Or => zip(t, |x, y| x | y),
        BinaryOp::Eq => zip(t, |x, y| x == y),
        BinaryOp::Ne => zip(t, |x, y| x != y),
        BinaryOp::Lt => zip(t, |x, y| !x & y),
        BinaryOp::Le => zip(t, |x, y| x <= y),
        BinaryOp::Gt => zip(t, |x, y| x & !y),
        BinaryOp::Ge => zip(t, |x, y| x >= y),
        _ => Vec::new(), // arithmetic on bool is rejected by Prim::infer
    })
}

pub(super) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> CpuStorage {
    let (sa, sb) = (a.storage(), b.storage());
    let (la, lb) = (a.layout(), b.layout());
    fn two<'a, T: StorageElement>(
        sa: &'a CpuStorage,
        la: &Layout,
        sb: &'a CpuStorage,
        lb: &Layout,
    ) -> Two<'a, T, T> {
        match (T::view(sa), T::view(sb)) {
            (Some(a), Some(b)) => Two::new(a, la, b, lb),
            // unreachable: Prim::infer checked the dtypes
            _ => Two::Flat(Cow::Owned(Vec::new()), Cow::Owned(Vec::new())),
        }
    }
    match a.dtype() {
        DType::F32 => binary_num::<f32>(op, &two(&sa, la, &sb, lb)),
        DType::F64 => binary_num::<f64>(op, &two(&sa, la, &sb, lb)),
        DType::F16 | DType::BF16 => {
            let t = Two::Flat(as_f32(&sa, la), as_f32(&sb, lb));
            let mut out = binary_num::<f32>(op, &t);
            // taken by `&mut`: a storage cannot be moved out of (it returns to the buffer cache)
            match &mut out {
                CpuStorage::F32(v) => from_f32_like(a.dtype(), std::mem::take(v)),
                _ => out,
            }
        }
        DType::I32 => binary_num::<i32>(op, &two(&sa, la, &sb, lb)),
        DType::I64 => binary_num::<i64>(op, &two(&sa, la, &sb, lb)),
        DType::U8 => binary_num::<u8>(op, &two(&sa, la, &sb, lb)),
        DType::Bool => binary_bool(op, &two(&sa, la, &sb, lb)),
    }
}

pub(super) fn where_(c: &Tensor, a: &Tensor, b: &Tensor) -> CpuStorage {
    fn go<T: StorageElement>(
        c: &[bool],
        lc: &Layout,
        a: &[T],
        la: &Layout,
        b: &[T],
        lb: &Layout,
    ) -> CpuStorage {
        let pick = |c: bool, a: T, b: T| if c { a } else { b };
        let Some(w) = Walk::new(&[lc, la, lb]) else {
            let (c, a, b) = (contig(c, lc), contig(a, la), contig(b, lb));
            return T::wrap(alloc::filled(c.len(), CHUNK, |k, o| {
                let start = k * CHUNK;
                let abc = a[start..].iter().zip(&b[start..]).zip(&c[start..]);
                for (o, ((&a, &b), &c)) in o.iter_mut().zip(abc) {
                    o.write(pick(c, a, b));
                }
            }));
        };
        let (c, a, b) = (w.operand(c, lc), w.operand(a, la), w.operand(b, lb));
        T::wrap(w.fill(
            || (Vec::new(), Vec::new(), Vec::new()),
            |(bc, ba, bb), at, o| {
                let n = o.len();
                let (c, a, b) = (
                    c.piece(&w, at, n, bc),
                    a.piece(&w, at, n, ba),
                    b.piece(&w, at, n, bb),
                );
                for (o, ((&a, &b), &c)) in o.iter_mut().zip(a.iter().zip(b).zip(c)) {
                    o.write(pick(c, a, b));
                }
            },
        ))
    }
    let (sc, sa, sb) = (c.storage(), a.storage(), b.storage());
    let cond = match bool::view(&sc) {
        Some(v) => v,
        None => return CpuStorage::Bool(Vec::new()), // unreachable: Prim::infer checked it
    };
    let (lc, la, lb) = (c.layout(), a.layout(), b.layout());
    crate::with_storage!(&*sa, v => {
        fn tag<T: StorageElement>(_: &[T], c: &[bool], lc: &Layout, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> CpuStorage {
            match (T::view(sa), T::view(sb)) {
                (Some(a), Some(b)) => go::<T>(c, lc, a, la, b, lb),
                _ => T::wrap(Vec::new()), // unreachable: Prim::infer checked the dtypes
            }
        }
        tag(v, cond, lc, &sa, la, &sb, lb)
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
