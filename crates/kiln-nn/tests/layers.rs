//! Each layer's forward against an independent f64 reference.

mod common;

use common::*;
use kiln_core::{DType, Tensor};
use kiln_nn::*;

#[test]
fn linear_forward() {
    let (n, i, o) = (3, 4, 5);
    let lin = Linear::new(i, o, true).unwrap();
    let xv = values(n * i, 1, 1.0);
    let y = f64s(&lin.forward(&tensor_f32(&xv, &[n, i])).unwrap());
    let xv: Vec<f64> = xv.iter().map(|&v| v as f32 as f64).collect();
    let (w, b) = (f64s(&lin.weight), f64s(lin.bias.as_ref().unwrap()));
    let mut want = vec![0.0; n * o];
    for r in 0..n {
        for c in 0..o {
            want[r * o + c] = b[c] + (0..i).map(|k| xv[r * i + k] * w[c * i + k]).sum::<f64>();
        }
    }
    assert_close(&y, &want, 1e-5);
    // a wrong trailing dim is an error, not a panic
    assert!(lin
        .forward(&Tensor::zeros(&[2, 3], DType::F32).unwrap())
        .is_err());
}

#[test]
fn linear_without_bias_and_batched() {
    let lin = Linear::new(3, 2, false).unwrap();
    assert!(lin.bias.is_none());
    let x = tensor_f32(&values(2 * 4 * 3, 2, 1.0), &[2, 4, 3]);
    assert_eq!(lin.forward(&x).unwrap().shape(), &[2, 4, 2]);
}

/// Direct convolution in f64, PyTorch's semantics.
#[allow(clippy::too_many_arguments)]
fn conv_ref(
    x: &[f64],
    xs: [usize; 4],
    w: &[f64],
    ws: [usize; 4],
    b: Option<&[f64]>,
    stride: [usize; 2],
    pad: [usize; 2],
    dil: [usize; 2],
    groups: usize,
) -> (Vec<f64>, [usize; 4]) {
    let [n, c, h, wd] = xs;
    let [o, cg, kh, kw] = ws;
    let oh = (h + 2 * pad[0] - dil[0] * (kh - 1) - 1) / stride[0] + 1;
    let ow = (wd + 2 * pad[1] - dil[1] * (kw - 1) - 1) / stride[1] + 1;
    let og = o / groups;
    let mut out = vec![0.0; n * o * oh * ow];
    for b_ in 0..n {
        for oc in 0..o {
            let g = oc / og;
            for y in 0..oh {
                for xx in 0..ow {
                    let mut s = b.map_or(0.0, |b| b[oc]);
                    for ic in 0..cg {
                        let cin = g * cg + ic;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (y * stride[0] + ky * dil[0]) as isize - pad[0] as isize;
                                let ix = (xx * stride[1] + kx * dil[1]) as isize - pad[1] as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xi = ((b_ * c + cin) * h + iy as usize) * wd + ix as usize;
                                let wi = ((oc * cg + ic) * kh + ky) * kw + kx;
                                s += x[xi] * w[wi];
                            }
                        }
                    }
                    out[((b_ * o + oc) * oh + y) * ow + xx] = s;
                }
            }
        }
    }
    (out, [n, o, oh, ow])
}

#[test]
fn conv2d_forward_matches_direct_convolution() {
    let cases = [
        (Conv2dConfig::default(), 4, 6, [3, 3]),
        (Conv2dConfig::default().stride(2).padding(1), 4, 6, [3, 3]),
        (Conv2dConfig::default().dilation(2).padding(2), 4, 2, [3, 2]),
        (Conv2dConfig::default().groups(2).bias(false), 4, 6, [1, 3]),
    ];
    for (k, (cfg, cin, cout, ks)) in cases.into_iter().enumerate() {
        let conv = Conv2d::with_dtype(cin, cout, ks, cfg, DType::F64).unwrap();
        let xs = [2, cin, 7, 6];
        let xv = values(xs.iter().product(), 10 + k as u64, 1.0);
        let y = conv.forward(&tensor_f64(&xv, &xs)).unwrap();
        let w = f64s(&conv.weight);
        let b = conv.bias.as_ref().map(f64s);
        let ws: [usize; 4] = conv.weight.shape().try_into().unwrap();
        let (want, shape) = conv_ref(
            &xv,
            xs,
            &w,
            ws,
            b.as_deref(),
            cfg.stride,
            cfg.padding,
            cfg.dilation,
            cfg.groups,
        );
        assert_eq!(y.shape(), &shape, "case {k}");
        assert_close(&f64s(&y), &want, 1e-10);
    }
}

#[test]
fn conv2d_invalid_arguments_are_errors() {
    let c = Conv2dConfig::default();
    assert!(Conv2d::new(3, 4, [3, 3], c.groups(2)).is_err()); // 3 % 2
    assert!(Conv2d::new(4, 3, [3, 3], c.groups(2)).is_err()); // out 3 % 2
    assert!(Conv2d::new(4, 4, [3, 3], c.groups(0)).is_err());
    assert!(Conv2d::new(4, 4, [0, 3], c).is_err());
    assert!(Conv2d::new(4, 4, [3, 3], c.stride(0)).is_err());
    let conv = Conv2d::new(3, 4, [3, 3], c).unwrap();
    assert!(conv
        .forward(&Tensor::zeros(&[1, 2, 5, 5], DType::F32).unwrap())
        .is_err());
    assert!(conv
        .forward(&Tensor::zeros(&[1, 3, 2, 2], DType::F32).unwrap())
        .is_err());
}

/// Per-channel (mean, biased var, unbiased var) of an NCHW buffer.
fn channel_stats(x: &[f64], s: [usize; 4]) -> Vec<(f64, f64, f64)> {
    let [n, c, h, w] = s;
    (0..c)
        .map(|ch| {
            let vals: Vec<f64> = (0..n)
                .flat_map(|b| (0..h * w).map(move |i| (b * c + ch) * h * w + i))
                .map(|i| x[i])
                .collect();
            let m = vals.iter().sum::<f64>() / vals.len() as f64;
            let ss = vals.iter().map(|v| (v - m) * (v - m)).sum::<f64>();
            (m, ss / vals.len() as f64, ss / (vals.len() - 1) as f64)
        })
        .collect()
}

#[test]
fn batchnorm2d_training_step_and_eval() {
    let s = [4, 3, 2, 3];
    let bn = BatchNorm2d::new(3).unwrap();
    let xv: Vec<f64> = values(s.iter().product(), 20, 2.0)
        .iter()
        .map(|&v| (v + 0.5) as f32 as f64)
        .collect();
    let x = tensor_f32(&xv, &s);
    let stats = channel_stats(&xv, s);
    let hw = 6;
    // training: batch statistics (biased variance) normalise
    let y = f64s(&bn.forward(&x).unwrap());
    let want: Vec<f64> = (0..xv.len())
        .map(|i| {
            let (m, v, _) = stats[(i / hw) % 3];
            (xv[i] - m) / (v + 1e-5).sqrt()
        })
        .collect();
    assert_close(&y, &want, 1e-5);
    // running stats after one step: momentum 0.1 from (0, 1), unbiased variance
    let r = bn.running.as_ref().unwrap();
    let rm: Vec<f64> = stats.iter().map(|s| 0.1 * s.0).collect();
    let rv: Vec<f64> = stats.iter().map(|s| 0.9 + 0.1 * s.2).collect();
    assert_close(&f64s(&r.running_mean), &rm, 1e-6);
    assert_close(&f64s(&r.running_var), &rv, 1e-6);
    assert_eq!(r.num_batches_tracked.item::<i64>().unwrap(), 1);
    assert_eq!(r.num_batches_tracked.dtype(), DType::I64);
    // eval: the running statistics normalise, and nothing is updated
    bn.eval();
    let y = f64s(&bn.forward(&x).unwrap());
    let want: Vec<f64> = (0..xv.len())
        .map(|i| {
            let c = (i / hw) % 3;
            (xv[i] - rm[c]) / (rv[c] + 1e-5).sqrt()
        })
        .collect();
    assert_close(&y, &want, 1e-5);
    assert_eq!(r.num_batches_tracked.item::<i64>().unwrap(), 1);
    assert_close(&f64s(&r.running_mean), &rm, 1e-6);
}

#[test]
fn batchnorm2d_cumulative_average_and_bad_input() {
    let cfg = BatchNormConfig {
        momentum: None,
        ..Default::default()
    };
    let bn = BatchNorm2d::with_config(2, cfg).unwrap();
    let s = [3, 2, 2, 2];
    let a = values(24, 30, 1.0);
    let b = values(24, 31, 1.0);
    bn.forward(&tensor_f64(&a, &s)).unwrap();
    bn.forward(&tensor_f64(&b, &s)).unwrap();
    let (sa, sb) = (channel_stats(&a, s), channel_stats(&b, s));
    // factor 1/1 then 1/2: the plain average of the two batches' statistics
    let r = bn.running.as_ref().unwrap();
    let rm: Vec<f64> = (0..2).map(|c| (sa[c].0 + sb[c].0) / 2.0).collect();
    let rv: Vec<f64> = (0..2).map(|c| (sa[c].2 + sb[c].2) / 2.0).collect();
    assert_close(&f64s(&r.running_mean), &rm, 1e-6);
    assert_close(&f64s(&r.running_var), &rv, 1e-6);
    // wrong channels / one value per channel: Err, and no state change
    assert!(bn
        .forward(&Tensor::zeros(&[2, 3, 2, 2], DType::F32).unwrap())
        .is_err());
    assert!(bn
        .forward(&Tensor::zeros(&[1, 2, 1, 1], DType::F32).unwrap())
        .is_err());
    assert_eq!(r.num_batches_tracked.item::<i64>().unwrap(), 2);
}

#[test]
fn layernorm_forward() {
    let ln = LayerNorm::new(&[2, 3]).unwrap();
    // non-trivial affine parameters, set through the state dict
    let wv = values(6, 40, 1.0);
    let bv = values(6, 41, 1.0);
    let mut sd = StateDict::new();
    sd.insert("weight", tensor_f64(&wv, &[2, 3]));
    sd.insert("bias", tensor_f64(&bv, &[2, 3]));
    ln.load_state_dict(&sd, true).unwrap();
    let xv: Vec<f64> = values(4 * 6, 42, 3.0)
        .iter()
        .map(|&v| v as f32 as f64)
        .collect();
    let y = f64s(&ln.forward(&tensor_f32(&xv, &[4, 2, 3])).unwrap());
    let mut want = vec![0.0; 24];
    for r in 0..4 {
        let row = &xv[r * 6..r * 6 + 6];
        let m = row.iter().sum::<f64>() / 6.0;
        let v = row.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / 6.0;
        for j in 0..6 {
            let w = wv[j] as f32 as f64;
            let b = bv[j] as f32 as f64;
            want[r * 6 + j] = (row[j] - m) / (v + 1e-5).sqrt() * w + b;
        }
    }
    assert_close(&y, &want, 1e-5);
    assert!(ln
        .forward(&Tensor::zeros(&[4, 3, 2], DType::F32).unwrap())
        .is_err());
    let plain = LayerNorm::with_config(&[3], 1e-5, false, false).unwrap();
    assert!(plain.named_parameters().is_empty());
}

#[test]
fn embedding_forward() {
    let emb = Embedding::new(5, 3).unwrap();
    let w = f64s(&emb.weight);
    let idx = Tensor::from_vec(vec![4i64, 0, 2, 2], &[2, 2]).unwrap();
    let y = emb.forward(&idx).unwrap();
    assert_eq!(y.shape(), &[2, 2, 3]);
    let want: Vec<f64> = [4, 0, 2, 2]
        .iter()
        .flat_map(|&r| w[r * 3..r * 3 + 3].to_vec())
        .collect();
    assert_close(&f64s(&y), &want, 0.0);
    assert!(emb
        .forward(&Tensor::from_vec(vec![5i64], &[1]).unwrap())
        .is_err());
    assert!(emb
        .forward(&Tensor::from_vec(vec![-1i64], &[1]).unwrap())
        .is_err());
    assert!(emb
        .forward(&Tensor::zeros(&[2], DType::F32).unwrap())
        .is_err());
}

#[test]
fn activations_forward() {
    let xv: Vec<f64> = values(40, 50, 3.0)
        .iter()
        .map(|&v| v as f32 as f64)
        .collect();
    let x = tensor_f32(&xv, &[4, 10]);
    type Ref = fn(f64) -> f64;
    let cases: Vec<(Box<dyn Module>, Ref)> = vec![
        (Box::new(ReLU::new()), |v| v.max(0.0)),
        (Box::new(Sigmoid::new()), |v| 1.0 / (1.0 + (-v).exp())),
        (Box::new(Tanh::new()), f64::tanh),
        (Box::new(SiLU::new()), |v| v / (1.0 + (-v).exp())),
        (Box::new(GELU::new()), |v| {
            0.5 * v * (1.0 + erf(v / 2f64.sqrt()))
        }),
        (
            Box::new(GELU::with_approximate(GeluApproximate::Tanh)),
            |v| {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * v * (1.0 + (k * (v + 0.044715 * v * v * v)).tanh())
            },
        ),
        (Box::new(LeakyReLU::new(0.1)), |v| {
            if v > 0.0 {
                v
            } else {
                0.1 * v
            }
        }),
        (Box::new(Identity::new()), |v| v),
    ];
    for (i, (m, f)) in cases.iter().enumerate() {
        let y = f64s(&m.forward(&x).unwrap());
        let want: Vec<f64> = xv.iter().map(|&v| f(v)).collect();
        assert!(m.named_parameters().is_empty());
        for (g, w) in y.iter().zip(&want) {
            assert!((g - w).abs() < 2e-6, "activation {i}: got {g}, want {w}");
        }
    }
}

#[test]
fn softmax_forward() {
    let xv = values(12, 60, 4.0);
    let x = tensor_f64(&xv, &[3, 4]);
    for (dim, m) in [(1isize, Softmax::new(-1)), (0, Softmax::new(0))] {
        let y = f64s(&m.forward(&x).unwrap());
        let mut want = vec![0.0; 12];
        for i in 0..3 {
            for j in 0..4 {
                let at = |a: usize, b: usize| xv[a * 4 + b];
                let (line, me): (Vec<f64>, f64) = if dim == 1 {
                    ((0..4).map(|k| at(i, k)).collect(), at(i, j))
                } else {
                    ((0..3).map(|k| at(k, j)).collect(), at(i, j))
                };
                let z: f64 = line.iter().map(|v| v.exp()).sum();
                want[i * 4 + j] = me.exp() / z;
            }
        }
        assert_close(&y, &want, 1e-12);
    }
    let ls = f64s(&LogSoftmax::new(1).forward(&x).unwrap());
    let sm = f64s(&Softmax::new(1).forward(&x).unwrap());
    assert_close(&ls, &sm.iter().map(|v| v.ln()).collect::<Vec<_>>(), 1e-12);
    assert!(Softmax::new(2).forward(&x).is_err());
}

#[test]
fn dropout_train_and_eval() {
    let d = Dropout::new(0.3).unwrap();
    let x = Tensor::ones(&[4000], DType::F32).unwrap();
    let y = f64s(&d.forward(&x).unwrap());
    let zeros = y.iter().filter(|&&v| v == 0.0).count();
    // kept values are scaled by 1/(1-p)
    assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6));
    let frac = zeros as f64 / 4000.0;
    assert!((frac - 0.3).abs() < 0.04, "dropped fraction {frac}");
    d.eval();
    assert_eq!(f64s(&d.forward(&x).unwrap()), vec![1.0; 4000]);
    assert!(Dropout::new(1.5).is_err());
    assert!(Dropout::new(-0.1).is_err());
}

#[test]
fn pooling_forward() {
    let s = [2, 2, 5, 6];
    let xv = values(s.iter().product(), 70, 1.0);
    let x = tensor_f64(&xv, &s);
    let at = |n: usize, c: usize, i: isize, j: isize| -> Option<f64> {
        if i < 0 || j < 0 || i >= 5 || j >= 6 {
            return None;
        }
        Some(xv[((n * 2 + c) * 5 + i as usize) * 6 + j as usize])
    };
    // (kernel, stride, padding)
    for (k, st, p) in [(2, 2, 0), (3, 2, 1), (3, 1, 0)] {
        let oh = (5 + 2 * p - k) / st + 1;
        let ow = (6 + 2 * p - k) / st + 1;
        let mp = MaxPool2d::with_config([k; 2], [st; 2], [p; 2]).unwrap();
        let ap = AvgPool2d::with_config([k; 2], [st; 2], [p; 2], true).unwrap();
        let ap_ex = AvgPool2d::with_config([k; 2], [st; 2], [p; 2], false).unwrap();
        let (mut wmax, mut wavg, mut wavg_ex) = (vec![], vec![], vec![]);
        for n in 0..2 {
            for c in 0..2 {
                for y in 0..oh {
                    for xx in 0..ow {
                        let win: Vec<f64> = (0..k)
                            .flat_map(|a| (0..k).map(move |b| (a, b)))
                            .filter_map(|(a, b)| {
                                at(
                                    n,
                                    c,
                                    (y * st + a) as isize - p as isize,
                                    (xx * st + b) as isize - p as isize,
                                )
                            })
                            .collect();
                        wmax.push(win.iter().cloned().fold(f64::NEG_INFINITY, f64::max));
                        let sum: f64 = win.iter().sum();
                        wavg.push(sum / (k * k) as f64);
                        wavg_ex.push(sum / win.len() as f64);
                    }
                }
            }
        }
        assert_close(&f64s(&mp.forward(&x).unwrap()), &wmax, 1e-12);
        assert_close(&f64s(&ap.forward(&x).unwrap()), &wavg, 1e-12);
        assert_close(&f64s(&ap_ex.forward(&x).unwrap()), &wavg_ex, 1e-12);
    }
    // adaptive: PyTorch's bins [floor(i*H/o), ceil((i+1)*H/o))
    let ad = AdaptiveAvgPool2d::new([3, 4]).unwrap();
    let y = ad.forward(&x).unwrap();
    assert_eq!(y.shape(), &[2, 2, 3, 4]);
    let mut want = vec![];
    for n in 0..2 {
        for c in 0..2 {
            for i in 0..3usize {
                for j in 0..4usize {
                    let (h0, h1) = (i * 5 / 3, ((i + 1) * 5).div_ceil(3));
                    let (w0, w1) = (j * 6 / 4, ((j + 1) * 6).div_ceil(4));
                    let mut s = 0.0;
                    for a in h0..h1 {
                        for b in w0..w1 {
                            s += at(n, c, a as isize, b as isize).unwrap();
                        }
                    }
                    want.push(s / ((h1 - h0) * (w1 - w0)) as f64);
                }
            }
        }
    }
    assert_close(&f64s(&y), &want, 1e-12);
    assert!(MaxPool2d::new(0).is_err());
    assert!(AdaptiveAvgPool2d::new([0, 1]).is_err());
    assert!(MaxPool2d::new(2)
        .unwrap()
        .forward(&Tensor::zeros(&[2, 3], DType::F32).unwrap())
        .is_err());
}

#[test]
fn flatten_and_sequential_forward() {
    let x = tensor_f64(&values(2 * 3 * 4 * 5, 80, 1.0), &[2, 3, 4, 5]);
    assert_eq!(Flatten::default().forward(&x).unwrap().shape(), &[2, 60]);
    assert_eq!(Flatten::new(1, 2).forward(&x).unwrap().shape(), &[2, 12, 5]);
    assert_eq!(Flatten::new(0, -1).forward(&x).unwrap().shape(), &[120]);
    assert!(Flatten::new(2, 1).forward(&x).is_err());

    // Sequential chains: compare against calling the same layers by hand
    let seq = Sequential::new()
        .add(Linear::with_dtype(5, 4, true, DType::F64).unwrap())
        .add(ReLU::new())
        .add(Linear::with_dtype(4, 2, true, DType::F64).unwrap());
    let xin = tensor_f64(&values(3 * 5, 81, 1.0), &[3, 5]);
    let want = seq[2]
        .forward(&seq[1].forward(&seq[0].forward(&xin).unwrap()).unwrap())
        .unwrap();
    assert_close(&f64s(&seq.forward(&xin).unwrap()), &f64s(&want), 0.0);
    let ml: ModuleList = vec![Box::new(ReLU::new()) as Box<dyn Module>]
        .into_iter()
        .collect();
    assert!(ml.forward(&xin).is_err());
}
