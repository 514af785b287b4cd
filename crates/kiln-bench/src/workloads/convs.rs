//! DenseNet-121's convolutions one by one (batch 64, 224x224, channels-last f32 with TF32, as its
//! compiled training step runs them), forward, data gradient and weight gradient, on cuDNN and on
//! kiln's generated kernels (`kiln::cuda::set_generated_conv`): where the generated kernels stand
//! against cuDNN's Hopper kernels, shape by shape, and the step's convolution time each would
//! give (every shape weighted by its count in the step). GPU only.
//!
//! Rows: `convs_LABEL` / `KIND_ENGINE` / `call` (us) and `tflops`; `convs_step` / `KIND_ENGINE` /
//! `weighted_total` (ms). The stem's data gradient is timed but left out of the totals (the
//! step does not compute it: the images need no gradient).

use kiln::core::dispatch::apply;
use kiln::core::prim::{ConvParams, Prim};
use kiln::{DType, Tensor};

use super::BenchResult;
use crate::harness::Ctx;

/// A convolution of the step: its label, input channels, input size (square), output channels,
/// kernel size (square), stride, padding, and how many of it the step has.
type Shape = (
    &'static str,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
);

const BATCH: usize = 64;

/// The stem, each dense block's 1x1 bottleneck at a middle layer's input width and its 3x3
/// growth convolution, and two transitions: the layers between share their kinds and sizes.
const SHAPES: &[Shape] = &[
    ("stem_7x7_s2", 3, 224, 64, 7, 2, 3, 1),
    ("1x1_56_c64", 64, 56, 128, 1, 1, 0, 1),
    ("1x1_56_c160", 160, 56, 128, 1, 1, 0, 6),
    ("3x3_56", 128, 56, 32, 3, 1, 1, 6),
    ("1x1_28_c320", 320, 28, 128, 1, 1, 0, 12),
    ("3x3_28", 128, 28, 32, 3, 1, 1, 12),
    ("1x1_14_c640", 640, 14, 128, 1, 1, 0, 24),
    ("3x3_14", 128, 14, 32, 3, 1, 1, 24),
    ("1x1_7_c768", 768, 7, 128, 1, 1, 0, 16),
    ("3x3_7", 128, 7, 32, 3, 1, 1, 16),
    ("trans_56_256_128", 256, 56, 128, 1, 1, 0, 1),
    ("trans_14_1024_512", 1024, 14, 512, 1, 1, 0, 1),
];

const KINDS: [&str; 3] = ["forward", "grad_input", "grad_weight"];

pub fn run(ctx: &mut Ctx) -> BenchResult {
    if !ctx.on_gpu() {
        return Err("convs runs on a GPU (it compares cuDNN with kiln's generated kernels)".into());
    }
    let timer = ctx.timer();
    let was = kiln::cuda::generated_conv();
    // [engine][kind] milliseconds over the step
    let mut totals = [[0.0f64; 3]; 2];
    let r = kiln::no_grad(|| -> BenchResult {
        for &(label, c, h, k, r, stride, pad, count) in SHAPES {
            let p = ConvParams {
                stride: [stride; 2],
                padding: [pad; 2],
                dilation: [1, 1],
                groups: 1,
                channels_last: true,
            };
            let oh = (h + 2 * pad - r) / stride + 1;
            let (xs, ws) = ([BATCH, h, h, c], [k, r, r, c]);
            let x = Tensor::randn(&xs, DType::F32)?.to(ctx.dev)?;
            let w = Tensor::randn(&ws, DType::F32)?.to(ctx.dev)?;
            let dy = Tensor::randn(&[BATCH, oh, oh, k], DType::F32)?.to(ctx.dev)?;
            let flops = 2.0 * (BATCH * oh * oh * k * r * r * c) as f64;
            for (e, engine) in ["cudnn", "generated"].into_iter().enumerate() {
                kiln::cuda::set_generated_conv(e == 1);
                for (kind_index, kind) in KINDS.into_iter().enumerate() {
                    let call = || match kind_index {
                        0 => apply(Prim::Conv2d(p), &[&x, &w]),
                        1 => apply(
                            Prim::Conv2dGradInput {
                                params: p,
                                input_shape: xs,
                            },
                            &[&dy, &w],
                        ),
                        _ => apply(
                            Prim::Conv2dGradWeight {
                                params: p,
                                weight_shape: ws,
                            },
                            &[&dy, &x],
                        ),
                    };
                    let t = timer.time(&format!("{label} {kind} {engine}"), call)?;
                    let (w_name, variant) = (format!("convs_{label}"), format!("{kind}_{engine}"));
                    ctx.emit(&w_name, &variant, "call", t.us(), "us");
                    ctx.emit(&w_name, &variant, "tflops", flops / t.s() / 1e12, "TFLOP/s");
                    // the step computes no gradient of the images
                    if !(c == 3 && kind_index == 1) {
                        totals[e][kind_index] += t.us() * count as f64 / 1e3;
                    }
                }
            }
        }
        Ok(())
    });
    kiln::cuda::set_generated_conv(was);
    r?;
    for (e, engine) in ["cudnn", "generated"].into_iter().enumerate() {
        for (k, kind) in KINDS.into_iter().enumerate() {
            let variant = format!("{kind}_{engine}");
            ctx.emit("convs_step", &variant, "weighted_total", totals[e][k], "ms");
        }
    }
    Ok(())
}
