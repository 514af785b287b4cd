//! kiln's main demo: the same model trained eagerly and compiled (`kiln::compile`), on the CPU.
//! Both runs start from the same seed; the compiled one must match eager step for step.
//!
//!     cargo run --release --example quickstart

#[path = "common/train.rs"]
mod train;

fn main() -> kiln::Result<()> {
    let epochs = 15;
    println!("kiln quickstart: a small CNN on handwritten digits, {epochs} epochs, CPU\n");
    let eager = train::train(false, epochs, 0, false)?;
    let compiled = train::train(true, epochs, 0, false)?;
    let max_rel = eager
        .step_losses
        .iter()
        .zip(&compiled.step_losses)
        .map(|(a, b)| ((a - b).abs() / a.abs().max(1e-12)) as f64)
        .fold(0.0, f64::max);
    for (name, r) in [("eager", &eager), ("compiled", &compiled)] {
        println!(
            "{name:>9}: final loss {:.4}  test accuracy {:.3}  first step {:6.1} ms  total {:.2} s",
            r.step_losses.last().copied().unwrap_or(f32::NAN),
            r.test_accuracy,
            r.first_step.as_secs_f64() * 1e3,
            r.train_time.as_secs_f64()
        );
    }
    println!("\nlargest per-step loss difference, compiled vs eager: {max_rel:.2e} (relative)");
    println!(
        "backend: kiln (captured forward and AOT-derived backward graphs as fused C/OpenMP kernels; \
         small matmuls generated inline, larger ones and conv on the core kernels). First step \
         includes tracing and compiling; kernels are \
         cached under KILN_CACHE_DIR (default ~/.cache/kiln), so the next run starts warm."
    );
    Ok(())
}
