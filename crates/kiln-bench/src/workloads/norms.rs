//! Normalization layers alone, forward, eager vs compiled: batch norm in training mode with the
//! ReLU after it (ResNet's block, [32, 64, 56, 56] f32) and layer norm with its affine (BERT's,
//! [4096, 768] f32). Each is a reduction per row and a pass over the rows again; the bandwidth
//! is counted as reading the input and writing the output once (the floor a fused kernel can
//! reach when a row's later walks find it in cache). `tools/torch_norms.py` times PyTorch eager
//! and torch.compile on the same shapes.

use kiln::inductor::with_fresh_cache;
use kiln::{DType, Tensor};

use super::BenchResult;
use crate::harness::{max_abs_diff, once, Ctx, Timing};

const W: &str = "norms";

/// One case: its name, input shape and the function.
struct Norm {
    name: &'static str,
    shape: &'static [usize],
    f: fn(&[Tensor]) -> kiln::Result<Tensor>,
    /// The per-feature parameters' length (channels or features).
    params: usize,
}

fn batch_norm_relu(a: &[Tensor]) -> kiln::Result<Tensor> {
    a[0].batch_norm(Some(&a[1]), Some(&a[2]), None, true, 1e-5)?
        .relu()
}

fn layer_norm(a: &[Tensor]) -> kiln::Result<Tensor> {
    a[0].layer_norm(&[768], Some(&a[1]), Some(&a[2]), 1e-5)
}

const CASES: &[Norm] = &[
    Norm {
        name: "batch_norm_relu_32x64x56x56",
        shape: &[32, 64, 56, 56],
        f: batch_norm_relu,
        params: 64,
    },
    Norm {
        name: "layer_norm_4096x768",
        shape: &[4096, 768],
        f: layer_norm,
        params: 768,
    },
];

/// A call's time, and its bandwidth counting `bytes` (one read of the input, one write of the
/// output).
fn emit_call(ctx: &mut Ctx, w: &str, variant: &str, t: &Timing, bytes: f64) {
    ctx.emit(w, variant, "call", t.us(), "us");
    ctx.emit(w, variant, "bandwidth", bytes / t.s() / 1e9, "GB/s");
}

pub fn run(ctx: &mut Ctx) -> BenchResult {
    let timer = ctx.timer();
    let mode = ctx.mode_name();
    for case in CASES {
        let args = [
            Tensor::randn(case.shape, DType::F32)?.to(ctx.dev)?,
            Tensor::randn(&[case.params], DType::F32)?.to(ctx.dev)?,
            Tensor::randn(&[case.params], DType::F32)?.to(ctx.dev)?,
        ];
        let numel: usize = case.shape.iter().product();
        let bytes = (2 * numel * 4) as f64;
        let name = case.name;
        let (f, w) = (case.f, format!("{W}_{name}"));
        kiln::no_grad(|| -> BenchResult {
            let eager = timer.time(&format!("{name}: eager"), || f(&args))?;
            emit_call(ctx, &w, "eager", &eager, bytes);
            let g = kiln::compile_fn(move |a: &[Tensor]| Ok(vec![f(a)?]), ctx.opts())?;
            let (r, t) =
                with_fresh_cache(|| once(&format!("{name}: cold compile"), || g.call(&args)));
            let compiled_out = r?.remove(0);
            ctx.emit(&w, mode, "cold_compile", t.as_secs_f64(), "s");
            // compiled equals eager (bitwise on the CPU, where both sum in one order)
            let diff = max_abs_diff(&f(&args)?, &compiled_out)?;
            ctx.emit(&w, mode, "max_abs_diff_vs_eager", diff, "abs");
            let t = timer.time(&format!("{name}: compiled"), || g.call(&args))?;
            emit_call(ctx, &w, mode, &t, bytes);
            Ok(())
        })?;
    }
    Ok(())
}
