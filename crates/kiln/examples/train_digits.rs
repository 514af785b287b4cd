//! Trains a small CNN on the UCI handwritten digits (first 80% of rows), reports accuracy on the
//! held-out last 20%. `--compile` runs the model through `kiln::compile`.
//!
//!     cargo run --release --example train_digits [-- --compile] [--epochs N] [--seed S]

#[path = "common/train.rs"]
mod train;

fn main() -> kiln::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| args.iter().position(|a| a == name);
    let value = |name: &str, default: u64| -> u64 {
        flag(name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let compile = flag("--compile").is_some();
    let epochs = value("--epochs", 30) as usize;
    let seed = value("--seed", 0);
    println!(
        "training DigitsCnn on digits, {} mode, {epochs} epochs, seed {seed}",
        if compile { "compiled" } else { "eager" }
    );
    let run = train::train(compile, epochs, seed, true)?;
    println!(
        "first_step={:.1}ms train_time={:.2}s",
        run.first_step.as_secs_f64() * 1e3,
        run.train_time.as_secs_f64()
    );
    println!("test_accuracy={:.3}", run.test_accuracy);
    Ok(())
}
