//! The digits training loop shared by `quickstart` and `train_digits`.

use std::time::{Duration, Instant};

use kiln::data::{digits_path, permutation, Digits};
use kiln::models::DigitsCnn;
use kiln::nn::optim::{Adam, AdamConfig, CosineAnnealingLR, LrScheduler, Optimizer};
use kiln::prelude::*;

#[allow(dead_code)] // each example reads the fields it reports
pub struct Run {
    pub step_losses: Vec<f32>,
    pub test_accuracy: f64,
    pub train_time: Duration,
    /// Time of the first step (for a compiled model: tracing and compiling included).
    pub first_step: Duration,
}

pub fn accuracy(model: &dyn Module, data: &Digits) -> Result<f64> {
    model.eval();
    let logits = no_grad(|| model.forward(&data.images))?;
    model.train(true);
    let pred = logits.argmax(Some(1), false)?;
    let correct = pred.eq(&data.labels)?.sum_all()?.item::<i64>()?;
    Ok(correct as f64 / data.len() as f64)
}

/// Augmentation: the batch's 8x8 images moved by up to one pixel each way (zeros shift in).
fn shift(x: &Tensor, salt: u64) -> Result<Tensor> {
    let r = kiln::data::permutation(9, salt)[0] as usize;
    let (dy, dx) = (r / 3, r % 3);
    let padded = x.reshape([-1, 1, 8, 8])?.pad(&[1, 1, 1, 1], 0.0)?;
    padded.narrow(2, dy, 8)?.narrow(3, dx, 8)?.reshape([-1, 64])
}

/// Trains a fresh `DigitsCnn` (seeded) on the first 80% of rows; accuracy on the last 20%.
pub fn train(compile: bool, epochs: usize, seed: u64, verbose: bool) -> Result<Run> {
    manual_seed(seed);
    let data = Digits::load(&digits_path()?)?;
    let (train_set, test_set) = data.split(0.2)?;
    let model = DigitsCnn::new()?;
    let compiled;
    let run: &dyn Module = if compile {
        compiled = kiln::compile(&model, CompileOptions::default())?;
        &compiled
    } else {
        &model
    };
    let mut opt = Adam::new(
        model.parameters(),
        AdamConfig {
            lr: 2e-3,
            ..AdamConfig::default()
        },
    )?;
    let mut sched = CosineAnnealingLR::new(&opt, epochs, 0.0)?;
    let mut step_losses = Vec::new();
    let start = Instant::now();
    let mut first_step = Duration::ZERO;
    for epoch in 0..epochs {
        let order = permutation(train_set.len(), seed + epoch as u64);
        let mut epoch_loss = 0.0;
        let batches = train_set.batches(&order, 32)?;
        for (k, (x, y)) in batches.iter().enumerate() {
            let t = Instant::now();
            let x = shift(
                x,
                seed.wrapping_mul(1000)
                    .wrapping_add((epoch * batches.len() + k) as u64),
            )?;
            let loss = run
                .forward(&x)?
                .cross_entropy(y, None, 0.0, Reduction::Mean)?;
            opt.zero_grad();
            loss.backward()?;
            opt.step()?;
            let l = loss.item::<f32>()?;
            if step_losses.is_empty() {
                first_step = t.elapsed();
            }
            step_losses.push(l);
            epoch_loss += l as f64;
        }
        sched.step();
        if verbose {
            println!(
                "epoch {epoch:2}  loss {:.4}",
                epoch_loss / batches.len() as f64
            );
        }
    }
    let train_time = start.elapsed();
    let test_accuracy = accuracy(run, &test_set)?;
    Ok(Run {
        step_losses,
        test_accuracy,
        train_time,
        first_step,
    })
}
