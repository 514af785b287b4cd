//! One transformer block (`BertLayer`: attention, then the GELU MLP) and the stack of them
//! (`BertEncoder`, whose blocks are named `layer.0`, `layer.1`, .. as in Hugging Face).

use kiln_core::{Result, Tensor};
use kiln_nn::{Linear, Module, TrainFlag};

use super::attention::{BertAttention, BertResidualOutput};
use super::config::BertConfig;

/// The MLP's expansion: dense (hidden → intermediate) then exact GELU.
pub struct BertIntermediate {
    pub dense: Linear,
    training: TrainFlag,
}

impl BertIntermediate {
    pub fn new(cfg: &BertConfig) -> Result<BertIntermediate> {
        Ok(BertIntermediate {
            dense: Linear::new(cfg.hidden_size, cfg.intermediate_size, true)?,
            training: TrainFlag::default(),
        })
    }
}

impl Module for BertIntermediate {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.dense.forward(x)?.gelu()
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

pub struct BertLayer {
    pub attention: BertAttention,
    pub intermediate: BertIntermediate,
    /// The MLP's contraction (intermediate → hidden) + residual + LayerNorm.
    pub output: BertResidualOutput,
    training: TrainFlag,
}

impl BertLayer {
    pub fn new(cfg: &BertConfig) -> Result<BertLayer> {
        Ok(BertLayer {
            attention: BertAttention::new(cfg)?,
            intermediate: BertIntermediate::new(cfg)?,
            output: BertResidualOutput::new(cfg, cfg.intermediate_size)?,
            training: TrainFlag::default(),
        })
    }

    pub fn run(&self, hidden: &Tensor, mask_bias: Option<&Tensor>) -> Result<Tensor> {
        let attended = self.attention.attend(hidden, mask_bias)?;
        self.output
            .project(&self.intermediate.forward(&attended)?, &attended)
    }
}

impl Module for BertLayer {
    fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        self.run(hidden, None)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("attention".into(), &self.attention as &dyn Module),
            ("intermediate".into(), &self.intermediate),
            ("output".into(), &self.output),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("attention".into(), &mut self.attention as &mut dyn Module),
            ("intermediate".into(), &mut self.intermediate),
            ("output".into(), &mut self.output),
        ]
    }
}

/// The blocks as a list module, so their names are `0`, `1`, .. under `layer` (PyTorch's
/// `nn.ModuleList`, typed so the blocks keep their masked `run`).
pub struct BertLayerList {
    pub layers: Vec<BertLayer>,
    training: TrainFlag,
}

impl Module for BertLayerList {
    fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        self.layers
            .iter()
            .try_fold(hidden.clone(), |h, layer| layer.run(&h, None))
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| (i.to_string(), l as &dyn Module))
            .collect()
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        self.layers
            .iter_mut()
            .enumerate()
            .map(|(i, l)| (i.to_string(), l as &mut dyn Module))
            .collect()
    }
}

pub struct BertEncoder {
    pub layer: BertLayerList,
    training: TrainFlag,
}

impl BertEncoder {
    pub fn new(cfg: &BertConfig) -> Result<BertEncoder> {
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| BertLayer::new(cfg))
            .collect::<Result<Vec<_>>>()?;
        Ok(BertEncoder {
            layer: BertLayerList {
                layers,
                training: TrainFlag::default(),
            },
            training: TrainFlag::default(),
        })
    }

    pub fn run(&self, hidden: &Tensor, mask_bias: Option<&Tensor>) -> Result<Tensor> {
        self.layer
            .layers
            .iter()
            .try_fold(hidden.clone(), |h, layer| layer.run(&h, mask_bias))
    }
}

impl Module for BertEncoder {
    fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        self.run(hidden, None)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("layer".into(), &self.layer as &dyn Module)]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![("layer".into(), &mut self.layer as &mut dyn Module)]
    }
}
