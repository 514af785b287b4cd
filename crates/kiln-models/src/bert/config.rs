//! `BertConfig`: the fields of a Hugging Face BERT `config.json` that shape the network. Fields the
//! file leaves out take `transformers.BertConfig`'s defaults, which are bert-base-uncased's.

use std::path::Path;

use kiln_core::{Error, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    /// Only `"gelu"` (the exact, erf-based GELU) is implemented.
    pub hidden_act: String,
    pub hidden_dropout_prob: f64,
    pub attention_probs_dropout_prob: f64,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    pub pad_token_id: usize,
    /// Only `"absolute"` (learned position embeddings) is implemented.
    pub position_embedding_type: String,
}

impl Default for BertConfig {
    fn default() -> Self {
        BertConfig::bert_base_uncased()
    }
}

impl BertConfig {
    /// bert-base-uncased: 12 layers, hidden 768, 12 heads, intermediate 3072, vocab 30522.
    pub fn bert_base_uncased() -> BertConfig {
        BertConfig {
            vocab_size: 30522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            hidden_act: "gelu".to_string(),
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            pad_token_id: 0,
            position_embedding_type: "absolute".to_string(),
        }
    }

    /// Parses a `config.json` text; unknown fields (architectures, model_type, ..) are ignored.
    pub fn from_json_str(text: &str) -> Result<BertConfig> {
        let cfg: BertConfig = serde_json::from_str(text)
            .map_err(|e| Error::Io(format!("BertConfig: config.json is not valid: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a `config.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<BertConfig> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Io(format!("BertConfig: {}: {e}", path.display())))?;
        BertConfig::from_json_str(&text).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
    }

    /// Size of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Rejects configurations this implementation would compute wrongly or not at all.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::arg("BertConfig", msg));
        if self.hidden_size == 0 || self.num_attention_heads == 0 {
            return bad(format!(
                "hidden_size ({}) and num_attention_heads ({}) must be positive",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return bad(format!(
                "hidden_size ({}) is not a multiple of num_attention_heads ({})",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.hidden_act != "gelu" {
            return bad(format!(
                "hidden_act \"{}\" is not supported (only \"gelu\", the exact erf form)",
                self.hidden_act
            ));
        }
        if self.position_embedding_type != "absolute" {
            return bad(format!(
                "position_embedding_type \"{}\" is not supported (only \"absolute\")",
                self.position_embedding_type
            ));
        }
        for (name, p) in [
            ("hidden_dropout_prob", self.hidden_dropout_prob),
            (
                "attention_probs_dropout_prob",
                self.attention_probs_dropout_prob,
            ),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return bad(format!("{name} must be in [0, 1], got {p}"));
            }
        }
        if self.layer_norm_eps.is_nan() || self.layer_norm_eps < 0.0 {
            return bad(format!(
                "layer_norm_eps must be non-negative, got {}",
                self.layer_norm_eps
            ));
        }
        if self.vocab_size == 0 || self.max_position_embeddings == 0 || self.type_vocab_size == 0 {
            return bad(format!(
                "vocab_size ({}), max_position_embeddings ({}) and type_vocab_size ({}) must be positive",
                self.vocab_size, self.max_position_embeddings, self.type_vocab_size
            ));
        }
        Ok(())
    }
}
