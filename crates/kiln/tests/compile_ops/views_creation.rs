//! Views and movement ops, creation and random ops inside a compiled function, half precision, inputs without grad and detach.

use crate::*;

type View = fn(&Tensor) -> Result<Tensor>;

#[test]
fn views_and_movement() {
    let mut rng = Rng::new(21);
    let ops: Vec<(&str, &[usize], View)> = vec![
        ("reshape [6, 4]", &[2, 3, 4], |x| x.reshape([6, 4])),
        ("reshape [-1]", &[2, 3, 4], |x| x.reshape([-1isize])),
        ("reshape [4, -1, 3]", &[2, 3, 4], |x| x.reshape([4, -1, 3])),
        ("reshape same", &[2, 3], |x| x.reshape([2, 3])),
        ("view", &[2, 3, 4], |x| x.contiguous()?.view([3, 8])),
        ("permute", &[2, 3, 4], |x| x.permute(&[2, 0, 1])),
        ("permute neg", &[2, 3, 4], |x| x.permute(&[-1, 0, 1])),
        ("transpose", &[2, 3, 4], |x| x.transpose(0, 2)),
        ("t", &[3, 4], |x| x.t()),
        ("expand", &[3, 1], |x| x.expand([2, 3, 5])),
        ("expand -1", &[3, 1], |x| x.expand([-1, 4])),
        ("broadcast_to", &[1, 4], |x| x.broadcast_to(&[2, 3, 4])),
        ("expand_as", &[4], |x| {
            x.expand_as(&Tensor::zeros(&[3, 4], DType::F32)?)
        }),
        ("narrow", &[3, 5], |x| x.narrow(1, 1, 3)),
        ("narrow 0", &[3, 5], |x| x.narrow(0, 2, 0)),
        ("slice step", &[7, 3], |x| x.slice(0, -6, 100, 2)),
        ("slice empty", &[7, 3], |x| x.slice(0, 5, 2, 1)),
        ("select", &[3, 5], |x| x.select(1, -1)),
        ("squeeze", &[3, 1, 4, 1], |x| x.squeeze()),
        ("squeeze_dim", &[3, 1, 4], |x| x.squeeze_dim(1)),
        ("squeeze_dim not 1", &[3, 2], |x| x.squeeze_dim(1)),
        ("unsqueeze 0", &[3, 4], |x| x.unsqueeze(0)),
        ("unsqueeze -1", &[3, 4], |x| x.unsqueeze(-1)),
        ("contiguous", &[3, 4], |x| x.contiguous()),
        ("flatten", &[2, 3, 4], |x| x.flatten(1, -1)),
        ("flatten 0..1", &[2, 3, 4], |x| x.flatten(0, 1)),
        ("flatten scalar", &[], |x| x.flatten(0, -1)),
        ("reshape size 0", &[0, 6], |x| x.reshape([3, 0, 2])),
        ("permute size 0", &[2, 0, 3], |x| x.permute(&[2, 1, 0])),
        ("chain", &[2, 3, 4], |x| {
            x.transpose(0, 1)?
                .narrow(2, 1, 2)?
                .unsqueeze(1)?
                .expand([3, 5, 2, 2])?
                .reshape([15, 4])
        }),
    ];
    for (name, shape, op) in ops {
        let mut lays = vec![Lay::C];
        if shape.len() >= 2 {
            lays.push(Lay::T);
        }
        if !shape.is_empty() {
            lays.extend([Lay::S, Lay::E]);
        }
        for lay in lays {
            // `view` needs a contiguous input: the case makes one first
            Case::new(format!("{name} {shape:?} {lay:?}"))
                .fwd_tol(libm_tol(name))
                .grad_tol(libm_tol(name))
                .run(
                    &mut rng,
                    move |a| one(op(&a[0])),
                    move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
                );
            // a view as output and further math on it (outputs that alias each other)
            Case::new(format!("{name} {shape:?} {lay:?} then exp")).run(
                &mut rng,
                move |a| {
                    let v = op(&a[0])?;
                    Ok(vec![v.exp()?, v])
                },
                move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
            );
        }
    }
}

#[test]
fn creation_ops_inside_the_compiled_fn() {
    let mut rng = Rng::new(23);
    type Make = fn(&Tensor) -> Result<Tensor>;
    let ops: Vec<(&str, Make)> = vec![
        ("full", |x| {
            x.add(&Tensor::full_on(&[3, 4], 0.5, DType::F32, x.device())?)
        }),
        ("zeros", |x| {
            x.mul(&Tensor::zeros_on(&[4], DType::F64, x.device())?)
        }),
        ("ones", |x| {
            x.sub(&Tensor::ones_on(&[3, 1], DType::F32, x.device())?)
        }),
        ("zeros_like", |x| x.add(&Tensor::zeros_like(x)?)),
        ("ones_like", |x| x.mul(&Tensor::ones_like(x)?)),
        ("full_like", |x| x.mul(&Tensor::full_like(x, -2.0)?)),
        ("arange f32", |x| {
            x.mul(&Tensor::arange_on(0.0, 12.0, 1.0, DType::F32, x.device())?.reshape([3, 4])?)
        }),
        ("arange i64", |x| {
            x.add(&Tensor::arange_on(-3.0, 5.0, 2.0, DType::I64, x.device())?)
        }),
        ("linspace", |x| {
            x.add(&Tensor::linspace_on(-1.0, 1.0, 4, DType::F32, x.device())?)
        }),
        ("full, no input dependence", |_| {
            Tensor::full(&[2, 2], 3.0, DType::F32)?.exp()
        }),
    ];
    for (name, op) in ops {
        Case::new(name).run(
            &mut rng,
            move |a| one(op(&a[0])),
            |r| vec![r.arg(Gen::Normal, &[3, 4], Lay::T, true)],
        );
    }
    let random: Vec<(&str, Make)> = vec![
        ("rand", |x| {
            x.add(&Tensor::rand_on(x.shape(), DType::F32, x.device())?)
        }),
        ("randn", |x| {
            x.mul(&Tensor::randn_on(&[4], DType::F64, x.device())?)
        }),
        ("uniform", |x| {
            x.mul(&Tensor::uniform_on(
                x.shape(),
                -2.0,
                3.0,
                DType::F32,
                x.device(),
            )?)
        }),
        ("rand f16", |x| {
            x.add(&Tensor::rand_on(x.shape(), DType::F16, x.device())?)
        }),
    ];
    for (name, op) in random {
        Case::new(name).seeded(555).calls(3).run(
            &mut rng,
            move |a| one(op(&a[0])),
            |r| vec![r.arg(Gen::Normal, &[3, 4], Lay::C, true)],
        );
    }
}

#[test]
fn random_from_an_explicit_generator() {
    use kiln::Generator;
    use std::sync::Mutex;
    let mut rng = Rng::new(32);
    type Draw = fn(&Tensor, &mut Generator) -> Result<Tensor>;
    let draws: Vec<(&str, Draw)> = vec![
        ("rand_with", |x, g| {
            x.add(&Tensor::rand_with(x.shape(), DType::F32, g)?.to_device(x.device())?)
        }),
        ("randn_with", |x, g| {
            x.mul(&Tensor::randn_with(x.shape(), DType::F32, g)?.to_device(x.device())?)
        }),
    ];
    for (name, draw) in draws {
        // the default generator is reseeded identically for both runs, so only the explicit
        // generator can make them differ
        Case::new(name).seeded(9).calls(3).retraced().run_stateful(
            &mut rng,
            || Mutex::new(Generator::new(42)),
            move |g: &Mutex<Generator>, a: &[Tensor]| one(draw(&a[0], &mut g.lock().unwrap())),
            |_| vec![],
            |r| vec![r.arg(Gen::Normal, &[3, 4], Lay::C, true)],
        );
    }
}

#[test]
fn half_precision_compositions() {
    let mut rng = Rng::new(24);
    for dt in [DType::F16, DType::BF16] {
        Case::new(format!("{dt:?} mlp")).run(
            &mut rng,
            |a| {
                let h = a[0].matmul(&a[1])?.add(&a[2])?.gelu()?;
                Ok(vec![h.softmax(-1)?, h.layer_norm(&[3], None, None, 1e-5)?])
            },
            move |r| {
                vec![
                    In::grad(r.randn(&[4, 5]).to_dtype(dt).unwrap()),
                    In::grad(r.randn(&[5, 3]).to_dtype(dt).unwrap()),
                    In::grad(r.randn(&[3]).to_dtype(dt).unwrap()),
                ]
            },
        );
        Case::new(format!("{dt:?} conv + pool + sum")).run(
            &mut rng,
            |a| {
                let y = a[0].conv2d(&a[1], None, [1, 1], [1, 1], [1, 1], 1)?;
                Ok(vec![y
                    .max_pool2d([2, 2], [2, 2], [0, 0])?
                    .sum(&[1], false)?])
            },
            move |r| {
                vec![
                    In::grad(r.randn(&[1, 2, 4, 4]).to_dtype(dt).unwrap()),
                    In::grad(r.randn(&[3, 2, 3, 3]).to_dtype(dt).unwrap()),
                ]
            },
        );
    }
}

#[test]
fn inputs_without_grad_and_detach() {
    let mut rng = Rng::new(25);
    // only some inputs require grad; a detached branch contributes no gradient
    Case::new("mixed requires_grad").run(
        &mut rng,
        |a| {
            let y = a[0].mul(&a[1])?.add(&a[0].sin()?.detach().exp()?)?;
            Ok(vec![y.sum(&[0], false)?])
        },
        |r| {
            vec![
                r.arg(Gen::Normal, &[3, 4], Lay::T, true),
                r.arg(Gen::Normal, &[3, 4], Lay::C, false),
            ]
        },
    );
    Case::new("no input requires grad").run(
        &mut rng,
        |a| one(a[0].matmul(&a[1])?.softmax(0)),
        |r| {
            vec![
                r.arg(Gen::Normal, &[3, 4], Lay::C, false),
                r.arg(Gen::Normal, &[4, 2], Lay::T, false),
            ]
        },
    );
    Case::new("an input returned as is, and a constant").run(
        &mut rng,
        |a| {
            Ok(vec![
                a[0].clone(),
                a[1].exp()?,
                Tensor::ones(&[2], DType::F32)?,
            ])
        },
        |r| {
            vec![
                r.arg(Gen::Normal, &[3], Lay::C, true),
                r.arg(Gen::Normal, &[2, 2], Lay::C, true),
            ]
        },
    );
    Case::new("no_grad inside").run(
        &mut rng,
        |a| {
            let s = no_grad(|| a[0].sum(&[1], true))?;
            Ok(vec![a[0].sub(&s)?])
        },
        |r| vec![r.arg(Gen::Normal, &[3, 4], Lay::C, true)],
    );
}
