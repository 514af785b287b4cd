//! BERT without pretrained weights: structure and key names (Hugging Face's), parameter counts,
//! checkpoint loading errors, attention-mask and dropout semantics, pooling.

use kiln_core::{no_grad, DType, Tensor};
use kiln_models::bert::{
    l2_normalize, mean_pooling, BertConfig, BertModel, BertTokenizer, LoadReport,
};
use kiln_nn::{Module, StateDict};

fn tiny() -> BertConfig {
    BertConfig {
        vocab_size: 50,
        hidden_size: 8,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 16,
        max_position_embeddings: 16,
        type_vocab_size: 2,
        ..BertConfig::bert_base_uncased()
    }
}

fn ids(rows: &[&[i64]]) -> Tensor {
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), &[b, t]).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn key_names_follow_hugging_face() {
    let model = BertModel::from_config(&tiny()).unwrap();
    let keys: Vec<String> = model.state_dict().keys().map(String::from).collect();
    let mut expected: Vec<String> = [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    ]
    .map(String::from)
    .to_vec();
    for i in 0..2 {
        for suffix in [
            "attention.self.query.weight",
            "attention.self.query.bias",
            "attention.self.key.weight",
            "attention.self.key.bias",
            "attention.self.value.weight",
            "attention.self.value.bias",
            "attention.output.dense.weight",
            "attention.output.dense.bias",
            "attention.output.LayerNorm.weight",
            "attention.output.LayerNorm.bias",
            "intermediate.dense.weight",
            "intermediate.dense.bias",
            "output.dense.weight",
            "output.dense.bias",
            "output.LayerNorm.weight",
            "output.LayerNorm.bias",
        ] {
            expected.push(format!("encoder.layer.{i}.{suffix}"));
        }
    }
    expected.push("pooler.dense.weight".into());
    expected.push("pooler.dense.bias".into());
    assert_eq!(keys, expected);

    let sd = model.state_dict();
    assert_eq!(
        sd.get("encoder.layer.1.intermediate.dense.weight")
            .unwrap()
            .shape(),
        &[16, 8]
    );
    assert_eq!(
        sd.get("encoder.layer.1.output.dense.weight")
            .unwrap()
            .shape(),
        &[8, 16]
    );
    let no_pooler = BertModel::without_pooler(&tiny()).unwrap();
    assert_eq!(no_pooler.state_dict().len(), expected.len() - 2);
}

#[test]
fn parameter_count_matches_the_architecture() {
    let c = tiny();
    let (v, h, i, p, t) = (50, 8, 16, 16, 2);
    let embeddings = v * h + p * h + t * h + 2 * h;
    let layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h;
    let pooler = h * h + h;
    let model = BertModel::from_config(&c).unwrap();
    assert_eq!(
        model.num_parameters(),
        embeddings + c.num_hidden_layers * layer + pooler
    );
}

#[test]
fn bert_base_has_109_482_240_parameters_in_199_tensors() {
    let model = BertModel::from_config(&BertConfig::bert_base_uncased()).unwrap();
    assert_eq!(model.num_parameters(), 109_482_240);
    assert_eq!(model.parameters().len(), 199);
}

#[test]
fn config_parses_hugging_face_json_with_defaults() {
    let cfg = BertConfig::from_json_str(
        r#"{"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 384,
            "num_hidden_layers": 6, "intermediate_size": 1536, "layer_norm_eps": 1e-12}"#,
    )
    .unwrap();
    assert_eq!(cfg.hidden_size, 384);
    assert_eq!(cfg.num_hidden_layers, 6);
    assert_eq!(cfg.num_attention_heads, 12); // default
    assert_eq!(cfg.head_dim(), 32);
    assert_eq!(cfg.vocab_size, 30522); // default
    let err = BertConfig::from_json_str(r#"{"hidden_act": "relu"}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("hidden_act"), "{err}");
    let err = BertConfig::from_json_str(r#"{"hidden_size": 100, "num_attention_heads": 12}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("multiple"), "{err}");
}

/// A state dict of `src`'s values under new names, as another program would have saved them.
fn renamed(src: &BertModel, f: impl Fn(&str) -> String) -> StateDict {
    src.state_dict()
        .iter()
        .map(|(k, t)| (f(k), t.detach()))
        .collect()
}

#[test]
fn loading_accepts_a_bert_prefix_and_ignores_extras() {
    let src = BertModel::from_config(&tiny()).unwrap();
    let dst = BertModel::from_config(&tiny()).unwrap();
    let mut sd = renamed(&src, |k| format!("bert.{k}"));
    sd.insert(
        "bert.embeddings.position_ids",
        Tensor::arange(0.0, 16.0, 1.0, DType::I64)
            .unwrap()
            .unsqueeze(0)
            .unwrap(),
    );
    sd.insert(
        "cls.predictions.bias",
        Tensor::zeros(&[50], DType::F32).unwrap(),
    );
    let LoadReport { ignored } = dst.load_hf_state_dict(&sd).unwrap();
    assert_eq!(ignored, vec!["cls.predictions.bias".to_string()]);
    let x = ids(&[&[1, 5, 7, 2]]);
    src.eval();
    dst.eval();
    let (a, b) = no_grad(|| (src.forward(&x).unwrap(), dst.forward(&x).unwrap()));
    assert_eq!(max_abs_diff(&a, &b), 0.0);
}

#[test]
fn loading_reports_missing_keys_and_wrong_shapes_and_changes_nothing() {
    let src = BertModel::from_config(&tiny()).unwrap();
    let dst = BertModel::from_config(&tiny()).unwrap();
    let before = dst
        .embeddings
        .word_embeddings
        .weight
        .to_vec::<f32>()
        .unwrap();

    let mut sd = renamed(&src, |k| k.to_string());
    sd.remove("encoder.layer.1.attention.self.key.bias");
    let err = dst.load_hf_state_dict(&sd).unwrap_err().to_string();
    assert!(
        err.contains("Missing") && err.contains("encoder.layer.1.attention.self.key.bias"),
        "{err}"
    );

    let mut sd = renamed(&src, |k| k.to_string());
    sd.insert(
        "encoder.layer.0.intermediate.dense.weight",
        Tensor::zeros(&[8, 16], DType::F32).unwrap(),
    );
    let err = dst.load_hf_state_dict(&sd).unwrap_err().to_string();
    assert!(
        err.contains("encoder.layer.0.intermediate.dense.weight")
            && err.contains("[8, 16]")
            && err.contains("[16, 8]"),
        "{err}"
    );
    assert_eq!(
        dst.embeddings
            .word_embeddings
            .weight
            .to_vec::<f32>()
            .unwrap(),
        before,
        "a failed load must not write any parameter"
    );
}

#[test]
fn padding_does_not_change_the_other_tokens() {
    let model = BertModel::from_config(&tiny()).unwrap();
    model.eval();
    no_grad(|| {
        let alone = model.encode(&ids(&[&[3, 9, 4]]), None, None).unwrap();
        let other = model
            .encode(&ids(&[&[11, 12, 13, 14, 15]]), None, None)
            .unwrap();
        // the short row padded with arbitrary ids; the mask must hide them
        let batch = ids(&[&[3, 9, 4, 17, 23], &[11, 12, 13, 14, 15]]);
        let mask = ids(&[&[1, 1, 1, 0, 0], &[1, 1, 1, 1, 1]]);
        let padded = model.encode(&batch, Some(&mask), None).unwrap();
        let row0 = padded.narrow(0, 0, 1).unwrap().narrow(1, 0, 3).unwrap();
        let row1 = padded.narrow(0, 1, 1).unwrap();
        assert!(max_abs_diff(&row0, &alone) < 1e-5);
        assert!(max_abs_diff(&row1, &other) < 1e-5);

        // without the mask the padding is attended to, and the outputs move
        let unmasked = model.encode(&batch, None, None).unwrap();
        let row0 = unmasked.narrow(0, 0, 1).unwrap().narrow(1, 0, 3).unwrap();
        assert!(max_abs_diff(&row0, &alone) > 1e-3);

        // mean pooling ignores the padded positions too
        let pooled = mean_pooling(&padded, &mask)
            .unwrap()
            .narrow(0, 0, 1)
            .unwrap();
        let pooled_alone = mean_pooling(&alone, &ids(&[&[1, 1, 1]])).unwrap();
        assert!(max_abs_diff(&pooled, &pooled_alone) < 1e-5);
    });
}

#[test]
fn token_types_and_pooler_output() {
    let model = BertModel::from_config(&tiny()).unwrap();
    model.eval();
    no_grad(|| {
        let x = ids(&[&[1, 2, 3], &[4, 5, 6]]);
        let zeros = ids(&[&[0, 0, 0], &[0, 0, 0]]);
        let ones = ids(&[&[1, 1, 1], &[1, 1, 1]]);
        let default = model.run(&x, None, None).unwrap();
        let explicit = model.run(&x, None, Some(&zeros)).unwrap();
        let type1 = model.run(&x, None, Some(&ones)).unwrap();
        assert_eq!(
            max_abs_diff(&default.last_hidden_state, &explicit.last_hidden_state),
            0.0
        );
        assert!(max_abs_diff(&default.last_hidden_state, &type1.last_hidden_state) > 1e-3);
        let pooled = default.pooler_output.unwrap();
        assert_eq!(pooled.shape(), &[2, 8]);
        let v = pooled.to_vec::<f32>().unwrap();
        assert!(v.iter().all(|x| x.abs() <= 1.0), "tanh output");
    });
}

#[test]
fn dropout_is_active_only_in_training() {
    let model = BertModel::from_config(&tiny()).unwrap();
    let x = ids(&[&[1, 2, 3, 4]]);
    no_grad(|| {
        model.train(true);
        let a = model.forward(&x).unwrap();
        let b = model.forward(&x).unwrap();
        assert!(
            max_abs_diff(&a, &b) > 1e-4,
            "two training passes draw different masks"
        );
        model.eval();
        let c = model.forward(&x).unwrap();
        let d = model.forward(&x).unwrap();
        assert_eq!(max_abs_diff(&c, &d), 0.0);
    });
}

#[test]
fn bad_inputs_are_errors() {
    let model = BertModel::from_config(&tiny()).unwrap();
    let float_ids = Tensor::zeros(&[1, 3], DType::F32).unwrap();
    assert!(model.forward(&float_ids).is_err());
    let too_long = Tensor::zeros(&[1, 17], DType::I64).unwrap();
    let err = model.forward(&too_long).unwrap_err().to_string();
    assert!(err.contains("max_position_embeddings"), "{err}");
    let out_of_vocab = ids(&[&[1, 50]]);
    assert!(model.forward(&out_of_vocab).is_err());
    let mask = ids(&[&[1, 1, 1]]);
    assert!(model.encode(&ids(&[&[1, 2]]), Some(&mask), None).is_err());
}

#[test]
fn pooling_by_hand() {
    // two tokens kept, one masked: the mean is over the kept ones only
    let hidden = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 100.0, 100.0], &[1, 3, 2]).unwrap();
    let mask = ids(&[&[1, 1, 0]]);
    let pooled = mean_pooling(&hidden, &mask).unwrap();
    assert_eq!(pooled.to_vec::<f32>().unwrap(), vec![2.0, 3.0]);
    let unit = l2_normalize(&Tensor::from_vec(vec![3.0f32, 4.0], &[1, 2]).unwrap()).unwrap();
    assert_eq!(unit.to_vec::<f32>().unwrap(), vec![0.6, 0.8]);
    // an all-padding row pools to zeros, not NaN
    let empty = mean_pooling(&hidden, &ids(&[&[0, 0, 0]])).unwrap();
    assert_eq!(empty.to_vec::<f32>().unwrap(), vec![0.0, 0.0]);
}

#[test]
fn a_missing_tokenizer_file_is_an_error_naming_it() {
    let err = BertTokenizer::from_file("/nonexistent/tokenizer.json")
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("/nonexistent/tokenizer.json"), "{err}");
}
