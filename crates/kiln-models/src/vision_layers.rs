//! Pieces the torchvision models share: bias-free convolutions with Kaiming-normal init, and the
//! check that a model's input is an NCHW image batch with the channels it expects.

use kiln_core::{Error, Result, Tensor};
use kiln_nn::init::{kaiming_normal_, FanMode};
use kiln_nn::{Conv2d, Conv2dConfig};

/// `nn.Conv2d(cin, cout, k, stride, padding, bias=False)` followed by torchvision's
/// `kaiming_normal_(weight, mode)` (ReLU gain √2): ResNet scales by fan_out, DenseNet by fan_in.
pub(crate) fn conv_no_bias(
    cin: usize,
    cout: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    mode: FanMode,
) -> Result<Conv2d> {
    let config = Conv2dConfig::default()
        .stride(stride)
        .padding(padding)
        .bias(false);
    let conv = Conv2d::new(cin, cout, [kernel, kernel], config)?;
    kaiming_normal_(&conv.weight, 0.0, mode)?;
    Ok(conv)
}

/// `model` expects [N, `channels`, H, W]; anything else is an error naming the model and the shape,
/// before any layer (or any running statistic) is touched.
pub(crate) fn check_image_batch(model: &'static str, x: &Tensor, channels: usize) -> Result<()> {
    if x.rank() != 4 || x.shape()[1] != channels {
        return Err(Error::shape(
            model,
            format!(
                "expected a 4-D image batch [N, {channels}, H, W], got a {}-D tensor of shape {:?}",
                x.rank(),
                x.shape()
            ),
        ));
    }
    if x.shape()[0] == 0 {
        return Err(Error::shape(
            model,
            format!("expected at least one image, got shape {:?}", x.shape()),
        ));
    }
    Ok(())
}

/// The classifier size must be positive (a zero-width head has nothing to predict).
pub(crate) fn check_num_classes(model: &'static str, num_classes: usize) -> Result<()> {
    if num_classes == 0 {
        return Err(Error::arg(model, "num_classes must be at least 1"));
    }
    Ok(())
}
