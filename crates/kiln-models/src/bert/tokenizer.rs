//! Text → `input_ids` / `attention_mask` / `token_type_ids` tensors with the `tokenizers` crate,
//! from the model's own `tokenizer.json` (the same file Hugging Face's fast tokenizer reads).

use std::path::Path;

use kiln_core::{Error, Result, Tensor};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

/// A tokenized batch: three [batch, seq] int64 tensors, padded on the right to the longest text.
pub struct BatchEncoding {
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    pub token_type_ids: Tensor,
}

pub struct BertTokenizer {
    inner: Tokenizer,
}

fn tok_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Io(format!("tokenizer: {what}: {e}"))
}

impl BertTokenizer {
    /// Loads `tokenizer.json`. Its truncation setting is kept; its padding is changed to pad each
    /// batch to its longest text (sentence-transformers' behaviour; files often ask for a fixed
    /// 128, which would only add masked tokens), keeping the file's pad token and id.
    pub fn from_file(path: impl AsRef<Path>) -> Result<BertTokenizer> {
        let path = path.as_ref();
        let mut inner =
            Tokenizer::from_file(path).map_err(|e| tok_err(&path.display().to_string(), e))?;
        let padding = PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            ..inner.get_padding().cloned().unwrap_or_default()
        };
        inner.with_padding(Some(padding));
        Ok(BertTokenizer { inner })
    }

    /// Truncates every text to `max_len` tokens, special tokens included (sentence-transformers
    /// uses the model's `max_seq_length`, e.g. 256 for all-MiniLM-L6-v2, where tokenizer.json
    /// says 128).
    pub fn with_max_length(mut self, max_len: usize) -> Result<BertTokenizer> {
        let truncation = TruncationParams {
            max_length: max_len,
            ..self.inner.get_truncation().cloned().unwrap_or_default()
        };
        self.inner
            .with_truncation(Some(truncation))
            .map_err(|e| tok_err(&format!("truncation to {max_len} tokens"), e))?;
        Ok(self)
    }

    /// Pads each batch to a multiple of `n` tokens (still at least its longest text). Compiled
    /// graphs are specialised to their shapes, so bucketing lengths bounds the recompiles.
    pub fn with_pad_to_multiple_of(mut self, n: usize) -> Result<BertTokenizer> {
        if n == 0 {
            return Err(Error::arg(
                "BertTokenizer::with_pad_to_multiple_of",
                "the multiple must be positive",
            ));
        }
        let padding = PaddingParams {
            pad_to_multiple_of: Some(n),
            ..self.inner.get_padding().cloned().unwrap_or_default()
        };
        self.inner.with_padding(Some(padding));
        Ok(self)
    }

    /// The underlying `tokenizers::Tokenizer`, for anything this wrapper does not expose.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Tokenizes `texts` with the special tokens ([CLS] .. [SEP]) and pads them together.
    pub fn encode_batch(&self, texts: &[&str]) -> Result<BatchEncoding> {
        if texts.is_empty() {
            return Err(Error::arg(
                "BertTokenizer::encode_batch",
                "needs at least one text",
            ));
        }
        let encodings = self
            .inner
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| tok_err("encode_batch", e))?;
        let batch = encodings.len();
        let seq = encodings.first().map_or(0, |e| e.get_ids().len());
        if let Some(bad) = encodings.iter().find(|e| e.get_ids().len() != seq) {
            return Err(Error::shape(
                "BertTokenizer::encode_batch",
                format!(
                    "padding produced rows of {} and {} tokens",
                    seq,
                    bad.get_ids().len()
                ),
            ));
        }
        let gather = |f: fn(&tokenizers::Encoding) -> &[u32]| -> Result<Tensor> {
            let flat: Vec<i64> = encodings
                .iter()
                .flat_map(|e| f(e).iter().map(|&v| v as i64))
                .collect();
            Tensor::from_vec(flat, &[batch, seq])
        };
        Ok(BatchEncoding {
            input_ids: gather(|e| e.get_ids())?,
            attention_mask: gather(|e| e.get_attention_mask())?,
            token_type_ids: gather(|e| e.get_type_ids())?,
        })
    }
}
