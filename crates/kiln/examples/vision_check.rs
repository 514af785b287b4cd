//! Writes what `tools/vision_reference.py` needs to check kiln's ResNet-18 and DenseNet-121 against
//! torchvision: for each model, a folder with
//!
//!   weights.safetensors       the state dict (torchvision key names), seeded random values
//!   input.safetensors         "input": a fixed [batch, 3, size, size] float32 batch
//!   kiln_output.safetensors   "output": kiln's eval-mode logits for that input
//!   meta.json                 model name, classes, shapes, seed
//!
//!     cargo run --release --example vision_check -- [--out target/vision_check] [--size 224]
//!         [--batch 2] [--models resnet18,densenet121] [--seed 0]
//!     python3 tools/vision_reference.py target/vision_check/resnet18
//!
//! The weights are torchvision's initialisation with every BatchNorm made non-trivial (weight, bias,
//! running mean and variance drawn at random): with the defaults (1, 0, 0, 1) a BatchNorm in eval
//! mode is almost the identity and a wrong eps, a swapped mean/var or a missed affine term would go
//! unnoticed. The input is 224x224 because that is the resolution torchvision's models are built
//! for (at 32x32 DenseNet's last block runs on 1x1 maps and the pooling paths are barely
//! exercised); batch 2 shows the batch dimension is not mixed up while keeping the files ~1 MB.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use kiln::models::densenet::densenet121;
use kiln::models::resnet::resnet18;
use kiln::nn::io::save_safetensors;
use kiln::nn::StateDict;
use kiln::prelude::*;
use kiln::Generator;

const CLASSES: usize = 1000;

struct Args {
    out: PathBuf,
    size: usize,
    batch: usize,
    models: Vec<String>,
    seed: u64,
}

fn parse_args() -> std::result::Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut a = Args {
        out: PathBuf::from("target/vision_check"),
        size: 224,
        batch: 2,
        models: vec!["resnet18".into(), "densenet121".into()],
        seed: 0,
    };
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let positive = || {
            value
                .parse::<usize>()
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| format!("{flag} must be a positive integer, got {value:?}"))
        };
        match flag.as_str() {
            "--out" => a.out = PathBuf::from(value),
            "--size" => a.size = positive()?,
            "--batch" => a.batch = positive()?,
            "--models" => a.models = value.split(',').map(str::to_string).collect(),
            "--seed" => {
                a.seed = value
                    .parse()
                    .map_err(|_| format!("--seed must be a non-negative integer, got {value:?}"))?
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

/// Gives every BatchNorm random affine parameters and running statistics (see the header).
/// Values are written in place (`assign`), so the model sees them.
fn randomize_batchnorms(model: &dyn Module, gen: &mut Generator) -> Result<()> {
    // the live tensors (not the state dict's detached handles), so the writes are the model's
    let mut named = Vec::new();
    model.visit("", &mut |name, t, _| {
        named.push((name.to_string(), t.clone()))
    });
    // a BatchNorm is a module prefix with a running_var; its weight and bias are `prefix.weight/bias`
    let bn_prefixes: HashSet<&str> = named
        .iter()
        .filter_map(|(k, _)| k.strip_suffix(".running_var"))
        .collect();
    let is_bn = |name: &str, suffix: &str| {
        name.strip_suffix(suffix)
            .is_some_and(|p| bn_prefixes.contains(p))
    };
    let mut uniform = |shape: &[usize], lo: f64, hi: f64| -> Result<Tensor> {
        Tensor::rand_with(shape, DType::F32, gen)?
            .mul(hi - lo)?
            .add(lo)
    };
    no_grad(|| {
        for (name, t) in &named {
            let shape = t.shape().to_vec();
            let fresh = if name.ends_with(".running_var") || is_bn(name, ".weight") {
                uniform(&shape, 0.5, 1.5)?
            } else if name.ends_with(".running_mean") || is_bn(name, ".bias") {
                uniform(&shape, -0.2, 0.2)?
            } else if name.ends_with(".num_batches_tracked") {
                // not used by the forward pass; a non-zero value shows it round-trips
                Tensor::full(&[], 7.0, DType::I64)?
            } else {
                continue;
            };
            t.assign(&fresh)?;
        }
        Ok(())
    })
}

fn save_one(path: &Path, key: &str, t: &Tensor) -> Result<()> {
    let mut sd = StateDict::new();
    sd.insert(key, t.clone());
    save_safetensors(&sd, path)
}

fn check_model(name: &str, a: &Args) -> Result<()> {
    kiln::manual_seed(a.seed);
    let model: Box<dyn Module> = match name {
        "resnet18" => Box::new(resnet18(CLASSES)?),
        "densenet121" => Box::new(densenet121(CLASSES)?),
        other => {
            return Err(kiln::Error::arg(
                "vision_check",
                format!("unknown model {other:?} (resnet18 or densenet121)"),
            ))
        }
    };
    let mut gen = Generator::new(a.seed.wrapping_add(1000));
    randomize_batchnorms(&*model, &mut gen)?;
    model.eval();
    let x = Tensor::randn_with(&[a.batch, 3, a.size, a.size], DType::F32, &mut gen)?;
    let t = std::time::Instant::now();
    let y = no_grad(|| model.forward(&x))?;
    let elapsed = t.elapsed();

    let dir = a.out.join(name);
    std::fs::create_dir_all(&dir)
        .map_err(|e| kiln::Error::Io(format!("{}: {e}", dir.display())))?;
    save_safetensors(&*model, dir.join("weights.safetensors"))?;
    save_one(&dir.join("input.safetensors"), "input", &x)?;
    save_one(&dir.join("kiln_output.safetensors"), "output", &y)?;
    let meta = format!(
        "{{\n  \"model\": \"{name}\",\n  \"num_classes\": {CLASSES},\n  \"input_shape\": {:?},\n  \
         \"output_shape\": {:?},\n  \"seed\": {}\n}}\n",
        x.shape(),
        y.shape(),
        a.seed
    );
    std::fs::write(dir.join("meta.json"), meta)
        .map_err(|e| kiln::Error::Io(format!("{}: {e}", dir.display())))?;

    let v = y.to_vec_f64()?;
    let max_abs = v.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    println!(
        "{name}: {} tensors, output {:?} (max |logit| {max_abs:.4}), eager forward {:.2} s -> {}",
        model.state_dict().len(),
        y.shape(),
        elapsed.as_secs_f64(),
        dir.display()
    );
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}\nusage: vision_check [--out DIR] [--size N] [--batch N] [--models resnet18,densenet121] [--seed N]");
            std::process::exit(2);
        }
    };
    for name in &args.models {
        if let Err(e) = check_model(name, &args) {
            eprintln!("error: {name}: {e}");
            std::process::exit(1);
        }
    }
}
