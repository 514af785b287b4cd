//! One module per workload of DESIGN.md's table that runs on the CPU today, each mirroring the
//! function of the same name in `../shared/bench/torch_baseline.py`.

pub mod adam;
pub mod bert;
pub mod convs;
pub mod dynamic;
pub mod mlp;
pub mod norms;
pub mod numpy_fn;
pub mod regional;
pub mod resnet18;
pub mod sincos;
pub mod train;
pub mod train_digits;

/// Workloads return any error; `main` prints it as the workload's error line and goes on.
pub type BenchResult<T = ()> = Result<T, Box<dyn std::error::Error>>;
