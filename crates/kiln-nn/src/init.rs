//! `torch.nn.init`: in-place initialisers, and the helpers layers use to build their parameters.
//! In-place means `assign` under `no_grad`, so an initialised parameter keeps its identity.

use kiln_core::{no_grad, DType, Error, Result, Tensor};

fn float_only(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::dtype(
            op,
            t.dtype(),
            "initialisers need a floating-point tensor",
        ));
    }
    Ok(())
}

/// `fan_in` and `fan_out` of a weight, PyTorch's `_calculate_fan_in_and_fan_out`: dim 1 and dim 0
/// times the receptive field (the product of the trailing dims).
pub fn fan_in_and_fan_out(shape: &[usize]) -> Result<(usize, usize)> {
    if shape.len() < 2 {
        return Err(Error::shape(
            "init",
            format!("fan in and fan out can not be computed for tensor with fewer than 2 dimensions, got {shape:?}"),
        ));
    }
    let receptive: usize = shape[2..].iter().product();
    Ok((shape[1] * receptive, shape[0] * receptive))
}

/// `nn.init.uniform_(t, low, high)`.
pub fn uniform_(t: &Tensor, low: f64, high: f64) -> Result<()> {
    float_only("uniform_", t)?;
    no_grad(|| t.assign(&Tensor::uniform(t.shape(), low, high, t.dtype())?))
}

/// `nn.init.normal_(t, mean, std)`.
pub fn normal_(t: &Tensor, mean: f64, std: f64) -> Result<()> {
    float_only("normal_", t)?;
    no_grad(|| t.assign(&Tensor::randn(t.shape(), t.dtype())?.mul(std)?.add(mean)?))
}

/// `nn.init.constant_(t, value)`.
pub fn constant_(t: &Tensor, value: f64) -> Result<()> {
    no_grad(|| t.assign(&Tensor::full(t.shape(), value, t.dtype())?))
}

pub fn zeros_(t: &Tensor) -> Result<()> {
    constant_(t, 0.0)
}

pub fn ones_(t: &Tensor) -> Result<()> {
    constant_(t, 1.0)
}

/// `nn.init.kaiming_uniform_(t, a, mode='fan_in', nonlinearity='leaky_relu')`:
/// bound = gain * sqrt(3 / fan_in) with gain = sqrt(2 / (1 + a²)).
pub fn kaiming_uniform_(t: &Tensor, a: f64) -> Result<()> {
    let (fan_in, _) = fan_in_and_fan_out(t.shape())?;
    let gain = (2.0 / (1.0 + a * a)).sqrt();
    let bound = if fan_in == 0 {
        0.0
    } else {
        gain * (3.0 / fan_in as f64).sqrt()
    };
    uniform_(t, -bound, bound)
}

/// Which fan Kaiming initialisation scales by: `fan_in` keeps the forward pass's activation variance,
/// `fan_out` the backward pass's gradient variance (what torchvision's ResNet uses).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FanMode {
    #[default]
    FanIn,
    FanOut,
}

/// `nn.init.kaiming_normal_(t, a, mode, nonlinearity='leaky_relu')`: N(0, std²) with
/// std = gain / sqrt(fan), gain = sqrt(2 / (1 + a²)). `a = 0` is also PyTorch's `nonlinearity='relu'`
/// (gain √2), so `kaiming_normal_(w, 0.0, FanMode::FanOut)` is torchvision's ResNet conv init.
pub fn kaiming_normal_(t: &Tensor, a: f64, mode: FanMode) -> Result<()> {
    let (fan_in, fan_out) = fan_in_and_fan_out(t.shape())?;
    let fan = match mode {
        FanMode::FanIn => fan_in,
        FanMode::FanOut => fan_out,
    };
    if fan == 0 {
        // PyTorch warns and leaves an empty tensor alone; there is nothing to draw
        return Ok(());
    }
    let gain = (2.0 / (1.0 + a * a)).sqrt();
    normal_(t, 0.0, gain / (fan as f64).sqrt())
}

/// `nn.init.xavier_uniform_(t, gain)`: bound = gain * sqrt(6 / (fan_in + fan_out)).
pub fn xavier_uniform_(t: &Tensor, gain: f64) -> Result<()> {
    let (fan_in, fan_out) = fan_in_and_fan_out(t.shape())?;
    let bound = if fan_in + fan_out == 0 {
        0.0
    } else {
        gain * (6.0 / (fan_in + fan_out) as f64).sqrt()
    };
    uniform_(t, -bound, bound)
}

/// The bound PyTorch's default Linear/Conv init ends at: kaiming_uniform(a=√5) gives 1/√fan_in for
/// the weight, and the bias uses the same 1/√fan_in. Zero fan-in gives an empty or zero range.
pub fn default_bound(fan_in: usize) -> f64 {
    if fan_in == 0 {
        0.0
    } else {
        1.0 / (fan_in as f64).sqrt()
    }
}

/// A leaf tensor that requires grad: what `nn.Parameter(t)` makes.
pub fn parameter(t: Tensor) -> Result<Tensor> {
    t.detach().with_grad()
}

/// A fresh parameter drawn from U(-bound, bound).
pub(crate) fn uniform_parameter(shape: &[usize], bound: f64, dtype: DType) -> Result<Tensor> {
    parameter(Tensor::uniform(shape, -bound, bound, dtype)?)
}

/// A fresh parameter filled with `value`.
pub(crate) fn full_parameter(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
    parameter(Tensor::full(shape, value, dtype)?)
}
