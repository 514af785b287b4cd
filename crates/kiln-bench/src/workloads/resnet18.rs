//! torch_baseline.py's `resnet18`: torchvision's ResNet-18 (random weights, 1000 classes), batch 16
//! of 3x224x224, inference in eval mode under no_grad: eager vs `kiln::compile`, plus the cold
//! compile (fresh kernel cache) and how far the compiled logits land from the eager ones.

use kiln::inductor::with_fresh_cache;
use kiln::models::resnet::resnet18;
use kiln::nn::Module;
use kiln::{no_grad, DType, Tensor};

use super::BenchResult;
use crate::harness::{once, Ctx};

const W: &str = "resnet18_bs16";

pub fn run(ctx: &mut Ctx) -> BenchResult {
    kiln::manual_seed(0);
    let model = resnet18(1000)?;
    model.eval();
    let x = Tensor::randn(&[16, 3, 224, 224], DType::F32)?;
    let timer = ctx.timer();

    let (eager_t, eager_out) =
        timer.time_keep("resnet18: eager", || no_grad(|| model.forward(&x)))?;
    ctx.emit(W, "eager", "call", eager_t.ms(), "ms");

    let compiled = kiln::compile(&model, ctx.opts())?;
    let (first, t) = with_fresh_cache(|| {
        once("resnet18: cold compile", || {
            no_grad(|| compiled.forward(&x))
        })
    });
    first?;
    let variant = ctx.mode_name();
    ctx.emit(W, variant, "cold_compile", t.as_secs_f64(), "s");
    let (t, out) = timer.time_keep("resnet18: compiled", || no_grad(|| compiled.forward(&x)))?;
    ctx.emit(W, variant, "call", t.ms(), "ms");

    // the same weights and input: a speedup only counts if the answer is the same
    let (a, b) = (out.to_vec_f64()?, eager_out.to_vec_f64()?);
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
    ctx.emit(W, variant, "max_rel_diff_vs_eager", diff / scale, "ratio");
    Ok(())
}
