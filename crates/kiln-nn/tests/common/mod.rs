//! Shared test helpers: deterministic inputs and tolerant comparison. Expected values in the tests
//! are computed independently (f64 loops over these inputs), never copied from kiln's output.
#![allow(dead_code)]

use kiln_core::Tensor;

/// Deterministic values in [-scale, scale) from a tiny LCG (no dependence on kiln's RNG).
pub fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

pub fn tensor_f32(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.iter().map(|&x| x as f32).collect::<Vec<_>>(), shape).unwrap()
}

pub fn tensor_f64(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap()
}

pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

#[track_caller]
pub fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "length mismatch");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "element {i}: got {g}, want {w} (|diff| {err:e} > tol {tol:e})"
        );
    }
}

/// erf by its Maclaurin series; accurate to ~1e-12 for |x| <= 3, enough for f32 checks.
pub fn erf(x: f64) -> f64 {
    let mut sum = 0.0;
    let mut term = x; // (-1)^n x^(2n+1) / n!
    for n in 0..200 {
        sum += term / (2 * n + 1) as f64;
        term *= -x * x / (n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}
