//! `nn.Conv2d` over `Tensor::conv2d`; weight [out, in/groups, kh, kw].

use kiln_core::{DType, Error, Result, Tensor};

use crate::init::{default_bound, uniform_parameter};
use crate::module::{Module, TensorKind, TrainFlag};

/// Conv2d's optional arguments, PyTorch's defaults in `Default`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dConfig {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
    pub bias: bool,
}

impl Default for Conv2dConfig {
    fn default() -> Self {
        Conv2dConfig {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
            bias: true,
        }
    }
}

impl Conv2dConfig {
    pub fn stride(mut self, s: usize) -> Self {
        self.stride = [s, s];
        self
    }
    pub fn padding(mut self, p: usize) -> Self {
        self.padding = [p, p];
        self
    }
    pub fn dilation(mut self, d: usize) -> Self {
        self.dilation = [d, d];
        self
    }
    pub fn groups(mut self, g: usize) -> Self {
        self.groups = g;
        self
    }
    pub fn bias(mut self, b: bool) -> Self {
        self.bias = b;
        self
    }
}

pub struct Conv2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel_size: [usize; 2],
    pub config: Conv2dConfig,
    training: TrainFlag,
}

impl Conv2d {
    /// `nn.Conv2d(in, out, kernel_size, stride, padding, dilation, groups, bias)`, float32, with
    /// PyTorch's default init (U(-1/√fan_in, 1/√fan_in), fan_in = in/groups · kh · kw).
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel_size: [usize; 2],
        config: Conv2dConfig,
    ) -> Result<Conv2d> {
        Conv2d::with_dtype(in_channels, out_channels, kernel_size, config, DType::F32)
    }

    pub fn with_dtype(
        in_channels: usize,
        out_channels: usize,
        kernel_size: [usize; 2],
        config: Conv2dConfig,
        dtype: DType,
    ) -> Result<Conv2d> {
        let c = &config;
        let bad = |msg: String| Err(Error::arg("Conv2d", msg));
        if c.groups == 0 {
            return bad("groups must be a positive integer".into());
        }
        if in_channels % c.groups != 0 {
            return bad(format!(
                "in_channels ({in_channels}) must be divisible by groups ({})",
                c.groups
            ));
        }
        if out_channels % c.groups != 0 {
            return bad(format!(
                "out_channels ({out_channels}) must be divisible by groups ({})",
                c.groups
            ));
        }
        if kernel_size.contains(&0) || c.stride.contains(&0) || c.dilation.contains(&0) {
            return bad(format!(
                "kernel_size {kernel_size:?}, stride {:?} and dilation {:?} must be positive",
                c.stride, c.dilation
            ));
        }
        let per_group = in_channels / c.groups;
        let bound = default_bound(per_group * kernel_size[0] * kernel_size[1]);
        let shape = [out_channels, per_group, kernel_size[0], kernel_size[1]];
        let weight = uniform_parameter(&shape, bound, dtype)?;
        let bias = match c.bias {
            true => Some(uniform_parameter(&[out_channels], bound, dtype)?),
            false => None,
        };
        Ok(Conv2d {
            weight,
            bias,
            in_channels,
            out_channels,
            kernel_size,
            config,
            training: TrainFlag::default(),
        })
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() != 4 || x.shape()[1] != self.in_channels {
            return Err(Error::shape(
                "Conv2d",
                format!(
                    "expected input [N, {}, H, W], got {:?}",
                    self.in_channels,
                    x.shape()
                ),
            ));
        }
        let c = &self.config;
        x.conv2d(
            &self.weight,
            self.bias.as_ref(),
            c.stride,
            c.padding,
            c.dilation,
            c.groups,
        )
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn visit_own(&self, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f("weight", &self.weight, TensorKind::Parameter);
        if let Some(b) = &self.bias {
            f("bias", b, TensorKind::Parameter);
        }
    }
    fn visit_own_mut(&mut self, f: &mut dyn FnMut(&str, &mut Tensor, TensorKind)) {
        f("weight", &mut self.weight, TensorKind::Parameter);
        if let Some(b) = &mut self.bias {
            f("bias", b, TensorKind::Parameter);
        }
    }
}
