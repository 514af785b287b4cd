//! Reductions over random dim subsets (keepdim both ways), arg-reductions, var/std with correction,
//! logsumexp, softmax and log_softmax against f64 references; size-0 and NaN edge cases.

mod common;

use common::*;
use kiln_core::{DType, Result, Tensor};
use proptest::prelude::*;

fn sum(v: &[f64]) -> f64 {
    v.iter().sum()
}
fn mean(v: &[f64]) -> f64 {
    sum(v) / v.len() as f64
}
fn var(v: &[f64], correction: usize) -> f64 {
    let m = mean(v);
    v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() as f64 - correction as f64).max(0.0)
}
fn lse(v: &[f64]) -> f64 {
    let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m.is_infinite() {
        return m;
    }
    m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn reductions_match_f64(shape in shape(0, 4, 4), kind in kind(), keepdim: bool, seed: u64) {
        let mut rng = TRng::new(seed);
        let (dims, user) = random_dims(shape.len(), &mut rng);
        let nonempty = dims.iter().all(|&d| shape[d] > 0);
        for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
            let x = make(&shape, kind, dtype, &mut rng, |r| r.uniform(-2.0, 2.0));
            let xv = x.to_vec_f64().unwrap();
            let out_shape = |keep: &[usize], drop: &[usize]| if keepdim { keep.to_vec() } else { drop.to_vec() };
            let ctx = |n: &str| format!("{n} {dtype} {shape:?} dims {user:?} keepdim {keepdim} {kind:?}");
            type Case<'a> = (&'a str, Box<dyn Fn() -> Result<Tensor> + 'a>, Box<dyn Fn(&[f64]) -> f64>, bool);
            let cases: Vec<Case> = vec![
                ("sum", Box::new(|| x.sum(&user, keepdim)), Box::new(sum), true),
                ("mean", Box::new(|| x.mean(&user, keepdim)), Box::new(mean), true),
                ("prod", Box::new(|| x.prod(&user, keepdim)), Box::new(|v: &[f64]| v.iter().product()), true),
                ("max", Box::new(|| x.max(&user, keepdim)), Box::new(|v: &[f64]| v.iter().cloned().fold(f64::NEG_INFINITY, f64::max)), nonempty),
                ("min", Box::new(|| x.min(&user, keepdim)), Box::new(|v: &[f64]| v.iter().cloned().fold(f64::INFINITY, f64::min)), nonempty),
                ("var0", Box::new(|| x.var(&user, 0, keepdim)), Box::new(|v: &[f64]| var(v, 0)), true),
                ("var1", Box::new(|| x.var(&user, 1, keepdim)), Box::new(|v: &[f64]| var(v, 1)), true),
                ("std1", Box::new(|| x.std(&user, 1, keepdim)), Box::new(|v: &[f64]| var(v, 1).sqrt()), true),
                ("logsumexp", Box::new(|| x.logsumexp(&user, keepdim)), Box::new(lse), true),
            ];
            for (name, op, f, defined) in cases {
                let (want, keep, drop) = ref_reduce(&xv, &shape, &dims, f);
                // a half result can overflow to inf where the f64 product does not
                let want: Vec<f64> = want.iter().map(|&v| round_to(v, dtype)).collect();
                match op() {
                    Ok(t) => {
                        prop_assert!(defined, "{}: expected an error", ctx(name));
                        // halves: mean/var/std/logsumexp go through several rounded prims
                        check(&t, &want, &out_shape(&keep, &drop), dtype, &ctx(name));
                    }
                    Err(e) => prop_assert!(!defined, "{}: {e}", ctx(name)),
                }
            }
            // arg-reductions along one dim
            if shape.is_empty() || shape[dims[0]] == 0 {
                continue;
            }
            let d = dims[0];
            for (name, is_max) in [("argmax", true), ("argmin", false)] {
                let (want, keep, drop) = ref_reduce(&xv, &shape, &[d], |v| {
                    let mut best = 0;
                    for (i, &a) in v.iter().enumerate() {
                        if (is_max && a > v[best]) || (!is_max && a < v[best]) { best = i; }
                    }
                    best as f64
                });
                let t = if is_max { x.argmax(Some(d as isize), keepdim) } else { x.argmin(Some(d as isize), keepdim) }.unwrap();
                check(&t, &want, &out_shape(&keep, &drop), DType::I64, &ctx(name));
            }
        }
    }

    #[test]
    fn softmax_family_matches_f64(shape in shape(1, 4, 5), kind in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        let d = rng.below(shape.len());
        let user = if rng.unit() < 0.5 { d as isize } else { d as isize - shape.len() as isize };
        for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
            let x = make(&shape, kind, dtype, &mut rng, |r| r.uniform(-6.0, 6.0));
            let xv = x.to_vec_f64().unwrap();
            // reference: per-slice softmax written back in place
            let mut sm = vec![0.0; xv.len()];
            let mut lsm = vec![0.0; xv.len()];
            let (lse_v, _, _) = ref_reduce(&xv, &shape, &[d], lse);
            let mut keep = shape.clone();
            keep[d] = 1;
            for (i, &v) in xv.iter().enumerate() {
                let mut idx = unravel(i, &shape);
                idx[d] = 0;
                let l = lse_v[ravel(&idx, &keep)];
                lsm[i] = v - l;
                sm[i] = (v - l).exp();
            }
            check(&x.softmax(user).unwrap(), &sm, &shape, dtype, &format!("softmax {dtype} {shape:?} dim {user}"));
            check(&x.log_softmax(user).unwrap(), &lsm, &shape, dtype, &format!("log_softmax {dtype} {shape:?} dim {user}"));
        }
    }
}

#[test]
fn integer_and_bool_reductions_follow_torch_dtypes() -> Result<()> {
    let i = Tensor::from_vec(vec![1i32, 2, 3, 4, 5, 6], &[2, 3])?;
    let s = i.sum(&[1], false)?;
    assert_eq!(s.dtype(), DType::I64);
    assert_eq!(s.to_vec::<i64>()?, vec![6, 15]);
    assert_eq!(i.prod(&[0], false)?.to_vec::<i64>()?, vec![4, 10, 18]);
    assert_eq!(i.max(&[1], false)?.dtype(), DType::I32);
    assert_eq!(i.max(&[1], false)?.to_vec::<i32>()?, vec![3, 6]);
    assert_eq!(i.mean(&[], false)?.to_vec::<f32>()?, vec![3.5]);
    let big = Tensor::from_vec(vec![1i64 << 53, 1, 1], &[3])?;
    assert_eq!(big.sum_all()?.to_vec::<i64>()?, vec![(1i64 << 53) + 2]);
    let b = Tensor::from_vec(vec![true, false, true, true], &[2, 2])?;
    assert_eq!(b.sum(&[1], false)?.to_vec::<i64>()?, vec![1, 2]);
    assert_eq!(b.sum_all()?.dtype(), DType::I64);
    // amax/amin of a bool tensor is bool
    let m = b.max(&[1], false)?;
    assert_eq!(m.dtype(), DType::Bool);
    assert_eq!(m.to_vec::<bool>()?, vec![true, true]);
    assert_eq!(b.min(&[1], false)?.to_vec::<bool>()?, vec![false, true]);
    assert_eq!(b.argmax(Some(1), false)?.to_vec::<i64>()?, vec![0, 0]);
    assert_eq!(b.argmin(None, false)?.to_vec::<i64>()?, vec![1]);
    Ok(())
}

#[test]
fn size_zero_reductions() -> Result<()> {
    let x = Tensor::zeros(&[2, 0, 3], DType::F32)?;
    assert_eq!(x.sum(&[1], false)?.to_vec::<f32>()?, vec![0.0; 6]);
    assert_eq!(x.sum(&[1], true)?.shape(), &[2, 1, 3]);
    assert_eq!(x.prod(&[1], false)?.to_vec::<f32>()?, vec![1.0; 6]);
    assert!(x
        .mean(&[1], false)?
        .to_vec::<f32>()?
        .iter()
        .all(|v| v.is_nan()));
    // reducing the non-empty dims of an empty tensor gives an empty result
    assert_eq!(x.max(&[2], false)?.shape(), &[2, 0]);
    assert_eq!(x.sum(&[0, 2], false)?.shape(), &[0]);
    assert_eq!(x.argmax(Some(2), false)?.shape(), &[2, 0]);
    // max/argmax over an empty dim are errors (no identity), as in PyTorch
    assert!(x.max(&[1], false).is_err());
    assert!(x.argmax(Some(1), false).is_err());
    assert!(x.argmax(None, false).is_err());
    // logsumexp over an empty dim is -inf; softmax of an empty tensor is empty
    let l = x.logsumexp(&[1], false)?;
    assert_eq!(l.shape(), &[2, 3]);
    assert!(l.to_vec::<f32>()?.iter().all(|&v| v == f32::NEG_INFINITY));
    assert_eq!(x.softmax(1)?.shape(), &[2, 0, 3]);
    assert_eq!(x.log_softmax(1)?.shape(), &[2, 0, 3]);
    // integer sums of empty tensors
    let e = Tensor::zeros(&[0], DType::I32)?;
    assert_eq!(e.sum_all()?.to_vec::<i64>()?, vec![0]);
    Ok(())
}

#[test]
fn nan_and_inf_in_reductions() -> Result<()> {
    let n = f64::NAN;
    let x = Tensor::from_vec(vec![1.0, n, 3.0, 2.0, 5.0, n, 0.0, -1.0, 7.0], &[3, 3])?;
    let mx = x.max(&[1], false)?.to_vec::<f64>()?;
    assert!(mx[0].is_nan() && mx[1].is_nan() && mx[2] == 7.0, "{mx:?}");
    let mn = x.min(&[1], false)?.to_vec::<f64>()?;
    assert!(mn[0].is_nan() && mn[1].is_nan() && mn[2] == -1.0, "{mn:?}");
    // argmax/argmin return the (first) NaN's index, as PyTorch
    assert_eq!(x.argmax(Some(1), false)?.to_vec::<i64>()?, vec![1, 2, 2]);
    assert_eq!(x.argmin(Some(1), false)?.to_vec::<i64>()?, vec![1, 2, 1]);
    let two_nans = Tensor::from_vec(vec![n, 1.0, n], &[3])?;
    assert_eq!(two_nans.argmax(None, false)?.to_vec::<i64>()?, vec![0]);
    // ties: the first occurrence wins
    let t = Tensor::from_vec(vec![2.0f32, 5.0, 5.0, -1.0, -1.0], &[5])?;
    assert_eq!(t.argmax(None, false)?.to_vec::<i64>()?, vec![1]);
    assert_eq!(t.argmin(None, true)?.to_vec::<i64>()?, vec![3]);
    assert_eq!(t.argmin(None, true)?.shape(), &[] as &[usize]);
    // logsumexp / softmax with infinities
    let inf = f64::INFINITY;
    let y = Tensor::from_vec(vec![-inf, -inf, 0.0, -inf, inf, 1.0], &[3, 2])?;
    let l = y.logsumexp(&[1], false)?.to_vec::<f64>()?;
    assert_eq!(l, vec![-inf, 0.0, inf]);
    let s = y.softmax(1)?.to_vec::<f64>()?;
    assert!(s[0].is_nan() && s[1].is_nan());
    assert_eq!(&s[2..4], &[1.0, 0.0]);
    // scalars
    let z = Tensor::scalar(3.0f64);
    assert_eq!(z.sum(&[0], false)?.to_vec::<f64>()?, vec![3.0]);
    assert_eq!(z.argmax(Some(0), false)?.to_vec::<i64>()?, vec![0]);
    assert_eq!(z.max(&[], true)?.shape(), &[] as &[usize]);
    Ok(())
}

/// Variance far from zero: values around 10^4 with a spread of one, in f32. The squared
/// deviations are Welford's (deviations from a running mean, no cancellation of squares around
/// zero), so the result is as close to the f64 two-pass reference as f32 output allows — rows
/// short, long, and single rows long enough to be taken in chunks.
#[test]
fn variance_of_values_far_from_zero() -> Result<()> {
    let mut rng = TRng::new(17);
    for shape in [vec![4usize, 37], vec![3, 5000], vec![1, 40_000]] {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n)
            .map(|_| (1e4 + rng.uniform(-1.0, 1.0)) as f32 as f64)
            .collect();
        let x = Tensor::from_vec(v.iter().map(|&a| a as f32).collect::<Vec<_>>(), &shape)?;
        let got = x.var(&[1], 1, false)?.to_vec::<f32>()?;
        for (row, g) in v.chunks(shape[1]).zip(got) {
            let want = var(row, 1);
            assert!(
                (g as f64 - want).abs() <= 1e-5 * want,
                "{shape:?}: {g} vs {want}"
            );
        }
    }
    Ok(())
}

/// The squared-deviations prim takes float operands only: an integer one is an error naming the
/// op and the dtype (`Tensor::var` converts to float first, as PyTorch's does).
#[test]
fn squared_deviations_of_integers_are_an_error() -> Result<()> {
    use kiln_core::prim::{Prim, ReduceOp};
    let x = Tensor::from_vec(vec![1i64, 2, 3, 4], &[2, 2])?;
    let prim = Prim::Reduce {
        op: ReduceOp::SumSqDev,
        dims: vec![1],
    };
    let err = kiln_core::dispatch::apply(prim, &[&x])
        .unwrap_err()
        .to_string();
    assert!(err.contains("reduce") && err.contains("I64"), "{err}");
    let v = x.var(&[1], 0, false)?.to_vec::<f32>()?;
    assert_eq!(v, vec![0.25, 0.25]);
    Ok(())
}
