//! Dtypes on the GPU: casts to every dtype and half-precision arithmetic against the CPU, and
//! Rust numbers or CPU scalars meeting CUDA tensors by value in the launch.

use kiln_core::{DType, Result, Tensor};

use super::harness::{input, Rng, CUDA};

pub fn casts_and_half() -> std::result::Result<(), String> {
    let mut rng = Rng::new(700);
    let e = |x: kiln_core::Error| x.to_string();
    let x = input(&mut rng, &[5, 7], -100.0, 100.0, true).map_err(e)?;
    for d in [
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
    ] {
        // the same casts on the CPU are the reference, bit for bit
        let cpu = x.to_dtype(d).map_err(e)?.to_vec_f64().map_err(e)?;
        let gpu = x.to(CUDA).map_err(e)?.to_dtype(d).map_err(e)?;
        let got = gpu.to_vec_f64().map_err(e)?;
        if cpu != got && d != DType::U8 {
            return Err(format!("cast to {d}: {got:?} != {cpu:?}"));
        }
    }
    // half-precision arithmetic computes in f32 and rounds, as on the CPU
    for d in [DType::F16, DType::BF16] {
        let h = x.div(50.0).map_err(e)?.to_dtype(d).map_err(e)?;
        let f = |t: &Tensor| -> Result<Tensor> { t.exp()?.mul(t)?.add(1.0)?.sum(&[1], false) };
        let want = f(&h).map_err(e)?.to_vec_f64().map_err(e)?;
        let got = f(&h.to(CUDA).map_err(e)?)
            .map_err(e)?
            .to_vec_f64()
            .map_err(e)?;
        let err = super::harness::rel_err(&got, &want)?;
        if err > 1e-2 {
            return Err(format!("{d} arithmetic: relative error {err}"));
        }
    }
    Ok(())
}

/// Rust numbers and CPU scalars meet CUDA tensors by value in the launch (no device buffer):
/// every dtype, either operand position, `where`'s branches, against the same ops on the CPU bit
/// for bit; an int64 beyond 2^53, which an f64 argument would round, is copied over instead.
pub fn scalar_operands_by_value() -> std::result::Result<(), String> {
    let mut rng = Rng::new(710);
    let e = |x: kiln_core::Error| x.to_string();
    let x = input(&mut rng, &[6, 5], -20.0, 20.0, true).map_err(e)?;
    type Case = fn(&Tensor) -> Result<Tensor>;
    let cases: [(&str, Case); 8] = [
        ("x * 2.5", |t| t.mul(2.5)),
        ("x + 3", |t| t.add(3)),
        ("x - 0.1", |t| t.sub(0.1)),
        ("max(x, 0)", |t| t.maximum(0.0)),
        ("x / 7", |t| t.div(7.0)),
        ("x > 1.5", |t| t.gt(1.5)),
        ("10 - x (CPU scalar first)", |t| {
            Tensor::scalar(10.0f64).to_dtype(t.dtype())?.sub(t)
        }),
        ("where(x > 0, x, -1)", |t| {
            Tensor::where_(&t.gt(0.0)?, t, -1.0)
        }),
    ];
    // every dtype but bool
    for &d in DType::ALL.iter().filter(|&&d| d != DType::Bool) {
        let cpu_x = x.to_dtype(d).map_err(e)?;
        let gpu_x = cpu_x.to(CUDA).map_err(e)?;
        for (what, f) in &cases {
            let want = f(&cpu_x).map_err(e)?.to_vec_f64().map_err(e)?;
            let got = f(&gpu_x).map_err(e)?;
            if got.device() != CUDA {
                return Err(format!("{d} {what}: ran on {}", got.device()));
            }
            let got = got.to_vec_f64().map_err(e)?;
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
            if !same {
                return Err(format!("{d} {what}: gpu {got:?} != cpu {want:?}"));
            }
        }
    }
    let big = (1i64 << 60) + 1;
    let ints = Tensor::from_vec(vec![0i64, 1, -1], &[3]).map_err(e)?;
    let got = ints
        .to(CUDA)
        .map_err(e)?
        .add(Tensor::scalar(big))
        .map_err(e)?;
    let got = got.to_vec::<i64>().map_err(e)?;
    if got != vec![big, big + 1, big - 1] {
        return Err(format!("int64 + 2^60+1: {got:?}"));
    }
    Ok(())
}
