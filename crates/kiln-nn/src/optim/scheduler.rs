//! Learning-rate schedulers. Like PyTorch's, they are "chainable": each step reads the optimizer's
//! current lr and updates it, through the optimizer's shared `LrHandle`.

use std::f64::consts::PI;

use kiln_core::{Error, Result};

use super::{LrHandle, Optimizer};

pub trait LrScheduler {
    /// Advances one epoch and sets the optimizer's lr.
    fn step(&mut self);
    /// The lr this scheduler last set.
    fn get_last_lr(&self) -> f64;
    /// How many times `step` has run since construction (PyTorch's `last_epoch`).
    fn last_epoch(&self) -> u64;
}

/// `StepLR(optimizer, step_size, gamma)`: lr ← lr·γ every `step_size` epochs.
pub struct StepLR {
    lr: LrHandle,
    step_size: u64,
    gamma: f64,
    base_lr: f64,
    last_epoch: u64,
    last_lr: f64,
}

impl StepLR {
    pub fn new<O: Optimizer + ?Sized>(opt: &O, step_size: usize, gamma: f64) -> Result<StepLR> {
        if step_size == 0 {
            return Err(Error::arg("StepLR", "step_size must be positive"));
        }
        let lr = opt.lr_handle();
        let base_lr = lr.get();
        Ok(StepLR {
            lr,
            step_size: step_size as u64,
            gamma,
            base_lr,
            last_epoch: 0,
            last_lr: base_lr,
        })
    }
    /// The lr the optimizer had when the scheduler was created (`initial_lr`).
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }
}

impl LrScheduler for StepLR {
    fn step(&mut self) {
        self.last_epoch += 1;
        let current = self.lr.get();
        let lr = if self.last_epoch % self.step_size == 0 {
            current * self.gamma
        } else {
            current
        };
        self.lr.set(lr);
        self.last_lr = lr;
    }
    fn get_last_lr(&self) -> f64 {
        self.last_lr
    }
    fn last_epoch(&self) -> u64 {
        self.last_epoch
    }
}

/// `CosineAnnealingLR(optimizer, T_max, eta_min)`:
/// lr_t = η_min + (η_0 − η_min)(1 + cos(π t / T_max))/2, computed with PyTorch's recursive form
/// (which continues past T_max as a cosine wave rather than clamping).
pub struct CosineAnnealingLR {
    lr: LrHandle,
    t_max: u64,
    eta_min: f64,
    base_lr: f64,
    last_epoch: u64,
    last_lr: f64,
}

impl CosineAnnealingLR {
    pub fn new<O: Optimizer + ?Sized>(
        opt: &O,
        t_max: usize,
        eta_min: f64,
    ) -> Result<CosineAnnealingLR> {
        if t_max == 0 {
            return Err(Error::arg("CosineAnnealingLR", "T_max must be positive"));
        }
        let lr = opt.lr_handle();
        let base_lr = lr.get();
        Ok(CosineAnnealingLR {
            lr,
            t_max: t_max as u64,
            eta_min,
            base_lr,
            last_epoch: 0,
            last_lr: base_lr,
        })
    }
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }
}

impl LrScheduler for CosineAnnealingLR {
    fn step(&mut self) {
        self.last_epoch += 1;
        let (e, t) = (self.last_epoch as f64, self.t_max as f64);
        let (current, eta_min) = (self.lr.get(), self.eta_min);
        // PyTorch: (last_epoch - 1 - T_max) % (2 T_max) == 0, with Python's non-negative modulo
        let restart = (self.last_epoch as i128 - 1 - self.t_max as i128)
            .rem_euclid(2 * self.t_max as i128)
            == 0;
        let lr = if restart {
            current + (self.base_lr - eta_min) * (1.0 - (PI / t).cos()) / 2.0
        } else {
            (1.0 + (PI * e / t).cos()) / (1.0 + (PI * (e - 1.0) / t).cos()) * (current - eta_min)
                + eta_min
        };
        self.lr.set(lr);
        self.last_lr = lr;
    }
    fn get_last_lr(&self) -> f64 {
        self.last_lr
    }
    fn last_epoch(&self) -> u64 {
        self.last_epoch
    }
}
