//! The `adam` workload times `kiln::compile_fn(|_| opt.step())`; these tests check that what it
//! times is Adam: a compiled step replays without recompiling and tracks eager step for step, with
//! gradients that change between steps, a scheduler changing the lr, and eager steps mixed in.

use std::sync::Mutex;

use kiln::nn::optim::{
    Adam, AdamConfig, AdamW, AdamWConfig, CosineAnnealingLR, LrScheduler, Optimizer,
};
use kiln::{CompileOptions, DType, Tensor};

fn params(seed: u64) -> Vec<Tensor> {
    kiln::manual_seed(seed);
    [&[8usize, 16][..], &[16], &[3, 4, 5]]
        .iter()
        .map(|s| {
            let p = Tensor::randn(s, DType::F32).unwrap().with_grad().unwrap();
            p.set_grad(Some(Tensor::zeros(s, DType::F32).unwrap()));
            p
        })
        .collect()
}

/// New gradient values, written into the existing gradient tensors.
fn set_grads(ps: &[Tensor], step: usize) {
    kiln::manual_seed(1000 + step as u64);
    for p in ps {
        let g = Tensor::randn(p.shape(), DType::F32).unwrap();
        p.grad().unwrap().assign(&g).unwrap();
    }
}

fn values(ps: &[Tensor]) -> Vec<f32> {
    ps.iter().flat_map(|p| p.to_vec::<f32>().unwrap()).collect()
}

/// Runs 6 steps eagerly and with the step compiled (steps 3 and 5 eager in the compiled run),
/// the lr annealed every other step; returns (eager, compiled, compiles, step counts).
fn run<O: Optimizer + Send>(make: &dyn Fn(Vec<Tensor>) -> O) -> (Vec<f32>, Vec<f32>, usize) {
    // parameters and gradients come from the process-wide generator after `manual_seed`; the
    // tests run on parallel threads under `cargo test`, and interleaved draws would give the
    // eager and compiled runs different values
    static DEFAULT_GENERATOR: Mutex<()> = Mutex::new(());
    let _draws = DEFAULT_GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    let eager_ps = params(1);
    let mut eager = make(eager_ps.clone());
    let mut sched = CosineAnnealingLR::new(&eager, 4, 1e-4).unwrap();
    for k in 0..6 {
        set_grads(&eager_ps, k);
        eager.step().unwrap();
        if k % 2 == 1 {
            sched.step();
        }
    }

    let ps = params(1);
    let opt = Mutex::new(make(ps.clone()));
    let mut sched = CosineAnnealingLR::new(&*opt.lock().unwrap(), 4, 1e-4).unwrap();
    let step = kiln::compile_fn(
        |_: &[Tensor]| {
            opt.lock().unwrap().step()?;
            Ok(vec![])
        },
        CompileOptions::default(),
    )
    .unwrap();
    for k in 0..6 {
        set_grads(&ps, k);
        match k {
            3 | 5 => opt.lock().unwrap().step().unwrap(),
            _ => {
                step.call(&[]).unwrap();
            }
        }
        if k % 2 == 1 {
            sched.step();
        }
    }
    (values(&eager_ps), values(&ps), step.stats().compiles)
}

fn assert_close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-6 * (1.0 + x.abs()),
            "element {i}: eager {x} vs compiled {y}"
        );
    }
}

#[test]
fn compiled_adam_tracks_eager_without_recompiling() {
    for foreach in [false, true] {
        for amsgrad in [false, true] {
            let (e, c, compiles) = run(&|ps| {
                Adam::new(
                    ps,
                    AdamConfig {
                        lr: 0.01,
                        weight_decay: 0.1,
                        amsgrad,
                        foreach,
                        ..AdamConfig::default()
                    },
                )
                .unwrap()
            });
            assert_close(&e, &c);
            assert_eq!(compiles, 1, "foreach={foreach} amsgrad={amsgrad}");
        }
    }
}

#[test]
fn compiled_adamw_tracks_eager_without_recompiling() {
    for foreach in [false, true] {
        let (e, c, compiles) = run(&|ps| {
            AdamW::new(
                ps,
                AdamWConfig {
                    lr: 0.01,
                    foreach,
                    ..AdamWConfig::default()
                },
            )
            .unwrap()
        });
        assert_close(&e, &c);
        assert_eq!(compiles, 1, "foreach={foreach}");
    }
}

#[test]
fn compiled_steps_count_in_the_step_tensors() {
    let ps = params(2);
    let opt = Mutex::new(Adam::new(ps.clone(), AdamConfig::default()).unwrap());
    let step = kiln::compile_fn(
        |_: &[Tensor]| {
            opt.lock().unwrap().step()?;
            Ok(vec![])
        },
        CompileOptions::default(),
    )
    .unwrap();
    for _ in 0..4 {
        step.call(&[]).unwrap();
    }
    assert_eq!(opt.lock().unwrap().steps(), vec![4, 4, 4]);
    assert_eq!(step.stats().replays, 3);
}
