//! Building, caching, loading and running generated kernels.

pub mod cc;
pub mod exec;
pub mod plan;
pub mod pool;
