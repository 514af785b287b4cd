//! Every op on the GPU against the CPU float64 reference, forward and backward, on seeded random
//! shapes (broadcasting, non-contiguous views, size-0 and size-1 dims).
//!
//! A custom harness (libtest-mimic) so that a machine without CUDA reports these tests as ignored,
//! with a count, instead of passing them silently: `cargo test` prints "N ignored", nextest
//! "N skipped".

mod gpu;

use gpu::harness::{check_fwd, check_grad, input, Rng, CUDA};
use kiln_core::{DType, Device, Reduction, Result, Tensor};
use libtest_mimic::{Arguments, Failed, Trial};

type Check = fn() -> std::result::Result<(), String>;

fn trial(name: &str, f: Check, available: bool) -> Trial {
    Trial::test(name, move || f().map_err(Failed::from)).with_ignored_flag(!available)
}

/// Random operands for an elementwise op with `arity` inputs, broadcast against the first.
fn operands(rng: &mut Rng, arity: usize, lo: f64, hi: f64) -> Result<Vec<Tensor>> {
    let s = rng.shape(true);
    let strided = rng.below(2) == 0;
    let mut v = vec![input(rng, &s, lo, hi, strided)?];
    for _ in 1..arity {
        let b = rng.broadcast_of(&s);
        let strided = rng.below(2) == 0;
        v.push(input(rng, &b, lo, hi, strided)?);
    }
    Ok(v)
}

const CASES: u64 = 12;

macro_rules! unary_test {
    ($name:ident, $lo:expr, $hi:expr, $tol:expr, $f:expr) => {
        fn $name() -> std::result::Result<(), String> {
            for seed in 0..CASES {
                let mut rng = Rng::new(seed);
                let xs = operands(&mut rng, 1, $lo, $hi).map_err(|e| e.to_string())?;
                let f: fn(&Tensor) -> Result<Tensor> = $f;
                check_fwd(stringify!($name), &xs, $tol, |x| f(&x[0]))?;
                if seed % 3 == 0 {
                    check_grad(stringify!($name), &xs, $tol, |x| f(&x[0]))?;
                }
            }
            Ok(())
        }
    };
}

unary_test!(unary_exp, -3.0, 3.0, 1e-6, |x| x.exp());
unary_test!(unary_log, 0.1, 4.0, 1e-6, |x| x.log());
unary_test!(unary_log1p, -0.5, 4.0, 1e-6, |x| x.log1p());
unary_test!(unary_sqrt, 0.1, 4.0, 1e-6, |x| x.sqrt());
unary_test!(unary_sin, -4.0, 4.0, 1e-6, |x| x.sin());
unary_test!(unary_cos, -4.0, 4.0, 1e-6, |x| x.cos());
unary_test!(unary_tanh, -3.0, 3.0, 1e-6, |x| x.tanh());
unary_test!(unary_erf, -2.0, 2.0, 1e-6, |x| x.erf());
unary_test!(unary_neg_abs, -2.0, 2.0, 1e-7, |x| x.neg()?.abs());
unary_test!(unary_floor_sign, -3.0, 3.0, 1e-7, |x| x
    .floor()?
    .add(&x.sign()?));
unary_test!(unary_recip, 0.5, 3.0, 1e-6, |x| x.reciprocal());
unary_test!(act_sigmoid, -4.0, 4.0, 1e-6, |x| x.sigmoid());
unary_test!(act_relu, -2.0, 2.0, 1e-7, |x| x.relu());
unary_test!(act_gelu, -3.0, 3.0, 1e-6, |x| x.gelu());
unary_test!(act_silu, -3.0, 3.0, 1e-6, |x| x.silu());
unary_test!(scalar_ops, -2.0, 2.0, 1e-6, |x| x
    .mul(3.0)?
    .add(0.5)?
    .pow(2.0));
unary_test!(clamp, -2.0, 2.0, 1e-7, |x| x.clamp(Some(-0.5), Some(0.7)));

macro_rules! binary_test {
    ($name:ident, $lo:expr, $hi:expr, $tol:expr, $f:expr) => {
        binary_test!($name, $lo, $hi, $tol, true, $f);
    };
    ($name:ident, $lo:expr, $hi:expr, $tol:expr, $grad:expr, $f:expr) => {
        fn $name() -> std::result::Result<(), String> {
            for seed in 0..CASES {
                let mut rng = Rng::new(100 + seed);
                let xs = operands(&mut rng, 2, $lo, $hi).map_err(|e| e.to_string())?;
                let f: fn(&Tensor, &Tensor) -> Result<Tensor> = $f;
                check_fwd(stringify!($name), &xs, $tol, |x| f(&x[0], &x[1]))?;
                if $grad && seed % 3 == 0 {
                    check_grad(stringify!($name), &xs, $tol, |x| f(&x[0], &x[1]))?;
                }
            }
            Ok(())
        }
    };
}

binary_test!(binary_add, -2.0, 2.0, 1e-7, |a, b| a.add(b));
binary_test!(binary_sub, -2.0, 2.0, 1e-7, |a, b| a.sub(b));
binary_test!(binary_mul, -2.0, 2.0, 1e-7, |a, b| a.mul(b));
binary_test!(binary_div, 0.5, 2.0, 1e-6, |a, b| a.div(b));
binary_test!(binary_pow, 0.5, 2.0, 1e-6, |a, b| a.pow(b));
binary_test!(binary_max_min, -2.0, 2.0, 1e-7, |a, b| a
    .maximum(b)?
    .add(&a.minimum(b)?));
binary_test!(compare_where, -2.0, 2.0, 1e-7, |a, b| Tensor::where_(
    &a.gt(b)?,
    a,
    b
));
// comparisons have no gradient: forward only
binary_test!(compare_all, -2.0, 2.0, 1e-7, false, |a, b| {
    let r = a.lt(b)?.to_dtype(DType::F32)?;
    let r = r.add(&a.le(b)?.to_dtype(DType::F32)?.mul(2.0)?)?;
    let r = r.add(
        &a.eq(b)?
            .logical_or(&a.ne(b)?)?
            .to_dtype(DType::F32)?
            .mul(4.0)?,
    )?;
    r.add(
        &a.ge(b)?
            .logical_and(&a.gt(b)?.logical_not()?)?
            .to_dtype(DType::F32)?,
    )
});

macro_rules! reduce_test {
    ($name:ident, $tol:expr, $grad:expr, $f:expr) => {
        fn $name() -> std::result::Result<(), String> {
            for seed in 0..CASES {
                let mut rng = Rng::new(200 + seed);
                let mut s = rng.shape(false);
                if s.is_empty() {
                    s.push(1 + rng.below(5));
                }
                if seed == 1 {
                    s = vec![3, 1000]; // long rows: the block reduction with several warps
                }
                let strided = rng.below(2) == 0;
                let x = input(&mut rng, &s, -2.0, 2.0, strided).map_err(|e| e.to_string())?;
                let dim = rng.below(s.len()) as isize;
                let f: fn(&Tensor, isize) -> Result<Tensor> = $f;
                check_fwd(stringify!($name), std::slice::from_ref(&x), $tol, |x| {
                    f(&x[0], dim)
                })?;
                if $grad && seed % 3 == 0 {
                    check_grad(stringify!($name), &[x], $tol, |x| f(&x[0], dim))?;
                }
            }
            Ok(())
        }
    };
}

/// A few long rows (batch norm's per-channel sums, full sums) take two passes, chunks then
/// partials (`kernels/reduce.rs`): each reduction against the CPU, on a contiguous and a permuted
/// (strided) input, with gradients for the sum.
fn reduce_long_rows_split() -> std::result::Result<(), String> {
    let mut rng = Rng::new(290);
    for strided in [false, true] {
        let x = input(&mut rng, &[64, 3, 40, 40], -2.0, 2.0, strided).map_err(|e| e.to_string())?;
        check_fwd("per-channel sum", std::slice::from_ref(&x), 1e-6, |x| {
            x[0].sum(&[0, 2, 3], true)
        })?;
        check_fwd("per-channel max", std::slice::from_ref(&x), 1e-7, |x| {
            x[0].max(&[0, 2, 3], false)
        })?;
        check_fwd("per-channel min", std::slice::from_ref(&x), 1e-7, |x| {
            x[0].min(&[0, 2, 3], false)
        })?;
        check_fwd("batch-norm variance", std::slice::from_ref(&x), 1e-5, |x| {
            x[0].var(&[0, 2, 3], 0, false)
        })?;
        check_fwd("full sum", std::slice::from_ref(&x), 1e-6, |x| {
            x[0].sum_all()
        })?;
        check_grad("per-channel sum", &[x], 1e-6, |x| {
            x[0].sum(&[0, 2, 3], false)
        })?;
    }
    let long = input(&mut rng, &[1 << 20], -2.0, 2.0, false).map_err(|e| e.to_string())?;
    check_fwd("sum of 2^20", std::slice::from_ref(&long), 1e-6, |x| {
        x[0].sum_all()
    })?;
    let ints = long
        .mul(100.0)
        .and_then(|t| t.to_dtype(DType::I64))
        .map_err(|e| e.to_string())?;
    check_fwd("i64 sum of 2^20", std::slice::from_ref(&ints), 0.0, |x| {
        x[0].sum_all()
    })
}

/// The squared-deviations prim (moment sums fused by the runtime: `reduce::launch_f64_sum`)
/// equals its definition run as prims (x in f64, its square, two sums:
/// `kiln_core::ops::reduce::sum_sq_dev_as_ops`) to the bit: f32 and half operands, channels-last
/// views, rows split into chunks, rows a block takes, rows a thread takes, an empty reduction.
fn squared_deviations_fused_equal_their_prims() -> std::result::Result<(), String> {
    use kiln_core::prim::{Prim, ReduceOp};
    let e = |e: kiln_core::Error| e.to_string();
    let mut rng = Rng::new(17);
    // [N, C, H, W] reduced over N, H, W (a batch norm's statistics)
    let shapes: [[usize; 4]; 4] = [[64, 3, 40, 40], [4, 5, 6, 7], [3, 17, 1, 2], [0, 3, 2, 2]];
    for shape in shapes {
        for channels_last in [false, true] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let [n, c, h, w] = shape;
                let x = match channels_last {
                    false => input(&mut rng, &shape, 98.0, 102.0, false).and_then(|x| x.to(CUDA)),
                    true => input(&mut rng, &[n, h, w, c], 98.0, 102.0, false)
                        .and_then(|x| x.to(CUDA))
                        .and_then(|x| x.permute(&[0, 3, 1, 2])),
                }
                .and_then(|x| x.to_dtype(dtype))
                .map_err(e)?;
                let dims = [0, 2, 3];
                let what = format!("{shape:?} {dtype} channels-last {channels_last}");
                let fused = kiln_core::dispatch::apply(
                    Prim::Reduce {
                        op: ReduceOp::SumSqDev,
                        dims: dims.to_vec(),
                    },
                    &[&x],
                )
                .map_err(e)?;
                let prims = kiln_core::ops::reduce::sum_sq_dev_as_ops(&x, &dims).map_err(e)?;
                let bits = |t: &Tensor| -> Result<Vec<u32>> {
                    Ok(t.to_dtype(DType::F32)?
                        .to(Device::Cpu)?
                        .to_vec::<f32>()?
                        .into_iter()
                        .map(f32::to_bits)
                        .collect())
                };
                let (f, p) = (bits(&fused).map_err(e)?, bits(&prims).map_err(e)?);
                if f != p || f.len() != c {
                    return Err(format!("{what}: fused {f:x?} vs prims {p:x?}"));
                }
            }
        }
    }
    Ok(())
}

reduce_test!(reduce_sum, 1e-6, true, |x, d| x.sum(&[d], true));
reduce_test!(reduce_sum_all, 1e-6, true, |x, _| x.sum_all());
reduce_test!(reduce_sum_two_dims, 1e-6, true, |x, d| {
    let r = x.rank() as isize;
    if r < 2 {
        x.sum(&[d], false)
    } else {
        x.sum(&[0, r - 1], false)
    }
});
reduce_test!(reduce_mean, 1e-6, true, |x, d| x.mean(&[d], false));
reduce_test!(reduce_max, 1e-7, true, |x, d| x.max(&[d], true));
reduce_test!(reduce_min, 1e-7, false, |x, d| x.min(&[d], false));
reduce_test!(reduce_prod, 1e-5, false, |x, d| x.prod(&[d], true));
reduce_test!(reduce_var, 1e-5, true, |x, d| x.var(&[d], 1, true));
reduce_test!(reduce_logsumexp, 1e-6, true, |x, d| x
    .logsumexp(&[d], false));
// f32 softmax backward cancels (g - sum(g*y)): 1e-6 is below its rounding
reduce_test!(softmax, 1e-5, true, |x, d| x.softmax(d));
reduce_test!(log_softmax, 1e-6, true, |x, d| x.log_softmax(d));
reduce_test!(argmax, 0.0, false, |x, d| x.argmax(Some(d), false));

fn layer_norm() -> std::result::Result<(), String> {
    for seed in 0..CASES {
        let mut rng = Rng::new(300 + seed);
        let (b, n) = (1 + rng.below(6), 1 + rng.below(300));
        let e = |x: kiln_core::Error| x.to_string();
        let x = input(&mut rng, &[b, n], -2.0, 2.0, seed % 2 == 0).map_err(e)?;
        let w = input(&mut rng, &[n], 0.5, 1.5, false).map_err(e)?;
        let bias = input(&mut rng, &[n], -0.5, 0.5, false).map_err(e)?;
        check_grad("layer_norm", &[x, w, bias], 1e-5, |t| {
            t[0].layer_norm(&[n], Some(&t[1]), Some(&t[2]), 1e-5)
        })?;
    }
    Ok(())
}

fn matmul() -> std::result::Result<(), String> {
    let shapes: &[(&[usize], &[usize])] = &[
        (&[3, 4], &[4, 5]),
        (&[1, 7], &[7, 1]),
        (&[2, 3, 8], &[2, 8, 4]),
        (&[4, 3, 8], &[8, 6]),
        (&[33, 65], &[65, 17]),
        (&[0, 4], &[4, 3]),
        (&[3, 0], &[0, 2]),
        (&[128, 256], &[256, 64]),
    ];
    for (i, (a, b)) in shapes.iter().enumerate() {
        let mut rng = Rng::new(400 + i as u64);
        let e = |x: kiln_core::Error| x.to_string();
        let x = input(&mut rng, a, -1.0, 1.0, i % 2 == 1).map_err(e)?;
        let y = input(&mut rng, b, -1.0, 1.0, i % 3 == 2).map_err(e)?;
        check_fwd("matmul", &[x.clone(), y.clone()], 1e-5, |t| {
            t[0].matmul(&t[1])
        })?;
        check_grad("matmul", &[x.clone(), y.clone()], 1e-5, |t| {
            t[0].matmul(&t[1])
        })?;
        // transposed operands are read in place by cuBLAS
        if a.len() == 2 && b.len() == 2 {
            let (xt, yt) = (
                x.t().map_err(e)?.contiguous().map_err(e)?,
                y.t().map_err(e)?.contiguous().map_err(e)?,
            );
            check_fwd("matmul_t", &[xt, yt], 1e-5, |t| {
                t[0].t()?.matmul(&t[1].t()?)
            })?;
        }
    }
    Ok(())
}

fn mlp_training_step() -> std::result::Result<(), String> {
    let mut rng = Rng::new(500);
    let e = |x: kiln_core::Error| x.to_string();
    let x = input(&mut rng, &[16, 20], -1.0, 1.0, false).map_err(e)?;
    let w1 = input(&mut rng, &[32, 20], -0.3, 0.3, false).map_err(e)?;
    let b1 = input(&mut rng, &[32], -0.1, 0.1, false).map_err(e)?;
    let w2 = input(&mut rng, &[10, 32], -0.3, 0.3, false).map_err(e)?;
    let target: Vec<i64> = (0..16).map(|i| (i * 7 % 10) as i64).collect();
    let target = Tensor::from_vec(target, &[16]).map_err(e)?;
    check_grad("mlp", &[x, w1, b1, w2], 1e-5, |t| {
        let h = t[0].linear(&t[1], Some(&t[2]))?.relu()?;
        let logits = h.linear(&t[3], None)?;
        let tgt = target.to(logits.device())?;
        logits.cross_entropy(&tgt, None, 0.0, Reduction::Mean)
    })
}

/// Many inputs, contiguous, offset (a narrowed view), strided (a transpose, copied element by
/// element) and empty, along a middle dim (the table copy's pieces as column blocks of the
/// output) and flat along dim 0 (a foreach optimizer's concatenation: 140 inputs, three
/// launches of the table copy), in f32 and f16: equal to the CPU's.
fn cat_many_inputs() -> std::result::Result<(), String> {
    let mut rng = Rng::new(610);
    let e = |x: kiln_core::Error| x.to_string();
    let mut parts = Vec::new();
    for i in 0..70 {
        let len = (i * 7) % 5;
        let shape = match i % 3 {
            0 => vec![3, len, 5],
            1 => vec![4, len, 5],
            _ => vec![3, 5, len],
        };
        parts.push(input(&mut rng, &shape, -1.0, 1.0, false).map_err(e)?);
    }
    let views = |t: &[Tensor]| -> kiln_core::Result<Vec<Tensor>> {
        t.iter()
            .enumerate()
            .map(|(i, x)| match i % 3 {
                0 => Ok(x.clone()),
                1 => x.narrow(0, 1, 3),
                _ => x.transpose(1, 2),
            })
            .collect()
    };
    check_fwd("cat of 70 along dim 1", &parts, 0.0, |t| {
        let v = views(t)?;
        Tensor::cat(&v.iter().collect::<Vec<_>>(), 1)
    })?;
    check_fwd("cat of 70 along dim 1, f16", &parts, 0.0, |t| {
        let v = views(t)?
            .iter()
            .map(|x| x.to_dtype(DType::F16))
            .collect::<kiln_core::Result<Vec<_>>>()?;
        Tensor::cat(&v.iter().collect::<Vec<_>>(), 1)
    })?;
    let flat: Vec<Tensor> = (0..140)
        .map(|i| input(&mut rng, &[(i * 37) % 300], -1.0, 1.0, false))
        .collect::<kiln_core::Result<_>>()
        .map_err(e)?;
    check_fwd("flat cat of 140", &flat, 0.0, |t| {
        Tensor::cat(&t.iter().collect::<Vec<_>>(), 0)
    })
}

/// `Tensor::assign_many` over 150 pairs (three launches of the table kernel): sizes from 0 up,
/// offset windows of one buffer, a transposed destination and an f16 one (copied one by one), a
/// broadcast source, host sources; then pairs that must read as if written in order (a source
/// that is a later pair's destination, overlapping destinations). Equal to `assign` pair by pair
/// on the CPU.
fn assign_many_pairs() -> std::result::Result<(), String> {
    let e = |x: kiln_core::Error| x.to_string();
    let mut rng = Rng::new(620);
    let mut run = || -> kiln_core::Result<Option<String>> {
        let big = Tensor::zeros(&[4000], DType::F32)?;
        let mut dsts = Vec::new();
        let mut srcs = Vec::new();
        for i in 0..150usize {
            let n = (i * 37) % 1500;
            let (d, s) = match i % 10 {
                // contiguous windows of one buffer, end to end
                3 => (
                    big.narrow(0, (i / 10) * 250, 200)?,
                    input(&mut rng, &[200], -1.0, 1.0, false)?,
                ),
                5 => (
                    Tensor::zeros(&[7, 5], DType::F32)?.t()?,
                    input(&mut rng, &[5, 7], -1.0, 1.0, false)?,
                ),
                7 => (
                    Tensor::zeros(&[n], DType::F16)?,
                    input(&mut rng, &[n], -1.0, 1.0, false)?,
                ),
                8 => (
                    Tensor::zeros(&[3, n], DType::F32)?,
                    input(&mut rng, &[n], -1.0, 1.0, false)?.expand([3, n])?,
                ),
                _ => (
                    Tensor::zeros(&[n], DType::F32)?,
                    input(&mut rng, &[n], -1.0, 1.0, false)?,
                ),
            };
            dsts.push(d);
            srcs.push(s);
        }
        // the windows and the transpose are rebuilt on the device below; the rest move as values
        let on_gpu = |t: &Tensor| t.contiguous()?.to(CUDA);
        let big_gpu = big.to(CUDA)?;
        let gpu_dsts = dsts
            .iter()
            .enumerate()
            .map(|(i, d)| match i % 10 {
                3 => big_gpu.narrow(0, (i / 10) * 250, 200),
                5 => Tensor::zeros(&[7, 5], DType::F32)?.to(CUDA)?.t(),
                _ => on_gpu(d),
            })
            .collect::<kiln_core::Result<Vec<_>>>()?;
        let gpu_srcs = srcs
            .iter()
            .enumerate()
            .map(|(i, s)| if i % 4 == 1 { Ok(s.clone()) } else { on_gpu(s) })
            .collect::<kiln_core::Result<Vec<_>>>()?;
        let pairs: Vec<(&Tensor, &Tensor)> = gpu_dsts.iter().zip(&gpu_srcs).collect();
        Tensor::assign_many(&pairs)?;
        for (d, s) in dsts.iter().zip(&srcs) {
            d.assign(s)?;
        }
        for (i, (g, c)) in gpu_dsts.iter().zip(&dsts).enumerate() {
            if g.to_vec_f64()? != c.to_vec_f64()? {
                return Ok(Some(format!(
                    "pair {i} ({:?}) differs from assign",
                    c.shape()
                )));
            }
        }
        if big_gpu.to_vec::<f32>()? != big.to_vec::<f32>()? {
            return Ok(Some("the windows' buffer differs from assign's".into()));
        }
        // in order: b <- a, then a <- s (b must get a's old values); c <- a's new values after;
        // two overlapping windows of one buffer, the later one winning
        let a = Tensor::full(&[64], 1.0, DType::F32)?.to(CUDA)?;
        let b = Tensor::zeros(&[64], DType::F32)?.to(CUDA)?;
        let c = Tensor::zeros(&[64], DType::F32)?.to(CUDA)?;
        let s = Tensor::full(&[64], 2.0, DType::F32)?.to(CUDA)?;
        let w = Tensor::zeros(&[100], DType::F32)?.to(CUDA)?;
        let (w1, w2) = (w.narrow(0, 0, 64)?, w.narrow(0, 36, 64)?);
        Tensor::assign_many(&[(&b, &a), (&a, &s), (&c, &a)])?;
        let ones = Tensor::full(&[64], 1.0, DType::F32)?.to(CUDA)?;
        Tensor::assign_many(&[(&w1, &s), (&w2, &ones)])?;
        let got: Vec<f32> = [&a, &b, &c]
            .iter()
            .map(|t| t.sum_all()?.item::<f32>())
            .collect::<kiln_core::Result<_>>()?;
        let wv = w.to_vec::<f32>()?;
        let want_w: Vec<f32> = (0..100).map(|i| if i < 36 { 2.0 } else { 1.0 }).collect();
        if got != [128.0, 64.0, 128.0] || wv != want_w {
            return Ok(Some(format!(
                "pairs not written in order: sums {got:?}, windows {wv:?}"
            )));
        }
        Ok(None)
    };
    match run().map_err(e)? {
        None => Ok(()),
        Some(msg) => Err(msg),
    }
}

fn views_cat_pad_gather() -> std::result::Result<(), String> {
    let mut rng = Rng::new(600);
    let e = |x: kiln_core::Error| x.to_string();
    let x = input(&mut rng, &[4, 6], -1.0, 1.0, true).map_err(e)?;
    let y = input(&mut rng, &[4, 3], -1.0, 1.0, false).map_err(e)?;
    check_grad("cat_pad", &[x.clone(), y], 1e-6, |t| {
        Tensor::cat(&[&t[0], &t[1]], 1)?.pad(&[1, 2, 0, 1], 0.5)
    })?;
    // windows along dim 0 are contiguous with an offset (a bug once: the offset was dropped)
    let z = input(&mut rng, &[2, 6], -1.0, 1.0, false).map_err(e)?;
    check_grad("cat_dim0", &[x.clone(), z], 1e-6, |t| {
        Tensor::cat(&[&t[0], &t[1]], 0)?.pad(&[0, 0, 2, 1], -1.0)
    })?;
    check_grad("views", std::slice::from_ref(&x), 1e-6, |t| {
        t[0].transpose(0, 1)?
            .narrow(0, 1, 4)?
            .reshape(vec![2, 8])?
            .unsqueeze(0)?
            .expand(vec![3, 2, 8])
    })?;
    let idx = Tensor::from_vec(vec![0i64, 3, 1, 3], &[4]).map_err(e)?;
    check_grad("index_select", &[x], 1e-6, |t| {
        t[0].index_select(0, &idx.to(t[0].device())?)
    })
}

fn argmin_ties_and_nan() -> std::result::Result<(), String> {
    let e = |x: kiln_core::Error| x.to_string();
    // ties take the first index; a NaN wins; long rows cross warps and blocks of threads
    let mut v = vec![1.0f32; 3 * 700];
    v[5] = -2.0;
    v[600] = -2.0;
    v[700 + 650] = f32::NAN;
    v[700 + 10] = -5.0;
    v[1400 + 699] = 0.5;
    let x = Tensor::from_vec(v, &[3, 700]).map_err(e)?;
    for f in [Tensor::argmin, Tensor::argmax] {
        let cpu = f(&x, Some(1), false)
            .map_err(e)?
            .to_vec::<i64>()
            .map_err(e)?;
        let gpu = f(&x.to(CUDA).map_err(e)?, Some(1), false).map_err(e)?;
        let gpu = gpu.to_vec::<i64>().map_err(e)?;
        if cpu != gpu {
            return Err(format!("arg-reduction: gpu {gpu:?}, cpu {cpu:?}"));
        }
    }
    Ok(())
}

fn gather_scatter_and_bad_index() -> std::result::Result<(), String> {
    let mut rng = Rng::new(800);
    let e = |x: kiln_core::Error| x.to_string();
    let x = input(&mut rng, &[5, 6], -1.0, 1.0, true).map_err(e)?;
    let idx: Vec<i64> = (0..5 * 4).map(|i| (i * 7 % 6) as i64).collect();
    let idx = Tensor::from_vec(idx, &[5, 4]).map_err(e)?;
    check_grad("gather", std::slice::from_ref(&x), 1e-6, |t| {
        t[0].gather(1, &idx.to(t[0].device())?)
    })?;
    let src = input(&mut rng, &[5, 4], -1.0, 1.0, false).map_err(e)?;
    check_grad("scatter_add", &[x.clone(), src], 1e-6, |t| {
        t[0].scatter_add(1, &idx.to(t[0].device())?, &t[1])
    })?;
    let words = input(&mut rng, &[10, 3], -1.0, 1.0, false).map_err(e)?;
    let ids = Tensor::from_vec(vec![1i64, 9, 1, 0], &[4]).map_err(e)?;
    check_grad("embedding", &[words], 1e-6, |t| {
        t[0].embedding(&ids.to(t[0].device())?)
    })?;
    let bad = Tensor::from_vec(vec![0i64, 6, 1, 2], &[1, 4])
        .map_err(e)?
        .to(CUDA)
        .map_err(e)?;
    // the call does not wait for the device: the error comes at the next synchronization (here
    // the read), names the op, and is reported once
    let xd = x.to(CUDA).map_err(e)?;
    let gathered = xd
        .gather(1, &bad)
        .map_err(|err| format!("gather queued with a bad index failed at the call: {err}"))?;
    match gathered.to_vec::<f32>() {
        Err(err)
            if err.to_string().contains("gather") && err.to_string().contains("out of range") => {}
        other => return Err(format!("gather with index 6 of 6, read back: {other:?}")),
    }
    let good = xd.gather(1, &idx.to(CUDA).map_err(e)?).map_err(e)?;
    good.to_vec::<f32>()
        .map_err(|err| format!("the index error was reported twice: {err}"))?;
    // scatter_add's check, through synchronize
    let src = Tensor::ones(&[1, 4], DType::F32)
        .map_err(e)?
        .to(CUDA)
        .map_err(e)?;
    let _queued = xd.scatter_add(1, &bad, &src).map_err(e)?;
    match kiln_cuda::synchronize(CUDA) {
        Err(err) if err.to_string().contains("scatter_add") => Ok(()),
        other => Err(format!(
            "scatter_add with index 6 of 6, synchronize: {other:?}"
        )),
    }
}

/// A few optimizer steps on GPU parameters (f32) and CPU ones (f64), per-parameter and foreach.
fn optimizers_on_device() -> std::result::Result<(), String> {
    use kiln_nn::optim::{Adam, AdamConfig, Optimizer, SGDConfig, SGD};
    let e = |x: kiln_core::Error| x.to_string();
    let mut rng = Rng::new(900);
    let x = input(&mut rng, &[6, 8], -1.0, 1.0, false).map_err(e)?;
    let w = input(&mut rng, &[8, 5], -0.5, 0.5, false).map_err(e)?;
    let b = input(&mut rng, &[5], -0.5, 0.5, false).map_err(e)?;
    for foreach in [false, true] {
        for adam in [false, true] {
            let mut finals = Vec::new();
            for device in [Device::Cpu, CUDA] {
                let cast = |t: &Tensor| -> Result<Tensor> {
                    match device {
                        Device::Cpu => t.to_dtype(DType::F64),
                        d => t.to(d),
                    }
                };
                let ps = vec![
                    cast(&w).map_err(e)?.with_grad().map_err(e)?,
                    cast(&b).map_err(e)?.with_grad().map_err(e)?,
                ];
                let xs = cast(&x).map_err(e)?;
                let mut opt: Box<dyn Optimizer> = if adam {
                    let cfg = AdamConfig {
                        lr: 0.05,
                        foreach,
                        ..Default::default()
                    };
                    Box::new(Adam::new(ps.clone(), cfg).map_err(e)?)
                } else {
                    let cfg = SGDConfig {
                        lr: 0.1,
                        momentum: 0.9,
                        foreach,
                        ..Default::default()
                    };
                    Box::new(SGD::new(ps.clone(), cfg).map_err(e)?)
                };
                for _ in 0..3 {
                    opt.zero_grad();
                    let loss = xs
                        .matmul(&ps[0])
                        .map_err(e)?
                        .add(&ps[1])
                        .map_err(e)?
                        .tanh()
                        .map_err(e)?
                        .sum_all()
                        .map_err(e)?;
                    loss.backward().map_err(e)?;
                    opt.step().map_err(e)?;
                }
                if ps[0].device() != device {
                    return Err(format!("parameter moved to {}", ps[0].device()));
                }
                finals.push(ps);
            }
            for (g, c) in finals[1].iter().zip(&finals[0]) {
                let err = gpu::harness::rel_err(
                    &g.to_vec_f64().map_err(e)?,
                    &c.to_vec_f64().map_err(e)?,
                )?;
                if err > 1e-5 {
                    return Err(format!(
                        "adam={adam} foreach={foreach}: parameters differ by {err:.2e}"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn conv_and_pool() -> std::result::Result<(), String> {
    let mut rng = Rng::new(1000);
    let e = |x: kiln_core::Error| x.to_string();
    let x = input(&mut rng, &[2, 3, 7, 6], -1.0, 1.0, false).map_err(e)?;
    let w = input(&mut rng, &[4, 3, 3, 3], -0.5, 0.5, false).map_err(e)?;
    check_grad("conv2d", &[x.clone(), w], 1e-5, |t| {
        t[0].conv2d(&t[1], None, [1, 2], [1, 1], [1, 1], 1)
    })?;
    check_grad("max_pool2d", &[x], 1e-6, |t| {
        t[0].max_pool2d([2, 2], [2, 2], [0, 0])
    })
}

fn random_matches_cpu() -> std::result::Result<(), String> {
    let e = |x: kiln_core::Error| x.to_string();
    for normal in [false, true] {
        kiln_core::manual_seed(42);
        let cpu = if normal {
            Tensor::randn(&[1000], DType::F32)
        } else {
            Tensor::rand(&[1000], DType::F32)
        }
        .map_err(e)?;
        kiln_core::manual_seed(42);
        let gpu = if normal {
            Tensor::randn_on(&[1000], DType::F32, CUDA)
        } else {
            Tensor::rand_on(&[1000], DType::F32, CUDA)
        }
        .map_err(e)?;
        let (c, g) = (
            cpu.to_vec::<f32>().map_err(e)?,
            gpu.to_vec::<f32>().map_err(e)?,
        );
        let worst = c
            .iter()
            .zip(&g)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        if worst > 1e-6 {
            return Err(format!(
                "rand (normal={normal}) differs from the CPU's by {worst}"
            ));
        }
    }
    Ok(())
}

fn assign_into_device_view() -> std::result::Result<(), String> {
    let e = |x: kiln_core::Error| x.to_string();
    let base = Tensor::zeros(&[4, 6], DType::F32)
        .map_err(e)?
        .to(CUDA)
        .map_err(e)?;
    let view = base
        .narrow(1, 2, 3)
        .map_err(e)?
        .transpose(0, 1)
        .map_err(e)?;
    let src = Tensor::arange(0.0, 12.0, 1.0, DType::F32)
        .map_err(e)?
        .reshape(vec![3, 4])
        .map_err(e)?;
    view.assign(&src).map_err(e)?; // a host source is copied over
    let want = Tensor::zeros(&[4, 6], DType::F32).map_err(e)?;
    want.narrow(1, 2, 3)
        .map_err(e)?
        .transpose(0, 1)
        .map_err(e)?
        .assign(&src)
        .map_err(e)?;
    if base.to_vec::<f32>().map_err(e)? != want.to_vec::<f32>().map_err(e)? {
        return Err("assign into a strided CUDA view wrote the wrong elements".into());
    }
    // a contiguous destination window with an offset
    let rows = base.narrow(0, 1, 2).map_err(e)?;
    rows.assign(&Tensor::full(&[2, 6], 0.0, DType::F32).map_err(e)?)
        .map_err(e)?;
    let w2 = want.narrow(0, 1, 2).map_err(e)?;
    w2.assign(&Tensor::full(&[2, 6], 0.0, DType::F32).map_err(e)?)
        .map_err(e)?;
    if base.to_vec::<f32>().map_err(e)? != want.to_vec::<f32>().map_err(e)? {
        return Err("assign into rows 1..3 of a CUDA tensor wrote the wrong elements".into());
    }
    let expect: f32 = want.to_vec::<f32>().map_err(e)?.iter().sum();
    let item = base.sum_all().map_err(e)?.item::<f32>().map_err(e)?;
    if item != expect {
        return Err(format!("item after assign: {item}"));
    }
    let shown = format!("{}", base.narrow(0, 0, 1).map_err(e)?);
    if !shown.contains("4.") {
        return Err(format!("display of a CUDA tensor: {shown}"));
    }
    Ok(())
}

fn allocator_steady_state() -> std::result::Result<(), String> {
    let e = |x: kiln_core::Error| x.to_string();
    let x = Tensor::ones(&[1024], DType::F32)
        .map_err(e)?
        .to(CUDA)
        .map_err(e)?;
    let mut y = x.clone();
    for _ in 0..10 {
        y = y.add(&x).map_err(e)?;
    }
    let before = kiln_cuda::memory_stats(CUDA).map_err(e)?;
    for _ in 0..1000 {
        y = y.add(&x).map_err(e)?.mul(0.5).map_err(e)?;
    }
    kiln_cuda::synchronize(CUDA).map_err(e)?;
    let after = kiln_cuda::memory_stats(CUDA).map_err(e)?;
    if after.driver_allocs != before.driver_allocs {
        return Err(format!(
            "steady state called cuMemAlloc: {before:?} -> {after:?}"
        ));
    }
    if after.peak_allocated < after.allocated || after.reserved < after.allocated {
        return Err(format!("inconsistent stats {after:?}"));
    }
    drop(y);
    // the pool's arenas go back whole once none of their blocks is live (other tests' tensors
    // may hold some here; the arenas' own rules are `alloc.rs`'s unit tests)
    kiln_cuda::empty_cache(CUDA).map_err(e)?;
    let emptied = kiln_cuda::memory_stats(CUDA).map_err(e)?;
    kiln_cuda::empty_cache(CUDA).map_err(e)?;
    let again = kiln_cuda::memory_stats(CUDA).map_err(e)?;
    if emptied.reserved > after.reserved
        || emptied.reserved < emptied.allocated
        || again.reserved > emptied.reserved
    {
        return Err(format!(
            "empty_cache: {after:?} -> {emptied:?} -> {again:?}"
        ));
    }
    Ok(())
}

fn events_time_the_device() -> std::result::Result<(), String> {
    let e = |x: kiln_core::Error| x.to_string();
    let x = Tensor::ones(&[1 << 20], DType::F32)
        .map_err(e)?
        .to(CUDA)
        .map_err(e)?;
    let start = kiln_cuda::Event::record(CUDA).map_err(e)?;
    let y = x.exp().map_err(e)?.sum_all().map_err(e)?;
    let end = kiln_cuda::Event::record(CUDA).map_err(e)?;
    let ms = start.elapsed_ms(&end).map_err(e)?;
    if !(ms > 0.0 && ms < 1000.0) {
        return Err(format!("event time {ms} ms"));
    }
    let v = y.item::<f32>().map_err(e)?;
    if (v - (1 << 20) as f32 * std::f32::consts::E).abs() > 1.0 {
        return Err(format!("sum of exp(1) over 2^20: {v}"));
    }
    Ok(())
}

fn mixed_devices_error() -> std::result::Result<(), String> {
    let e = |x: kiln_core::Error| x.to_string();
    let a = Tensor::ones(&[3], DType::F32)
        .map_err(e)?
        .to(CUDA)
        .map_err(e)?;
    let b = Tensor::ones(&[3], DType::F32).map_err(e)?;
    match a.add(&b) {
        Err(err) if err.to_string().contains("Cuda(0)") => Ok(()),
        other => Err(format!("cuda + cpu tensors: {other:?}")),
    }
}

fn main() {
    let mut args = Arguments::from_args();
    // one trial at a time: the allocator and NVRTC counters some trials check are per device, and
    // trials running side by side would move them (allocator_steady_state saw others' cuMemAllocs)
    args.test_threads = Some(1);
    kiln_cuda::init();
    // the convolution checks compare with f32 precision; `cudnn_tf32_switch` turns TF32 on
    kiln_cuda::set_cudnn_allow_tf32(false);
    let available = kiln_cuda::is_available();
    if !available {
        eprintln!(
            "kiln-cuda GPU tests skipped: {}",
            kiln_cuda::unavailable_reason()
                .map(|e| e.to_string())
                .unwrap_or_default()
        );
    }
    let tests: &[(&str, Check)] = &[
        ("unary_exp", unary_exp),
        ("unary_log", unary_log),
        ("unary_log1p", unary_log1p),
        ("unary_sqrt", unary_sqrt),
        ("unary_sin", unary_sin),
        ("unary_cos", unary_cos),
        ("unary_tanh", unary_tanh),
        ("unary_erf", unary_erf),
        ("unary_neg_abs", unary_neg_abs),
        ("unary_floor_sign", unary_floor_sign),
        ("unary_recip", unary_recip),
        ("act_sigmoid", act_sigmoid),
        ("act_relu", act_relu),
        ("act_gelu", act_gelu),
        ("act_silu", act_silu),
        ("scalar_ops", scalar_ops),
        ("clamp", clamp),
        ("binary_add", binary_add),
        ("binary_sub", binary_sub),
        ("binary_mul", binary_mul),
        ("binary_div", binary_div),
        ("binary_pow", binary_pow),
        ("binary_max_min", binary_max_min),
        ("compare_where", compare_where),
        ("compare_all", compare_all),
        ("reduce_sum", reduce_sum),
        ("reduce_long_rows_split", reduce_long_rows_split),
        (
            "squared_deviations_fused_equal_their_prims",
            squared_deviations_fused_equal_their_prims,
        ),
        ("reduce_sum_all", reduce_sum_all),
        ("reduce_sum_two_dims", reduce_sum_two_dims),
        ("reduce_mean", reduce_mean),
        ("reduce_max", reduce_max),
        ("reduce_min", reduce_min),
        ("reduce_prod", reduce_prod),
        ("reduce_var", reduce_var),
        ("reduce_logsumexp", reduce_logsumexp),
        ("softmax", softmax),
        ("log_softmax", log_softmax),
        ("argmax", argmax),
        ("argmin_ties_and_nan", argmin_ties_and_nan),
        ("gather_scatter_and_bad_index", gather_scatter_and_bad_index),
        ("layer_norm", layer_norm),
        ("matmul", matmul),
        ("mlp_training_step", mlp_training_step),
        ("views_cat_pad_gather", views_cat_pad_gather),
        ("cat_many_inputs", cat_many_inputs),
        ("assign_many_pairs", assign_many_pairs),
        ("casts_and_half", gpu::dtypes::casts_and_half),
        (
            "scalar_operands_by_value",
            gpu::dtypes::scalar_operands_by_value,
        ),
        ("optimizers_on_device", optimizers_on_device),
        ("conv_and_pool", conv_and_pool),
        (
            "conv_cudnn_forward_and_backward",
            gpu::conv::cudnn_forward_and_backward,
        ),
        ("conv_cudnn_bias_and_layer", gpu::conv::cudnn_bias_and_layer),
        ("conv_cudnn_channels_last", gpu::conv::cudnn_channels_last),
        ("conv_cudnn_half_types", gpu::conv::cudnn_half_types),
        ("conv_cudnn_tf32_switch", gpu::conv::cudnn_tf32_switch),
        ("conv_cudnn_benchmark_mode", gpu::conv::cudnn_benchmark_mode),
        ("conv_cudnn_plans_on_disk", gpu::conv::cudnn_plans_on_disk),
        ("conv_cudnn_epilogues", gpu::conv_epilogue::cudnn_epilogues),
        (
            "conv_generated_channels_last",
            gpu::conv::generated_channels_last,
        ),
        (
            "conv_generated_channel_slices",
            gpu::conv::generated_channel_slices,
        ),
        (
            "module_to_cuda_and_back",
            gpu::modules::module_to_cuda_and_back,
        ),
        (
            "matmul_half_types",
            gpu::matmul::half_matmul_forward_and_backward,
        ),
        ("cublaslt_epilogues", gpu::matmul::cublaslt_epilogues),
        ("cublaslt_bad_operands", gpu::matmul::cublaslt_bad_operands),
        (
            "matmul_epilogue_prim_without_cublaslt",
            gpu::matmul::matmul_epilogue_prim_without_cublaslt,
        ),
        ("random_matches_cpu", random_matches_cpu),
        ("assign_into_device_view", assign_into_device_view),
        ("allocator_steady_state", allocator_steady_state),
        ("mixed_devices_error", mixed_devices_error),
        ("events_time_the_device", events_time_the_device),
    ];
    let trials = tests.iter().map(|(n, f)| trial(n, *f, available)).collect();
    let _ = Device::Cpu;
    let conclusion = libtest_mimic::run(&args, trials);
    if available {
        // which prims still took the host path: the kernels still to write
        eprintln!("host fallbacks: {:?}", kiln_cuda::host_fallbacks());
        eprintln!(
            "nvrtc (compiles, disk hits): {:?}",
            kiln_cuda::kernel_cache_stats()
        );
    }
    conclusion.exit();
}
