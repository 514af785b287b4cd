//! `nn.Dropout`: active only in training mode.

use kiln_core::{Error, Result, Tensor};

use crate::module::{Module, TrainFlag};

pub struct Dropout {
    pub p: f64,
    training: TrainFlag,
}

impl Dropout {
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::arg(
                "Dropout",
                format!("dropout probability has to be between 0 and 1, but got {p}"),
            ));
        }
        Ok(Dropout {
            p,
            training: TrainFlag::default(),
        })
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.dropout(self.p, self.is_training())
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
}
