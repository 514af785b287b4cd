//! torch_baseline.py's `regional`: 64 × Layer(Linear 10→10, ReLU, sigmoid, Linear, ReLU) after one
//! Linear. Cold compile of the whole model vs regional compilation (each block compiled; identical
//! blocks share one compiled graph), warm-disk-cache compiles (in this process after forgetting the
//! loaded kernels, and in a genuinely new process), and call latency eager vs compiled. With
//! `--device cuda`: the same rows on the GPU (compile times from fresh child processes, see
//! `run_gpu`) plus reduce-overhead and the kernel launches per compiled call.

use std::process::Command;
use std::time::Duration;

use kiln::inductor::{forget_loaded_kernels, kernel_cache_stats, with_fresh_cache};
use kiln::nn::{Linear, Module, ReLU, TrainFlag};
use kiln::{no_grad, CompiledModule, DType, Device, Mode, Tensor};

use super::BenchResult;
use crate::harness::{once, Ctx};

const W: &str = "regional";
const DEPTH: usize = 64;

/// torch_baseline.py's `Layer`.
pub struct Layer {
    linear1: Linear,
    relu1: ReLU,
    linear2: Linear,
    relu2: ReLU,
    training: TrainFlag,
}

impl Layer {
    pub fn new() -> kiln::Result<Layer> {
        Ok(Layer {
            linear1: Linear::new(10, 10, true)?,
            relu1: ReLU::new(),
            linear2: Linear::new(10, 10, true)?,
            relu2: ReLU::new(),
            training: TrainFlag::default(),
        })
    }
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        let a = self.relu1.forward(&self.linear1.forward(x)?)?;
        let a = a.sigmoid()?;
        self.relu2.forward(&self.linear2.forward(&a)?)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("linear1".into(), &self.linear1 as &dyn Module),
            ("relu1".into(), &self.relu1),
            ("linear2".into(), &self.linear2),
            ("relu2".into(), &self.relu2),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("linear1".into(), &mut self.linear1 as &mut dyn Module),
            ("relu1".into(), &mut self.relu1),
            ("linear2".into(), &mut self.linear2),
            ("relu2".into(), &mut self.relu2),
        ]
    }
}

/// torch_baseline.py's `Model`: one Linear, then 64 blocks — plain `Layer`s, or (regional) each
/// block wrapped by `kiln::compile`.
pub struct Model<L: Module> {
    linear: Linear,
    layers: Vec<L>,
    training: TrainFlag,
}

impl<L: Module> Model<L> {
    fn with_layers(layers: Vec<L>) -> kiln::Result<Self> {
        Ok(Model {
            linear: Linear::new(10, 10, true)?,
            layers,
            training: TrainFlag::default(),
        })
    }
}

impl Model<Layer> {
    pub fn new() -> kiln::Result<Self> {
        let layers = (0..DEPTH)
            .map(|_| Layer::new())
            .collect::<kiln::Result<_>>()?;
        Model::with_layers(layers)
    }
}

impl<L: Module> Module for Model<L> {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        let mut x = self.linear.forward(x)?;
        for layer in &self.layers {
            x = layer.forward(&x)?;
        }
        Ok(x)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = vec![("linear".into(), &self.linear)];
        for (i, l) in self.layers.iter().enumerate() {
            c.push((format!("layers.{i}"), l as &dyn Module));
        }
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c: Vec<(String, &mut dyn Module)> = vec![("linear".into(), &mut self.linear)];
        for (i, l) in self.layers.iter_mut().enumerate() {
            c.push((format!("layers.{i}"), l as &mut dyn Module));
        }
        c
    }
}

/// C compiler runs and disk-cache hits while `f` runs.
fn cc_delta<R>(f: impl FnOnce() -> R) -> (R, u64, u64) {
    let before = kernel_cache_stats();
    let r = f();
    let after = kernel_cache_stats();
    (
        r,
        after.compiles - before.compiles,
        after.disk_hits - before.disk_hits,
    )
}

/// How many times each cold compile is repeated (each in its own fresh cache; the median counts).
fn cold_reps(ctx: &Ctx) -> usize {
    if ctx.quick {
        1
    } else {
        3
    }
}

fn median(mut ts: Vec<Duration>) -> Duration {
    ts.sort();
    ts[ts.len() / 2]
}

/// Compile plus first call (with autograd on, as torch_baseline.py's `cold` calls the model),
/// timed, in a fresh kernel cache; the last compiled module stays usable afterwards.
fn cold<'m, M: Module>(
    ctx: &Ctx,
    msg: &str,
    m: &'m M,
    x: &Tensor,
) -> BenchResult<(CompiledModule<'m>, Duration, u64)> {
    let mut times = Vec::new();
    let mut last = None;
    let mut builds = 0;
    for _ in 0..cold_reps(ctx) {
        let opts = ctx.opts();
        let (r, b, _) = cc_delta(|| {
            with_fresh_cache(|| {
                once(msg, || -> kiln::Result<CompiledModule<'m>> {
                    let c = kiln::compile(m, opts)?;
                    std::hint::black_box(c.forward(x)?);
                    Ok(c)
                })
            })
        });
        times.push(r.1);
        last = Some(r.0?);
        builds = b;
    }
    let c = last.ok_or("no cold compile ran")?;
    Ok((c, median(times), builds))
}

pub fn run(ctx: &mut Ctx) -> BenchResult {
    if ctx.on_gpu() {
        return run_gpu(ctx);
    }
    kiln::manual_seed(0);
    let x = Tensor::randn(&[10, 10], DType::F32)?;
    let eager = Model::new()?;

    // cold: the whole model as one graph
    let (full, t, builds) = cold(ctx, "regional: cold compile, full model", &eager, &x)?;
    ctx.emit(
        W,
        &ctx.variant("full_model"),
        "cold_compile",
        t.as_secs_f64(),
        "s",
    );
    ctx.emit(
        W,
        &ctx.variant("full_model"),
        "cc_builds",
        builds as f64,
        "count",
    );

    // cold: regional — every block compiled separately; identical blocks share one graph
    let blocks: Vec<Layer> = (0..DEPTH)
        .map(|_| Layer::new())
        .collect::<kiln::Result<_>>()?;
    let compiled_blocks = blocks
        .iter()
        .map(|b| kiln::compile(b, ctx.opts()))
        .collect::<kiln::Result<Vec<_>>>()?;
    let regional = Model::with_layers(compiled_blocks)?;
    let (mut times, mut builds) = (Vec::new(), 0);
    for _ in 0..cold_reps(ctx) {
        let (r, b, _) = cc_delta(|| {
            with_fresh_cache(|| {
                once("regional: cold compile, regional model", || {
                    regional.forward(&x)
                })
            })
        });
        std::hint::black_box(r.0?);
        times.push(r.1);
        builds = b;
    }
    ctx.emit(
        W,
        &ctx.variant("regional"),
        "cold_compile",
        median(times).as_secs_f64(),
        "s",
    );
    ctx.emit(
        W,
        &ctx.variant("regional"),
        "cc_builds",
        builds as f64,
        "count",
    );

    // cold: one block alone (what regional compilation has to compile)
    let block = Layer::new()?;
    let block_x = Tensor::randn(&[10, 10], DType::F32)?;
    let (one, t, builds) = cold(ctx, "regional: cold compile, one block", &block, &block_x)?;
    drop(one);
    ctx.emit(
        W,
        &ctx.variant("regional_one_block"),
        "cold_compile",
        t.as_secs_f64(),
        "s",
    );
    ctx.emit(
        W,
        &ctx.variant("regional_one_block"),
        "cc_builds",
        builds as f64,
        "count",
    );

    // warm start, in this process: fill the disk cache, forget every loaded kernel and compiled
    // graph, then compile a new instance (torch_baseline.py's reset + recompile). The graphs
    // compiled inside the fresh-cache scopes above are still cached in memory, their kernels gone
    // from disk: forget them first, or the fill would be a graph-cache hit writing nothing to disk.
    forget_loaded_kernels();
    {
        let fill = kiln::compile(&eager, ctx.opts())?;
        once("regional: filling the disk cache", || fill.forward(&x)).0?;
    }
    forget_loaded_kernels();
    let again = Model::new()?;
    let (r, builds, hits) = cc_delta(|| {
        once("regional: warm compile (in process)", || {
            let c = kiln::compile(&again, ctx.opts())?;
            c.forward(&x)
        })
    });
    std::hint::black_box(r.0?);
    ctx.emit(
        W,
        &ctx.variant("full_model"),
        "warm_disk_cache_compile",
        r.1.as_secs_f64(),
        "s",
    );
    ctx.emit(
        W,
        &ctx.variant("full_model"),
        "warm_cc_builds",
        builds as f64,
        "count",
    );
    ctx.emit(
        W,
        &ctx.variant("full_model"),
        "warm_disk_hits",
        hits as f64,
        "count",
    );

    // warm start in a new process, against the same cache folder
    let child = warm_in_child(ctx.mode)?;
    ctx.emit(
        W,
        &ctx.variant("full_model_new_process"),
        "warm_disk_cache_compile",
        child.0,
        "s",
    );
    ctx.emit(
        W,
        &ctx.variant("full_model_new_process"),
        "warm_cc_builds",
        child.1,
        "count",
    );
    ctx.emit(
        W,
        &ctx.variant("full_model_new_process"),
        "warm_disk_hits",
        child.2,
        "count",
    );

    // steady-state call latency, under no_grad (the first calls recompile for the grad mode; the
    // timer's warm-up absorbs them)
    let timer = ctx.timer();
    no_grad(|| -> BenchResult {
        let t = timer.time("regional: eager call", || eager.forward(&x))?;
        ctx.emit(W, "eager", "call", t.us(), "us");
        let t = timer.time("regional: full_model call", || full.forward(&x))?;
        ctx.emit(W, &ctx.variant("full_model"), "call", t.us(), "us");
        let t = timer.time("regional: regional call", || regional.forward(&x))?;
        ctx.emit(W, &ctx.variant("regional"), "call", t.us(), "us");
        Ok(())
    })?;
    let st = full.stats();
    ctx.emit(
        W,
        &ctx.variant("full_model"),
        "compiles",
        st.compiles as f64,
        "count",
    );
    ctx.emit(
        W,
        &ctx.variant("full_model"),
        "graph_breaks",
        st.graph_breaks as f64,
        "count",
    );
    Ok(())
}

/// Runs this executable's hidden child subcommand; returns (seconds, cc builds, disk hits).
fn warm_in_child(mode: Mode) -> BenchResult<(f64, f64, f64)> {
    child("cpu", mode, "full", &kiln::inductor::cache_dir())
}

/// The child subcommand on `device` against cache folder `dir`, compiling the `what` model
/// (`full`, or `regional`: each block compiled); returns (seconds, cc builds, disk hits).
fn child(
    device: &str,
    mode: Mode,
    what: &str,
    dir: &std::path::Path,
) -> BenchResult<(f64, f64, f64)> {
    let pb = crate::harness::spinner(format!("regional: {what} compile (new process)"));
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        crate::WARM_CHILD,
        "--mode",
        mode.as_str(),
        "--device",
        device,
    ])
    .env("KILN_CACHE_DIR", dir)
    .env(WHAT_ENV, what);
    let v = crate::compile_child::child_result(crate::WARM_CHILD, cmd, pb)?;
    let num = |k: &str| v.get(k).and_then(|x| x.as_f64()).unwrap_or(f64::NAN);
    Ok((num("seconds"), num("cc_builds"), num("disk_hits")))
}

/// Which model the child compiles: `full` (the default) or `regional`.
const WHAT_ENV: &str = "KILN_BENCH_REGIONAL_WHAT";

/// The child's side: compile the model once (on `dev`), against the cache folder it was given,
/// and run it once (with autograd on, as `cold`), waiting for the device.
pub fn warm_child(mode: Mode, dev: Device) -> BenchResult {
    kiln::manual_seed(0);
    let x = Tensor::randn(&[10, 10], DType::F32)?.to(dev)?;
    let regional = std::env::var(WHAT_ENV).as_deref() == Ok("regional");
    let opts = kiln::CompileOptions::default().mode(mode);
    // `measure`: timed up to the device's completion, profiled under KILN_BENCH_PROFILE
    let ((), m) = crate::compile_child::measure(dev, || {
        if regional {
            let mut blocks: Vec<Layer> = (0..DEPTH)
                .map(|_| Layer::new())
                .collect::<kiln::Result<_>>()?;
            for b in &mut blocks {
                b.to(dev)?;
            }
            let compiled = blocks
                .iter()
                .map(|b| kiln::compile(b, opts.clone()))
                .collect::<kiln::Result<Vec<_>>>()?;
            let mut model = Model::with_layers(compiled)?;
            model.linear.to(dev)?;
            std::hint::black_box(model.forward(&x)?);
        } else {
            let mut model = Model::new()?;
            model.to(dev)?;
            let c = kiln::compile(&model, opts)?;
            std::hint::black_box(c.forward(&x)?);
        }
        Ok(())
    })?;
    println!(
        "{}",
        serde_json::json!({
            "seconds": m.secs,
            "cc_builds": m.cc_builds,
            "disk_hits": m.cc_disk_hits,
        })
    );
    Ok(())
}

/// The workload on a GPU. Compile times come from child processes: the CUDA runtime keeps the
/// kernels it built in memory for the process's life, so only a new process against an empty
/// cache folder compiles cold (NVRTC and the C compiler both), and a second one against the
/// same folder is the warm-disk-cache compile. Call latency as on the CPU, plus reduce-overhead
/// (the forward one replayed CUDA graph): torch_baseline.py's rows.
fn run_gpu(ctx: &mut Ctx) -> BenchResult {
    let dev = ctx.dev;
    let name = ctx.device.clone();
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let fresh = || {
        std::env::temp_dir().join(format!(
            "kiln-bench-regional-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ))
    };
    let reps = cold_reps(ctx);
    let mut warm_dir = None;
    for (mode, what, variant) in [
        (Mode::Default, "full", "full_model"),
        (Mode::Default, "regional", "regional"),
        (Mode::ReduceOverhead, "full", "full_model_reduce_overhead"),
    ] {
        let mut times = Vec::new();
        let mut builds = 0.0;
        for _ in 0..reps {
            let dir = fresh();
            let (t, b, _) = child(&name, mode, what, &dir)?;
            times.push(Duration::from_secs_f64(t));
            builds = b;
            match (
                warm_dir.is_none() && what == "full" && mode == Mode::Default,
                &dir,
            ) {
                (true, d) => warm_dir = Some(d.clone()),
                (false, d) => {
                    let _ = std::fs::remove_dir_all(d);
                }
            }
        }
        ctx.emit(W, variant, "cold_compile", median(times).as_secs_f64(), "s");
        ctx.emit(W, variant, "cc_builds", builds, "count");
    }
    if let Some(dir) = warm_dir {
        let (t, builds, hits) = child(&name, Mode::Default, "full", &dir)?;
        let _ = std::fs::remove_dir_all(&dir);
        ctx.emit(W, "full_model", "warm_disk_cache_compile", t, "s");
        ctx.emit(W, "full_model", "warm_cc_builds", builds, "count");
        ctx.emit(W, "full_model", "warm_disk_hits", hits, "count");
    }

    kiln::manual_seed(0);
    let x = Tensor::randn(&[10, 10], DType::F32)?.to(dev)?;
    let mut eager = Model::new()?;
    eager.to(dev)?;
    let full = kiln::compile(&eager, kiln::CompileOptions::default())?;
    let ro = kiln::compile(
        &eager,
        kiln::CompileOptions::default().mode(Mode::ReduceOverhead),
    )?;
    let mut blocks: Vec<Layer> = (0..DEPTH)
        .map(|_| Layer::new())
        .collect::<kiln::Result<_>>()?;
    for b in &mut blocks {
        b.to(dev)?;
    }
    let compiled_blocks = blocks
        .iter()
        .map(|b| kiln::compile(b, kiln::CompileOptions::default()))
        .collect::<kiln::Result<Vec<_>>>()?;
    let mut regional = Model::with_layers(compiled_blocks)?;
    regional.linear.to(dev)?;
    let timer = ctx.timer();
    no_grad(|| -> BenchResult {
        let t = timer.time("regional: eager call", || eager.forward(&x))?;
        ctx.emit(W, "eager", "call", t.us(), "us");
        let before = kiln::inductor::exec_stats();
        let t = timer.time("regional: full_model call", || full.forward(&x))?;
        let after = kiln::inductor::exec_stats();
        ctx.emit(W, "full_model", "call", t.us(), "us");
        let calls = (after.calls - before.calls).max(1);
        ctx.emit(
            W,
            "full_model",
            "kernel_launches_per_call",
            (after.kernel_launches - before.kernel_launches) as f64 / calls as f64,
            "count",
        );
        ctx.profile("regional full_model call", || full.forward(&x))?;
        if ctx.on_gpu() {
            // the host's share: batches of calls queued back to back without waiting (a call
            // is a launch, so a batch stays well inside the driver's queue; the device runs
            // behind), the device drained between batches; the median batch, since one batch
            // on a shared host can take several times another
            let (batches, n) = (7, 40);
            let mut per_call = Vec::with_capacity(batches);
            for _ in 0..batches {
                kiln::cuda::synchronize(dev)?;
                let t0 = std::time::Instant::now();
                for _ in 0..n {
                    std::hint::black_box(full.forward(&x)?);
                }
                per_call.push(t0.elapsed().as_secs_f64() * 1e6 / n as f64);
            }
            kiln::cuda::synchronize(dev)?;
            per_call.sort_by(f64::total_cmp);
            ctx.emit(W, "full_model", "host_call", per_call[batches / 2], "us");
        }
        let t = timer.time("regional: reduce-overhead call", || ro.forward(&x))?;
        ctx.emit(W, "full_model_reduce_overhead", "call", t.us(), "us");
        let t = timer.time("regional: regional call", || regional.forward(&x))?;
        ctx.emit(W, "regional", "call", t.us(), "us");
        Ok(())
    })?;
    let st = full.stats();
    ctx.emit(W, "full_model", "compiles", st.compiles as f64, "count");
    ctx.emit(
        W,
        "full_model",
        "graph_breaks",
        st.graph_breaks as f64,
        "count",
    );
    Ok(())
}
