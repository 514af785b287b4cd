//! batch_norm, layer_norm, embedding/index_select/gather/scatter_add, cat/stack/split/chunk/pad,
//! dropout and the losses against f64 references.

mod common;

use common::*;
use kiln_core::{DType, Reduction, RunningStats, Tensor};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn norms_match_f64(n in 2usize..4, c in 1usize..4, hw in 1usize..4, kind in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        let shape = [n, c, hw, hw];
        let x = make(&shape, kind, DType::F64, &mut rng, |r| r.uniform(-2.0, 2.0));
        let xv = x.to_vec_f64().unwrap();
        let w = make(&[c], Kind::Contiguous, DType::F64, &mut rng, |r| r.uniform(0.5, 1.5));
        let b = make(&[c], Kind::Contiguous, DType::F64, &mut rng, |r| r.uniform(-0.5, 0.5));
        let (wv, bv) = (w.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
        let rm0: Vec<f64> = rng.vec(c, |r| r.uniform(-0.5, 0.5));
        let rv0: Vec<f64> = rng.vec(c, |r| r.uniform(0.5, 1.5));
        let (rm, rv) = (from_f64s(&rm0, &[c], DType::F64), from_f64s(&rv0, &[c], DType::F64));
        let (eps, mom) = (1e-5, 0.1);
        // training: batch statistics normalize; running stats take the unbiased variance
        let y = x.batch_norm(Some(&w), Some(&b), Some(RunningStats { mean: &rm, var: &rv, momentum: mom }), true, eps).unwrap();
        let per_c = |ch: usize| -> Vec<f64> { xv.iter().enumerate().filter(|(i, _)| unravel(*i, &shape)[1] == ch).map(|(_, &v)| v).collect() };
        let mut want = vec![0.0; xv.len()];
        let (mut want_rm, mut want_rv) = (vec![0.0; c], vec![0.0; c]);
        for ch in 0..c {
            let v = per_c(ch);
            let m = v.iter().sum::<f64>() / v.len() as f64;
            let var = v.iter().map(|a| (a - m).powi(2)).sum::<f64>() / v.len() as f64;
            for (i, &xi) in xv.iter().enumerate() {
                if unravel(i, &shape)[1] == ch {
                    want[i] = (xi - m) / (var + eps).sqrt() * wv[ch] + bv[ch];
                }
            }
            want_rm[ch] = (1.0 - mom) * rm0[ch] + mom * m;
            want_rv[ch] = (1.0 - mom) * rv0[ch] + mom * var * v.len() as f64 / (v.len() - 1) as f64;
        }
        check(&y, &want, &shape, DType::F64, "batch_norm train");
        check(&rm, &want_rm, &[c], DType::F64, "running_mean");
        check(&rv, &want_rv, &[c], DType::F64, "running_var");
        // eval: running stats normalize, and are left alone
        let y = x.batch_norm(None, Some(&b), Some(RunningStats { mean: &rm, var: &rv, momentum: mom }), false, eps).unwrap();
        let want: Vec<f64> = xv.iter().enumerate().map(|(i, &xi)| { let ch = unravel(i, &shape)[1]; (xi - want_rm[ch]) / (want_rv[ch] + eps).sqrt() + bv[ch] }).collect();
        check(&y, &want, &shape, DType::F64, "batch_norm eval");
        check(&rm, &want_rm, &[c], DType::F64, "running_mean after eval");
        // layer_norm over the last two dims with elementwise affine
        let norm = [hw, hw];
        let lw = make(&norm, Kind::Contiguous, DType::F64, &mut rng, |r| r.uniform(0.5, 1.5));
        let lwv = lw.to_vec_f64().unwrap();
        let y = x.layer_norm(&norm, Some(&lw), Some(&b.reshape([c, 1, 1]).unwrap().expand([c, hw, hw]).unwrap().select(0, 0).unwrap()), eps).unwrap();
        let k = hw * hw;
        let mut want = vec![0.0; xv.len()];
        for (r, row) in xv.chunks(k).enumerate() {
            let m = row.iter().sum::<f64>() / k as f64;
            let var = row.iter().map(|a| (a - m).powi(2)).sum::<f64>() / k as f64;
            for j in 0..k {
                want[r * k + j] = (row[j] - m) / (var + eps).sqrt() * lwv[j] + bv[0];
            }
        }
        check(&y, &want, &shape, DType::F64, "layer_norm");
    }

    #[test]
    fn indexing_matches_f64(shape in shape_nz(1, 3, 4), kind in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        let r = shape.len();
        let d = rng.below(r);
        let x = make(&shape, kind, DType::F32, &mut rng, |r| r.uniform(-2.0, 2.0));
        let xv = x.to_vec_f64().unwrap();
        // gather: index shape <= input shape outside dim, any size along dim
        let mut ishape: Vec<usize> = shape.iter().map(|&n| 1 + rng.below(n)).collect();
        ishape[d] = rng.below(4);
        let iv: Vec<f64> = rng.vec(numel(&ishape), |q| q.below(shape[d]) as f64);
        let idx = from_f64s(&iv, &ishape, DType::I64);
        let want: Vec<f64> = (0..iv.len()).map(|i| { let mut p = unravel(i, &ishape); p[d] = iv[i] as usize; xv[ravel(&p, &shape)] }).collect();
        check(&x.gather(d as isize, &idx).unwrap(), &want, &ishape, DType::F32, "gather");
        // scatter_add of a src of the index's shape
        let src = make(&ishape, Kind::Contiguous, DType::F32, &mut rng, |r| r.uniform(-1.0, 1.0));
        let sv = src.to_vec_f64().unwrap();
        let mut want = xv.clone();
        for i in 0..iv.len() { let mut p = unravel(i, &ishape); p[d] = iv[i] as usize; want[ravel(&p, &shape)] += sv[i]; }
        check(&x.scatter_add(d as isize, &idx, &src).unwrap(), &want, &shape, DType::F32, "scatter_add");
        // index_select with repeats, as int32
        let nsel = rng.below(5);
        let sel: Vec<f64> = rng.vec(nsel, |q| q.below(shape[d]) as f64);
        let st = from_f64s(&sel, &[sel.len()], DType::I32);
        let mut oshape = shape.clone();
        oshape[d] = sel.len();
        let want: Vec<f64> = (0..numel(&oshape)).map(|i| { let mut p = unravel(i, &oshape); p[d] = sel[p[d]] as usize; xv[ravel(&p, &shape)] }).collect();
        check(&x.index_select(d as isize - r as isize, &st).unwrap(), &want, &oshape, DType::F32, "index_select");
        // embedding of a 2-D index tensor into a [V, D] table
        if r == 2 {
            let ids: Vec<f64> = rng.vec(6, |q| q.below(shape[0]) as f64);
            let e = x.embedding(&from_f64s(&ids, &[2, 3], DType::I64)).unwrap();
            let want: Vec<f64> = ids.iter().flat_map(|&i| xv[i as usize * shape[1]..(i as usize + 1) * shape[1]].to_vec()).collect();
            check(&e, &want, &[2, 3, shape[1]], DType::F32, "embedding");
        }
    }

    #[test]
    fn movement_ops_match_f64(shape in shape(1, 3, 4), kind in kind(), seed: u64) {
        let mut rng = TRng::new(seed);
        let r = shape.len();
        let d = rng.below(r);
        let x = make(&shape, kind, DType::F64, &mut rng, |r| r.uniform(-2.0, 2.0));
        let xv = x.to_vec_f64().unwrap();
        // cat with a partner that differs along d (dtype promoted from f32)
        let mut s2 = shape.clone();
        s2[d] = rng.below(3);
        let y = make(&s2, Kind::Permuted, DType::F32, &mut rng, |r| r.uniform(-2.0, 2.0));
        let yv = y.to_vec_f64().unwrap();
        let mut cs = shape.clone();
        cs[d] += s2[d];
        let want: Vec<f64> = (0..numel(&cs)).map(|i| { let mut p = unravel(i, &cs); if p[d] < shape[d] { xv[ravel(&p, &shape)] } else { p[d] -= shape[d]; yv[ravel(&p, &s2)] } }).collect();
        check(&Tensor::cat(&[&x, &y], d as isize).unwrap(), &want, &cs, DType::F64, "cat");
        // stack of x with -x along a new dim
        let nx = x.neg().unwrap();
        let sd = rng.below(r + 1);
        let mut ss = shape.clone();
        ss.insert(sd, 2);
        let want: Vec<f64> = (0..numel(&ss)).map(|i| { let mut p = unravel(i, &ss); let which = p.remove(sd); let v = xv[ravel(&p, &shape)]; if which == 0 { v } else { -v } }).collect();
        check(&Tensor::stack(&[&x, &nx], sd as isize).unwrap(), &want, &ss, DType::F64, "stack");
        // split / chunk: pieces concatenate back, sizes as PyTorch
        let size = 1 + rng.below(3);
        let parts = x.split(size, d as isize).unwrap();
        let n = shape[d];
        prop_assert_eq!(parts.len(), n.div_ceil(size));
        for (i, p) in parts.iter().enumerate() { prop_assert_eq!(p.shape()[d], size.min(n - i * size)); }
        if !parts.is_empty() {
            let back = Tensor::cat(&parts.iter().collect::<Vec<_>>(), d as isize).unwrap();
            check(&back, &xv, &shape, DType::F64, "split+cat");
        }
        let chunks = 1 + rng.below(4);
        let cparts = x.chunk(chunks, d as isize).unwrap();
        let csz = n.div_ceil(chunks).max(1);
        prop_assert_eq!(cparts.len(), n.div_ceil(csz));
        // pad the last one or two dims with a value
        let np = r.min(2);
        let pads: Vec<usize> = (0..2 * np).map(|_| rng.below(3)).collect();
        let mut ps = shape.clone();
        for i in 0..np { ps[r - 1 - i] += pads[2 * i] + pads[2 * i + 1]; }
        let want: Vec<f64> = (0..numel(&ps)).map(|i| {
            let mut p = unravel(i, &ps);
            for k in 0..np {
                let dd = r - 1 - k;
                if p[dd] < pads[2 * k] || p[dd] >= pads[2 * k] + shape[dd] { return 7.5; }
                p[dd] -= pads[2 * k];
            }
            xv[ravel(&p, &shape)]
        }).collect();
        check(&x.pad(&pads, 7.5).unwrap(), &want, &ps, DType::F64, "pad");
    }

    #[test]
    fn losses_match_f64(n in 1usize..5, c in 2usize..5, extra in 0usize..3, smoothing in prop::sample::select(vec![0.0, 0.1, 0.3]), ignore: bool, seed: u64) {
        let mut rng = TRng::new(seed);
        let shape = if extra > 0 { vec![n, c, extra] } else { vec![n, c] };
        let tshape: Vec<usize> = shape.iter().enumerate().filter(|(i, _)| *i != 1).map(|(_, &v)| v).collect();
        let x = make(&shape, Kind::Permuted, DType::F64, &mut rng, |r| r.uniform(-3.0, 3.0));
        let xv = x.to_vec_f64().unwrap();
        let tv: Vec<f64> = rng.vec(numel(&tshape), |r| r.below(c) as f64);
        // ignore class 0 (some rows) when asked
        let ig = if ignore { Some(0i64) } else { None };
        let t = from_f64s(&tv, &tshape, DType::I64);
        let rows: Vec<(Vec<f64>, usize)> = (0..tv.len()).map(|i| {
            let p = unravel(i, &tshape);
            let logits = (0..c).map(|k| { let mut q = p.clone(); q.insert(1, k); xv[ravel(&q, &shape)] }).collect();
            (logits, tv[i] as usize)
        }).collect();
        let mut ce = Vec::new();
        let mut nll = Vec::new();
        let mut valid = 0.0;
        for (l, tgt) in &rows {
            let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + l.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            let lp: Vec<f64> = l.iter().map(|v| v - lse).collect();
            let keep = ig != Some(*tgt as i64);
            valid += keep as u8 as f64;
            let smooth = -lp.iter().sum::<f64>() / c as f64;
            ce.push(if keep { (1.0 - smoothing) * -lp[*tgt] + smoothing * smooth } else { 0.0 });
            nll.push(if keep { -l[*tgt] } else { 0.0 });
        }
        for (red, f) in [(Reduction::None, None), (Reduction::Sum, Some(1.0)), (Reduction::Mean, Some(valid))] {
            let got = x.cross_entropy(&t, ig, smoothing, red).unwrap();
            let got_nll = x.nll_loss(&t, ig, red).unwrap();
            match f {
                None => {
                    check(&got, &ce, &tshape, DType::F64, "cross_entropy none");
                    check(&got_nll, &nll, &tshape, DType::F64, "nll_loss none");
                }
                Some(div) => {
                    check(&got, &[ce.iter().sum::<f64>() / div], &[], DType::F64, &format!("cross_entropy {red:?}"));
                    check(&got_nll, &[nll.iter().sum::<f64>() / div], &[], DType::F64, &format!("nll_loss {red:?}"));
                }
            }
        }
        // mse and bce-with-logits (logits include exact zeros and large magnitudes)
        let y = make(&shape, Kind::Contiguous, DType::F64, &mut rng, |r| r.unit());
        let yv = y.to_vec_f64().unwrap();
        let xs = make(&shape, Kind::Strided, DType::F64, &mut rng, |r| [0.0, r.uniform(-40.0, 40.0), r.uniform(-3.0, 3.0)][r.below(3)]);
        let xsv = xs.to_vec_f64().unwrap();
        let mse: Vec<f64> = xsv.iter().zip(&yv).map(|(a, b)| (a - b).powi(2)).collect();
        // reference: the exact stable form max(x,0) - x*y + log1p(exp(-|x|))
        let bce_ref: Vec<f64> = xsv.iter().zip(&yv).map(|(&a, &b)| a.max(0.0) - a * b + (-a.abs()).exp().ln_1p()).collect();
        check(&xs.mse_loss(&y, Reduction::None).unwrap(), &mse, &shape, DType::F64, "mse none");
        check(&xs.mse_loss(&y, Reduction::Mean).unwrap(), &[mse.iter().sum::<f64>() / mse.len() as f64], &[], DType::F64, "mse mean");
        check(&xs.binary_cross_entropy_with_logits(&y, Reduction::None).unwrap(), &bce_ref, &shape, DType::F64, "bce none");
        check(&xs.binary_cross_entropy_with_logits(&y, Reduction::Sum).unwrap(), &[bce_ref.iter().sum::<f64>()], &[], DType::F64, "bce sum");
    }
}

#[test]
fn dropout_is_seeded_and_scales_kept_values() -> kiln_core::Result<()> {
    let x = Tensor::ones(&[40, 50], DType::F32)?;
    for p in [0.1, 0.5, 0.8] {
        kiln_core::manual_seed(123);
        let a = x.dropout(p, true)?.to_vec::<f32>()?;
        kiln_core::manual_seed(123);
        let b = x.dropout(p, true)?.to_vec::<f32>()?;
        assert_eq!(a, b, "same seed, same mask");
        let kept = a.iter().filter(|&&v| v != 0.0).count() as f64 / a.len() as f64;
        // 2000 Bernoulli draws: 4 standard deviations is < 0.045
        assert!((kept - (1.0 - p)).abs() < 0.045, "p={p}: kept {kept}");
        let scale = (1.0 / (1.0 - p)) as f32;
        assert!(
            a.iter().all(|&v| v == 0.0 || (v - scale).abs() < 1e-6),
            "kept values scaled by 1/(1-p)"
        );
        let c = x.dropout(p, true)?.to_vec::<f32>()?;
        assert_ne!(a, c, "the generator advances between calls");
    }
    assert_eq!(x.dropout(0.5, false)?.to_vec::<f32>()?, x.to_vec::<f32>()?);
    assert_eq!(x.dropout(1.0, true)?.to_vec::<f32>()?, vec![0.0; 2000]);
    assert_eq!(x.dropout(0.0, true)?.to_vec::<f32>()?, x.to_vec::<f32>()?);
    Ok(())
}

/// A contiguous view that starts inside its storage (rows 2.. of a table): gather reads it in place,
/// so positions must be taken from the view's offset, not the storage's start.
#[test]
fn gather_from_an_offset_contiguous_view() -> kiln_core::Result<()> {
    let table = Tensor::arange(0.0, 30.0, 1.0, DType::F32)?.reshape([6, 5])?;
    let rows = table.narrow(0, 2, 3)?; // values 10..25
    assert!(rows.is_contiguous() && rows.offset() == 10);
    let ids = Tensor::from_vec(vec![2i64, 0, 1], &[3])?;
    let e = rows.embedding(&ids)?.to_vec::<f32>()?;
    let want: Vec<f32> = [20.0, 10.0, 15.0]
        .iter()
        .flat_map(|&start: &f32| (0..5).map(move |j| start + j as f32))
        .collect();
    assert_eq!(e, want);
    let idx = Tensor::from_vec(vec![4i64, 0, 3], &[3, 1])?;
    assert_eq!(
        rows.gather(1, &idx)?.to_vec::<f32>()?,
        vec![14.0, 15.0, 23.0]
    );
    Ok(())
}
