//! Trains ResNet-18 (default) or DenseNet-121 for a few steps on synthetic CIFAR-shaped data and
//! prints the loss and time of every step. The data is learnable: each class has a fixed random
//! image (its "mean pattern"), and a sample is its class's pattern plus as much Gaussian noise, so the
//! loss falls from ln(classes) within a few steps when the model, its gradients and the optimizer
//! are right.
//!
//!     cargo run --release --example train_cifar_like -- [--model resnet18|densenet121] [--compile]
//!         [--steps 20] [--batch 64] [--size 32] [--classes 10] [--lr 1e-3] [--optim adam|sgd]
//!         [--seed 0]
//!
//! `--compile` runs the model through `kiln::compile` (forward and backward as generated C); the
//! first step then includes tracing and compiling, and the later ones replay. `--size 224` gives
//! ImageNet-sized inputs.

use std::time::Instant;

use kiln::models::densenet::densenet121;
use kiln::models::resnet::resnet18;
use kiln::nn::optim::{Adam, AdamConfig, Optimizer, SGDConfig, SGD};
use kiln::prelude::*;

struct Args {
    model: String,
    compile: bool,
    steps: usize,
    batch: usize,
    size: usize,
    classes: usize,
    lr: f64,
    optim: String,
    seed: u64,
}

fn parse_args() -> std::result::Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut a = Args {
        model: "resnet18".into(),
        compile: false,
        steps: 20,
        batch: 64,
        size: 32,
        classes: 10,
        lr: 1e-3,
        optim: "adam".into(),
        seed: 0,
    };
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        if flag == "--compile" {
            a.compile = true;
            continue;
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .as_str();
        let num = |what: &str| -> std::result::Result<usize, String> {
            value
                .parse::<usize>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| format!("{what} must be a positive integer, got {value:?}"))
        };
        match flag.as_str() {
            "--model" => a.model = value.to_string(),
            "--steps" => a.steps = num("--steps")?,
            "--batch" => a.batch = num("--batch")?,
            "--size" => a.size = num("--size")?,
            "--classes" => a.classes = num("--classes")?,
            "--seed" => {
                a.seed = value
                    .parse()
                    .map_err(|_| format!("--seed must be a non-negative integer, got {value:?}"))?
            }
            "--optim" => a.optim = value.to_string(),
            "--lr" => {
                a.lr = value
                    .parse()
                    .ok()
                    .filter(|&v: &f64| v > 0.0)
                    .ok_or_else(|| format!("--lr must be a positive number, got {value:?}"))?
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

/// One fixed N(0, 1) image per class: what the model has to learn to tell apart.
fn class_patterns(classes: usize, size: usize, seed: u64) -> Result<Tensor> {
    let mut gen = kiln::Generator::new(seed);
    Tensor::randn_with(&[classes, 3, size, size], DType::F32, &mut gen)
}

/// A batch: labels from a SplitMix-style stream, images = 0.5 · pattern[label] + N(0, 1) noise.
fn synthetic_batch(
    patterns: &Tensor,
    batch: usize,
    step: u64,
    gen: &mut kiln::Generator,
) -> Result<(Tensor, Tensor)> {
    let classes = patterns.shape()[0] as u64;
    let labels: Vec<i64> = (0..batch as u64)
        .map(|i| {
            let mut z = (step << 32 | i).wrapping_mul(0x9e3779b97f4a7c15);
            z = (z ^ (z >> 31)).wrapping_mul(0xbf58476d1ce4e5b9);
            ((z ^ (z >> 29)) % classes) as i64
        })
        .collect();
    let picked = labels
        .iter()
        .map(|&c| patterns.select(0, c as isize))
        .collect::<Result<Vec<_>>>()?;
    let means = Tensor::stack(&picked.iter().collect::<Vec<_>>(), 0)?;
    let noise = Tensor::randn_with(means.shape(), DType::F32, gen)?;
    let x = means.mul(0.5)?.add(&noise)?;
    Ok((x, Tensor::from_vec(labels, &[batch])?))
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}\nusage: train_cifar_like [--model resnet18|densenet121] [--compile] [--steps N] [--batch N] [--size N] [--classes N] [--lr X] [--optim adam|sgd] [--seed N]");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(a: &Args) -> Result<()> {
    kiln::manual_seed(a.seed);
    let model: Box<dyn Module> = match a.model.as_str() {
        "resnet18" => Box::new(resnet18(a.classes)?),
        "densenet121" => Box::new(densenet121(a.classes)?),
        other => {
            return Err(kiln::Error::arg(
                "train_cifar_like",
                format!("--model must be resnet18 or densenet121, got {other:?}"),
            ))
        }
    };
    let params = model.parameters();
    let mut opt: Box<dyn Optimizer> = match a.optim.as_str() {
        "adam" => Box::new(Adam::new(
            params,
            AdamConfig {
                lr: a.lr,
                foreach: true,
                ..AdamConfig::default()
            },
        )?),
        "sgd" => Box::new(SGD::new(
            params,
            SGDConfig {
                lr: a.lr,
                momentum: 0.9,
                foreach: true,
                ..SGDConfig::default()
            },
        )?),
        other => {
            return Err(kiln::Error::arg(
                "train_cifar_like",
                format!("--optim must be adam or sgd, got {other:?}"),
            ))
        }
    };
    let compiled;
    let net: &dyn Module = if a.compile {
        compiled = kiln::compile(&model, CompileOptions::default())?;
        &compiled
    } else {
        &*model
    };
    println!(
        "{} ({} parameters), {} mode, {} steps of batch {} x 3x{}x{}, {} classes, {} lr {}, {} threads",
        a.model,
        model.num_parameters(),
        if a.compile { "compiled" } else { "eager" },
        a.steps,
        a.batch,
        a.size,
        a.size,
        a.classes,
        a.optim,
        a.lr,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    println!(
        "chance-level loss ln({}) = {:.4}",
        a.classes,
        (a.classes as f64).ln()
    );

    let patterns = class_patterns(a.classes, a.size, a.seed.wrapping_add(1))?;
    let mut noise_gen = kiln::Generator::new(a.seed.wrapping_add(2));
    model.train(true);
    let mut times = Vec::with_capacity(a.steps);
    let mut losses = Vec::with_capacity(a.steps);
    for step in 0..a.steps {
        let (x, y) = synthetic_batch(&patterns, a.batch, step as u64, &mut noise_gen)?;
        let t = Instant::now();
        let loss = net
            .forward(&x)?
            .cross_entropy(&y, None, 0.0, Reduction::Mean)?;
        opt.zero_grad();
        loss.backward()?;
        opt.step()?;
        let l = loss.item::<f32>()?;
        let dt = t.elapsed().as_secs_f64();
        println!("step {step:3}  loss {l:.4}  {:8.1} ms", dt * 1e3);
        times.push(dt);
        losses.push(l);
    }
    if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
        let later = &times[1.min(times.len() - 1)..];
        println!(
            "loss {first:.4} -> {last:.4}; first step {:.1} ms, later steps mean {:.1} ms",
            times[0] * 1e3,
            later.iter().sum::<f64>() / later.len() as f64 * 1e3
        );
    }
    Ok(())
}
