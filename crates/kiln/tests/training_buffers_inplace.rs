//! A compiled training step writes batch norm's running statistics (and its step counter) straight
//! into the module's buffers: AOT autograd's forward graph keeps the traced graph's in-place writes,
//! so the kiln backend writes those outputs into their inputs' storage instead of the caller
//! copying each new value over the old one after the call (one copy launch per buffer on a GPU:
//! 363 a DenseNet-121 step). The buffers' values match eager execution's.

use kiln::inductor::exec_stats;
use kiln::nn::{BatchNorm2d, Module};
use kiln::prelude::*;

fn state(m: &dyn Module) -> Vec<(String, Vec<f64>)> {
    m.state_dict()
        .iter()
        .map(|(k, t)| (k.to_string(), t.to_vec_f64().unwrap()))
        .collect()
}

#[test]
fn batch_norm_buffers_are_updated_in_place_by_the_compiled_forward() -> Result<()> {
    if kiln::inductor::runtime::cc::toolchain().is_none() {
        eprintln!("SKIPPED: no C compiler; the kiln backend runs the interpreter");
        return Ok(());
    }
    const C: usize = 6;
    let (eager, compiled_bn) = (BatchNorm2d::new(C)?, BatchNorm2d::new(C)?);
    eager.train(true);
    compiled_bn.train(true);
    let compiled = kiln::compile(&compiled_bn, CompileOptions::default())?;
    assert_eq!(
        compiled_bn.buffers().len(),
        3,
        "running mean, running variance, step count"
    );
    let buffer_bytes = (2 * C * 4 + 8) as u64;
    for call in 0..3 {
        let x = Tensor::randn(&[4, C, 3, 5], DType::F32)?.with_grad()?;
        eager.forward(&x)?.sum(&[], false)?.backward()?;
        let before = exec_stats();
        compiled.forward(&x)?.sum(&[], false)?.backward()?;
        let after = exec_stats();
        let inplace = after.inplace_bytes - before.inplace_bytes;
        assert!(
            inplace >= buffer_bytes,
            "call {call}: {inplace} bytes written in place, the buffers are {buffer_bytes}"
        );
        for ((k, c), (_, e)) in state(&compiled_bn).iter().zip(state(&eager)) {
            for (i, (p, q)) in c.iter().zip(&e).enumerate() {
                assert!(
                    (p - q).abs() <= 1e-5 * (1.0 + q.abs()),
                    "call {call}: {k}[{i}]: compiled {p} vs eager {q}"
                );
            }
        }
    }
    Ok(())
}
