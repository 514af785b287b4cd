//! torch_baseline.py's `adam`: Adam(lr=0.01) over 10 × Linear(1024, 1024, bias=False) whose
//! gradients are set (random tensors), one step timed: eager per-parameter loop, eager foreach, and
//! the step compiled with `kiln::compile_fn` (both implementations). A compiled step must neither
//! recompile on every call nor drift from eager: the compile count and the largest difference from
//! eager after a few steps are reported too.

use std::sync::Mutex;

use kiln::inductor::with_fresh_cache;
use kiln::nn::optim::{Adam, AdamConfig, Optimizer};
use kiln::nn::Linear;
use kiln::{CompiledFn, DType, Device, Tensor};

use super::BenchResult;
use crate::harness::{once, Ctx};

const W: &str = "adam";
const LAYERS: usize = 10;
const WIDTH: usize = 1024;
/// Steps compared against eager, on this many layers of the same shape.
const CHECK_STEPS: usize = 3;
const CHECK_LAYERS: usize = 2;

fn config(foreach: bool) -> AdamConfig {
    AdamConfig {
        lr: 0.01,
        foreach,
        ..AdamConfig::default()
    }
}

/// The parameters of `layers` Linear(1024, 1024, bias=False) on `dev`, each with a random
/// gradient set.
fn params_with_grads(layers: usize, dev: Device) -> kiln::Result<Vec<Tensor>> {
    let mut ps = Vec::new();
    for _ in 0..layers {
        let w = Linear::new(WIDTH, WIDTH, false)?
            .weight
            .detach()
            .to(dev)?
            .with_grad()?;
        w.set_grad(Some(Tensor::randn(w.shape(), DType::F32)?.to(dev)?));
        ps.push(w);
    }
    Ok(ps)
}

/// `torch.compile(fn)` over `opt.step()`: the optimizer behind a mutex, as the closure is `Fn`.
fn compiled_step<'a>(ctx: &Ctx, opt: &'a Mutex<Adam>) -> kiln::Result<CompiledFn<'a>> {
    kiln::compile_fn(
        move |_: &[Tensor]| {
            opt.lock().unwrap_or_else(|e| e.into_inner()).step()?;
            Ok(vec![])
        },
        ctx.opts(),
    )
}

/// Copies of `ps`' values (with the same gradient tensors), for a second optimizer.
fn copies(ps: &[Tensor]) -> kiln::Result<Vec<Tensor>> {
    ps.iter()
        .map(|p| {
            let c = Tensor::from_vec(p.to_vec::<f32>()?, p.shape())?
                .to(p.device())?
                .with_grad()?;
            c.set_grad(p.grad());
            Ok(c)
        })
        .collect()
}

/// How the gradients change between the steps of the drift check.
#[derive(Clone, Copy, PartialEq)]
enum NewGrads {
    /// New values written into the same gradient tensors.
    InPlace,
    /// New gradient tensors, as `zero_grad()` + `backward()` leave them.
    Replaced,
}

/// Largest |compiled − eager| over every parameter after `CHECK_STEPS` steps from equal values,
/// with gradients that change from step to step (a constant gradient hides a stale optimizer
/// state: Adam's bias-corrected update is then the same at every step).
fn drift_from_eager(ctx: &Ctx, foreach: bool, grads: NewGrads) -> BenchResult<f64> {
    kiln::manual_seed(7);
    let base = params_with_grads(CHECK_LAYERS, ctx.dev)?;
    let eager_ps = copies(&base)?;
    let compiled_ps = copies(&base)?;
    let mut eager = Adam::new(eager_ps.clone(), config(foreach))?;
    let opt = Mutex::new(Adam::new(compiled_ps.clone(), config(foreach))?);
    let step = compiled_step(ctx, &opt)?;
    for k in 0..CHECK_STEPS {
        if k > 0 {
            for (a, b) in eager_ps.iter().zip(&compiled_ps) {
                let g = Tensor::randn(a.shape(), DType::F32)?.to(ctx.dev)?;
                match grads {
                    NewGrads::InPlace => {
                        let ga = a.grad().ok_or("no gradient")?;
                        let gb = b.grad().ok_or("no gradient")?;
                        ga.assign(&g)?;
                        if !ga.same_tensor(&gb) {
                            gb.assign(&g)?;
                        }
                    }
                    NewGrads::Replaced => {
                        a.set_grad(Some(g.clone()));
                        let copy = Tensor::from_vec(g.to_vec::<f32>()?, g.shape())?;
                        b.set_grad(Some(copy.to(ctx.dev)?));
                    }
                }
            }
        }
        eager.step()?;
        step.call(&[])?;
    }
    let mut worst = 0.0f64;
    for (a, b) in eager_ps.iter().zip(&compiled_ps) {
        let (a, b) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
        for (x, y) in a.iter().zip(&b) {
            worst = worst.max((x - y).abs() as f64);
        }
    }
    Ok(worst)
}

pub fn run(ctx: &mut Ctx) -> BenchResult {
    kiln::manual_seed(0);
    let params = params_with_grads(LAYERS, ctx.dev)?;
    let nparam: usize = params.iter().map(|p| p.numel()).sum();
    // floor: read p, g, m, v; write p, m, v (fp32), as torch_baseline.py counts it
    let floor_bytes = (nparam * 28) as f64;
    let timer = ctx.timer();

    for (variant, foreach) in [("eager_foreach", true), ("eager_forloop", false)] {
        let mut opt = Adam::new(params.clone(), config(foreach))?;
        let t = timer.time(&format!("adam: {variant} step"), || opt.step())?;
        ctx.emit(W, variant, "step", t.us(), "us");
        ctx.emit(W, variant, "bandwidth", floor_bytes / t.s() / 1e9, "GB/s");
    }

    for (base, foreach) in [("compiled", false), ("compiled_foreach", true)] {
        let variant = &ctx.variant(base);
        let opt = Mutex::new(Adam::new(params.clone(), config(foreach))?);
        let step = compiled_step(ctx, &opt)?;
        let (r, t) =
            with_fresh_cache(|| once(&format!("adam: {variant} compile"), || step.call(&[])));
        r?;
        ctx.emit(W, variant, "cold_compile", t.as_secs_f64(), "s");
        let t = timer.time(&format!("adam: {variant} step"), || step.call(&[]))?;
        ctx.emit(W, variant, "step", t.us(), "us");
        ctx.emit(W, variant, "bandwidth", floor_bytes / t.s() / 1e9, "GB/s");
        ctx.cuda_range(variant, || step.call(&[]))?;
        let st = step.stats();
        ctx.emit(W, variant, "compiles", st.compiles as f64, "count");
        ctx.emit(W, variant, "graph_breaks", st.graph_breaks as f64, "count");
        ctx.emit(
            W,
            variant,
            "eager_fallbacks",
            st.eager_fallbacks as f64,
            "count",
        );
        for (grads, name) in [
            (NewGrads::InPlace, "grads_in_place"),
            (NewGrads::Replaced, "grads_replaced"),
        ] {
            let drift = drift_from_eager(ctx, foreach, grads)?;
            ctx.emit(
                W,
                variant,
                &format!("max_diff_vs_eager_{name}"),
                drift,
                "abs",
            );
        }
    }
    ctx.emit(W, "floor_bytes", "bytes", floor_bytes, "B");
    Ok(())
}
