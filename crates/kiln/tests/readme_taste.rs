//! README.md's "A taste", verbatim, so the README stays true.

use kiln::nn::optim::{Adam, AdamConfig, Optimizer};
use kiln::nn::{Linear, Module, ReLU, Sequential};
use kiln::prelude::*;

#[test]
fn readme_taste_runs() -> Result<()> {
    let model = Sequential::new()
        .add(Linear::new(64, 128, true)?)
        .add(ReLU::new())
        .add(Linear::new(128, 10, true)?);
    let compiled = kiln::compile(&model, CompileOptions::default())?; // the one line
    let mut opt = Adam::new(
        model.parameters(),
        AdamConfig {
            lr: 1e-3,
            ..AdamConfig::default()
        },
    )?;
    let x = Tensor::randn(&[32, 64], DType::F32)?;
    let y = Tensor::from_vec((0..32).map(|i| i % 10).collect::<Vec<i64>>(), &[32])?;
    let loss = compiled
        .forward(&x)?
        .cross_entropy(&y, None, 0.0, Reduction::Mean)?;
    opt.zero_grad();
    loss.backward()?; // runs the compiled backward graph
    opt.step()?;
    // and the step did something: the loss on the same batch goes down
    let after = compiled
        .forward(&x)?
        .cross_entropy(&y, None, 0.0, Reduction::Mean)?;
    assert!(after.item::<f32>()? < loss.item::<f32>()?);
    Ok(())
}
