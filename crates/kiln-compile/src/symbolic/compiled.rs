//! A compiled symbolic graph for backends that compile concrete graphs only: each run reads the
//! symbol values off its inputs' shapes, and runs the graph instantiated at those values, compiled
//! once per distinct size through the structural cache (the `eager` interpreter's "compile" is
//! free, so for it this is the interpreter running the symbolic graph). A backend that generates
//! size-generic code implements `Backend::compile_symbolic` instead and is not wrapped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_core::{Error, Result, Tensor};

use super::context::{with_context, SizeContext};
use super::sym_graph::SymGraph;
use crate::backends::{Backend, BackendContext, CompiledGraph};
use crate::cache;

pub struct PerSizeCompiled {
    sym: Arc<SymGraph>,
    backend: Arc<dyn Backend>,
    ctx: BackendContext,
    name: String,
    per_size: Mutex<HashMap<Vec<i64>, Arc<dyn CompiledGraph>>>,
    /// Names this graph in the size context its compiles run under.
    id: u64,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl PerSizeCompiled {
    pub fn new(
        sym: Arc<SymGraph>,
        backend: Arc<dyn Backend>,
        ctx: BackendContext,
        name: &str,
    ) -> Self {
        PerSizeCompiled {
            sym,
            backend,
            ctx,
            name: name.to_string(),
            per_size: Mutex::new(HashMap::new()),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn at(&self, inputs: &[Tensor]) -> Result<Arc<dyn CompiledGraph>> {
        let syms = symbol_values(&self.sym, inputs)?;
        if let Some(c) = self
            .per_size
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&syms)
        {
            return Ok(c.clone());
        }
        let g = self.sym.instantiate(&syms)?;
        let size = SizeContext {
            graph_id: self.id,
            values: syms.clone(),
        };
        let c = with_context(size, || {
            cache::compile_cached(&self.backend, &self.ctx, &g, &self.name)
        })?;
        self.per_size
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(syms, c.clone());
        Ok(c)
    }
}

/// The symbols' values for a run on `inputs` (graph-input order), read at their bindings.
pub fn symbol_values(sym: &SymGraph, inputs: &[Tensor]) -> Result<Vec<i64>> {
    sym.symbols
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let &(i, d) = s.dims.first().ok_or_else(|| {
                Error::arg("compile", format!("symbol s{k} is bound to no input"))
            })?;
            inputs
                .get(i)
                .and_then(|t| t.shape().get(d))
                .map(|&v| v as i64)
                .ok_or_else(|| {
                    Error::arg(
                        "compile",
                        format!("symbol s{k} reads dim {d} of input {i}, which the call lacks"),
                    )
                })
        })
        .collect()
}

impl CompiledGraph for PerSizeCompiled {
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.at(inputs)?.run(inputs)
    }
    fn run_with_rng(&self, inputs: &[Tensor], rng: (u64, u64)) -> Result<Vec<Tensor>> {
        self.at(inputs)?.run_with_rng(inputs, rng)
    }
}
