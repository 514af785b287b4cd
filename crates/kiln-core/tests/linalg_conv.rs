//! matmul (1-D, 2-D, batched, broadcast batch, transposed views, size 0), linear, conv2d (stride,
//! padding, dilation, groups) and pooling against direct nested-loop f64 references.

mod common;

use common::*;
use kiln_core::{DType, Tensor};
use proptest::prelude::*;

/// Reference matmul over row-major f64 with PyTorch's 1-D and broadcast-batch rules.
fn ref_matmul(a: &[f64], sa: &[usize], b: &[f64], sb: &[usize]) -> (Vec<f64>, Vec<usize>) {
    let sa2: Vec<usize> = if sa.len() == 1 {
        vec![1, sa[0]]
    } else {
        sa.to_vec()
    };
    let sb2: Vec<usize> = if sb.len() == 1 {
        vec![sb[0], 1]
    } else {
        sb.to_vec()
    };
    let (m, k) = (sa2[sa2.len() - 2], sa2[sa2.len() - 1]);
    let n = sb2[sb2.len() - 1];
    let (ba, bb) = (&sa2[..sa2.len() - 2], &sb2[..sb2.len() - 2]);
    let batch = bshape(ba, bb).unwrap();
    let mut out = Vec::new();
    for bi in 0..numel(&batch) {
        let idx = unravel(bi, &batch);
        let ia = ravel(&bidx(&idx, ba), ba);
        let ib = ravel(&bidx(&idx, bb), bb);
        for r in 0..m {
            for c in 0..n {
                let s: f64 = (0..k)
                    .map(|p| a[ia * m * k + r * k + p] * b[ib * k * n + p * n + c])
                    .sum();
                out.push(s);
            }
        }
    }
    let mut shape = batch;
    if sa.len() > 1 {
        shape.push(m);
    }
    if sb.len() > 1 {
        shape.push(n);
    }
    (out, shape)
}

fn bidx(out: &[usize], s: &[usize]) -> Vec<usize> {
    let lead = out.len() - s.len();
    s.iter()
        .enumerate()
        .map(|(d, &n)| if n == 1 { 0 } else { out[lead + d] })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn ref_conv(
    x: &[f64],
    xs: &[usize],
    w: &[f64],
    ws: &[usize],
    b: Option<&[f64]>,
    s: [usize; 2],
    p: [usize; 2],
    d: [usize; 2],
    g: usize,
) -> (Vec<f64>, Vec<usize>) {
    let (n, c, h, wd) = (xs[0], xs[1], xs[2], xs[3]);
    let (o, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
    let oh = (h + 2 * p[0] - d[0] * (kh - 1) - 1) / s[0] + 1;
    let ow = (wd + 2 * p[1] - d[1] * (kw - 1) - 1) / s[1] + 1;
    let og = o / g;
    let mut out = vec![0.0; n * o * oh * ow];
    for bi in 0..n {
        for oc in 0..o {
            let grp = oc / og;
            for y in 0..oh {
                for xx in 0..ow {
                    let mut acc = b.map_or(0.0, |b| b[oc]);
                    for ci in 0..cg {
                        let ic = grp * cg + ci;
                        for ki in 0..kh {
                            for kj in 0..kw {
                                let iy = (y * s[0] + ki * d[0]) as isize - p[0] as isize;
                                let ix = (xx * s[1] + kj * d[1]) as isize - p[1] as isize;
                                if iy < 0 || ix < 0 || iy as usize >= h || ix as usize >= wd {
                                    continue;
                                }
                                acc += x[((bi * c + ic) * h + iy as usize) * wd + ix as usize]
                                    * w[((oc * cg + ci) * kh + ki) * kw + kj];
                            }
                        }
                    }
                    out[((bi * o + oc) * oh + y) * ow + xx] = acc;
                }
            }
        }
    }
    (out, vec![n, o, oh, ow])
}

/// The in-plane offsets (row-major in an `hw` plane) of the input elements under output
/// `o`'s window, row by row, padding left out.
fn window_taps(
    o: [usize; 2],
    hw: [usize; 2],
    k: [usize; 2],
    s: [usize; 2],
    p: [usize; 2],
) -> impl Iterator<Item = usize> {
    (0..k[0]).flat_map(move |ki| {
        (0..k[1]).filter_map(move |kj| {
            let iy = (o[0] * s[0] + ki) as isize - p[0] as isize;
            let ix = (o[1] * s[1] + kj) as isize - p[1] as isize;
            let inside = iy >= 0 && ix >= 0 && (iy as usize) < hw[0] && (ix as usize) < hw[1];
            inside.then(|| iy as usize * hw[1] + ix as usize)
        })
    })
}

/// Reference pooling; `avg` None means max.
fn ref_pool(
    x: &[f64],
    xs: &[usize],
    k: [usize; 2],
    s: [usize; 2],
    p: [usize; 2],
    avg: Option<bool>,
) -> (Vec<f64>, Vec<usize>) {
    let (n, c, h, w) = (xs[0], xs[1], xs[2], xs[3]);
    let oh = (h + 2 * p[0] - k[0]) / s[0] + 1;
    let ow = (w + 2 * p[1] - k[1]) / s[1] + 1;
    let mut out = Vec::new();
    for plane in 0..n * c {
        for y in 0..oh {
            for xx in 0..ow {
                let (mut mx, mut sum, mut cnt) = (f64::NEG_INFINITY, 0.0, 0usize);
                for at in window_taps([y, xx], [h, w], k, s, p) {
                    let v = x[plane * h * w + at];
                    mx = mx.max(v);
                    sum += v;
                    cnt += 1;
                }
                out.push(match avg {
                    None => mx,
                    Some(true) => sum / (k[0] * k[1]) as f64,
                    Some(false) => sum / cnt as f64,
                });
            }
        }
    }
    (out, vec![n, c, oh, ow])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn matmul_matches_f64(rank_a in 1usize..=4, rank_b in 1usize..=4, m in 0usize..5, k in 0usize..5, n in 0usize..5, ta: bool, tb: bool, seed: u64) {
        let mut rng = TRng::new(seed);
        // batch dims: b's are a's with some set to 1 or dropped
        let full: Vec<usize> = (0..rank_a.max(rank_b).saturating_sub(2)).map(|_| [1, 2, 3][rng.below(3)]).collect();
        let part = broadcast_partner(&full, &mut rng);
        let (mut ba, mut bb) = if rng.unit() < 0.5 { (full, part) } else { (part, full) };
        // keep the trailing dims so the batches still broadcast
        ba.drain(..ba.len().saturating_sub(rank_a.saturating_sub(2)));
        bb.drain(..bb.len().saturating_sub(rank_b.saturating_sub(2)));
        let mut sa = ba.clone();
        sa.extend(if rank_a == 1 { vec![k] } else { vec![m, k] });
        let mut sb = bb.clone();
        sb.extend(if rank_b == 1 { vec![k] } else { vec![k, n] });
        for dtype in [DType::F64, DType::F32, DType::BF16, DType::I64] {
            let gen = |r: &mut TRng| if dtype.is_float() { r.uniform(-1.0, 1.0) } else { r.below(7) as f64 - 3.0 };
            // transposed views: build the transpose contiguous and view it back
            let build = |s: &[usize], t: bool, rng: &mut TRng| {
                if t && s.len() >= 2 {
                    let mut st = s.to_vec();
                    let r = st.len();
                    st.swap(r - 1, r - 2);
                    let base = make(&st, Kind::Contiguous, dtype, rng, gen);
                    base.transpose(-1, -2).unwrap()
                } else {
                    make(s, Kind::Contiguous, dtype, rng, gen)
                }
            };
            let a = build(&sa, ta, &mut rng);
            let b = build(&sb, tb, &mut rng);
            let (want, shape) = ref_matmul(&a.to_vec_f64().unwrap(), &sa, &b.to_vec_f64().unwrap(), &sb);
            // bf16: k products rounded once in f32 then to bf16
            let got = a.matmul(&b).unwrap();
            check(&got, &want, &shape, dtype, &format!("matmul {dtype} {sa:?}{} @ {sb:?}{}", if ta {"ᵀ"} else {""}, if tb {"ᵀ"} else {""}));
        }
    }

    #[test]
    fn conv2d_matches_direct_loops(n in 0usize..3, g in 1usize..=2, cg in 1usize..=2, og in 0usize..=2, h in 1usize..7, w in 1usize..7, kh in 1usize..=3, kw in 1usize..=3, s0 in 1usize..=2, s1 in 1usize..=2, p0 in 0usize..=2, p1 in 0usize..=1, d0 in 1usize..=2, d1 in 1usize..=2, bias: bool, kind in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        let (c, o) = (g * cg, g * og);
        prop_assume!(h + 2 * p0 > d0 * (kh - 1) && w + 2 * p1 > d1 * (kw - 1));
        for dtype in [DType::F64, DType::F32] {
            let x = make(&[n, c, h, w], kind, dtype, &mut rng, |r| r.uniform(-1.0, 1.0));
            let wt = make(&[o, cg, kh, kw], Kind::Permuted, dtype, &mut rng, |r| r.uniform(-1.0, 1.0));
            let b = make(&[o], Kind::Contiguous, dtype, &mut rng, |r| r.uniform(-1.0, 1.0));
            let bv = b.to_vec_f64().unwrap();
            let (want, shape) = ref_conv(&x.to_vec_f64().unwrap(), x.shape(), &wt.to_vec_f64().unwrap(), wt.shape(), bias.then_some(&bv[..]), [s0, s1], [p0, p1], [d0, d1], g);
            let got = x.conv2d(&wt, bias.then_some(&b), [s0, s1], [p0, p1], [d0, d1], g).unwrap();
            check(&got, &want, &shape, dtype, &format!("conv2d {dtype} x{:?} w{:?} s{:?} p{:?} d{:?} g{g}", x.shape(), wt.shape(), [s0, s1], [p0, p1], [d0, d1]));
        }
    }

    /// The channels-last convolution prims (the compiler's NHWC form) compute what the NCHW ones
    /// do on the same values: the forward against the direct loops, both gradients against the
    /// NCHW gradient prims, with the shapes in channels-last order.
    #[test]
    fn channels_last_conv_prims_match_nchw(n in 0usize..3, g in 1usize..=2, cg in 1usize..=2, og in 1usize..=2, h in 1usize..7, w in 1usize..7, kh in 1usize..=3, kw in 1usize..=3, s0 in 1usize..=2, p0 in 0usize..=1, d0 in 1usize..=2, kind in kind(), seed: u64) {
        use kiln_core::dispatch::apply;
        use kiln_core::prim::{ConvParams, Prim, FROM_CHANNELS_LAST, TO_CHANNELS_LAST};
        let mut rng = TRng::new(seed);
        let (c, o) = (g * cg, g * og);
        prop_assume!(h + 2 * p0 > d0 * (kh - 1) && w + 2 * p0 > d0 * (kw - 1));
        let nchw = ConvParams { stride: [s0, 1], padding: [p0, p0], dilation: [d0, 1], groups: g, channels_last: false };
        let cl = ConvParams { channels_last: true, ..nchw };
        let x = make(&[n, c, h, w], kind, DType::F64, &mut rng, |r| r.uniform(-1.0, 1.0));
        let wt = make(&[o, cg, kh, kw], Kind::Permuted, DType::F64, &mut rng, |r| r.uniform(-1.0, 1.0));
        let to_cl = |t: &Tensor| t.permute(&TO_CHANNELS_LAST.map(|d| d as isize)).unwrap().contiguous().unwrap();
        let (xc, wc) = (to_cl(&x), to_cl(&wt));
        let y = apply(Prim::Conv2d(cl), &[&xc, &wc]).unwrap();
        let (want, shape) = ref_conv(&x.to_vec_f64().unwrap(), x.shape(), &wt.to_vec_f64().unwrap(), wt.shape(), None, [s0, 1], [p0, p0], [d0, 1], g);
        let back = y.permute(&FROM_CHANNELS_LAST.map(|d| d as isize)).unwrap();
        check(&back, &want, &shape, DType::F64, "channels-last conv2d");
        let gy = make(&shape, kind, DType::F64, &mut rng, |r| r.uniform(-1.0, 1.0));
        let gyc = to_cl(&gy);
        let s4 = |t: &Tensor| [t.shape()[0], t.shape()[1], t.shape()[2], t.shape()[3]];
        for (plain, channels_last, args, args_cl) in [
            (Prim::Conv2dGradInput { params: nchw, input_shape: s4(&x) }, Prim::Conv2dGradInput { params: cl, input_shape: s4(&xc) }, [&gy, &wt], [&gyc, &wc]),
            (Prim::Conv2dGradWeight { params: nchw, weight_shape: s4(&wt) }, Prim::Conv2dGradWeight { params: cl, weight_shape: s4(&wc) }, [&gy, &x], [&gyc, &xc]),
        ] {
            let want = apply(plain.clone(), &args).unwrap();
            let got = apply(channels_last, &args_cl).unwrap();
            let got = got.permute(&FROM_CHANNELS_LAST.map(|d| d as isize)).unwrap();
            check(&got, &want.to_vec_f64().unwrap(), want.shape(), DType::F64, plain.name());
        }
    }

    #[test]
    fn pooling_matches_direct_loops(n in 1usize..3, c in 1usize..3, h in 1usize..8, w in 1usize..8, k0 in 1usize..=3, k1 in 1usize..=3, s0 in 1usize..=3, s1 in 1usize..=2, pad: bool, kind in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        let p = if pad { [k0 / 2, k1 / 2] } else { [0, 0] };
        prop_assume!(h + 2 * p[0] >= k0 && w + 2 * p[1] >= k1);
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let x = make(&[n, c, h, w], kind, dtype, &mut rng, |r| r.uniform(-2.0, 2.0));
            let xv = x.to_vec_f64().unwrap();
            let (want, shape) = ref_pool(&xv, x.shape(), [k0, k1], [s0, s1], p, None);
            let pooled = x.max_pool2d([k0, k1], [s0, s1], p).unwrap();
            check(&pooled, &want, &shape, dtype, &format!("max_pool2d {dtype}"));
            // under no_grad the maximum is the output, without the index grad mode routes the
            // gradient by: the same values, bit for bit (the inputs hold no -0.0)
            let inference = kiln_core::no_grad(|| x.max_pool2d([k0, k1], [s0, s1], p)).unwrap();
            let bits = |t: &Tensor| t.to_vec_f64().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&inference), bits(&pooled), "max_pool2d {} under no_grad", dtype);
            for cip in [true, false] {
                let (want, shape) = ref_pool(&xv, x.shape(), [k0, k1], [s0, s1], p, Some(cip));
                let got = x.avg_pool2d([k0, k1], [s0, s1], p, cip).unwrap();
                check(&got, &want, &shape, dtype, &format!("avg_pool2d {dtype} k{:?} s{:?} p{p:?} count_include_pad={cip}", [k0, k1], [s0, s1]));
            }
            for (oh, ow) in [(1, 1), (h, w), (h.div_ceil(2), w.div_ceil(3)), (3.min(h), 2.min(w)), (h + 1, w + 2)] {
                // PyTorch's bins: [floor(i*H/oh), ceil((i+1)*H/oh))
                let mut want = Vec::new();
                for plane in 0..n * c {
                    for i in 0..oh {
                        for j in 0..ow {
                            let (y0, y1) = (i * h / oh, ((i + 1) * h).div_ceil(oh));
                            let (x0, x1) = (j * w / ow, ((j + 1) * w).div_ceil(ow));
                            let mut s = 0.0;
                            for y in y0..y1 { for xx in x0..x1 { s += xv[plane * h * w + y * w + xx]; } }
                            want.push(s / ((y1 - y0) * (x1 - x0)) as f64);
                        }
                    }
                }
                let got = x.adaptive_avg_pool2d([oh, ow]).unwrap();
                check(&got, &want, &[n, c, oh, ow], dtype, &format!("adaptive_avg_pool2d {dtype} {h}x{w} -> {oh}x{ow}"));
            }
        }
    }
}

#[test]
fn linear_matches_f64() -> kiln_core::Result<()> {
    let mut rng = TRng::new(7);
    for (xs, out_f, bias) in [
        (vec![3usize, 4], 5usize, true),
        (vec![2, 3, 4], 2, false),
        (vec![4], 3, true),
        (vec![0, 4], 3, true),
    ] {
        let inf = *xs.last().unwrap();
        let x = make(&xs, Kind::Strided, DType::F64, &mut rng, |r| {
            r.uniform(-1.0, 1.0)
        });
        let w = make(&[out_f, inf], Kind::Contiguous, DType::F64, &mut rng, |r| {
            r.uniform(-1.0, 1.0)
        });
        let b = make(&[out_f], Kind::Contiguous, DType::F64, &mut rng, |r| {
            r.uniform(-1.0, 1.0)
        });
        let (xv, wv, bv) = (x.to_vec_f64()?, w.to_vec_f64()?, b.to_vec_f64()?);
        let rows = xv.len() / inf;
        let mut want = Vec::new();
        for r in 0..rows {
            for o in 0..out_f {
                let s: f64 = (0..inf).map(|i| xv[r * inf + i] * wv[o * inf + i]).sum();
                want.push(s + if bias { bv[o] } else { 0.0 });
            }
        }
        let mut shape = xs[..xs.len() - 1].to_vec();
        shape.push(out_f);
        check(
            &x.linear(&w, bias.then_some(&b))?,
            &want,
            &shape,
            DType::F64,
            &format!("linear {xs:?}"),
        );
    }
    // integer matmul and a k = 0 product of zeros
    let a = Tensor::from_vec(vec![1i32, 2, 3, 4], &[2, 2])?;
    assert_eq!(a.matmul(&a)?.to_vec::<i32>()?, vec![7, 10, 15, 22]);
    let z = Tensor::zeros(&[3, 0], DType::F32)?.matmul(&Tensor::zeros(&[0, 2], DType::F32)?)?;
    assert_eq!(z.shape(), &[3, 2]);
    assert_eq!(z.to_vec::<f32>()?, vec![0.0; 6]);
    Ok(())
}

/// max_pool2d sends each output's gradient to the first window position holding the maximum
/// (row by row, PyTorch's `max_pool2d_with_indices` rule), ties included: inputs drawn from
/// {-1, 0, 1} tie often. A NaN in a window makes the output NaN and takes the gradient.
#[test]
fn max_pool2d_gradient_goes_to_the_first_maximum_of_each_window() -> kiln_core::Result<()> {
    let mut rng = TRng::new(7);
    for (shape, k, s, p) in [
        ([2, 3, 7, 6], [3, 3], [2, 2], [1, 1]),
        ([1, 2, 5, 5], [2, 2], [1, 1], [0, 0]),
        ([1, 1, 6, 4], [3, 2], [1, 2], [1, 0]),
    ] {
        let numel: usize = shape.iter().product();
        let mut xv: Vec<f64> = (0..numel).map(|_| rng.uniform(-1.5, 1.5).round()).collect();
        xv[numel / 2] = f64::NAN;
        let x = Tensor::from_vec(xv.clone(), &shape)?.with_grad()?;
        let y = x.max_pool2d(k, s, p)?;
        let (oh, ow) = (y.shape()[2], y.shape()[3]);
        let gv: Vec<f64> = (0..y.numel()).map(|_| rng.uniform(0.5, 2.0)).collect();
        y.mul(&Tensor::from_vec(gv.clone(), y.shape())?)?
            .sum_all()?
            .backward()?;
        let (h, w) = (shape[2], shape[3]);
        let mut want = vec![0.0; numel];
        let yv = y.to_vec_f64()?;
        for plane in 0..shape[0] * shape[1] {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut best: Option<(usize, f64)> = None;
                    for tap in window_taps([oy, ox], [h, w], k, s, p) {
                        let at = plane * h * w + tap;
                        let v = xv[at];
                        let better = match best {
                            None => true,
                            Some((_, b)) => !b.is_nan() && (v > b || v.is_nan()),
                        };
                        if better {
                            best = Some((at, v));
                        }
                    }
                    let (at, v) = best.expect("every window holds an input element");
                    let o = plane * oh * ow + oy * ow + ox;
                    want[at] += gv[o];
                    let got = yv[o];
                    assert!(
                        got == v || (got.is_nan() && v.is_nan()),
                        "{shape:?} out {o}: {got} vs {v}"
                    );
                }
            }
        }
        let grad = x.grad().expect("a gradient").to_vec_f64()?;
        assert_eq!(grad, want, "{shape:?} k {k:?} s {s:?} p {p:?}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The compiler's fused `act(a @ b + bias)` prim computes, bit for bit, what the matmul and
    /// the ops it replaces compute (`linear`'s add, `relu`, `gelu_tanh`), and the f64 reference
    /// to rounding; on strided and transposed operands, size-0 and size-1 dims, every float
    /// dtype.
    #[test]
    fn matmul_epilogue_prim_equals_the_ops_it_replaces(m in 0usize..6, k in 1usize..5, n in 0usize..6, bias: bool, act in 0usize..3, ta: bool, kind in kind(), seed: u64) {
        use kiln_core::dispatch::apply;
        use kiln_core::prim::{Activation, Epilogue, Prim};
        let mut rng = TRng::new(seed);
        for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
            let gen = |r: &mut TRng| r.uniform(-1.0, 1.0);
            let a = match ta {
                true => make(&[1, k, m], Kind::Contiguous, dtype, &mut rng, gen).transpose(-1, -2).unwrap(),
                false => make(&[1, m, k], kind, dtype, &mut rng, gen),
            };
            let b = make(&[1, k, n], kind, dtype, &mut rng, gen);
            let bv = make(&[n], kind, dtype, &mut rng, gen);
            let act = [Activation::None, Activation::Relu, Activation::GeluTanh][act];
            let e = Epilogue { bias, act };
            let mut ops = vec![&a, &b];
            if bias {
                ops.push(&bv);
            }
            let got = apply(Prim::MatmulEpilogue(e), &ops).unwrap();
            let mut want = a.matmul(&b).unwrap();
            if bias {
                want = want.add(&bv).unwrap();
            }
            want = match act {
                Activation::None => want,
                Activation::Relu => want.relu().unwrap(),
                Activation::GeluTanh => want.gelu_tanh().unwrap(),
            };
            let ctx = format!("{dtype} [1,{m},{k}]{} @ [1,{k},{n}] {e:?}", if ta { "ᵀ" } else { "" });
            prop_assert_eq!(got.shape(), want.shape(), "{}", ctx);
            let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
            let same = g.iter().zip(&w).all(|(x, y)| x.to_bits() == y.to_bits());
            prop_assert!(same, "{}: {:?} != {:?}", ctx, g, w);
            // and against f64 loops
            let (av, bvv, biv) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap(), bv.to_vec_f64().unwrap());
            let (mut r, _) = ref_matmul(&av, &[m, k], &bvv, &[k, n]);
            for (i, x) in r.iter_mut().enumerate() {
                if bias {
                    *x += biv[i % n.max(1)];
                }
                *x = match act {
                    Activation::None => *x,
                    Activation::Relu => x.max(0.0),
                    Activation::GeluTanh => {
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * *x * (1.0 + (c * (*x + 0.044715 * x.powi(3))).tanh())
                    }
                };
            }
            check(&got.reshape([m, n]).unwrap(), &r, &[m, n], dtype, &ctx);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The compiler's fused `act(conv2d(x, w) * scale + shift + residual)` prim computes, bit for
    /// bit, what the convolution and the ops it replaces compute (eval batch norm's `mul` and
    /// `add`, conv2d's bias add, a residual add, `relu`, `gelu_tanh`), in NCHW and channels-last
    /// form, and the f64 reference to rounding; strided operands, size-0 and size-1 dims, every
    /// float dtype.
    #[test]
    fn conv2d_epilogue_prim_equals_the_ops_it_replaces(n in 0usize..3, cg in 1usize..3, og in 0usize..3, groups in 1usize..=2, s in 1usize..=2, h in 1usize..5, w in 1usize..5, k in 1usize..=3, p in 0usize..=1, scale: bool, shift: bool, residual: bool, act in 0usize..3, channels_last: bool, kind in kind(), seed: u64) {
        use kiln_core::dispatch::apply;
        use kiln_core::prim::{Activation, ConvEpilogue, ConvParams, Prim, FROM_CHANNELS_LAST, TO_CHANNELS_LAST};
        prop_assume!(h + 2 * p >= k && w + 2 * p >= k && 2 * p <= k);
        let mut rng = TRng::new(seed);
        let (c, o) = (groups * cg, groups * og);
        let params = ConvParams { stride: [s, s], padding: [p, p], dilation: [1, 1], groups, channels_last };
        let act = [Activation::None, Activation::Relu, Activation::GeluTanh][act];
        let e = ConvEpilogue { scale, shift, residual, act };
        let (oh, ow) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
        for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
            let gen = |r: &mut TRng| r.uniform(-1.0, 1.0);
            let x = make(&[n, c, h, w], kind, dtype, &mut rng, gen);
            let wt = make(&[o, cg, k, k], Kind::Permuted, dtype, &mut rng, gen);
            let sc = make(&[o], kind, dtype, &mut rng, gen);
            let sh = make(&[o], kind, dtype, &mut rng, gen);
            let res = make(&[n, o, oh, ow], kind, dtype, &mut rng, gen);
            // the prim's operands in its own order (channels-last: NHWC shapes)
            let ordered = |t: &Tensor| match channels_last {
                true => t.permute(&TO_CHANNELS_LAST.map(|d| d as isize)).unwrap(),
                false => t.clone(),
            };
            let (xo, wo, ro) = (ordered(&x), ordered(&wt), ordered(&res));
            let mut ops = vec![&xo, &wo];
            ops.extend([(scale, &sc), (shift, &sh), (residual, &ro)].into_iter().filter(|(on, _)| *on).map(|(_, t)| t));
            let got = apply(Prim::Conv2dEpilogue { params, epilogue: e }, &ops).unwrap();
            let got = match channels_last {
                true => got.permute(&FROM_CHANNELS_LAST.map(|d| d as isize)).unwrap(),
                false => got,
            };
            // the ops as eager code writes them: batch_norm's and conv2d's [1, C, 1, 1] operands
            let mut want = x.conv2d(&wt, None, [s, s], [p, p], [1, 1], groups).unwrap();
            if scale {
                want = want.mul(sc.reshape([1, o, 1, 1]).unwrap()).unwrap();
            }
            if shift {
                want = want.add(sh.reshape([1, o, 1, 1]).unwrap()).unwrap();
            }
            if residual {
                want = want.add(&res).unwrap();
            }
            want = act.apply(want).unwrap();
            let ctx = format!("{dtype} x [{n},{c},{h},{w}] w [{o},{cg},{k},{k}] s {s} p {p} groups {groups} {e:?} channels-last {channels_last}");
            prop_assert_eq!(got.shape(), want.shape(), "{}", ctx);
            let (g, wv) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
            let same = g.iter().zip(&wv).all(|(a, b)| a.to_bits() == b.to_bits());
            prop_assert!(same, "{}: {:?} != {:?}", ctx, g, wv);
            // and against f64 loops
            let (mut r, shape) = ref_conv(&x.to_vec_f64().unwrap(), x.shape(), &wt.to_vec_f64().unwrap(), wt.shape(), None, [s, s], [p, p], [1, 1], groups);
            let (scv, shv, rv) = (sc.to_vec_f64().unwrap(), sh.to_vec_f64().unwrap(), res.to_vec_f64().unwrap());
            for (i, v) in r.iter_mut().enumerate() {
                let ch = (i / (oh * ow)) % o.max(1);
                if scale {
                    *v *= scv[ch];
                }
                if shift {
                    *v += shv[ch];
                }
                if residual {
                    *v += rv[i];
                }
                *v = match act {
                    Activation::None => *v,
                    Activation::Relu => v.max(0.0),
                    Activation::GeluTanh => {
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * *v * (1.0 + (c * (*v + 0.044715 * v.powi(3))).tanh())
                    }
                };
            }
            check(&got, &r, &shape, dtype, &ctx);
        }
    }
}

/// Per-channel operands of the wrong length, a residual of the wrong shape, a missing operand,
/// mixed dtypes: each a clear error naming the op.
#[test]
fn conv2d_epilogue_prim_rejects_bad_operands() {
    use kiln_core::dispatch::apply;
    use kiln_core::prim::{Activation, ConvEpilogue, ConvParams, Prim};
    let params = ConvParams {
        stride: [1, 1],
        padding: [0, 0],
        dilation: [1, 1],
        groups: 1,
        channels_last: false,
    };
    let x = Tensor::zeros(&[2, 3, 5, 5], DType::F32).unwrap();
    let w = Tensor::zeros(&[4, 3, 3, 3], DType::F32).unwrap();
    let all = Prim::Conv2dEpilogue {
        params,
        epilogue: ConvEpilogue {
            scale: true,
            shift: true,
            residual: true,
            act: Activation::Relu,
        },
    };
    let four = Tensor::zeros(&[4], DType::F32).unwrap();
    let three = Tensor::zeros(&[3], DType::F32).unwrap();
    let res = Tensor::zeros(&[2, 4, 3, 3], DType::F32).unwrap();
    let bad_res = Tensor::zeros(&[2, 4, 5, 5], DType::F32).unwrap();
    let err = apply(all.clone(), &[&x, &w, &three, &four, &res]).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("conv2d_epilogue") && msg.contains("[4]"),
        "{msg}"
    );
    let err = apply(all.clone(), &[&x, &w, &four, &four, &bad_res]).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("conv2d_epilogue") && msg.contains("residual"),
        "{msg}"
    );
    let err = apply(all.clone(), &[&x, &w, &four, &four]).unwrap_err();
    assert!(err.to_string().contains("conv2d_epilogue"), "{err}");
    let half = Tensor::zeros(&[4], DType::F16).unwrap();
    let err = apply(all.clone(), &[&x, &w, &half, &four, &res]).unwrap_err();
    assert!(err.to_string().contains("conv2d_epilogue"), "{err}");
    // the good operands run
    let y = apply(all, &[&x, &w, &four, &four, &res]).unwrap();
    assert_eq!(y.shape(), &[2, 4, 3, 3]);
}

/// A bias of the wrong length, a missing bias, integer operands: each a clear error naming the op.
#[test]
fn matmul_epilogue_prim_rejects_bad_operands() {
    use kiln_core::dispatch::apply;
    use kiln_core::prim::{Activation, Epilogue, Prim};
    let a = Tensor::zeros(&[1, 3, 4], DType::F32).unwrap();
    let b = Tensor::zeros(&[1, 4, 5], DType::F32).unwrap();
    let with_bias = Prim::MatmulEpilogue(Epilogue {
        bias: true,
        act: Activation::Relu,
    });
    let err = apply(
        with_bias.clone(),
        &[&a, &b, &Tensor::zeros(&[4], DType::F32).unwrap()],
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("matmul_epilogue") && err.to_string().contains("[5]"),
        "{err}"
    );
    let err = apply(with_bias, &[&a, &b]).unwrap_err();
    assert!(err.to_string().contains("matmul_epilogue"), "{err}");
    let ints = Tensor::zeros(&[1, 3, 4], DType::I64).unwrap();
    let intb = Tensor::zeros(&[1, 4, 5], DType::I64).unwrap();
    let relu = Prim::MatmulEpilogue(Epilogue {
        bias: false,
        act: Activation::Relu,
    });
    let err = apply(relu, &[&ints, &intb]).unwrap_err();
    assert!(err.to_string().contains("matmul_epilogue"), "{err}");
}

/// `f`'s values right after a buffer of `len` NaNs went back to the CPU's cache (the next buffer
/// of that size is likely that one).
fn after_freed_nans(
    len: usize,
    f: impl Fn() -> kiln_core::Result<Tensor>,
) -> kiln_core::Result<Vec<f64>> {
    drop(Tensor::full(&[len], f64::NAN, DType::F32)?.add(0.0)?);
    f()?.to_vec_f64()
}

/// f32 values uniform in [-1, 1) of `shape`, laid out as `kind` says.
fn uniform_f32(shape: &[usize], kind: Kind, rng: &mut TRng) -> Tensor {
    make(shape, kind, DType::F32, rng, |r| r.uniform(-1.0, 1.0))
}

/// The GEMMs of matmul and conv2d write into a reused buffer from the CPU's cache (`take_vec`)
/// without reading it: a freed buffer of NaNs of the result's size (1 MiB, the cache's smallest)
/// leaves no trace in the next result.
#[test]
fn gemm_outputs_in_reused_buffers_do_not_read_them() -> kiln_core::Result<()> {
    let mut rng = TRng::new(7);
    let x = uniform_f32(&[2, 3, 34, 66], Kind::Contiguous, &mut rng);
    let w = uniform_f32(&[64, 3, 3, 3], Kind::Contiguous, &mut rng);
    let a = uniform_f32(&[512, 8], Kind::Contiguous, &mut rng);
    let b = uniform_f32(&[8, 512], Kind::Contiguous, &mut rng);
    let conv = || x.conv2d(&w, None, [1, 1], [0, 0], [1, 1], 1);
    let want_conv = conv()?.to_vec_f64()?;
    let want_mm = a.matmul(&b)?.to_vec_f64()?;
    assert_eq!(want_conv.len(), 1 << 18);
    assert_eq!(want_mm.len(), 1 << 18);
    for _ in 0..2 {
        assert_eq!(after_freed_nans(1 << 18, conv)?, want_conv);
        assert_eq!(after_freed_nans(1 << 18, || a.matmul(&b))?, want_mm);
    }
    Ok(())
}

/// cat writes every element of a reused buffer and pad fills one before writing its interior:
/// a freed buffer of NaNs of the result's size leaves no trace in either.
#[test]
fn cat_and_pad_in_reused_buffers_leave_no_trace() -> kiln_core::Result<()> {
    let mut rng = TRng::new(11);
    let a = uniform_f32(&[512, 512], Kind::Contiguous, &mut rng);
    let b = uniform_f32(&[512, 512], Kind::Permuted, &mut rng);
    let cat = || Tensor::cat(&[&a, &b], 0);
    let pad = || a.narrow(0, 0, 510)?.pad(&[0, 0, 1, 1], 2.0);
    let (want_cat, want_pad) = (cat()?.to_vec_f64()?, pad()?.to_vec_f64()?);
    assert_eq!(want_cat.len(), 1 << 19);
    assert_eq!(want_pad.len(), 1 << 18);
    for _ in 0..2 {
        assert_eq!(after_freed_nans(1 << 19, cat)?, want_cat);
        assert_eq!(after_freed_nans(1 << 18, pad)?, want_pad);
    }
    Ok(())
}
