//! The `kiln` backend on the GPU: code over CUDA tensors, compiled (generated CUDA kernels from
//! `kiln-inductor/src/codegen/cuda.rs`, extern steps through the eager CUDA runtime), against the
//! same code run eagerly on the GPU and against the CPU in float64.
//!
//! A custom harness (libtest-mimic): without CUDA these tests are reported as ignored, with a
//! count. On the GPU machine the whole op suite also runs on the device:
//! `KILN_TEST_DEVICE=cuda cargo test -p kiln --test compile_ops`.

use std::sync::Mutex;

#[path = "gpu_compile/autotune.rs"]
mod autotune;
#[path = "gpu_compile/conv_engine.rs"]
mod conv_engine;
#[path = "gpu_compile/conv_epilogues.rs"]
mod conv_epilogues;
#[path = "gpu_compile/cudagraph_arguments.rs"]
mod cudagraph_arguments;
#[path = "gpu_compile/cudagraph_training.rs"]
mod cudagraph_training;
#[path = "gpu_compile/graph_cache.rs"]
mod graph_cache;
#[path = "gpu_compile/losses.rs"]
mod losses;
#[path = "gpu_compile/optimizers.rs"]
mod optimizers;
#[path = "gpu_compile/reduce_overhead.rs"]
mod reduce_overhead;
#[path = "gpu_compile/reductions.rs"]
mod reductions;

use kiln::inductor::exec_stats;
use kiln::nn::optim::Optimizer;
use kiln::nn::{Linear, Module, ReLU, Sequential, Sigmoid};
use kiln::prelude::*;
use libtest_mimic::{Arguments, Failed, Trial};

const CUDA: Device = Device::Cuda(0);
type Outcome = std::result::Result<(), String>;
type Check = fn() -> Outcome;

/// Held by the tests that switch cuDNN's TF32 or the convolution engine (process-wide switches,
/// `kiln_core::backends`) or count what ran on which engine, so that one does not switch them
/// back, or launch generated convolutions, under another running beside it.
static CONV_SWITCHES: Mutex<()> = Mutex::new(());

fn conv_switches() -> std::sync::MutexGuard<'static, ()> {
    CONV_SWITCHES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Each output of `got` within `tol` of `want`'s, relative to `want`'s largest element: a tuned
/// GEMM sums in its algorithm's order, and an element whose terms cancel carries the rounding of
/// the largest terms.
fn close_to_largest(what: &str, got: &[Tensor], want: &[Tensor], tol: f64) -> Outcome {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_vec_f64().map_err(err)?, w.to_vec_f64().map_err(err)?);
        let largest = w.iter().fold(0f64, |m, v| m.max(v.abs()));
        let worst = g
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f64, f64::max);
        if g.len() != w.len() || worst > tol * largest {
            return Err(format!(
                "{what} output {i}: differs by {worst:e} (largest {largest:e}, tolerance {tol:e})"
            ));
        }
    }
    Ok(())
}

fn err(e: kiln::Error) -> String {
    e.to_string()
}

/// ‖got − want‖ / ‖want‖ within `tol`: float32 results against a float64 reference, where
/// values near zero carry the rounding of larger intermediate values (a layer norm's).
fn close(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Outcome {
    let (g, w) = (
        got.to_vec_f64().map_err(err)?,
        want.to_vec_f64().map_err(err)?,
    );
    if g.len() != w.len() {
        return Err(format!("{what}: {} values vs {}", g.len(), w.len()));
    }
    let num: f64 = g.iter().zip(&w).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = w.iter().map(|b| b * b).sum();
    let e = (num / den.max(1e-300)).sqrt();
    if e.is_nan() || e > tol {
        return Err(format!("{what}: relative error {e:.3e} > {tol:.1e}"));
    }
    Ok(())
}

/// `got` equals `want` within `tol` relative to the larger magnitude (0: bitwise).
fn same(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Outcome {
    if got.shape() != want.shape() {
        return Err(format!(
            "{what}: shape {:?} vs {:?}",
            got.shape(),
            want.shape()
        ));
    }
    let (g, w) = (
        got.to_vec_f64().map_err(err)?,
        want.to_vec_f64().map_err(err)?,
    );
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = (a.is_nan() && b.is_nan())
            || a == b
            || (a - b).abs() <= tol * a.abs().max(b.abs()).max(1e-30);
        if !ok {
            return Err(format!(
                "{what}: element {i}: {a:e} vs {b:e} (tolerance {tol:e})"
            ));
        }
    }
    Ok(())
}

/// Each output of `got` equals the one of `want` at its position (`same`), named
/// `<what> output <k>` in a failure.
fn same_outputs(what: &str, got: &[Tensor], want: &[Tensor], tol: f64) -> Outcome {
    if got.len() != want.len() {
        return Err(format!("{what}: {} outputs vs {}", got.len(), want.len()));
    }
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        same(&format!("{what} output {k}"), g, w, tol)?;
    }
    Ok(())
}

/// `got` equals `want` within `tol` of `want`'s largest magnitude, element by element.
fn same_scaled(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Outcome {
    let scale = want
        .to_vec_f64()
        .map_err(err)?
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs()));
    let (g, w) = (
        got.to_vec_f64().map_err(err)?,
        want.to_vec_f64().map_err(err)?,
    );
    if got.shape() != want.shape() {
        return Err(format!(
            "{what}: shape {:?} vs {:?}",
            got.shape(),
            want.shape()
        ));
    }
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        if (a - b).abs() > tol * scale || a.is_nan() != b.is_nan() {
            return Err(format!(
                "{what}: element {i}: {a:e} vs {b:e} (tolerance {tol:e} of {scale:e})"
            ));
        }
    }
    Ok(())
}

/// A two-layer MLP's weights on the GPU (64 → 32 → 10, scaled by 0.1), drawn after
/// `manual_seed(seed)`, requiring grad.
fn mlp_weights(seed: u64) -> Result<Vec<Tensor>> {
    manual_seed(seed);
    [[64usize, 32], [32, 10]]
        .iter()
        .map(|s| {
            Tensor::randn(s, DType::F32)?
                .mul(0.1)?
                .to(CUDA)?
                .with_grad()
        })
        .collect()
}

/// Parameters of `shapes` on the GPU, each with a random gradient, drawn after
/// `manual_seed(seed)`: what an optimizer step reads.
fn params_with_grads(shapes: &[Vec<usize>], seed: u64) -> Result<Vec<Tensor>> {
    manual_seed(seed);
    shapes
        .iter()
        .map(|s| {
            let p = Tensor::randn(s, DType::F32)?.to(CUDA)?.with_grad()?;
            p.set_grad(Some(Tensor::randn(s, DType::F32)?.to(CUDA)?));
            Ok(p)
        })
        .collect()
}

/// `opt`'s step compiled with `opts`: a call takes no arguments, returns nothing, and steps the
/// optimizer behind the lock.
fn compiled_step<O: Optimizer + Send>(
    opt: &Mutex<O>,
    opts: CompileOptions,
) -> std::result::Result<kiln::CompiledFn<'_>, String> {
    kiln::compile_fn(
        move |_: &[Tensor]| {
            opt.lock().unwrap_or_else(|e| e.into_inner()).step()?;
            Ok(vec![])
        },
        opts,
    )
    .map_err(err)
}

fn randn(shape: &[usize], seed: u64) -> Result<Tensor> {
    manual_seed(seed);
    Tensor::randn(shape, DType::F32)
}

/// A call's arguments on the GPU: normal values of `shapes` (the `i`-th seeded `seed + i`), as
/// `dtype`.
fn cuda_randn(shapes: &[&[usize]], seed: u64, dtype: DType) -> Result<Vec<Tensor>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| randn(s, seed + i as u64)?.to_dtype(dtype)?.to(CUDA))
        .collect()
}

/// Runs `f` compiled and eagerly on CUDA copies of `inputs` (twice, with new values the second
/// time) and on float64 CPU copies; checks outputs and that the compiled graph ran generated
/// kernels.
fn differential(
    name: &str,
    shapes: &[&[usize]],
    tol_ref: f64,
    f: fn(&[Tensor]) -> Result<Vec<Tensor>>,
) -> Outcome {
    let compiled = kiln::compile_fn(f, CompileOptions::default()).map_err(err)?;
    for call in 0..2u64 {
        let host: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| randn(s, 100 * call + i as u64))
            .collect::<Result<_>>()
            .map_err(err)?;
        let dev: Vec<Tensor> = host
            .iter()
            .map(|t| t.to(CUDA))
            .collect::<Result<_>>()
            .map_err(err)?;
        let before = exec_stats();
        let got = compiled.call(&dev).map_err(err)?;
        if exec_stats().calls == before.calls {
            return Err(format!("{name}: the compiled graph did not run"));
        }
        let eager = f(&dev).map_err(err)?;
        let f64s: Vec<Tensor> = host
            .iter()
            .map(|t| t.to_dtype(DType::F64))
            .collect::<Result<_>>()
            .map_err(err)?;
        let reference = f(&f64s).map_err(err)?;
        for (k, ((g, e), r)) in got.iter().zip(&eager).zip(&reference).enumerate() {
            if g.device() != CUDA {
                return Err(format!("{name}: output {k} on {}", g.device()));
            }
            // compiled and eager CUDA kernels sum in float64 and call the same math functions
            // without FMA contraction: they agree to the last bit but for summation order
            same(
                &format!("{name} call {call} output {k} vs eager"),
                g,
                e,
                1e-6,
            )?;
            close(
                &format!("{name} call {call} output {k} vs f64"),
                g,
                r,
                tol_ref,
            )?;
        }
    }
    Ok(())
}

/// A kernel taking both the sine and the cosine of one value calls `sincosf` once
/// (`codegen/cuda_sincos.rs`): its results equal eager's separate `sinf` and `cosf` to the bit,
/// f32 and f64, through the vector loop and the scalar one, for arguments small, large (CUDA's
/// slow reduction path), infinite and NaN.
fn sine_and_cosine_of_one_value_match_eager() -> Outcome {
    let f = |a: &[Tensor]| -> Result<Vec<Tensor>> {
        let (s, c) = (a[0].sin()?, a[0].cos()?);
        Ok(vec![s.add(&c)?, s.mul(&c)?])
    };
    let compiled = kiln::compile_fn(f, CompileOptions::default()).map_err(err)?;
    for (n, dtype) in [
        (1 << 20, DType::F32),
        (1001, DType::F32),
        (1 << 16, DType::F64),
    ] {
        let scales = [1.0, 100.0, 1e4, 1e6, 1e30];
        let mut v: Vec<f64> = randn(&[n], 7)
            .and_then(|t| t.to_vec_f64())
            .map_err(err)?
            .iter()
            .enumerate()
            .map(|(i, x)| x * scales[i % scales.len()])
            .collect();
        let specials = [0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN];
        for (i, s) in specials.iter().enumerate() {
            v[i * 97] = *s;
        }
        let x = Tensor::from_vec(v, &[n])
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to(CUDA))
            .map_err(err)?;
        let got = compiled.call(std::slice::from_ref(&x)).map_err(err)?;
        let want = f(std::slice::from_ref(&x)).map_err(err)?;
        same_outputs(&format!("{n} {dtype}"), &got, &want, 0.0)?;
    }
    Ok(())
}

fn pointwise_chain() -> Outcome {
    differential("pointwise_chain", &[&[33, 65], &[65]], 1e-5, |x| {
        let y = x[0].mul(&x[1])?.add(1.0)?.tanh()?.mul(&x[0].sin()?)?;
        Ok(vec![y.exp()?, y.t()?.contiguous()?])
    })
}

/// Pointwise kernels large enough to move four elements per load and store: a length no
/// multiple of four (the tail after the vectors), and an input one element into its buffer (not
/// aligned for a vector: the scalar loop), each equal to eager.
fn vector_loads_any_alignment() -> Outcome {
    differential("vector_tail", &[&[4099], &[4099]], 1e-5, |x| {
        Ok(vec![x[0].mul(&x[1])?.sin()?, x[0].add(2.0)?])
    })?;
    let f = |a: &[Tensor]| -> Result<Vec<Tensor>> { Ok(vec![a[0].mul(&a[1])?.exp()?]) };
    let compiled = kiln::compile_fn(f, CompileOptions::default()).map_err(err)?;
    let base = randn(&[8204], 7).map_err(err)?.to(CUDA).map_err(err)?;
    let y = randn(&[8200], 8).map_err(err)?.to(CUDA).map_err(err)?;
    for start in [0usize, 1, 4] {
        let x = base.narrow(0, start, 8200).map_err(err)?;
        let got = compiled.call(&[x.clone(), y.clone()]).map_err(err)?;
        let want = f(&[x, y.clone()]).map_err(err)?;
        same(&format!("offset {start}"), &got[0], &want[0], 1e-6)?;
    }
    Ok(())
}

/// A vector loop whose lanes share every index but the innermost (`Builder::lane_var`): window
/// taps of a padded channels-last tensor, a per-channel vector and a transposed operand (read a
/// lane at a time) in one kernel; an innermost extent that is no multiple of four; and a
/// per-channel vector one element into its buffer (its vector read unaligned: the scalar loop).
/// Each equal to eager and to float64.
fn vector_lanes_share_outer_indices() -> Outcome {
    differential(
        "vector_lanes_windows",
        &[&[4, 12, 12, 16], &[16], &[16, 12, 12, 4]],
        1e-5,
        |x| {
            let p = x[0].pad(&[0, 0, 1, 1, 1, 1], 0.0)?;
            let tap = |h: usize, w: usize| p.narrow(1, h, 12)?.narrow(2, w, 12);
            let windows = tap(0, 0)?.add(&tap(2, 1)?)?.add(&tap(1, 2)?)?;
            let scaled = windows.mul(&x[1])?.add(&x[2].permute(&[3, 1, 2, 0])?)?;
            Ok(vec![scaled.tanh()?])
        },
    )?;
    differential("vector_lanes_odd_inner", &[&[30, 20, 6], &[6]], 1e-5, |x| {
        Ok(vec![x[0].mul(&x[1])?.sin()?])
    })?;
    let f = |a: &[Tensor]| -> Result<Vec<Tensor>> { Ok(vec![a[0].mul(&a[1])?.exp()?]) };
    let compiled = kiln::compile_fn(f, CompileOptions::default()).map_err(err)?;
    let x = randn(&[512, 16], 9).map_err(err)?.to(CUDA).map_err(err)?;
    let base = randn(&[17], 10).map_err(err)?.to(CUDA).map_err(err)?;
    for start in [0usize, 1] {
        let w = base.narrow(0, start, 16).map_err(err)?;
        let got = compiled.call(&[x.clone(), w.clone()]).map_err(err)?;
        let want = f(&[x.clone(), w]).map_err(err)?;
        same(
            &format!("per-channel offset {start}"),
            &got[0],
            &want[0],
            1e-6,
        )?;
    }
    Ok(())
}

fn softmax_layer_norm_gelu() -> Outcome {
    differential(
        "softmax_layer_norm_gelu",
        &[&[8, 12, 64], &[64], &[64]],
        1e-5,
        |x| {
            let s = x[0].softmax(-1)?;
            let n = x[0].layer_norm(&[64], Some(&x[1]), Some(&x[2]), 1e-5)?;
            Ok(vec![s, n.gelu()?])
        },
    )
}

/// K = 128: over `small_matmul`'s limit, so a cuBLAS call between generated kernels.
fn linear_relu_matmul_extern() -> Outcome {
    differential(
        "linear_relu_matmul_extern",
        &[&[16, 128], &[128, 24]],
        1e-5,
        |x| Ok(vec![x[0].matmul(&x[1])?.relu()?.add(1.0)?]),
    )
}

/// Linear layers' biases and activations run in the GEMM (cuBLASLt's epilogues): two layers, two
/// epilogue calls per compiled call and no generated kernel, in default mode, reduce-overhead
/// (replayed from a CUDA graph) and max-autotune (tuned with the epilogue); ReLU in f32 to the
/// rounding of the sums' order and in bf16 to bf16's; GELU's tanh form to the rounding of
/// cuBLASLt's own tanh.
fn linear_epilogues_run_in_the_gemm() -> Outcome {
    fn relu_mlp(x: &[Tensor]) -> Result<Vec<Tensor>> {
        let h = x[0].linear(&x[1], Some(&x[2]))?.relu()?;
        Ok(vec![h.linear(&x[3], Some(&x[4]))?])
    }
    fn gelu_mlp(x: &[Tensor]) -> Result<Vec<Tensor>> {
        let h = x[0].linear(&x[1], Some(&x[2]))?.gelu_tanh()?;
        Ok(vec![h.linear(&x[3], Some(&x[4]))?])
    }
    type Mlp = fn(&[Tensor]) -> Result<Vec<Tensor>>;
    let shapes: [&[usize]; 5] = [&[8, 48, 256], &[512, 256], &[512], &[96, 512], &[96]];
    let cases: [(&str, Mlp, Mode, DType, f64); 5] = [
        ("relu", relu_mlp, Mode::Default, DType::F32, 1e-5),
        ("relu", relu_mlp, Mode::ReduceOverhead, DType::F32, 1e-5),
        ("relu", relu_mlp, Mode::MaxAutotune, DType::F32, 1e-5),
        ("relu", relu_mlp, Mode::Default, DType::BF16, 2e-2),
        ("gelu_tanh", gelu_mlp, Mode::Default, DType::F32, 1e-4),
    ];
    for (name, mlp, mode, dtype, tol) in cases {
        let compiled = kiln::compile_fn(mlp, CompileOptions::default().mode(mode)).map_err(err)?;
        for call in 0..3u64 {
            let x = cuda_randn(&shapes, 700 + 10 * call, dtype).map_err(err)?;
            let (gemms, before) = (kiln::cuda::epilogue_gemms(), exec_stats());
            let got = compiled.call(&x).map_err(err)?;
            let ran = kiln::cuda::epilogue_gemms() - gemms;
            let launches = exec_stats().kernel_launches - before.kernel_launches;
            let what = format!("{name} {mode:?} {dtype} call {call}");
            let replayed = mode != Mode::Default && call > 0;
            // a recording call may run the graph twice (once to warm up)
            if !replayed && (ran < 2 || ran % 2 != 0 || launches != 0) {
                return Err(format!(
                    "{what}: {ran} epilogue GEMMs and {launches} generated kernels, want 2 per \
                     run and 0"
                ));
            }
            let want = mlp(&x).map_err(err)?;
            let (g, w) = (
                got[0].to_dtype(DType::F32).map_err(err)?,
                want[0].to_dtype(DType::F32).map_err(err)?,
            );
            close(&what, &g, &w, tol)?;
        }
    }
    Ok(())
}

/// A CPU scalar tensor fed to a device graph is read on every call (not a constant captured at
/// trace time).
fn cpu_scalar_follows_its_value() -> Outcome {
    let f = kiln::compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].mul(&a[1])?]),
        CompileOptions::default(),
    )
    .map_err(err)?;
    let x = randn(&[5, 3], 1).map_err(err)?.to(CUDA).map_err(err)?;
    for v in [2.0f32, -3.0] {
        let s = Tensor::from_vec(vec![v], &[]).map_err(err)?;
        let got = f.call(&[x.clone(), s.clone()]).map_err(err)?;
        let want = x.mul(&s.to(CUDA).map_err(err)?).map_err(err)?;
        same(&format!("x * {v}"), &got[0], &want, 0.0)?;
    }
    Ok(())
}

/// Forward and backward of a small MLP compiled on the GPU: loss and gradients equal eager's.
fn mlp_forward_backward() -> Outcome {
    mlp_with(CompileOptions::default(), 1)
}

/// The `cudagraphs` backend (eager kernels recorded as CUDA graphs, forward and AOT backward):
/// equal to eager on every call, and the calls after the first two replay recordings.
fn cudagraphs_backend_forward_backward() -> Outcome {
    let before = exec_stats().graph_replays;
    mlp_with(CompileOptions::default().backend("cudagraphs"), 4)?;
    match exec_stats().graph_replays - before {
        0 => Err("the cudagraphs backend replayed no recorded graph".into()),
        _ => Ok(()),
    }
}

/// A two-layer MLP's loss compiled with `opts`, called `calls` times (each call's loss and
/// gradients against eager's, the gradients cleared between calls).
fn mlp_with(opts: CompileOptions, calls: usize) -> Outcome {
    let make = || mlp_weights(11);
    let loss = |w: &[Tensor], x: &Tensor, y: &Tensor| -> Result<Tensor> {
        let h = x.matmul(&w[0])?.relu()?;
        h.matmul(&w[1])?
            .cross_entropy(y, None, 0.0, Reduction::Mean)
    };
    let (we, wc) = (make().map_err(err)?, make().map_err(err)?);
    let x = randn(&[16, 64], 5).map_err(err)?.to(CUDA).map_err(err)?;
    let y = Tensor::from_vec((0..16i64).map(|i| i % 10).collect::<Vec<_>>(), &[16])
        .map_err(err)?
        .to(CUDA)
        .map_err(err)?;
    let wc2 = wc.clone();
    let f = kiln::compile_fn(
        move |a: &[Tensor]| Ok(vec![loss(&wc2, &a[0], &a[1])?]),
        opts,
    )
    .map_err(err)?;
    for call in 0..calls {
        for w in wc.iter().chain(&we) {
            w.set_grad(None);
        }
        let lc = f.call(&[x.clone(), y.clone()]).map_err(err)?;
        lc[0].backward().map_err(err)?;
        let le = loss(&we, &x, &y).map_err(err)?;
        le.backward().map_err(err)?;
        same(&format!("call {call}: loss"), &lc[0], &le, 1e-6)?;
        for (i, (c, e)) in wc.iter().zip(&we).enumerate() {
            let (gc, ge) = (c.grad(), e.grad());
            match (gc, ge) {
                // the kiln backend generates the matmuls (K ≤ 64), summing in double, where
                // eager runs cuBLAS's f32 chain: a gradient element near zero carries cuBLAS's
                // rounding of its larger terms, so the comparison is relative to the gradient's
                // largest element
                (Some(gc), Some(ge)) => {
                    same_scaled(&format!("call {call}: grad {i}"), &gc, &ge, 1e-5)?
                }
                _ => return Err(format!("call {call}: grad {i} missing")),
            }
        }
    }
    Ok(())
}

/// `kiln-bench regional`'s block: Linear, ReLU, sigmoid, Linear, ReLU.
fn tiny_block() -> Result<Sequential> {
    Ok(Sequential::new()
        .add(Linear::new(10, 10, true)?)
        .add(ReLU::new())
        .add(Sigmoid::new())
        .add(Linear::new(10, 10, true)?)
        .add(ReLU::new()))
}

/// A Linear 10→10 and `layers` blocks on a 10x10 input, on the GPU.
fn tiny_model(layers: usize) -> Result<Sequential> {
    manual_seed(21);
    let mut m = Sequential::new().add(Linear::new(10, 10, true)?);
    for _ in 0..layers {
        m.push(tiny_block()?);
    }
    m.to(CUDA)?;
    Ok(m)
}

/// `tiny_model`'s forward in float64 on the CPU, from its parameters (in order: the first
/// Linear's weight and bias, then each block's two).
fn tiny_reference(model: &Sequential, x: &Tensor) -> Result<Tensor> {
    let p: Vec<Tensor> = model
        .parameters()
        .iter()
        .map(|t| t.to(Device::Cpu)?.to_dtype(DType::F64))
        .collect::<Result<_>>()?;
    let mut h = x.to_dtype(DType::F64)?.linear(&p[0], Some(&p[1]))?;
    for w in p[2..].chunks(4) {
        let a = h.linear(&w[0], Some(&w[1]))?.relu()?.sigmoid()?;
        h = a.linear(&w[2], Some(&w[3]))?.relu()?;
    }
    Ok(h)
}

/// The regional workload's model (8 and 64 blocks of 10x10 Linears) compiled on the GPU, in
/// default and reduce-overhead modes: its matmuls are generated (no cuBLAS) and the whole
/// forward is one kernel in one block (`kiln-inductor/src/sequential.rs`), so a call is one
/// launch; outputs equal eager (cuBLAS) within 1e-5 of the largest element, and the float64 CPU
/// model within 1e-5 (norm-wise), on several inputs.
fn tiny_mlp_one_launch() -> Outcome {
    for layers in [8usize, 64] {
        let model = tiny_model(layers).map_err(err)?;
        for mode in [Mode::Default, Mode::ReduceOverhead] {
            let name = format!("{layers} layers, {}", mode.as_str());
            let compiled =
                kiln::compile(&model, CompileOptions::default().mode(mode)).map_err(err)?;
            for call in 0..4u64 {
                let host = randn(&[10, 10], 300 + call).map_err(err)?;
                let x = host.to(CUDA).map_err(err)?;
                let before = exec_stats();
                let got = kiln::no_grad(|| compiled.forward(&x)).map_err(err)?;
                let after = exec_stats();
                let want = kiln::no_grad(|| model.forward(&x)).map_err(err)?;
                same_scaled(&format!("{name} call {call} vs eager"), &got, &want, 1e-5)?;
                let r64 = tiny_reference(&model, &host).map_err(err)?;
                close(&format!("{name} call {call} vs f64"), &got, &r64, 1e-5)?;
                // the first call compiles (and the second records, under reduce-overhead):
                // count the launches of the calls after
                if call >= 2 {
                    let launches = after.kernel_launches - before.kernel_launches;
                    let replays = after.graph_replays - before.graph_replays;
                    let ok = match mode {
                        Mode::ReduceOverhead => replays == 1 && launches == 0,
                        _ => launches == 1,
                    };
                    if !ok {
                        return Err(format!(
                            "{name} call {call}: {launches} kernel launches, {replays} graph \
                             replays (want one launch, or one replay)"
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// `codegen/cuda_literals.rs` on the device, sharing forced on (`KILN_SHARE_KERNELS_FROM=0`):
/// three stages of a pointwise chain, a layer norm (a block per row, 256 threads at each size)
/// and a row sum of squares, each stage at another size and reading the one before (so no launch
/// holds two stages side by side). The later stages' kernels share builds (`shared_kernels`
/// counts them; none without the override) and every output equals eager.
fn literal_sharing_matches_eager() -> Outcome {
    let shapes: [&[usize]; 3] = [&[256, 512], &[384, 640], &[128, 768]];
    let f = |x: &[Tensor]| -> Result<Vec<Tensor>> {
        let (mut out, mut carry) = (Vec::new(), x[0].mean(&[0, 1], false)?);
        for t in x {
            let cols = t.shape()[1];
            let t = t.add(&carry)?;
            let y = t.mul(1.5)?.tanh()?.add(&t)?;
            let z = y.layer_norm(&[cols], None, None, 1e-5)?;
            // squares: a layer norm's row sums to about zero, which no relative check can hold
            let w = z.mul(&z)?.sum(&[1], false)?;
            carry = w.mean(&[0], false)?.mul(1e-3)?;
            out.extend([z, w]);
        }
        Ok(out)
    };
    let (single, _) = shared_when_forced("literal_sharing_matches_eager", &shapes, f)?;
    if single < 2 {
        return Err(format!(
            "{single} single kernels given shared builds with sharing forced (want 2 or more)"
        ));
    }
    Ok(())
}

/// Launches of several members share builds too: four stages of two chains side by side
/// (`exp(x) + c` and `tanh(y) * c` at two widths), each stage at another row count and reading
/// the one before through `c`, a sum of its first chain. The stages' launches share one
/// dispatcher and its device functions, and every output equals eager.
fn launch_sharing_matches_eager() -> Outcome {
    let shapes: [&[usize]; 8] = [
        &[256, 512],
        &[256, 96],
        &[384, 640],
        &[384, 96],
        &[128, 768],
        &[128, 96],
        &[192, 320],
        &[192, 96],
    ];
    let f = |x: &[Tensor]| -> Result<Vec<Tensor>> {
        let (mut out, mut carry) = (Vec::new(), x[0].mean(&[0, 1], false)?);
        for pair in x.chunks(2) {
            let a = pair[0].exp()?.add(&carry)?;
            let b = pair[1].tanh()?.mul(&carry)?;
            carry = a.mean(&[0, 1], false)?.mul(1e-2)?;
            out.extend([a, b]);
        }
        Ok(out)
    };
    let (_, launches) = shared_when_forced("launch_sharing_matches_eager", &shapes, f)?;
    if launches < 3 {
        return Err(format!(
            "{launches} launches of several members given shared builds with sharing forced \
             (want 3 or more)"
        ));
    }
    Ok(())
}

/// `f` compiled and checked against eager (`differential`) with sharing forced on, then with
/// the default threshold (which the small graphs here stay under): the kernels given shared
/// builds with it forced, single and launches of several members (`shared_kernels`); an error
/// if any were shared without it.
fn shared_when_forced(
    name: &str,
    shapes: &[&[usize]],
    f: fn(&[Tensor]) -> Result<Vec<Tensor>>,
) -> std::result::Result<(u64, u64), String> {
    let shared = |share: Option<&str>| -> std::result::Result<(u64, u64), String> {
        if let Some(v) = share {
            std::env::set_var("KILN_SHARE_KERNELS_FROM", v);
        }
        let before = kiln::inductor::shared_kernels();
        // a fresh cache: sharing happens where plans are made, and a warm disk cache (this
        // binary run twice on one machine) would hand both compiles their plans
        let r = kiln::inductor::with_fresh_cache(|| differential(name, shapes, 1e-4, f));
        std::env::remove_var("KILN_SHARE_KERNELS_FROM");
        let after = kiln::inductor::shared_kernels();
        r.map(|()| (after.0 - before.0, after.1 - before.1))
    };
    let (forced, default) = (shared(Some("0"))?, shared(None)?);
    if default != (0, 0) {
        return Err(format!(
            "{name}: kernels given shared builds without sharing forced: {default:?} (want none)"
        ));
    }
    Ok(forced)
}

/// NVRTC compilations plus disk-cache hits so far: how many translation units were not found in
/// memory.
fn units_built() -> u64 {
    let (compiles, disk_hits) = kiln::cuda::kernel_cache_stats();
    compiles + disk_hits
}

/// Dynamic shapes on the GPU (`codegen/cuda_sizes.rs`): functions compiled with `dynamic:
/// Some(true)` and called at six batch sizes equal eager at each, and from its third size on the
/// pointwise function's compiled call builds no kernel: every generated kernel is size-generic,
/// its units the same text as at the size it was fitted. The MLP's forward and backward build
/// none at the last two sizes. Before that they build at four sizes, not two: the backward's
/// weight gradient is a matmul whose K is the batch, generated inline up to K = 64 and a cuBLAS
/// call above (`ir::lower::small_matmul`), so the backward's plan changes between 64 and 80 and
/// its kernels are fitted afresh from 80 and 104 (on the H100, 2026-11-25: 6, 5, 2, 2, 0, 0
/// units at 48, 64, 80, 104, 120, 72). Eager runs first at each size, so the extern steps' eager
/// kernels are not what is counted.
fn dynamic_sizes_share_kernels() -> Outcome {
    let sizes = [48usize, 64, 80, 104, 120, 72];
    // a pointwise chain (four elements per load: at least 4096 of them), a softmax and a layer
    // norm (a warp per row)
    let (gamma_host, beta_host) = (
        randn(&[96], 21).map_err(err)?,
        randn(&[96], 22).map_err(err)?,
    );
    let gamma = gamma_host.to(CUDA).map_err(err)?;
    let beta = beta_host.to(CUDA).map_err(err)?;
    // the function over given affine parameters: on the GPU, and in f64 on the CPU (reference)
    let with = |a: &Tensor, gamma: &Tensor, beta: &Tensor| -> Result<Vec<Tensor>> {
        let y = a.mul(2.0)?.add(1.0)?.tanh()?.mul(&a.sin()?)?;
        let n = y.layer_norm(&[96], Some(gamma), Some(beta), 1e-5)?;
        Ok(vec![y.softmax(-1)?, n.gelu()?])
    };
    let f = |a: &[Tensor]| -> Result<Vec<Tensor>> { with(&a[0], &gamma, &beta) };
    let (gamma64, beta64) = (
        gamma_host.to_dtype(DType::F64).map_err(err)?,
        beta_host.to_dtype(DType::F64).map_err(err)?,
    );
    let compiled =
        kiln::compile_fn(f, CompileOptions::default().dynamic(Some(true))).map_err(err)?;
    for (k, &n) in sizes.iter().enumerate() {
        let host = randn(&[n, 96], 30 + k as u64).map_err(err)?;
        let x = host.to(CUDA).map_err(err)?;
        let eager = f(std::slice::from_ref(&x)).map_err(err)?;
        let before = units_built();
        let got = compiled.call(std::slice::from_ref(&x)).map_err(err)?;
        let built = units_built() - before;
        if k >= 2 && built != 0 {
            return Err(format!(
                "pointwise: size {n} (call {k}) built {built} kernel units"
            ));
        }
        let reference =
            with(&host.to_dtype(DType::F64).map_err(err)?, &gamma64, &beta64).map_err(err)?;
        for (o, ((g, e), r)) in got.iter().zip(&eager).zip(&reference).enumerate() {
            same(&format!("size {n} output {o} vs eager"), g, e, 1e-6)?;
            close(&format!("size {n} output {o} vs f64"), g, r, 1e-5)?;
        }
    }
    let s = compiled.stats();
    if (s.compiles, s.symbolic_compiles) != (1, 1) {
        return Err(format!("pointwise: one symbolic compile expected: {s:?}"));
    }
    // a small MLP, forward and backward: cross entropy plus a mean over the batch (whose count
    // is a size)
    let make = || mlp_weights(12);
    let loss = |w: &[Tensor], x: &Tensor, y: &Tensor| -> Result<Tensor> {
        let h = x.matmul(&w[0])?.relu()?;
        h.matmul(&w[1])?
            .cross_entropy(y, None, 0.0, Reduction::Mean)?
            .add(&h.square()?.mean_all()?.mul(0.01)?)
    };
    let (we, wc) = (make().map_err(err)?, make().map_err(err)?);
    let wc2 = wc.clone();
    let mlp = kiln::compile_fn(
        move |a: &[Tensor]| Ok(vec![loss(&wc2, &a[0], &a[1])?]),
        CompileOptions::default().dynamic(Some(true)),
    )
    .map_err(err)?;
    let mut builds: Vec<(usize, u64)> = Vec::new();
    for (k, &n) in sizes.iter().enumerate() {
        let x = randn(&[n, 64], 40 + k as u64)
            .map_err(err)?
            .to(CUDA)
            .map_err(err)?;
        let labels: Vec<i64> = (0..n as i64).map(|i| i * 7 % 10).collect();
        let y = Tensor::from_vec(labels, &[n])
            .map_err(err)?
            .to(CUDA)
            .map_err(err)?;
        let le = loss(&we, &x, &y).map_err(err)?;
        le.backward().map_err(err)?;
        let before = units_built();
        let lc = mlp.call(&[x.clone(), y.clone()]).map_err(err)?;
        lc[0].backward().map_err(err)?;
        let built = units_built() - before;
        builds.push((n, built));
        same(&format!("mlp size {n} loss"), &lc[0], &le, 1e-6)?;
        for (i, (c, e)) in wc.iter().zip(&we).enumerate() {
            match (c.grad(), e.grad()) {
                // generated matmuls (K ≤ 64, summed in double) against cuBLAS's f32 chain:
                // relative to the gradient's largest element, as in `mlp_with`
                (Some(gc), Some(ge)) => {
                    same_scaled(&format!("mlp size {n} grad {i}"), &gc, &ge, 1e-5)?
                }
                _ => return Err(format!("mlp size {n}: grad {i} missing")),
            }
            c.zero_grad();
            e.zero_grad();
        }
    }
    let s = mlp.stats();
    if (s.compiles, s.symbolic_compiles) != (1, 1) {
        return Err(format!("mlp: one symbolic compile expected: {s:?}"));
    }
    eprintln!("dynamic_sizes_share_kernels: mlp kernel units built per size {builds:?}");
    if builds[sizes.len() - 2..].iter().any(|&(_, b)| b != 0) {
        return Err(format!(
            "mlp: the last two sizes built kernel units (per size: {builds:?})"
        ));
    }
    Ok(())
}

fn main() {
    let mut args = Arguments::from_args();
    // one at a time: the tests seed kiln's process-wide generator
    args.test_threads = Some(1);
    kiln::cuda::init();
    // the checks compare with f32 precision, convolutions included
    kiln::cuda::set_cudnn_allow_tf32(false);
    let available = kiln::cuda::is_available();
    if !available {
        eprintln!("gpu_compile: no CUDA device ({}); tests ignored", {
            kiln::cuda::check()
                .err()
                .map_or_else(String::new, |e| e.to_string())
        });
    }
    let tests: [(&str, Check); 38] = [
        (
            "linear_epilogues_run_in_the_gemm",
            linear_epilogues_run_in_the_gemm,
        ),
        (
            "reduce_overhead_matmuls_match_eager",
            reduce_overhead::reduce_overhead_matmuls_match_eager,
        ),
        (
            "recording_refuses_other_threads_work",
            reduce_overhead::recording_refuses_other_threads_work,
        ),
        (
            "plans_read_back_from_disk",
            graph_cache::plans_read_back_from_disk,
        ),
        (
            "cross_entropy_compiled_and_bad_targets",
            losses::cross_entropy_compiled_and_bad_targets,
        ),
        (
            "literal_sharing_matches_eager",
            literal_sharing_matches_eager,
        ),
        ("launch_sharing_matches_eager", launch_sharing_matches_eager),
        ("column_reductions", reductions::column_reductions),
        (
            "vector_lanes_share_outer_indices",
            vector_lanes_share_outer_indices,
        ),
        (
            "foreach_adam_flat_update",
            optimizers::foreach_adam_flat_update,
        ),
        (
            "max_autotune_tunes_once_and_persists",
            autotune::max_autotune_tunes_once_and_persists,
        ),
        (
            "max_autotune_times_gemm_algorithms",
            autotune::max_autotune_times_gemm_algorithms,
        ),
        (
            "reduce_overhead_backward_reads_saved_activations_in_place",
            cudagraph_training::reduce_overhead_backward_reads_saved_activations_in_place,
        ),
        (
            "max_autotune_times_convolution_engines",
            autotune::max_autotune_times_convolution_engines,
        ),
        (
            "max_autotune_chooses_generated_or_cudnn_convolutions",
            autotune::max_autotune_chooses_generated_or_cudnn_convolutions,
        ),
        (
            "generated_convolutions_are_loaded_not_run_by_the_warm_up",
            autotune::generated_convolutions_are_loaded_not_run_by_the_warm_up,
        ),
        (
            "default_mode_chooses_one_convolution_engine_per_function",
            conv_engine::default_mode_chooses_one_convolution_engine_per_function,
        ),
        (
            "conv_epilogues_in_max_autotune",
            conv_epilogues::conv_epilogues_in_max_autotune,
        ),
        ("dynamic_sizes_share_kernels", dynamic_sizes_share_kernels),
        (
            "cudagraphs_backend_forward_backward",
            cudagraphs_backend_forward_backward,
        ),
        ("tiny_mlp_one_launch", tiny_mlp_one_launch),
        ("vector_loads_any_alignment", vector_loads_any_alignment),
        (
            "adam_many_parameters_few_launches",
            optimizers::adam_many_parameters_few_launches,
        ),
        (
            "reduce_overhead_replays_with_new_inputs",
            reduce_overhead::reduce_overhead_replays_with_new_inputs,
        ),
        (
            "reduce_overhead_adam_steps",
            reduce_overhead::reduce_overhead_adam_steps,
        ),
        (
            "reduce_overhead_reads_a_repeated_argument_in_place",
            cudagraph_arguments::reduce_overhead_reads_a_repeated_argument_in_place,
        ),
        ("plain_sgd_step", optimizers::plain_sgd_step),
        ("pointwise_chain", pointwise_chain),
        (
            "sine_and_cosine_of_one_value_match_eager",
            sine_and_cosine_of_one_value_match_eager,
        ),
        (
            "reductions_every_strategy",
            reductions::reductions_every_strategy,
        ),
        (
            "split_reductions_few_long_rows",
            reductions::split_reductions_few_long_rows,
        ),
        (
            "sibling_reductions_every_strategy",
            reductions::sibling_reductions_every_strategy,
        ),
        ("softmax_layer_norm_gelu", softmax_layer_norm_gelu),
        ("linear_relu_matmul_extern", linear_relu_matmul_extern),
        ("cpu_scalar_follows_its_value", cpu_scalar_follows_its_value),
        ("adam_step", optimizers::adam_step),
        ("sgd_momentum_step", optimizers::sgd_momentum_step),
        ("mlp_forward_backward", mlp_forward_backward),
    ];
    let trials = tests
        .iter()
        .map(|&(n, f)| {
            Trial::test(n, move || f().map_err(Failed::from)).with_ignored_flag(!available)
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    // A graph whose kernels could not be generated runs on the interpreter and still gives
    // right answers: only this count tells (max-autotune's DenseNet-121 backward went unnoticed
    // that way for sessions).
    let interpreted = kiln::inductor::interpreted_graphs();
    if interpreted > 0 {
        eprintln!(
            "{interpreted} compiled graph(s) fell back to the interpreter (stderr names why)"
        );
        std::process::exit(101);
    }
    conclusion.exit();
}
