//! Unary, binary, comparison, logical, where and clamp ops against f64 references, on random shapes
//! with broadcasting, non-contiguous layouts, size-0/size-1 dims and every float dtype; plus dtype
//! promotion and integer/bool/-0.0/NaN edge cases.

mod common;

use common::*;
use kiln_core::{DType, Result, Tensor};
use proptest::prelude::*;

const FLOATS: [DType; 4] = [DType::F64, DType::F32, DType::F16, DType::BF16];

fn erf(x: f64) -> f64 {
    // Abramowitz-Stegun 7.1.26 is only 1e-7 accurate; use a series/continued fraction instead.
    if x.abs() < 3.0 {
        // Maclaurin series
        let mut sum = 0.0;
        let mut term = x;
        let mut n = 0.0;
        loop {
            let add = term / (2.0 * n + 1.0);
            sum += add;
            if add.abs() < 1e-17 * sum.abs().max(1e-300) {
                break;
            }
            n += 1.0;
            term *= -x * x / n;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc continued fraction (Lentz) for |x| >= 3
        let ax = x.abs();
        let mut f = ax;
        for k in (1..60).rev() {
            f = ax + (k as f64 / 2.0) / f;
        }
        let erfc = (-ax * ax).exp() / (f * std::f64::consts::PI.sqrt());
        (1.0 - erfc).copysign(x)
    }
}

type UnaryCase = (
    &'static str,
    fn(&Tensor) -> Result<Tensor>,
    fn(f64) -> f64,
    f64,
    f64,
);

/// (name, op, reference, input lo, input hi)
fn unary_cases() -> Vec<UnaryCase> {
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    vec![
        ("neg", |t| t.neg(), |x| -x, -3.0, 3.0),
        ("abs", |t| t.abs(), f64::abs, -3.0, 3.0),
        ("exp", |t| t.exp(), f64::exp, -4.0, 4.0),
        ("log", |t| t.log(), f64::ln, 0.05, 5.0),
        ("log1p", |t| t.log1p(), f64::ln_1p, -0.9, 5.0),
        ("sqrt", |t| t.sqrt(), f64::sqrt, 0.0, 5.0),
        ("rsqrt", |t| t.rsqrt(), |x| 1.0 / x.sqrt(), 0.05, 5.0),
        ("sin", |t| t.sin(), f64::sin, -4.0, 4.0),
        ("cos", |t| t.cos(), f64::cos, -4.0, 4.0),
        ("tanh", |t| t.tanh(), f64::tanh, -4.0, 4.0),
        ("sigmoid", |t| t.sigmoid(), sig, -8.0, 8.0),
        ("relu", |t| t.relu(), |x| x.max(0.0), -3.0, 3.0),
        (
            "gelu",
            |t| t.gelu(),
            |x| 0.5 * x * (1.0 + erf(x / 2f64.sqrt())),
            -4.0,
            4.0,
        ),
        (
            "gelu_tanh",
            |t| t.gelu_tanh(),
            |x| {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
            },
            -4.0,
            4.0,
        ),
        ("silu", |t| t.silu(), |x| x / (1.0 + (-x).exp()), -6.0, 6.0),
        ("erf", |t| t.erf(), erf, -4.0, 4.0),
        ("floor", |t| t.floor(), f64::floor, -5.0, 5.0),
        (
            "sign",
            |t| t.sign(),
            |x| {
                if x > 0.0 {
                    1.0
                } else if x < 0.0 {
                    -1.0
                } else {
                    0.0
                }
            },
            -2.0,
            2.0,
        ),
        ("reciprocal", |t| t.reciprocal(), |x| 1.0 / x, 0.1, 4.0),
        ("square", |t| t.square(), |x| x * x, -3.0, 3.0),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn unary_ops_match_f64(shape in shape(0, 4, 4), kind in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        for (name, op, f, lo, hi) in unary_cases() {
            for dtype in FLOATS {
                let x = make(&shape, kind, dtype, &mut rng, |r| r.uniform(lo, hi));
                let xv = x.to_vec_f64().unwrap();
                let want: Vec<f64> = xv.iter().map(|&v| f(v)).collect();
                let got = op(&x).unwrap();
                check(&got, &want, &shape, dtype, &format!("{name} {dtype} {kind:?}"));
            }
        }
    }

    #[test]
    fn binary_ops_broadcast_match_f64(a_shape in shape(0, 4, 4), kind_a in kind(), kind_b in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        let b_shape = broadcast_partner(&a_shape, &mut rng);
        let (a_shape, b_shape) = if rng.unit() < 0.5 { (a_shape, b_shape) } else { (b_shape, a_shape) };
        type Case = (&'static str, fn(&Tensor, &Tensor) -> Result<Tensor>, fn(f64, f64) -> f64);
        let cases: [Case; 7] = [
            ("add", |a, b| a.add(b), |a, b| a + b),
            ("sub", |a, b| a.sub(b), |a, b| a - b),
            ("mul", |a, b| a.mul(b), |a, b| a * b),
            ("div", |a, b| a.div(b), |a, b| a / b),
            ("pow", |a, b| a.abs()?.add(0.1)?.pow(b), |a, b| (a.abs() + 0.1).powf(b)),
            ("maximum", |a, b| a.maximum(b), f64::max),
            ("minimum", |a, b| a.minimum(b), f64::min),
        ];
        for dtype in FLOATS {
            let a = make(&a_shape, kind_a, dtype, &mut rng, |r| r.away_from_zero(0.25, 2.0));
            let b = make(&b_shape, kind_b, dtype, &mut rng, |r| r.away_from_zero(0.25, 2.0));
            let (av, bv) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
            for (name, op, f) in cases {
                // `pow` rounds |a|+0.1 to the dtype before raising it; mirror that in the reference
                let (want, shape) = ref_map(&[(&av, &a_shape), (&bv, &b_shape)], |x| {
                    if name == "pow" { round_to(x[0].abs() + 0.1, dtype).powf(x[1]) } else { f(x[0], x[1]) }
                });
                let got = op(&a, &b).unwrap();
                check(&got, &want, &shape, dtype, &format!("{name} {dtype} {a_shape:?} {b_shape:?}"));
            }
            type Cmp = (&'static str, fn(&Tensor, &Tensor) -> Result<Tensor>, fn(f64, f64) -> bool);
            let cmps: [Cmp; 6] = [
                ("eq", |a, b| a.eq(b), |a, b| a == b),
                ("ne", |a, b| a.ne(b), |a, b| a != b),
                ("lt", |a, b| a.lt(b), |a, b| a < b),
                ("le", |a, b| a.le(b), |a, b| a <= b),
                ("gt", |a, b| a.gt(b), |a, b| a > b),
                ("ge", |a, b| a.ge(b), |a, b| a >= b),
            ];
            // compare against -|a|, equal to `a` wherever a < 0, so ties are exercised too
            let b2 = a.abs().unwrap().neg().unwrap();
            let b2v = b2.to_vec_f64().unwrap();
            for (name, op, f) in cmps {
                for (rhs, rv, rs) in [(&b, &bv, &b_shape), (&b2, &b2v, &a_shape)] {
                    let (want, shape) = ref_map(&[(&av, &a_shape), (rv, rs)], |x| f(x[0], x[1]) as u8 as f64);
                    check(&op(&a, rhs).unwrap(), &want, &shape, DType::Bool, &format!("{name} {dtype}"));
                }
            }
        }
    }

    /// Broadcast and strided operands whose shared rows hold 16 or more elements are read in
    /// place (`cpu/walk.rs`) instead of copied first: every kind of view, broadcast partners,
    /// size-1 dims; the same bits as the ops on contiguous copies of the broadcast operands.
    #[test]
    fn views_with_long_rows_are_read_in_place(lead in shape_nz(0, 3, 3), row in 16usize..40, kind_a in kind(), kind_b in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        let mut a_shape = lead;
        a_shape.push(row);
        let b_shape = broadcast_partner(&a_shape, &mut rng);
        type Case = (&'static str, fn(&Tensor, &Tensor) -> Result<Tensor>);
        let cases: [Case; 6] = [
            ("add", |a, b| a.add(b)),
            ("mul", |a, b| a.mul(b)),
            ("maximum", |a, b| a.maximum(b)),
            ("le", |a, b| a.le(b)),
            ("where", |a, b| Tensor::where_(&a.gt(0.0)?, a, b)),
            ("relu", |a, _| a.relu()),
        ];
        for dtype in [DType::F32, DType::F64, DType::I64] {
            let a = make(&a_shape, kind_a, dtype, &mut rng, |r| r.uniform(-3.0, 3.0).round());
            let b = make(&b_shape, kind_b, dtype, &mut rng, |r| r.uniform(-3.0, 3.0));
            // the operands as contiguous tensors of the result's shape: the path without views
            let copies = |a: &Tensor, b: &Tensor| -> Result<(Tensor, Tensor)> {
                Ok((a.broadcast_to(&a_shape)?.contiguous()?, b.broadcast_to(&a_shape)?.contiguous()?))
            };
            let (ac, bc) = copies(&a, &b).unwrap();
            for (name, op) in cases {
                let (got, want) = (op(&a, &b).unwrap(), op(&ac, &bc).unwrap());
                let ctx = format!("{name} {dtype} {a_shape:?} {kind_a:?} with {b_shape:?} {kind_b:?}");
                prop_assert_eq!(got.shape(), want.shape(), "{}", &ctx);
                let bits = |t: &Tensor| t.to_vec_f64().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                prop_assert_eq!(bits(&got), bits(&want), "{}", &ctx);
            }
            // and against f64 for one op
            let (av, bv) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
            let (want, shape) = ref_map(&[(&av, &a_shape), (&bv, &b_shape)], |x| x[0] * x[1]);
            if dtype != DType::I64 {
                check(&a.mul(&b).unwrap(), &want, &shape, dtype, "mul");
            }
        }
    }

    #[test]
    fn logical_where_clamp_match_f64(a_shape in shape(0, 3, 4), kind_a in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        let b_shape = broadcast_partner(&a_shape, &mut rng);
        let a = make(&a_shape, kind_a, DType::Bool, &mut rng, |r| (r.unit() < 0.5) as u8 as f64);
        let b = make(&b_shape, Kind::Contiguous, DType::Bool, &mut rng, |r| (r.unit() < 0.5) as u8 as f64);
        let (av, bv) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
        let (want, shape) = ref_map(&[(&av, &a_shape), (&bv, &b_shape)], |x| ((x[0] != 0.0) && (x[1] != 0.0)) as u8 as f64);
        check(&a.logical_and(&b).unwrap(), &want, &shape, DType::Bool, "logical_and");
        let (want, _) = ref_map(&[(&av, &a_shape), (&bv, &b_shape)], |x| ((x[0] != 0.0) || (x[1] != 0.0)) as u8 as f64);
        check(&a.logical_or(&b).unwrap(), &want, &shape, DType::Bool, "logical_or");
        let want: Vec<f64> = av.iter().map(|&v| (v == 0.0) as u8 as f64).collect();
        check(&a.logical_not().unwrap(), &want, &a_shape, DType::Bool, "logical_not");

        for dtype in FLOATS {
            // where with broadcast condition / branches
            let x = make(&b_shape, Kind::Permuted, dtype, &mut rng, |r| r.uniform(-2.0, 2.0));
            let y = make(&[], Kind::Contiguous, dtype, &mut rng, |r| r.uniform(-2.0, 2.0));
            let (xv, yv) = (x.to_vec_f64().unwrap(), y.to_vec_f64().unwrap());
            let (want, shape) = ref_map(&[(&av, &a_shape), (&xv, &b_shape), (&yv, &[])], |v| if v[0] != 0.0 { v[1] } else { v[2] });
            check(&Tensor::where_(&a, &x, &y).unwrap(), &want, &shape, dtype, "where");
            // where with a scalar branch keeps the tensor's dtype (a Python scalar does not promote)
            let (want, shape) = ref_map(&[(&av, &a_shape), (&xv, &b_shape)], |v| if v[0] != 0.0 { 0.5 } else { v[1] });
            check(&Tensor::where_(&a, 0.5, &x).unwrap(), &want, &shape, dtype, "where(c, 0.5, x)");
            // clamp
            let (lo, hi) = (rng.uniform(-1.0, 0.0), rng.uniform(0.0, 1.0));
            for (mn, mx) in [(Some(lo), Some(hi)), (Some(lo), None), (None, Some(hi))] {
                let want: Vec<f64> = xv.iter().map(|&v| {
                    let mut v = v;
                    if let Some(l) = mn { if v < round_to(l, dtype) { v = round_to(l, dtype) } }
                    if let Some(h) = mx { if v > round_to(h, dtype) { v = round_to(h, dtype) } }
                    v
                }).collect();
                check(&x.clamp(mn, mx).unwrap(), &want, &b_shape, dtype, &format!("clamp {mn:?} {mx:?}"));
            }
        }
    }
}

#[test]
fn tensor_scalar_operands_and_promotion() -> Result<()> {
    let i = Tensor::from_vec(vec![1i32, -2, 3], &[3])?;
    let l = Tensor::from_vec(vec![1i64, 2, 3], &[3])?;
    let f = Tensor::from_vec(vec![0.5f32, 1.5, -2.0], &[3])?;
    let d = Tensor::from_vec(vec![0.25f64, 1.0, 2.0], &[3])?;
    let h = Tensor::from_vec(vec![half::f16::from_f32(1.5); 3], &[3])?;
    let bf = Tensor::from_vec(vec![half::bf16::from_f32(2.0); 3], &[3])?;
    let b = Tensor::from_vec(vec![true, false, true], &[3])?;
    let u = Tensor::from_vec(vec![200u8, 100, 0], &[3])?;

    // tensor-tensor promotion follows torch.promote_types
    assert_eq!(i.add(&f)?.dtype(), DType::F32);
    assert_eq!(i.add(&l)?.dtype(), DType::I64);
    assert_eq!(f.add(&d)?.dtype(), DType::F64);
    assert_eq!(h.add(&f)?.dtype(), DType::F32);
    assert_eq!(h.add(&bf)?.dtype(), DType::F32);
    assert_eq!(h.add(&i)?.dtype(), DType::F16);
    assert_eq!(b.add(&i)?.dtype(), DType::I32);
    assert_eq!(b.add(&b.to_dtype(DType::U8)?)?.dtype(), DType::U8);
    assert_eq!(u.add(&i)?.dtype(), DType::I32);
    assert_eq!(i.add(&f)?.to_vec::<f32>()?, vec![1.5, -0.5, 1.0]);
    assert_eq!(h.add(&i)?.to_vec_f64()?, vec![2.5, -0.5, 4.5]);
    assert_eq!(b.add(&i)?.to_vec::<i32>()?, vec![2, -2, 4]);
    // true division of integers gives float
    assert_eq!(i.div(&l)?.dtype(), DType::F32);
    assert_eq!(i.div(2i64)?.to_vec::<f32>()?, vec![0.5, -1.0, 1.5]);
    // scalars, as Python's: Rust integers keep an int tensor's dtype, Rust floats make it float32
    // (even integral ones: `int_tensor + 2.0` is float in PyTorch)
    assert_eq!(i.add(2.0)?.dtype(), DType::F32);
    assert_eq!(i.add(2.0)?.to_vec::<f32>()?, vec![3.0, 0.0, 5.0]);
    assert_eq!(b.mul(2.0)?.dtype(), DType::F32);
    assert_eq!(i.mul(3i64)?.dtype(), DType::I32);
    assert_eq!(i.mul(3i64)?.to_vec::<i32>()?, vec![3, -6, 9]);
    assert_eq!(i.add(0.5)?.dtype(), DType::F32);
    assert_eq!(i.add(0.5)?.to_vec::<f32>()?, vec![1.5, -1.5, 3.5]);
    assert_eq!(h.mul(2.0)?.dtype(), DType::F16);
    assert_eq!(bf.sub(0.5)?.dtype(), DType::BF16);
    assert_eq!(bf.sub(0.5)?.to_vec_f64()?, vec![1.5; 3]);
    assert_eq!(f.mul(1e10)?.dtype(), DType::F32);
    assert_eq!(b.add(1i64)?.dtype(), DType::I64);
    // u8 arithmetic wraps like PyTorch's uint8
    assert_eq!(u.add(&u)?.to_vec::<u8>()?, vec![144, 200, 0]);
    // comparisons of mixed dtypes compare values
    assert_eq!(i.lt(&f)?.to_vec::<bool>()?, vec![false, true, false]);
    assert_eq!(i.eq(1.0)?.to_vec::<bool>()?, vec![true, false, false]);
    // float-only ops on ints compute in float32
    assert_eq!(i.exp()?.dtype(), DType::F32);
    assert_eq!(
        l.sqrt()?.to_vec::<f32>()?,
        vec![1.0, 2f32.sqrt(), 3f32.sqrt()]
    );
    // where promotes its branches; clamp keeps an int tensor int for integral bounds
    assert_eq!(
        Tensor::where_(&b, &i, &f)?.to_vec::<f32>()?,
        vec![1.0, 1.5, 3.0]
    );
    let c = i.clamp(Some(0.0), Some(2.0))?;
    assert_eq!(c.dtype(), DType::I32);
    assert_eq!(c.to_vec::<i32>()?, vec![1, 0, 2]);
    let c = i.clamp(Some(-0.5), None)?;
    assert_eq!(c.to_vec::<f32>()?, vec![1.0, -0.5, 3.0]);
    assert_eq!(h.clamp(Some(1.75), None)?.dtype(), DType::F16);
    Ok(())
}

#[test]
fn integer_and_bool_edge_cases() -> Result<()> {
    let i = Tensor::from_vec(vec![i32::MIN, -7, 0, 7, i32::MAX], &[5])?;
    assert_eq!(i.sign()?.to_vec::<i32>()?, vec![-1, -1, 0, 1, 1]);
    assert_eq!(
        i.neg()?.to_vec::<i32>()?,
        vec![i32::MIN, 7, 0, -7, -i32::MAX]
    );
    assert_eq!(i.abs()?.to_vec::<i32>()?, vec![i32::MIN, 7, 0, 7, i32::MAX]);
    assert_eq!(i.floor()?.to_vec::<i32>()?, i.to_vec::<i32>()?);
    let l = Tensor::from_vec(vec![i64::MIN, -3, 0, 5], &[4])?;
    assert_eq!(l.sign()?.to_vec::<i64>()?, vec![-1, -1, 0, 1]);
    // integer pow and maximum/minimum stay integer
    let p = Tensor::from_vec(vec![2i64, 3, -2], &[3])?;
    assert_eq!(p.pow(3i64)?.to_vec::<i64>()?, vec![8, 27, -8]);
    assert_eq!(p.maximum(0i64)?.to_vec::<i64>()?, vec![2, 3, 0]);
    assert_eq!(
        p.minimum(&Tensor::from_vec(vec![5i64, 1, -9], &[3])?)?
            .to_vec::<i64>()?,
        vec![2, 1, -9]
    );
    // big int64 values survive arithmetic exactly (no f64 round trip)
    let big = Tensor::from_vec(vec![(1i64 << 53) + 1], &[1])?;
    assert_eq!(big.add(1i64)?.to_vec::<i64>()?, vec![(1i64 << 53) + 2]);
    // u8 sign / abs
    let u = Tensor::from_vec(vec![0u8, 3, 255], &[3])?;
    assert_eq!(u.sign()?.to_vec::<u8>()?, vec![0, 1, 1]);
    assert_eq!(u.abs()?.to_vec::<u8>()?, vec![0, 3, 255]);
    // bool: comparisons, logical ops on non-bool inputs (nonzero is true)
    let b = Tensor::from_vec(vec![false, true], &[2])?;
    assert_eq!(
        b.lt(&b.logical_not()?)?.to_vec::<bool>()?,
        vec![true, false]
    );
    let f = Tensor::from_vec(vec![0.0f32, 2.0, f32::NAN], &[3])?;
    assert_eq!(
        f.logical_and(1.0)?.to_vec::<bool>()?,
        vec![false, true, true]
    );
    assert_eq!(f.logical_not()?.to_vec::<bool>()?, vec![true, false, false]);
    Ok(())
}

#[test]
fn float_specials_nan_inf_negative_zero() -> Result<()> {
    let x = Tensor::from_vec(
        vec![-0.0f64, 0.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY],
        &[5],
    )?;
    // sign(±0) is +0 as in PyTorch ((0 < x) - (x < 0)); sign(±inf) = ±1
    let s = x.sign()?.to_vec::<f64>()?;
    assert_eq!(s[0].to_bits(), 0.0f64.to_bits(), "sign(-0.0) = {}", s[0]);
    assert_eq!(s[1].to_bits(), 0.0f64.to_bits());
    assert_eq!(&s[3..], &[1.0, -1.0]);
    assert!(x.abs()?.to_vec::<f64>()?[0].is_sign_positive());
    assert!(Tensor::from_vec(vec![0.0f64], &[1])?
        .neg()?
        .to_vec::<f64>()?[0]
        .is_sign_negative());
    assert_eq!(
        x.reciprocal()?.to_vec::<f64>()?[..2],
        [f64::NEG_INFINITY, f64::INFINITY]
    );
    // NaN propagates through maximum / minimum from either side, and through clamp
    let a = Tensor::from_vec(vec![f64::NAN, 1.0, 2.0], &[3])?;
    let b = Tensor::from_vec(vec![1.0, f64::NAN, 0.0], &[3])?;
    for t in [
        a.maximum(&b)?,
        a.minimum(&b)?,
        b.maximum(&a)?,
        b.minimum(&a)?,
    ] {
        let v = t.to_vec::<f64>()?;
        assert!(v[0].is_nan() && v[1].is_nan(), "{v:?}");
    }
    assert_eq!(a.maximum(&b)?.to_vec::<f64>()?[2], 2.0);
    assert!(a.clamp(Some(0.0), Some(1.0))?.to_vec::<f64>()?[0].is_nan());
    // relu(NaN) is NaN in PyTorch
    assert!(a.relu()?.to_vec::<f64>()?[0].is_nan());
    // sigmoid saturates cleanly
    let big = Tensor::from_vec(vec![-1000.0f32, 1000.0], &[2])?;
    assert_eq!(big.sigmoid()?.to_vec::<f32>()?, vec![0.0, 1.0]);
    assert_eq!(big.silu()?.to_vec::<f32>()?, vec![-0.0, 1000.0]);
    // comparisons with NaN are false except ne
    assert_eq!(a.eq(&a)?.to_vec::<bool>()?, vec![false, true, true]);
    assert_eq!(a.ne(&a)?.to_vec::<bool>()?, vec![true, false, false]);
    Ok(())
}

#[test]
fn casts_round_and_saturate_like_torch() -> Result<()> {
    let x = Tensor::from_vec(vec![-1.7f64, -0.2, 0.0, 0.6, 2.9], &[5])?;
    assert_eq!(
        x.to_dtype(DType::I64)?.to_vec::<i64>()?,
        vec![-1, 0, 0, 0, 2]
    );
    assert_eq!(
        x.to_dtype(DType::Bool)?.to_vec::<bool>()?,
        vec![true, true, false, true, true]
    );
    let big = Tensor::from_vec(vec![(1i64 << 60) + 1], &[1])?;
    assert_eq!(big.to_dtype(DType::I32)?.to_vec::<i32>()?, vec![1]);
    let h = x.to_dtype(DType::F16)?;
    assert_eq!(
        h.to_vec_f64()?,
        [-1.7f64, -0.2, 0.0, 0.6, 2.9]
            .iter()
            .map(|&v| round_to(v, DType::F16))
            .collect::<Vec<_>>()
    );
    Ok(())
}
