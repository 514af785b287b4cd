//! kiln-compile: kiln's TorchDynamo. Captures the prims a function applies into graphs (tracing
//! through the core's `Interceptor` hook), guards them, caches them by structure, splits them at
//! graph breaks, and hands them to a backend.
//!
//! Layering: this crate knows the core's prims and tensors, nothing of `nn`; backends know graphs,
//! not user code.

mod alias;
pub mod aot;
pub mod backends;
mod cache;
pub mod codec;
mod compiled_fn;
pub mod cse;
pub mod debug;
pub mod disk_cache;
mod explain;
pub mod fast_hash;
pub mod graph;
pub mod guards;
pub mod logs;
mod options;
pub mod prefetch;
pub mod record;
pub mod symbolic;
pub mod trace;

pub use backends::{list_backends, register_backend, Backend, BackendContext, CompiledGraph};
pub use cache::{reset, stats as cache_stats, CacheStats};
pub use compiled_fn::{compile_fn, compile_named, CompiledFn, FnStats};
pub use explain::{explain, EntryReport, ExplainOutput, SymbolReport, SymbolicReport};
pub use graph::{Graph, Node, NodeId, Op};
pub use options::{BackendChoice, CompileOptions, Mode};
pub use symbolic::{mark_dynamic, mark_static};
