//! How long AOT autograd takes to build and partition DenseNet-121's joint graph (ignored: a
//! measurement, not a check). The training forward graph (8,764 nodes at [2, 3, 64, 64]) is
//! captured once on the CPU; then, each the best of 20 runs:
//!
//! - `AotBackend::compile` over a trivial inner backend (no joint rewrite; the interpreter for
//!   both halves, so one copy of each);
//! - `joint::build` followed by `partition::partition`: the "aot autograd: joint graph and
//!   partition" span of a warm start, less the inner backend's `prepare_joint`;
//! - each of the two alone.
//!
//! `cargo test --release -p kiln --test aot_timing -- --ignored --nocapture`
//!
//! `KILN_AOT_RUNS=<n>` times the best of `n` runs instead; `KILN_AOT_LOOPS=<n>` then compiles `n`
//! more times (something for `perf record` to sample); `KILN_AOT_DUMP=<dir>` writes the joint,
//! forward and backward graphs' listings and structure keys there, to compare the partition's
//! decisions before and after a change to it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln::compiler::aot::{joint, partition, AotBackend};
use kiln::compiler::backends::Interpreter;
use kiln::prelude::*;
use kiln::{Backend, BackendContext, CompiledGraph, Graph};

/// Keeps the graphs it is given and runs them with the interpreter.
struct Capture(Mutex<Vec<Graph>>);

impl Backend for Capture {
    fn name(&self) -> &str {
        "capture"
    }
    fn compile(&self, graph: &Graph, _ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(graph.clone());
        Ok(Arc::new(Interpreter::new(graph.clone())))
    }
}

/// Runs every graph it is given with the interpreter (what the timing's inner backend costs is
/// one copy of each half).
struct Trivial;

impl Backend for Trivial {
    fn name(&self) -> &str {
        "trivial"
    }
    fn compile(&self, graph: &Graph, _ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        Ok(Arc::new(Interpreter::new(graph.clone())))
    }
}

fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> Duration {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

#[test]
#[ignore = "a timing, not a check"]
fn densenet121_joint_graph_and_partition_time() -> Result<()> {
    manual_seed(0);
    let m = kiln::models::densenet::densenet121(10)?;
    m.train(true);
    let capture = Arc::new(Capture(Mutex::new(Vec::new())));
    let compiled = kiln::compile(
        &m,
        CompileOptions::default().custom_backend(capture.clone()),
    )?;
    let x = Tensor::randn(&[2, 3, 64, 64], DType::F32)?;
    compiled.forward(&x)?;
    let graph = capture.0.lock().unwrap_or_else(|e| e.into_inner())[0].clone();
    println!("forward graph: {} nodes", graph.nodes.len());

    let runs: usize = std::env::var("KILN_AOT_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20);
    let ctx = BackendContext::default();
    let aot = AotBackend::new("x", Arc::new(Trivial));
    let compile = best_of(runs, || aot.compile(&graph, &ctx).map(|_| ()));
    let build = best_of(runs, || joint::build(&graph));
    // both phases, as the "aot autograd: joint graph and partition" span runs them
    let both = best_of(runs, || -> Result<()> {
        let j = joint::build(&graph)?.expect("a training graph");
        partition::partition(j.graph, j.num_primals, j.num_fwd_outputs)?;
        Ok(())
    });
    let j = joint::build(&graph)?.expect("a training graph");
    println!("joint graph: {} nodes", j.graph.nodes.len());
    // the partition consumes the joint graph: one copy per run, made beforehand
    let mut copies: Vec<Graph> = (0..runs).map(|_| j.graph.clone()).collect();
    let part = best_of(runs, || {
        let g = copies.pop().unwrap_or_default();
        partition::partition(g, j.num_primals, j.num_fwd_outputs).map(|_| ())
    });
    println!(
        "best of {runs}: AotBackend::compile {:.2} ms, joint::build + partition {:.2} ms, \
         joint::build {:.2} ms, partition {:.2} ms",
        compile.as_secs_f64() * 1e3,
        both.as_secs_f64() * 1e3,
        build.as_secs_f64() * 1e3,
        part.as_secs_f64() * 1e3
    );

    if let Ok(n) = std::env::var("KILN_AOT_LOOPS") {
        for _ in 0..n.parse().unwrap_or(0) {
            std::hint::black_box(aot.compile(&graph, &ctx)?);
        }
    }
    if let Ok(dir) = std::env::var("KILN_AOT_DUMP") {
        let p = partition::partition(j.graph.clone(), j.num_primals, j.num_fwd_outputs)?;
        let dir = std::path::Path::new(&dir);
        let write = |name: &str, text: String| std::fs::write(dir.join(name), text);
        // structural keys are bytes: their hashes compare across builds
        let key = |g: &kiln::Graph| kiln::compiler::disk_cache::key(&[&g.structure_key()]);
        let io = |e: std::io::Error| kiln::Error::arg("aot_timing", e.to_string());
        write("joint.txt", j.graph.to_code("joint")).map_err(io)?;
        write("forward.txt", p.forward.to_code("forward")).map_err(io)?;
        write("backward.txt", p.backward.to_code("backward")).map_err(io)?;
        write(
            "keys.txt",
            format!(
                "{:032x}\n{:032x}\n{:032x}\nsaved {} bytes {}\n",
                key(&j.graph),
                key(&p.forward),
                key(&p.backward),
                p.num_saved,
                p.saved_bytes
            ),
        )
        .map_err(io)?;
    }
    Ok(())
}
