//! `nn.LayerNorm`: normalises over the trailing `normalized_shape` dims.

use kiln_core::{DType, Error, Result, Tensor};

use crate::init::full_parameter;
use crate::module::{Module, TensorKind, TrainFlag};

pub struct LayerNorm {
    pub weight: Option<Tensor>,
    pub bias: Option<Tensor>,
    pub normalized_shape: Vec<usize>,
    pub eps: f64,
    training: TrainFlag,
}

impl LayerNorm {
    /// `nn.LayerNorm(normalized_shape)` with eps=1e-5 and an affine weight (ones) and bias (zeros).
    pub fn new(normalized_shape: &[usize]) -> Result<LayerNorm> {
        LayerNorm::with_config(normalized_shape, 1e-5, true, true)
    }

    /// `nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias)`.
    pub fn with_config(
        normalized_shape: &[usize],
        eps: f64,
        elementwise_affine: bool,
        bias: bool,
    ) -> Result<LayerNorm> {
        if normalized_shape.is_empty() {
            return Err(Error::arg(
                "LayerNorm",
                "normalized_shape must have at least one dim",
            ));
        }
        if eps.is_nan() || eps < 0.0 {
            return Err(Error::arg(
                "LayerNorm",
                format!("eps must be non-negative, got {eps}"),
            ));
        }
        let (weight, bias) = if elementwise_affine {
            let w = full_parameter(normalized_shape, 1.0, DType::F32)?;
            let b = match bias {
                true => Some(full_parameter(normalized_shape, 0.0, DType::F32)?),
                false => None,
            };
            (Some(w), b)
        } else {
            (None, None)
        };
        Ok(LayerNorm {
            weight,
            bias,
            normalized_shape: normalized_shape.to_vec(),
            eps,
            training: TrainFlag::default(),
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(
            &self.normalized_shape,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.eps,
        )
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn visit_own(&self, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        if let Some(w) = &self.weight {
            f("weight", w, TensorKind::Parameter);
        }
        if let Some(b) = &self.bias {
            f("bias", b, TensorKind::Parameter);
        }
    }
    fn visit_own_mut(&mut self, f: &mut dyn FnMut(&str, &mut Tensor, TensorKind)) {
        if let Some(w) = &mut self.weight {
            f("weight", w, TensorKind::Parameter);
        }
        if let Some(b) = &mut self.bias {
            f("bias", b, TensorKind::Parameter);
        }
    }
}
