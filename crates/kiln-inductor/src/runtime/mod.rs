//! Building, caching, loading and running generated kernels.

pub mod autotune;
pub mod cc;
pub(crate) mod conv_warmup;
pub mod cudagraph;
pub mod exec;
pub mod plan;
pub mod pool;
mod trig;
