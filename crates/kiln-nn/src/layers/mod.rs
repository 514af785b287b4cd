//! The layers of `torch.nn`, one family per file.

mod activation;
mod batchnorm;
mod container;
mod conv;
mod dropout;
mod embedding;
mod flatten;
mod layernorm;
mod linear;
mod pooling;

pub use activation::{
    GeluApproximate, Identity, LeakyReLU, LogSoftmax, ReLU, SiLU, Sigmoid, Softmax, Tanh, GELU,
};
pub use batchnorm::{BatchNorm2d, BatchNormConfig, RunningBuffers};
pub use container::{ModuleList, Sequential};
pub use conv::{Conv2d, Conv2dConfig};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use flatten::Flatten;
pub use layernorm::LayerNorm;
pub use linear::Linear;
pub use pooling::{AdaptiveAvgPool2d, AvgPool2d, MaxPool2d};
