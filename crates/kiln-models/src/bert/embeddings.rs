//! `BertEmbeddings`: word + learned absolute position + token type embeddings, then LayerNorm and
//! dropout (Hugging Face's `BertEmbeddings`, with its attribute names).

use kiln_core::{DType, Error, Result, Tensor};
use kiln_nn::{Dropout, Embedding, LayerNorm, Module, TrainFlag};

use super::config::BertConfig;

pub struct BertEmbeddings {
    pub word_embeddings: Embedding,
    pub position_embeddings: Embedding,
    pub token_type_embeddings: Embedding,
    pub layer_norm: LayerNorm,
    pub dropout: Dropout,
    training: TrainFlag,
}

/// `input_ids` must be a [batch, seq] integer tensor.
pub(crate) fn check_ids(op: &'static str, name: &str, ids: &Tensor) -> Result<()> {
    if ids.dtype().is_float() || ids.dtype() == DType::Bool {
        return Err(Error::dtype(
            op,
            ids.dtype(),
            format!("{name} must be an integer tensor (int64 or int32)"),
        ));
    }
    if ids.rank() != 2 {
        return Err(Error::shape(
            op,
            format!("{name} must be [batch, seq_len], got {:?}", ids.shape()),
        ));
    }
    Ok(())
}

impl BertEmbeddings {
    /// Fresh tables drawn from N(0, 1) (the layers' defaults; load a state dict for real weights).
    pub fn new(cfg: &BertConfig) -> Result<BertEmbeddings> {
        Ok(BertEmbeddings {
            word_embeddings: Embedding::new(cfg.vocab_size, cfg.hidden_size)?,
            position_embeddings: Embedding::new(cfg.max_position_embeddings, cfg.hidden_size)?,
            token_type_embeddings: Embedding::new(cfg.type_vocab_size, cfg.hidden_size)?,
            layer_norm: LayerNorm::with_config(&[cfg.hidden_size], cfg.layer_norm_eps, true, true)?,
            dropout: Dropout::new(cfg.hidden_dropout_prob)?,
            training: TrainFlag::default(),
        })
    }

    /// `input_ids`, `token_type_ids`: [batch, seq] integers → [batch, seq, hidden].
    /// Without `token_type_ids` every token is of type 0, as in Hugging Face.
    pub fn embed(&self, input_ids: &Tensor, token_type_ids: Option<&Tensor>) -> Result<Tensor> {
        check_ids("BertEmbeddings", "input_ids", input_ids)?;
        let seq_len = input_ids.shape()[1];
        if seq_len > self.position_embeddings.num_embeddings {
            return Err(Error::shape(
                "BertEmbeddings",
                format!(
                    "sequence length {seq_len} (input_ids {:?}) exceeds max_position_embeddings {}",
                    input_ids.shape(),
                    self.position_embeddings.num_embeddings
                ),
            ));
        }
        let words = self.word_embeddings.forward(input_ids)?;
        // made where the ids live, so a model moved to a GPU gathers from a GPU index (and a
        // compiled model captures it in the device's graph)
        let positions =
            Tensor::arange_on(0.0, seq_len as f64, 1.0, DType::I64, input_ids.device())?
                .unsqueeze(0)?;
        let mut x = words.add(&self.position_embeddings.forward(&positions)?)?;
        x = match token_type_ids {
            Some(tt) => {
                check_ids("BertEmbeddings", "token_type_ids", tt)?;
                if tt.shape() != input_ids.shape() {
                    return Err(Error::shape(
                        "BertEmbeddings",
                        format!(
                            "token_type_ids {:?} must have the shape of input_ids {:?}",
                            tt.shape(),
                            input_ids.shape()
                        ),
                    ));
                }
                x.add(&self.token_type_embeddings.forward(tt)?)?
            }
            // row 0 broadcast over every token: what an all-zero token_type_ids would gather
            None => x.add(&self.token_type_embeddings.weight.narrow(0, 0, 1)?)?,
        };
        self.dropout.forward(&self.layer_norm.forward(&x)?)
    }
}

impl Module for BertEmbeddings {
    fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.embed(input_ids, None)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            (
                "word_embeddings".into(),
                &self.word_embeddings as &dyn Module,
            ),
            ("position_embeddings".into(), &self.position_embeddings),
            ("token_type_embeddings".into(), &self.token_type_embeddings),
            ("LayerNorm".into(), &self.layer_norm),
            ("dropout".into(), &self.dropout),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            (
                "word_embeddings".into(),
                &mut self.word_embeddings as &mut dyn Module,
            ),
            ("position_embeddings".into(), &mut self.position_embeddings),
            (
                "token_type_embeddings".into(),
                &mut self.token_type_embeddings,
            ),
            ("LayerNorm".into(), &mut self.layer_norm),
            ("dropout".into(), &mut self.dropout),
        ]
    }
}
