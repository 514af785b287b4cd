//! `BertModel`: embeddings → encoder → optional pooler, with Hugging Face's parameter names, and
//! loading of Hugging Face / sentence-transformers checkpoints.

use std::collections::HashSet;
use std::path::Path;

use kiln_core::{DType, Error, Result, Tensor};
use kiln_nn::{io, Linear, Module, StateDict, TensorKind, TrainFlag};

use super::config::BertConfig;
use super::embeddings::{check_ids, BertEmbeddings};
use super::encoder::BertEncoder;

/// `pooler.dense` + tanh over the first ([CLS]) token: BERT's next-sentence-prediction head input.
pub struct BertPooler {
    pub dense: Linear,
    training: TrainFlag,
}

impl BertPooler {
    pub fn new(cfg: &BertConfig) -> Result<BertPooler> {
        Ok(BertPooler {
            dense: Linear::new(cfg.hidden_size, cfg.hidden_size, true)?,
            training: TrainFlag::default(),
        })
    }
}

impl Module for BertPooler {
    /// [batch, seq, hidden] → [batch, hidden].
    fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        if hidden.rank() != 3 || hidden.shape()[1] == 0 {
            return Err(Error::shape(
                "BertPooler",
                format!(
                    "expects [batch, seq >= 1, hidden], got {:?}",
                    hidden.shape()
                ),
            ));
        }
        self.dense.forward(&hidden.select(1, 0)?)?.tanh()
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("dense".into(), &self.dense as &dyn Module)]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![("dense".into(), &mut self.dense as &mut dyn Module)]
    }
}

/// What `BertModel::run` returns (Hugging Face's `BaseModelOutputWithPooling`).
pub struct BertOutput {
    /// [batch, seq, hidden]
    pub last_hidden_state: Tensor,
    /// [batch, hidden]; `None` for a model built without a pooler.
    pub pooler_output: Option<Tensor>,
}

/// Keys a checkpoint may carry that are not parameters: `position_ids` is a constant buffer that
/// older transformers versions saved.
fn is_known_extra(key: &str) -> bool {
    key == "embeddings.position_ids"
}

/// What `load_hf_state_dict` did besides loading every parameter.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Checkpoint keys that name no parameter of this model (e.g. `cls.predictions.*` heads).
    pub ignored: Vec<String>,
}

pub struct BertModel {
    pub config: BertConfig,
    pub embeddings: BertEmbeddings,
    pub encoder: BertEncoder,
    pub pooler: Option<BertPooler>,
    training: TrainFlag,
}

impl BertModel {
    /// Hugging Face's `BertModel(config)` (with the pooling layer), randomly initialised.
    pub fn from_config(cfg: &BertConfig) -> Result<BertModel> {
        BertModel::build(cfg, true)
    }

    /// `BertModel(config, add_pooling_layer=False)`.
    pub fn without_pooler(cfg: &BertConfig) -> Result<BertModel> {
        BertModel::build(cfg, false)
    }

    fn build(cfg: &BertConfig, pooler: bool) -> Result<BertModel> {
        cfg.validate()?;
        Ok(BertModel {
            config: cfg.clone(),
            embeddings: BertEmbeddings::new(cfg)?,
            encoder: BertEncoder::new(cfg)?,
            pooler: pooler.then(|| BertPooler::new(cfg)).transpose()?,
            training: TrainFlag::default(),
        })
    }

    /// A model folder as Hugging Face saves it: `config.json` + `model.safetensors`.
    /// The model is returned in eval mode (dropout off), as `from_pretrained` does.
    pub fn from_pretrained(dir: impl AsRef<Path>) -> Result<BertModel> {
        let dir = dir.as_ref();
        let cfg = BertConfig::from_file(dir.join("config.json"))?;
        let model = BertModel::from_config(&cfg)?;
        let sd = io::load_safetensors(dir.join("model.safetensors"))?;
        model.load_hf_state_dict(&sd)?;
        model.eval();
        Ok(model)
    }

    /// Loads a Hugging Face checkpoint: keys may carry a `bert.` prefix (as in `BertForMaskedLM`
    /// files); keys that name no parameter here are ignored and listed in the report. A missing
    /// parameter or a wrong shape is an error, and then nothing is written.
    pub fn load_hf_state_dict(&self, sd: &StateDict) -> Result<LoadReport> {
        let mut own = HashSet::new();
        self.visit("", &mut |name, _, _| {
            own.insert(name.to_string());
        });
        let mut report = LoadReport::default();
        let mut wanted = StateDict::new();
        for (key, t) in sd.iter() {
            let name = key.strip_prefix("bert.").unwrap_or(key);
            if own.contains(name) {
                if wanted.insert(name, t.clone()).is_some() {
                    return Err(Error::arg(
                        "BertModel::load_hf_state_dict",
                        format!("parameter \"{name}\" appears both with and without the \"bert.\" prefix"),
                    ));
                }
            } else if !is_known_extra(name) {
                report.ignored.push(key.to_string());
            }
        }
        self.load_state_dict(&wanted, true).map_err(|e| {
            Error::arg(
                "BertModel::load_hf_state_dict",
                format!("checkpoint does not fit this BertConfig: {e}"),
            )
        })?;
        Ok(report)
    }

    /// The additive attention bias for a [batch, seq] mask of 1 (attend) / 0 (padding):
    /// [batch, 1, 1, seq] of 0 and the dtype's most negative value, as Hugging Face builds it, so a
    /// padded key gets exactly zero weight after the softmax.
    pub fn attention_bias(attention_mask: &Tensor, dtype: DType) -> Result<Tensor> {
        if attention_mask.rank() != 2 {
            return Err(Error::shape(
                "BertModel",
                format!(
                    "attention_mask must be [batch, seq_len], got {:?}",
                    attention_mask.shape()
                ),
            ));
        }
        let most_negative = match dtype {
            DType::F64 => f64::MIN,
            DType::F16 => -65504.0,
            _ => f32::MIN as f64,
        };
        let (b, t) = (attention_mask.shape()[0], attention_mask.shape()[1]);
        let keep = attention_mask.to_dtype(dtype)?;
        keep.neg()?
            .add(1.0)?
            .mul(most_negative)?
            .reshape([b, 1, 1, t])
    }

    /// `model(input_ids, attention_mask, token_type_ids)`: `input_ids` [batch, seq] integers;
    /// `attention_mask` [batch, seq] of 1/0 (None: attend everywhere); `token_type_ids` [batch, seq]
    /// (None: all type 0). Returns the last hidden state and, with a pooler, its output.
    pub fn run(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<BertOutput> {
        let last_hidden_state = self.encode(input_ids, attention_mask, token_type_ids)?;
        let pooler_output = match &self.pooler {
            Some(p) => Some(p.forward(&last_hidden_state)?),
            None => None,
        };
        Ok(BertOutput {
            last_hidden_state,
            pooler_output,
        })
    }

    /// `run` without the pooler: the last hidden state [batch, seq, hidden] only.
    pub fn encode(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        check_ids("BertModel", "input_ids", input_ids)?;
        let hidden = self.embeddings.embed(input_ids, token_type_ids)?;
        let bias = match attention_mask {
            Some(m) => {
                if m.shape() != input_ids.shape() {
                    return Err(Error::shape(
                        "BertModel",
                        format!(
                            "attention_mask {:?} must have the shape of input_ids {:?}",
                            m.shape(),
                            input_ids.shape()
                        ),
                    ));
                }
                Some(BertModel::attention_bias(m, hidden.dtype())?)
            }
            None => None,
        };
        self.encoder.run(&hidden, bias.as_ref())
    }
}

impl Module for BertModel {
    /// `input_ids` [batch, seq] → `last_hidden_state` [batch, seq, hidden], attending everywhere.
    /// Use `encode` for an attention mask or token types, `run` for the pooler output too.
    fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.encode(input_ids, None, None)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn visit_own(&self, _: &mut dyn FnMut(&str, &Tensor, TensorKind)) {}
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c = vec![
            ("embeddings".to_string(), &self.embeddings as &dyn Module),
            ("encoder".to_string(), &self.encoder),
        ];
        if let Some(p) = &self.pooler {
            c.push(("pooler".to_string(), p));
        }
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c = vec![
            (
                "embeddings".to_string(),
                &mut self.embeddings as &mut dyn Module,
            ),
            ("encoder".to_string(), &mut self.encoder),
        ];
        if let Some(p) = &mut self.pooler {
            c.push(("pooler".to_string(), p));
        }
        c
    }
}
