//! `nn.BatchNorm2d`: normalises each channel of an [N, C, H, W] input. Training uses batch statistics
//! and updates the running ones in place; eval uses the running ones.

use kiln_core::{no_grad, DType, Error, Result, RunningStats, Tensor};

use crate::init::full_parameter;
use crate::module::{Module, TensorKind, TrainFlag};

/// BatchNorm's optional arguments, PyTorch's defaults in `Default`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormConfig {
    pub eps: f64,
    /// `None` means a cumulative moving average (factor 1/num_batches_tracked), as in PyTorch.
    pub momentum: Option<f64>,
    pub affine: bool,
    pub track_running_stats: bool,
}

impl Default for BatchNormConfig {
    fn default() -> Self {
        BatchNormConfig {
            eps: 1e-5,
            momentum: Some(0.1),
            affine: true,
            track_running_stats: true,
        }
    }
}

/// The running statistics, present when `track_running_stats`.
pub struct RunningBuffers {
    pub running_mean: Tensor,
    pub running_var: Tensor,
    /// int64 scalar, as in PyTorch.
    pub num_batches_tracked: Tensor,
}

pub struct BatchNorm2d {
    pub weight: Option<Tensor>,
    pub bias: Option<Tensor>,
    pub running: Option<RunningBuffers>,
    pub num_features: usize,
    pub config: BatchNormConfig,
    training: TrainFlag,
}

impl BatchNorm2d {
    /// `nn.BatchNorm2d(num_features)` with eps=1e-5, momentum=0.1.
    pub fn new(num_features: usize) -> Result<BatchNorm2d> {
        BatchNorm2d::with_config(num_features, BatchNormConfig::default())
    }

    pub fn with_config(num_features: usize, config: BatchNormConfig) -> Result<BatchNorm2d> {
        if config.eps.is_nan() || config.eps < 0.0 {
            return Err(Error::arg(
                "BatchNorm2d",
                format!("eps must be non-negative, got {}", config.eps),
            ));
        }
        if let Some(m) = config.momentum {
            if !(0.0..=1.0).contains(&m) {
                return Err(Error::arg(
                    "BatchNorm2d",
                    format!("momentum must be in [0, 1], got {m}"),
                ));
            }
        }
        let n = [num_features];
        let (weight, bias) = if config.affine {
            (
                Some(full_parameter(&n, 1.0, DType::F32)?),
                Some(full_parameter(&n, 0.0, DType::F32)?),
            )
        } else {
            (None, None)
        };
        let running = if config.track_running_stats {
            Some(RunningBuffers {
                running_mean: Tensor::zeros(&n, DType::F32)?,
                running_var: Tensor::ones(&n, DType::F32)?,
                num_batches_tracked: Tensor::zeros(&[], DType::I64)?,
            })
        } else {
            None
        };
        Ok(BatchNorm2d {
            weight,
            bias,
            running,
            num_features,
            config,
            training: TrainFlag::default(),
        })
    }

    fn check_input(&self, x: &Tensor, training: bool) -> Result<()> {
        if x.rank() != 4 || x.shape()[1] != self.num_features {
            return Err(Error::shape(
                "BatchNorm2d",
                format!(
                    "expected 4D input [N, {}, H, W], got {:?}",
                    self.num_features,
                    x.shape()
                ),
            ));
        }
        let per_channel = x.numel() / self.num_features.max(1);
        if training && per_channel <= 1 {
            return Err(Error::shape(
                "BatchNorm2d",
                format!(
                    "expected more than 1 value per channel when training, got input {:?}",
                    x.shape()
                ),
            ));
        }
        Ok(())
    }
}

impl Module for BatchNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let training = self.is_training();
        // batch statistics are used in training, and always when no running stats are kept
        let use_batch_stats = training || self.running.is_none();
        // checked before the num_batches_tracked increment, so a bad input changes no state
        self.check_input(x, use_batch_stats)?;
        let mut factor = self.config.momentum.unwrap_or(0.0);
        if let (true, Some(r)) = (training, &self.running) {
            let n = &r.num_batches_tracked;
            no_grad(|| n.assign(&n.add(1i64)?))?;
            if self.config.momentum.is_none() {
                factor = 1.0 / n.item::<i64>()? as f64;
            }
        }
        let stats = self.running.as_ref().map(|r| RunningStats {
            mean: &r.running_mean,
            var: &r.running_var,
            momentum: factor,
        });
        x.batch_norm(
            self.weight.as_ref(),
            self.bias.as_ref(),
            stats,
            use_batch_stats,
            self.config.eps,
        )
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn visit_own(&self, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        if let (Some(w), Some(b)) = (&self.weight, &self.bias) {
            f("weight", w, TensorKind::Parameter);
            f("bias", b, TensorKind::Parameter);
        }
        if let Some(r) = &self.running {
            f("running_mean", &r.running_mean, TensorKind::Buffer);
            f("running_var", &r.running_var, TensorKind::Buffer);
            f(
                "num_batches_tracked",
                &r.num_batches_tracked,
                TensorKind::Buffer,
            );
        }
    }
    fn visit_own_mut(&mut self, f: &mut dyn FnMut(&str, &mut Tensor, TensorKind)) {
        if let (Some(w), Some(b)) = (&mut self.weight, &mut self.bias) {
            f("weight", w, TensorKind::Parameter);
            f("bias", b, TensorKind::Parameter);
        }
        if let Some(r) = &mut self.running {
            f("running_mean", &mut r.running_mean, TensorKind::Buffer);
            f("running_var", &mut r.running_var, TensorKind::Buffer);
            f(
                "num_batches_tracked",
                &mut r.num_batches_tracked,
                TensorKind::Buffer,
            );
        }
    }
}
