//! Backward of every differentiable op vs central finite differences in f64, on random shapes with
//! broadcasting and non-contiguous views; plus autograd API semantics (backward_with, accumulation,
//! no_grad, detach, leaves without requires_grad).

mod common;

use common::*;
use kiln_core::{no_grad, DType, Reduction, Result, Tensor};
use proptest::prelude::*;

type Op1 = (&'static str, fn(&Tensor) -> Result<Tensor>, bool);

/// (name, op, needs inputs away from 0 and integers)
fn unary_ops() -> Vec<Op1> {
    vec![
        ("neg", |t| t.neg(), false),
        ("abs", |t| t.abs(), true),
        ("exp", |t| t.exp(), false),
        ("log", |t| t.abs()?.add(0.5)?.log(), false),
        ("log1p", |t| t.abs()?.log1p(), true),
        ("sqrt", |t| t.abs()?.add(0.3)?.sqrt(), false),
        ("rsqrt", |t| t.abs()?.add(0.3)?.rsqrt(), false),
        ("sin", |t| t.sin(), false),
        ("cos", |t| t.cos(), false),
        ("tanh", |t| t.tanh(), false),
        ("sigmoid", |t| t.sigmoid(), false),
        ("relu", |t| t.relu(), true),
        ("leaky_relu", |t| t.leaky_relu(0.1), true),
        ("gelu", |t| t.gelu(), false),
        ("gelu_tanh", |t| t.gelu_tanh(), false),
        ("silu", |t| t.silu(), false),
        ("erf", |t| t.erf(), false),
        ("reciprocal", |t| t.abs()?.add(0.5)?.reciprocal(), true),
        ("square", |t| t.square(), false),
        ("clamp", |t| t.clamp(Some(-0.5), Some(0.7)), true),
        ("floor*x", |t| t.floor()?.add(t), true),
        ("sign*x", |t| t.sign()?.mul(t), true),
        ("softmax", |t| t.softmax(-1), false),
        ("log_softmax", |t| t.log_softmax(0), false),
        ("logsumexp", |t| t.logsumexp(&[-1], false), false),
        ("sum", |t| t.sum(&[0], true), false),
        ("mean", |t| t.mean(&[-1], false), false),
        ("prod", |t| t.prod(&[-1], false), false),
        ("max", |t| t.max(&[0], false), false),
        ("min", |t| t.min(&[-1], true), false),
        (
            "var",
            |t| Tensor::cat(&[t, &t.mul(0.5)?], -1)?.var(&[-1], 1, false),
            false,
        ),
        // two distinct values per slice: std = 0 has an undefined derivative
        (
            "std",
            |t| Tensor::cat(&[t, &t.add(1.0)?], 0)?.std(&[0], 0, true),
            false,
        ),
        ("pow_scalar", |t| t.pow(3.0), false),
        (
            "scalar_pow",
            |t| Tensor::full(t.shape(), 1.7, DType::F64)?.pow(t),
            false,
        ),
        (
            "flip_views",
            |t| t.t()?.contiguous()?.flatten(0, -1)?.unsqueeze(0)?.squeeze(),
            false,
        ),
        (
            "narrow_select",
            |t| t.narrow(-1, 0, 1)?.select(0, -1),
            false,
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn unary_and_reduction_grads(shape in shape_nz(2, 2, 3), kind in prop::sample::select(vec![Kind::Contiguous, Kind::Permuted, Kind::Strided]), seed: u64) {
        let mut rng = TRng::new(seed);
        let plan = ViewPlan::new(&shape, kind, &mut rng);
        for (name, op, away) in unary_ops() {
            // away from kinks (0, clamp bounds, integers) so finite differences are valid
            let vals = rng.vec(numel(&plan.base_shape), |r| if away { let v = r.away_from_zero(0.1, 1.9); if (v.fract().abs() < 0.05) || (v - 0.7).abs() < 0.05 || (v + 0.5).abs() < 0.05 { v + 0.13 } else { v } } else { r.uniform(-1.5, 1.5) });
            check_grad(&[(vals, plan.base_shape.clone())], |x| op(&plan.apply(&x[0])?), &mut rng, &format!("{name} {shape:?} {kind:?}"));
        }
    }

    #[test]
    fn binary_grads_with_broadcasting(a_shape in shape_nz(1, 3, 3), seed: u64) {
        let mut rng = TRng::new(seed);
        let b_shape = broadcast_partner(&a_shape, &mut rng);
        let (a_shape, b_shape) = if rng.unit() < 0.5 { (a_shape, b_shape) } else { (b_shape, a_shape) };
        type Op2 = (&'static str, fn(&Tensor, &Tensor) -> Result<Tensor>);
        let ops: [Op2; 8] = [
            ("add", |a, b| a.add(b)),
            ("sub", |a, b| a.sub(b)),
            ("mul", |a, b| a.mul(b)),
            ("div", |a, b| a.div(b)),
            ("pow", |a, b| a.abs()?.add(0.2)?.pow(b)),
            ("maximum", |a, b| a.maximum(b)),
            ("minimum", |a, b| a.minimum(b)),
            ("where", |a, b| Tensor::where_(&a.gt(0.0)?, a, &b.mul(2.0)?)),
        ];
        for (name, op) in ops {
            let a = (rng.vec(numel(&a_shape), |r| r.away_from_zero(0.3, 1.5)), a_shape.clone());
            let b = (rng.vec(numel(&b_shape), |r| r.away_from_zero(0.3, 1.5)), b_shape.clone());
            check_grad(&[a, b], |x| op(&x[0], &x[1]), &mut rng, &format!("{name} {a_shape:?} {b_shape:?}"));
        }
        // an expanded (stride-0) operand accumulates its gradient over the broadcast dim
        let a = gvals(&[a_shape.len().max(1)], &mut rng);
        let n = a.0.len();
        check_grad(&[a], |x| x[0].reshape([n, 1])?.expand([n, 3])?.mul(&x[0].reshape([n, 1])?), &mut rng, "expand");
    }

    #[test]
    fn matmul_linear_conv_pool_grads(m in 1usize..4, k in 1usize..4, n in 1usize..4, batch in 1usize..3, seed: u64) {
        let mut rng = TRng::new(seed);
        check_grad(&[gvals(&[batch, m, k], &mut rng), gvals(&[k, n], &mut rng)], |x| x[0].matmul(&x[1]), &mut rng, "matmul bcast");
        check_grad(&[gvals(&[k, m], &mut rng), gvals(&[batch, 1, n, k], &mut rng)], |x| x[0].t()?.matmul(&x[1].transpose(-1, -2)?), &mut rng, "matmul transposed views");
        check_grad(&[gvals(&[k], &mut rng), gvals(&[k], &mut rng)], |x| x[0].matmul(&x[1]), &mut rng, "dot");
        check_grad(&[gvals(&[batch, k], &mut rng), gvals(&[n, k], &mut rng), gvals(&[n], &mut rng)], |x| x[0].linear(&x[1], Some(&x[2])), &mut rng, "linear");
        let (g, s, p, d) = (1 + rng.below(2), 1 + rng.below(2), rng.below(2), 1 + rng.below(2));
        let (c, o) = (g * (1 + rng.below(2)), g * (1 + rng.below(2)));
        let (h, w) = (3 + rng.below(3), 3 + rng.below(2));
        // along the width too: the column matrix's rows are runs of the input row (`cpu/conv.rs`)
        let (sw, pw, dw) = (1 + rng.below(2), rng.below(2), 1 + rng.below(2));
        check_grad(&[gvals(&[batch, c, h, w], &mut rng), gvals(&[o, c / g, 2, 2], &mut rng), gvals(&[o], &mut rng)],
            |x| x[0].conv2d(&x[1], Some(&x[2]), [s, sw], [p, pw], [d, dw], g), &mut rng, &format!("conv2d g{g} s{s},{sw} p{p},{pw} d{d},{dw}"));
        // a 1x1 kernel at stride 1 without padding reads the image as its column matrix
        check_grad(&[gvals(&[batch, c, h, w], &mut rng), gvals(&[o, c / g, 1, 1], &mut rng)],
            |x| x[0].conv2d(&x[1], None, [1, 1], [0, 0], [1, 1], g), &mut rng, &format!("conv2d 1x1 g{g}"));
        check_grad(&[gvals(&[batch, c, h, w], &mut rng)], |x| x[0].permute(&[0, 1, 3, 2])?.max_pool2d([2, 2], [1, 2], [1, 0]), &mut rng, "max_pool2d");
        check_grad(&[gvals(&[batch, c, h, w], &mut rng)], |x| x[0].avg_pool2d([3, 2], [2, 1], [1, 1], false), &mut rng, "avg_pool2d");
        check_grad(&[gvals(&[batch, c, h, w], &mut rng)], |x| x[0].adaptive_avg_pool2d([2, 3]), &mut rng, "adaptive_avg_pool2d");
    }

    #[test]
    fn norm_index_movement_loss_grads(n in 2usize..4, c in 1usize..4, seed: u64) {
        let mut rng = TRng::new(seed);
        check_grad(&[gvals(&[n, c, 2], &mut rng), gvals(&[c], &mut rng), gvals(&[c], &mut rng)],
            |x| x[0].batch_norm(Some(&x[1]), Some(&x[2]), None, true, 1e-5), &mut rng, "batch_norm");
        check_grad(&[gvals(&[n, c, 3], &mut rng), gvals(&[c, 3], &mut rng), gvals(&[3], &mut rng)],
            |x| x[0].layer_norm(&[c, 3], Some(&x[1]), Some(&x[2]), 1e-5), &mut rng, "layer_norm");
        let idx = from_f64s(&rng.vec(n * 2, |r| r.below(c) as f64), &[n, 2], DType::I64);
        check_grad(&[gvals(&[n, c], &mut rng)], |x| x[0].gather(1, &idx), &mut rng, "gather");
        check_grad(&[gvals(&[n, c], &mut rng), gvals(&[n, 2], &mut rng)], |x| x[0].scatter_add(1, &idx, &x[1]), &mut rng, "scatter_add");
        let sel = from_f64s(&rng.vec(5, |r| r.below(n) as f64), &[5], DType::I64);
        check_grad(&[gvals(&[n, c], &mut rng)], |x| x[0].index_select(0, &sel), &mut rng, "index_select");
        check_grad(&[gvals(&[n, c], &mut rng)], |x| x[0].embedding(&sel.reshape([1, 5])?), &mut rng, "embedding");
        check_grad(&[gvals(&[n, c], &mut rng), gvals(&[1, c], &mut rng)], |x| Tensor::cat(&[&x[0], &x[1]], 0), &mut rng, "cat");
        check_grad(&[gvals(&[n, c], &mut rng), gvals(&[n, c], &mut rng)], |x| Tensor::stack(&[&x[0], &x[1]], 1), &mut rng, "stack");
        check_grad(&[gvals(&[n, c + 2], &mut rng)], |x| { let p = x[0].split(2, 1)?; p[0].mul(&p[p.len() - 1].sum(&[1], true)?) }, &mut rng, "split");
        check_grad(&[gvals(&[n, c + 3], &mut rng)], |x| x[0].slice(1, 1, 100, 2)?.mul(&x[0].slice(1, 0, 1, 3)?), &mut rng, "slice step");
        check_grad(&[gvals(&[n, c], &mut rng)], |x| x[0].pad(&[1, 2, 0, 1], 3.0)?.square(), &mut rng, "pad");
        check_grad(&[gvals(&[n, c], &mut rng)], |x| x[0].reshape([c, n])?.permute(&[1, 0])?.expand([2, n, c]), &mut rng, "reshape/permute/expand");
        let t = from_f64s(&rng.vec(n, |r| r.below(c + 1) as f64), &[n], DType::I64);
        let c1 = c + 1;
        check_grad(&[gvals(&[n, c1], &mut rng)], |x| x[0].cross_entropy(&t, Some(0), 0.2, Reduction::Mean), &mut rng, "cross_entropy");
        check_grad(&[gvals(&[n, c1], &mut rng)], |x| x[0].log_softmax(1)?.nll_loss(&t, None, Reduction::Sum), &mut rng, "nll_loss");
        check_grad(&[gvals(&[n, c], &mut rng), gvals(&[n, c], &mut rng)], |x| x[0].mse_loss(&x[1], Reduction::Mean), &mut rng, "mse_loss");
        let y = from_f64s(&rng.vec(n * c, |r| r.unit()), &[n, c], DType::F64);
        check_grad(&[gvals(&[n, c], &mut rng)], |x| x[0].binary_cross_entropy_with_logits(&y, Reduction::Sum), &mut rng, "bce_with_logits");
    }
}

#[test]
fn bce_with_logits_grad_at_zero_is_sigmoid_minus_target() -> Result<()> {
    // zero logits are common (zero-initialized heads); d/dx = sigmoid(0) - y = 0.5 - y
    let x = Tensor::zeros(&[3], DType::F64)?.with_grad()?;
    let y = Tensor::from_vec(vec![0.0f64, 0.25, 1.0], &[3])?;
    x.binary_cross_entropy_with_logits(&y, Reduction::Sum)?
        .backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![0.5, 0.25, -0.5]);
    Ok(())
}

#[test]
fn special_point_grads_match_torch() -> Result<()> {
    // relu'(0) = 0, abs'(0) = 0, maximum ties split the gradient, pow(0, 0)' = 0 (no NaN)
    let x = Tensor::from_vec(vec![0.0f64, -1.0, 2.0], &[3])?.with_grad()?;
    x.relu()?.add(&x.abs()?)?.sum_all()?.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![0.0, -1.0, 2.0]);
    let a = Tensor::from_vec(vec![1.0f64, 2.0], &[2])?.with_grad()?;
    let b = Tensor::from_vec(vec![1.0f64, 3.0], &[2])?.with_grad()?;
    a.maximum(&b)?.sum_all()?.backward()?;
    assert_eq!(a.grad().unwrap().to_vec::<f64>()?, vec![0.5, 0.0]);
    assert_eq!(b.grad().unwrap().to_vec::<f64>()?, vec![0.5, 1.0]);
    let z = Tensor::from_vec(vec![0.0f64, 0.0, 2.0], &[3])?.with_grad()?;
    let e = Tensor::from_vec(vec![0.0f64, 2.0, 0.0], &[3])?.with_grad()?;
    z.pow(&e)?.sum_all()?.backward()?;
    assert_eq!(z.grad().unwrap().to_vec::<f64>()?, vec![0.0, 0.0, 0.0]);
    assert_eq!(
        e.grad().unwrap().to_vec::<f64>()?,
        vec![0.0, 0.0, 2f64.ln()]
    );
    // prod with one zero: the gradient at the zero is the product of the others
    let p = Tensor::from_vec(vec![2.0f64, 0.0, 3.0], &[3])?.with_grad()?;
    p.prod(&[], false)?.backward()?;
    assert_eq!(p.grad().unwrap().to_vec::<f64>()?, vec![0.0, 6.0, 0.0]);
    Ok(())
}

#[test]
fn autograd_api_semantics() -> Result<()> {
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], &[3])?.with_grad()?;
    let w = Tensor::from_vec(vec![0.5f64, -1.0, 2.0], &[3])?; // requires_grad = false
                                                              // backward_with a given gradient
    let y = x.mul(&w)?.mul(&x)?; // w x^2
    y.backward_with(&Tensor::from_vec(vec![1.0f64, 10.0, 100.0], &[3])?)?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![1.0, -40.0, 1200.0]);
    assert!(
        w.grad().is_none(),
        "a leaf without requires_grad gets no grad"
    );
    // a second backward accumulates
    x.mul(&w)?.mul(&x)?.sum_all()?.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![2.0, -44.0, 1212.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    // a tensor used twice accumulates both paths
    x.mul(&x)?.add(&x)?.sum_all()?.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![3.0, 5.0, 7.0]);
    // no_grad records nothing
    let z = no_grad(|| x.mul(2.0))?;
    assert!(!z.requires_grad() && z.is_leaf());
    assert!(z.sum_all()?.backward().is_err());
    // detach cuts the graph but shares the data
    x.zero_grad();
    let d = x.detach();
    assert!(!d.requires_grad() && d.shares_storage(&x));
    x.mul(&d)?.sum_all()?.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![1.0, 2.0, 3.0]);
    // backward on a leaf seeds its own grad; ints cannot require grad
    let leaf = Tensor::scalar(2.0f64).with_grad()?;
    leaf.backward()?;
    assert_eq!(leaf.grad().unwrap().to_vec::<f64>()?, vec![1.0]);
    assert!(Tensor::from_vec(vec![1i64], &[1])?.with_grad().is_err());
    // gradients flow through a f32 -> f64 cast back in the leaf's dtype
    let f = Tensor::from_vec(vec![1.5f32, -2.0], &[2])?.with_grad()?;
    f.to_dtype(DType::F64)?.square()?.sum_all()?.backward()?;
    let g = f.grad().unwrap();
    assert_eq!(g.dtype(), DType::F32);
    assert_eq!(g.to_vec::<f32>()?, vec![3.0, -4.0]);
    Ok(())
}
