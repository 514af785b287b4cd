//! `kiln::explain` and `KILN_LOGS=graph_code`: what compiling a function does, and what a graph
//! break is — kiln's answer to `torch._dynamo.explain(fn)(x)` and `TORCH_LOGS=graph_code`.
//!
//!     cargo run --release --example explain
//!
//! The function below has one data-dependent branch: Rust reads a value out of a traced tensor
//! (`.item()`) to decide what to compute next. The compiler cannot see past that read, so, as
//! TorchDynamo does, it ends the graph there (a *graph break*), runs it to get the value, lets the
//! Rust code take its branch, and starts a second graph after it.
//!
//! The example shows, in order:
//! 1. the `kiln::explain` report: graph count, break count and op count, each break's reason and
//!    source location (a line of this file), ops per graph, and the guards a compiled version
//!    would check before reusing its graphs;
//! 2. the function compiled (`kiln::compile_named`) and called twice on the same input with the `graph_code` log channel on: the
//!    first call prints each captured graph as it is compiled (torch.fx-style listing, one line per
//!    primitive op); the second prints nothing new, because both graphs come from the compile cache
//!    — only the Rust code between them runs again, as it must, to take the branch;
//! 3. a third call whose input takes the other branch: the first graph is reused, a new second graph
//!    is compiled.
//!
//! Log channels are read from `KILN_LOGS` once, at the first compile; this example sets it itself
//! and installs a `tracing` subscriber writing to stdout (an application's own subscriber takes
//! precedence over the stderr one kiln would install), switched on only for the compile section.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use kiln::prelude::*;

/// Whether `tracing` output (kiln's log channels) is printed right now.
static SHOW_LOGS: AtomicBool = AtomicBool::new(false);

/// `relu(x @ w) * 2` when the sum of `sin(x @ w)` is positive, else `sigmoid(..)`. The `.item()`
/// is the graph break.
fn branchy(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let h = x.matmul(w)?.sin()?;
    let total: f32 = h.sum_all()?.item()?; // <- graph break: Rust needs a value
    if total > 0.0 {
        h.relu()?.mul(2.0)
    } else {
        h.sigmoid()
    }
}

fn section(title: &str) {
    println!(
        "\n=== {title} {}",
        "=".repeat(72usize.saturating_sub(title.len()))
    );
}

fn main() -> kiln::Result<()> {
    // Enable the `graph_code` channel before the first kiln call that could read it (the channel
    // mask is read once), and print log records to stdout only while SHOW_LOGS is set.
    std::env::set_var("KILN_LOGS", "graph_code");
    let _ = tracing_subscriber::fmt()
        .with_writer(|| -> Box<dyn Write> {
            if SHOW_LOGS.load(Ordering::Relaxed) {
                Box::new(std::io::stdout())
            } else {
                Box::new(std::io::sink())
            }
        })
        .with_target(true)
        .with_level(false)
        .without_time()
        .try_init();

    kiln::manual_seed(0);
    let w = Tensor::randn(&[4, 3], DType::F32)?; // captured by the closure, like a parameter
    let x = Tensor::randn(&[2, 4], DType::F32)?;
    // a function of tensors, as `compile_fn` and `explain` take it
    let f = |args: &[Tensor]| Ok(vec![branchy(&args[0], &w)?]);
    // an input for which the branch goes the other way (sin is odd: sum(sin(-x@w)) = -sum(sin(x@w)))
    let x_other = x.neg()?;

    section("kiln::explain(f, [x])   (torch._dynamo.explain(f)(x))");
    let report = kiln::explain(f, std::slice::from_ref(&x))?;
    print!("{report}");
    let total: f32 = x.matmul(&w)?.sin()?.sum_all()?.item()?;
    let taken = if total > 0.0 {
        format!("sum = {total:.3} > 0, so `relu(h) * 2`")
    } else {
        format!(
            "sum = {total:.3} <= 0, so `sigmoid(h)`, which kiln decomposes as \
             0.5 * tanh(0.5 * h) + 0.5"
        )
    };
    println!(
        "\nReading the report:\n\
         - the break reason points at the `.item()` line in `branchy` (this file);\n\
         - graph 0 is `sin(x @ w)` and the sum that `.item()` reads; graph 1 is the branch taken \
         for this input\n  ({taken});\n\
         - the 2 captured tensors are `w` (a closure capture, guarded like a module parameter and \
         passed by\n  reference, never baked in as a constant) and `h`, the value graph 0 hands \
         to graph 1 across the break."
    );

    section("kiln::compile_named(\"branchy\", f) with KILN_LOGS=graph_code");
    let compiled = kiln::compile_named("branchy", f, CompileOptions::default())?;
    SHOW_LOGS.store(true, Ordering::Relaxed);
    for (call, input) in [(1, &x), (2, &x), (3, &x_other)] {
        let what = match call {
            1 => "first call: traces, compiles both graphs (each listing below is one graph)",
            2 => "second call, same input: both graphs come from the cache, no new code",
            _ => "third call, input taking the other branch: graph 0 reused, a new graph 1",
        };
        println!("\n--- call {call}: {what}");
        let before = kiln::cache_stats();
        let got = compiled.call(std::slice::from_ref(input))?.remove(0);
        let after = kiln::cache_stats();
        let eager = branchy(input, &w)?;
        let max_diff = got
            .to_vec::<f32>()?
            .iter()
            .zip(eager.to_vec::<f32>()?)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!(
            "--- call {call} done: {} graph(s) compiled, {} taken from the cache; \
             max |compiled - eager| = {max_diff:e}",
            after.backend_compiles - before.backend_compiles,
            after.cache_hits - before.cache_hits,
        );
    }
    SHOW_LOGS.store(false, Ordering::Relaxed);

    let s = compiled.stats();
    section("compiled function stats");
    println!(
        "traces: {}, graph breaks seen: {}, whole-call replays: {}",
        s.traces, s.graph_breaks, s.replays
    );
    println!(
        "A function with a graph break re-runs its Rust code on every call (the branch must be \
         decided\nfrom live values), and each graph segment is fetched from the compile cache by \
         structure.\nRemove the `.item()` (or compile with `.fullgraph(true)` to make the break \
         an error) to get one\ngraph replayed without running any Rust code."
    );
    Ok(())
}
