//! reduce-overhead on a training step (`kiln-inductor/src/runtime/cudagraph.rs`): the backward's
//! recording reads the activations the forward's recording saved where the forward's replay
//! writes them, instead of copying them into buffers of its own before every replay; the step
//! stays equal to eager.

use kiln::nn::{Linear, Module, ReLU, Sequential};
use kiln::prelude::*;

use super::{err, exec_stats, randn, same_scaled, Outcome, CUDA};

/// Wide hidden layers on a narrow input: the saved activations ([64, 512] each) outweigh the
/// call's arguments many times over.
fn mlp() -> Result<Sequential> {
    manual_seed(31);
    let mut m = Sequential::new()
        .add(Linear::new(32, 512, true)?)
        .add(ReLU::new())
        .add(Linear::new(512, 512, true)?)
        .add(ReLU::new())
        .add(Linear::new(512, 4, true)?);
    m.to(CUDA)?;
    Ok(m)
}

/// The output and every gradient of one step of `forward` on `x` (gradients cleared first).
fn step(
    m: &Sequential,
    forward: &dyn Fn(&Tensor) -> Result<Tensor>,
    x: &Tensor,
) -> Result<Vec<Tensor>> {
    m.zero_grad();
    let out = forward(x)?;
    out.square()?.mean_all()?.backward()?;
    let mut all = vec![out.clone_data()?];
    all.extend(m.parameters().iter().filter_map(|p| p.grad()));
    Ok(all)
}

pub fn reduce_overhead_backward_reads_saved_activations_in_place() -> Outcome {
    let m = mlp().map_err(err)?;
    let compiled =
        kiln::compile(&m, CompileOptions::default().mode(Mode::ReduceOverhead)).map_err(err)?;
    let nbytes = |t: &Tensor| (t.numel() * t.dtype().size_in_bytes()) as u64;
    for call in 0..5u64 {
        let x = randn(&[64, 32], 40 + call)
            .and_then(|x| x.to(CUDA))
            .map_err(err)?;
        let before = exec_stats();
        let got = step(&m, &|x| compiled.forward(x), &x).map_err(err)?;
        let after = exec_stats();
        let want = step(&m, &|x| m.forward(x), &x).map_err(err)?;
        if got.len() != want.len() {
            return Err(format!(
                "call {call}: {} results, want {}",
                got.len(),
                want.len()
            ));
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            same_scaled(&format!("call {call}: result {i}"), g, w, 1e-5)?;
        }
        // the first call runs, the second records; from the third both halves replay, copying
        // only what the caller passes: x (to the forward, and to the backward, which reads it
        // for the first layer's weight gradient) and the output's gradient
        if call >= 2 {
            let replays = after.graph_replays - before.graph_replays;
            let copied = after.replay_copied_bytes - before.replay_copied_bytes;
            let limit = 2 * nbytes(&x) + nbytes(&got[0]) + 1024;
            if replays != 2 || copied > limit {
                return Err(format!(
                    "call {call}: {replays} replays (want 2) copying {copied} bytes (at most \
                     {limit}: the saved activations were copied)"
                ));
            }
        }
    }
    Ok(())
}
