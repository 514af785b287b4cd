//! conv2d forward and both gradients on the GPU (cuDNN) against the CPU in f64: stride, padding,
//! dilation, groups (depthwise too), batch 1, 1x1 downsampling, non-contiguous operands, half
//! types, the TF32 switch; and kiln's generated kernels in place of cuDNN (channels-last, TF32).

use kiln_core::prim::ConvParams;
use kiln_core::{DType, Result, Tensor};

use super::harness::{check_fwd, check_grad, input, Rng, CUDA};

type Outcome = std::result::Result<(), String>;

/// [n, c, h, w], [o, c/groups, kh, kw], stride, padding, dilation, groups.
type Case = (
    [usize; 4],
    [usize; 4],
    [usize; 2],
    [usize; 2],
    [usize; 2],
    usize,
);

const CASES: &[Case] = &[
    ([1, 3, 8, 8], [4, 3, 3, 3], [1, 1], [1, 1], [1, 1], 1), // batch 1
    ([2, 4, 9, 7], [6, 4, 3, 2], [2, 1], [0, 1], [1, 1], 1), // stride, non-square kernel
    ([2, 3, 11, 10], [5, 3, 3, 3], [1, 1], [2, 2], [2, 2], 1), // dilation
    ([2, 4, 7, 7], [6, 2, 3, 3], [1, 1], [1, 1], [1, 1], 2), // groups
    ([2, 4, 6, 6], [4, 1, 3, 3], [2, 2], [1, 1], [1, 1], 4), // depthwise, stride 2
    ([2, 8, 8, 8], [16, 8, 1, 1], [2, 2], [0, 0], [1, 1], 1), // ResNet's 1x1 downsample
    ([3, 3, 15, 15], [8, 3, 7, 7], [2, 2], [3, 3], [1, 1], 1), // ResNet's stem (small)
    ([1, 2, 5, 6], [3, 2, 5, 6], [1, 1], [0, 0], [1, 1], 1), // kernel = input: 1x1 output
    ([2, 16, 1, 1], [16, 16, 3, 3], [1, 1], [1, 1], [1, 1], 1), // a 1x1 map, 3x3 kernel, pad 1
    ([2, 16, 2, 2], [32, 16, 3, 3], [2, 2], [1, 1], [1, 1], 1), // down to a 1x1 map
    ([2, 16, 2, 2], [32, 16, 1, 1], [2, 2], [0, 0], [1, 1], 1), // 1x1 stride 2 down to 1x1
    ([2, 64, 4, 4], [64, 64, 3, 3], [1, 1], [1, 1], [1, 1], 1), // ResNet's block at 32x32 input
];

fn conv(t: &[Tensor], c: &Case) -> Result<Tensor> {
    let (_, _, stride, padding, dilation, groups) = *c;
    t[0].conv2d(&t[1], None, stride, padding, dilation, groups)
}

fn conv_fallbacks() -> u64 {
    kiln_cuda::host_fallbacks()
        .iter()
        .filter(|(name, _)| name.starts_with("conv2d"))
        .map(|(_, n)| n)
        .sum()
}

/// A case's geometry in channels-last form, and its input and filter (NCHW, drawn from `seed`).
fn channels_last_case(c: &Case, seed: u64) -> Result<(ConvParams, Tensor, Tensor)> {
    let (_, _, stride, padding, dilation, groups) = *c;
    let params = ConvParams {
        stride,
        padding,
        dilation,
        groups,
        channels_last: true,
    };
    let mut rng = Rng::new(seed);
    let x = input(&mut rng, &c.0, -1.0, 1.0, false)?;
    let w = input(&mut rng, &c.1, -0.5, 0.5, false)?;
    Ok((params, x, w))
}

/// Forward, grad input and grad weight of every case, f32 on cuDNN (FMA math) vs f64 on the CPU,
/// with no host fallback taken.
pub fn cudnn_forward_and_backward() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    let before = conv_fallbacks();
    for (i, c) in CASES.iter().enumerate() {
        let mut rng = Rng::new(2000 + i as u64);
        let strided = i % 2 == 1;
        let x = input(&mut rng, &c.0, -1.0, 1.0, strided).map_err(e)?;
        let w = input(&mut rng, &c.1, -0.5, 0.5, false).map_err(e)?;
        check_grad(&format!("conv2d case {i} {c:?}"), &[x, w], 1e-5, |t| {
            conv(t, c)
        })?;
    }
    let after = conv_fallbacks();
    if after != before {
        return Err(format!(
            "{} convolutions took the host path (is cuDNN missing?): {:?}",
            after - before,
            kiln_cuda::host_fallbacks()
        ));
    }
    // the default path is the graph API (cheap per call); the legacy API only in benchmark mode
    let (graph, _) = kiln_cuda::cudnn_plan_counts();
    if !kiln_cuda::cudnn_benchmark() && graph == 0 {
        return Err(format!(
            "no convolution ran on a graph-API plan: {:?}",
            kiln_cuda::cudnn_graph_error()
        ));
    }
    Ok(())
}

/// The channels-last prims (`ConvParams::channels_last`, which the compiler's layout pass writes):
/// forward, grad input and grad weight of every case on NHWC cuDNN descriptors, through the graph
/// API and the legacy one (benchmark mode), against the CPU in f64, with no host fallback.
pub fn cudnn_channels_last() -> Outcome {
    use kiln_core::dispatch::apply;
    use kiln_core::prim::{Prim, FROM_CHANNELS_LAST, TO_CHANNELS_LAST};
    let e = |x: kiln_core::Error| x.to_string();
    let before = conv_fallbacks();
    let perm = |p: [usize; 4]| p.map(|d| d as isize);
    for benchmark in [false, true] {
        kiln_cuda::set_cudnn_benchmark(benchmark);
        for (i, c) in CASES.iter().enumerate() {
            let (params, x, w) = channels_last_case(c, 2400 + i as u64).map_err(e)?;
            let what = format!("channels-last conv2d case {i} {c:?} (benchmark {benchmark})");
            let r = check_grad(&what, &[x, w], 1e-5, |t| {
                let nhwc = |t: &Tensor| t.permute(&perm(TO_CHANNELS_LAST))?.contiguous();
                let y = apply(Prim::Conv2d(params), &[&nhwc(&t[0])?, &nhwc(&t[1])?])?;
                y.permute(&perm(FROM_CHANNELS_LAST))
            });
            if r.is_err() {
                kiln_cuda::set_cudnn_benchmark(false);
                return r;
            }
        }
    }
    kiln_cuda::set_cudnn_benchmark(false);
    let after = conv_fallbacks();
    if after != before {
        return Err(format!(
            "{} channels-last convolutions took the host path: {:?}",
            after - before,
            kiln_cuda::host_fallbacks()
        ));
    }
    Ok(())
}

/// conv2d with bias through the layer, batch 1, as a model runs it.
pub fn cudnn_bias_and_layer() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    let mut rng = Rng::new(2100);
    let x = input(&mut rng, &[1, 3, 10, 9], -1.0, 1.0, false).map_err(e)?;
    let w = input(&mut rng, &[5, 3, 3, 3], -0.5, 0.5, false).map_err(e)?;
    let b = input(&mut rng, &[5], -0.5, 0.5, false).map_err(e)?;
    check_grad("conv2d with bias", &[x, w, b], 1e-5, |t| {
        t[0].conv2d(&t[1], Some(&t[2]), [2, 1], [1, 1], [1, 1], 1)
    })
}

/// f16 and bf16 convolutions (tensor cores, f32 accumulation) within their precision; the CPU
/// reference computes from the same rounded inputs.
pub fn cudnn_half_types() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    for (dtype, tol) in [(DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        for (i, c) in CASES.iter().enumerate().take(5) {
            let mut rng = Rng::new(2200 + i as u64);
            let x = input(&mut rng, &c.0, -1.0, 1.0, false).map_err(e)?;
            let w = input(&mut rng, &c.1, -0.5, 0.5, false).map_err(e)?;
            let (x, w) = (x.to_dtype(dtype).map_err(e)?, w.to_dtype(dtype).map_err(e)?);
            check_fwd(&format!("conv2d {dtype} case {i}"), &[x, w], tol, |t| {
                let t: Vec<Tensor> = t.iter().map(|v| v.to_dtype(dtype)).collect::<Result<_>>()?;
                conv(&t, c)
            })?;
        }
    }
    Ok(())
}

/// With TF32 allowed, f32 convolutions stay within TF32's precision; the switch goes back off.
pub fn cudnn_tf32_switch() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    let mut rng = Rng::new(2300);
    let c = &CASES[6];
    let x = input(&mut rng, &c.0, -1.0, 1.0, false).map_err(e)?;
    let w = input(&mut rng, &c.1, -0.5, 0.5, false).map_err(e)?;
    kiln_cuda::set_cudnn_allow_tf32(true);
    let r = check_fwd("conv2d tf32", &[x.clone(), w.clone()], 5e-3, |t| conv(t, c));
    kiln_cuda::set_cudnn_allow_tf32(false);
    r?;
    // and off again: full f32 precision (a plan made with TF32 must not be reused)
    check_fwd("conv2d after tf32", &[x, w], 1e-5, |t| conv(t, c))
}

/// The legacy API's path (benchmark mode: algorithms timed once per shape) on the same cases.
pub fn cudnn_benchmark_mode() -> Outcome {
    kiln_cuda::set_cudnn_benchmark(true);
    let r = cudnn_forward_and_backward();
    kiln_cuda::set_cudnn_benchmark(false);
    r
}

/// Convolution plans chosen by heuristics are stored in the kiln cache folder and rebuilt from
/// there by a later scope (as by a new process), giving the same results; a damaged entry is
/// ignored and replaced. Each scope makes one plan (`cudnn_plan_counts` counts plans rebuilt from
/// disk too); `cudnn_plan_disk_hits` tells which came from disk.
pub fn cudnn_plans_on_disk() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    let dir = std::env::temp_dir().join(format!("kiln-cudnn-plans-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut rng = Rng::new(2600);
    // a shape no other test uses, so this process has made no plan for it
    let x = input(&mut rng, &[3, 5, 11, 9], -1.0, 1.0, false)
        .and_then(|t| t.to(CUDA))
        .map_err(e)?;
    let w = input(&mut rng, &[7, 5, 3, 3], -0.5, 0.5, false)
        .and_then(|t| t.to(CUDA))
        .map_err(e)?;
    let conv = || -> Result<Vec<f32>> {
        x.conv2d(&w, None, [1, 1], [1, 1], [1, 1], 1)?
            .to_vec::<f32>()
    };
    let in_scope = |f: &dyn Fn() -> Result<Vec<f32>>| {
        let (made, hits) = (
            kiln_cuda::cudnn_plan_counts().0,
            kiln_cuda::cudnn_plan_disk_hits(),
        );
        let y = kiln_core::cache::with_root(dir.clone(), f).map_err(e)?;
        let made = kiln_cuda::cudnn_plan_counts().0 - made;
        Ok::<_, String>((y, made, kiln_cuda::cudnn_plan_disk_hits() - hits))
    };
    let result = (|| {
        let (first, made, hits) = in_scope(&conv)?;
        let entries: Vec<_> = std::fs::read_dir(dir.join("cudnn"))
            .map_err(|err| format!("no plan folder after the first scope: {err}"))?
            .filter_map(|d| d.ok().map(|d| d.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        if made != 1 || hits != 0 || entries.len() != 1 {
            return Err(format!(
                "first scope: {made} plans made, {hits} from disk, {} entries stored (want 1, 0, 1)",
                entries.len()
            ));
        }
        let (again, made, hits) = in_scope(&conv)?;
        if made != 1 || hits != 1 || again != first {
            return Err(format!(
                "second scope: {made} plans made, {hits} from disk (want 1, 1), same result: {}",
                again == first
            ));
        }
        std::fs::write(&entries[0], b"{ not a plan").map_err(|err| err.to_string())?;
        let (third, made, hits) = in_scope(&conv)?;
        if made != 1 || hits != 0 || third != first {
            return Err(format!(
                "damaged entry: {made} plans made, {hits} from disk (want 1, 0), same result: {}",
                third == first
            ));
        }
        let (_, made, hits) = in_scope(&conv)?;
        match (made, hits) {
            (1, 1) => Ok(()),
            _ => Err(format!(
                "after the damaged entry was replaced: {made} made, {hits} from disk (want 1, 1)"
            )),
        }
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// With the switch on, channels-last convolutions with TF32 allowed run on kiln's generated
/// kernels (`conv_generated.rs`): forward, data and weight gradients against the CPU in f64 within
/// TF32's precision, through the tile widths (32, 64 and 128 output columns), four-wide and
/// scalar loads (channels not a multiple of 4, as a stem's RGB input), strides, padding and
/// dilation, k in channel blocks (channels a multiple of 16) or not, the weight gradient's sum
/// split across blocks, and operands that are views (copied first). The split sum is
/// deterministic: a second run gives the same bits. No convolution reaches cuDNN's plans or the
/// host path. On compute capability 9.0 the forwards and stride-1 data gradients whose summed
/// channels are a multiple of 4 run on Hopper's kernel (`conv_wgmma.rs`; the stem's forward
/// stays on mma.sync): a channel block cut short (36 = 32 + 4), an odd number of output
/// channels, windows walking past the last image, tiles of every width.
pub fn generated_channels_last() -> Outcome {
    use kiln_core::dispatch::apply;
    use kiln_core::prim::{Prim, FROM_CHANNELS_LAST, TO_CHANNELS_LAST};
    let e = |x: kiln_core::Error| x.to_string();
    let generated: &[Case] = &[
        ([2, 8, 9, 9], [32, 8, 3, 3], [1, 1], [1, 1], [1, 1], 1), // 32 columns, four-wide
        ([2, 16, 6, 7], [40, 16, 3, 3], [2, 2], [1, 1], [1, 1], 1), // 64 columns, stride 2
        ([4, 12, 17, 13], [24, 12, 1, 1], [1, 1], [0, 0], [1, 1], 1), // 1x1
        ([2, 3, 40, 40], [16, 3, 7, 7], [2, 2], [3, 3], [1, 1], 1), // a stem: scalar loads
        ([8, 16, 32, 32], [32, 16, 3, 3], [1, 1], [1, 1], [1, 1], 1), // a long split sum
        ([2, 8, 11, 10], [8, 8, 3, 3], [1, 1], [2, 2], [2, 2], 1), // dilation
        ([3, 20, 9, 9], [72, 20, 3, 1], [1, 2], [1, 0], [1, 1], 1), // 72 columns: a 128-wide tile
        ([2, 32, 9, 9], [64, 32, 3, 3], [1, 1], [1, 1], [1, 1], 1), // k in channel blocks
        ([2, 48, 5, 6], [32, 48, 3, 3], [2, 1], [2, 1], [2, 1], 1), // the same, strided, dilated
        ([2, 36, 7, 9], [5, 36, 5, 5], [1, 1], [4, 4], [2, 2], 1), // 36 channels, 5 out, 5x5
        ([3, 64, 5, 5], [136, 64, 1, 1], [1, 1], [0, 0], [1, 1], 1), // 160-wide tile
        ([2, 96, 6, 6], [200, 96, 3, 3], [1, 1], [1, 1], [1, 1], 1), // two 128-wide tiles
        ([2, 160, 4, 5], [92, 160, 1, 1], [1, 1], [0, 0], [1, 1], 1), // 96 wide; dx 160
        ([2, 184, 3, 3], [24, 184, 3, 3], [1, 1], [1, 1], [1, 1], 1), // dx 192 wide
        ([2, 8, 5, 5], [320, 8, 3, 3], [1, 1], [1, 1], [1, 1], 1), // two 160-wide tiles
        ([2, 320, 3, 4], [16, 320, 1, 1], [1, 1], [0, 0], [1, 1], 1), // dx in two 160s
    ];
    let cases: Vec<&Case> = generated
        .iter()
        .chain(CASES.iter().filter(|c| c.5 == 1))
        .collect();
    let before = (kiln_cuda::generated_convs(), conv_fallbacks());
    let hopper_before = kiln_cuda::hopper_convs();
    let plans_before = kiln_cuda::cudnn_plan_counts();
    let perm = |p: [usize; 4]| p.map(|d| d as isize);
    kiln_cuda::set_cudnn_allow_tf32(true);
    kiln_cuda::set_generated_conv(true);
    let mut ran = 0;
    let mut check = || -> Outcome {
        for (i, &c) in cases.iter().enumerate() {
            let (params, x, w) = channels_last_case(c, 2700 + i as u64).map_err(e)?;
            let what = format!("generated channels-last conv2d case {i} {c:?}");
            // odd cases pass the NHWC views themselves (not contiguous: the runtime copies)
            let view = i % 2 == 1;
            let conv = |t: &[Tensor]| -> Result<Tensor> {
                let nhwc = |t: &Tensor| -> Result<Tensor> {
                    let v = t.permute(&perm(TO_CHANNELS_LAST))?;
                    if view {
                        Ok(v)
                    } else {
                        v.contiguous()
                    }
                };
                let y = apply(Prim::Conv2d(params), &[&nhwc(&t[0])?, &nhwc(&t[1])?])?;
                y.permute(&perm(FROM_CHANNELS_LAST))
            };
            // TF32 rounds each operand to 10 mantissa bits (as cuDNN's TF32 check allows)
            check_grad(&what, &[x.clone(), w.clone()], 5e-3, conv)?;
            ran += 3;
            // the same bits again (the weight gradient's split sum has a fixed order)
            let bits = |x: &Tensor, w: &Tensor| -> Result<(Vec<f32>, Vec<f32>)> {
                let (x, w) = (x.to(CUDA)?.with_grad()?, w.to(CUDA)?.with_grad()?);
                let y = conv(&[x.clone(), w.clone()])?;
                y.sum_all()?.backward()?;
                let gw = w
                    .grad()
                    .ok_or_else(|| kiln_core::Error::arg("test", "no grad"))?;
                Ok((y.to_vec::<f32>()?, gw.to_vec::<f32>()?))
            };
            let (a, b) = (bits(&x, &w).map_err(e)?, bits(&x, &w).map_err(e)?);
            ran += 6;
            if a != b {
                return Err(format!("{what}: a second run gave other bits"));
            }
        }
        Ok(())
    };
    let r = check();
    kiln_cuda::set_cudnn_allow_tf32(false);
    kiln_cuda::set_generated_conv(false);
    r?;
    let after = (kiln_cuda::generated_convs(), conv_fallbacks());
    if after.0 - before.0 != ran || after.1 != before.1 {
        return Err(format!(
            "{} generated convolutions of {ran} run, {} host fallbacks",
            after.0 - before.0,
            after.1 - before.1
        ));
    }
    if kiln_cuda::cudnn_plan_counts() != plans_before {
        return Err("a generated convolution made a cuDNN plan".into());
    }
    // three of each kind a case (the gradient check's, then two runs for the bits); a forward
    // fits with channels a multiple of 4, a data gradient at stride 1 with out channels a
    // multiple of 4 and padding within the window's reach, a weight gradient with both
    let hopper = kiln_cuda::hopper_convs() - hopper_before;
    let fit = |c: &&Case| -> usize {
        let (x, w, stride, padding, dilation, _) = **c;
        let forward = x[1] % 4 == 0;
        let data = stride == [1, 1]
            && w[0] % 4 == 0
            && (0..2).all(|i| padding[i] <= dilation[i] * (w[2 + i] - 1));
        let weight = x[1] % 4 == 0 && w[0] % 4 == 0;
        3 * (usize::from(forward) + usize::from(data) + usize::from(weight))
    };
    let want = match kiln_cuda::compute_capability(CUDA).map_err(e)? {
        (9, 0) => cases.iter().map(fit).sum(),
        _ => 0,
    };
    if hopper != want {
        return Err(format!(
            "{hopper} convolutions ran on Hopper's kernels, want {want}"
        ));
    }
    Ok(())
}

/// A channel slice of a wider channels-last tensor (a dense layer's new features within the
/// gradient of the concatenations they joined) is read in place by the generated kernels that
/// walk their operands through tensor maps: the forward's input, the data gradient's output
/// gradient and both operands of the weight gradient give the bits a packed copy gives. On
/// compute capability 9.0 the four are read in place (`slices_read_in_place`); elsewhere the
/// mma.sync kernels take packed copies, with the same check of the bits.
pub fn generated_channel_slices() -> Outcome {
    use kiln_core::dispatch::apply;
    use kiln_core::prim::Prim;
    let e = |x: kiln_core::Error| x.to_string();
    // (n, h, w), the wide tensor's channels, the slice's first channel and channels, the
    // filter's other channels, its size: a 3x3 at an offset of 8 channels, then a 1x1 whose
    // 36 channels cut a channel block short
    let cases = [
        ([2usize, 6, 5], 100usize, 8usize, 32usize, 16usize, 3usize),
        ([3, 4, 7], 72, 4, 36, 8, 1),
    ];
    kiln_cuda::set_cudnn_allow_tf32(true);
    kiln_cuda::set_generated_conv(true);
    let before = kiln_cuda::slices_read_in_place();
    let run = || -> Outcome {
        for (i, &([n, h, w], wide_c, start, c, other, k)) in cases.iter().enumerate() {
            let what = format!("channel slice case {i}");
            let mut rng = Rng::new(4100 + i as u64);
            let params = ConvParams {
                stride: [1, 1],
                padding: [k / 2, k / 2],
                dilation: [1, 1],
                groups: 1,
                channels_last: true,
            };
            let wide = |rng: &mut Rng| -> Result<Tensor> {
                input(rng, &[n, h, w, wide_c], -1.0, 1.0, false)?.to(CUDA)
            };
            let slice = wide(&mut rng).map_err(e)?.narrow(3, start, c).map_err(e)?;
            if slice.is_contiguous() {
                return Err(format!("{what}: the slice is contiguous"));
            }
            let packed = slice.contiguous().map_err(e)?;
            // filters in channels-last order (K, R, S, C): the slice as the forward's input,
            // then as the data gradient's output gradient
            let w_in = input(&mut rng, &[other, k, k, c], -0.5, 0.5, false)
                .and_then(|t| t.to(CUDA))
                .map_err(e)?;
            let w_out = input(&mut rng, &[c, k, k, other], -0.5, 0.5, false)
                .and_then(|t| t.to(CUDA))
                .map_err(e)?;
            let x2 = wide(&mut rng).map_err(e)?.narrow(3, start, c).map_err(e)?;
            let x2_packed = x2.contiguous().map_err(e)?;
            let prims = [
                Prim::Conv2d(params),
                Prim::Conv2dGradInput {
                    params,
                    input_shape: [n, h, w, other],
                },
                Prim::Conv2dGradWeight {
                    params,
                    weight_shape: [c, k, k, c],
                },
            ];
            let operands: [[&Tensor; 4]; 3] = [
                [&slice, &w_in, &packed, &w_in],
                [&slice, &w_out, &packed, &w_out],
                [&slice, &x2, &packed, &x2_packed],
            ];
            for (prim, [a, b, pa, pb]) in prims.iter().zip(operands) {
                let bits = |x: &Tensor, y: &Tensor| -> Result<Vec<f32>> {
                    apply(prim.clone(), &[x, y])?.to_vec::<f32>()
                };
                let (sliced, packed) = (bits(a, b).map_err(e)?, bits(pa, pb).map_err(e)?);
                if sliced != packed {
                    return Err(format!(
                        "{what}: {} differs from a packed copy's",
                        prim.name()
                    ));
                }
            }
        }
        Ok(())
    };
    let r = run();
    kiln_cuda::set_cudnn_allow_tf32(false);
    kiln_cuda::set_generated_conv(false);
    r?;
    let read = kiln_cuda::slices_read_in_place() - before;
    let want = match kiln_cuda::compute_capability(CUDA).map_err(e)? {
        (9, 0) => 4 * cases.len(),
        _ => 0,
    };
    if read != want {
        return Err(format!("{read} slices read in place, want {want}"));
    }
    Ok(())
}
