//! torch_baseline.py's `bert`: BERT inference in eval mode under no_grad, eager vs `kiln::compile`.
//! bert-base-uncased's shape with random weights (`BertModel(BertConfig())`), batch 1 × 9 tokens
//! (`bert_base_seq9`) and 32 × 128 (`bert_base_bs32_seq128`); then all-MiniLM-L6-v2 with its real
//! weights at the same two shapes (`minilm_l6_*`, no torch counterpart), when the weights are in
//! the kiln cache (`fetch_minilm`) or in `$KILN_BENCH_MINILM_DIR`; otherwise those rows are skipped
//! with a message. Token ids are seeded random ids below the vocabulary size, no attention mask,
//! as torch_baseline.py calls the model. The compiled forward is the module's (`last_hidden_state`;
//! torch's output also carries the pooler, one 768×768 linear on the first token).
//!
//! Rows per shape: `eager` call, the mode's `cold_compile` (fresh kernel cache, in process) and
//! `call`, the largest |compiled − eager| over the hidden states, and for the first shape (every
//! shape on a GPU) the cold and warm compiles in new processes (`compile_child`).
//!
//! On the CPU with `--quick`, the 32 × 128 shape becomes 4 × 32 (`*_bs4_seq32`): bert-base over
//! 4,096 tokens takes seconds per call on a few cores.

use std::ffi::OsString;
use std::path::PathBuf;

use kiln::inductor::with_fresh_cache;
use kiln::models::bert::{BertConfig, BertModel};
use kiln::models::fetch::{fetch_minilm, sha256_file, MINILM_SAFETENSORS_SHA256, MODEL_FILES};
use kiln::nn::Module;
use kiln::{no_grad, Device, Mode, Tensor};

use super::BenchResult;
use crate::compile_child::{emit_new_process_compiles, measure, Measured};
use crate::harness::{max_abs_diff, once, Ctx};

/// The seed of bert-base's random weights; token ids use their own seeds (`Case::ids_seed`).
const SEED: u64 = 0;

/// A folder with all-MiniLM-L6-v2's files, used instead of the kiln cache's (the GPU machine has no
/// network; a child process with a fresh cache folder is told where the parent found them).
pub const MINILM_ENV: &str = "KILN_BENCH_MINILM_DIR";

#[derive(Clone)]
enum Weights {
    /// bert-base-uncased's config, random weights from `SEED`.
    BertBase,
    /// all-MiniLM-L6-v2 from this folder.
    MiniLm(PathBuf),
}

struct Case {
    workload: String,
    batch: usize,
    seq: usize,
    ids_seed: u64,
}

/// The shapes for one model; `small` (CPU under `--quick`) shrinks the large one.
fn cases(w: &Weights, small: bool) -> Vec<Case> {
    let prefix = match w {
        Weights::BertBase => "bert_base",
        Weights::MiniLm(_) => "minilm_l6",
    };
    let (b, t) = if small { (4, 32) } else { (32, 128) };
    vec![
        Case {
            workload: format!("{prefix}_seq9"),
            batch: 1,
            seq: 9,
            ids_seed: 1,
        },
        Case {
            workload: format!("{prefix}_bs{b}_seq{t}"),
            batch: b,
            seq: t,
            ids_seed: 2,
        },
    ]
}

fn small(dev: Device, quick: bool) -> bool {
    dev == Device::Cpu && quick
}

/// Seeded token ids in `[0, vocab)`, [batch, seq] i64 (splitmix64: a pure function of the seed).
fn token_ids(batch: usize, seq: usize, vocab: usize, seed: u64) -> kiln::Result<Tensor> {
    let mut s = seed;
    let ids: Vec<i64> = (0..batch * seq)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % vocab as u64) as i64
        })
        .collect();
    Tensor::from_vec(ids, &[batch, seq])
}

/// all-MiniLM-L6-v2's folder: `$KILN_BENCH_MINILM_DIR` (checked like the cache's), else the
/// kiln cache, fetched there if missing.
fn minilm_dir() -> kiln::Result<PathBuf> {
    let Some(dir) = std::env::var_os(MINILM_ENV).map(PathBuf::from) else {
        return fetch_minilm();
    };
    let missing: Vec<&str> = MODEL_FILES
        .iter()
        .copied()
        .filter(|f| !dir.join(f).is_file())
        .collect();
    if !missing.is_empty() {
        return Err(kiln::Error::Io(format!(
            "{MINILM_ENV}={}: missing {}",
            dir.display(),
            missing.join(", ")
        )));
    }
    let sum = sha256_file(&dir.join("model.safetensors"))?;
    if sum != MINILM_SAFETENSORS_SHA256 {
        return Err(kiln::Error::Io(format!(
            "{MINILM_ENV}={}: model.safetensors has SHA-256 {sum}, expected {MINILM_SAFETENSORS_SHA256}",
            dir.display()
        )));
    }
    Ok(dir)
}

/// The model in eval mode on `dev`.
fn build(w: &Weights, dev: Device) -> kiln::Result<BertModel> {
    let mut model = match w {
        Weights::BertBase => {
            kiln::manual_seed(SEED);
            BertModel::from_config(&BertConfig::bert_base_uncased())?
        }
        Weights::MiniLm(dir) => BertModel::from_pretrained(dir)?,
    };
    model.eval();
    if dev != Device::Cpu {
        model.to(dev)?;
    }
    Ok(model)
}

pub fn run(ctx: &mut Ctx) -> BenchResult {
    run_model(ctx, &Weights::BertBase)?;
    match minilm_dir() {
        Ok(dir) => run_model(ctx, &Weights::MiniLm(dir)),
        Err(e) => {
            eprintln!("kiln-bench: bert: skipping the all-MiniLM-L6-v2 rows: {e}");
            Ok(())
        }
    }
}

fn run_model(ctx: &mut Ctx, weights: &Weights) -> BenchResult {
    let dev = ctx.dev;
    let model = build(weights, dev)?;
    let timer = ctx.timer();
    let child_env: Vec<(&str, OsString)> = match weights {
        Weights::MiniLm(dir) => vec![(MINILM_ENV, dir.clone().into_os_string())],
        Weights::BertBase => vec![],
    };
    for (i, case) in cases(weights, small(dev, ctx.quick))
        .into_iter()
        .enumerate()
    {
        let w = case.workload.as_str();
        let ids =
            token_ids(case.batch, case.seq, model.config.vocab_size, case.ids_seed)?.to(dev)?;
        let (t, eager_out) =
            timer.time_keep(&format!("{w}: eager"), || no_grad(|| model.forward(&ids)))?;
        ctx.emit(w, "eager", "call", t.ms(), "ms");
        if ctx.eager_only {
            continue;
        }
        // a fresh compiled module per shape (torch_baseline.py resets the compiler per compile)
        let compiled = kiln::compile(&model, ctx.opts())?;
        let (first, _) = with_fresh_cache(|| {
            once(&format!("{w}: cold compile"), || {
                measure(dev, || no_grad(|| compiled.forward(&ids)))
            })
        });
        let variant = ctx.mode_name();
        ctx.emit(w, variant, "cold_compile", first?.1.secs, "s");
        let (t, out) = timer.time_keep(&format!("{w}: {variant}"), || {
            no_grad(|| compiled.forward(&ids))
        })?;
        ctx.emit(w, variant, "call", t.ms(), "ms");
        ctx.cuda_range(w, || no_grad(|| compiled.forward(&ids)))?;
        ctx.profile(&format!("{w} {variant} call"), || {
            no_grad(|| compiled.forward(&ids))
        })?;
        ctx.emit(
            w,
            variant,
            "max_abs_diff_vs_eager",
            max_abs_diff(&out, &eager_out)?,
            "abs",
        );
        let st = compiled.stats();
        ctx.emit(w, variant, "graph_breaks", st.graph_breaks as f64, "count");
        if i == 0 || ctx.on_gpu() {
            emit_new_process_compiles(ctx, w, variant, &format!("bert:{w}"), &child_env)?;
        }
    }
    Ok(())
}

/// `compile_child`'s side for `bert:WORKLOAD`: the model and ids as `run` builds them, one eager
/// call, then the compile and first compiled call measured.
pub fn compile_once(workload: &str, dev: Device, mode: Mode, quick: bool) -> BenchResult<Measured> {
    let weights = match workload.starts_with("minilm") {
        true => Weights::MiniLm(minilm_dir()?),
        false => Weights::BertBase,
    };
    let case = cases(&weights, small(dev, quick))
        .into_iter()
        .find(|c| c.workload == workload)
        .ok_or_else(|| format!("bert: no workload {workload:?} with these options"))?;
    let model = build(&weights, dev)?;
    let ids = token_ids(case.batch, case.seq, model.config.vocab_size, case.ids_seed)?.to(dev)?;
    no_grad(|| model.forward(&ids))?;
    kiln::core::device::synchronize(dev)?;
    let opts = kiln::CompileOptions::default().mode(mode);
    let (_, m) = measure(dev, || {
        let c = kiln::compile(&model, opts)?;
        no_grad(|| c.forward(&ids))
    })?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_are_in_the_vocabulary_and_follow_the_seed() {
        let vocab = 30522;
        let a = token_ids(4, 33, vocab, 1).unwrap().to_vec::<i64>().unwrap();
        let b = token_ids(4, 33, vocab, 1).unwrap().to_vec::<i64>().unwrap();
        let c = token_ids(4, 33, vocab, 2).unwrap().to_vec::<i64>().unwrap();
        assert_eq!(a.len(), 4 * 33);
        assert!(a.iter().all(|&t| (0..vocab as i64).contains(&t)));
        assert_eq!(a, b);
        assert_ne!(a, c);
        // spread over the vocabulary, not stuck in a corner of it
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(
            distinct.len() > a.len() * 9 / 10,
            "{} distinct",
            distinct.len()
        );
    }

    /// `Module::to`'s visitor check (what `--device cuda` relies on) passes for BERT.
    #[test]
    fn bert_can_move_between_devices() {
        let mut cfg = BertConfig::bert_base_uncased();
        cfg.num_hidden_layers = 2; // the structure, not the size, is under test
        let mut m = BertModel::from_config(&cfg).unwrap();
        let n = m.parameters().len();
        m.to(Device::Cpu).unwrap();
        assert!(n > 0 && m.parameters().len() == n);
    }
}
