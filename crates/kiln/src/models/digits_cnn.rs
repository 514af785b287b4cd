//! A small CNN for the 8x8 digits: two conv/relu/maxpool stages and a two-layer classifier with dropout.

use kiln_core::{Result, Tensor};
use kiln_nn::{
    Conv2d, Conv2dConfig, Dropout, Linear, MaxPool2d, Module, ReLU, Sequential, TensorKind,
    TrainFlag,
};

pub struct DigitsCnn {
    net: Sequential,
    training: TrainFlag,
}

impl DigitsCnn {
    pub fn new() -> Result<DigitsCnn> {
        let same = Conv2dConfig {
            padding: [1, 1],
            ..Conv2dConfig::default()
        };
        let net = Sequential::new()
            .add(Conv2d::new(1, 32, [3, 3], same)?)
            .add(ReLU::new())
            .add(MaxPool2d::new(2)?)
            .add(Conv2d::new(32, 64, [3, 3], same)?)
            .add(ReLU::new())
            .add(MaxPool2d::new(2)?)
            .add(kiln_nn::Flatten::new(1, -1))
            .add(Linear::new(64 * 2 * 2, 128, true)?)
            .add(ReLU::new())
            .add(Dropout::new(0.3)?)
            .add(Linear::new(128, 10, true)?);
        Ok(DigitsCnn {
            net,
            training: TrainFlag::default(),
        })
    }
}

impl Module for DigitsCnn {
    /// `x`: [N, 64] pixels in [0, 1] (or [N, 1, 8, 8]); returns [N, 10] logits.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.net.forward(&x.reshape([-1, 1, 8, 8])?)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn visit_own(&self, _: &mut dyn FnMut(&str, &Tensor, TensorKind)) {}
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("net".to_string(), &self.net as &dyn Module)]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![("net".to_string(), &mut self.net as &mut dyn Module)]
    }
}
