//! AOT autograd: when a captured graph has outputs that need gradients, its backward is derived at
//! compile time. `joint` traces forward + backward into one graph (through the core's per-prim VJP
//! rules), `partition` splits it by a min-cut into a forward that also returns the values saved for
//! backward and a backward graph, and both are compiled by an inner backend. At run time the forward
//! records one `Function` node on the eager tape whose backward runs the compiled backward graph.

mod cache;
pub mod joint;
mod maxflow;
pub mod partition;

use std::sync::Arc;

use kiln_core::autograd::{apply_function, is_grad_enabled, Function};
use kiln_core::ops::default_draw;
use kiln_core::profiler;
use kiln_core::{no_grad, Error, Result, Tensor};

use crate::backends::{Backend, BackendContext, CompiledGraph};
use crate::debug;
use crate::graph::Graph;
use crate::logs::{self, Channel};
use crate::prefetch::Recent;

/// Wraps an inner backend with joint-graph construction and partitioning (`aot_eager` wraps the
/// interpreter; code-generating backends wrap their own compilers).
pub struct AotBackend {
    name: String,
    inner: Arc<dyn Backend>,
}

impl AotBackend {
    pub fn new(name: &str, inner: Arc<dyn Backend>) -> Self {
        AotBackend {
            name: name.to_string(),
            inner,
        }
    }
}

impl Backend for AotBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn compile(&self, graph: &Graph, ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        // nothing needs a gradient: an inference graph
        if joint::diff_outputs(graph).is_empty() {
            return self.inner.compile(graph, ctx);
        }
        let split = self.split(graph, ctx)?;
        logs::emit(Channel::GraphCode, || {
            format!(
                "{}{}",
                split.forward.to_code("aot_forward"),
                split.backward.to_code("aot_backward")
            )
        });
        if debug::enabled() {
            debug::dump("aot_forward", &split.forward.to_code("forward"));
            debug::dump("aot_backward", &split.backward.to_code("backward"));
        }
        let out_meta = split.diff_outputs.iter().map(|&k| {
            let n = &graph.nodes[graph.outputs[k]];
            (n.shape.clone(), n.dtype)
        });
        let (forward, backward) = self
            .inner
            .compile_pair(&split.forward, &split.backward, ctx)?;
        let compiled = AotCompiled {
            forward,
            backward,
            rng_span: graph.rng_span,
            num_fwd_outputs: split.num_fwd_outputs,
            num_saved: split.num_saved,
            diff_meta: out_meta.collect::<Vec<_>>().into(),
            diff_outputs: split.diff_outputs,
            grad_inputs: split.grad_inputs,
            saved_bytes: split.saved_bytes,
            forward_draws: split.forward.rng_span > 0,
            backward_draws: split.backward.rng_span > 0,
        };
        drop_off_the_path(split.forward, split.backward);
        Ok(Arc::new(compiled))
    }

    fn cache_id(&self) -> Option<String> {
        self.inner.cache_id()
    }

    /// The inner backend is told first (it may read ahead what it stores); then the splits the
    /// function's last compiles used are read ahead (once a process).
    fn trace_starting(&self, ctx: &BackendContext, args: &[Tensor]) {
        self.inner.trace_starting(ctx, args);
        self.read_ahead(ctx);
    }

    /// What was read ahead for the trace and not taken is stale: dropped.
    fn trace_finished(&self, ctx: &BackendContext) {
        cache::discard_read_ahead(&ctx.name);
        self.inner.trace_finished(ctx);
    }
}

impl AotBackend {
    /// The forward and backward graphs of `graph` (one that needs a backward): from the cache on
    /// disk when the inner backend has a cache id and the graph was split before, else built
    /// (the joint graph, the inner backend's rewrite of it, the min-cut) and stored.
    fn split(&self, graph: &Graph, ctx: &BackendContext) -> Result<cache::Split> {
        // the inner backend's cache id is its build and settings, read from the environment:
        // asked once a split
        let id = self
            .inner
            .cache_id()
            .filter(|_| crate::disk_cache::enabled());
        let key = id.as_ref().map(|id| {
            let _span = profiler::span(profiler::Category::Compile, || {
                "aot autograd: split key".into()
            });
            cache::key(graph, id)
        });
        let recent = id.and_then(|id| recent(ctx, &id));
        if let Some(key) = key {
            let found = {
                let _span = profiler::span(profiler::Category::Compile, || {
                    "aot autograd: split read from the disk cache".into()
                });
                cache::load(key)
            };
            if let Some(split) = found {
                if let Some(recent) = &recent {
                    recent.remember(key);
                }
                return Ok(split);
            }
        }
        let _span = profiler::span(profiler::Category::Compile, || {
            "aot autograd: joint graph and partition".into()
        });
        let mut joint = joint::build(graph)?
            .ok_or_else(|| Error::arg("aot autograd", "no output of the graph needs a gradient"))?;
        if let Some(g) = self.inner.prepare_joint(&joint.graph)? {
            joint.graph = g;
        }
        if debug::enabled() {
            debug::dump("aot_joint", &joint.graph.to_code("joint"));
        }
        // the partition takes the joint graph's nodes
        let g = std::mem::take(&mut joint.graph);
        let mut part = partition::partition(g, joint.num_primals, joint.num_fwd_outputs)?;
        // the forward's inputs are the graph's, in order, and its first outputs are the graph's:
        // the graph's in-place writes (batch norm's running statistics) are the forward's, which
        // the inner backend may then write into their inputs instead of the caller copying each
        // new value over its old one afterwards; the backward's inputs are its own buffers
        part.forward.static_inputs = graph.static_inputs.clone();
        part.forward.mutated_inputs = graph.mutated_inputs.clone();
        let split = cache::Split {
            forward: part.forward,
            backward: part.backward,
            num_fwd_outputs: joint.num_fwd_outputs,
            num_saved: part.num_saved,
            saved_bytes: part.saved_bytes,
            diff_outputs: joint.diff_outputs,
            grad_inputs: joint.grad_inputs,
        };
        if let Some(key) = key {
            cache::store(key, &split);
            if let Some(recent) = &recent {
                recent.remember(key);
            }
        }
        Ok(split)
    }

    /// Reads ahead, each on a thread of its own, the splits the function `ctx` names used in
    /// its last compiles. Once a process for a function: a later trace (a recompile, a graph
    /// break's segments) finds what its compile needs read or in memory already.
    fn read_ahead(&self, ctx: &BackendContext) {
        let Some(recent) = self.inner.cache_id().and_then(|id| recent(ctx, &id)) else {
            return;
        };
        for key in recent.to_read_ahead() {
            cache::read_ahead(&ctx.name, key);
        }
    }
}

/// The manifest of the splits the function `ctx` names used (`prefetch::Recent`), under its
/// name, its mode and the inner backend's cache id `id`; `None` when nothing is cached.
fn recent(ctx: &BackendContext, id: &str) -> Option<Recent> {
    Recent::new(
        "aot",
        &[ctx.name.as_bytes(), ctx.mode.as_bytes(), id.as_bytes()],
    )
}

/// Drops the split's graphs (the compiled pair keeps what it runs) on a thread of its own:
/// thousands of nodes, each with vectors of its own, freed between the compile and the first
/// launch otherwise.
fn drop_off_the_path(forward: Graph, backward: Graph) {
    let drop_both = move || {
        let _span = profiler::span(profiler::Category::Compile, || {
            "aot autograd: the split's graphs dropped".into()
        });
        drop((forward, backward));
    };
    // where no thread can be started, the graphs are dropped here (the closure with them)
    let _ = std::thread::Builder::new()
        .name("kiln-drop".into())
        .spawn(drop_both);
}

/// A compiled forward and backward pair.
pub struct AotCompiled {
    forward: Arc<dyn CompiledGraph>,
    backward: Arc<dyn CompiledGraph>,
    rng_span: u64,
    num_fwd_outputs: usize,
    num_saved: usize,
    diff_outputs: Vec<usize>,
    diff_meta: Arc<[(Vec<usize>, kiln_core::DType)]>,
    grad_inputs: Vec<usize>,
    saved_bytes: usize,
    forward_draws: bool,
    backward_draws: bool,
}

impl AotCompiled {
    /// Bytes the forward saves for backward per call.
    pub fn saved_bytes(&self) -> usize {
        self.saved_bytes
    }

    fn run_at(&self, inputs: &[Tensor], rng: Option<(u64, u64)>) -> Result<Vec<Tensor>> {
        let mut outs = no_grad(|| match rng {
            Some(r) if self.forward_draws => self.forward.run_with_rng(inputs, r),
            _ => self.forward.run(inputs),
        })?;
        if outs.len() != self.num_fwd_outputs + self.num_saved {
            return Err(Error::arg(
                "aot autograd",
                "the forward graph returned the wrong number of values",
            ));
        }
        let saved = outs.split_off(self.num_fwd_outputs);
        if !is_grad_enabled() {
            return Ok(outs);
        }
        let backward = Arc::new(CompiledBackward {
            graph: self.backward.clone(),
            saved,
            rng,
            draws: self.backward_draws,
            tangent_meta: self.diff_meta.clone(),
        });
        let wrt: Vec<Tensor> = self
            .grad_inputs
            .iter()
            .map(|&i| inputs[i].clone())
            .collect();
        let diff: Vec<Tensor> = self.diff_outputs.iter().map(|&k| outs[k].clone()).collect();
        let tracked = apply_function(backward, &wrt, &diff);
        for (&k, t) in self.diff_outputs.iter().zip(tracked) {
            outs[k] = t;
        }
        Ok(outs)
    }
}

impl CompiledGraph for AotCompiled {
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let rng = (self.rng_span > 0).then(|| default_draw(self.rng_span as usize));
        self.run_at(inputs, rng)
    }

    fn run_with_rng(&self, inputs: &[Tensor], rng: (u64, u64)) -> Result<Vec<Tensor>> {
        self.run_at(inputs, Some(rng))
    }
}

/// The tape node of one compiled forward call: its saved values and the compiled backward.
struct CompiledBackward {
    graph: Arc<dyn CompiledGraph>,
    saved: Vec<Tensor>,
    rng: Option<(u64, u64)>,
    /// Whether the backward graph itself draws (recomputes the forward's random values).
    draws: bool,
    /// Shapes and dtypes of the tangents, for outputs that got no gradient (shared per graph).
    tangent_meta: Arc<[(Vec<usize>, kiln_core::DType)]>,
}

impl Function for CompiledBackward {
    fn name(&self) -> &str {
        "CompiledFunctionBackward"
    }

    fn backward(&self, grad_outputs: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let _span = profiler::span(profiler::Category::CompiledBackward, || {
            "CompiledFunctionBackward".into()
        });
        let mut inputs = self.saved.clone();
        for (g, (shape, dtype)) in grad_outputs.iter().zip(self.tangent_meta.iter()) {
            inputs.push(match g {
                Some(g) => g.clone(),
                None => Tensor::zeros(shape.as_slice(), *dtype)?,
            });
        }
        let grads = match self.rng {
            Some(r) if self.draws => self.graph.run_with_rng(&inputs, r)?,
            _ => self.graph.run(&inputs)?,
        };
        Ok(grads.into_iter().map(Some).collect())
    }

    fn saved_tensors(&self) -> Vec<Tensor> {
        self.saved.clone()
    }
}
