//! Multi-head self-attention (`BertSelfAttention`) and its projection + residual + LayerNorm
//! (`BertSelfOutput`), grouped as Hugging Face's `BertAttention` with children `self` and `output`.

use kiln_core::{Error, Result, Tensor};
use kiln_nn::{Dropout, LayerNorm, Linear, Module, TrainFlag};

use super::config::BertConfig;

pub struct BertSelfAttention {
    pub query: Linear,
    pub key: Linear,
    pub value: Linear,
    pub dropout: Dropout,
    pub num_heads: usize,
    pub head_dim: usize,
    training: TrainFlag,
}

impl BertSelfAttention {
    pub fn new(cfg: &BertConfig) -> Result<BertSelfAttention> {
        let h = cfg.hidden_size;
        Ok(BertSelfAttention {
            query: Linear::new(h, h, true)?,
            key: Linear::new(h, h, true)?,
            value: Linear::new(h, h, true)?,
            dropout: Dropout::new(cfg.attention_probs_dropout_prob)?,
            num_heads: cfg.num_attention_heads,
            head_dim: cfg.head_dim(),
            training: TrainFlag::default(),
        })
    }

    /// [batch, seq, hidden] → [batch, heads, seq, head_dim].
    fn split_heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t) = (x.shape()[0], x.shape()[1]);
        x.reshape([b, t, self.num_heads, self.head_dim])?
            .permute(&[0, 2, 1, 3])
    }

    /// `hidden`: [batch, seq, hidden]; `mask_bias`: additive, broadcastable to
    /// [batch, heads, seq, seq] (0 where a key may be attended to, a large negative value where not).
    pub fn attend(&self, hidden: &Tensor, mask_bias: Option<&Tensor>) -> Result<Tensor> {
        let hidden_size = self.num_heads * self.head_dim;
        if hidden.rank() != 3 || hidden.shape()[2] != hidden_size {
            return Err(Error::shape(
                "BertSelfAttention",
                format!(
                    "hidden states must be [batch, seq, {hidden_size}], got {:?}",
                    hidden.shape()
                ),
            ));
        }
        let (b, t) = (hidden.shape()[0], hidden.shape()[1]);
        let q = self.split_heads(&self.query.forward(hidden)?)?;
        let k = self.split_heads(&self.key.forward(hidden)?)?;
        let v = self.split_heads(&self.value.forward(hidden)?)?;
        let mut scores = q
            .matmul(&k.transpose(-1, -2)?)?
            .div((self.head_dim as f64).sqrt())?;
        if let Some(bias) = mask_bias {
            scores = scores.add(bias)?;
        }
        let probs = self.dropout.forward(&scores.softmax(-1)?)?;
        probs
            .matmul(&v)?
            .permute(&[0, 2, 1, 3])?
            .reshape([b, t, hidden_size])
    }
}

impl Module for BertSelfAttention {
    fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        self.attend(hidden, None)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("query".into(), &self.query as &dyn Module),
            ("key".into(), &self.key),
            ("value".into(), &self.value),
            ("dropout".into(), &self.dropout),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("query".into(), &mut self.query as &mut dyn Module),
            ("key".into(), &mut self.key),
            ("value".into(), &mut self.value),
            ("dropout".into(), &mut self.dropout),
        ]
    }
}

/// dense → dropout → LayerNorm(· + residual): the sub-layer epilogue shared by attention and MLP.
pub struct BertResidualOutput {
    pub dense: Linear,
    pub layer_norm: LayerNorm,
    pub dropout: Dropout,
    training: TrainFlag,
}

impl BertResidualOutput {
    pub fn new(cfg: &BertConfig, in_features: usize) -> Result<BertResidualOutput> {
        Ok(BertResidualOutput {
            dense: Linear::new(in_features, cfg.hidden_size, true)?,
            layer_norm: LayerNorm::with_config(&[cfg.hidden_size], cfg.layer_norm_eps, true, true)?,
            dropout: Dropout::new(cfg.hidden_dropout_prob)?,
            training: TrainFlag::default(),
        })
    }

    pub fn project(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let y = self.dropout.forward(&self.dense.forward(x)?)?;
        self.layer_norm.forward(&y.add(residual)?)
    }
}

impl Module for BertResidualOutput {
    /// Without a separate residual the input is its own residual (only shapes where in = out).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.project(x, x)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("dense".into(), &self.dense as &dyn Module),
            ("LayerNorm".into(), &self.layer_norm),
            ("dropout".into(), &self.dropout),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("dense".into(), &mut self.dense as &mut dyn Module),
            ("LayerNorm".into(), &mut self.layer_norm),
            ("dropout".into(), &mut self.dropout),
        ]
    }
}

/// Hugging Face's `BertAttention`: `self` (the heads) and `output` (projection + residual + norm).
pub struct BertAttention {
    pub self_attention: BertSelfAttention,
    pub output: BertResidualOutput,
    training: TrainFlag,
}

impl BertAttention {
    pub fn new(cfg: &BertConfig) -> Result<BertAttention> {
        Ok(BertAttention {
            self_attention: BertSelfAttention::new(cfg)?,
            output: BertResidualOutput::new(cfg, cfg.hidden_size)?,
            training: TrainFlag::default(),
        })
    }

    pub fn attend(&self, hidden: &Tensor, mask_bias: Option<&Tensor>) -> Result<Tensor> {
        let context = self.self_attention.attend(hidden, mask_bias)?;
        self.output.project(&context, hidden)
    }
}

impl Module for BertAttention {
    fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        self.attend(hidden, None)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("self".into(), &self.self_attention as &dyn Module),
            ("output".into(), &self.output),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("self".into(), &mut self.self_attention as &mut dyn Module),
            ("output".into(), &mut self.output),
        ]
    }
}
