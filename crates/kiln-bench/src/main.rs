//! kiln-bench: kiln's side of the workloads in DESIGN.md, measured the way
//! `../shared/bench/torch_baseline.py` measures PyTorch, in the same JSON-lines format.
//!
//!     cargo run --release -p kiln-bench -- WORKLOAD [--device cpu] [--mode default] [--quick]
//!
//! WORKLOAD: regional, adam, sincos, numpy_fn, train_digits, resnet18, dynamic, bert,
//! train_resnet18, train_densenet121, norms, mlp, or all. One JSON object per line on
//! stdout (`workload, variant, metric, value, unit, device`); a table on stderr at the end. With
//! `OUT` set, the lines are also appended to `$OUT/results.jsonl`, as torch_baseline.py does.

mod compile_child;
mod harness;
mod proc_stats;
mod workloads;

use std::process::ExitCode;

use harness::{Ctx, Report};
use kiln::Mode;

const WORKLOADS: &[&str] = &[
    "regional",
    "adam",
    "sincos",
    "numpy_fn",
    "train_digits",
    "resnet18",
    "dynamic",
    "bert",
    "train_resnet18",
    "train_densenet121",
    "norms",
    "mlp",
];

/// The workloads that run with `--device cuda` so far.
const GPU_WORKLOADS: &[&str] = &[
    "sincos",
    "adam",
    "resnet18",
    "regional",
    "dynamic",
    "norms",
    "mlp",
    "convs",
    "convs_resnet18",
];
/// The model workloads, which run on CUDA too (a list of their own, so that GPU_WORKLOADS's line
/// stays one edit for whoever moves the next workload over).
const GPU_MODEL_WORKLOADS: &[&str] = &["bert", "train_resnet18", "train_densenet121"];
/// Workloads with nothing to measure on the CPU (not in `all`).
const GPU_ONLY_WORKLOADS: &[&str] = &["convs", "convs_resnet18"];

const USAGE: &str = "usage: kiln-bench WORKLOAD [--device cpu|cuda[:N]] [--mode MODE] [--quick]
  WORKLOAD  regional | adam | sincos | numpy_fn | train_digits | resnet18 | dynamic | bert
            | train_resnet18 | train_densenet121 | norms | mlp | all
            | convs, convs_resnet18 (GPU only: DenseNet-121's or ResNet-18's convolutions on
            cuDNN and on kiln's kernels)
  --device  cpu (the default) or cuda / cuda:N (sincos, adam, regional, resnet18, dynamic,
            norms, mlp, bert, train_*, convs*)
  --mode    eager | default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
            (eager: the eager rows only)
  --quick   shorter runs (all --quick takes a few minutes on two cores)";

/// A hidden subcommand: the full regional model compiled once in a fresh process, against the
/// parent's kernel cache folder (warm disk cache). Prints one JSON object for the parent.
const WARM_CHILD: &str = "regional-warm-child";

struct Args {
    workload: String,
    device: String,
    mode: Mode,
    eager_only: bool,
    quick: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut workload = None;
    let (mut device, mut mode, mut quick) = ("cpu".to_string(), Mode::Default, false);
    let mut eager_only = false;
    while let Some(a) = it.next() {
        match a.as_str() {
            "--device" => device = it.next().ok_or("--device needs a value")?,
            "--mode" => {
                let m = it.next().ok_or("--mode needs a value")?;
                if m == "eager" {
                    eager_only = true;
                } else {
                    mode = Mode::from_name(&m).ok_or_else(|| format!("unknown mode {m:?}"))?;
                }
            }
            "--quick" => quick = true,
            "-h" | "--help" => return Err(String::new()),
            s if s.starts_with('-') => return Err(format!("unknown option {s:?}")),
            s if workload.is_none() => workload = Some(s.to_string()),
            s => return Err(format!("unexpected argument {s:?}")),
        }
    }
    let workload = workload.ok_or("no workload given")?;
    if workload != "all"
        && workload != WARM_CHILD
        && !workload.starts_with(compile_child::PREFIX)
        && !WORKLOADS.contains(&workload.as_str())
        && !GPU_ONLY_WORKLOADS.contains(&workload.as_str())
    {
        return Err(format!("unknown workload {workload:?}"));
    }
    Ok(Args {
        workload,
        device,
        mode,
        eager_only,
        quick,
    })
}

/// `cpu`, `cuda` or `cuda:N`; a CUDA device must be usable (its libraries found, a GPU present).
fn parse_device(s: &str) -> Result<kiln::Device, String> {
    let dev = match s {
        "cpu" => return Ok(kiln::Device::Cpu),
        "cuda" => kiln::Device::Cuda(0),
        d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => kiln::Device::Cuda(n),
            _ => return Err(format!("unknown device {d:?} (cpu, cuda or cuda:N)")),
        },
    };
    kiln::cuda::check().map_err(|e| format!("--device {s}: {e}"))?;
    Ok(dev)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("kiln-bench: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let dev = match parse_device(&args.device) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kiln-bench: {e}");
            return ExitCode::from(2);
        }
    };
    // `KILN_CONV=generated` / `cudnn`: channels-last TF32 convolutions all on kiln's generated
    // kernels, or all on cuDNN, where by default (`auto`) a compiled function chooses
    // (`kiln::cuda::set_conv_engine`; pairs from one build)
    match std::env::var("KILN_CONV").as_deref() {
        Ok("generated") => kiln::cuda::set_conv_engine(kiln::cuda::ConvEngine::Generated),
        Ok("cudnn") => kiln::cuda::set_conv_engine(kiln::cuda::ConvEngine::Cudnn),
        _ => {}
    }
    if args.workload == WARM_CHILD {
        return match workloads::regional::warm_child(args.mode, dev) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kiln-bench {WARM_CHILD}: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Some(key) = args.workload.strip_prefix(compile_child::PREFIX) {
        return match compile_child::child_main(key, dev, args.mode, args.quick) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kiln-bench {}: {e}", args.workload);
                ExitCode::FAILURE
            }
        };
    }
    let selected: Vec<&str> = match args.workload.as_str() {
        "all" => WORKLOADS.to_vec(),
        w => vec![w],
    };
    let mut ctx = Ctx {
        device: args.device.clone(),
        dev,
        mode: args.mode,
        eager_only: args.eager_only,
        quick: args.quick,
        report: Report::default(),
    };
    eprintln!(
        "kiln-bench: {} on {} ({} threads){}, mode {}{}, kernel cache {}",
        selected.join(", "),
        cpu_name(),
        threads(),
        match dev {
            kiln::Device::Cpu => String::new(),
            d => format!(", device {d}"),
        },
        if args.eager_only {
            "eager"
        } else {
            args.mode.as_str()
        },
        if args.quick { ", quick" } else { "" },
        kiln::inductor::cache_dir().display()
    );
    let mut failed = false;
    for w in selected {
        let interpreted = kiln::inductor::interpreted_graphs();
        let r = match w {
            w if ctx.on_gpu()
                && !GPU_WORKLOADS.contains(&w)
                && !GPU_MODEL_WORKLOADS.contains(&w) =>
            {
                Err(format!("{w} does not run on {} yet", ctx.device).into())
            }
            "regional" => workloads::regional::run(&mut ctx),
            "adam" => workloads::adam::run(&mut ctx),
            "sincos" => workloads::sincos::run(&mut ctx),
            "numpy_fn" => workloads::numpy_fn::run(&mut ctx),
            "train_digits" => workloads::train_digits::run(&mut ctx),
            "resnet18" => workloads::resnet18::run(&mut ctx),
            "dynamic" => workloads::dynamic::run(&mut ctx),
            "bert" => workloads::bert::run(&mut ctx),
            "norms" => workloads::norms::run(&mut ctx),
            "mlp" => workloads::mlp::run(&mut ctx),
            "convs" => workloads::convs::run(&mut ctx),
            "convs_resnet18" => workloads::convs::run_resnet18(&mut ctx),
            "train_resnet18" => workloads::train::run(&mut ctx, workloads::train::Arch::ResNet18),
            "train_densenet121" => {
                workloads::train::run(&mut ctx, workloads::train::Arch::DenseNet121)
            }
            _ => unreachable!("checked in parse_args"),
        };
        // compiled rows that timed the interpreter would compare eager kernels with torch.compile
        let fell_back = kiln::inductor::interpreted_graphs() - interpreted;
        let r = match r {
            Ok(()) if fell_back > 0 => Err(format!(
                "{fell_back} compiled graph(s) fell back to the interpreter (their kernels could \
                 not be generated: see the warning above); its compiled rows time eager kernels"
            )
            .into()),
            r => r,
        };
        // keep going: one failing workload must not hide the rest
        if let Err(e) = r {
            failed = true;
            ctx.report.error(w, &e.to_string());
        }
    }
    if let Ok(out) = std::env::var("OUT") {
        let path = std::path::Path::new(&out).join("results.jsonl");
        let lines: String = ctx.report.rows.iter().map(|r| r.to_json() + "\n").collect();
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, lines.as_bytes()));
        if let Err(e) = written {
            eprintln!("kiln-bench: could not append to {}: {e}", path.display());
        }
    }
    eprintln!("\n{}", ctx.report.table());
    match failed {
        true => ExitCode::FAILURE,
        false => ExitCode::SUCCESS,
    }
}

pub fn threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}
