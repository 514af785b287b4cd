//! ResNet's residual blocks, as torchvision builds them: `BasicBlock` (two 3x3 convs, resnet18/34)
//! and `Bottleneck` (1x1 → 3x3 → 1x1 with 4x expansion, resnet50 and deeper; the stride sits on the
//! 3x3 conv, torchvision's "ResNet v1.5").

use kiln_core::{Result, Tensor};
use kiln_nn::init::FanMode;
use kiln_nn::{BatchNorm2d, Conv2d, Module, ReLU, Sequential, TrainFlag};

use crate::vision_layers::conv_no_bias;

/// The two block designs and how much wider a block's output is than its `planes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    Basic,
    Bottleneck,
}

impl BlockKind {
    pub fn expansion(self) -> usize {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }

    /// One block taking `inplanes` channels to `planes * expansion`, first conv stride `stride`.
    pub(crate) fn build(
        self,
        inplanes: usize,
        planes: usize,
        stride: usize,
    ) -> Result<Box<dyn Module>> {
        let downsample = if stride != 1 || inplanes != planes * self.expansion() {
            Some(downsample(inplanes, planes * self.expansion(), stride)?)
        } else {
            None
        };
        Ok(match self {
            BlockKind::Basic => Box::new(BasicBlock::new(inplanes, planes, stride, downsample)?),
            BlockKind::Bottleneck => {
                Box::new(Bottleneck::new(inplanes, planes, stride, downsample)?)
            }
        })
    }
}

/// The shortcut's projection when shape changes: `Sequential(conv1x1(stride), BatchNorm2d)`, so its
/// keys are `downsample.0.weight` and `downsample.1.*` as in torchvision.
fn downsample(inplanes: usize, outplanes: usize, stride: usize) -> Result<Sequential> {
    Ok(Sequential::new()
        .add(conv_no_bias(
            inplanes,
            outplanes,
            1,
            stride,
            0,
            FanMode::FanOut,
        )?)
        .add(BatchNorm2d::new(outplanes)?))
}

/// `out + shortcut(x)`, then ReLU: the residual join both block kinds end with.
fn residual_join(out: Tensor, x: &Tensor, downsample: Option<&Sequential>) -> Result<Tensor> {
    let identity = match downsample {
        Some(d) => d.forward(x)?,
        None => x.clone(),
    };
    out.add(&identity)?.relu()
}

/// conv3x3(stride) → bn → relu → conv3x3 → bn, plus the shortcut, → relu.
pub struct BasicBlock {
    pub conv1: Conv2d,
    pub bn1: BatchNorm2d,
    pub relu: ReLU,
    pub conv2: Conv2d,
    pub bn2: BatchNorm2d,
    pub downsample: Option<Sequential>,
    training: TrainFlag,
}

impl BasicBlock {
    pub fn new(
        inplanes: usize,
        planes: usize,
        stride: usize,
        downsample: Option<Sequential>,
    ) -> Result<BasicBlock> {
        Ok(BasicBlock {
            conv1: conv_no_bias(inplanes, planes, 3, stride, 1, FanMode::FanOut)?,
            bn1: BatchNorm2d::new(planes)?,
            relu: ReLU::new(),
            conv2: conv_no_bias(planes, planes, 3, 1, 1, FanMode::FanOut)?,
            bn2: BatchNorm2d::new(planes)?,
            downsample,
            training: TrainFlag::default(),
        })
    }
}

impl Module for BasicBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self
            .relu
            .forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?;
        let out = self.bn2.forward(&self.conv2.forward(&out)?)?;
        residual_join(out, x, self.downsample.as_ref())
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = vec![
            ("conv1".into(), &self.conv1),
            ("bn1".into(), &self.bn1),
            ("relu".into(), &self.relu),
            ("conv2".into(), &self.conv2),
            ("bn2".into(), &self.bn2),
        ];
        if let Some(d) = &self.downsample {
            c.push(("downsample".into(), d));
        }
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c: Vec<(String, &mut dyn Module)> = vec![
            ("conv1".into(), &mut self.conv1),
            ("bn1".into(), &mut self.bn1),
            ("relu".into(), &mut self.relu),
            ("conv2".into(), &mut self.conv2),
            ("bn2".into(), &mut self.bn2),
        ];
        if let Some(d) = &mut self.downsample {
            c.push(("downsample".into(), d));
        }
        c
    }
}

/// conv1x1 → bn → relu → conv3x3(stride) → bn → relu → conv1x1 (x4 channels) → bn, plus the
/// shortcut, → relu.
pub struct Bottleneck {
    pub conv1: Conv2d,
    pub bn1: BatchNorm2d,
    pub conv2: Conv2d,
    pub bn2: BatchNorm2d,
    pub conv3: Conv2d,
    pub bn3: BatchNorm2d,
    pub relu: ReLU,
    pub downsample: Option<Sequential>,
    training: TrainFlag,
}

impl Bottleneck {
    pub fn new(
        inplanes: usize,
        planes: usize,
        stride: usize,
        downsample: Option<Sequential>,
    ) -> Result<Bottleneck> {
        // torchvision's width = planes * (base_width / 64) * groups, which is `planes` for the
        // standard (non-wide, non-grouped) ResNets built here
        let width = planes;
        let out = planes * BlockKind::Bottleneck.expansion();
        Ok(Bottleneck {
            conv1: conv_no_bias(inplanes, width, 1, 1, 0, FanMode::FanOut)?,
            bn1: BatchNorm2d::new(width)?,
            conv2: conv_no_bias(width, width, 3, stride, 1, FanMode::FanOut)?,
            bn2: BatchNorm2d::new(width)?,
            conv3: conv_no_bias(width, out, 1, 1, 0, FanMode::FanOut)?,
            bn3: BatchNorm2d::new(out)?,
            relu: ReLU::new(),
            downsample,
            training: TrainFlag::default(),
        })
    }
}

impl Module for Bottleneck {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self
            .relu
            .forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?;
        let out = self
            .relu
            .forward(&self.bn2.forward(&self.conv2.forward(&out)?)?)?;
        let out = self.bn3.forward(&self.conv3.forward(&out)?)?;
        residual_join(out, x, self.downsample.as_ref())
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = vec![
            ("conv1".into(), &self.conv1),
            ("bn1".into(), &self.bn1),
            ("conv2".into(), &self.conv2),
            ("bn2".into(), &self.bn2),
            ("conv3".into(), &self.conv3),
            ("bn3".into(), &self.bn3),
            ("relu".into(), &self.relu),
        ];
        if let Some(d) = &self.downsample {
            c.push(("downsample".into(), d));
        }
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c: Vec<(String, &mut dyn Module)> = vec![
            ("conv1".into(), &mut self.conv1),
            ("bn1".into(), &mut self.bn1),
            ("conv2".into(), &mut self.conv2),
            ("bn2".into(), &mut self.bn2),
            ("conv3".into(), &mut self.conv3),
            ("bn3".into(), &mut self.bn3),
            ("relu".into(), &mut self.relu),
        ];
        if let Some(d) = &mut self.downsample {
            c.push(("downsample".into(), d));
        }
        c
    }
}
