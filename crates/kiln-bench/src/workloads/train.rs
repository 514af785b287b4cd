//! torch_baseline.py's `train_resnet18` and `train_densenet121` (`train_step_bench`): one training
//! step — `zero_grad`, forward, cross-entropy, backward, Adam(lr 1e-4, weight_decay 0.005) — on a
//! batch of 64 random 3×224×224 images with random labels, the model in train mode. torch builds
//! both models with `num_classes=10`; so does this, so that the rows pair with torch's.
//!
//! Compiled variant: the model is `kiln::compile`d and the optimizer step stays eager (foreach, as
//! torch's default Adam on CUDA), exactly what torch_baseline.py times: `torch.compile(m)` with
//! `opt.step()` outside it.
//!
//! Rows: `eager` and the mode's `train_step`; `cold_compile` (the first compiled step, fresh
//! kernel cache); `loss_max_abs_diff_vs_eager` (the losses of the first steps, compiled vs eager,
//! from the same seed, weights and batch; the first and last of those losses are rows too);
//! graph breaks; on a GPU, for ResNet-18, the cold and warm compiles in new processes
//! (`compile_child`; DenseNet-121's is the long compile — torch takes 115 s — and two more of it
//! per mode would crowd a 10-minute device call).
//!
//! On the CPU with `--quick` the batch is 2 × 3×32×32 (`train_*_bs2_32`), so a smoke test takes
//! seconds rather than minutes.

use std::sync::Mutex;

use kiln::inductor::with_fresh_cache;
use kiln::models::densenet::densenet121;
use kiln::models::resnet::resnet18;
use kiln::nn::optim::{Adam, AdamConfig, Optimizer};
use kiln::nn::Module;
use kiln::{DType, Device, Mode, Reduction, Tensor};

use super::BenchResult;
use crate::compile_child::{emit_new_process_compiles, measure, Measured};
use crate::harness::{once, Ctx};

/// torch_baseline.py's `train_step_bench` builds both models with 10 classes.
const CLASSES: usize = 10;
const MODEL_SEED: u64 = 0;
const DATA_SEED: u64 = 1;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Arch {
    ResNet18,
    DenseNet121,
}

impl Arch {
    fn name(self) -> &'static str {
        match self {
            Arch::ResNet18 => "resnet18",
            Arch::DenseNet121 => "densenet121",
        }
    }
    fn parse(s: &str) -> Option<Arch> {
        [Arch::ResNet18, Arch::DenseNet121]
            .into_iter()
            .find(|a| a.name() == s)
    }
}

/// (batch, resolution): torch's 64 × 224², or 2 × 32² on the CPU under `--quick`.
fn shape(dev: Device, quick: bool) -> (usize, usize) {
    match dev == Device::Cpu && quick {
        true => (2, 32),
        false => (64, 224),
    }
}

/// Steps whose losses are compared, compiled vs eager.
fn loss_steps(quick: bool) -> usize {
    if quick {
        3
    } else {
        5
    }
}

/// The batch: seeded normal images and labels in `[0, CLASSES)`, on `dev`.
fn batch(batch: usize, res: usize, dev: Device) -> kiln::Result<(Tensor, Tensor)> {
    kiln::manual_seed(DATA_SEED);
    let x = Tensor::randn(&[batch, 3, res, res], DType::F32)?;
    let y = Tensor::uniform(&[batch], 0.0, CLASSES as f64, DType::F32)?
        .floor()?
        .clamp(Some(0.0), Some((CLASSES - 1) as f64))?
        .to_dtype(DType::I64)?;
    Ok((x.to(dev)?, y.to(dev)?))
}

/// torch_baseline.py's optimizer; foreach, as torch's default on CUDA.
const ADAM: AdamConfig = AdamConfig {
    lr: 1e-4,
    betas: (0.9, 0.999),
    eps: 1e-8,
    weight_decay: 0.005,
    amsgrad: false,
    maximize: false,
    foreach: true,
};

fn adam(params: Vec<Tensor>) -> kiln::Result<Adam> {
    Adam::new(params, ADAM)
}

/// torch_baseline.py's `step`: the loss is returned unread (reading it would wait for the device).
fn step(model: &dyn Module, opt: &mut Adam, x: &Tensor, y: &Tensor) -> kiln::Result<Tensor> {
    opt.zero_grad();
    let loss = model
        .forward(x)?
        .cross_entropy(y, None, 0.0, Reduction::Mean)?;
    loss.backward()?;
    opt.step()?;
    Ok(loss)
}

/// A model from `MODEL_SEED` in train mode on `dev` (the same weights at every call).
fn fresh<M: Module>(build: &dyn Fn() -> kiln::Result<M>, dev: Device) -> kiln::Result<M> {
    kiln::manual_seed(MODEL_SEED);
    let mut m = build()?;
    m.train(true);
    if dev != Device::Cpu {
        m.to(dev)?;
    }
    Ok(m)
}

pub fn run(ctx: &mut Ctx, arch: Arch) -> BenchResult {
    match arch {
        Arch::ResNet18 => run_with(ctx, arch, &|| resnet18(CLASSES)),
        Arch::DenseNet121 => run_with(ctx, arch, &|| densenet121(CLASSES)),
    }
}

fn run_with<M: Module>(
    ctx: &mut Ctx,
    arch: Arch,
    build: &dyn Fn() -> kiln::Result<M>,
) -> BenchResult {
    let dev = ctx.dev;
    let (bs, res) = shape(dev, ctx.quick);
    let w = format!("train_{}_bs{bs}_{res}", arch.name());
    let w = w.as_str();
    let (x, y) = batch(bs, res, dev)?;
    let n = loss_steps(ctx.quick);
    let timer = ctx.timer();

    let mut eager_losses = Vec::with_capacity(n);
    {
        let model = fresh(build, dev)?;
        let mut opt = adam(model.parameters())?;
        for _ in 0..n {
            eager_losses.push(step(&model, &mut opt, &x, &y)?.item::<f32>()?);
        }
        let t = timer.time(&format!("{w}: eager step"), || {
            step(&model, &mut opt, &x, &y)
        })?;
        ctx.emit(w, "eager", "train_step", t.ms(), "ms");
        ctx.profile(&format!("{w} eager step"), || {
            step(&model, &mut opt, &x, &y)
        })?;
    }
    if ctx.eager_only {
        return Ok(());
    }

    let variant = ctx.mode_name();
    // `KILN_BENCH_PROFILE_COMPILE=0` leaves the cold compile unprofiled (the steps still are)
    let profile_compile = std::env::var("KILN_BENCH_PROFILE_COMPILE").map_or(true, |v| v != "0");
    if std::env::var_os("KILN_BENCH_PROFILE").is_some() && profile_compile {
        // where a cold compile's time goes (the `compile` rows), first-use costs of the process
        // included: a fresh model compiled in a fresh cache, its first step profiled. It runs
        // before the timed cold compile, which under KILN_BENCH_PROFILE is the process's second
        let model = fresh(build, dev)?;
        let compiled = kiln::compile(&model, ctx.opts())?;
        let mut opt = adam(model.parameters())?;
        let (nvrtc0, load0) = kiln::cuda::kernel_compile_times();
        let builds0 = kiln::cuda::kernel_cache_stats().0;
        with_fresh_cache(|| {
            ctx.profile(&format!("{w} cold compile ({variant})"), || {
                step(&compiled, &mut opt, &x, &y)
            })
        })?;
        let (nvrtc, load) = kiln::cuda::kernel_compile_times();
        eprintln!(
            "cold compile: {} NVRTC builds, NVRTC {:.3} s and module loads {:.3} s summed over \
             threads",
            kiln::cuda::kernel_cache_stats().0 - builds0,
            (nvrtc - nvrtc0).as_secs_f64(),
            (load - load0).as_secs_f64()
        );
    }
    {
        let model = fresh(build, dev)?;
        let compiled = kiln::compile(&model, ctx.opts())?;
        let mut opt = adam(model.parameters())?;
        let (first, _) = with_fresh_cache(|| {
            once(&format!("{w}: cold compile ({variant})"), || {
                measure(dev, || step(&compiled, &mut opt, &x, &y))
            })
        });
        let (loss, cold) = first?;
        ctx.emit(w, variant, "cold_compile", cold.secs, "s");
        if ctx.on_gpu() {
            emit_conv_engine(ctx, w, variant);
        }
        let mut losses = vec![loss.item::<f32>()?];
        for _ in 1..n {
            losses.push(step(&compiled, &mut opt, &x, &y)?.item::<f32>()?);
        }
        let diff = losses
            .iter()
            .zip(&eager_losses)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64));
        ctx.emit(w, variant, "loss_max_abs_diff_vs_eager", diff, "abs");
        // the losses themselves: a difference of 0 only means something if they moved
        for (v, ls) in [("eager", &eager_losses), (variant, &losses)] {
            let (first, last) = (ls[0], ls[ls.len() - 1]);
            ctx.emit(w, v, "first_loss", first as f64, "nats");
            ctx.emit(w, v, &format!("loss_after_{n}_steps"), last as f64, "nats");
        }
        let t = timer.time(&format!("{w}: {variant} step"), || {
            step(&compiled, &mut opt, &x, &y)
        })?;
        ctx.emit(w, variant, "train_step", t.ms(), "ms");
        ctx.profile(&format!("{w} {variant} step"), || {
            step(&compiled, &mut opt, &x, &y)
        })?;
        ctx.cuda_range(w, || step(&compiled, &mut opt, &x, &y))?;
        let st = compiled.stats();
        ctx.emit(w, variant, "graph_breaks", st.graph_breaks as f64, "count");
    }
    run_compiled_optimizer(ctx, w, build, &x, &y, &eager_losses)?;
    // DenseNet-121's compile is the long one: two more of it per mode would crowd a device call
    if ctx.on_gpu() && arch == Arch::ResNet18 {
        // the children need the device's memory more than this process's cache does
        kiln::cuda::empty_cache(dev)?;
        emit_new_process_compiles(ctx, w, variant, &format!("train:{}", arch.name()), &[])?;
    }
    Ok(())
}

/// The step as kiln would have it written: the model compiled and the optimizer step too
/// (`compile_fn` over `opt.step()`, PyTorch's compiled-optimizer recipe), with the for-loop Adam,
/// whose per-parameter updates the compiler fuses horizontally into a few multi-tensor kernels.
/// torch_baseline.py has no such row (its optimizer step stays eager), so its variant,
/// `<mode>_compiled_optimizer`, pairs with nothing of torch's: compare it with torch's `default`.
fn run_compiled_optimizer<M: Module>(
    ctx: &mut Ctx,
    w: &str,
    build: &dyn Fn() -> kiln::Result<M>,
    x: &Tensor,
    y: &Tensor,
    eager_losses: &[f32],
) -> BenchResult {
    let variant = format!("{}_compiled_optimizer", ctx.mode_name());
    let model = fresh(build, ctx.dev)?;
    let compiled = kiln::compile(&model, ctx.opts())?;
    let opt = Mutex::new(Adam::new(
        model.parameters(),
        AdamConfig {
            foreach: false,
            ..ADAM
        },
    )?);
    let opt_step = kiln::compile_fn(
        |_: &[Tensor]| {
            opt.lock().unwrap_or_else(|e| e.into_inner()).step()?;
            Ok(vec![])
        },
        ctx.opts(),
    )?;
    // the optimizer step's own host time (to the call's return: on the first call its tracing,
    // planning, NVRTC and module loads) and the NVRTC builds it made go to `timed`; under
    // KILN_BENCH_PROFILE, `measure`'s profile shows its spans among the model's
    let opt_cold = std::cell::Cell::new((0.0, 0u64));
    let run = |timed: Option<&std::cell::Cell<(f64, u64)>>| -> kiln::Result<Tensor> {
        opt.lock().unwrap_or_else(|e| e.into_inner()).zero_grad();
        let loss = compiled
            .forward(x)?
            .cross_entropy(y, None, 0.0, Reduction::Mean)?;
        loss.backward()?;
        match timed {
            None => opt_step.call(&[])?,
            Some(timed) => {
                let builds = kiln::cuda::kernel_cache_stats().0;
                let t = std::time::Instant::now();
                let out = opt_step.call(&[])?;
                let built = kiln::cuda::kernel_cache_stats().0 - builds;
                timed.set((t.elapsed().as_secs_f64(), built));
                out
            }
        };
        Ok(loss)
    };
    let one = || run(None);
    let (first, _) = with_fresh_cache(|| {
        once(&format!("{w}: cold compile ({variant})"), || {
            measure(ctx.dev, || run(Some(&opt_cold)))
        })
    });
    let (loss, cold) = first?;
    ctx.emit(w, &variant, "cold_compile", cold.secs, "s");
    let (opt_secs, opt_builds) = opt_cold.get();
    ctx.emit(w, &variant, "optimizer_cold_compile", opt_secs, "s");
    if ctx.on_gpu() {
        ctx.emit(
            w,
            &variant,
            "optimizer_nvrtc_builds",
            opt_builds as f64,
            "count",
        );
    }
    let mut losses = vec![loss.item::<f32>()?];
    for _ in 1..eager_losses.len() {
        losses.push(one()?.item::<f32>()?);
    }
    let diff = losses
        .iter()
        .zip(eager_losses)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64));
    ctx.emit(w, &variant, "loss_max_abs_diff_vs_eager", diff, "abs");
    let t = ctx.timer().time(&format!("{w}: {variant} step"), one)?;
    ctx.emit(w, &variant, "train_step", t.ms(), "ms");
    ctx.emit(
        w,
        &variant,
        "optimizer_compiles",
        opt_step.stats().compiles as f64,
        "count",
    );
    ctx.cuda_range(w, one)?;
    Ok(())
}

/// `compile_child`'s side for `train:ARCH`: model and batch as `run` builds them, one eager step,
/// then the compile and first compiled step measured.
pub fn compile_once(arch: &str, dev: Device, mode: Mode, quick: bool) -> BenchResult<Measured> {
    let arch = Arch::parse(arch).ok_or_else(|| format!("train: no model {arch:?}"))?;
    match arch {
        Arch::ResNet18 => compile_once_with(dev, mode, quick, &|| resnet18(CLASSES)),
        Arch::DenseNet121 => compile_once_with(dev, mode, quick, &|| densenet121(CLASSES)),
    }
}

fn compile_once_with<M: Module>(
    dev: Device,
    mode: Mode,
    quick: bool,
    build: &dyn Fn() -> kiln::Result<M>,
) -> BenchResult<Measured> {
    let (bs, res) = shape(dev, quick);
    let (x, y) = batch(bs, res, dev)?;
    let model = fresh(build, dev)?;
    let mut opt = adam(model.parameters())?;
    step(&model, &mut opt, &x, &y)?;
    kiln::core::device::synchronize(dev)?;
    let opts = kiln::CompileOptions::default().mode(mode);
    let (_, m) = measure(dev, || {
        let c = kiln::compile(&model, opts)?;
        step(&c, &mut opt, &x, &y)
    })?;
    Ok(m)
}

/// The convolution engine the compile chose (`kiln::cuda::function_choices`): the functions on
/// kiln's generated kernels so far, and the last timed choice's milliseconds over its
/// convolutions on each engine.
fn emit_conv_engine(ctx: &mut Ctx, w: &str, variant: &str) {
    let (_, generated, _) = kiln::cuda::function_choices();
    ctx.emit(
        w,
        variant,
        "conv_functions_generated",
        generated as f64,
        "count",
    );
    if let Some((n, cudnn, kiln_ms)) = kiln::cuda::last_function_timing() {
        ctx.emit(w, variant, "conv_choice_distinct", n as f64, "count");
        ctx.emit(w, variant, "conv_choice_cudnn", cudnn, "ms");
        ctx.emit(w, variant, "conv_choice_generated", kiln_ms, "ms");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Module::to` checks, before copying anything, that the mutable visitors reach every tensor
    /// the visitors list: what `--device cuda` relies on. Moving to the CPU runs the same check.
    #[test]
    fn the_models_can_move_between_devices() {
        for arch in [Arch::ResNet18, Arch::DenseNet121] {
            let before = match arch {
                Arch::ResNet18 => fresh(&|| resnet18(CLASSES), Device::Cpu).map(|mut m| {
                    let n = m.parameters().len();
                    m.to(Device::Cpu).map(|_| (n, m.parameters().len()))
                }),
                Arch::DenseNet121 => fresh(&|| densenet121(CLASSES), Device::Cpu).map(|mut m| {
                    let n = m.parameters().len();
                    m.to(Device::Cpu).map(|_| (n, m.parameters().len()))
                }),
            };
            let (n, after) = before.unwrap().unwrap();
            assert!(
                n > 0 && n == after,
                "{arch:?}: {n} parameters before, {after} after"
            );
        }
    }

    #[test]
    fn labels_are_classes() {
        let (x, y) = batch(64, 8, Device::Cpu).unwrap();
        assert_eq!(x.shape(), &[64, 3, 8, 8]);
        let y = y.to_vec::<i64>().unwrap();
        assert!(y.iter().all(|&c| (0..CLASSES as i64).contains(&c)), "{y:?}");
        // 64 uniform draws over 10 classes miss more than two with negligible odds; a constant
        // or a floor that always truncates to 0 would show one class
        let seen: std::collections::HashSet<_> = y.iter().collect();
        assert!(seen.len() >= 8, "{seen:?}");
    }
}
