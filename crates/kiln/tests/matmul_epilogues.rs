//! Linear layers' epilogues in a training step on a device (the mock device: host memory, the
//! CPU's kernels; the graphs are the ones a GPU gets): the forward half saves each ReLU's output,
//! not its mask (the backward reads the mask from the output: `relu_mask.rs`), so both layers'
//! biases and the ReLU run in the matmul calls (`epilogue.rs`); the step, its graphs fused and
//! interpreted (the epilogue prim's kernel here runs the ops it stands for), gives eager's loss
//! and gradients bit for bit.

#[path = "support/capture.rs"]
mod capture;
#[path = "../../kiln-core/tests/support/mock_device.rs"]
mod mock_device;

use capture::Capture;
use kiln::compiler::graph::Op;
use kiln::core::prim::{Activation, Epilogue, Prim};
use kiln::nn::{Linear, Module, ReLU, Sequential};
use kiln::prelude::*;
use mock_device::{setup, DEV};

fn model() -> Result<Sequential> {
    manual_seed(3);
    let mut m = Sequential::new()
        .add(Linear::new(64, 128, true)?)
        .add(ReLU::new())
        .add(Linear::new(128, 32, true)?);
    m.to(DEV)?;
    Ok(m)
}

/// One step's loss and gradients, with the model run as `forward` runs it.
fn step(m: &Sequential, forward: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Vec<Vec<f32>>> {
    manual_seed(4);
    let x = Tensor::randn(&[4, 48, 64], DType::F32)?.to(DEV)?;
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
    setup();
    let m = model()?;
    let want = step(&m, &|x| m.forward(x))?;
    let capture = Capture::rewriting(kiln::inductor::epilogue::fuse);
    let aot = std::sync::Arc::new(kiln::compiler::aot::AotBackend::new(
        "capture",
        capture.clone(),
    ));
    let compiled = kiln::compile(&m, CompileOptions::default().custom_backend(aot))?;
    let got = step(&m, &|x| compiled.forward(x))?;
    assert_eq!(got, want);
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
    Ok(())
}
