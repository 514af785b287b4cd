//! reduce-overhead on the GPU: recorded CUDA graphs replayed with new arguments, cuBLAS matmuls
//! inside a recording, other threads' work refused while one records, and an optimizer step
//! updated in place by its replays.

use std::sync::Mutex;

use kiln::inductor::exec_stats;
use kiln::nn::optim::{Adam, AdamConfig, Optimizer};
use kiln::prelude::*;

use super::{compiled_step, cuda_randn, err, optimizers, randn, same, same_outputs, Outcome, CUDA};

/// reduce-overhead: the calls after the first two replay a recorded CUDA graph, with each call's
/// new argument values, and equal eager.
pub fn reduce_overhead_replays_with_new_inputs() -> Outcome {
    let f = |a: &[Tensor]| -> Result<Vec<Tensor>> {
        let y = a[0].sin()?.add(&a[0].cos()?)?;
        Ok(vec![y.clone(), y.sum(&[1], false)?.mul(&a[1])?])
    };
    let compiled =
        kiln::compile_fn(f, CompileOptions::default().mode(Mode::ReduceOverhead)).map_err(err)?;
    let before = exec_stats().graph_replays;
    for call in 0..5u64 {
        let x = randn(&[64, 300], call)
            .map_err(err)?
            .to(CUDA)
            .map_err(err)?;
        let s = Tensor::scalar(call as f32 + 0.5); // a CPU scalar, copied in on every replay
        let got = compiled.call(&[x.clone(), s.clone()]).map_err(err)?;
        let want = f(&[x, s]).map_err(err)?;
        same_outputs(&format!("call {call}"), &got, &want, 1e-6)?;
    }
    let replays = exec_stats().graph_replays - before;
    if replays != 4 {
        return Err(format!("{replays} graph replays in 5 calls, expected 4"));
    }
    Ok(())
}

/// Matmuls through cuBLAS (small ones not generated) recorded in a CUDA graph, over operands
/// read in place transposed or not: the recording call (call 0) and the replays after it agree
/// with eager. Not to the bit: while a graph records cuBLAS may pick another kernel than it runs
/// eagerly (seen: an ulp apart in f32 where both operands are transposed).
pub fn reduce_overhead_matmuls_match_eager() -> Outcome {
    let f = |a: &[Tensor]| -> Result<Vec<Tensor>> {
        Ok(vec![
            a[0].t()?.matmul(&a[1])?,
            a[2].matmul(&a[3].t()?)?.relu()?,
            a[4].t()?.matmul(&a[5].t()?)?,
        ])
    };
    let opts = CompileOptions::default()
        .mode(Mode::ReduceOverhead)
        .option(kiln::inductor::INLINE_SMALL_MATMULS, "false");
    let compiled = kiln::compile_fn(f, opts).map_err(err)?;
    for call in 0..3u64 {
        let shapes: [&[usize]; 6] = [&[4, 5], &[4, 3], &[3, 4], &[5, 4], &[4, 3], &[5, 4]];
        let args = cuda_randn(&shapes, 10 * call, DType::F32).map_err(err)?;
        let got = compiled.call(&args).map_err(err)?;
        let want = f(&args).map_err(err)?;
        same_outputs(&format!("call {call}"), &got, &want, 1e-6)?;
    }
    Ok(())
}

/// While one thread records a CUDA graph from the device's stream, another thread's work on
/// the device is refused with an error that says why (it would join the recording); once the
/// recording ends it runs.
pub fn recording_refuses_other_threads_work() -> Outcome {
    let rt = kiln::core::device::runtime_for("test", CUDA).map_err(err)?;
    let x = Tensor::ones(&[1000], DType::F32)
        .map_err(err)?
        .to(CUDA)
        .map_err(err)?;
    rt.begin_capture(CUDA).map_err(err)?;
    let other = std::thread::scope(|s| s.spawn(|| x.add(&x).map(|_| ())).join());
    let recorded = rt.end_capture(CUDA);
    let refused = match other {
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(())) => return Err("another thread's add ran during a recording".into()),
        Err(_) => return Err("another thread's add panicked during a recording".into()),
    };
    recorded.map_err(err)?;
    if !refused.contains("recording a CUDA graph") {
        return Err(format!("unexpected error: {refused}"));
    }
    let after =
        std::thread::scope(|s| s.spawn(|| x.add(&x)?.sum(&[], false)?.item::<f32>()).join());
    match after {
        Ok(Ok(2000.0)) => Ok(()),
        other => Err(format!("after the recording: {other:?}")),
    }
}

/// A reduce-overhead optimizer step: parameters and state updated in place by the replays,
/// gradients (new values each step) copied in.
pub fn reduce_overhead_adam_steps() -> Outcome {
    let (eager_ps, compiled_ps) = (
        optimizers::params(4).map_err(err)?,
        optimizers::params(4).map_err(err)?,
    );
    let mut eager = Adam::new(eager_ps.clone(), AdamConfig::default()).map_err(err)?;
    let opt = Mutex::new(Adam::new(compiled_ps.clone(), AdamConfig::default()).map_err(err)?);
    let step = compiled_step(&opt, CompileOptions::default().mode(Mode::ReduceOverhead))?;
    let before = exec_stats().graph_replays;
    for k in 0..5u64 {
        for (e, c) in eager_ps.iter().zip(&compiled_ps) {
            let g = randn(e.shape(), 50 + k)
                .map_err(err)?
                .to(CUDA)
                .map_err(err)?;
            let (ge, gc) = (e.grad().ok_or("no grad")?, c.grad().ok_or("no grad")?);
            ge.assign(&g).map_err(err)?;
            gc.assign(&g).map_err(err)?;
        }
        eager.step().map_err(err)?;
        step.call(&[]).map_err(err)?;
        for (i, (e, c)) in eager_ps.iter().zip(&compiled_ps).enumerate() {
            same(&format!("step {k} parameter {i}"), c, e, 1e-6)?;
        }
    }
    if exec_stats().graph_replays == before {
        return Err("no step replayed a recorded graph".into());
    }
    Ok(())
}
