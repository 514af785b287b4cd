//! Backends turn a captured `Graph` into something runnable. Users pick one by name or pass their
//! own value implementing `Backend` (as torch.compile's `backend=` takes a string or a callable).

mod eager;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};

use kiln_core::{Error, Result, Tensor};

use crate::aot::AotBackend;
use crate::graph::Graph;
use crate::symbolic::SymGraph;

pub use eager::{EagerBackend, Interpreter};

/// What a backend is told besides the graph.
#[derive(Clone, Debug, Default)]
pub struct BackendContext {
    /// `CompileOptions::mode`, as text (`default`, `reduce-overhead`, ...).
    pub mode: String,
    /// `CompileOptions::options`, handed through untouched.
    pub options: BTreeMap<String, String>,
    /// `CompileOptions::fullgraph`: the user asked for strictness, so a backend that cannot do its
    /// job (no C compiler, say) errs instead of falling back.
    pub fullgraph: bool,
    /// The compiled function's name ("DenseNet" for a module of that type): what a backend may
    /// key what it remembers of the function's compiles by, across processes.
    pub name: String,
}

pub trait Backend: Send + Sync {
    fn name(&self) -> &str;
    fn compile(&self, graph: &Graph, ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>>;
    /// Compiles AOT autograd's forward and backward graphs, which are always compiled together:
    /// a backend may share work between them (kiln's CUDA target builds both graphs' kernels in
    /// one pool of compiler threads). The default compiles one, then the other.
    fn compile_pair(
        &self,
        forward: &Graph,
        backward: &Graph,
        ctx: &BackendContext,
    ) -> Result<(Arc<dyn CompiledGraph>, Arc<dyn CompiledGraph>)> {
        Ok((self.compile(forward, ctx)?, self.compile(backward, ctx)?))
    }
    /// Told before the function named `ctx.name` is first traced, with `args` (once per
    /// compiled function, again after `kiln::reset`; the trace's graphs come to `compile` after
    /// it; not for a dynamic-shape probe's stand-in arguments): a backend may start work that
    /// does not need the graphs, such as loading what the function's last compile in another
    /// process built. The default: nothing.
    fn trace_starting(&self, ctx: &BackendContext, args: &[Tensor]) {
        let _ = (ctx, args);
    }
    /// Told when the trace `trace_starting` announced has ended and its graphs are compiled: what
    /// the backend started for it and no compile took (values read ahead for graphs that
    /// changed) can go. The default: nothing.
    fn trace_finished(&self, ctx: &BackendContext) {
        let _ = ctx;
    }
    /// A rewrite of AOT autograd's joint graph (forward and backward in one) before it is split,
    /// so that what the forward saves for the backward is what this backend wants saved (kiln's
    /// CUDA target: activations in channels-last order). The rewrite keeps the graph's inputs and
    /// outputs, in order, with their shapes and values. `None`, the default: no rewrite.
    fn prepare_joint(&self, joint: &Graph) -> Result<Option<Graph>> {
        let _ = joint;
        Ok(None)
    }
    /// An id for what this backend makes of a graph, part of every key it and AOT autograd
    /// around it use in the compiled-graph cache on disk (`disk_cache.rs`). It must change
    /// whenever the result for the same graph and options could: a hash of the sources of the
    /// backend and of everything below it (the core's VJP rules, AOT autograd's partition), and
    /// the settings its rewrites read (environment variables).
    /// `None`, the default: nothing of this backend's compiles is cached on disk.
    fn cache_id(&self) -> Option<String> {
        None
    }
    /// Compiles a graph with symbolic sizes into code that runs at every size its guards admit
    /// (sizes read off the inputs at run time). `None`, the default: this backend compiles
    /// concrete graphs only, and kiln compiles the graph once per size for it.
    fn compile_symbolic(
        &self,
        graph: &SymGraph,
        ctx: &BackendContext,
    ) -> Option<Result<Arc<dyn CompiledGraph>>> {
        let _ = (graph, ctx);
        None
    }
}

/// A compiled graph: inputs in graph-input order, outputs in graph-output order.
pub trait CompiledGraph: Send + Sync {
    /// Runs the graph; its random draws (if any) take a fresh base from the default generator.
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>>;
    /// Runs the graph with its random draws based at `rng` = (seed, offset) rather than a fresh
    /// draw: AOT autograd's backward regenerates the forward's dropout masks this way instead of
    /// saving them. Backends whose graphs draw random numbers must implement it.
    fn run_with_rng(&self, inputs: &[Tensor], rng: (u64, u64)) -> Result<Vec<Tensor>> {
        let _ = (inputs, rng);
        Err(Error::Unsupported {
            op: "CompiledGraph::run_with_rng",
            msg: "this backend cannot replay a graph's random draws at a given seed and offset"
                .into(),
        })
    }
}

fn registry() -> &'static RwLock<BTreeMap<String, Arc<dyn Backend>>> {
    static R: OnceLock<RwLock<BTreeMap<String, Arc<dyn Backend>>>> = OnceLock::new();
    R.get_or_init(|| {
        let mut m: BTreeMap<String, Arc<dyn Backend>> = BTreeMap::new();
        m.insert("eager".into(), Arc::new(EagerBackend));
        m.insert(
            "aot_eager".into(),
            Arc::new(AotBackend::new("aot_eager", Arc::new(EagerBackend))),
        );
        RwLock::new(m)
    })
}

/// `torch._dynamo.list_backends()`: the registered backend names, sorted.
pub fn list_backends() -> Vec<String> {
    registry()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .keys()
        .cloned()
        .collect()
}

/// Registers a backend under `name`. A name can be registered once.
pub fn register_backend(name: &str, backend: Arc<dyn Backend>) -> Result<()> {
    let mut r = registry().write().unwrap_or_else(|e| e.into_inner());
    if r.contains_key(name) {
        return Err(Error::arg(
            "register_backend",
            format!("a backend named {name:?} is already registered"),
        ));
    }
    r.insert(name.to_string(), backend);
    Ok(())
}

pub fn lookup_backend(name: &str) -> Result<Arc<dyn Backend>> {
    registry()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(name)
        .cloned()
        .ok_or_else(|| {
            Error::arg(
                "compile",
                format!(
                    "unknown backend {name:?}; registered backends: {:?}{}",
                    list_backends(),
                    if name == "kiln" {
                        " (the `kiln` backend is registered by kiln-inductor: use `kiln::compile`, \
                         or call `kiln_inductor::register()` first)"
                    } else {
                        ""
                    }
                ),
            )
        })
}
