//! `nn.MaxPool2d`, `nn.AvgPool2d`, `nn.AdaptiveAvgPool2d` over the matching `Tensor` ops.

use kiln_core::{Error, Result, Tensor};

use crate::module::{Module, TrainFlag};

fn check_pool(op: &'static str, kernel: [usize; 2], stride: [usize; 2]) -> Result<()> {
    if kernel.contains(&0) || stride.contains(&0) {
        return Err(Error::arg(
            op,
            format!("kernel_size {kernel:?} and stride {stride:?} must be positive"),
        ));
    }
    Ok(())
}

/// `nn.MaxPool2d(kernel_size, stride, padding)`.
pub struct MaxPool2d {
    pub kernel_size: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    training: TrainFlag,
}

impl MaxPool2d {
    /// `nn.MaxPool2d(k)`: stride defaults to the kernel size, no padding.
    pub fn new(kernel_size: usize) -> Result<MaxPool2d> {
        MaxPool2d::with_config([kernel_size; 2], [kernel_size; 2], [0, 0])
    }
    pub fn with_config(
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<MaxPool2d> {
        check_pool("MaxPool2d", kernel_size, stride)?;
        Ok(MaxPool2d {
            kernel_size,
            stride,
            padding,
            training: TrainFlag::default(),
        })
    }
}

impl Module for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.max_pool2d(self.kernel_size, self.stride, self.padding)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
}

/// `nn.AvgPool2d(kernel_size, stride, padding, count_include_pad)`.
pub struct AvgPool2d {
    pub kernel_size: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub count_include_pad: bool,
    training: TrainFlag,
}

impl AvgPool2d {
    /// `nn.AvgPool2d(k)`: stride defaults to the kernel size, no padding.
    pub fn new(kernel_size: usize) -> Result<AvgPool2d> {
        AvgPool2d::with_config([kernel_size; 2], [kernel_size; 2], [0, 0], true)
    }
    pub fn with_config(
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
    ) -> Result<AvgPool2d> {
        check_pool("AvgPool2d", kernel_size, stride)?;
        Ok(AvgPool2d {
            kernel_size,
            stride,
            padding,
            count_include_pad,
            training: TrainFlag::default(),
        })
    }
}

impl Module for AvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.avg_pool2d(
            self.kernel_size,
            self.stride,
            self.padding,
            self.count_include_pad,
        )
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
}

/// `nn.AdaptiveAvgPool2d(output_size)`.
pub struct AdaptiveAvgPool2d {
    pub output_size: [usize; 2],
    training: TrainFlag,
}

impl AdaptiveAvgPool2d {
    pub fn new(output_size: [usize; 2]) -> Result<AdaptiveAvgPool2d> {
        if output_size.contains(&0) {
            return Err(Error::arg(
                "AdaptiveAvgPool2d",
                format!("output_size {output_size:?} must be positive"),
            ));
        }
        Ok(AdaptiveAvgPool2d {
            output_size,
            training: TrainFlag::default(),
        })
    }
}

impl Module for AdaptiveAvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.adaptive_avg_pool2d(self.output_size)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
}
