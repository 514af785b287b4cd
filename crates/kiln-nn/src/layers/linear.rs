//! `nn.Linear`: y = x Wᵀ + b with W of shape [out_features, in_features].

use kiln_core::{DType, Error, Result, Tensor};

use crate::init::{default_bound, parameter, uniform_parameter};
use crate::module::{Module, TensorKind, TrainFlag};

pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub in_features: usize,
    pub out_features: usize,
    training: TrainFlag,
}

impl Linear {
    /// PyTorch's default init: weight and bias from U(-1/√in, 1/√in), float32.
    pub fn new(in_features: usize, out_features: usize, bias: bool) -> Result<Linear> {
        Linear::with_dtype(in_features, out_features, bias, DType::F32)
    }

    pub fn with_dtype(
        in_features: usize,
        out_features: usize,
        bias: bool,
        dtype: DType,
    ) -> Result<Linear> {
        let bound = default_bound(in_features);
        let weight = uniform_parameter(&[out_features, in_features], bound, dtype)?;
        let bias = match bias {
            true => Some(uniform_parameter(&[out_features], bound, dtype)?),
            false => None,
        };
        Ok(Linear {
            weight,
            bias,
            in_features,
            out_features,
            training: TrainFlag::default(),
        })
    }

    /// A Linear over given values (they are detached and become parameters).
    pub fn from_weights(weight: Tensor, bias: Option<Tensor>) -> Result<Linear> {
        if weight.rank() != 2 {
            return Err(Error::shape(
                "Linear",
                format!("weight must be [out, in], got {:?}", weight.shape()),
            ));
        }
        let (out_features, in_features) = (weight.shape()[0], weight.shape()[1]);
        if let Some(b) = &bias {
            if b.shape() != [out_features] {
                return Err(Error::shape(
                    "Linear",
                    format!(
                        "bias must be [{out_features}] for weight {:?}, got {:?}",
                        weight.shape(),
                        b.shape()
                    ),
                ));
            }
        }
        Ok(Linear {
            weight: parameter(weight)?,
            bias: bias.map(parameter).transpose()?,
            in_features,
            out_features,
            training: TrainFlag::default(),
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() == 0 || x.shape()[x.rank() - 1] != self.in_features {
            return Err(Error::shape(
                "Linear",
                format!(
                    "input {:?} must end in in_features={}",
                    x.shape(),
                    self.in_features
                ),
            ));
        }
        x.linear(&self.weight, self.bias.as_ref())
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
