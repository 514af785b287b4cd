//! End to end, compiled equals eager: `DigitsCnn` (conv, relu, max-pool, flatten, linear, dropout)
//! trained with Adam for 20 steps eagerly and through `kiln::compile` from one seed. Per-step losses
//! and the final parameters must agree, the compiled model must trace once and replay every later
//! step, and in eval mode (a recompile: the training flag is guarded) its logits must match too.

use kiln::data::{digits_path, permutation, Digits};
use kiln::models::DigitsCnn;
use kiln::nn::optim::{Adam, AdamConfig, Optimizer};
use kiln::prelude::*;

const SEED: u64 = 2024;
const STEPS: usize = 20;
const BATCH: usize = 32;

struct Run {
    losses: Vec<f32>,
    params: Vec<(String, Tensor)>,
    eval_logits: Tensor,
    stats: Option<kiln::FnStats>,
}

fn train(data: &Digits, compile: bool) -> Result<Run> {
    manual_seed(SEED);
    let model = DigitsCnn::new()?;
    let compiled = if compile {
        Some(kiln::compile(&model, CompileOptions::default())?)
    } else {
        None
    };
    let run: &dyn Module = match &compiled {
        Some(c) => c,
        None => &model,
    };
    let mut opt = Adam::new(
        model.parameters(),
        AdamConfig {
            lr: 2e-3,
            ..AdamConfig::default()
        },
    )?;
    let order = permutation(data.len(), SEED);
    let batches = data.batches(&order[..STEPS * BATCH], BATCH)?;
    let mut losses = Vec::new();
    for (x, y) in &batches {
        // dropout (p = 0.3) draws from the default generator: both runs draw the same masks
        let loss = run
            .forward(x)?
            .cross_entropy(y, None, 0.0, Reduction::Mean)?;
        opt.zero_grad();
        loss.backward()?;
        opt.step()?;
        losses.push(loss.item::<f32>()?);
    }
    let stats = compiled.as_ref().map(|c| c.stats());
    run.eval();
    let held_out = data.images.narrow(0, data.len() - 100, 100)?;
    let eval_logits = no_grad(|| run.forward(&held_out))?;
    Ok(Run {
        losses,
        params: model.named_parameters(),
        eval_logits,
        stats,
    })
}

/// Largest relative difference, asserting it is at most `tol`.
fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> f64 {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (x, y) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let mut worst = 0.0f64;
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        let rel = if p == q {
            0.0
        } else {
            (p - q).abs() / p.abs().max(q.abs())
        };
        assert!(
            rel <= tol,
            "{what}: element {i}: compiled {p:e} vs eager {q:e}"
        );
        worst = worst.max(rel);
    }
    worst
}

#[test]
fn digits_cnn_trains_identically_compiled_and_eager() -> Result<()> {
    let data = Digits::load(&digits_path()?)?;
    assert!(data.len() >= STEPS * BATCH + 100);
    let eager = train(&data, false)?;
    let compiled = train(&data, true)?;

    assert_eq!(compiled.losses.len(), STEPS);
    for (k, (c, e)) in compiled.losses.iter().zip(&eager.losses).enumerate() {
        let rel = ((c - e).abs() / e.abs()) as f64;
        assert!(
            rel <= 1e-5,
            "step {k}: compiled loss {c} vs eager {e} (rel {rel:e})"
        );
    }
    assert!(
        eager.losses[STEPS - 1] < eager.losses[0],
        "training should reduce the loss: {:?}",
        eager.losses
    );

    assert_eq!(compiled.params.len(), eager.params.len());
    let mut worst = 0.0f64;
    for ((nc, pc), (ne, pe)) in compiled.params.iter().zip(&eager.params) {
        assert_eq!(nc, ne);
        worst = worst.max(assert_close(&format!("parameter {nc}"), pc, pe, 1e-5));
    }
    println!("largest relative parameter difference after {STEPS} steps: {worst:e}");
    assert_close(
        "eval-mode logits",
        &compiled.eval_logits,
        &eager.eval_logits,
        1e-5,
    );

    let s = compiled.stats.expect("compiled stats");
    assert_eq!(s.graph_breaks, 0, "{s:?}");
    assert_eq!(
        (s.traces, s.compiles, s.replays),
        (1, 1, STEPS - 1),
        "one trace, then replays: {s:?}"
    );
    Ok(())
}
