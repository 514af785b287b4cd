//! Training a small CNN on the UCI digits, eager vs `kiln::compile`d model: step time, the first
//! (compiling) step, and held-out accuracy. The loop is the examples' own
//! (`crates/kiln/examples/common/train.rs`), included by path so the two cannot drift apart; it
//! compiles with the default options, whatever `--mode` says.

use kiln::inductor::with_fresh_cache;

use super::BenchResult;
use crate::harness::{spinner, Ctx};

#[allow(dead_code)]
#[path = "../../../kiln/examples/common/train.rs"]
mod train;

const W: &str = "train_digits";

pub fn run(ctx: &mut Ctx) -> BenchResult {
    let epochs = if ctx.quick { 3 } else { 30 };
    let seed = 0;
    if ctx.mode != kiln::Mode::Default {
        eprintln!("kiln-bench: train_digits compiles in the default mode (--mode is not applied)");
    }
    for (variant, compile) in [("eager", false), ("compiled_default", true)] {
        let pb = spinner(format!("train_digits: {variant}, {epochs} epochs"));
        // a fresh kernel cache, so the first compiled step is a cold compile
        let run = with_fresh_cache(|| train::train(compile, epochs, seed, false));
        pb.finish_and_clear();
        let run = run?;
        let steps = run.step_losses.len();
        let rest = run.train_time.saturating_sub(run.first_step);
        let step_ms = rest.as_secs_f64() * 1e3 / (steps.saturating_sub(1).max(1)) as f64;
        ctx.emit(W, variant, "train_step", step_ms, "ms");
        ctx.emit(W, variant, "first_step", run.first_step.as_secs_f64(), "s");
        ctx.emit(W, variant, "train_time", run.train_time.as_secs_f64(), "s");
        ctx.emit(W, variant, "test_accuracy", run.test_accuracy, "fraction");
        let last = run.step_losses.last().copied().unwrap_or(f32::NAN);
        ctx.emit(W, variant, "final_loss", last as f64, "nats");
    }
    ctx.emit(W, "epochs", "count", epochs as f64, "epochs");
    Ok(())
}
