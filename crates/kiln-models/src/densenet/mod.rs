//! DenseNet, torchvision's architecture and state-dict key names (`features.conv0.weight`,
//! `features.denseblock1.denselayer1.norm1.running_mean`, `features.transition1.conv.weight`,
//! `features.norm5.bias`, `classifier.weight`), so state dicts move between kiln and torchvision:
//!
//! features: conv0 (7x7/2, pad 3, no bias) → norm0 → relu0 → pool0 (max 3/2, pad 1) →
//! denseblock1 → transition1 → ... → denseblock4 → norm5; then relu → adaptive average pool to 1x1
//! → flatten → classifier.
//!
//! Initialisation follows torchvision: Kaiming-normal (fan_in, ReLU gain) for every conv,
//! BatchNorm weight 1 and bias 0, classifier bias 0 (its weight keeps PyTorch's Linear default).

mod blocks;

pub use blocks::{DenseBlock, DenseLayer, Transition};

use kiln_core::{Error, Result, Tensor};
use kiln_nn::init::{zeros_, FanMode};
use kiln_nn::{BatchNorm2d, Conv2d, Linear, MaxPool2d, Module, ReLU, TrainFlag};

use crate::vision_layers::{check_image_batch, check_num_classes, conv_no_bias};

/// `torchvision.models.DenseNet`'s hyperparameters.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseNetConfig {
    /// Channels each dense layer adds (`k` in the paper).
    pub growth_rate: usize,
    /// Dense layers per block.
    pub block_config: Vec<usize>,
    /// Channels of the stem convolution.
    pub num_init_features: usize,
    /// The 1x1 bottleneck is `bn_size * growth_rate` channels wide.
    pub bn_size: usize,
    /// Dropout after each dense layer (0 disables it).
    pub drop_rate: f64,
}

impl DenseNetConfig {
    /// DenseNet-121: growth 32, blocks (6, 12, 24, 16), 64 stem channels, bn_size 4, no dropout.
    pub fn densenet121() -> Self {
        DenseNetConfig {
            growth_rate: 32,
            block_config: vec![6, 12, 24, 16],
            num_init_features: 64,
            bn_size: 4,
            drop_rate: 0.0,
        }
    }
}

/// The `features` submodule: the stem, the dense blocks with transitions between them, and norm5.
pub struct DenseNetFeatures {
    pub conv0: Conv2d,
    pub norm0: BatchNorm2d,
    pub relu0: ReLU,
    pub pool0: MaxPool2d,
    /// `denseblock{i+1}`.
    pub blocks: Vec<DenseBlock>,
    /// `transition{i+1}`, after every block but the last.
    pub transitions: Vec<Transition>,
    pub norm5: BatchNorm2d,
    /// Channels leaving norm5 (the classifier's input width).
    pub num_features: usize,
    training: TrainFlag,
}

impl DenseNetFeatures {
    fn new(c: &DenseNetConfig) -> Result<DenseNetFeatures> {
        let mut blocks = Vec::new();
        let mut transitions = Vec::new();
        let mut num_features = c.num_init_features;
        for (i, &num_layers) in c.block_config.iter().enumerate() {
            blocks.push(DenseBlock::new(
                num_layers,
                num_features,
                c.bn_size,
                c.growth_rate,
                c.drop_rate,
            )?);
            num_features += num_layers * c.growth_rate;
            if i + 1 != c.block_config.len() {
                transitions.push(Transition::new(num_features, num_features / 2)?);
                num_features /= 2;
            }
        }
        Ok(DenseNetFeatures {
            conv0: conv_no_bias(3, c.num_init_features, 7, 2, 3, FanMode::FanIn)?,
            norm0: BatchNorm2d::new(c.num_init_features)?,
            relu0: ReLU::new(),
            pool0: MaxPool2d::with_config([3, 3], [2, 2], [1, 1])?,
            blocks,
            transitions,
            norm5: BatchNorm2d::new(num_features)?,
            num_features,
            training: TrainFlag::default(),
        })
    }
}

impl Module for DenseNetFeatures {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self
            .relu0
            .forward(&self.norm0.forward(&self.conv0.forward(x)?)?)?;
        let mut x = self.pool0.forward(&x)?;
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x)?;
            if let Some(t) = self.transitions.get(i) {
                x = t.forward(&x)?;
            }
        }
        self.norm5.forward(&x)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    /// torchvision's registration order: blocks and transitions interleaved.
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = vec![
            ("conv0".into(), &self.conv0),
            ("norm0".into(), &self.norm0),
            ("relu0".into(), &self.relu0),
            ("pool0".into(), &self.pool0),
        ];
        for (i, block) in self.blocks.iter().enumerate() {
            c.push((format!("denseblock{}", i + 1), block));
            if let Some(t) = self.transitions.get(i) {
                c.push((format!("transition{}", i + 1), t));
            }
        }
        c.push(("norm5".into(), &self.norm5));
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c: Vec<(String, &mut dyn Module)> = vec![
            ("conv0".into(), &mut self.conv0),
            ("norm0".into(), &mut self.norm0),
            ("relu0".into(), &mut self.relu0),
            ("pool0".into(), &mut self.pool0),
        ];
        let mut transitions = self.transitions.iter_mut();
        for (i, block) in self.blocks.iter_mut().enumerate() {
            c.push((format!("denseblock{}", i + 1), block));
            if let Some(t) = transitions.next() {
                c.push((format!("transition{}", i + 1), t));
            }
        }
        c.push(("norm5".into(), &mut self.norm5));
        c
    }
}

pub struct DenseNet {
    pub features: DenseNetFeatures,
    pub classifier: Linear,
    pub config: DenseNetConfig,
    training: TrainFlag,
}

impl DenseNet {
    pub fn new(config: DenseNetConfig, num_classes: usize) -> Result<DenseNet> {
        check_num_classes("DenseNet", num_classes)?;
        let c = &config;
        if c.growth_rate == 0 || c.bn_size == 0 || c.num_init_features == 0 {
            return Err(Error::arg(
                "DenseNet",
                format!(
                    "growth_rate ({}), bn_size ({}) and num_init_features ({}) must be positive",
                    c.growth_rate, c.bn_size, c.num_init_features
                ),
            ));
        }
        if c.block_config.is_empty() || !(0.0..1.0).contains(&c.drop_rate) {
            return Err(Error::arg(
                "DenseNet",
                format!(
                    "need at least one dense block and drop_rate in [0, 1), got block_config \
                     {:?} and drop_rate {}",
                    c.block_config, c.drop_rate
                ),
            ));
        }
        let features = DenseNetFeatures::new(c)?;
        let classifier = Linear::new(features.num_features, num_classes, true)?;
        if let Some(b) = &classifier.bias {
            zeros_(b)?;
        }
        Ok(DenseNet {
            features,
            classifier,
            config,
            training: TrainFlag::default(),
        })
    }
}

impl DenseNet {
    /// The stem divides H and W by 4 and each transition's 2x2 pooling halves them again, so the
    /// stem's output must be at least 2^transitions pixels on each side.
    fn check_input_size(&self, x: &Tensor) -> Result<()> {
        // conv0 (7x7/2, pad 3) and pool0 (3/2, pad 1) both map a side of n ≥ 1 to (n - 1) / 2 + 1
        let halve = |n: usize| (n - 1) / 2 + 1;
        let need = 1usize << self.features.transitions.len();
        let (h, w) = (x.shape()[2], x.shape()[3]);
        if h == 0 || w == 0 || halve(halve(h)) < need || halve(halve(w)) < need {
            return Err(Error::shape(
                "DenseNet",
                format!(
                    "input {:?} is too small: after the stem it must be at least {need}x{need} \
                     so that each of the {} transitions can pool 2x2 (images of at least {}x{})",
                    x.shape(),
                    self.features.transitions.len(),
                    4 * need - 3,
                    4 * need - 3
                ),
            ));
        }
        Ok(())
    }
}

/// DenseNet-121 (7,978,856 parameters with 1000 classes).
pub fn densenet121(num_classes: usize) -> Result<DenseNet> {
    DenseNet::new(DenseNetConfig::densenet121(), num_classes)
}

impl Module for DenseNet {
    /// `x`: [N, 3, H, W] float32 images, at least 29x29 for four dense blocks (see
    /// `check_input_size`); returns [N, num_classes] logits.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_image_batch("DenseNet", x, 3)?;
        self.check_input_size(x)?;
        let y = self.features.forward(x)?.relu()?;
        let y = y.adaptive_avg_pool2d([1, 1])?.flatten(1, -1)?;
        self.classifier.forward(&y)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("features".into(), &self.features),
            ("classifier".into(), &self.classifier),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("features".into(), &mut self.features),
            ("classifier".into(), &mut self.classifier),
        ]
    }
}
