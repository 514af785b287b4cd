//! Backends turn a captured `Graph` into something runnable. Users pick one by name or pass their
//! own value implementing `Backend` (as torch.compile's `backend=` takes a string or a callable).

mod eager;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};

use kiln_core::{Error, Result, Tensor};

use crate::graph::Graph;

pub use eager::{EagerBackend, Interpreter};

/// What a backend is told besides the graph.
#[derive(Clone, Debug, Default)]
pub struct BackendContext {
    /// `CompileOptions::mode`, as text (`default`, `reduce-overhead`, ...).
    pub mode: String,
    /// `CompileOptions::options`, handed through untouched.
    pub options: BTreeMap<String, String>,
}

pub trait Backend: Send + Sync {
    fn name(&self) -> &str;
    fn compile(&self, graph: &Graph, ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>>;
}

/// A compiled graph: inputs in graph-input order, outputs in graph-output order.
pub trait CompiledGraph: Send + Sync {
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>>;
}

fn registry() -> &'static RwLock<BTreeMap<String, Arc<dyn Backend>>> {
    static R: OnceLock<RwLock<BTreeMap<String, Arc<dyn Backend>>>> = OnceLock::new();
    R.get_or_init(|| {
        let mut m: BTreeMap<String, Arc<dyn Backend>> = BTreeMap::new();
        m.insert("eager".into(), Arc::new(EagerBackend));
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
                    "unknown backend {name:?}; registered backends: {:?}",
                    list_backends()
                ),
            )
        })
}
