//! The process-wide cache of compiled graphs, keyed on structure (DESIGN.md invariant 4): a graph
//! that was compiled once — by any function, any layer — is never compiled again in this process.
//! Per backend instance: the registry's named backends are one `Arc` each, shared by every
//! function that names them, while two custom backends are two backends even under one name (as
//! `torch.compile` caches per backend callable) — one that records the graphs it is given sees
//! its own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use kiln_core::{profiler, Result};

use crate::backends::{Backend, BackendContext, CompiledGraph};
use crate::debug;
use crate::graph::Graph;
use crate::logs::{self, Channel};

/// The backend instance's address, the compile options, the graph's structure.
type Key = (usize, String, Vec<u8>);

/// A compiled graph and the backend that compiled it: an entry whose backend was dropped (and
/// whose address another may now have) is stale.
struct Entry {
    backend: Weak<dyn Backend>,
    compiled: Arc<dyn CompiledGraph>,
}

fn cache() -> &'static Mutex<HashMap<Key, Entry>> {
    static C: OnceLock<Mutex<HashMap<Key, Entry>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

fn address(backend: &Arc<dyn Backend>) -> usize {
    Arc::as_ptr(backend).cast::<()>() as usize
}

static EPOCH: AtomicU64 = AtomicU64::new(0);
static COMPILES: AtomicU64 = AtomicU64::new(0);
static HITS: AtomicU64 = AtomicU64::new(0);

/// Process-wide counters, for tests and `explain`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Graphs handed to a backend's `compile`.
    pub backend_compiles: u64,
    /// Graphs found already compiled.
    pub cache_hits: u64,
}

pub fn stats() -> CacheStats {
    CacheStats {
        backend_compiles: COMPILES.load(Ordering::Relaxed),
        cache_hits: HITS.load(Ordering::Relaxed),
    }
}

/// Bumped by `reset()`: compiled functions drop entries from an older epoch.
pub fn epoch() -> u64 {
    EPOCH.load(Ordering::Relaxed)
}

/// `torch._dynamo.reset()`: forgets every compiled graph and every function's cache entries.
pub fn reset() {
    cache().lock().unwrap_or_else(|e| e.into_inner()).clear();
    crate::prefetch::forget_uses();
    EPOCH.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn compile_cached(
    backend: &Arc<dyn Backend>,
    ctx: &BackendContext,
    graph: &Graph,
    name: &str,
) -> Result<Arc<dyn CompiledGraph>> {
    // a graph compiled (and perhaps recorded for replay) under other backend switches holds the
    // kernels they chose: not shared (`kiln_core::backends`)
    let options = format!(
        "{}|{:?}|{}|{}",
        ctx.mode,
        ctx.options,
        ctx.fullgraph,
        kiln_core::backends::fingerprint()
    );
    let key = {
        let _span = profiler::span(profiler::Category::Compile, || {
            format!("graph key: {name}").into()
        });
        (address(backend), options, graph.structure_key())
    };
    if let Some(e) = cache().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        if e.backend
            .upgrade()
            .is_some_and(|b| Arc::ptr_eq(&b, backend))
        {
            HITS.fetch_add(1, Ordering::Relaxed);
            return Ok(e.compiled.clone());
        }
    }
    let n = COMPILES.fetch_add(1, Ordering::Relaxed);
    logs::emit(Channel::GraphCode, || {
        graph.to_code(&format!("{name}_graph{n}"))
    });
    if debug::enabled() {
        debug::dump(&format!("{name}_graph{n}"), &graph.to_code(name));
    }
    let compiled = {
        let _span = profiler::span(profiler::Category::Compile, || {
            format!("compile {name} ({})", backend.name()).into()
        });
        backend.compile(graph, ctx)?
    };
    let entry = Entry {
        backend: Arc::downgrade(backend),
        compiled: compiled.clone(),
    };
    let mut cache = cache().lock().unwrap_or_else(|e| e.into_inner());
    // the entries of backends dropped since (a compile is rare next to a sweep of the map)
    cache.retain(|_, e| e.backend.strong_count() > 0);
    cache.insert(key, entry);
    Ok(compiled)
}
