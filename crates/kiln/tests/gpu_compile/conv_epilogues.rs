//! Convolution epilogues on the GPU (`kiln-inductor/src/conv_epilogue.rs`): an eval-mode ResNet
//! block compiled in max-autotune runs its batch norms, skip connection and ReLUs inside cuDNN's
//! convolution calls (one fused operation graph each), equal to eager within TF32's or half
//! precision's rounding; the default mode leaves them to generated kernels; with TF32 off (no
//! fused engine for f32) the fused prims still run, as the convolution and the ops.

use kiln::core::RunningStats;
use kiln::prelude::*;

use super::{close, conv_switches, err, randn, Outcome, CUDA};

/// `relu(bn(conv(relu(bn(conv(x))))) + x)`, eval mode; `p`: x, two weights, two batch norms'
/// mean, var, weight and bias.
fn block(p: &[Tensor]) -> Result<Vec<Tensor>> {
    let bn = |x: &Tensor, s: &[Tensor]| {
        let stats = RunningStats {
            mean: &s[0],
            var: &s[1],
            momentum: 0.1,
        };
        x.batch_norm(Some(&s[2]), Some(&s[3]), Some(stats), false, 1e-5)
    };
    let conv = |x: &Tensor, w: &Tensor| x.conv2d(w, None, [1, 1], [1, 1], [1, 1], 1);
    let h = bn(&conv(&p[0], &p[1])?, &p[3..7])?.relu()?;
    let h = bn(&conv(&h, &p[2])?, &p[7..11])?;
    Ok(vec![h.add(&p[0])?.relu()?])
}

fn inputs(seed: u64, dtype: DType) -> Result<Vec<Tensor>> {
    let c = 32;
    let mut v = vec![
        randn(&[4, c, 12, 12], seed)?,
        randn(&[c, c, 3, 3], seed + 1)?.mul(0.1)?,
        randn(&[c, c, 3, 3], seed + 2)?.mul(0.1)?,
    ];
    for i in 0..2 {
        let s = seed + 10 + 4 * i;
        v.push(randn(&[c], s)?.mul(0.1)?);
        v.push(randn(&[c], s + 1)?.abs()?.add(0.5)?);
        v.push(randn(&[c], s + 2)?.mul(0.2)?.add(1.0)?);
        v.push(randn(&[c], s + 3)?.mul(0.1)?);
    }
    v.into_iter().map(|t| t.to_dtype(dtype)?.to(CUDA)).collect()
}

/// The block in max-autotune makes fused cuDNN plans (two per distinct block) and equals eager;
/// the default mode makes none.
pub fn conv_epilogues_in_max_autotune() -> Outcome {
    let _switches = conv_switches();
    // (mode, dtype, TF32, fused plans expected, tolerance)
    let cases = [
        (Mode::MaxAutotune, DType::F32, true, true, 5e-3),
        (Mode::MaxAutotuneNoCudagraphs, DType::F16, true, true, 5e-3),
        (Mode::MaxAutotune, DType::F32, false, false, 1e-5),
        (Mode::Default, DType::F32, true, false, 5e-3),
    ];
    let result = (|| {
        for (i, (mode, dtype, tf32, fused, tol)) in cases.into_iter().enumerate() {
            // the switch is part of a compiled graph's key and its function's guards: the third
            // case does not replay what the first recorded under TF32
            kiln::cuda::set_cudnn_allow_tf32(tf32);
            let compiled =
                kiln::compile_fn(block, CompileOptions::default().mode(mode)).map_err(err)?;
            let before = kiln::cuda::cudnn_fused_plans();
            for call in 0..3u64 {
                let x = inputs(900 + 100 * i as u64 + 20 * call, dtype).map_err(err)?;
                let got = compiled.call(&x).map_err(err)?;
                let want = block(&x).map_err(err)?;
                let what = format!("{mode:?} {dtype} tf32 {tf32} call {call}");
                let f32 = |t: &Tensor| t.to_dtype(DType::F32);
                let (g, w) = (f32(&got[0]).map_err(err)?, f32(&want[0]).map_err(err)?);
                if let Err(e) = close(&what, &g, &w, tol) {
                    // which side is off: eager against the CPU in f64
                    let cpu: Vec<Tensor> = x
                        .iter()
                        .map(|t| t.to(Device::Cpu)?.to_dtype(DType::F64))
                        .collect::<Result<_>>()
                        .map_err(err)?;
                    let reference = block(&cpu).map_err(err)?;
                    let eager = close("eager vs f64", &w, &reference[0], tol);
                    let fused = kiln::cuda::cudnn_fused_plans() - before;
                    return Err(format!("{e} ({eager:?}; {fused} fused plans so far)"));
                }
            }
            let made = kiln::cuda::cudnn_fused_plans() - before;
            if fused != (made >= 2) || (!fused && made != 0) {
                return Err(format!(
                    "{mode:?} {dtype} tf32 {tf32}: {made} fused cuDNN plans made, expected {}",
                    if fused { "two" } else { "none" }
                ));
            }
        }
        Ok(())
    })();
    kiln::cuda::set_cudnn_allow_tf32(false);
    result
}
