//! kiln: a deep-learning library for Rust whose heart is a just-in-time graph compiler.
//!
//! This facade re-exports the layers below it; see ARCHITECTURE.md for the map.

mod compile;
pub mod data;
pub mod models;
pub mod ndarray_interop;

pub use kiln_core::profiler::{self, profile, profile_synchronized, Profile};
pub use kiln_core::{
    self as core, autograd, manual_seed, no_grad, DType, Device, Error, Generator, Reduction,
    Result, Tensor,
};
pub use kiln_nn as nn;

pub use compile::{compile, compile_fn, compile_named, list_backends, CompiledModule};
/// Graph IR, tracer and backend internals, for backend writers.
pub use kiln_compile as compiler;
pub use kiln_compile::{
    cache_stats, explain, mark_dynamic, mark_static, register_backend, reset, Backend,
    BackendContext, CompileOptions, CompiledFn, CompiledGraph, EntryReport, ExplainOutput, FnStats,
    Graph, Mode, SymbolReport, SymbolicReport,
};
/// Loop IR, fusion and C code generation (the `kiln` backend).
pub use kiln_inductor as inductor;

/// The CUDA runtime: `kiln::cuda::init()` makes `Device::Cuda(n)` usable (`is_available`,
/// `memory_stats`, `empty_cache`, `synchronize`, `set_allow_tf32`, `set_cudnn_allow_tf32`).
/// Without CUDA it is still there, and says why it cannot run.
pub mod cuda {
    pub use kiln_cuda::*;

    // the entry points that make CUDA usable also register the `kiln` backend: eager code that
    // compiles a piece of itself (a foreach optimizer's flat update) finds it without a
    // `kiln::compile` having run first

    /// `kiln_cuda::init`, with the `kiln` backend registered.
    pub fn init() {
        kiln_cuda::init();
        kiln_inductor::register();
    }
    /// `kiln_cuda::check`, with the `kiln` backend registered.
    pub fn check() -> kiln_core::Result<()> {
        kiln_inductor::register();
        kiln_cuda::check()
    }
    /// `torch.cuda.is_available()`, with the `kiln` backend registered.
    pub fn is_available() -> bool {
        check().is_ok()
    }
}

/// `use kiln::prelude::*;` brings in what a training script needs.
pub mod prelude {
    pub use crate::ndarray_interop::NdarrayExt;
    pub use crate::{compile, compile_fn, CompileOptions, Mode};
    pub use kiln_core::{manual_seed, no_grad, DType, Device, Reduction, Result, Tensor};
    pub use kiln_nn::Module;
}
