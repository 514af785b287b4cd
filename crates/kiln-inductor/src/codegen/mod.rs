//! Source generation from the schedule. `c`: C with OpenMP for the CPU (and the expression
//! builder both targets share); `cuda`: CUDA C for NVIDIA GPUs, compiled by NVRTC.

pub mod c;
pub mod cuda;
pub mod template;
