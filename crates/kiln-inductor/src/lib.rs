//! kiln-inductor: kiln's Inductor. Lowers captured prim graphs to a loop-level IR, fuses
//! (`schedule`), generates C with OpenMP (`codegen`), builds it with the system compiler and caches
//! the result in memory and on disk (`runtime`).
//!
//! Layering: this crate knows graphs and prims (kiln-compile, kiln-core), nothing of `nn`.

mod backend;
pub mod codegen;
mod horizontal;
pub mod ir;
pub mod runtime;
pub mod schedule;
mod sequential;

use std::sync::{Arc, Once};

use kiln_compile::aot::AotBackend;
use kiln_compile::logs::{self, Channel};

pub use backend::{generate, CpuCodegen, INLINE_SMALL_MATMULS};
pub use runtime::cc::{
    cache_dir, forget_loaded_kernels, stats as kernel_cache_stats, with_fresh_cache,
    KernelCacheStats,
};
pub use runtime::pool::{stats as exec_stats, ExecStats};

/// Registers the `kiln` backend (AOT autograd over generated CPU kernels). Idempotent.
pub fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let kiln = Arc::new(AotBackend::new("kiln", Arc::new(CpuCodegen)));
        // a second registration (a user registered "kiln" first) keeps the user's
        let _ = kiln_compile::register_backend("kiln", kiln);
    });
}

pub(crate) fn log_output_code(src: &str) {
    logs::emit(Channel::OutputCode, || src.to_string());
}
