//! Cross-entropy on the GPU, compiled: each row's target log-probability is picked in the row
//! kernel that computes log_softmax (kiln-inductor's `one_hot.rs`), the gradient is one
//! generated kernel, and a target out of range is still an error, reported at the next
//! synchronization as eager gathers report it.

use kiln::prelude::*;

use super::{err, randn, same, Outcome, CUDA};

fn loss(a: &[Tensor], ignore: Option<i64>, smoothing: f64) -> Result<Tensor> {
    a[0].cross_entropy(&a[1], ignore, smoothing, Reduction::Mean)
}

/// Compiled forward and backward against eager on the device, with and without an ignored
/// class and label smoothing; then a target of 1000 classes' range, then valid targets again.
pub fn cross_entropy_compiled_and_bad_targets() -> Outcome {
    let (rows, classes) = (96usize, 1000usize);
    for (ignore, smoothing) in [(None, 0.0), (Some(3i64), 0.1)] {
        let f = move |a: &[Tensor]| Ok(vec![loss(a, ignore, smoothing)?]);
        let compiled = kiln::compile_fn(f, CompileOptions::default()).map_err(err)?;
        for call in 0..2u64 {
            let x = randn(&[rows, classes], 7 + call).map_err(err)?;
            let targets: Vec<i64> = (0..rows as i64)
                .map(|i| (i * 37 + call as i64) % classes as i64 % 5 * 211 % classes as i64)
                .collect();
            let t = Tensor::from_vec(targets, &[rows]).map_err(err)?;
            let run = |compiled_run: bool| -> Result<(Tensor, Tensor)> {
                let x = x.to(CUDA)?.with_grad()?;
                let t = t.to(CUDA)?;
                let l = match compiled_run {
                    true => compiled.call(&[x.clone(), t])?.remove(0),
                    false => loss(&[x.clone(), t], ignore, smoothing)?,
                };
                l.backward()?;
                let g = x
                    .grad()
                    .ok_or_else(|| kiln::Error::arg("test", "no gradient"))?;
                Ok((l, g))
            };
            let (cl, cg) = run(true).map_err(err)?;
            let (el, eg) = run(false).map_err(err)?;
            let what = format!("cross_entropy ignore {ignore:?} smoothing {smoothing} call {call}");
            same(&format!("{what} loss"), &cl, &el, 1e-6)?;
            same(&format!("{what} gradient"), &cg, &eg, 1e-6)?;
        }
        // a target one past the last class: the loss is handed back, the error comes with the
        // first read (the device's next synchronization), naming the gather's dim and size
        let mut bad: Vec<i64> = vec![1; rows];
        bad[rows / 2] = classes as i64;
        let x = randn(&[rows, classes], 1)
            .map_err(err)?
            .to(CUDA)
            .map_err(err)?;
        let t = Tensor::from_vec(bad, &[rows])
            .and_then(|t| t.to(CUDA))
            .map_err(err)?;
        let read = compiled
            .call(&[x.clone(), t])
            .and_then(|mut l| l.remove(0).to_vec_f64());
        match read {
            Err(e) if e.to_string().contains("gather") && e.to_string().contains("1000") => {}
            Err(e) => return Err(format!("bad target: unexpected error {e}")),
            Ok(v) => return Err(format!("bad target: no error, loss {v:?}")),
        }
        // the device and the compiled function are fine afterwards
        let t = Tensor::from_vec(vec![2i64; rows], &[rows])
            .and_then(|t| t.to(CUDA))
            .map_err(err)?;
        let l = compiled
            .call(&[x.clone(), t.clone()])
            .map_err(err)?
            .remove(0);
        let e = loss(&[x, t], ignore, smoothing).map_err(err)?;
        same("after the bad target", &l, &e, 1e-6)?;
    }
    Ok(())
}
