//! The compiled optimizer on the GPU: Adam and SGD steps equal eager's, in place (no new
//! parameter tensors), many parameters in a few horizontal launches, and the foreach Adam's flat
//! update as one generated kernel.

use std::sync::Mutex;

use kiln::inductor::exec_stats;
use kiln::nn::optim::{Adam, AdamConfig, Optimizer, SGDConfig, SGD};
use kiln::prelude::*;

use super::{compiled_step, err, params_with_grads, same, Outcome};

/// A two-layer MLP's parameters (256 → 128 → 10 weights), each with a random gradient.
pub(super) fn params(seed: u64) -> Result<Vec<Tensor>> {
    params_with_grads(&[vec![256, 128], vec![128, 10]], seed)
}

/// A compiled optimizer step on the GPU writes the parameters in place and equals the eager step.
pub(super) fn optimizer_steps<O: Optimizer + Send>(
    make: impl Fn(Vec<Tensor>) -> Result<O>,
) -> Outcome {
    let (eager_ps, compiled_ps) = (params(3).map_err(err)?, params(3).map_err(err)?);
    let mut eager = make(eager_ps.clone()).map_err(err)?;
    let opt = Mutex::new(make(compiled_ps.clone()).map_err(err)?);
    let step = compiled_step(&opt, CompileOptions::default())?;
    let mut inplace = 0;
    for k in 0..3 {
        eager.step().map_err(err)?;
        let before = exec_stats();
        step.call(&[]).map_err(err)?;
        if k > 0 {
            inplace += exec_stats().inplace_bytes - before.inplace_bytes;
        }
        for (i, (e, c)) in eager_ps.iter().zip(&compiled_ps).enumerate() {
            same(&format!("step {k} parameter {i}"), c, e, 1e-6)?;
        }
    }
    for (i, (e, c)) in eager_ps.iter().zip(&compiled_ps).enumerate() {
        same(&format!("parameter {i}"), c, e, 1e-6)?;
    }
    if inplace == 0 {
        return Err("the compiled step wrote nothing in place".into());
    }
    Ok(())
}

pub(super) fn adam_step() -> Outcome {
    optimizer_steps(|ps| Adam::new(ps, AdamConfig::default()))
}

/// A compiled Adam step over parameters of many shapes runs as a few horizontal launches (each
/// running every parameter's kernels side by side), not a few launches per parameter, and
/// equals the eager step. 24 parameters: one launch then takes far more than 64 arguments (a
/// limit the launcher once had).
pub(super) fn adam_many_parameters_few_launches() -> Outcome {
    let mut shapes: Vec<Vec<usize>> = vec![
        vec![300, 40],
        vec![40],
        vec![40, 40],
        vec![7],
        vec![5000],
        vec![3, 3, 16, 8],
        vec![1],
        vec![64, 33],
    ];
    shapes.extend((0..16).map(|i| vec![5 + 3 * i, 2 + i % 4]));
    let make = || params_with_grads(&shapes, 21);
    let (eager_ps, compiled_ps) = (make().map_err(err)?, make().map_err(err)?);
    let mut eager = Adam::new(eager_ps.clone(), AdamConfig::default()).map_err(err)?;
    let opt = Mutex::new(Adam::new(compiled_ps.clone(), AdamConfig::default()).map_err(err)?);
    let step = compiled_step(&opt, CompileOptions::default())?;
    for k in 0..3 {
        eager.step().map_err(err)?;
        let before = exec_stats().kernel_launches;
        step.call(&[]).map_err(err)?;
        let launches = exec_stats().kernel_launches - before;
        if k > 0 && launches > 4 {
            return Err(format!(
                "{launches} kernel launches for a step over {} parameters",
                shapes.len()
            ));
        }
        for (i, (e, c)) in eager_ps.iter().zip(&compiled_ps).enumerate() {
            same(&format!("step {k} parameter {i}"), c, e, 1e-6)?;
        }
    }
    Ok(())
}

/// An eager foreach Adam on the GPU runs its flat update as one compiled call of at most two
/// generated launches (`kiln-nn/src/optim/flat_update.rs`) and equals the per-parameter loop,
/// with amsgrad and without, over parameters of several shapes.
pub(super) fn foreach_adam_flat_update() -> Outcome {
    let shapes: Vec<Vec<usize>> = vec![vec![300, 40], vec![40], vec![7], vec![3, 3, 16, 8]];
    for amsgrad in [false, true] {
        let cfg = |foreach| AdamConfig {
            lr: 0.01,
            weight_decay: 0.05,
            amsgrad,
            foreach,
            ..AdamConfig::default()
        };
        let (looped_ps, foreach_ps) = (
            params_with_grads(&shapes, 5).map_err(err)?,
            params_with_grads(&shapes, 5).map_err(err)?,
        );
        let mut looped = Adam::new(looped_ps.clone(), cfg(false)).map_err(err)?;
        let mut foreach = Adam::new(foreach_ps.clone(), cfg(true)).map_err(err)?;
        for k in 0..3 {
            looped.step().map_err(err)?;
            let before = exec_stats();
            foreach.step().map_err(err)?;
            let after = exec_stats();
            let (calls, launches) = (
                after.calls - before.calls,
                after.kernel_launches - before.kernel_launches,
            );
            if calls != 1 || launches > 2 {
                return Err(format!(
                    "amsgrad={amsgrad} step {k}: {calls} compiled calls, {launches} generated \
                     launches (want 1 call, at most 2 launches)"
                ));
            }
            for (i, (e, c)) in looped_ps.iter().zip(&foreach_ps).enumerate() {
                same(
                    &format!("amsgrad={amsgrad} step {k} parameter {i}"),
                    c,
                    e,
                    1e-6,
                )?;
            }
        }
    }
    Ok(())
}

pub(super) fn plain_sgd_step() -> Outcome {
    optimizer_steps(|ps| {
        SGD::new(
            ps,
            SGDConfig {
                lr: 0.1,
                ..SGDConfig::default()
            },
        )
    })
}

pub(super) fn sgd_momentum_step() -> Outcome {
    optimizer_steps(|ps| {
        SGD::new(
            ps,
            SGDConfig {
                lr: 0.1,
                momentum: 0.9,
                ..SGDConfig::default()
            },
        )
    })
}
