//! Dynamic shapes (issue 9): a size-generic compiled function against a static one, at the same
//! size. The static function is compiled for that size only (`dynamic: Some(false)`); the dynamic
//! one has seen three other sizes first (automatic dynamic: a static entry, then a symbolic one
//! whose kernels become size-generic at its second size), and meets the measured size as a new
//! one: it is traced, found to instantiate the symbolic graph, and runs the size-generic kernels.
//! `new_kernels` counts kernels loaded for that new size: 0 means no kernel was specialised to it;
//! `first_call_at_new_size` is that first call (trace, check, code generation without the C
//! compiler, run), against `call`, the steady state.
//! The two are timed in alternation (three rounds), the best of each kept. Acceptance: dynamic
//! within 1.2x of static. With `--device cuda` the same on the GPU (size-generic CUDA kernels).

use kiln::inductor::kernel_cache_stats;
use kiln::models::resnet::resnet18;
use kiln::nn::Module;
use kiln::{no_grad, DType, Result, Tensor};

use super::BenchResult;
use crate::harness::Ctx;

const W: &str = "dynamic_shapes";

/// A softmax over rows: a reduction kernel and pointwise kernels.
fn softmax_rows(x: &Tensor) -> Result<Tensor> {
    x.mul(2.0)?.add(1.0)?.softmax(-1)
}

/// A layer norm without weights: two reductions and a pointwise epilogue.
fn layer_norm(x: &Tensor) -> Result<Tensor> {
    let mu = x.mean(&[-1], true)?;
    let d = x.sub(&mu.expand_as(x)?)?;
    let var = d.mul(&d)?.mean(&[-1], true)?;
    d.div(&var.add(1e-5)?.sqrt()?.expand_as(x)?)
}

/// Times `f` compiled static at `shape` and dynamic (after `warm` other sizes of dim 0); emits
/// both call times, their ratio, and the kernels the dynamic one loaded at `shape`.
fn compare(
    ctx: &mut Ctx,
    name: &str,
    f: &(dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync),
    shape: &[usize],
    warm: &[usize],
) -> BenchResult {
    let call = |a: &[Tensor]| Ok(vec![f(&a[0])?]);
    let dev = ctx.dev;
    let x = Tensor::randn(shape, DType::F32)?.to(dev)?;
    let want = no_grad(|| f(&x))?.to_vec_f64()?;
    let timer = ctx.timer();

    let stat = kiln::compile_fn(call, ctx.opts().dynamic(Some(false)))?;
    no_grad(|| stat.call(std::slice::from_ref(&x)))?; // compile

    let dynamic = kiln::compile_fn(call, ctx.opts())?;
    for &n in warm {
        let mut s = shape.to_vec();
        s[0] = n;
        no_grad(|| dynamic.call(&[Tensor::randn(&s, DType::F32)?.to(dev)?]))?;
    }
    let before = kernel_cache_stats().kernels;
    let t = std::time::Instant::now();
    let got = no_grad(|| dynamic.call(std::slice::from_ref(&x)))?;
    kiln::core::device::synchronize(dev)?;
    // trace, check against the symbolic graph, generate this size's code (no C compiler), run
    let first_call = t.elapsed().as_secs_f64() * 1e3;
    let new_kernels = kernel_cache_stats().kernels - before;
    let st = dynamic.stats();
    if st.symbolic_compiles != 1 || st.symbolic_reuses < 1 {
        return Err(
            format!("{name}: the dynamic function did not reuse a symbolic entry: {st:?}").into(),
        );
    }
    let (a, b) = (got[0].to_vec_f64()?, &want);
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
    // the two timed in alternation, the best of each kept: on a shared machine, load that comes
    // and goes must not land on one side of the ratio
    let (mut t_static, mut t_dynamic) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..if ctx.quick { 2 } else { 3 } {
        let s = timer.time(&format!("{name}: static"), || {
            no_grad(|| stat.call(std::slice::from_ref(&x)))
        })?;
        let d = timer.time(&format!("{name}: dynamic"), || {
            no_grad(|| dynamic.call(std::slice::from_ref(&x)))
        })?;
        t_static = t_static.min(s.ms());
        t_dynamic = t_dynamic.min(d.ms());
    }
    let w = format!("{W}_{name}");
    ctx.emit(&w, "static", "call", t_static, "ms");
    ctx.emit(&w, "dynamic", "call", t_dynamic, "ms");
    ctx.emit(&w, "dynamic", "ratio_vs_static", t_dynamic / t_static, "x");
    ctx.emit(&w, "dynamic", "new_kernels", new_kernels as f64, "kernels");
    ctx.emit(&w, "dynamic", "first_call_at_new_size", first_call, "ms");
    ctx.emit(
        &w,
        "dynamic",
        "max_rel_diff_vs_eager",
        diff / scale,
        "ratio",
    );
    Ok(())
}

pub fn run(ctx: &mut Ctx) -> BenchResult {
    let rows = if ctx.quick { 1024 } else { 4096 };
    compare(
        ctx,
        "softmax_rows",
        &softmax_rows,
        &[rows, 1024],
        &[rows / 2, rows * 5 / 8, rows * 3 / 4],
    )?;
    compare(
        ctx,
        "layer_norm",
        &layer_norm,
        &[rows, 768],
        &[rows / 2, rows * 5 / 8, rows * 3 / 4],
    )?;
    // ResNet-18 inference, batch 16 (at 112 under --quick, else torch_baseline.py's 224)
    kiln::manual_seed(0);
    let mut model = resnet18(1000)?;
    model.to(ctx.dev)?;
    model.eval();
    let side = if ctx.quick { 112 } else { 224 };
    let m = &model;
    compare(
        ctx,
        "resnet18_bs16",
        &move |x: &Tensor| m.forward(x),
        &[16, 3, side, side],
        &[8, 10, 12],
    )?;
    Ok(())
}
