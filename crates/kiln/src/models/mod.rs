//! Reference models built from `kiln::nn`, used by the examples, tests and benchmarks.
//! The large ones (ResNet, DenseNet, BERT) live in the `kiln-models` crate and are re-exported here.

mod digits_cnn;

pub use digits_cnn::DigitsCnn;
pub use kiln_models::{bert, densenet, fetch, resnet};
