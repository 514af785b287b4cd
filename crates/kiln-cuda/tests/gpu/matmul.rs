//! Matmul in half precision (cuBLAS, f32 accumulation) and cuBLASLt's fused epilogues (bias, ReLU,
//! GELU-tanh), against the CPU in f64.

use kiln_core::{DType, Device, Result, Tensor};
use kiln_cuda::{matmul_epilogue, Epilogue};

use super::harness::{check_grad, input, rel_err, Rng, CUDA};

type Outcome = std::result::Result<(), String>;

/// f16 and bf16 matmul forward and backward (bmm, broadcast batch, a transposed operand); the CPU
/// reference rounds the same inputs to the half type and computes in f64.
pub fn half_matmul_forward_and_backward() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    for (dtype, tol) in [(DType::F16, 2e-3), (DType::BF16, 1.5e-2)] {
        for (i, (sa, sb)) in [
            (vec![5, 7], vec![7, 3]),
            (vec![2, 4, 9], vec![2, 9, 6]),
            (vec![3, 4, 8], vec![8, 5]),
            (vec![1, 33], vec![33, 17]),
        ]
        .into_iter()
        .enumerate()
        {
            let mut rng = Rng::new(4000 + i as u64);
            let a = input(&mut rng, &sa, -1.0, 1.0, i % 2 == 1).map_err(e)?;
            let b = input(&mut rng, &sb, -1.0, 1.0, false).map_err(e)?;
            check_grad(
                &format!("{dtype} matmul {sa:?} @ {sb:?}"),
                &[a, b],
                tol,
                |t| {
                    let wide = t[0].dtype();
                    t[0].to_dtype(dtype)?
                        .matmul(&t[1].to_dtype(dtype)?)?
                        .to_dtype(wide)
                },
            )?;
        }
    }
    Ok(())
}

/// The epilogue applied to `a @ b + bias` on the CPU in f64 (the reference).
fn reference(a: &Tensor, b: &Tensor, bias: Option<&Tensor>, ep: Epilogue) -> Result<Tensor> {
    let f = |t: &Tensor| t.to(Device::Cpu)?.to_dtype(DType::F64);
    let mut y = f(a)?.matmul(&f(b)?)?;
    if let Some(bias) = bias {
        y = y.add(&f(bias)?)?;
    }
    match ep {
        Epilogue::Relu | Epilogue::BiasRelu => y.relu(),
        Epilogue::GeluTanh | Epilogue::BiasGeluTanh => y.gelu_tanh(),
        Epilogue::None | Epilogue::Bias => Ok(y),
    }
}

pub fn cublaslt_epilogues() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    let all = [
        Epilogue::None,
        Epilogue::Bias,
        Epilogue::Relu,
        Epilogue::BiasRelu,
        Epilogue::GeluTanh,
        Epilogue::BiasGeluTanh,
    ];
    for (dtype, tol) in [
        (DType::F32, 1e-5),
        (DType::F16, 2e-3),
        (DType::BF16, 1.5e-2),
    ] {
        for (i, ep) in all.iter().enumerate() {
            for (j, (m, k, n)) in [(7, 5, 3), (64, 96, 40), (1, 17, 33)]
                .into_iter()
                .enumerate()
            {
                let mut rng = Rng::new(4100 + (i * 3 + j) as u64);
                let cast = |t: Tensor| -> Result<Tensor> { t.to_dtype(dtype)?.to(CUDA) };
                let a = cast(input(&mut rng, &[m, k], -1.0, 1.0, false).map_err(e)?).map_err(e)?;
                // b as the transpose of a row-major [n, k] (a Linear's weight) every other case
                let b = if j % 2 == 0 {
                    cast(input(&mut rng, &[k, n], -1.0, 1.0, false).map_err(e)?).map_err(e)?
                } else {
                    cast(input(&mut rng, &[n, k], -1.0, 1.0, false).map_err(e)?)
                        .map_err(e)?
                        .t()
                        .map_err(e)?
                };
                // the bias every other element of a longer vector (copied for cuBLASLt) in the
                // transposed case
                let bias = match ep {
                    Epilogue::Bias | Epilogue::BiasRelu | Epilogue::BiasGeluTanh if j == 1 => {
                        let pairs = cast(input(&mut rng, &[n, 2], -1.0, 1.0, false).map_err(e)?)
                            .map_err(e)?;
                        Some(pairs.narrow(1, 0, 1).map_err(e)?.reshape([n]).map_err(e)?)
                    }
                    Epilogue::Bias | Epilogue::BiasRelu | Epilogue::BiasGeluTanh => {
                        Some(cast(input(&mut rng, &[n], -1.0, 1.0, false).map_err(e)?).map_err(e)?)
                    }
                    _ => None,
                };
                let what = format!("{ep:?} {dtype} [{m}, {k}] @ [{k}, {n}]");
                let got = matmul_epilogue(&a, &b, bias.as_ref(), *ep)
                    .map_err(|x| format!("{what}: {x}"))?;
                if got.device() != CUDA || got.shape() != [m, n] || got.dtype() != dtype {
                    return Err(format!("{what}: got {got:?}"));
                }
                let want = reference(&a, &b, bias.as_ref(), *ep).map_err(e)?;
                let err = rel_err(
                    &got.to_vec_f64().map_err(e)?,
                    &want.to_vec_f64().map_err(e)?,
                )?;
                if err > tol {
                    return Err(format!("{what}: relative error {err:.2e} > {tol:.1e}"));
                }
            }
        }
    }
    Ok(())
}

pub fn cublaslt_bad_operands() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    let dev = |s: &[usize]| -> Result<Tensor> { Tensor::ones(s, DType::F32)?.to(CUDA) };
    let a = dev(&[4, 3]).map_err(e)?;
    let b = dev(&[3, 5]).map_err(e)?;
    let cases: Vec<(&str, Result<Tensor>)> = vec![
        (
            "shape",
            matmul_epilogue(&a, &dev(&[4, 5]).map_err(e)?, None, Epilogue::None),
        ),
        (
            "needs a bias",
            matmul_epilogue(&a, &b, None, Epilogue::BiasRelu),
        ),
        (
            "bias",
            matmul_epilogue(&a, &b, Some(&dev(&[4]).map_err(e)?), Epilogue::Bias),
        ),
        (
            "device",
            matmul_epilogue(
                &a,
                &Tensor::ones(&[3, 5], DType::F32).map_err(e)?,
                None,
                Epilogue::None,
            ),
        ),
        (
            "dtype",
            matmul_epilogue(
                &a,
                &b.to_dtype(DType::F16).map_err(e)?,
                None,
                Epilogue::None,
            ),
        ),
    ];
    for (what, r) in cases {
        match r {
            Err(err) if err.to_string().contains("matmul_epilogue") => {}
            other => {
                return Err(format!(
                    "{what}: expected an Err naming the op, got {other:?}"
                ))
            }
        }
    }
    // a correct call still works after the refusals: 4x3 ones @ 3x5 ones = 3 everywhere
    let y = matmul_epilogue(&a, &b, None, Epilogue::None).map_err(e)?;
    let v = y.to_vec_f64().map_err(e)?;
    if v.len() != 20 || v.iter().any(|&x| x != 3.0) {
        return Err(format!("ones @ ones after errors: {v:?}"));
    }
    Ok(())
}

/// `Prim::MatmulEpilogue` where cuBLASLt's epilogues do not apply (f64, two batches, an empty
/// inner dim): the runtime runs the matmul and the ops on the device, equal to the prim on the
/// CPU, and no epilogue GEMM is counted.
pub fn matmul_epilogue_prim_without_cublaslt() -> Outcome {
    use kiln_core::dispatch::apply;
    use kiln_core::prim::{Activation, Epilogue as PrimEpilogue, Prim};
    let e = |x: kiln_core::Error| x.to_string();
    let prim = Prim::MatmulEpilogue(PrimEpilogue {
        bias: true,
        act: Activation::Relu,
    });
    for (i, (dtype, [b, m, k, n])) in [
        (DType::F64, [1, 9, 5, 4]),
        (DType::F32, [2, 9, 5, 4]),
        (DType::F32, [1, 9, 0, 4]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = Rng::new(4300 + i as u64);
        let cpu = [
            input(&mut rng, &[b, m, k], -1.0, 1.0, false).map_err(e)?,
            input(&mut rng, &[b, k, n], -1.0, 1.0, false).map_err(e)?,
            input(&mut rng, &[n], -1.0, 1.0, false).map_err(e)?,
        ]
        .map(|t| t.to_dtype(dtype));
        let cpu: Vec<Tensor> = cpu.into_iter().collect::<Result<_>>().map_err(e)?;
        let gpu: Vec<Tensor> = cpu
            .iter()
            .map(|t| t.to(CUDA))
            .collect::<Result<_>>()
            .map_err(e)?;
        let before = kiln_cuda::epilogue_gemms();
        let got = apply(prim.clone(), &gpu.iter().collect::<Vec<_>>()).map_err(e)?;
        let want = apply(prim.clone(), &cpu.iter().collect::<Vec<_>>()).map_err(e)?;
        let what = format!("{dtype} [{b}, {m}, {k}] @ [{b}, {k}, {n}]");
        if got.device() != CUDA || kiln_cuda::epilogue_gemms() != before {
            return Err(format!(
                "{what}: on {}, an epilogue GEMM counted",
                got.device()
            ));
        }
        let err = rel_err(
            &got.to_vec_f64().map_err(e)?,
            &want.to_vec_f64().map_err(e)?,
        )?;
        if err > 1e-6 {
            return Err(format!("{what}: relative error {err:.2e}"));
        }
    }
    Ok(())
}
