//! Reductions, arg-reductions and the softmax family; matmul, linear, conv2d and pooling, compiled vs eager.

use crate::*;

type Reduce = fn(&Tensor, &[isize], bool) -> Result<Tensor>;

#[test]
fn reductions_over_dims_with_keepdim() {
    let mut rng = Rng::new(6);
    let ops: Vec<(&str, Reduce, Gen)> = vec![
        ("sum", |x, d, k| x.sum(d, k), Gen::Normal),
        ("mean", |x, d, k| x.mean(d, k), Gen::Normal),
        ("max", |x, d, k| x.max(d, k), Gen::Ties),
        ("min", |x, d, k| x.min(d, k), Gen::Ties),
        ("prod", |x, d, k| x.prod(d, k), Gen::Normal),
        ("prod (zeros)", |x, d, k| x.prod(d, k), Gen::Ties),
        ("var", |x, d, k| x.var(d, 1, k), Gen::Normal),
        ("var correction 0", |x, d, k| x.var(d, 0, k), Gen::Normal),
        ("std", |x, d, k| x.std(d, 1, k), Gen::Normal),
        ("logsumexp", |x, d, k| x.logsumexp(d, k), Gen::Normal),
    ];
    let cases: &[(&[usize], Lay, &[isize])] = &[
        (&[2, 3, 4], Lay::C, &[]),
        (&[2, 3, 4], Lay::C, &[0]),
        (&[2, 3, 4], Lay::C, &[-1]),
        (&[2, 3, 4], Lay::C, &[0, 2]),
        (&[2, 3, 4], Lay::T, &[1]),
        (&[3, 1, 4], Lay::C, &[1]),
        (&[4, 5], Lay::S, &[0]),
        (&[3, 4], Lay::E, &[0]),
        (&[], Lay::C, &[]),
        (&[5], Lay::C, &[0]),
    ];
    for (name, op, g) in &ops {
        let (op, g) = (*op, *g);
        for &(shape, lay, dims) in cases {
            if shape.is_empty() && *name == "logsumexp" {
                continue; // see softmax_family_of_a_rank0_input_on_replay (ignored: a bug)
            }
            for keep in [false, true] {
                Case::new(format!(
                    "{name} {shape:?} {lay:?} dims {dims:?} keepdim {keep}"
                ))
                .run(
                    &mut rng,
                    move |a| one(op(&a[0], dims, keep)),
                    move |r| vec![r.arg(g, shape, lay, true)],
                );
            }
        }
    }
    // size-0 inputs: reducing the empty dim gives the identity (sum 0, prod 1, logsumexp -inf,
    // mean NaN), reducing another dim gives an empty result
    for (name, op, g) in &ops {
        let (op, g) = (*op, *g);
        let empty_ok = matches!(*name, "sum" | "prod" | "mean" | "logsumexp");
        for dims in [&[1isize][..], &[0][..]] {
            if dims == [0] && !empty_ok {
                continue; // max/min of nothing is an error, as in PyTorch
            }
            Case::new(format!("{name} [0, 3] dims {dims:?}")).run(
                &mut rng,
                move |a| one(op(&a[0], dims, false)),
                move |r| vec![r.arg(g, &[0, 3], Lay::C, true)],
            );
        }
    }
    Case::new("sum_all / mean_all").run(
        &mut rng,
        |a| Ok(vec![a[0].sum_all()?, a[0].mean_all()?]),
        |r| vec![r.arg(Gen::Normal, &[3, 5], Lay::T, true)],
    );
    Case::new("sum of i64 and bool").run(
        &mut rng,
        |a| {
            Ok(vec![
                a[0].sum(&[1], false)?,
                a[1].sum(&[0], true)?,
                a[0].prod(&[0], false)?,
                a[0].max(&[1], false)?,
                a[1].max(&[], false)?,
                a[0].mean(&[1], false)?,
            ])
        },
        |r| vec![In::val(r.ints(&[3, 4], -3, 4)), In::val(r.bools(&[3, 4]))],
    );
}

/// Bitwise (0) where the generated code follows the eager kernels' summation order: the CPU and
/// the mock device. On a GPU the eager kernels reduce by their own warp and block trees and the
/// generated kernels by theirs (split reductions included): the sums agree to a few ulps, not to
/// the bit, so there they are checked to a relative 1e-5 (f32) or 1e-13 (f64).
fn lane_order_tol(dtype: DType) -> f64 {
    match (common::test_device(), dtype) {
        (kiln::Device::Cuda(_), DType::F64) => 1e-13,
        (kiln::Device::Cuda(_), _) => 1e-5,
        _ => 0.0,
    }
}

/// Float sums long enough to fill the 16 accumulators of `prim::SUM_LANES`'s summation order
/// (full groups, a remainder, several runs of the innermost reduced dim, a strided column): the
/// generated C follows the eager kernel's order, so compiled equals eager bitwise. In f32 and f64;
/// var (Welford's moments in the same lanes and chunks), layer norm and softmax too. f32 values summed in f64 are mostly exact whatever the
/// order, so the values are divided by 3 in f64 (all 53 bits used), and checked to be ones where
/// the lane order and a single sequential accumulator give different bits: the order is really
/// under test.
#[test]
fn long_float_sums_follow_the_eager_lane_order() {
    let mut rng = Rng::new(61);
    let cases: &[(&[usize], &[isize])] = &[
        (&[3, 40], &[-1]),
        (&[37, 5], &[0]),
        (&[4, 19, 33], &[1, 2]),
        (&[4, 19, 33], &[2, 0]),
        (&[2, 16], &[1]),
        (&[3, 600], &[]),
        // single rows of 2^15 and more (`prim::SUM_CHUNKED_FROM`): summed in chunks, in
        // parallel, eager and generated C in the same chunked order
        (&[1 << 15], &[]),
        (&[50_000], &[0]),
        (&[300, 200], &[]),
        (&[3, 70, 200], &[]),
        (&[40, 1000], &[1, 0]),
        (&[5, 9000], &[]),
    ];
    let mut differs = false;
    for &(shape, dims) in cases {
        // a sequential f64 sum of each row (the order sums had before the lanes), to show the
        // cases discriminate
        let x = rng
            .randn(shape)
            .to_dtype(DType::F64)
            .unwrap()
            .div(3.0)
            .unwrap();
        let lanes = x.sum(dims, false).unwrap().to_vec::<f64>().unwrap();
        let nd: Vec<usize> = if dims.is_empty() {
            (0..shape.len()).collect()
        } else {
            dims.iter()
                .map(|&d| d.rem_euclid(shape.len() as isize) as usize)
                .collect()
        };
        let mut perm: Vec<usize> = (0..shape.len()).filter(|d| !nd.contains(d)).collect();
        perm.extend(&nd);
        let perm: Vec<isize> = perm.iter().map(|&d| d as isize).collect();
        let rows = x.permute(&perm).unwrap().contiguous().unwrap();
        let flat = rows.to_vec::<f64>().unwrap();
        let row: usize = nd.iter().map(|&d| shape[d]).product();
        for (r, want) in flat.chunks(row).zip(&lanes) {
            let sequential = r.iter().fold(0f64, |a, &v| a + v);
            assert!((sequential - want).abs() <= 1e-12 * r.iter().map(|v| v.abs()).sum::<f64>());
            differs |= sequential != *want;
        }
        for dtype in [DType::F32, DType::F64] {
            Case::new(format!("sum, mean, var {shape:?} dims {dims:?} {dtype:?}"))
                .fwd_tol(lane_order_tol(dtype))
                .grad_tol(lane_order_tol(dtype))
                .run(
                    &mut rng,
                    move |a| {
                        let x = a[0].to_dtype(dtype)?.div(3.0)?;
                        // var: squared deviations in Welford's lanes (`prim::SqDevState`)
                        Ok(vec![
                            x.sum(dims, false)?,
                            x.mean(dims, true)?,
                            x.var(dims, 1, false)?,
                        ])
                    },
                    move |r| vec![r.arg(Gen::Normal, shape, Lay::C, true)],
                );
        }
    }
    assert!(
        differs,
        "no case tells the lane order from a sequential one"
    );
    Case::new("var, layer norm and softmax over 100")
        .fwd_tol(lane_order_tol(DType::F32))
        .grad_tol(lane_order_tol(DType::F32))
        .run(
            &mut rng,
            |a| {
                Ok(vec![
                    a[0].var(&[1], 1, false)?,
                    a[0].layer_norm(&[100], None, None, 1e-5)?,
                    a[0].softmax(-1)?,
                ])
            },
            |r| vec![r.arg(Gen::Normal, &[6, 100], Lay::C, true)],
        );
}

#[test]
fn argmax_and_argmin() {
    let mut rng = Rng::new(7);
    let cases: &[(&[usize], Lay, Option<isize>)] = &[
        (&[3, 4], Lay::C, None),
        (&[3, 4], Lay::C, Some(0)),
        (&[3, 4], Lay::T, Some(-1)),
        (&[2, 3, 4], Lay::S, Some(1)),
        (&[4, 1], Lay::E, Some(1)),
        (&[], Lay::C, Some(0)),
        (&[], Lay::C, None),
        (&[0, 3], Lay::C, Some(1)),
    ];
    for &(shape, lay, dim) in cases {
        for keep in [false, true] {
            Case::new(format!("argmax/argmin {shape:?} {lay:?} {dim:?} {keep}")).run(
                &mut rng,
                move |a| Ok(vec![a[0].argmax(dim, keep)?, a[0].argmin(dim, keep)?]),
                move |r| vec![r.arg(Gen::Ties, shape, lay, false)],
            );
        }
    }
}

#[test]
fn softmax_and_log_softmax() {
    let mut rng = Rng::new(8);
    let cases: &[(&[usize], Lay, isize)] = &[
        (&[2, 3, 4], Lay::C, 0),
        (&[2, 3, 4], Lay::C, 1),
        (&[2, 3, 4], Lay::C, -1),
        (&[3, 4], Lay::T, -1),
        (&[3, 4], Lay::T, 0),
        (&[4, 3], Lay::S, 1),
        (&[3, 5], Lay::E, 0),
        (&[3, 1], Lay::C, 1),
        (&[0, 5], Lay::C, -1),
        (&[5, 0], Lay::C, 0),
        (&[6], Lay::C, 0),
    ];
    for &(shape, lay, dim) in cases {
        Case::new(format!("softmax {shape:?} {lay:?} dim {dim}")).run(
            &mut rng,
            move |a| one(a[0].softmax(dim)),
            move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
        );
        Case::new(format!("log_softmax {shape:?} {lay:?} dim {dim}")).run(
            &mut rng,
            move |a| one(a[0].log_softmax(dim)),
            move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
        );
    }
    Case::new("softmax of large and -inf logits").run(
        &mut rng,
        |a| {
            let x = a[0].mul(100.0)?;
            let masked = Tensor::where_(&a[1], &x, f64::NEG_INFINITY)?;
            Ok(vec![masked.softmax(-1)?, masked.log_softmax(-1)?])
        },
        |r| {
            let mut mask = r.bools(&[3, 5]).to_vec::<bool>().unwrap();
            mask.iter_mut().step_by(5).for_each(|m| *m = true);
            vec![
                In::grad(r.randn(&[3, 5])),
                In::val(Tensor::from_vec(mask, &[3, 5]).unwrap()),
            ]
        },
    );
}

#[test]
fn matmul_batched_and_broadcast() {
    let mut rng = Rng::new(9);
    let cases: &[(&[usize], Lay, &[usize], Lay)] = &[
        (&[4], Lay::C, &[4], Lay::C),
        (&[3, 4], Lay::C, &[4], Lay::S),
        (&[4], Lay::C, &[4, 5], Lay::C),
        (&[3, 4], Lay::C, &[4, 5], Lay::C),
        (&[3, 4], Lay::T, &[4, 5], Lay::T),
        (&[2, 3, 4], Lay::C, &[2, 4, 5], Lay::C),
        (&[2, 3, 4], Lay::T, &[2, 4, 5], Lay::S),
        (&[2, 1, 3, 4], Lay::C, &[5, 4, 2], Lay::C),
        (&[2, 3, 4], Lay::C, &[4, 5], Lay::C),
        (&[2, 3, 4], Lay::T, &[4, 5], Lay::C),
        (&[3, 3, 4], Lay::E, &[4, 2], Lay::T),
        (&[2, 3, 4], Lay::C, &[4], Lay::C),
        (&[4], Lay::C, &[2, 4, 5], Lay::C),
        (&[1, 4], Lay::C, &[4, 1], Lay::C),
        (&[0, 3], Lay::C, &[3, 4], Lay::C),
        (&[2, 0], Lay::C, &[0, 3], Lay::C),
        (&[0, 2, 3], Lay::C, &[3, 2], Lay::C),
    ];
    for &(sa, la, sb, lb) in cases {
        // a GEMM tuned by max-autotune sums in its algorithm's order: an element that cancels
        // carries the rounding of the largest terms (bitwise in default mode all the same)
        Case::new(format!("matmul {sa:?} {la:?} @ {sb:?} {lb:?}"))
            .tol_of_max()
            .run(
                &mut rng,
                |a| one(a[0].matmul(&a[1])),
                move |r| {
                    vec![
                        r.arg(Gen::Normal, sa, la, true),
                        r.arg(Gen::Normal, sb, lb, true),
                    ]
                },
            );
    }
    Case::new("matmul f64 x f32").tol_of_max().run(
        &mut rng,
        |a| one(a[0].matmul(&a[1])),
        |r| {
            vec![
                In::grad(r.randn(&[3, 4]).to_dtype(DType::F64).unwrap()),
                In::grad(r.randn(&[4, 2])),
            ]
        },
    );
}

#[test]
fn linear() {
    let mut rng = Rng::new(10);
    let cases: &[(&[usize], Lay, bool)] = &[
        (&[5, 4], Lay::C, true),
        (&[5, 4], Lay::T, true),
        (&[2, 5, 4], Lay::C, false),
        (&[4], Lay::C, true),
        (&[0, 4], Lay::C, true),
    ];
    for &(sx, lx, bias) in cases {
        Case::new(format!("linear {sx:?} {lx:?} bias {bias}"))
            .tol_of_max()
            .run(
                &mut rng,
                move |a| one(a[0].linear(&a[1], a.get(2))),
                move |r| {
                    let mut v = vec![
                        r.arg(Gen::Normal, sx, lx, true),
                        r.arg(Gen::Normal, &[3, 4], Lay::C, true),
                    ];
                    if bias {
                        v.push(r.arg(Gen::Normal, &[3], Lay::C, true));
                    }
                    v
                },
            );
    }
}

struct Conv {
    x: &'static [usize],
    lay: Lay,
    w: &'static [usize],
    bias: bool,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
}

#[test]
fn conv2d_stride_padding_dilation_groups() {
    let mut rng = Rng::new(11);
    let base = Conv {
        x: &[2, 3, 7, 6],
        lay: Lay::C,
        w: &[4, 3, 3, 3],
        bias: true,
        stride: [1, 1],
        padding: [0, 0],
        dilation: [1, 1],
        groups: 1,
    };
    let cases = [
        Conv { ..base },
        Conv {
            bias: false,
            stride: [2, 1],
            padding: [1, 2],
            ..base
        },
        Conv {
            dilation: [2, 2],
            padding: [1, 1],
            ..base
        },
        Conv {
            lay: Lay::T,
            stride: [2, 2],
            ..base
        },
        Conv {
            x: &[2, 4, 6, 6],
            w: &[6, 2, 3, 3],
            groups: 2,
            padding: [1, 1],
            ..base
        },
        Conv {
            x: &[1, 4, 5, 5],
            w: &[4, 1, 3, 3],
            groups: 4,
            ..base
        },
        Conv {
            x: &[2, 3, 5, 4],
            lay: Lay::S,
            w: &[2, 3, 1, 1],
            ..base
        },
        Conv {
            x: &[3, 3, 4, 4],
            lay: Lay::E,
            w: &[2, 3, 2, 3],
            stride: [1, 2],
            ..base
        },
        Conv {
            x: &[0, 3, 5, 5],
            ..base
        },
    ];
    for c in cases {
        let Conv {
            x,
            lay,
            w,
            bias,
            stride,
            padding,
            dilation,
            groups,
        } = c;
        // on a GPU the compiled graph convolves in channels-last order (kiln-inductor's
        // `channels_last.rs`: cuDNN's NHWC algorithms) and eager in NCHW: the same sums in
        // other orders, equal to a few ulps of the largest output (against float64 in gpu_ops)
        let tol = match common::test_device() {
            kiln::Device::Cuda(_) => 1e-5,
            _ => 0.0,
        };
        Case::new(format!(
            "conv2d x {x:?} {lay:?} w {w:?} bias {bias} s {stride:?} p {padding:?} d {dilation:?} g {groups}"
        ))
        .fwd_tol(tol)
        .grad_tol(tol)
        .tol_of_max()
        .run(
            &mut rng,
            move |a| one(a[0].conv2d(&a[1], a.get(2), stride, padding, dilation, groups)),
            move |r| {
                let mut v = vec![
                    r.arg(Gen::Normal, x, lay, true),
                    r.arg(Gen::Normal, w, Lay::C, true),
                ];
                if bias {
                    v.push(r.arg(Gen::Normal, &[w[0]], Lay::C, true));
                }
                v
            },
        );
    }
}

#[test]
fn pooling() {
    let mut rng = Rng::new(12);
    type Geo = ([usize; 2], [usize; 2], [usize; 2]);
    let geos: &[Geo] = &[
        ([2, 2], [2, 2], [0, 0]),
        ([3, 3], [2, 2], [1, 1]),
        ([2, 3], [1, 2], [1, 1]),
        ([3, 1], [1, 1], [0, 0]),
    ];
    let inputs: &[(&[usize], Lay)] = &[
        (&[2, 3, 6, 7], Lay::C),
        (&[1, 2, 5, 5], Lay::T),
        (&[2, 1, 4, 6], Lay::S),
        (&[0, 2, 4, 4], Lay::C),
    ];
    for &(k, s, p) in geos {
        for &(shape, lay) in inputs {
            // ties: equal values inside a window (max's gradient goes to them as the rule says)
            Case::new(format!(
                "max_pool2d {shape:?} {lay:?} k {k:?} s {s:?} p {p:?}"
            ))
            .run(
                &mut rng,
                move |a| one(a[0].max_pool2d(k, s, p)),
                move |r| vec![r.arg(Gen::Ties, shape, lay, true)],
            );
            for include in [true, false] {
                Case::new(format!(
                    "avg_pool2d {shape:?} {lay:?} k {k:?} s {s:?} p {p:?} count_include_pad {include}"
                ))
                .run(
                    &mut rng,
                    move |a| one(a[0].avg_pool2d(k, s, p, include)),
                    move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
                );
            }
        }
    }
    let adaptive: &[(&[usize], Lay, [usize; 2])] = &[
        (&[2, 3, 8, 8], Lay::C, [4, 4]),
        (&[2, 3, 7, 5], Lay::C, [3, 2]),
        (&[1, 2, 6, 5], Lay::T, [4, 3]),
        (&[2, 2, 5, 6], Lay::S, [1, 1]),
        (&[1, 1, 3, 3], Lay::C, [5, 4]),
        (&[0, 2, 4, 4], Lay::C, [2, 2]),
    ];
    for &(shape, lay, out) in adaptive {
        Case::new(format!("adaptive_avg_pool2d {shape:?} {lay:?} -> {out:?}")).run(
            &mut rng,
            move |a| one(a[0].adaptive_avg_pool2d(out)),
            move |r| vec![r.arg(Gen::Normal, shape, lay, true)],
        );
    }
    Case::new("pooling i64 input").run(
        &mut rng,
        |a| {
            Ok(vec![
                a[0].max_pool2d([2, 2], [1, 1], [1, 1])?,
                a[0].avg_pool2d([2, 2], [2, 2], [0, 0], true)?,
                a[0].adaptive_avg_pool2d([2, 3])?,
            ])
        },
        |r| vec![In::val(r.ints(&[1, 2, 4, 5], -5, 5))],
    );
}
