//! `nn.Flatten(start_dim=1, end_dim=-1)`.

use kiln_core::{Result, Tensor};

use crate::module::{Module, TrainFlag};

pub struct Flatten {
    pub start_dim: isize,
    pub end_dim: isize,
    training: TrainFlag,
}

impl Flatten {
    pub fn new(start_dim: isize, end_dim: isize) -> Self {
        Flatten {
            start_dim,
            end_dim,
            training: TrainFlag::default(),
        }
    }
}

impl Default for Flatten {
    /// PyTorch's defaults: keep the batch dim, flatten the rest.
    fn default() -> Self {
        Flatten::new(1, -1)
    }
}

impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.flatten(self.start_dim, self.end_dim)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
}
