//! A foreach Adam on a device computes its flat update through one compiled function
//! (`kiln-nn/src/optim/flat_update.rs`), compiled at the first step and replayed after (each of
//! the three steps answered by it, none by the eager fallback), and its steps equal the
//! per-parameter loop's, also when a parameter has no gradient (a part of the group updated). The mock device (host memory, CPU kernels) stands in for
//! CUDA, so this checks the plumbing on any machine; `gpu_compile.rs` runs the generated kernel.
//! One test in this binary: it counts the process's backend compiles.

#[path = "../../kiln-core/tests/support/mock_device.rs"]
mod mock_device;

use kiln::nn::optim::{Adam, AdamConfig, AdamW, AdamWConfig, Optimizer};
use kiln::prelude::*;
use mock_device::{setup, DEV};

fn params(seed: u64) -> Result<Vec<Tensor>> {
    manual_seed(seed);
    [vec![7usize, 5], vec![5], vec![3, 2, 2]]
        .iter()
        .map(|s| Tensor::randn(s, DType::F32)?.to(DEV)?.with_grad())
        .collect()
}

/// Three steps with the same gradients; the parameters after each.
fn steps(opt: &mut dyn Optimizer, ps: &[Tensor]) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::new();
    for k in 0..3u64 {
        manual_seed(100 + k);
        for p in ps {
            p.set_grad(Some(Tensor::randn(p.shape(), DType::F32)?.to(DEV)?));
        }
        opt.step()?;
        for p in ps {
            out.push(p.to_vec::<f32>()?);
        }
    }
    Ok(out)
}

/// A fourth step with the second parameter's gradient cleared; the parameters after it.
fn partial_step(opt: &mut dyn Optimizer, ps: &[Tensor]) -> Result<Vec<Vec<f32>>> {
    manual_seed(200);
    for (i, p) in ps.iter().enumerate() {
        p.set_grad(match i {
            1 => None,
            _ => Some(Tensor::randn(p.shape(), DType::F32)?.to(DEV)?),
        });
    }
    opt.step()?;
    ps.iter().map(|p| p.to_vec::<f32>()).collect()
}

fn assert_close(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    for (g, w) in got.iter().zip(want) {
        for (a, b) in g.iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "{what}: foreach {a} vs for-loop {b}"
            );
        }
    }
}

#[test]
fn a_device_foreach_adam_compiles_its_flat_update_once() -> Result<()> {
    setup();
    kiln::inductor::register();
    for amsgrad in [false, true] {
        let cfg = |foreach| AdamConfig {
            lr: 0.05,
            weight_decay: 0.1,
            amsgrad,
            foreach,
            ..AdamConfig::default()
        };
        let (ps, qs) = (params(1)?, params(1)?);
        let mut looped = Adam::new(qs.clone(), cfg(false))?;
        let want = steps(&mut looped, &qs)?;
        let before = kiln::cache_stats().backend_compiles;
        let mut foreach = Adam::new(ps.clone(), cfg(true))?;
        let got = steps(&mut foreach, &ps)?;
        let compiles = kiln::cache_stats().backend_compiles - before;
        assert_eq!(
            compiles, 1,
            "amsgrad={amsgrad}: one compile over three steps"
        );
        assert_close(&format!("Adam amsgrad={amsgrad}"), &got, &want);
        assert_eq!(foreach.steps(), vec![3, 3, 3]);
        assert_eq!(foreach.compiled_flat_updates(), 3, "amsgrad={amsgrad}");
        assert_eq!(looped.compiled_flat_updates(), 0);
        // a step where one parameter has no gradient updates the other two through the flat
        // update's pure form (a part of the group), the third keeping its value and step count
        let got = partial_step(&mut foreach, &ps)?;
        let want = partial_step(&mut looped, &qs)?;
        assert_close(
            &format!("Adam amsgrad={amsgrad}, one gradient missing"),
            &got,
            &want,
        );
        assert_eq!(foreach.steps(), vec![4, 3, 4]);
        assert_eq!(foreach.compiled_flat_updates(), 4, "amsgrad={amsgrad}");
    }
    let cfg = |foreach| AdamWConfig {
        lr: 0.05,
        foreach,
        ..AdamWConfig::default()
    };
    let (ps, qs) = (params(2)?, params(2)?);
    let want = steps(&mut AdamW::new(qs.clone(), cfg(false))?, &qs)?;
    let mut foreach = AdamW::new(ps.clone(), cfg(true))?;
    let got = steps(&mut foreach, &ps)?;
    assert_close("AdamW", &got, &want);
    assert_eq!(foreach.compiled_flat_updates(), 3);
    assert_eq!(foreach.steps(), vec![3, 3, 3]);
    Ok(())
}
