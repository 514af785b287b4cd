//! ResNet, torchvision's architecture and state-dict key names, so `resnet18().state_dict()` and
//! `torchvision.models.resnet18().state_dict()` have the same keys and shapes and load into each other:
//!
//! conv1 (7x7/2, pad 3, no bias) → bn1 → relu → maxpool (3/2, pad 1) → layer1..layer4 (residual
//! blocks; the first block of layer2..4 halves the resolution) → avgpool (adaptive, 1x1) → flatten → fc.
//!
//! Initialisation follows torchvision: Kaiming-normal (fan_out, ReLU gain) for every conv, BatchNorm
//! weight 1 and bias 0, PyTorch's default init for `fc`.

mod blocks;

pub use blocks::{BasicBlock, BlockKind, Bottleneck};

use kiln_core::{Result, Tensor};
use kiln_nn::init::FanMode;
use kiln_nn::{
    AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Linear, MaxPool2d, Module, ReLU, Sequential, TrainFlag,
};

use crate::vision_layers::{check_image_batch, check_num_classes, conv_no_bias};

pub struct ResNet {
    pub conv1: Conv2d,
    pub bn1: BatchNorm2d,
    pub relu: ReLU,
    pub maxpool: MaxPool2d,
    pub layer1: Sequential,
    pub layer2: Sequential,
    pub layer3: Sequential,
    pub layer4: Sequential,
    pub avgpool: AdaptiveAvgPool2d,
    pub fc: Linear,
    pub kind: BlockKind,
    training: TrainFlag,
}

impl ResNet {
    /// `torchvision.models.ResNet(block, layers, num_classes)`: `layers[i]` blocks in stage i, stage
    /// widths 64, 128, 256, 512 (times the block's expansion at the output).
    pub fn new(kind: BlockKind, layers: [usize; 4], num_classes: usize) -> Result<ResNet> {
        check_num_classes("ResNet", num_classes)?;
        if layers.contains(&0) {
            return Err(kiln_core::Error::arg(
                "ResNet",
                format!("every stage needs at least one block, got layers {layers:?}"),
            ));
        }
        let mut inplanes = 64;
        let mut stage = |planes: usize, blocks: usize, stride: usize| -> Result<Sequential> {
            let mut seq = Sequential::new();
            seq.push_boxed(kind.build(inplanes, planes, stride)?);
            inplanes = planes * kind.expansion();
            for _ in 1..blocks {
                seq.push_boxed(kind.build(inplanes, planes, 1)?);
            }
            Ok(seq)
        };
        let layer1 = stage(64, layers[0], 1)?;
        let layer2 = stage(128, layers[1], 2)?;
        let layer3 = stage(256, layers[2], 2)?;
        let layer4 = stage(512, layers[3], 2)?;
        Ok(ResNet {
            conv1: conv_no_bias(3, 64, 7, 2, 3, FanMode::FanOut)?,
            bn1: BatchNorm2d::new(64)?,
            relu: ReLU::new(),
            maxpool: MaxPool2d::with_config([3, 3], [2, 2], [1, 1])?,
            layer1,
            layer2,
            layer3,
            layer4,
            avgpool: AdaptiveAvgPool2d::new([1, 1])?,
            fc: Linear::new(512 * kind.expansion(), num_classes, true)?,
            kind,
            training: TrainFlag::default(),
        })
    }
}

/// ResNet-18: BasicBlock, [2, 2, 2, 2] (11,689,512 parameters with 1000 classes).
pub fn resnet18(num_classes: usize) -> Result<ResNet> {
    ResNet::new(BlockKind::Basic, [2, 2, 2, 2], num_classes)
}

/// ResNet-34: BasicBlock, [3, 4, 6, 3].
pub fn resnet34(num_classes: usize) -> Result<ResNet> {
    ResNet::new(BlockKind::Basic, [3, 4, 6, 3], num_classes)
}

/// ResNet-50: Bottleneck, [3, 4, 6, 3].
pub fn resnet50(num_classes: usize) -> Result<ResNet> {
    ResNet::new(BlockKind::Bottleneck, [3, 4, 6, 3], num_classes)
}

impl Module for ResNet {
    /// `x`: [N, 3, H, W] float32 images; returns [N, num_classes] logits.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_image_batch("ResNet", x, 3)?;
        let x = self.conv1.forward(x)?;
        let x = self.relu.forward(&self.bn1.forward(&x)?)?;
        let mut x = self.maxpool.forward(&x)?;
        for layer in [&self.layer1, &self.layer2, &self.layer3, &self.layer4] {
            x = layer.forward(&x)?;
        }
        let x = self.avgpool.forward(&x)?.flatten(1, -1)?;
        self.fc.forward(&x)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("conv1".into(), &self.conv1),
            ("bn1".into(), &self.bn1),
            ("relu".into(), &self.relu),
            ("maxpool".into(), &self.maxpool),
            ("layer1".into(), &self.layer1),
            ("layer2".into(), &self.layer2),
            ("layer3".into(), &self.layer3),
            ("layer4".into(), &self.layer4),
            ("avgpool".into(), &self.avgpool),
            ("fc".into(), &self.fc),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("conv1".into(), &mut self.conv1),
            ("bn1".into(), &mut self.bn1),
            ("relu".into(), &mut self.relu),
            ("maxpool".into(), &mut self.maxpool),
            ("layer1".into(), &mut self.layer1),
            ("layer2".into(), &mut self.layer2),
            ("layer3".into(), &mut self.layer3),
            ("layer4".into(), &mut self.layer4),
            ("avgpool".into(), &mut self.avgpool),
            ("fc".into(), &mut self.fc),
        ]
    }
}
