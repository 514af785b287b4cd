//! `Prim::Conv2dEpilogue` on the GPU (one cuDNN operation graph: the convolution and
//! `act(y * scale + shift + residual)` after it) against the same prim on the CPU in f64, which
//! runs the convolution and the ops it stands for: NCHW and channels-last, f32 with and without
//! TF32, f16 and bf16, every part of the epilogue, strided operands. Where cuDNN has no fused
//! engine for a case the prim still runs, as the convolution and the ops on the device.

use kiln_core::dispatch::apply;
use kiln_core::prim::{
    Activation, ConvEpilogue, ConvParams, Prim, FROM_CHANNELS_LAST, TO_CHANNELS_LAST,
};
use kiln_core::{DType, Result, Tensor};

use super::harness::{check_fwd, input, Rng};

type Outcome = std::result::Result<(), String>;

/// [n, c, h, w], [o, c, k, k], stride, padding.
type Case = ([usize; 4], [usize; 4], usize, usize);

const CASES: &[Case] = &[
    ([2, 64, 8, 8], [64, 64, 3, 3], 1, 1), // a ResNet block's convolution
    ([2, 32, 9, 9], [64, 32, 1, 1], 2, 0), // a 1x1 downsample
    ([1, 3, 15, 15], [16, 3, 7, 7], 2, 3), // a stem: 3 input channels
    ([2, 5, 6, 6], [7, 5, 3, 3], 1, 1),    // channel counts no vector width divides
];

const EPILOGUES: &[ConvEpilogue] = &[
    // eval batch norm + ReLU
    ConvEpilogue {
        scale: true,
        shift: true,
        residual: false,
        act: Activation::Relu,
    },
    // eval batch norm + the skip connection + ReLU (a ResNet block's end)
    ConvEpilogue {
        scale: true,
        shift: true,
        residual: true,
        act: Activation::Relu,
    },
    // Conv2d's bias
    ConvEpilogue {
        scale: false,
        shift: true,
        residual: false,
        act: Activation::None,
    },
    // bias + tanh-GELU
    ConvEpilogue {
        scale: false,
        shift: true,
        residual: false,
        act: Activation::GeluTanh,
    },
];

fn run(t: &[Tensor], params: ConvParams, e: ConvEpilogue) -> Result<Tensor> {
    let perm = |p: [usize; 4]| p.map(|d| d as isize);
    let ordered = |t: &Tensor| match params.channels_last {
        true => t.permute(&perm(TO_CHANNELS_LAST)),
        false => Ok(t.clone()),
    };
    let (x, w, res) = (ordered(&t[0])?, ordered(&t[1])?, ordered(&t[4])?);
    let mut ops = vec![&x, &w];
    if e.scale {
        ops.push(&t[2]);
    }
    if e.shift {
        ops.push(&t[3]);
    }
    if e.residual {
        ops.push(&res);
    }
    let y = apply(
        Prim::Conv2dEpilogue {
            params,
            epilogue: e,
        },
        &ops,
    )?;
    match params.channels_last {
        true => y.permute(&perm(FROM_CHANNELS_LAST)),
        false => Ok(y),
    }
}

/// Every case, epilogue, layout and dtype against the CPU. Prints which configurations cuDNN
/// fused (`cudnn_fused_plans`), and requires that some did.
pub fn cudnn_epilogues() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    let configs = [
        (DType::F32, false, 1e-5),
        (DType::F32, true, 5e-3),
        (DType::F16, true, 4e-3),
        (DType::BF16, true, 3e-2),
    ];
    let mut fused_any = false;
    for (dtype, tf32, tol) in configs {
        kiln_cuda::set_cudnn_allow_tf32(tf32);
        for channels_last in [true, false] {
            let mut fused = Vec::new();
            for (i, c) in CASES.iter().enumerate() {
                let (xs, ws, stride, pad) = *c;
                let params = ConvParams {
                    stride: [stride; 2],
                    padding: [pad; 2],
                    dilation: [1, 1],
                    groups: 1,
                    channels_last,
                };
                let oh = (xs[2] + 2 * pad - ws[2]) / stride + 1;
                let ow = (xs[3] + 2 * pad - ws[3]) / stride + 1;
                for (j, ep) in EPILOGUES.iter().enumerate() {
                    let mut rng = Rng::new(2600 + 10 * i as u64 + j as u64);
                    let strided = (i + j) % 2 == 1;
                    let mut t = vec![
                        input(&mut rng, &xs, -1.0, 1.0, strided).map_err(e)?,
                        input(&mut rng, &ws, -0.3, 0.3, false).map_err(e)?,
                        input(&mut rng, &[ws[0]], 0.5, 1.5, false).map_err(e)?,
                        input(&mut rng, &[ws[0]], -0.5, 0.5, strided).map_err(e)?,
                        input(&mut rng, &[xs[0], ws[0], oh, ow], -1.0, 1.0, strided).map_err(e)?,
                    ];
                    for v in &mut t {
                        *v = v.to_dtype(dtype).map_err(e)?;
                    }
                    let before = kiln_cuda::cudnn_fused_plans();
                    let what = format!(
                        "conv2d_epilogue {dtype} tf32 {tf32} channels-last {channels_last} \
                         case {i} {c:?} {ep:?}"
                    );
                    let r = check_fwd(&what, &t, tol, |t| {
                        let t: Vec<Tensor> =
                            t.iter().map(|v| v.to_dtype(dtype)).collect::<Result<_>>()?;
                        run(&t, params, *ep)
                    });
                    if r.is_err() {
                        kiln_cuda::set_cudnn_allow_tf32(false);
                        return r;
                    }
                    fused.push(kiln_cuda::cudnn_fused_plans() > before);
                }
            }
            fused_any |= fused.iter().any(|&f| f);
            println!(
                "conv2d_epilogue {dtype} tf32 {tf32} channels-last {channels_last}: fused {:?}",
                fused.iter().map(|&f| u8::from(f)).collect::<Vec<_>>()
            );
        }
    }
    kiln_cuda::set_cudnn_allow_tf32(false);
    if !fused_any {
        return Err(format!(
            "cuDNN fused no epilogue: {:?}",
            kiln_cuda::cudnn_graph_error()
        ));
    }
    Ok(())
}
