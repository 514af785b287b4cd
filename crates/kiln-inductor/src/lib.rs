//! kiln-inductor: kiln's Inductor. Lowers captured prim graphs to a loop-level IR, fuses
//! (`schedule`), generates C with OpenMP (`codegen`), builds it with the system compiler and caches
//! the result in memory and on disk (`runtime`).
//!
//! Layering: this crate knows graphs and prims (kiln-compile, kiln-core), nothing of `nn`.

mod backend;
pub mod channels_last;
pub mod codegen;
pub mod conv_epilogue;
mod cudagraphs;
pub mod epilogue;
mod footprint;
mod horizontal;
pub mod ir;
mod matchers;
mod one_hot;
mod parallel;
mod plan_cache;
mod relu_mask;
mod repeats;
mod replace;
mod rows;
pub mod runtime;
pub mod schedule;
mod sequential;
mod sibling_reductions;
pub mod sink_expands;
mod split_reduction;
#[cfg(test)]
mod test_graphs;
pub mod traffic;
mod two_pass;

use std::sync::{Arc, Once};

use kiln_compile::aot::AotBackend;
use kiln_compile::logs::{self, Channel};

pub use backend::{generate, interpreted_graphs, prepare_joint, CpuCodegen, INLINE_SMALL_MATMULS};
pub use codegen::cuda_literals::shared_kernels;
pub use cudagraphs::CudaGraphsBackend;
pub use runtime::cc::{
    cache_dir, forget_loaded_kernels, stats as kernel_cache_stats, with_fresh_cache,
    KernelCacheStats,
};
pub use runtime::pool::{stats as exec_stats, ExecStats};

/// Registers the `kiln` backend (AOT autograd over generated kernels: C for the CPU, CUDA C for
/// a GPU) and `cudagraphs` (AOT autograd over eager kernels recorded as CUDA graphs). Idempotent.
pub fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let kiln = Arc::new(AotBackend::new("kiln", Arc::new(CpuCodegen)));
        // a second registration (a user registered the name first) keeps the user's
        let _ = kiln_compile::register_backend("kiln", kiln);
        let cudagraphs = Arc::new(AotBackend::new("cudagraphs", Arc::new(CudaGraphsBackend)));
        let _ = kiln_compile::register_backend("cudagraphs", cudagraphs);
    });
}

pub(crate) fn log_output_code(src: &str) {
    logs::emit(Channel::OutputCode, || src.to_string());
}
