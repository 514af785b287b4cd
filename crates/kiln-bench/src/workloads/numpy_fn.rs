//! torch_baseline.py's `numpy_fn` on 1024×640 f64: standardise X and Y per column, sum of the
//! outer products per row, clip, exp, plus a regulariser. The same function three ways: plain
//! `ndarray` (the NumPy analog, written as the NumPy code is, 3-D broadcast product included), eager
//! kiln, and `kiln::compile_fn` — the last two take ndarray arrays and give one back, the conversions
//! inside the timed region.

use std::hint::black_box;

use kiln::inductor::with_fresh_cache;
use kiln::ndarray_interop::NdarrayExt;
use kiln::{DType, Tensor};
use ndarray::{Array1, Array2, ArrayD, Axis, Ix1};

use super::BenchResult;
use crate::harness::{once, Ctx};

const W: &str = "numpy_fn";
const ROWS: usize = 1024;
const COLS: usize = 640;

/// The NumPy code, line for line, in ndarray.
fn ndarray_fn(x: &Array2<f64>, y: &Array2<f64>) -> Array1<f64> {
    let standardise = |a: &Array2<f64>| {
        let mean = a.mean_axis(Axis(0)).expect("rows");
        let mut std = a.std_axis(Axis(0), 0.0);
        std.mapv_inplace(|s| if s == 0.0 { 1.0 } else { s });
        (a - &mean) / &std
    };
    let xn = standardise(x);
    let yn = standardise(y);
    // Xn[:, :, None] * Yn[:, None, :], summed over the last two axes
    let outer = &xn.view().insert_axis(Axis(2)) * &yn.view().insert_axis(Axis(1));
    let r = outer.sum_axis(Axis(2)).sum_axis(Axis(1));
    drop(outer);
    let r = r.mapv(|v| v.clamp(-1.0, 1.0)).mapv(f64::exp);
    let reg = (xn.mapv(|v| v.powi(2)) + yn.mapv(|v| v.powi(2))).sum_axis(Axis(1));
    r + 0.001 * reg
}

/// The NumPy code in kiln's tensor API.
fn kiln_fn(x: &Tensor, y: &Tensor) -> kiln::Result<Tensor> {
    let standardise = |a: &Tensor| -> kiln::Result<Tensor> {
        let mean = a.mean(&[0], false)?;
        let std = a.std(&[0], 0, false)?;
        let std = Tensor::where_(&std.eq(0.0)?, 1.0, &std)?;
        a.sub(&mean)?.div(&std)
    };
    let xn = standardise(x)?;
    let yn = standardise(y)?;
    let r = xn
        .unsqueeze(2)?
        .mul(&yn.unsqueeze(1)?)?
        .sum(&[-2, -1], false)?;
    let r = r.clamp(Some(-1.0), Some(1.0))?.exp()?;
    let reg = xn.pow(2.0)?.add(&yn.pow(2.0)?)?.sum(&[1], false)?;
    r.add(&reg.mul(0.001)?)
}

fn to_tensor(a: &Array2<f64>) -> kiln::Result<Tensor> {
    Tensor::from_ndarray(a.clone().into_dyn())
}

fn to_array(t: Tensor) -> BenchResult<Array1<f64>> {
    let a: ArrayD<f64> = t.into_ndarray()?;
    Ok(a.into_dimensionality::<Ix1>()?)
}

fn max_abs_diff(a: &Array1<f64>, b: &Array1<f64>) -> f64 {
    a.iter()
        .zip(b)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0, f64::max)
}

pub fn run(ctx: &mut Ctx) -> BenchResult {
    kiln::manual_seed(0);
    let x: Array2<f64> = Tensor::randn(&[ROWS, COLS], DType::F64)?
        .into_ndarray::<f64>()?
        .into_dimensionality()?;
    let y: Array2<f64> = Tensor::randn(&[ROWS, COLS], DType::F64)?
        .into_ndarray::<f64>()?
        .into_dimensionality()?;
    let timer = ctx.timer();

    let (t, want) = timer.time_keep("numpy_fn: ndarray", || {
        Ok::<_, kiln::Error>(ndarray_fn(&x, &y))
    })?;
    ctx.emit(W, "ndarray", "call", t.ms(), "ms");

    let eager = |x: &Array2<f64>, y: &Array2<f64>| -> BenchResult<Array1<f64>> {
        to_array(kiln_fn(&to_tensor(x)?, &to_tensor(y)?)?)
    };
    let (t, got) = timer.time_keep("numpy_fn: kiln eager", || eager(&x, &y))?;
    ctx.emit(W, "kiln_eager", "call", t.ms(), "ms");
    ctx.emit(
        W,
        "kiln_eager",
        "max_abs_diff_vs_ndarray",
        max_abs_diff(&got, &want),
        "abs",
    );

    let g = kiln::compile_fn(|a: &[Tensor]| Ok(vec![kiln_fn(&a[0], &a[1])?]), ctx.opts())?;
    let compiled = |x: &Array2<f64>, y: &Array2<f64>| -> BenchResult<Array1<f64>> {
        let out = g.call(&[to_tensor(x)?, to_tensor(y)?])?;
        let r = out.into_iter().next().ok_or("no output")?;
        to_array(r)
    };
    let variant = format!("kiln.compile_cpu_{}", ctx.mode_name());
    let (r, t) = with_fresh_cache(|| once("numpy_fn: cold compile", || compiled(&x, &y)));
    let got = r?;
    ctx.emit(W, &variant, "cold_compile", t.as_secs_f64(), "s");
    let t = timer.time("numpy_fn: compiled", || compiled(&x, &y))?;
    ctx.emit(W, &variant, "call", t.ms(), "ms");
    ctx.emit(
        W,
        &variant,
        "max_abs_diff_vs_ndarray",
        max_abs_diff(&got, &want),
        "abs",
    );
    black_box(got);
    ctx.emit(W, &variant, "compiles", g.stats().compiles as f64, "count");
    ctx.emit(
        W,
        "cpu_threads",
        "count",
        crate::threads() as f64,
        "threads",
    );
    Ok(())
}
