//! An MLP's forward pass, eager vs compiled: `Linear(1024, 4096) -> ReLU -> Linear(4096, 4096)
//! -> ReLU -> Linear(4096, 1024)` on a [8192, 1024] f32 batch: three GEMMs, 412 GFLOP in
//! all; what the compiler adds around them is the biases and ReLUs, which on a GPU it runs in the
//! GEMMs' epilogues (`kiln-inductor/src/epilogue.rs`; `KILN_MATMUL_EPILOGUES=0` runs them as
//! generated kernels instead, for a before/after in one build; on the CPU they always are). Then a training step's forward and backward
//! (loss: the output's mean square; no optimizer), where the forward saves each ReLU's output
//! rather than its mask (`relu_mask.rs`) so the ReLUs join the GEMMs there too.
//! `tools/torch_mlp.py` times PyTorch eager and torch.compile on the same model.

use kiln::inductor::with_fresh_cache;
use kiln::{DType, Tensor};

use super::BenchResult;
use crate::harness::{max_abs_diff, once, Ctx};

const W: &str = "mlp_8192x1024";
/// Each layer's (in, out) features.
const LAYERS: [(usize, usize); 3] = [(1024, 4096), (4096, 4096), (4096, 1024)];
const BATCH: usize = 8192;

fn forward(a: &[Tensor]) -> kiln::Result<Tensor> {
    let mut h = a[0].clone();
    for (i, w) in a[1..].chunks(2).enumerate() {
        h = h.linear(&w[0], Some(&w[1]))?;
        if i + 1 < LAYERS.len() {
            h = h.relu()?;
        }
    }
    Ok(h)
}

pub fn run(ctx: &mut Ctx) -> BenchResult {
    let timer = ctx.timer();
    let mode = ctx.mode_name();
    let mut args = vec![Tensor::randn(&[BATCH, LAYERS[0].0], DType::F32)?.to(ctx.dev)?];
    for (i, o) in LAYERS {
        let scale = 1.0 / (i as f64).sqrt();
        args.push(
            Tensor::randn(&[o, i], DType::F32)?
                .mul(scale)?
                .to(ctx.dev)?,
        );
        args.push(Tensor::randn(&[o], DType::F32)?.mul(scale)?.to(ctx.dev)?);
    }
    let flops: usize = LAYERS.iter().map(|(i, o)| 2 * BATCH * i * o).sum();
    kiln::no_grad(|| -> BenchResult {
        let eager = timer.time("mlp: eager", || forward(&args))?;
        ctx.emit(W, "eager", "call", eager.us(), "us");
        let g = kiln::compile_fn(|a: &[Tensor]| Ok(vec![forward(a)?]), ctx.opts())?;
        let (r, t) = with_fresh_cache(|| once("mlp: cold compile", || g.call(&args)));
        let compiled_out = r?.remove(0);
        ctx.emit(W, mode, "cold_compile", t.as_secs_f64(), "s");
        let diff = max_abs_diff(&forward(&args)?, &compiled_out)?;
        ctx.emit(W, mode, "max_abs_diff_vs_eager", diff, "abs");
        let t = timer.time("mlp: compiled", || g.call(&args))?;
        ctx.emit(W, mode, "call", t.us(), "us");
        ctx.emit(W, mode, "tflops", flops as f64 / t.s() / 1e12, "TFLOP/s");
        Ok(())
    })?;
    train(ctx, &args)
}

/// The training step: forward, mean-square loss, backward into the weights' and biases'
/// gradients (three times the forward's flops).
fn train(ctx: &mut Ctx, args: &[Tensor]) -> BenchResult {
    let timer = ctx.timer();
    let mode = ctx.mode_name();
    let w = format!("{W}_train");
    let params: Vec<Tensor> = args[1..]
        .iter()
        .map(|p| p.detach().with_grad())
        .collect::<kiln::Result<_>>()?;
    let mut inputs = vec![args[0].clone()];
    inputs.extend(params.iter().cloned());
    let step = |f: &dyn Fn(&[Tensor]) -> kiln::Result<Tensor>| -> kiln::Result<Tensor> {
        for p in &params {
            p.set_grad(None);
        }
        let y = f(&inputs)?;
        let loss = y.mul(&y)?.mean(&[], false)?;
        loss.backward()?;
        Ok(loss)
    };
    let eager = timer.time("mlp train: eager", || step(&forward))?;
    ctx.emit(&w, "eager", "call", eager.us(), "us");
    let g = kiln::compile_fn(|a: &[Tensor]| Ok(vec![forward(a)?]), ctx.opts())?;
    let compiled = |a: &[Tensor]| -> kiln::Result<Tensor> { Ok(g.call(a)?.remove(0)) };
    let (r, t) = with_fresh_cache(|| once("mlp train: cold compile", || step(&compiled)));
    r?;
    ctx.emit(&w, mode, "cold_compile", t.as_secs_f64(), "s");
    let grads = |ps: &[Tensor]| -> kiln::Result<Vec<Tensor>> {
        ps.iter()
            .map(|p| {
                p.grad()
                    .ok_or_else(|| kiln::Error::arg("mlp", "no gradient"))
            })
            .collect()
    };
    step(&forward)?;
    let want = grads(&params)?;
    step(&compiled)?;
    let mut diff = 0f64;
    for (a, b) in grads(&params)?.iter().zip(&want) {
        diff = diff.max(max_abs_diff(a, b)?);
    }
    ctx.emit(&w, mode, "max_abs_grad_diff_vs_eager", diff, "abs");
    let t = timer.time("mlp train: compiled", || step(&compiled))?;
    ctx.emit(&w, mode, "call", t.us(), "us");
    Ok(())
}
