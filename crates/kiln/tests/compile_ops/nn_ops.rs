//! Normalization (batch norm with running statistics, layer norm), embedding and indexing, cat/stack/split, pad, dropout and the losses, compiled vs eager.

use crate::*;

/// Running mean and variance, equal for the compiled and the eager run.
fn running_stats(c: usize) -> (Tensor, Tensor) {
    let mut r = Rng::new(99);
    (
        common::deep_copy(&r.randn(&[c])),
        common::deep_copy(&r.positive(&[c])),
    )
}

#[test]
fn batch_norm_train_and_eval() {
    let mut rng = Rng::new(13);
    let inputs: &[(&[usize], Lay)] = &[
        (&[4, 3], Lay::C),
        (&[5, 3], Lay::T),
        (&[2, 3, 4, 5], Lay::C),
        (&[2, 3, 2, 4], Lay::S),
        (&[3, 3, 2], Lay::E),
        (&[1, 3, 1, 2], Lay::C),
        // 16 channels and more: on the CPU each channel is a row of one kernel (statistics,
        // then normalization), which must sum in the eager order
        (&[3, 16, 5, 7], Lay::C),
        (&[2, 17, 3, 4], Lay::S),
        (&[4, 16, 9], Lay::T),
    ];
    for &(shape, lay) in inputs {
        let c = shape[1];
        for (training, affine, momentum) in [
            (true, true, 0.1),
            (true, false, 0.3),
            (false, true, 0.1),
            (false, false, 0.1),
        ] {
            Case::new(format!(
                "batch_norm {shape:?} {lay:?} training {training} affine {affine} (running stats)"
            ))
            .calls(3)
            .run_stateful(
                &mut rng,
                move || running_stats(c),
                move |(mean, var): &(Tensor, Tensor), a: &[Tensor]| {
                    let running = RunningStats {
                        mean,
                        var,
                        momentum,
                    };
                    one(a[0].batch_norm(a.get(1), a.get(2), Some(running), training, 1e-5))
                },
                |(mean, var)| vec![mean.clone(), var.clone()],
                move |r| {
                    let mut v = vec![r.arg(Gen::Normal, shape, lay, true)];
                    if affine {
                        v.push(r.arg(Gen::Normal, &[c], Lay::C, true));
                        v.push(r.arg(Gen::Normal, &[c], Lay::C, true));
                    }
                    v
                },
            );
        }
        Case::new(format!(
            "batch_norm {shape:?} {lay:?} training, no running stats"
        ))
        .run(
            &mut rng,
            |a| one(a[0].batch_norm(a.get(1), None, None, true, 1e-3)),
            move |r| {
                vec![
                    r.arg(Gen::Normal, shape, lay, true),
                    r.arg(Gen::Normal, &[c], Lay::C, true),
                ]
            },
        );
    }
}

#[test]
fn batch_norm_running_stats_passed_as_arguments() {
    let mut rng = Rng::new(30);
    for training in [true, false] {
        Case::new(format!(
            "batch_norm, running stats as arguments, training {training}"
        ))
        .run(
            &mut rng,
            move |a| {
                let running = RunningStats {
                    mean: &a[1],
                    var: &a[2],
                    momentum: 0.2,
                };
                one(a[0].batch_norm(None, None, Some(running), training, 1e-5))
            },
            |r| {
                vec![
                    r.arg(Gen::Normal, &[4, 3, 2], Lay::C, true),
                    In::val(r.randn(&[3])),
                    In::val(r.positive(&[3])),
                ]
            },
        );
    }
}

/// `nn::BatchNorm2d` behind a conv, through `kiln::compile`: outputs, parameter gradients, running
/// statistics and `num_batches_tracked` equal over training steps, then in eval mode.
#[test]
fn batch_norm_module_compiled() -> Result<()> {
    use kiln::nn::{BatchNorm2d, Conv2d, Conv2dConfig, ReLU, Sequential};
    let _lock = common::default_rng_lock();
    let make = || -> Result<Sequential> {
        manual_seed(5);
        let cfg = Conv2dConfig {
            padding: [1, 1],
            ..Conv2dConfig::default()
        };
        Ok(Sequential::new()
            .add(Conv2d::new(2, 3, [3, 3], cfg)?)
            .add(BatchNorm2d::new(3)?)
            .add(ReLU::new()))
    };
    let (eager, model) = (make()?, make()?);
    let compiled = kiln::compile(&model, common::compile_options())?;
    let mut rng = Rng::new(31);
    for step in 0..4 {
        if step == 3 {
            eager.eval();
            compiled.eval();
        }
        let x = rng.randn(&[2, 2, 5, 4]).transpose(2, 3)?;
        eager.zero_grad();
        model.zero_grad();
        let (yc, ye) = (compiled.forward(&x)?, eager.forward(&x)?);
        common::assert_same(&format!("step {step}: output"), &yc, &ye, 0.0);
        let w = rng.randn(ye.shape());
        yc.mul(&w)?.sum_all()?.backward()?;
        ye.mul(&w)?.sum_all()?.backward()?;
        for ((n, c), (_, e)) in model
            .named_parameters()
            .iter()
            .zip(&eager.named_parameters())
        {
            let what = format!("step {step}: grad of {n}");
            common::assert_same(&what, &c.grad().unwrap(), &e.grad().unwrap(), 0.0);
        }
        for ((n, c), (_, e)) in model.named_buffers().iter().zip(&eager.named_buffers()) {
            common::assert_same(&format!("step {step}: buffer {n}"), c, e, 0.0);
        }
    }
    let s = compiled.stats();
    // three training steps (one trace, two replays), then eval: a recompile
    assert_eq!(
        (s.traces, s.compiles, s.replays, s.graph_breaks),
        (2, 2, 2, 0),
        "{s:?}"
    );
    Ok(())
}

#[test]
fn layer_norm() {
    let mut rng = Rng::new(14);
    let cases: &[(&[usize], Lay, &[usize])] = &[
        (&[4, 6], Lay::C, &[6]),
        (&[4, 6], Lay::T, &[6]),
        (&[2, 3, 4], Lay::C, &[3, 4]),
        (&[2, 3, 4], Lay::S, &[4]),
        (&[3, 2, 5], Lay::E, &[2, 5]),
        (&[5, 1], Lay::C, &[1]),
        (&[0, 4], Lay::C, &[4]),
        // few rows of many features: on a GPU a block walks each row (`codegen/cuda_rows.rs`)
        (&[1, 9, 768], Lay::C, &[768]),
        (&[3, 300], Lay::T, &[300]),
    ];
    for &(shape, lay, norm) in cases {
        for (weight, bias) in [(true, true), (true, false), (false, false)] {
            Case::new(format!(
                "layer_norm {shape:?} {lay:?} over {norm:?} weight {weight} bias {bias}"
            ))
            .run(
                &mut rng,
                move |a| {
                    let w = weight.then(|| &a[1]);
                    let b = bias.then(|| &a[2]);
                    one(a[0].layer_norm(norm, w, b, 1e-5))
                },
                move |r| {
                    vec![
                        r.arg(Gen::Normal, shape, lay, true),
                        r.arg(Gen::Normal, norm, Lay::C, weight),
                        r.arg(Gen::Normal, norm, Lay::C, bias),
                    ]
                },
            );
        }
    }
}

#[test]
fn embedding_and_index_select() {
    let mut rng = Rng::new(15);
    let idx_shapes: &[&[usize]] = &[&[3, 5], &[7], &[], &[2, 0]];
    for &s in idx_shapes {
        for lay in [Lay::C, Lay::T] {
            // repeated indices: their gradients accumulate
            Case::new(format!("embedding weight {lay:?} indices {s:?}"))
                .atomic_sums()
                .run(
                    &mut rng,
                    |a| one(a[0].embedding(&a[1])),
                    move |r| {
                        vec![
                            r.arg(Gen::Normal, &[6, 4], lay, true),
                            In::val(r.ints(s, 0, 6)),
                        ]
                    },
                );
        }
    }
    let cases: &[(&[usize], Lay, isize, usize)] = &[
        (&[5, 3], Lay::C, 0, 7),
        (&[5, 3], Lay::T, 1, 4),
        (&[2, 4, 3], Lay::S, -2, 6),
        (&[4, 3], Lay::E, 0, 5),
        (&[4, 3], Lay::C, 1, 0),
        (&[0, 3], Lay::C, 1, 2),
    ];
    for &(shape, lay, dim, n) in cases {
        Case::new(format!("index_select {shape:?} {lay:?} dim {dim} n {n}"))
            .atomic_sums()
            .run(
                &mut rng,
                move |a| one(a[0].index_select(dim, &a[1])),
                move |r| {
                    let size = shape[dim.rem_euclid(shape.len() as isize) as usize] as i64;
                    vec![
                        r.arg(Gen::Normal, shape, lay, true),
                        In::val(r.ints(&[n], 0, size)),
                    ]
                },
            );
    }
    Case::new("index_select i32 index").atomic_sums().run(
        &mut rng,
        |a| one(a[0].index_select(0, &a[1].to_dtype(DType::I32)?)),
        |r| vec![In::grad(r.randn(&[4, 2])), In::val(r.ints(&[5], 0, 4))],
    );
}

#[test]
fn gather_and_scatter_add() {
    let mut rng = Rng::new(16);
    let cases: &[(&[usize], Lay, isize, &[usize])] = &[
        (&[3, 5], Lay::C, 1, &[3, 4]),
        (&[3, 5], Lay::T, 0, &[2, 5]),
        (&[3, 5], Lay::C, -1, &[2, 7]),
        (&[2, 3, 4], Lay::S, 2, &[2, 3, 2]),
        (&[4, 3], Lay::E, 0, &[6, 3]),
        (&[3, 5], Lay::C, 1, &[3, 0]),
    ];
    for &(shape, lay, dim, ishape) in cases {
        let d = dim.rem_euclid(shape.len() as isize) as usize;
        Case::new(format!(
            "gather {shape:?} {lay:?} dim {dim} index {ishape:?}"
        ))
        .atomic_sums()
        .run(
            &mut rng,
            move |a| one(a[0].gather(dim, &a[1])),
            move |r| {
                vec![
                    r.arg(Gen::Normal, shape, lay, true),
                    In::val(r.ints(ishape, 0, shape[d] as i64)),
                ]
            },
        );
        // scatter_add writes the index-shaped src into self along dim (src as large as index)
        Case::new(format!(
            "scatter_add {shape:?} {lay:?} dim {dim} index {ishape:?}"
        ))
        .atomic_sums()
        .run(
            &mut rng,
            move |a| one(a[0].scatter_add(dim, &a[1], &a[2])),
            move |r| {
                vec![
                    r.arg(Gen::Normal, shape, lay, true),
                    In::val(r.ints(ishape, 0, shape[d] as i64)),
                    r.arg(Gen::Normal, ishape, Lay::C, true),
                ]
            },
        );
    }
    Case::new("scatter_add into zeros, f64 src")
        .atomic_sums()
        .run(
            &mut rng,
            |a| {
                one(Tensor::zeros_on(&[4, 3], DType::F32, a[1].device())?
                    .scatter_add(0, &a[0], &a[1]))
            },
            |r| {
                vec![
                    In::val(r.ints(&[6, 3], 0, 4)),
                    In::grad(r.randn(&[6, 3]).to_dtype(DType::F64).unwrap()),
                ]
            },
        );
}

#[test]
fn cat_stack_split_chunk() {
    let mut rng = Rng::new(17);
    type Parts = &'static [(&'static [usize], Lay)];
    let cats: &[(Parts, isize)] = &[
        (&[(&[2, 3], Lay::C), (&[4, 3], Lay::C)], 0),
        (
            &[(&[2, 3], Lay::T), (&[2, 1], Lay::C), (&[2, 0], Lay::C)],
            -1,
        ),
        (&[(&[2, 3, 2], Lay::S), (&[2, 1, 2], Lay::E)], 1),
        (&[(&[0, 3], Lay::C), (&[0, 3], Lay::C)], 0),
        (&[(&[5], Lay::C)], 0),
    ];
    for &(parts, dim) in cats {
        Case::new(format!("cat {parts:?} dim {dim}")).run(
            &mut rng,
            move |a| one(Tensor::cat(&a.iter().collect::<Vec<_>>(), dim)),
            move |r| {
                parts
                    .iter()
                    .map(|&(s, l)| r.arg(Gen::Normal, s, l, true))
                    .collect()
            },
        );
    }
    Case::new("cat mixed dtypes").run(
        &mut rng,
        |a| one(Tensor::cat(&[&a[0], &a[1], &a[2]], 0)),
        |r| {
            vec![
                In::grad(r.randn(&[2, 3])),
                In::grad(r.randn(&[1, 3]).to_dtype(DType::F64).unwrap()),
                In::val(r.ints(&[2, 3], -5, 5)),
            ]
        },
    );
    for dim in [0isize, 1, 2, -1] {
        for lay in [Lay::C, Lay::T] {
            Case::new(format!("stack dim {dim} {lay:?}")).run(
                &mut rng,
                move |a| one(Tensor::stack(&[&a[0], &a[1], &a[2]], dim)),
                move |r| {
                    (0..3)
                        .map(|_| r.arg(Gen::Normal, &[2, 3], lay, true))
                        .collect()
                },
            );
        }
    }
    Case::new("stack size 0").run(
        &mut rng,
        |a| one(Tensor::stack(&[&a[0], &a[1]], 1)),
        |r| {
            (0..2)
                .map(|_| r.arg(Gen::Normal, &[0, 2], Lay::C, true))
                .collect()
        },
    );
    let splits: &[(&[usize], Lay, usize, isize)] = &[
        (&[7, 3], Lay::C, 3, 0),
        (&[3, 8], Lay::T, 4, 1),
        (&[2, 5], Lay::S, 2, -1),
        (&[4, 3], Lay::E, 1, 0),
        (&[3, 2], Lay::C, 5, 0),
    ];
    for &(shape, lay, size, dim) in splits {
        // only some pieces feed the loss: the others get no gradient
        Case::new(format!("split {shape:?} {lay:?} size {size} dim {dim}")).run(
            &mut rng,
            move |a| a[0].split(size, dim),
            move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
        );
        Case::new(format!("chunk {shape:?} {lay:?} chunks {size} dim {dim}")).run(
            &mut rng,
            move |a| a[0].chunk(size, dim),
            move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
        );
        Case::new(format!("split, first piece only {shape:?} {lay:?}")).run(
            &mut rng,
            move |a| Ok(vec![a[0].split(size, dim)?.remove(0).exp()?]),
            move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
        );
    }
}

#[test]
fn pad() {
    let mut rng = Rng::new(18);
    let cases: &[(&[usize], Lay, &[usize], f64)] = &[
        (&[2, 3], Lay::C, &[1, 2], 0.0),
        (&[2, 3], Lay::T, &[0, 1, 2, 0], -1.5),
        (&[2, 3, 4], Lay::C, &[1, 1, 1, 1, 1, 1], 2.0),
        (&[2, 3, 4], Lay::S, &[0, 0, 2, 1], f64::NEG_INFINITY),
        (&[3, 2], Lay::E, &[], 0.0),
        (&[0, 2], Lay::C, &[1, 1, 1, 0], 3.0),
        (&[4], Lay::C, &[0, 0], 0.0),
    ];
    for &(shape, lay, pads, value) in cases {
        Case::new(format!("pad {shape:?} {lay:?} {pads:?} value {value}")).run(
            &mut rng,
            move |a| one(a[0].pad(pads, value)),
            move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
        );
    }
    Case::new("pad i64").run(
        &mut rng,
        |a| one(a[0].pad(&[1, 1], 7.0)),
        |r| vec![In::val(r.ints(&[2, 2], 0, 3))],
    );
}

#[test]
fn dropout_same_seed_same_mask() {
    let mut rng = Rng::new(19);
    let cases: &[(&[usize], Lay, f64, bool)] = &[
        (&[4, 5], Lay::C, 0.3, true),
        (&[4, 5], Lay::T, 0.5, true),
        (&[3, 6], Lay::S, 0.9, true),
        (&[2, 3, 4], Lay::E, 0.5, true),
        (&[4, 5], Lay::C, 0.0, true),
        (&[4, 5], Lay::C, 1.0, true),
        (&[4, 5], Lay::C, 0.5, false),
        (&[0, 5], Lay::C, 0.5, true),
    ];
    for &(shape, lay, p, training) in cases {
        // three calls: the replays draw fresh masks, exactly as eager with the same seed
        Case::new(format!(
            "dropout {shape:?} {lay:?} p {p} training {training}"
        ))
        .seeded(1234)
        .calls(3)
        .run(
            &mut rng,
            move |a| one(a[0].dropout(p, training)),
            move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
        );
    }
    Case::new("two dropouts and a matmul")
        .seeded(77)
        .calls(3)
        .run(
            &mut rng,
            |a| {
                let h = a[0].dropout(0.2, true)?.matmul(&a[1])?.relu()?;
                Ok(vec![h.dropout(0.5, true)?, h])
            },
            |r| {
                vec![
                    r.arg(Gen::Normal, &[4, 6], Lay::C, true),
                    r.arg(Gen::Normal, &[6, 3], Lay::T, true),
                ]
            },
        );
}

#[test]
fn losses() {
    let mut rng = Rng::new(20);
    let reductions = [Reduction::Mean, Reduction::Sum, Reduction::None];
    // (logits shape, layout, classes, ignore_index, label smoothing)
    let ce: &[(&[usize], Lay, Option<i64>, f64)] = &[
        (&[6, 5], Lay::C, None, 0.0),
        (&[6, 5], Lay::T, None, 0.1),
        (&[6, 5], Lay::C, Some(2), 0.0),
        (&[6, 5], Lay::S, Some(-100), 0.2),
        (&[2, 5, 3, 3], Lay::C, None, 0.0),
        (&[2, 5, 3, 3], Lay::C, Some(-100), 0.1),
        (&[3, 4, 2], Lay::E, Some(1), 1.0),
        (&[1, 3], Lay::C, None, 0.0),
        (&[0, 3], Lay::C, None, 0.0),
    ];
    let targets = |r: &mut Rng, logits: &[usize], ignore: Option<i64>| -> Tensor {
        let mut shape = logits.to_vec();
        let c = shape.remove(1) as i64;
        let t = r.ints(&shape, 0, c);
        if ignore == Some(-100) {
            // about a quarter of the targets ignored
            let m = r.ints(&shape, 0, 4).eq(0i64).unwrap();
            Tensor::where_(&m, -100i64, &t).unwrap()
        } else {
            t
        }
    };
    for &(shape, lay, ignore, smoothing) in ce {
        for red in reductions {
            Case::new(format!(
                "cross_entropy {shape:?} {lay:?} ignore {ignore:?} smoothing {smoothing} {red:?}"
            ))
            .run(
                &mut rng,
                move |a| one(a[0].cross_entropy(&a[1], ignore, smoothing, red)),
                move |r| {
                    vec![
                        r.arg(Gen::Normal, shape, lay, true),
                        In::val(targets(r, shape, ignore)),
                    ]
                },
            );
            Case::new(format!(
                "nll_loss {shape:?} {lay:?} ignore {ignore:?} {red:?}"
            ))
            .run(
                &mut rng,
                move |a| one(a[0].log_softmax(1)?.nll_loss(&a[1], ignore, red)),
                move |r| {
                    vec![
                        r.arg(Gen::Normal, shape, lay, true),
                        In::val(targets(r, shape, ignore)),
                    ]
                },
            );
        }
    }
    Case::new("nll_loss on raw inputs, i32 targets").run(
        &mut rng,
        |a| one(a[0].nll_loss(&a[1].to_dtype(DType::I32)?, None, Reduction::Mean)),
        |r| vec![In::grad(r.randn(&[4, 3])), In::val(r.ints(&[4], 0, 3))],
    );
    let pairs: &[(&[usize], Lay, Lay)] = &[
        (&[3, 4], Lay::C, Lay::C),
        (&[3, 4], Lay::T, Lay::S),
        (&[2, 3, 2], Lay::E, Lay::C),
        (&[], Lay::C, Lay::C),
        (&[0, 3], Lay::C, Lay::C),
    ];
    for &(shape, lx, ly) in pairs {
        for red in reductions {
            Case::new(format!("mse_loss {shape:?} {lx:?} {ly:?} {red:?}")).run(
                &mut rng,
                move |a| one(a[0].mse_loss(&a[1], red)),
                move |r| {
                    vec![
                        r.arg(Gen::Normal, shape, lx, true),
                        r.arg(Gen::Normal, shape, ly, true),
                    ]
                },
            );
            // ties put exact zeros among the logits (the kink of max(x, 0) and |x|)
            Case::new(format!("bce_with_logits {shape:?} {lx:?} {ly:?} {red:?}")).run(
                &mut rng,
                move |a| one(a[0].binary_cross_entropy_with_logits(&a[1], red)),
                move |r| {
                    vec![
                        r.arg(Gen::Ties, shape, lx, true),
                        r.arg(Gen::Unit, shape, ly, true),
                    ]
                },
            );
        }
    }
}
