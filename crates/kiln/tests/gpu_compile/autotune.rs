//! max-autotune on the GPU: a pointwise chain with a softmax and an Adam step compiled in both
//! max-autotune modes equal eager; the first compile times the kernels' launch shapes and
//! writes its choices under the cache folder, a second compile (after `kiln::reset`) reads them
//! and times nothing. The same holds for cuBLASLt's GEMM algorithms and for cuDNN's engines of a
//! training step's convolutions. With kiln's generated convolutions switched on, the compile's
//! convolution warm-up loads their kernels without running them.

use std::sync::Mutex;

use kiln::inductor::{cache_dir, exec_stats, with_fresh_cache};
use kiln::nn::optim::{Adam, AdamConfig, Optimizer};
use kiln::nn::{Conv2d, Conv2dConfig, Flatten, Linear, Module, ReLU, Sequential};
use kiln::prelude::*;

use super::{
    close_to_largest, compiled_step, conv_switches, cuda_randn, err, params_with_grads, randn,
    same, same_outputs, Outcome, CUDA,
};

fn chain(x: &[Tensor]) -> Result<Vec<Tensor>> {
    let h = x[0].mul(&x[1])?.tanh()?.add(&x[0])?;
    Ok(vec![h.softmax(-1)?, h.exp()?])
}

/// A comparison of a compiled call's outputs with eager ones (`what` names the call).
type Check = fn(&str, &[Tensor], &[Tensor], f64) -> Outcome;

/// Three calls of `f` compiled in `mode`, each on new values of `shapes` (seeded from `seed`),
/// checked against eager by `check` to `tol`.
fn three_calls(
    mode: Mode,
    f: fn(&[Tensor]) -> Result<Vec<Tensor>>,
    shapes: &[&[usize]],
    seed: u64,
    (check, tol): (Check, f64),
) -> Outcome {
    let compiled = kiln::compile_fn(f, CompileOptions::default().mode(mode)).map_err(err)?;
    for call in 0..3u64 {
        let x = cuda_randn(shapes, seed + 10 * call, DType::F32).map_err(err)?;
        let got = compiled.call(&x).map_err(err)?;
        let want = f(&x).map_err(err)?;
        check(&format!("{mode:?} call {call}"), &got, &want, tol)?;
    }
    Ok(())
}

/// Three calls of the chain with new values each, compiled in `mode`, against eager.
fn run_chain(mode: Mode) -> Outcome {
    let shapes: [&[usize]; 2] = [&[64, 1000], &[64, 1000]];
    three_calls(mode, chain, &shapes, 300, (same_outputs, 1e-6))
}

/// Three compiled Adam steps (parameters updated in place: the kernels tuning must not run
/// twice on live data) against eager ones.
fn run_adam(mode: Mode) -> Outcome {
    let shapes = [vec![300, 40], vec![40], vec![5000], vec![64, 33]];
    let make = || params_with_grads(&shapes, 41);
    let (eager_ps, compiled_ps) = (make().map_err(err)?, make().map_err(err)?);
    let mut eager = Adam::new(eager_ps.clone(), AdamConfig::default()).map_err(err)?;
    let opt = Mutex::new(Adam::new(compiled_ps.clone(), AdamConfig::default()).map_err(err)?);
    let step = compiled_step(&opt, CompileOptions::default().mode(mode))?;
    for k in 0..3 {
        eager.step().map_err(err)?;
        step.call(&[]).map_err(err)?;
        for (i, (e, c)) in eager_ps.iter().zip(&compiled_ps).enumerate() {
            same(&format!("{mode:?} step {k} parameter {i}"), c, e, 1e-6)?;
        }
    }
    Ok(())
}

/// The choice files under the cache folder, each checked to name a chosen shape.
fn choice_files() -> std::result::Result<usize, String> {
    let root = cache_dir().join("autotune");
    let mut n = 0;
    for dev in std::fs::read_dir(&root).map_err(|e| format!("{}: {e}", root.display()))? {
        let dev = dev.map_err(|e| e.to_string())?.path();
        for f in std::fs::read_dir(&dev).map_err(|e| e.to_string())? {
            let f = f.map_err(|e| e.to_string())?.path();
            let text = std::fs::read_to_string(&f).map_err(|e| e.to_string())?;
            if !text.contains("\"chosen\"") {
                return Err(format!("{}: no choice in {text}", f.display()));
            }
            n += 1;
        }
    }
    Ok(n)
}

pub fn max_autotune_tunes_once_and_persists() -> Outcome {
    for mode in [Mode::MaxAutotune, Mode::MaxAutotuneNoCudagraphs] {
        with_fresh_cache(|| -> Outcome {
            let before = exec_stats();
            run_chain(mode)?;
            run_adam(mode)?;
            let first = exec_stats();
            let tuned = first.kernels_tuned - before.kernels_tuned;
            if tuned == 0 {
                return Err(format!("{mode:?}: no kernel was tuned"));
            }
            if first.tuning_hits != before.tuning_hits {
                return Err(format!("{mode:?}: choices found in an empty cache folder"));
            }
            // one file per distinct kernel: a kernel at two steps of a graph is timed at each
            let files = choice_files()? as u64;
            if files == 0 || files > tuned {
                return Err(format!(
                    "{mode:?}: {tuned} kernels tuned, {files} choice files"
                ));
            }
            // a new compile of the same graphs: the choices come from disk
            kiln::reset();
            run_chain(mode)?;
            run_adam(mode)?;
            let second = exec_stats();
            if second.kernels_tuned != first.kernels_tuned {
                return Err(format!(
                    "{mode:?}: {} kernels timed again after a reset",
                    second.kernels_tuned - first.kernels_tuned
                ));
            }
            if second.tuning_hits - first.tuning_hits != tuned {
                return Err(format!(
                    "{mode:?}: {} choices read back, {tuned} written",
                    second.tuning_hits - first.tuning_hits
                ));
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Linear layers and a batched matmul with a transposed operand: GEMMs large enough to stay
/// extern (cuBLAS), three shapes.
fn gemms(x: &[Tensor]) -> Result<Vec<Tensor>> {
    let h = x[0].matmul(&x[1])?.relu()?;
    let y = h.matmul(&x[2].t()?)?;
    let z = x[3].matmul(&x[4].transpose(-1, -2)?)?;
    Ok(vec![y, z])
}

/// Three calls of `gemms` compiled in `mode` against eager, to rounding (`close_to_largest`).
fn run_gemms(mode: Mode) -> Outcome {
    let shapes: [&[usize]; 5] = [
        &[256, 512],
        &[512, 384],
        &[128, 384],
        &[8, 64, 96],
        &[8, 80, 96],
    ];
    three_calls(mode, gemms, &shapes, 500, (close_to_largest, 1e-5))
}

/// max-autotune times cuBLASLt's algorithms for each GEMM shape once, writes the choices, and a
/// later scope over the same cache folder (a new process's view) reads them instead of timing.
pub fn max_autotune_times_gemm_algorithms() -> Outcome {
    use kiln::cuda::{gemm_tune_disk_hits, gemms_tuned};
    for mode in [Mode::MaxAutotune, Mode::MaxAutotuneNoCudagraphs] {
        with_fresh_cache(|| -> Outcome {
            let before = gemms_tuned();
            run_gemms(mode)?;
            let timed = gemms_tuned() - before;
            if timed != 3 {
                return Err(format!("{mode:?}: {timed} GEMM shapes timed, want 3"));
            }
            let dir = cache_dir();
            let files = std::fs::read_dir(dir.join("gemm"))
                .map_err(|e| format!("{}: {e}", dir.display()))?
                .filter_map(|f| f.ok())
                .filter(|f| f.path().extension().is_some_and(|e| e == "txt"))
                .count();
            if files != 3 {
                return Err(format!("{mode:?}: {files} GEMM choice files, want 3"));
            }
            kiln::reset();
            let (timed, hits) = (gemms_tuned(), gemm_tune_disk_hits());
            kiln::core::cache::with_root(dir, || run_gemms(mode))?;
            if gemms_tuned() != timed || gemm_tune_disk_hits() - hits != 3 {
                return Err(format!(
                    "{mode:?}: a new scope timed {} shapes and read {} choices, want 0 and 3",
                    gemms_tuned() - timed,
                    gemm_tune_disk_hits() - hits
                ));
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Two convolutions without bias (a stride-1 and a stride-2 one) and a linear layer.
fn conv_net() -> Result<Sequential> {
    let conv = |i, o, stride| {
        Conv2d::new(
            i,
            o,
            [3, 3],
            Conv2dConfig::default()
                .padding(1)
                .stride(stride)
                .bias(false),
        )
    };
    let mut m = Sequential::new()
        .add(conv(3, 8, 1)?)
        .add(ReLU::new())
        .add(conv(8, 16, 2)?)
        .add(ReLU::new())
        .add(Flatten::new(1, -1))
        .add(Linear::new(16 * 4 * 4, 4, true)?);
    m.to(CUDA)?;
    Ok(m)
}

/// The output and every parameter's gradient after one step of `m` on `x`, compiled in `mode`
/// (eager without one).
fn conv_step(m: &Sequential, mode: Option<Mode>, x: &Tensor) -> Result<Vec<Tensor>> {
    m.zero_grad();
    let out = match mode {
        Some(mode) => kiln::compile(m, CompileOptions::default().mode(mode))?.forward(x)?,
        None => m.forward(x)?,
    };
    out.square()?.mean_all()?.backward()?;
    let mut all = vec![out];
    all.extend(m.parameters().iter().filter_map(|p| p.grad()));
    Ok(all)
}

/// max-autotune times cuDNN's engines for each convolution of a training step once (the two
/// forward convolutions, both weight gradients, the second's input gradient), equal to eager to
/// rounding, writes the chosen plans, and a later scope over the same cache folder (a new
/// process's view) reads them instead of timing.
pub fn max_autotune_times_convolution_engines() -> Outcome {
    // TF32 off throughout: its five timed plans are the strict-f32 ones, its tolerance 1e-5
    let _switches = conv_switches();
    use kiln::cuda::{cudnn_plan_disk_hits, cudnn_plans_timed};
    let m = conv_net().map_err(err)?;
    let x = randn(&[4, 3, 8, 8], 77)
        .and_then(|x| x.to(CUDA))
        .map_err(err)?;
    let want = conv_step(&m, None, &x).map_err(err)?;
    for mode in [Mode::MaxAutotune, Mode::MaxAutotuneNoCudagraphs] {
        with_fresh_cache(|| -> Outcome {
            kiln::reset();
            let before = cudnn_plans_timed();
            let got = conv_step(&m, Some(mode), &x).map_err(err)?;
            close_to_largest(&format!("{mode:?} step"), &got, &want, 1e-5)?;
            let timed = cudnn_plans_timed() - before;
            if timed != 5 {
                return Err(format!(
                    "{mode:?}: {timed} convolution shapes timed, want 5"
                ));
            }
            kiln::reset();
            let (timed, hits) = (cudnn_plans_timed(), cudnn_plan_disk_hits());
            let again = kiln::core::cache::with_root(cache_dir(), || conv_step(&m, Some(mode), &x))
                .map_err(err)?;
            close_to_largest(&format!("{mode:?} step, new scope"), &again, &want, 1e-5)?;
            let read = cudnn_plan_disk_hits() - hits;
            if cudnn_plans_timed() != timed || read < 5 {
                return Err(format!(
                    "{mode:?}: a new scope timed {} shapes and read {read} plans, want 0 and 5",
                    cudnn_plans_timed() - timed
                ));
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// With TF32 allowed (PyTorch's default for convolutions), max-autotune also times kiln's
/// generated kernel against cuDNN's plan for each channels-last convolution of a training step
/// (five: two forward, two weight gradients, one input gradient) and keeps the faster, equal to
/// eager within TF32's rounding whichever wins; a later scope over the same cache folder reads
/// the five choices instead of timing.
pub fn max_autotune_chooses_generated_or_cudnn_convolutions() -> Outcome {
    let _switches = conv_switches();
    use kiln::cuda::conv_engine_choices;
    kiln::cuda::set_cudnn_allow_tf32(true);
    let r = (|| -> Outcome {
        let m = conv_net().map_err(err)?;
        let x = randn(&[4, 3, 8, 8], 78)
            .and_then(|x| x.to(CUDA))
            .map_err(err)?;
        let want = conv_step(&m, None, &x).map_err(err)?;
        with_fresh_cache(|| -> Outcome {
            kiln::reset();
            let (decided, _, read) = conv_engine_choices();
            let got = conv_step(&m, Some(Mode::MaxAutotune), &x).map_err(err)?;
            // TF32 rounds every operand to 10 mantissa bits, in eager's cuDNN as in either side
            close_to_largest("max-autotune step, TF32", &got, &want, 5e-3)?;
            let now = conv_engine_choices();
            if now.0 - decided != 5 || now.2 != read {
                return Err(format!(
                    "{} convolutions decided ({} read from disk), want 5 timed",
                    now.0 - decided,
                    now.2 - read
                ));
            }
            kiln::reset();
            let again = kiln::core::cache::with_root(cache_dir(), || {
                conv_step(&m, Some(Mode::MaxAutotune), &x)
            })
            .map_err(err)?;
            close_to_largest("max-autotune step, new scope", &again, &want, 5e-3)?;
            let later = conv_engine_choices();
            if later.0 - now.0 != 5 || later.2 - now.2 != 5 {
                return Err(format!(
                    "a new scope decided {} convolutions, {} from disk; want 5 and 5",
                    later.0 - now.0,
                    later.2 - now.2
                ));
            }
            Ok(())
        })
    })();
    kiln::cuda::set_cudnn_allow_tf32(false);
    r
}

/// With generated convolutions on (default mode), a compiled training step's convolutions run on
/// kiln's kernels, equal to eager within TF32's rounding, and the compile's warm-up
/// (`kiln-inductor/src/runtime/conv_warmup.rs`) only loads their modules: the first step
/// launches as many generated convolutions as the second (two forwards, two weight gradients,
/// the second convolution's data gradient), none run ahead of it.
pub fn generated_convolutions_are_loaded_not_run_by_the_warm_up() -> Outcome {
    let _switches = conv_switches();
    use kiln::cuda::generated_convs;
    kiln::cuda::set_cudnn_allow_tf32(true);
    let r = (|| -> Outcome {
        let m = conv_net().map_err(err)?;
        let x = randn(&[4, 3, 8, 8], 79)
            .and_then(|x| x.to(CUDA))
            .map_err(err)?;
        let want = conv_step(&m, None, &x).map_err(err)?;
        kiln::cuda::set_generated_conv(true);
        with_fresh_cache(|| -> Outcome {
            kiln::reset();
            let mut launched = Vec::new();
            for step in 0..2 {
                let before = generated_convs();
                let got = conv_step(&m, Some(Mode::Default), &x).map_err(err)?;
                launched.push(generated_convs() - before);
                close_to_largest(&format!("step {step}, generated"), &got, &want, 5e-3)?;
            }
            match launched[..] {
                [5, 5] => Ok(()),
                _ => Err(format!(
                    "generated convolutions launched by the two steps: {launched:?}, want [5, 5]"
                )),
            }
        })
    })();
    kiln::cuda::set_generated_conv(false);
    kiln::cuda::set_cudnn_allow_tf32(false);
    r
}
