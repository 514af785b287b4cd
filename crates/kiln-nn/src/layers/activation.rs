//! Parameter-free activation modules; each forwards to the one `Tensor` op that defines it.

use kiln_core::{Result, Tensor};

use crate::module::{Module, TrainFlag};

macro_rules! stateless {
    ($($(#[$doc:meta])* $name:ident => |$x:ident| $body:expr;)*) => {$(
        $(#[$doc])*
        #[derive(Default)]
        pub struct $name {
            training: TrainFlag,
        }
        impl $name {
            pub fn new() -> Self {
                Self::default()
            }
        }
        impl Module for $name {
            fn forward(&self, $x: &Tensor) -> Result<Tensor> {
                $body
            }
            fn train_flag(&self) -> &TrainFlag {
                &self.training
            }
        }
    )*};
}

stateless! {
    /// `nn.ReLU`.
    ReLU => |x| x.relu();
    /// `nn.SiLU` (swish): x·σ(x).
    SiLU => |x| x.silu();
    /// `nn.Sigmoid`.
    Sigmoid => |x| x.sigmoid();
    /// `nn.Tanh`.
    Tanh => |x| x.tanh();
    /// `nn.Identity`: returns its input.
    Identity => |x| Ok(x.clone());
}

/// GELU's two forms: PyTorch's `approximate='none'` (erf) and `'tanh'`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GeluApproximate {
    #[default]
    None,
    Tanh,
}

/// `nn.GELU(approximate)`.
#[derive(Default)]
pub struct GELU {
    pub approximate: GeluApproximate,
    training: TrainFlag,
}

impl GELU {
    /// The exact (erf) form, PyTorch's default.
    pub fn new() -> Self {
        Self::default()
    }
    pub fn with_approximate(approximate: GeluApproximate) -> Self {
        GELU {
            approximate,
            training: TrainFlag::default(),
        }
    }
}

impl Module for GELU {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.approximate {
            GeluApproximate::None => x.gelu(),
            GeluApproximate::Tanh => x.gelu_tanh(),
        }
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
}

/// `nn.LeakyReLU(negative_slope)`.
pub struct LeakyReLU {
    pub negative_slope: f64,
    training: TrainFlag,
}

impl LeakyReLU {
    pub fn new(negative_slope: f64) -> Self {
        LeakyReLU {
            negative_slope,
            training: TrainFlag::default(),
        }
    }
}

impl Default for LeakyReLU {
    fn default() -> Self {
        LeakyReLU::new(0.01)
    }
}

impl Module for LeakyReLU {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.leaky_relu(self.negative_slope)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
}

/// `nn.Softmax(dim)`.
pub struct Softmax {
    pub dim: isize,
    training: TrainFlag,
}

impl Softmax {
    pub fn new(dim: isize) -> Self {
        Softmax {
            dim,
            training: TrainFlag::default(),
        }
    }
}

impl Module for Softmax {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.softmax(self.dim)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
}

/// `nn.LogSoftmax(dim)`.
pub struct LogSoftmax {
    pub dim: isize,
    training: TrainFlag,
}

impl LogSoftmax {
    pub fn new(dim: isize) -> Self {
        LogSoftmax {
            dim,
            training: TrainFlag::default(),
        }
    }
}

impl Module for LogSoftmax {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.log_softmax(self.dim)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
}
