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
type Key = (usize, String, Arc<[u8]>);

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

thread_local! {
    /// The graph `compile_cached` is compiling on this thread (its address, alive and borrowed
    /// for the whole compile) and the structure bytes it made for its key.
    static COMPILING: std::cell::RefCell<Option<(usize, Arc<[u8]>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Names the graph being compiled on this thread, for `structure_bytes`, until dropped (when
/// the one an enclosing compile named, if any, is named again).
struct Compiling(Option<(usize, Arc<[u8]>)>);

impl Compiling {
    fn start(graph: &Graph, bytes: &Arc<[u8]>) -> Compiling {
        let at = graph as *const Graph as usize;
        Compiling(COMPILING.with(|c| c.borrow_mut().replace((at, bytes.clone()))))
    }
}

impl Drop for Compiling {
    fn drop(&mut self) {
        let outer = self.0.take();
        COMPILING.with(|c| *c.borrow_mut() = outer);
    }
}

/// `graph.structure_key()`: the bytes `compile_cached` made for its key when `graph` is the
/// graph it is compiling on this thread (AOT autograd's split key hashes the same captured
/// graph: 0.4 ms of a warm start's critical path on the H200's host), else made now.
pub(crate) fn structure_bytes(graph: &Graph) -> Arc<[u8]> {
    let at = graph as *const Graph as usize;
    COMPILING
        .with(|c| {
            c.borrow()
                .as_ref()
                .filter(|(g, _)| *g == at)
                .map(|(_, b)| b.clone())
        })
        .unwrap_or_else(|| graph.structure_key().into())
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
        (
            address(backend),
            options,
            Arc::<[u8]>::from(graph.structure_key()),
        )
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
        let _compiling = Compiling::start(graph, &key.2);
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

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;
    impl CompiledGraph for Nothing {
        fn run(&self, _: &[kiln_core::Tensor]) -> Result<Vec<kiln_core::Tensor>> {
            Ok(Vec::new())
        }
    }

    /// What `structure_bytes` answered inside a compile: (for the graph compiled: the same bytes
    /// twice, and equal to its structure key; for a copy of it at another address: the same
    /// bytes twice).
    #[derive(Default)]
    struct Probe(Mutex<Vec<(bool, bool, bool)>>);
    impl Backend for Probe {
        fn name(&self) -> &str {
            "probe"
        }
        fn compile(&self, g: &Graph, _: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
            let (a, b) = (structure_bytes(g), structure_bytes(g));
            let copy = g.clone();
            let shared_copy = Arc::ptr_eq(&structure_bytes(&copy), &structure_bytes(&copy));
            let want: Arc<[u8]> = g.structure_key().into();
            self.0
                .lock()
                .unwrap()
                .push((Arc::ptr_eq(&a, &b), a == want, shared_copy));
            Ok(Arc::new(Nothing))
        }
    }

    /// The graph being compiled reads back the bytes its key was made of (one allocation, not
    /// remade); any other graph, or the same graph outside the compile, has its bytes made.
    #[test]
    fn the_compiled_graph_reuses_its_key_bytes() {
        let probe = Arc::new(Probe::default());
        let backend: Arc<dyn Backend> = probe.clone();
        let ctx = BackendContext {
            mode: "default".into(),
            options: Default::default(),
            fullgraph: false,
            name: "probe".into(),
        };
        let g = Graph {
            num_inputs: 3,
            ..Graph::default()
        };
        compile_cached(&backend, &ctx, &g, "probe").unwrap();
        assert_eq!(*probe.0.lock().unwrap(), vec![(true, true, false)]);
        assert!(!Arc::ptr_eq(&structure_bytes(&g), &structure_bytes(&g)));
    }
}
