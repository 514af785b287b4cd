//! Building, caching, loading and running generated kernels.

pub mod autotune;
pub mod cc;
pub mod cudagraph;
pub mod exec;
pub mod plan;
pub mod pool;
mod trig;
