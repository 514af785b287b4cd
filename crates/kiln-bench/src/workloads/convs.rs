//! A model's convolutions one by one (batch 64, 224x224, channels-last f32 with TF32, as its
//! compiled training step runs them), forward, data gradient and weight gradient, on cuDNN and on
//! kiln's generated kernels (`kiln::cuda::set_conv_engine`): where the generated kernels stand
//! against cuDNN's Hopper kernels, shape by shape, and the step's convolution time each would
//! give (every shape weighted by its count in the step). `convs` runs DenseNet-121's,
//! `convs_resnet18` ResNet-18's. GPU only.
//!
//! Rows: `convs_LABEL` / `KIND_ENGINE` / `call` (us) and `tflops`; `convs_step` (DenseNet-121) or
//! `convs_resnet18_step` / `KIND_ENGINE` / `weighted_total` (ms). The stem's data gradient is
//! timed but left out of the totals (the step does not compute it: the images need no gradient).

use kiln::core::dispatch::apply;
use kiln::core::prim::{ConvParams, Prim};
use kiln::cuda::ConvEngine;
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

/// ResNet-18's: the stem, each stage's 3x3 convolutions, and the first block of stages 2-4 with
/// its strided 3x3 and its 1x1 downsample.
const RESNET18_SHAPES: &[Shape] = &[
    ("r18_stem_7x7_s2", 3, 224, 64, 7, 2, 3, 1),
    ("r18_3x3_56_c64", 64, 56, 64, 3, 1, 1, 4),
    ("r18_3x3_s2_56_c64", 64, 56, 128, 3, 2, 1, 1),
    ("r18_1x1_s2_56_c64", 64, 56, 128, 1, 2, 0, 1),
    ("r18_3x3_28_c128", 128, 28, 128, 3, 1, 1, 3),
    ("r18_3x3_s2_28_c128", 128, 28, 256, 3, 2, 1, 1),
    ("r18_1x1_s2_28_c128", 128, 28, 256, 1, 2, 0, 1),
    ("r18_3x3_14_c256", 256, 14, 256, 3, 1, 1, 3),
    ("r18_3x3_s2_14_c256", 256, 14, 512, 3, 2, 1, 1),
    ("r18_1x1_s2_14_c256", 256, 14, 512, 1, 2, 0, 1),
    ("r18_3x3_7_c512", 512, 7, 512, 3, 1, 1, 3),
];

const KINDS: [&str; 3] = ["forward", "grad_input", "grad_weight"];

/// The engines compared, by the name their rows carry (`totals`' first index).
const ENGINES: [(&str, ConvEngine); 2] = [
    ("cudnn", ConvEngine::Cudnn),
    ("generated", ConvEngine::Generated),
];

/// DenseNet-121's convolutions.
pub fn run(ctx: &mut Ctx) -> BenchResult {
    run_shapes(ctx, SHAPES, "convs_step")
}

/// ResNet-18's convolutions.
pub fn run_resnet18(ctx: &mut Ctx) -> BenchResult {
    run_shapes(ctx, RESNET18_SHAPES, "convs_resnet18_step")
}

/// Times each of `shapes` on both engines; `step` names the weighted totals' rows.
fn run_shapes(ctx: &mut Ctx, shapes: &[Shape], step: &str) -> BenchResult {
    if !ctx.on_gpu() {
        return Err("convs runs on a GPU (it compares cuDNN with kiln's generated kernels)".into());
    }
    let timer = ctx.timer();
    let was = kiln::cuda::conv_engine();
    // [engine][kind] milliseconds over the step
    let mut totals = [[0.0f64; 3]; 2];
    let r = kiln::no_grad(|| -> BenchResult {
        for &(label, c, h, k, r, stride, pad, count) in shapes {
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
            for (e, (engine, setting)) in ENGINES.into_iter().enumerate() {
                kiln::cuda::set_conv_engine(setting);
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
                    let (ran, hopper) = (kiln::cuda::generated_convs(), kiln::cuda::hopper_convs());
                    let t = timer.time(&format!("{label} {kind} {engine}"), call)?;
                    let (w_name, variant) = (format!("convs_{label}"), format!("{kind}_{engine}"));
                    ctx.emit(&w_name, &variant, "call", t.us(), "us");
                    if setting == ConvEngine::Generated {
                        // which family ran it: 1 where Hopper's kernels did, 0 the mma.sync ones
                        let hopper_share = (kiln::cuda::hopper_convs() - hopper) as f64
                            / (kiln::cuda::generated_convs() - ran).max(1) as f64;
                        ctx.emit(&w_name, &variant, "hopper_share", hopper_share, "ratio");
                    }
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
    kiln::cuda::set_conv_engine(was);
    r?;
    for (e, (engine, _)) in ENGINES.into_iter().enumerate() {
        for (k, kind) in KINDS.into_iter().enumerate() {
            let variant = format!("{kind}_{engine}");
            ctx.emit(step, &variant, "weighted_total", totals[e][k], "ms");
        }
    }
    Ok(())
}
