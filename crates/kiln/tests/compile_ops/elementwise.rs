//! Elementwise ops compiled vs eager: unary, binary and comparisons (broadcasting, scalars, mixed dtypes), where, clamp, casts.

use crate::*;

type Unary = fn(&Tensor) -> Result<Tensor>;

fn unary_ops() -> Vec<(&'static str, Unary, Gen)> {
    vec![
        ("neg", Tensor::neg, Gen::Normal),
        ("abs", Tensor::abs, Gen::Ties),
        ("exp", Tensor::exp, Gen::Normal),
        ("log", Tensor::log, Gen::Positive),
        ("log1p", Tensor::log1p, Gen::Positive),
        ("sqrt", Tensor::sqrt, Gen::Positive),
        ("sin", Tensor::sin, Gen::Normal),
        ("cos", Tensor::cos, Gen::Normal),
        ("tanh", Tensor::tanh, Gen::Normal),
        ("erf", Tensor::erf, Gen::Normal),
        ("floor", Tensor::floor, Gen::Normal),
        ("sign", Tensor::sign, Gen::Ties),
        ("reciprocal", Tensor::reciprocal, Gen::Positive),
        ("rsqrt", Tensor::rsqrt, Gen::Positive),
        ("square", Tensor::square, Gen::Normal),
        ("logical_not", Tensor::logical_not, Gen::Ties),
        ("relu", Tensor::relu, Gen::Ties),
        ("sigmoid", Tensor::sigmoid, Gen::Normal),
        ("silu", Tensor::silu, Gen::Normal),
        ("gelu", Tensor::gelu, Gen::Normal),
        ("gelu_tanh", Tensor::gelu_tanh, Gen::Normal),
        ("leaky_relu", |x| x.leaky_relu(0.1), Gen::Ties),
    ]
}

#[test]
fn unary_and_activations() {
    let mut rng = Rng::new(1);
    for (name, op, g) in unary_ops() {
        for &(shape, lay) in ELEMENTWISE_SHAPES {
            Case::new(format!("{name} {shape:?} {lay:?}"))
                .fwd_tol(libm_tol(name))
                .grad_tol(libm_tol(name))
                .run(
                    &mut rng,
                    move |a| one(op(&a[0])),
                    move |r| vec![r.arg(g, shape, lay, true)],
                );
        }
    }
}

#[test]
fn unary_on_integer_and_half_inputs() {
    let mut rng = Rng::new(2);
    for (name, op, _) in unary_ops() {
        // integer inputs: float-only ops promote to float32
        Case::new(format!("{name} i64"))
            .fwd_tol(libm_tol(name))
            .grad_tol(libm_tol(name))
            .run(
                &mut rng,
                move |a| one(op(&a[0])),
                |r| vec![In::val(r.ints(&[3, 4], -3, 4))],
            );
        for dt in [DType::F16, DType::BF16, DType::F64] {
            Case::new(format!("{name} {dt:?}"))
                .fwd_tol(libm_tol(name))
                .grad_tol(libm_tol(name))
                .run(
                    &mut rng,
                    move |a| one(op(&a[0])),
                    move |r| {
                        let g = if ["log", "log1p", "sqrt", "reciprocal", "rsqrt"].contains(&name) {
                            r.positive(&[3, 4])
                        } else {
                            r.randn(&[3, 4])
                        };
                        vec![In::grad(g.to_dtype(dt).unwrap())]
                    },
                );
        }
    }
}

type Binary = fn(&Tensor, &Tensor) -> Result<Tensor>;

fn binary_ops() -> Vec<(&'static str, Binary)> {
    vec![
        ("add", |a, b| a.add(b)),
        ("sub", |a, b| a.sub(b)),
        ("mul", |a, b| a.mul(b)),
        ("div", |a, b| a.div(b)),
        ("pow", |a, b| a.pow(b)),
        ("maximum", |a, b| a.maximum(b)),
        ("minimum", |a, b| a.minimum(b)),
        ("eq", |a, b| a.eq(b)),
        ("ne", |a, b| a.ne(b)),
        ("lt", |a, b| a.lt(b)),
        ("le", |a, b| a.le(b)),
        ("gt", |a, b| a.gt(b)),
        ("ge", |a, b| a.ge(b)),
        ("logical_and", |a, b| a.logical_and(b)),
        ("logical_or", |a, b| a.logical_or(b)),
    ]
}

const BINARY_SHAPES: &[(&[usize], Lay, &[usize], Lay)] = &[
    (&[3, 4], Lay::C, &[3, 4], Lay::C),
    (&[2, 1, 4], Lay::C, &[3, 1], Lay::C),
    (&[], Lay::C, &[2, 3], Lay::C),
    (&[4], Lay::C, &[3, 1], Lay::T),
    (&[3, 4], Lay::T, &[3, 4], Lay::S),
    (&[5, 3], Lay::E, &[3], Lay::S),
    (&[0, 3], Lay::C, &[1, 3], Lay::C),
];

#[test]
fn binary_and_comparisons_with_broadcasting() {
    let mut rng = Rng::new(3);
    for (name, op) in binary_ops() {
        // pow: a positive base keeps d/db = a^b ln(a) finite; ties exercise maximum/minimum's split
        let (ga, gb) = match name {
            "pow" => (Gen::Positive, Gen::Normal),
            "div" => (Gen::Normal, Gen::Positive),
            _ => (Gen::Ties, Gen::Ties),
        };
        for &(sa, la, sb, lb) in BINARY_SHAPES {
            Case::new(format!("{name} {sa:?} {la:?} {sb:?} {lb:?}")).run(
                &mut rng,
                move |a| one(op(&a[0], &a[1])),
                move |r| vec![r.arg(ga, sa, la, true), r.arg(gb, sb, lb, true)],
            );
        }
    }
}

#[test]
fn binary_with_scalars_and_mixed_dtypes() {
    let mut rng = Rng::new(4);
    type ScalarOp = fn(&Tensor) -> Result<Tensor>;
    let scalar: Vec<(&str, ScalarOp)> = vec![
        ("add 2.5", |x| x.add(2.5)),
        ("sub 1", |x| x.sub(1i64)),
        ("mul -3", |x| x.mul(-3.0)),
        ("div 0.5", |x| x.div(0.5)),
        ("pow 2", |x| x.pow(2.0)),
        ("pow 0.5", |x| x.abs()?.pow(0.5)),
        ("maximum 0", |x| x.maximum(0.0)),
        ("minimum 0.5", |x| x.minimum(0.5)),
        ("eq 0.5", |x| x.eq(0.5)),
        ("ne 0", |x| x.ne(0.0)),
        ("lt 0", |x| x.lt(0.0)),
        ("le 0", |x| x.le(0.0)),
        ("gt 0.5", |x| x.gt(0.5)),
        ("ge -0.5", |x| x.ge(-0.5)),
        ("logical_and 1", |x| x.logical_and(1.0)),
        ("logical_or 0", |x| x.logical_or(0.0)),
    ];
    for (name, op) in scalar {
        for &(shape, lay) in &ELEMENTWISE_SHAPES[2..5] {
            Case::new(format!("{name} {shape:?} {lay:?}"))
                .fwd_tol(libm_tol(name))
                .grad_tol(libm_tol(name))
                .run(
                    &mut rng,
                    move |a| one(op(&a[0])),
                    move |r| vec![r.arg(Gen::Ties, shape, lay, true)],
                );
        }
    }
    for (name, op) in binary_ops() {
        // f32 with int64 (promotes to f32), f32 with f64 (to f64), int64 with int64 (div: true division)
        Case::new(format!("{name} f32 x i64")).run(
            &mut rng,
            move |a| one(op(&a[0], &a[1])),
            |r| vec![In::grad(r.ties(&[3, 4])), In::val(r.ints(&[4], -2, 3))],
        );
        Case::new(format!("{name} f32 x f64")).run(
            &mut rng,
            move |a| one(op(&a[0], &a[1])),
            |r| {
                vec![
                    In::grad(r.positive(&[2, 3])),
                    In::grad(r.ties(&[2, 1]).to_dtype(DType::F64).unwrap()),
                ]
            },
        );
        if name != "pow" {
            // (integer pow with negative exponents is an error in PyTorch)
            Case::new(format!("{name} i64 x i64")).run(
                &mut rng,
                move |a| one(op(&a[0], &a[1])),
                |r| {
                    vec![
                        In::val(r.ints(&[3, 4], -3, 4)),
                        In::val(r.ints(&[3, 4], 1, 4)),
                    ]
                },
            );
        }
        // PyTorch reads + * maximum minimum on bools as or/and; kiln's Binary prim rejects them
        let bool_ok = !matches!(name, "add" | "sub" | "mul" | "pow" | "maximum" | "minimum");
        let case = Case::new(format!("{name} bool x bool"));
        let case = if bool_ok { case } else { case.errs() };
        case.run(
            &mut rng,
            move |a| one(op(&a[0], &a[1])),
            |r| vec![In::val(r.bools(&[3, 4])), In::val(r.bools(&[4]))],
        );
    }
}

/// Integer sums, differences and products wrap on overflow, compiled (generated in unsigned
/// arithmetic) as eagerly; the values sit at the ends of each dtype's range.
#[test]
fn integer_arithmetic_wraps() {
    let mut rng = Rng::new(7);
    let ends: [i64; 6] = [i64::MAX, i64::MIN, -1, 3, i64::MAX / 2 + 7, -(1 << 40)];
    let sums_and_products = binary_ops()
        .into_iter()
        .filter(|(name, _)| matches!(*name, "add" | "sub" | "mul"));
    let mut ops = 0;
    for (name, op) in sums_and_products {
        ops += 1;
        Case::new(format!("{name} i64 at the range's ends")).run(
            &mut rng,
            move |a| one(op(&a[0], &a[1])),
            move |_| {
                let a = Tensor::from_vec(ends.to_vec(), &[2, 3]).unwrap();
                let b = Tensor::from_vec(vec![2i64, i64::MAX, 5, i64::MIN, 4, 1 << 30], &[2, 3]);
                vec![In::val(a), In::val(b.unwrap())]
            },
        );
        Case::new(format!("{name} i32 at the range's ends")).run(
            &mut rng,
            move |a| one(op(&a[0], &a[1])),
            |_| {
                let a = Tensor::from_vec(vec![i32::MAX, i32::MIN, -1, 1 << 20], &[4]).unwrap();
                let b = Tensor::from_vec(vec![1i32, -1, i32::MIN, 1 << 12], &[4]).unwrap();
                vec![In::val(a), In::val(b)]
            },
        );
    }
    assert_eq!(ops, 3, "add, sub and mul");
}

#[test]
fn where_and_clamp() {
    let mut rng = Rng::new(5);
    Case::new("where tensor/tensor broadcast").run(
        &mut rng,
        |a| one(Tensor::where_(&a[0], &a[1], &a[2])),
        |r| {
            vec![
                In::val(r.bools(&[3, 1])),
                r.arg(Gen::Normal, &[1, 4], Lay::C, true),
                r.arg(Gen::Normal, &[3, 4], Lay::T, true),
            ]
        },
    );
    Case::new("where scalar branch").run(
        &mut rng,
        |a| one(Tensor::where_(&a[0], 0.5, &a[1])),
        |r| {
            vec![
                In::val(r.bools(&[2, 3])),
                r.arg(Gen::Normal, &[2, 3], Lay::S, true),
            ]
        },
    );
    Case::new("where tensor branch, scalar").run(
        &mut rng,
        |a| one(Tensor::where_(&a[0].gt(0.0)?, &a[0], -1.0)),
        |r| vec![r.arg(Gen::Ties, &[4, 3], Lay::E, true)],
    );
    Case::new("where f32/f64 promotion, int cond").run(
        &mut rng,
        |a| one(Tensor::where_(&a[0], &a[1], &a[2])),
        |r| {
            vec![
                In::val(r.ints(&[5], 0, 2)),
                In::grad(r.randn(&[5])),
                In::grad(r.randn(&[1]).to_dtype(DType::F64).unwrap()),
            ]
        },
    );
    Case::new("where size 0").run(
        &mut rng,
        |a| one(Tensor::where_(&a[0], &a[1], &a[2])),
        |r| {
            vec![
                In::val(r.bools(&[0, 3])),
                In::grad(r.randn(&[3])),
                In::grad(r.randn(&[0, 1])),
            ]
        },
    );
    let bounds = [
        (Some(-0.5), Some(0.5)),
        (Some(0.0), None),
        (None, Some(1.0)),
        (Some(1.0), Some(-1.0)),
    ];
    for (lo, hi) in bounds {
        for &(shape, lay) in ELEMENTWISE_SHAPES {
            Case::new(format!("clamp {lo:?} {hi:?} {shape:?} {lay:?}")).run(
                &mut rng,
                move |a| one(a[0].clamp(lo, hi)),
                move |r| vec![r.arg(Gen::Ties, shape, lay, true)],
            );
        }
    }
    Case::new("clamp i64").run(
        &mut rng,
        |a| one(a[0].clamp(Some(-1.0), Some(2.0))),
        |r| vec![In::val(r.ints(&[6], -4, 5))],
    );
}

#[test]
fn to_dtype() {
    let mut rng = Rng::new(22);
    for from in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for to in DType::ALL {
            for lay in [Lay::C, Lay::T] {
                Case::new(format!("to_dtype {from:?} -> {to:?} {lay:?}")).run(
                    &mut rng,
                    move |a| one(a[0].to_dtype(to)?.to_dtype(DType::F64)?.mul(3.0)),
                    move |r| {
                        // ties: exact integers and halves survive every cast the same way
                        let x = r.arg(Gen::Ties, &[3, 4], lay, true);
                        let base = x.base.mul(3.0).unwrap().to_dtype(from).unwrap();
                        vec![In { base, ..x }]
                    },
                );
            }
        }
    }
    for from in [DType::I64, DType::I32, DType::U8, DType::Bool] {
        for to in DType::ALL {
            Case::new(format!("to_dtype {from:?} -> {to:?}")).run(
                &mut rng,
                move |a| one(a[0].to_dtype(to)),
                move |r| vec![In::val(r.ints(&[2, 5], 0, 3).to_dtype(from).unwrap())],
            );
        }
    }
    Case::new("to_dtype normal values f32 -> f16 -> f32").run(
        &mut rng,
        |a| one(a[0].to_dtype(DType::F16)?.exp()?.to_dtype(DType::F32)),
        |r| vec![r.arg(Gen::Normal, &[4, 3], Lay::T, true)],
    );
}
