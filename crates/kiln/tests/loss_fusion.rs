//! Cross-entropy compiled for the CPU: each row's target log-probability is picked in the loop
//! that computes the row's log_softmax (kiln-inductor's `one_hot.rs`), the gradient needs no
//! scatter, results equal eager code bit for bit, and a target out of range is an error as in
//! eager code. The GPU counterpart is in `gpu_compile/losses.rs`.

use kiln::inductor::exec_stats;
use kiln::prelude::*;

fn loss(a: &[Tensor], ignore: Option<i64>, smoothing: f64) -> Result<Tensor> {
    a[0].cross_entropy(&a[1], ignore, smoothing, Reduction::Mean)
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .expect("readable")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn targets(rows: usize, classes: usize, seed: i64) -> Result<Tensor> {
    let t: Vec<i64> = (0..rows as i64)
        .map(|i| (i * 37 + seed) % classes as i64)
        .collect();
    Tensor::from_vec(t, &[rows])
}

#[test]
fn compiled_cross_entropy_equals_eager_and_checks_targets() -> Result<()> {
    if kiln::inductor::runtime::cc::toolchain().is_none() {
        eprintln!("SKIPPED: no C compiler; the kiln backend runs the interpreter");
        return Ok(());
    }
    let (rows, classes) = (48usize, 300usize);
    for (ignore, smoothing) in [(None, 0.0), (Some(4i64), 0.0), (None, 0.2)] {
        let f = move |a: &[Tensor]| Ok(vec![loss(a, ignore, smoothing)?]);
        let compiled = kiln::compile_fn(f, CompileOptions::default())?;
        for call in 0..2 {
            manual_seed(call);
            let x = Tensor::randn(&[rows, classes], DType::F32)?;
            let t = targets(rows, classes, call as i64)?;
            let run = |compiled_run: bool| -> Result<(Tensor, Tensor)> {
                let x = x.detach().with_grad()?;
                let l = match compiled_run {
                    true => compiled.call(&[x.clone(), t.clone()])?.remove(0),
                    false => loss(&[x.clone(), t.clone()], ignore, smoothing)?,
                };
                l.backward()?;
                let g = x
                    .grad()
                    .ok_or_else(|| kiln::Error::arg("test", "no gradient"))?;
                Ok((l, g))
            };
            let ((cl, cg), (el, eg)) = (run(true)?, run(false)?);
            let what = format!("ignore {ignore:?} smoothing {smoothing} call {call}");
            assert_eq!(bits(&cl), bits(&el), "loss, {what}");
            assert_eq!(bits(&cg), bits(&eg), "gradient, {what}");
        }
        // one target past the last class, then one below zero: the gather's error, as eager
        for bad in [classes as i64, -1] {
            let x = Tensor::randn(&[rows, classes], DType::F32)?;
            let mut t: Vec<i64> = vec![0; rows];
            t[rows - 1] = bad;
            let t = Tensor::from_vec(t, &[rows])?;
            let e = compiled.call(&[x.clone(), t]).map(|_| ());
            let msg = e
                .expect_err("an out-of-range target is an error")
                .to_string();
            assert!(
                msg.contains("gather") && msg.contains(&format!("size {classes}")),
                "{msg}"
            );
            let ok = compiled.call(&[x.clone(), targets(rows, classes, 1)?])?;
            let want = loss(&[x, targets(rows, classes, 1)?], ignore, smoothing)?;
            assert_eq!(bits(&ok[0]), bits(&want), "after the bad target");
        }
    }
    Ok(())
}

/// The forward of a loss in inference: the row's max, its sum of exponentials and the picked
/// log-probability are one loop nest, so no buffer of the logits' size is written. Before, the
/// log-probabilities were written out (a [64, 500] buffer) for a gather to read one element of
/// each row.
#[test]
fn no_logits_sized_buffer_in_the_forward() -> Result<()> {
    if kiln::inductor::runtime::cc::toolchain().is_none() {
        eprintln!("SKIPPED: no C compiler; the kiln backend runs the interpreter");
        return Ok(());
    }
    let (rows, classes) = (64usize, 500usize);
    let x = Tensor::randn(&[rows, classes], DType::F32)?;
    let t = targets(rows, classes, 3)?;
    let c = kiln::compile_fn(
        |a: &[Tensor]| Ok(vec![loss(a, None, 0.0)?]),
        CompileOptions::default(),
    )?;
    let before = exec_stats();
    let out = kiln::no_grad(|| c.call(&[x.clone(), t.clone()]))?;
    let after = exec_stats();
    assert_eq!(after.calls, before.calls + 1, "the compiled graph ran");
    let allocated = after.allocated_bytes - before.allocated_bytes;
    assert!(
        allocated < (rows * classes * 4) as u64,
        "the forward allocated {allocated} bytes"
    );
    assert_eq!(bits(&out[0]), bits(&loss(&[x, t], None, 0.0)?));
    Ok(())
}
