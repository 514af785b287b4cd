//! Small matmuls generated inline (`kiln_inductor::ir::lower::small_matmul`): a sum over k of
//! `a[b,m,k]·b[b,k,n]` in a generated kernel, fused with the operands' producers, instead of an
//! extern gemm call. The generated sum multiplies in double (exact for f32 operands) and
//! accumulates in double, in order of k (`kiln_core::prim::small_cpu_matmul` on the CPU). On the CPU the eager
//! kernel sums small products in that same order, so compiled equals eager bit for bit; on a GPU
//! eager runs cuBLAS's f32 chain, and the check is that the compiled result is within a few f32
//! ulp of eager and at least as close as eager to a float64 reference, forward and backward (the
//! backward's matmuls are small too and inlined).
//!
//! The generation is on by default (the `inline_small_matmuls` option turns it off); the test
//! also names it.
//!
//! One test, in order: it profiles (which records every thread) to see which matmuls ran as
//! eager prims.

#[path = "common/mod.rs"]
mod common;

use common::{deep_copy, Gen, In, Lay, Rng};
use kiln::prelude::*;
use kiln::profiler::Category;

/// Compiled vs eager, relative to the largest magnitude of the output: a K ≤ 64 f32 dot product
/// rounds at most K times in gemm (relative error ≤ K·2^-24 of Σ|a||b|, and Σ|a||b| is within a
/// small factor of max|out| for these normal inputs); 1e-5 covers K = 64 with room.
const TOL: f64 = 1e-5;

/// (largest |x - y|, largest |y|) over the elements.
fn max_err(x: &Tensor, y: &Tensor) -> (f64, f64) {
    let (x, y) = (x.to_vec_f64().unwrap(), y.to_vec_f64().unwrap());
    assert_eq!(x.len(), y.len());
    x.iter().zip(&y).fold((0.0f64, 0.0f64), |(e, m), (p, q)| {
        (e.max((p - q).abs()), m.max(q.abs()))
    })
}

/// `compiled` within `TOL` of `eager` (on the CPU equal to it), and no farther than eager from
/// the f64 reference (plus half an f32 ulp of the reference's largest element: both are rounded
/// to f32 at the end).
fn check(what: &str, compiled: &Tensor, eager: &Tensor, reference: &Tensor) {
    assert_eq!(compiled.shape(), eager.shape(), "{what}: shape");
    let (d, scale) = max_err(compiled, eager);
    if common::test_device() == Device::Cpu {
        assert_eq!(d, 0.0, "{what}: compiled vs eager on the CPU");
    }
    assert!(
        d <= TOL * scale.max(1e-30),
        "{what}: compiled vs eager differ by {d:e} (largest |eager| {scale:e})"
    );
    let (ec, scale) = max_err(compiled, reference);
    let (ee, _) = max_err(eager, reference);
    let half_ulp = scale * f64::from(f32::EPSILON) / 2.0;
    assert!(
        ec <= ee + half_ulp,
        "{what}: compiled is {ec:e} from the f64 reference, eager {ee:e}"
    );
}

/// Fresh leaves of `dtype` holding the arguments' values (requiring grad), and the arguments
/// formed from them (through each argument's view).
fn leaves_and_args(ins: &[In], dtype: DType) -> (Vec<Tensor>, Vec<Tensor>) {
    let leaves: Vec<Tensor> = ins
        .iter()
        .map(|i| {
            let t = deep_copy(&i.base).to_dtype(dtype).unwrap();
            t.set_requires_grad(true).unwrap();
            t
        })
        .collect();
    let args = ins
        .iter()
        .zip(&leaves)
        .map(|(i, t)| match &i.view {
            Some(v) => v(t).unwrap(),
            None => t.clone(),
        })
        .collect();
    (leaves, args)
}

/// One run of `f` and the gradients of `sum(out * w)`: (output, grads of the leaves).
fn run(
    f: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>,
    ins: &[In],
    w: &Tensor,
    dtype: DType,
) -> (Tensor, Vec<Tensor>) {
    let (leaves, args) = leaves_and_args(ins, dtype);
    let out = f(&args).unwrap().remove(0);
    let w = w.to_dtype(dtype).unwrap().to(out.device()).unwrap();
    out.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = leaves.iter().map(|l| l.grad().unwrap()).collect();
    (out, grads)
}

/// Eager matmul prims (extern calls) that ran inside `f`.
fn eager_matmuls(f: impl FnOnce()) -> usize {
    let ((), p) = kiln::profile(f);
    p.rows()
        .iter()
        .filter(|r| r.name == "matmul" && r.category == Category::Op)
        .map(|r| r.calls)
        .sum()
}

fn inline() -> CompileOptions {
    CompileOptions::default().option(kiln::inductor::INLINE_SMALL_MATMULS, "true")
}

#[test]
fn small_matmuls_are_generated_and_at_least_as_accurate_as_eager() {
    let mut rng = Rng::new(41);
    // (a, its layout, b, its layout, eager matmuls a compiled forward and backward runs on the
    // CPU and on a GPU, whose bounds differ: `small_cpu_matmul`, `small_matmul`)
    type Shapes = (&'static [usize], Lay, &'static [usize], Lay, (usize, usize));
    let cases: &[Shapes] = &[
        (&[3, 4], Lay::C, &[4, 5], Lay::C, (0, 0)),
        // transposed (non-contiguous) operands, read through their index expressions
        (&[3, 4], Lay::T, &[4, 5], Lay::T, (0, 0)),
        (&[2, 3, 4], Lay::T, &[2, 4, 5], Lay::S, (0, 0)),
        // broadcast batch: [2,1,3,4] @ [5,4,2] -> [2,5,3,2]; an expanded (stride-0) operand
        (&[2, 1, 3, 4], Lay::C, &[5, 4, 2], Lay::C, (0, 0)),
        (&[3, 3, 4], Lay::E, &[4, 2], Lay::T, (0, 0)),
        (&[2, 3, 4], Lay::C, &[4, 5], Lay::C, (0, 0)),
        // size-1 dims and vectors
        (&[1, 4], Lay::C, &[4, 1], Lay::C, (0, 0)),
        (&[4], Lay::C, &[2, 4, 5], Lay::C, (0, 0)),
        (&[2, 3, 4], Lay::C, &[4], Lay::C, (0, 0)),
        // the regional workload's shape, the largest K generated, and a classifier's backward
        // shapes (a batch of 2, 4 classes, 1024 features): the gradient of the 1024-wide side
        // has K = 1024 and stays a gemm; the forward and the other gradient (8192
        // multiply-adds) are generated on a GPU, gemm calls on the CPU
        (&[10, 10], Lay::C, &[10, 10], Lay::T, (0, 0)),
        (&[4, 64], Lay::C, &[64, 6], Lay::C, (0, 0)),
        (&[2, 4], Lay::C, &[4, 1024], Lay::C, (3, 1)),
        (&[4, 2], Lay::T, &[2, 1024], Lay::C, (3, 1)),
    ];
    let mm = |a: &[Tensor]| Ok(vec![a[0].matmul(&a[1])?]);
    let on_cpu = common::test_device() == Device::Cpu;
    for &(sa, la, sb, lb, (on_cpu_want, on_gpu_want)) in cases {
        let externs_want = if on_cpu { on_cpu_want } else { on_gpu_want };
        let what = format!("{sa:?} {la:?} @ {sb:?} {lb:?}");
        let ins = vec![
            rng.arg(Gen::Normal, sa, la, true),
            rng.arg(Gen::Normal, sb, lb, true),
        ];
        let out_shape = mm(&leaves_and_args(&ins, DType::F32).1).unwrap()[0]
            .shape()
            .to_vec();
        let w = rng.randn(&out_shape);
        let compiled = kiln::compile_fn(mm, inline()).unwrap();
        let call = |a: &[Tensor]| compiled.call(a);
        // the first call compiles; the second is the replay that is profiled
        run(&call, &ins, &w, DType::F32);
        let mut got = None;
        let externs = eager_matmuls(|| got = Some(run(&call, &ins, &w, DType::F32)));
        let (out_c, grads_c) = got.unwrap();
        assert_eq!(
            externs, externs_want,
            "{what}: matmuls run as eager prims (forward and backward)"
        );
        let (out_e, grads_e) = run(&mm, &ins, &w, DType::F32);
        let (out_r, grads_r) = run(&mm, &ins, &w, DType::F64);
        check(&format!("{what}: output"), &out_c, &out_e, &out_r);
        for (k, ((c, e), r)) in grads_c.iter().zip(&grads_e).zip(&grads_r).enumerate() {
            check(&format!("{what}: grad {k}"), c, e, r);
        }
    }

    // a large matmul stays on gemm (K = 128 > 64), and so does a small one with the option off:
    // extern on both sides, the same kernel, bitwise; by default a small one is generated, on
    // the CPU bitwise equal to eager
    let off = CompileOptions::default().option(kiln::inductor::INLINE_SMALL_MATMULS, "false");
    let mut cases = vec![(128, inline(), 1), (8, off, 1)];
    if common::test_device() == Device::Cpu {
        cases.push((8, CompileOptions::default(), 0));
    }
    for (k, opts, externs_want) in cases {
        let f = kiln::compile_fn(mm, opts).unwrap();
        let ins = [
            rng.arg(Gen::Normal, &[8, k], Lay::C, false),
            rng.arg(Gen::Normal, &[k, 8], Lay::C, false),
        ];
        let args: Vec<Tensor> = ins.iter().map(|i| deep_copy(&i.base)).collect();
        f.call(&args).unwrap();
        let mut out = None;
        assert_eq!(
            eager_matmuls(|| out = Some(f.call(&args).unwrap())),
            externs_want,
            "K = {k}"
        );
        let (d, _) = max_err(&out.unwrap()[0], &args[0].matmul(&args[1]).unwrap());
        assert_eq!(d, 0.0, "K = {k}");
    }
    let bad = kiln::compile_fn(
        mm,
        inline().option(kiln::inductor::INLINE_SMALL_MATMULS, "yes"),
    );
    let args: Vec<Tensor> = (0..2).map(|_| deep_copy(&rng.randn(&[2, 2]))).collect();
    let err = bad.and_then(|f| f.call(&args)).map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("inline_small_matmuls"), "{err}");
}
