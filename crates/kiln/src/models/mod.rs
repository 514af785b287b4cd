//! Reference models built from `kiln::nn`, used by the examples, tests and benchmarks.

mod digits_cnn;

pub use digits_cnn::DigitsCnn;
