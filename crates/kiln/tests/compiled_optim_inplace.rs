//! A compiled optimizer step writes parameters and optimizer state in place: after the first call,
//! a compiled Adam step (`compile_fn(|_| opt.step())`) allocates no parameter-sized buffer, every
//! parameter, first and second moment is written straight into its own storage, and the result
//! equals the eager step's bitwise.

use std::sync::Mutex;

use kiln::inductor::exec_stats;
use kiln::nn::optim::{Adam, AdamConfig, Optimizer, SGDConfig, SGD};
use kiln::prelude::*;

const SHAPES: [[usize; 2]; 2] = [[128, 64], [64, 32]];

/// Draws from the process-wide generator: the tests of this binary run on parallel threads under
/// `cargo test`, and two seeded draws interleaved would give the eager and compiled runs
/// different parameters.
static DEFAULT_GENERATOR: Mutex<()> = Mutex::new(());

fn params(seed: u64) -> Result<Vec<Tensor>> {
    let _draws = DEFAULT_GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    manual_seed(seed);
    SHAPES
        .iter()
        .map(|s| {
            let p = Tensor::randn(s, DType::F32)?.with_grad()?;
            p.set_grad(Some(Tensor::randn(s, DType::F32)?));
            Ok(p)
        })
        .collect()
}

/// Runs three eager and three compiled steps of `make(params)`; returns the in-place and allocated
/// bytes of the compiled steps after the first.
fn check<O: Optimizer + Send>(make: impl Fn(Vec<Tensor>) -> Result<O>) -> Result<(u64, u64)> {
    let (eager_ps, compiled_ps) = (params(5)?, params(5)?);
    let mut eager = make(eager_ps.clone())?;
    let opt = Mutex::new(make(compiled_ps.clone())?);
    let step = kiln::compile_fn(
        |_: &[Tensor]| {
            opt.lock().unwrap_or_else(|e| e.into_inner()).step()?;
            Ok(vec![])
        },
        CompileOptions::default(),
    )?;
    let (mut inplace, mut allocated) = (0, 0);
    for k in 0..3 {
        eager.step()?;
        let before = exec_stats();
        step.call(&[])?;
        let after = exec_stats();
        if k > 0 {
            inplace += after.inplace_bytes - before.inplace_bytes;
            allocated += after.allocated_bytes - before.allocated_bytes;
        }
    }
    for (e, c) in eager_ps.iter().zip(&compiled_ps) {
        assert_eq!(
            e.to_vec::<f32>()?,
            c.to_vec::<f32>()?,
            "compiled step differs"
        );
    }
    Ok((inplace, allocated))
}

#[test]
fn compiled_adam_and_sgd_update_parameters_and_state_in_place() -> Result<()> {
    if kiln::inductor::runtime::cc::toolchain().is_none() {
        eprintln!("SKIPPED: no C compiler; the kiln backend runs the interpreter");
        return Ok(());
    }
    let param_bytes: u64 = SHAPES.iter().map(|s| (s[0] * s[1] * 4) as u64).sum();
    // Adam: parameter, exp_avg and exp_avg_sq per parameter, two compiled steps counted
    let (inplace, allocated) = check(|ps| {
        Adam::new(
            ps,
            AdamConfig {
                lr: 0.01,
                ..AdamConfig::default()
            },
        )
    })?;
    assert!(
        inplace >= 2 * 3 * param_bytes,
        "adam in place: {inplace} bytes"
    );
    assert!(
        allocated < param_bytes / 8,
        "adam allocated {allocated} bytes"
    );
    // SGD with momentum: the parameters in place; its per-parameter loop replaces each momentum
    // buffer with a new tensor (Rust state, not `assign`), so those are new outputs every step
    let (inplace, allocated) = check(|ps| {
        SGD::new(
            ps,
            SGDConfig {
                lr: 0.1,
                momentum: 0.9,
                ..SGDConfig::default()
            },
        )
    })?;
    assert!(inplace >= 2 * param_bytes, "sgd in place: {inplace} bytes");
    assert!(
        allocated <= 2 * param_bytes,
        "sgd allocated {allocated} bytes"
    );
    Ok(())
}

/// SGD's momentum state changes after the first step; a compiled step must still equal eager on
/// every step, with dampening (a first-step flag) and without, per-parameter and foreach.
#[test]
fn compiled_sgd_momentum_equals_eager_every_step() -> Result<()> {
    for (dampening, foreach) in [(0.0, false), (0.5, false), (0.0, true), (0.5, true)] {
        check(|ps| {
            SGD::new(
                ps,
                SGDConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    dampening,
                    foreach,
                    ..SGDConfig::default()
                },
            )
        })
        .map_err(|e| {
            kiln::Error::arg(
                "sgd",
                format!("dampening {dampening} foreach {foreach}: {e}"),
            )
        })?;
    }
    Ok(())
}
