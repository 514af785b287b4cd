//! torch_baseline.py's `resnet18`: torchvision's ResNet-18 (random weights, 1000 classes), batch 16
//! of 3x224x224, inference in eval mode under no_grad: eager vs `kiln::compile`, plus the cold
//! compile (fresh kernel cache) and how far the compiled logits land from the eager ones.
//!
//! On a CUDA device (`--device cuda`) the model is moved there (`Module::to`) and run eagerly: each
//! timed call ends with a device synchronization, so the time is the device's, not the queueing's.
//! Rows: `eager` (PyTorch's defaults: cuDNN convolutions in TF32, matmuls in f32), `eager_f32`
//! (convolutions in f32 too, `set_cudnn_allow_tf32(false)`), `eager_cudnn_benchmark` (algorithms timed once per shape through
//! cuDNN's legacy API, rather than a graph-API plan from its heuristics), the largest difference from the CPU's logits, the host's time to queue one
//! forward, and each stage's device and host time.
//!
//! Compiled rows (any mode but `eager`) end with the cold and warm compiles in new processes
//! (`compile_child`: `cold_compile_new_process`, `warm_disk_cache_compile`).

use kiln::inductor::with_fresh_cache;
use kiln::models::resnet::resnet18;
use kiln::nn::Module;
use kiln::{no_grad, DType, Device, Tensor};

use super::BenchResult;
use crate::compile_child::{emit_new_process_compiles, measure, Measured};
use crate::harness::{once, Ctx};

const W: &str = "resnet18_bs16";

/// max |a - b| / max |b|.
fn max_rel_diff(a: &Tensor, b: &Tensor) -> kiln::Result<f64> {
    let (a, b) = (a.to_vec_f64()?, b.to_vec_f64()?);
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
    Ok(diff / scale)
}

pub fn run(ctx: &mut Ctx) -> BenchResult {
    kiln::manual_seed(0);
    let model = resnet18(1000)?;
    model.eval();
    let x = Tensor::randn(&[16, 3, 224, 224], DType::F32)?;
    if ctx.dev != Device::Cpu {
        return run_on_device(ctx, model, x);
    }
    let timer = ctx.timer();

    let (eager_t, eager_out) =
        timer.time_keep("resnet18: eager", || no_grad(|| model.forward(&x)))?;
    ctx.emit(W, "eager", "call", eager_t.ms(), "ms");
    if ctx.eager_only {
        return Ok(());
    }

    let compiled = kiln::compile(&model, ctx.opts())?;
    let (first, t) = with_fresh_cache(|| {
        once("resnet18: cold compile", || {
            no_grad(|| compiled.forward(&x))
        })
    });
    first?;
    let variant = ctx.mode_name();
    ctx.emit(W, variant, "cold_compile", t.as_secs_f64(), "s");
    let (t, out) = timer.time_keep("resnet18: compiled", || no_grad(|| compiled.forward(&x)))?;
    ctx.emit(W, variant, "call", t.ms(), "ms");
    ctx.profile(&format!("{W} {variant}"), || {
        no_grad(|| compiled.forward(&x))
    })?;

    // the same weights and input: a speedup only counts if the answer is the same
    ctx.emit(
        W,
        variant,
        "max_rel_diff_vs_eager",
        max_rel_diff(&out, &eager_out)?,
        "ratio",
    );
    emit_new_process_compiles(ctx, W, variant, "resnet18", &[])
}

/// `compile_child`'s side for `resnet18`: the model and input as `run` builds them, one eager
/// forward, then the compile and first compiled forward measured.
pub fn compile_once(dev: Device, mode: kiln::Mode) -> BenchResult<Measured> {
    kiln::manual_seed(0);
    let mut model = resnet18(1000)?;
    model.eval();
    let mut x = Tensor::randn(&[16, 3, 224, 224], DType::F32)?;
    if dev != Device::Cpu {
        model.to(dev)?;
        x = x.to(dev)?;
    }
    no_grad(|| model.forward(&x))?;
    kiln::core::device::synchronize(dev)?;
    let opts = kiln::CompileOptions::default().mode(mode);
    let (_, m) = measure(dev, || {
        let c = kiln::compile(&model, opts)?;
        no_grad(|| c.forward(&x))
    })?;
    Ok(m)
}

fn run_on_device(ctx: &mut Ctx, mut model: kiln::models::resnet::ResNet, x: Tensor) -> BenchResult {
    let device = ctx.dev;
    let reference = once("resnet18: CPU reference", || no_grad(|| model.forward(&x))).0?;
    model.to(device)?;
    let x = x.to(device)?;
    let timer = ctx.timer();
    if !ctx.eager_only {
        return compiled_on_device(ctx, &model, &x, &reference);
    }
    let call = || -> kiln::Result<Tensor> {
        let y = no_grad(|| model.forward(&x))?;
        kiln::cuda::synchronize(device)?;
        Ok(y)
    };
    let (t, out) = timer.time_keep("resnet18: eager (cuda)", call)?;
    ctx.emit(W, "eager", "call", t.ms(), "ms");
    ctx.emit(
        W,
        "eager",
        "max_rel_diff_vs_cpu",
        max_rel_diff(&out, &reference)?,
        "ratio",
    );
    // the rows above ran PyTorch's defaults (cuDNN convolutions in TF32); this one in full f32,
    // as `torch.backends.cudnn.allow_tf32 = False`
    kiln::cuda::set_cudnn_allow_tf32(false);
    let f32_only = timer.time_keep("resnet18: eager, convolutions in f32 (cuda)", call);
    kiln::cuda::set_cudnn_allow_tf32(true);
    let (t, out) = f32_only?;
    ctx.emit(W, "eager_f32", "call", t.ms(), "ms");
    ctx.emit(
        W,
        "eager_f32",
        "max_rel_diff_vs_cpu",
        max_rel_diff(&out, &reference)?,
        "ratio",
    );
    ctx.emit(
        W,
        "eager",
        "host_enqueue",
        host_enqueue_ms(&model, &x, device)?,
        "ms",
    );
    let (y, profile) = kiln::profile(|| no_grad(|| model.forward(&x)));
    y?;
    kiln::cuda::synchronize(device)?;
    eprintln!(
        "one eager forward on {device}, host time by prim:\n{}",
        profile.table(30)
    );
    breakdown(ctx, &model, &x)?;
    let (graph, legacy) = kiln::cuda::cudnn_plan_counts();
    eprintln!(
        "cuDNN plans: {graph} graph-API, {legacy} legacy-API{}",
        kiln::cuda::cudnn_graph_error()
            .map(|e| format!(" (first graph-API refusal: {e})"))
            .unwrap_or_default()
    );
    // algorithms timed once per shape through the legacy API (torch.backends.cudnn.benchmark);
    // last, so every row above ran the default path
    kiln::cuda::set_cudnn_benchmark(true);
    let benchmarked = timer.time_keep("resnet18: eager, cudnn benchmark (cuda)", call);
    let enqueue = host_enqueue_ms(&model, &x, device);
    kiln::cuda::set_cudnn_benchmark(false);
    ctx.emit(
        W,
        "eager_cudnn_benchmark",
        "call",
        benchmarked?.0.ms(),
        "ms",
    );
    ctx.emit(W, "eager_cudnn_benchmark", "host_enqueue", enqueue?, "ms");
    let stats = kiln::cuda::memory_stats(device)?;
    ctx.emit(
        W,
        "eager",
        "peak_allocated",
        stats.peak_allocated as f64 / (1 << 20) as f64,
        "MiB",
    );
    let fallbacks: u64 = kiln::cuda::host_fallbacks().iter().map(|(_, n)| n).sum();
    ctx.emit(W, "eager", "host_fallbacks", fallbacks as f64, "count");
    Ok(())
}

/// The model compiled in `ctx`'s mode on the device: eager and compiled forwards timed alike
/// (back-to-back calls, the device synchronized at the end of each timed run, as PyTorch's
/// `bench_ms` does), the cold compile, and the compiled output against the CPU's.
fn compiled_on_device(
    ctx: &mut Ctx,
    model: &kiln::models::resnet::ResNet,
    x: &Tensor,
    reference: &Tensor,
) -> BenchResult {
    let timer = ctx.timer();
    let t = timer.time("resnet18: eager (cuda)", || no_grad(|| model.forward(x)))?;
    ctx.emit(W, "eager", "call", t.ms(), "ms");
    let compiled = kiln::compile(model, ctx.opts())?;
    let (nvrtc0, load0) = kiln::cuda::kernel_compile_times();
    let (first, t) = with_fresh_cache(|| {
        once("resnet18: cold compile (cuda)", || {
            no_grad(|| compiled.forward(x))
        })
    });
    first?;
    let variant = ctx.mode_name();
    ctx.emit(W, variant, "cold_compile", t.as_secs_f64(), "s");
    // of which: NVRTC (summed over its parallel threads) and the driver loading the modules
    let (nvrtc, load) = kiln::cuda::kernel_compile_times();
    let nvrtc_s = (nvrtc - nvrtc0).as_secs_f64();
    ctx.emit(W, variant, "cold_compile_nvrtc_thread_time", nvrtc_s, "s");
    ctx.emit(
        W,
        variant,
        "cold_compile_module_load",
        (load - load0).as_secs_f64(),
        "s",
    );
    let (t, out) = timer.time_keep("resnet18: compiled (cuda)", || {
        no_grad(|| compiled.forward(x))
    })?;
    ctx.emit(W, variant, "call", t.ms(), "ms");
    ctx.cuda_range(W, || no_grad(|| compiled.forward(x)))?;
    ctx.emit(
        W,
        variant,
        "max_rel_diff_vs_cpu",
        max_rel_diff(&out, reference)?,
        "ratio",
    );
    emit_new_process_compiles(ctx, W, variant, "resnet18", &[])
}

/// Device time of `f` per call: events around `reps` back-to-back calls, after two warm-up calls.
fn device_ms(
    device: Device,
    reps: usize,
    f: impl Fn() -> kiln::Result<Tensor>,
) -> kiln::Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    let start = kiln::cuda::Event::record(device)?;
    for _ in 0..reps {
        f()?;
    }
    let end = kiln::cuda::Event::record(device)?;
    end.synchronize()?;
    kiln::cuda::synchronize(device)?;
    Ok(start.elapsed_ms(&end)? as f64 / reps as f64)
}

/// Where the device time of one forward goes, stage by stage (rows `stage_ms`, variant = stage).
fn breakdown(ctx: &mut Ctx, model: &kiln::models::resnet::ResNet, x: &Tensor) -> BenchResult {
    let device = ctx.dev;
    no_grad(|| -> BenchResult {
        let mut h = x.clone();
        let stages: [(&str, &dyn Module); 9] = [
            ("conv1", &model.conv1),
            ("bn1", &model.bn1),
            ("relu", &model.relu),
            ("maxpool", &model.maxpool),
            ("layer1", &model.layer1),
            ("layer2", &model.layer2),
            ("layer3", &model.layer3),
            ("layer4", &model.layer4),
            ("avgpool", &model.avgpool),
        ];
        for (name, stage) in stages {
            let input = h.clone();
            let ms = device_ms(device, 20, || stage.forward(&input))?;
            ctx.emit(W, &format!("stage_{name}"), "device_time", ms, "ms");
            // the host's time for the stage with the device idle (no queue to wait behind)
            kiln::cuda::synchronize(device)?;
            let t = std::time::Instant::now();
            let y = stage.forward(&input)?;
            let host = t.elapsed().as_secs_f64() * 1e3;
            kiln::cuda::synchronize(device)?;
            drop(y);
            ctx.emit(W, &format!("stage_{name}"), "host_time", host, "ms");
            h = stage.forward(&input)?;
        }
        let input = h.flatten(1, -1)?;
        let ms = device_ms(device, 20, || model.fc.forward(&input))?;
        ctx.emit(W, "stage_fc", "device_time", ms, "ms");
        Ok(())
    })
}

/// The host's share: the median time to queue one forward (the device idle when it starts).
fn host_enqueue_ms(
    model: &kiln::models::resnet::ResNet,
    x: &Tensor,
    device: Device,
) -> kiln::Result<f64> {
    let mut times = Vec::new();
    for _ in 0..9 {
        kiln::cuda::synchronize(device)?;
        let t = std::time::Instant::now();
        let y = no_grad(|| model.forward(x))?;
        times.push(t.elapsed());
        kiln::cuda::synchronize(device)?;
        drop(y);
    }
    times.sort();
    Ok(times[times.len() / 2].as_secs_f64() * 1e3)
}
