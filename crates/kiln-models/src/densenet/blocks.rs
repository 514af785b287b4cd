//! DenseNet's building blocks, as torchvision builds them: a dense layer (BN-ReLU-conv1x1 bottleneck,
//! BN-ReLU-conv3x3 producing `growth_rate` new channels), a dense block (each layer sees the
//! concatenation of the block input and every earlier layer's output) and a transition (BN-ReLU-
//! conv1x1 halving the channels, then 2x2 average pooling).

use kiln_core::{Result, Tensor};
use kiln_nn::init::FanMode;
use kiln_nn::{AvgPool2d, BatchNorm2d, Conv2d, Module, ReLU, TrainFlag};

use crate::vision_layers::conv_no_bias;

/// torchvision's `_DenseLayer` (its memory-efficient checkpointing variant computes the same values).
pub struct DenseLayer {
    pub norm1: BatchNorm2d,
    pub relu1: ReLU,
    pub conv1: Conv2d,
    pub norm2: BatchNorm2d,
    pub relu2: ReLU,
    pub conv2: Conv2d,
    pub drop_rate: f64,
    training: TrainFlag,
}

impl DenseLayer {
    pub fn new(
        num_input_features: usize,
        growth_rate: usize,
        bn_size: usize,
        drop_rate: f64,
    ) -> Result<DenseLayer> {
        let bottleneck = bn_size * growth_rate;
        Ok(DenseLayer {
            norm1: BatchNorm2d::new(num_input_features)?,
            relu1: ReLU::new(),
            conv1: conv_no_bias(num_input_features, bottleneck, 1, 1, 0, FanMode::FanIn)?,
            norm2: BatchNorm2d::new(bottleneck)?,
            relu2: ReLU::new(),
            conv2: conv_no_bias(bottleneck, growth_rate, 3, 1, 1, FanMode::FanIn)?,
            drop_rate,
            training: TrainFlag::default(),
        })
    }
}

impl Module for DenseLayer {
    /// `x`: the concatenation of every earlier feature map of the block; returns the
    /// `growth_rate` new channels.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self
            .conv1
            .forward(&self.relu1.forward(&self.norm1.forward(x)?)?)?;
        let y = self
            .conv2
            .forward(&self.relu2.forward(&self.norm2.forward(&y)?)?)?;
        if self.drop_rate > 0.0 {
            return y.dropout(self.drop_rate, self.is_training());
        }
        Ok(y)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("norm1".into(), &self.norm1),
            ("relu1".into(), &self.relu1),
            ("conv1".into(), &self.conv1),
            ("norm2".into(), &self.norm2),
            ("relu2".into(), &self.relu2),
            ("conv2".into(), &self.conv2),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("norm1".into(), &mut self.norm1),
            ("relu1".into(), &mut self.relu1),
            ("conv1".into(), &mut self.conv1),
            ("norm2".into(), &mut self.norm2),
            ("relu2".into(), &mut self.relu2),
            ("conv2".into(), &mut self.conv2),
        ]
    }
}

/// torchvision's `_DenseBlock`: layers named `denselayer1`, `denselayer2`, ...
pub struct DenseBlock {
    pub layers: Vec<DenseLayer>,
    training: TrainFlag,
}

impl DenseBlock {
    pub fn new(
        num_layers: usize,
        num_input_features: usize,
        bn_size: usize,
        growth_rate: usize,
        drop_rate: f64,
    ) -> Result<DenseBlock> {
        let layers = (0..num_layers)
            .map(|i| {
                DenseLayer::new(
                    num_input_features + i * growth_rate,
                    growth_rate,
                    bn_size,
                    drop_rate,
                )
            })
            .collect::<Result<_>>()?;
        Ok(DenseBlock {
            layers,
            training: TrainFlag::default(),
        })
    }
}

impl Module for DenseBlock {
    /// Returns the input with every layer's new channels appended, in order. torchvision
    /// concatenates the whole list before each layer; appending to a running concatenation gives
    /// the same tensor with two-input concatenations (a smaller graph when compiled).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut features = x.clone();
        for layer in &self.layers {
            let new = layer.forward(&features)?;
            features = Tensor::cat(&[&features, &new], 1)?;
        }
        Ok(features)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| (format!("denselayer{}", i + 1), l as &dyn Module))
            .collect()
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        self.layers
            .iter_mut()
            .enumerate()
            .map(|(i, l)| (format!("denselayer{}", i + 1), l as &mut dyn Module))
            .collect()
    }
}

/// torchvision's `_Transition`: norm → relu → conv1x1 (`num_output_features`) → avgpool 2x2/2.
pub struct Transition {
    pub norm: BatchNorm2d,
    pub relu: ReLU,
    pub conv: Conv2d,
    pub pool: AvgPool2d,
    training: TrainFlag,
}

impl Transition {
    pub fn new(num_input_features: usize, num_output_features: usize) -> Result<Transition> {
        Ok(Transition {
            norm: BatchNorm2d::new(num_input_features)?,
            relu: ReLU::new(),
            conv: conv_no_bias(
                num_input_features,
                num_output_features,
                1,
                1,
                0,
                FanMode::FanIn,
            )?,
            pool: AvgPool2d::new(2)?,
            training: TrainFlag::default(),
        })
    }
}

impl Module for Transition {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.relu.forward(&self.norm.forward(x)?)?;
        self.pool.forward(&self.conv.forward(&y)?)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("norm".into(), &self.norm),
            ("relu".into(), &self.relu),
            ("conv".into(), &self.conv),
            ("pool".into(), &self.pool),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("norm".into(), &mut self.norm),
            ("relu".into(), &mut self.relu),
            ("conv".into(), &mut self.conv),
            ("pool".into(), &mut self.pool),
        ]
    }
}
