//! Linear layers' epilogues in a training step, on the CPU: the forward half saves each ReLU's
//! output, not its mask (the backward reads the mask from the output: `relu_mask.rs`), so both
//! layers' biases and the ReLU run in the matmul calls (`epilogue.rs`); the compiled step's
//! loss and gradients equal eager ones bit for bit.

#[path = "support/capture.rs"]
mod capture;

use capture::Capture;
use kiln::compiler::graph::Op;
use kiln::core::prim::{Activation, Epilogue, Prim};
use kiln::nn::{Linear, Module, ReLU, Sequential};
use kiln::prelude::*;

fn model() -> Result<Sequential> {
    manual_seed(3);
    Ok(Sequential::new()
        .add(Linear::new(64, 128, true)?)
        .add(ReLU::new())
        .add(Linear::new(128, 32, true)?))
}

/// One step's loss and gradients, with the model run as `forward` runs it.
fn step(m: &Sequential, forward: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Vec<Vec<f32>>> {
    manual_seed(4);
    let x = Tensor::randn(&[4, 48, 64], DType::F32)?;
    for p in m.parameters() {
        p.set_grad(None);
    }
    let loss = forward(&x)?.mul(&forward(&x)?)?.mean(&[], false)?;
    loss.backward()?;
    let mut out = vec![loss.to_vec::<f32>()?];
    for p in m.parameters() {
        out.push(p.grad().expect("a gradient").to_vec::<f32>()?);
    }
    Ok(out)
}

#[test]
fn a_training_step_runs_bias_and_relu_in_the_matmuls() -> Result<()> {
    kiln::inductor::register();
    let m = model()?;
    let want = step(&m, &|x| m.forward(x))?;
    let capture = Capture::new();
    let compiled = kiln::compile(
        &m,
        CompileOptions::default().custom_backend(capture.clone()),
    )?;
    let got = step(&m, &|x| compiled.forward(x))?;
    assert_eq!(got, want, "interpreted halves");
    let graphs = capture.graphs();
    let forward = graphs.first().expect("a forward graph");
    // the forward returns no mask (a bool value) for its backward
    let masks = forward
        .outputs
        .iter()
        .filter(|&&o| forward.nodes[o].dtype == DType::Bool)
        .count();
    assert_eq!(masks, 0, "{}", forward.to_code("forward"));
    let fused = kiln::inductor::epilogue::fuse(forward).expect("epilogues");
    let epilogues: Vec<Epilogue> = fused
        .nodes
        .iter()
        .filter_map(|n| match n.op {
            Op::Prim(Prim::MatmulEpilogue(e)) => Some(e),
            _ => None,
        })
        .collect();
    let with = |act| Epilogue { bias: true, act };
    assert_eq!(epilogues, [with(Activation::Relu), with(Activation::None)]);
    // the `kiln` backend's generated kernels and epilogue calls: the same step, bit for bit
    let compiled = kiln::compile(&m, CompileOptions::default())?;
    assert_eq!(step(&m, &|x| compiled.forward(x))?, want, "compiled");
    Ok(())
}
