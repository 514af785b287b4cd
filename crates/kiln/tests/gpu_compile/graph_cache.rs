//! The compiled-graph cache on disk with CUDA plans (kiln-inductor's `plan_cache.rs`): a
//! training step compiled again as a new process would (in-memory caches forgotten) reads AOT
//! autograd's split and both graphs' plans back, stores nothing, and computes the same bits, in
//! the default mode and under reduce-overhead (whose CUDA graphs are recorded from the read
//! plan).

use kiln::compiler::disk_cache;
use kiln::nn::{BatchNorm2d, Conv2d, Conv2dConfig, Flatten, Linear, Module, ReLU, Sequential};
use kiln::prelude::*;

use super::{conv_switches, err, randn, Outcome, CUDA};

fn model() -> Result<Sequential> {
    let mut m = Sequential::new()
        .add(Conv2d::new(
            3,
            8,
            [3, 3],
            Conv2dConfig::default().padding(1),
        )?)
        .add(BatchNorm2d::new(8)?)
        .add(ReLU::new())
        .add(Flatten::new(1, -1))
        .add(Linear::new(8 * 8 * 8, 4, true)?);
    m.to(CUDA)?;
    m.train(true);
    Ok(m)
}

/// The output and every gradient of one step, as bits (the parameters start from one state).
fn step(
    m: &Sequential,
    mode: Mode,
    x: &Tensor,
    state: &kiln::nn::StateDict,
) -> Result<Vec<Vec<u64>>> {
    m.load_state_dict(state, true)?;
    m.zero_grad();
    let c = kiln::compile(m, CompileOptions::default().mode(mode))?;
    let out = c.forward(x)?;
    out.square()?.mean_all()?.backward()?;
    let mut all = vec![out];
    all.extend(m.parameters().iter().filter_map(|p| p.grad()));
    all.iter()
        .map(|t| Ok(t.to_vec_f64()?.iter().map(|v| v.to_bits()).collect()))
        .collect()
}

pub fn plans_read_back_from_disk() -> Outcome {
    if !disk_cache::enabled() {
        return Ok(());
    }
    // its two steps compare bit for bit: cuDNN's TF32 must not change between them
    let _switches = conv_switches();
    let m = model().map_err(err)?;
    let mut state = kiln::nn::StateDict::new();
    for (k, t) in m.state_dict().iter() {
        let c = Tensor::zeros_like(t).map_err(err)?;
        c.assign(t).map_err(err)?;
        state.insert(k, c);
    }
    let x = randn(&[4, 3, 8, 8], 5)
        .and_then(|x| x.to(CUDA))
        .map_err(err)?;
    kiln::inductor::with_fresh_cache(|| -> Outcome {
        for mode in [Mode::Default, Mode::ReduceOverhead] {
            kiln::reset();
            let s0 = disk_cache::stats();
            let first = step(&m, mode, &x, &state).map_err(err)?;
            let s1 = disk_cache::stats();
            kiln::reset();
            kiln::inductor::forget_loaded_kernels();
            let second = step(&m, mode, &x, &state).map_err(err)?;
            let s2 = disk_cache::stats();
            let cold = (s1.hits - s0.hits, s1.stores - s0.stores);
            let warm = (s2.hits - s1.hits, s2.stores - s1.stores);
            // neither the split nor a plan depends on the mode (reduce-overhead records CUDA
            // graphs of the same steps): the second mode finds all three already stored
            let want_cold = match mode {
                Mode::Default => (0, 3),
                _ => (3, 0),
            };
            if cold != want_cold || warm != (3, 0) {
                return Err(format!(
                    "{mode:?}: (hits, stores) cold {cold:?} (want {want_cold:?}), warm {warm:?} \
                     (want (3, 0))"
                ));
            }
            if first != second {
                return Err(format!(
                    "{mode:?}: the step from the cache computed other values"
                ));
            }
        }
        Ok(())
    })
}
