//! Source generation from the schedule. `builder`: the expression builder both targets share;
//! `c`: C with OpenMP for the CPU (and the pointwise and reduction bodies both targets wrap their
//! loops around); `c_horizontal`: independent C kernels in one parallel region;
//! `c_rows`: row kernels, a loop over the rows with each member's pass inside; `c_siblings`:
//! sums over the same loops in one walk, a lane array each; `c_sums`: float sums in the eager
//! kernel's order (lane arrays and their fold, long sums in chunks); `c_trig`: pointwise loops over f32
//! sines and cosines in blocks, inline functions with a check of their range);
//! `cuda`: CUDA C for NVIDIA GPUs, compiled by NVRTC (`cuda_compile`: graphs planned, built and
//! assembled, several sharing one NVRTC pool; `cuda_reduce`: its reduction kernels; `cuda_vector`: its pointwise kernels' vector loops; `cuda_residues`: its pointwise kernels split into residue classes of their output index (`residues`, shared with `c_residues`); `cuda_rows`: reductions over a row and the
//! values that read them, a warp per row; `cuda_sequential`: a whole small graph in one block; `cuda_units`: a
//! graph's kernels as a few translation units built on parallel threads; `cuda_sizes`: a symbolic
//! graph's size-generic kernels in units of their own; `cuda_literals`: a static graph's kernels
//! that differ only in integer literals built once); `template`: size-generic kernels of both
//! targets.

pub(crate) mod builder;
pub mod c;
pub(crate) mod c_horizontal;
mod c_residues;
pub(crate) mod c_rows;
pub(crate) mod c_siblings;
pub(crate) mod c_sums;
pub(crate) mod c_trig;
pub mod cuda;
pub mod cuda_compile;
pub mod cuda_literals;
pub(crate) mod cuda_prefetch;
mod cuda_reduce;
mod cuda_residues;
pub(crate) mod cuda_rows;
mod cuda_sequential;
mod cuda_shared;
mod cuda_sincos;
mod cuda_sizes;
mod cuda_tune;
mod cuda_units;
mod cuda_vector;
mod residues;
pub mod template;
#[cfg(test)]
pub(crate) mod test_runtime;
