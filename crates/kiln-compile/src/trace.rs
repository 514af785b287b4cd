//! The tracer: while installed as the core's `Interceptor`, every prim the user's code applies is
//! recorded into the current graph segment and answered with a deferred tensor. A value read of a
//! deferred tensor forces it: the segment ends (a graph break), is compiled and run, every traced
//! tensor the user still holds is filled in, and tracing continues in a new segment.

use std::collections::HashMap;
use std::panic::Location;
use std::sync::{Arc, Mutex, Weak};

use kiln_core::autograd::is_grad_enabled;
use kiln_core::intercept::{self, Deferred, Interceptor};
use kiln_core::prim::{OutMeta, Prim};
use kiln_core::{Device, Error, Result, Tensor, WeakTensor};

use crate::alias::{scatter_maps, Root, Views};
use crate::backends::{Backend, BackendContext, CompiledGraph};
use crate::cache;
use crate::fast_hash::Fast;
use crate::graph::{Graph, Node, NodeId, Op};
use crate::logs::{self, Channel};

/// Where a graph input's tensor comes from on each call.
#[derive(Clone)]
pub enum Source {
    /// The i-th call argument.
    Arg(usize),
    /// A tensor the traced code read that is not an argument (a parameter, a buffer, a captured
    /// constant). Held by reference: in-place updates are seen without recompiling.
    Captured(Tensor),
    /// The `.grad` of this tensor, read afresh on each call (backward replaces it).
    Grad(Tensor),
}

impl Source {
    /// The tensor this source stands for on a call with `args`.
    pub fn resolve(&self, args: &[Tensor]) -> Result<Tensor> {
        match self {
            Source::Arg(i) => Ok(args[*i].clone()),
            Source::Captured(t) => Ok(t.clone()),
            Source::Grad(owner) => owner.grad().ok_or_else(|| {
                Error::arg(
                    "compile",
                    format!(
                        "a compiled graph reads the gradient of a {:?} tensor, which has none",
                        owner.shape()
                    ),
                )
            }),
        }
    }
}

/// Gives `dst` a graph's new value for it. A backend that wrote in place
/// (`Graph::mutated_inputs`) hands the destination itself back: nothing to copy.
pub(crate) fn write_back(dst: &Tensor, new: &Tensor) -> Result<()> {
    if new.same_tensor(dst) {
        return Ok(());
    }
    kiln_core::no_grad(|| dst.assign(new))
}

/// Why a graph ended early.
#[derive(Clone, Debug)]
pub struct GraphBreak {
    /// The read that needed values: `item`, `to_vec`, `assign`, ...
    pub reason: &'static str,
    pub location: &'static Location<'static>,
}

impl std::fmt::Display for GraphBreak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` reads a traced tensor's values at {}:{}:{}",
            self.reason,
            self.location.file(),
            self.location.line(),
            self.location.column()
        )
    }
}

/// One finished segment: its graph, how to feed it, and what it produced.
pub struct SegmentRecord {
    pub graph: Graph,
    pub sources: Vec<Source>,
    pub compiled: Arc<dyn CompiledGraph>,
    /// Tensor ids of the graph outputs that are user-visible values, in output order.
    pub out_ids: Vec<u64>,
    /// In-place updates: (destination, graph output index holding the new value).
    pub mutations: Vec<(Tensor, usize)>,
    /// Set when the segment ended at a graph break rather than at the end of the function.
    pub ended_by: Option<GraphBreak>,
}

/// What the tracer does with the function's graph when tracing ends (`Tracer::set_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceMode {
    /// Compile and run every segment as it ends (the traced call's results come from that run).
    Run,
    /// A function traced as one graph keeps it uncompiled and unrun (`Tracer::take_captured`),
    /// for the caller to decide how to compile it (dynamic shapes); segments ended by a graph
    /// break still run as in `Run`.
    CaptureFinal,
    /// As `CaptureFinal`, but a graph break is an error: the trace ran on stand-in arguments and
    /// must have no effect.
    Probe,
}

/// The one graph of a trace in `CaptureFinal` or `Probe` mode, not yet compiled or run.
pub struct CapturedGraph {
    pub graph: Graph,
    pub sources: Vec<Source>,
    /// Tensor ids of the graph outputs that are user-visible values, in output order.
    pub out_ids: Vec<u64>,
    /// In-place updates: (destination, graph output index holding the new value).
    pub mutations: Vec<(Tensor, usize)>,
    /// The default generator's state before the traced code's first draw: a run of the graph
    /// must start there to draw what eager code would have.
    pub rng_base: Option<(u64, u64)>,
}

#[derive(Default)]
struct Segment {
    graph: Graph,
    sources: Vec<Source>,
    known: HashMap<u64, NodeId, Fast>,
    pending: Vec<(WeakTensor, NodeId, u64)>,
    /// Where each traced tensor's entry of `pending` is, by tensor id.
    pending_at: HashMap<u64, usize, Fast>,
    /// The length of `pending` at which its dead entries are next dropped (`note_pending`).
    compact_at: usize,
    mutations: Vec<(Tensor, NodeId)>,
    /// Traced tensors eager execution would have made views, for writes through them.
    views: Views,
    /// (seed, offset) of the first random draw traced in this segment.
    rng_base: Option<(u64, u64)>,
}

struct State {
    seg: Segment,
    done: Vec<SegmentRecord>,
}

pub struct Tracer {
    me: Weak<Tracer>,
    name: String,
    args: Vec<Tensor>,
    arg_ids: HashMap<u64, usize>,
    backend: Arc<dyn Backend>,
    ctx: BackendContext,
    fullgraph: bool,
    state: Mutex<State>,
    /// Gradients the traced code read, by tensor id, with the tensor they are the `.grad` of.
    grads: Mutex<HashMap<u64, Tensor>>,
    /// Why the traced code cannot be replayed without running it, if it cannot.
    retrace: Mutex<Option<&'static str>>,
    mode: Mutex<TraceMode>,
    captured: Mutex<Option<CapturedGraph>>,
}

impl Tracer {
    pub fn new(
        name: &str,
        args: &[Tensor],
        backend: Arc<dyn Backend>,
        ctx: BackendContext,
        fullgraph: bool,
    ) -> Arc<Tracer> {
        Arc::new_cyclic(|me| Tracer {
            me: me.clone(),
            name: name.to_string(),
            args: args.to_vec(),
            arg_ids: args.iter().enumerate().map(|(i, t)| (t.id(), i)).collect(),
            backend,
            ctx,
            fullgraph,
            state: Mutex::new(State {
                seg: Segment::default(),
                done: Vec::new(),
            }),
            grads: Mutex::new(HashMap::new()),
            retrace: Mutex::new(None),
            mode: Mutex::new(TraceMode::Run),
            captured: Mutex::new(None),
        })
    }

    pub fn set_mode(&self, mode: TraceMode) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = mode;
    }

    /// The graph kept by a `CaptureFinal` or `Probe` trace, once `finish` returned.
    pub fn take_captured(&self) -> Option<CapturedGraph> {
        self.captured
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The graph value of `t`: a value traced in this segment, or a new input.
    fn value_of(&self, seg: &mut Segment, t: &Tensor) -> NodeId {
        if let Some(&id) = seg.known.get(&t.id()) {
            return id;
        }
        let id = seg
            .graph
            .push_input(t.shape(), t.dtype(), t.device(), t.requires_grad());
        // the tracer's inputs are marked grad-enabled (the flag is part of the structure key)
        seg.graph.nodes[id].grad_enabled = true;
        let grad_of = self
            .grads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&t.id())
            .cloned();
        seg.sources
            .push(match (self.arg_ids.get(&t.id()), grad_of) {
                (Some(&i), _) => Source::Arg(i),
                (None, Some(owner)) => Source::Grad(owner),
                (None, None) => Source::Captured(t.clone()),
            });
        seg.known.insert(t.id(), id);
        id
    }

    /// Ends the current segment: compiles and runs it, fills in the traced tensors still alive.
    fn flush(&self, ended_by: Option<GraphBreak>) -> Result<()> {
        let seg = std::mem::take(&mut self.lock().seg);
        if seg.graph.num_ops() == 0 && seg.mutations.is_empty() {
            return Ok(());
        }
        let Segment {
            mut graph,
            sources,
            pending,
            mutations,
            rng_base,
            ..
        } = seg;
        let live: Vec<(Tensor, NodeId, u64)> = pending
            .iter()
            .filter_map(|(w, n, id)| w.upgrade().map(|t| (t, *n, *id)))
            .collect();
        graph.outputs = live
            .iter()
            .map(|(_, n, _)| *n)
            .chain(mutations.iter().map(|(_, n)| *n))
            .collect();
        let (mut graph, keep_inputs) = prune(graph);
        let sources: Vec<Source> = keep_inputs.iter().map(|&i| sources[i].clone()).collect();
        graph.mutated_inputs = self.mutated_inputs(&sources, &mutations, live.len());
        graph.static_inputs = sources
            .iter()
            .map(|s| matches!(s, Source::Captured(_)))
            .collect();
        let mode = *self.mode.lock().unwrap_or_else(|e| e.into_inner());
        if mode == TraceMode::Probe && ended_by.is_some() {
            return Err(Error::Unsupported {
                op: "compile (dynamic shapes)",
                msg: "a probe trace at another size reached a graph break".into(),
            });
        }
        if mode != TraceMode::Run && ended_by.is_none() && self.lock().done.is_empty() {
            *self.captured.lock().unwrap_or_else(|e| e.into_inner()) = Some(CapturedGraph {
                graph,
                sources,
                out_ids: live.iter().map(|(_, _, id)| *id).collect(),
                mutations: mutations
                    .iter()
                    .enumerate()
                    .map(|(k, (dst, _))| (dst.clone(), live.len() + k))
                    .collect(),
                rng_base,
            });
            return Ok(());
        }
        if let Some(b) = &ended_by {
            logs::emit(Channel::GraphBreaks, || {
                format!("graph break in {}: {b}", self.name)
            });
        }
        let compiled = cache::compile_cached(&self.backend, &self.ctx, &graph, &self.name)?;
        let inputs: Vec<Tensor> = sources
            .iter()
            .map(|s| s.resolve(&self.args))
            .collect::<Result<_>>()?;
        if let Some((seed, offset)) = rng_base {
            // the traced code already drew these values: the run draws them again, identically
            kiln_core::ops::set_default_generator_state(seed, offset);
        }
        let outputs = {
            let _off = intercept::install(None);
            // the traced call's run of what it just compiled, apart from the recording around it
            // in the compiled region's own time
            let _span =
                kiln_core::profiler::span(kiln_core::profiler::Category::CompiledRegion, || {
                    format!("traced graph's first run: {}", self.name).into()
                });
            let outs = compiled.run(&inputs)?;
            for ((t, _, _), v) in live.iter().zip(&outs) {
                t.fill_deferred(v)?;
            }
            for (k, (dst, _)) in mutations.iter().enumerate() {
                write_back(dst, &outs[live.len() + k])?;
            }
            outs
        };
        drop(outputs);
        let record = SegmentRecord {
            graph,
            sources,
            compiled,
            out_ids: live.iter().map(|(_, _, id)| *id).collect(),
            mutations: mutations
                .iter()
                .enumerate()
                .map(|(k, (dst, _))| (dst.clone(), live.len() + k))
                .collect(),
            ended_by,
        };
        self.lock().done.push(record);
        Ok(())
    }

    /// The graph's `mutated_inputs`: for each in-place write whose destination is a graph input,
    /// (its output index, that input's index). `set_value` keeps one write per destination.
    fn mutated_inputs(
        &self,
        sources: &[Source],
        mutations: &[(Tensor, NodeId)],
        first_output: usize,
    ) -> Vec<(usize, usize)> {
        let is = |s: &Source, dst: &Tensor| match s {
            Source::Arg(i) => self.args[*i].same_tensor(dst),
            Source::Captured(t) => t.same_tensor(dst),
            Source::Grad(_) => false, // re-read per call: not a stable destination
        };
        mutations
            .iter()
            .enumerate()
            .filter_map(|(k, (dst, _))| {
                let input = sources.iter().position(|s| is(s, dst))?;
                Some((first_output + k, input))
            })
            .collect()
    }

    /// Set when the traced code read Rust state a replay cannot reproduce.
    pub fn retrace_reason(&self) -> Option<&'static str> {
        *self.retrace.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends tracing: runs the last segment and returns every segment recorded.
    pub fn finish(&self) -> Result<Vec<SegmentRecord>> {
        self.flush(None)?;
        Ok(std::mem::take(&mut self.lock().done))
    }
}

impl Interceptor for Tracer {
    fn apply(
        &self,
        prim: &Prim,
        inputs: &[&Tensor],
        meta: &OutMeta,
        device: Device,
    ) -> Option<Result<Tensor>> {
        let me: Arc<dyn Deferred> = self.me.upgrade()?;
        let mut st = self.lock();
        // a deferred tensor of another (finished) trace is computed before it joins this one;
        // almost every operand is a value of this segment, found without taking its own lock
        let foreign =
            |st: &State, t: &Tensor| !st.seg.known.contains_key(&t.id()) && t.is_deferred();
        if inputs.iter().any(|t| foreign(&st, t)) {
            drop(st);
            for t in inputs {
                if foreign(&self.lock(), t) {
                    if let Err(e) = t.ready(prim.name(), Location::caller()) {
                        return Some(Err(e));
                    }
                }
            }
            st = self.lock();
        }
        let seg = &mut st.seg;
        let args: Vec<NodeId> = inputs.iter().map(|t| self.value_of(seg, t)).collect();
        let prim = match prim {
            // offsets become relative to the segment's first draw; see Graph::rng_span
            Prim::Rand {
                shape,
                dtype,
                dist,
                seed,
                offset,
            } => {
                let (_, base) = *seg.rng_base.get_or_insert((*seed, *offset));
                let rel = offset - base;
                let n: usize = shape.iter().product();
                seg.graph.rng_span = seg.graph.rng_span.max(rel + n as u64);
                Prim::Rand {
                    shape: shape.clone(),
                    dtype: *dtype,
                    dist: *dist,
                    seed: 0,
                    offset: rel,
                }
            }
            p => p.clone(),
        };
        let out = Tensor::deferred(&meta.shape, meta.dtype, device, me);
        if let Prim::Permute(_) | Prim::Expand(_) | Prim::Slice { .. } | Prim::Reshape(_) = &prim {
            seg.views.record(&prim, inputs[0], &out);
        }
        let id = seg.graph.push(Node {
            op: Op::Prim(prim),
            args,
            shape: meta.shape.clone(),
            dtype: meta.dtype,
            grad_enabled: is_grad_enabled(),
            requires_grad: false,
            device,
        });
        seg.known.insert(out.id(), id);
        note_pending(seg, &out, id);
        Some(Ok(out))
    }

    fn before_read(
        &self,
        t: &Tensor,
        why: &'static str,
        at: &'static Location<'static>,
    ) -> Result<()> {
        self.before_read_impl(t, why, at)
    }

    fn retrace_every_call(&self, why: &'static str) {
        *self.retrace.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    fn grad_read(&self, owner: &Tensor, grad: &Tensor) {
        if !grad.is_deferred() {
            self.grads
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(grad.id(), owner.clone());
        }
    }

    fn assign(&self, dst: &Tensor, src: &Tensor) -> Option<Result<()>> {
        let mut st = self.lock();
        if src.is_deferred() && !st.seg.known.contains_key(&src.id()) {
            return None;
        }
        let seg = &mut st.seg;
        if dst.is_deferred() && !seg.known.contains_key(&dst.id()) {
            return None; // a value of an earlier trace: compute it first (a graph break)
        }
        let v = self.value_of(seg, src);
        let mut stride_dependent = false;
        let written = match seg.views.get(dst.id()).cloned() {
            // a write through a view: the root it aliases gets a new value
            Some(view) => {
                stride_dependent = view.stride_dependent;
                let root_node = match &view.root {
                    Root::Real(t) => self.value_of(seg, t),
                    Root::Traced(id) => match seg.known.get(id) {
                        Some(&n) => n,
                        None => return None,
                    },
                };
                match self.write_through(seg, root_node, &view.chain, v) {
                    Ok(node) => (view.root, node),
                    Err(e) => return Some(Err(e)),
                }
            }
            None if dst.is_deferred() => (Root::Traced(dst.id()), v),
            None => {
                // the destination is read as it was before the write, then reads see the new value
                self.value_of(seg, dst);
                (Root::Real(dst.clone()), v)
            }
        };
        let rederived = set_value(seg, written.0, written.1);
        drop(st);
        match rederived.map(|views| views || stride_dependent) {
            Ok(true) => self.retrace_every_call(
                "a write through a reshaped view of a strided tensor (its strides are not guarded)",
            ),
            Ok(false) => {}
            Err(e) => return Some(Err(e)),
        }
        Some(Ok(()))
    }
}

impl Tracer {
    /// The new value of a root after `src` is written through its view `chain`.
    fn write_through(
        &self,
        seg: &mut Segment,
        root: NodeId,
        chain: &[Prim],
        src: NodeId,
    ) -> Result<NodeId> {
        let (shape, dtype) = (
            seg.graph.nodes[root].shape.clone(),
            seg.graph.nodes[root].dtype,
        );
        let Some((pos, mask)) = scatter_maps(&shape, chain)? else {
            return Ok(root);
        };
        // the index maps are constants made on the CPU; a device graph reads them on its device.
        // The upload reads them outside the trace: `before_read` would take the tracer's lock,
        // which this call already holds.
        let device = seg.graph.nodes[root].device;
        let (pos, mask) = {
            let _off = intercept::install(None);
            (pos.to_device(device)?, mask.to_device(device)?)
        };
        let n = pos.numel();
        let m = seg.graph.nodes[src].shape.iter().product();
        let pos = self.value_of(seg, &pos);
        let mask = self.value_of(seg, &mask);
        let src_flat = push(seg, Prim::Reshape(vec![m]), vec![src])?;
        let gathered = push(seg, Prim::Gather { dim: 0 }, vec![src_flat, pos])?;
        let root_flat = push(seg, Prim::Reshape(vec![n]), vec![root])?;
        let merged = push(seg, Prim::Where, vec![mask, gathered, root_flat])?;
        debug_assert_eq!(seg.graph.nodes[merged].dtype, dtype);
        push(seg, Prim::Reshape(shape), vec![merged])
    }
}

/// Appends `prim(args)` to the segment's graph (outside grad mode: writes are not differentiated).
fn push(seg: &mut Segment, prim: Prim, args: Vec<NodeId>) -> Result<NodeId> {
    let shapes: Vec<&[usize]> = args
        .iter()
        .map(|&a| seg.graph.nodes[a].shape.as_slice())
        .collect();
    let dtypes: Vec<_> = args.iter().map(|&a| seg.graph.nodes[a].dtype).collect();
    let meta = prim.infer(&shapes, &dtypes)?;
    let device = args
        .last()
        .map_or(Device::Cpu, |&a| seg.graph.nodes[a].device);
    Ok(seg.graph.push(Node {
        op: Op::Prim(prim),
        args,
        shape: meta.shape,
        dtype: meta.dtype,
        grad_enabled: false,
        requires_grad: false,
        device,
    }))
}

/// Makes `node` the value of `root` from here on: a real root's write is replayed after each call;
/// every live view of the root is re-derived from the new value, as shared storage would show it.
/// Returns whether one of those views exists only because of a real root's exact strides.
fn set_value(seg: &mut Segment, root: Root, node: NodeId) -> Result<bool> {
    let root_id = root.id();
    match root {
        Root::Real(t) => match seg.mutations.iter_mut().find(|(d, _)| d.id() == root_id) {
            Some(m) => m.1 = node,
            None => seg.mutations.push((t, node)),
        },
        Root::Traced(_) => {}
    }
    rebind(seg, root_id, node);
    let mut stride_dependent = false;
    for (view_id, view) in seg.views.of_root(root_id) {
        stride_dependent |= view.stride_dependent;
        let mut at = node;
        for p in view.chain {
            at = push(seg, p, vec![at])?;
        }
        rebind(seg, view_id, at);
    }
    Ok(stride_dependent)
}

/// Adds traced tensor `t`, the value of `node`, to those filled in when the segment runs. Most
/// traced tensors are intermediates the traced code drops at once, but a weak handle keeps
/// their allocation: the dead ones are dropped each time `pending` has doubled (amortized
/// constant time), so the allocator hands their memory, still in cache, to the next ones.
fn note_pending(seg: &mut Segment, t: &Tensor, node: NodeId) {
    if seg.pending.len() >= seg.compact_at {
        seg.pending.retain(|(w, _, _)| w.upgrade().is_some());
        seg.pending_at.clear();
        for (at, &(_, _, id)) in seg.pending.iter().enumerate() {
            seg.pending_at.insert(id, at);
        }
        seg.compact_at = (2 * seg.pending.len()).max(256);
    }
    seg.pending_at.insert(t.id(), seg.pending.len());
    seg.pending.push((t.downgrade(), node, t.id()));
}

/// Points tensor `id` at graph value `node`, for later reads and for filling it in at the end.
fn rebind(seg: &mut Segment, id: u64, node: NodeId) {
    seg.known.insert(id, node);
    if let Some(&at) = seg.pending_at.get(&id) {
        seg.pending[at].1 = node;
    }
}

impl Tracer {
    /// A read of a real tensor this segment wrote must see the write: run the segment first.
    fn before_read_impl(
        &self,
        t: &Tensor,
        why: &'static str,
        at: &'static Location<'static>,
    ) -> Result<()> {
        let written = self
            .lock()
            .seg
            .mutations
            .iter()
            .any(|(d, _)| d.id() == t.id());
        if written {
            self.force(t, why, at)?;
        }
        Ok(())
    }
}

impl Deferred for Tracer {
    fn force(&self, t: &Tensor, why: &'static str, at: &'static Location<'static>) -> Result<()> {
        let brk = GraphBreak {
            reason: why,
            location: at,
        };
        if self.fullgraph {
            return Err(Error::Unsupported {
                op: "compile(fullgraph=true)",
                msg: format!(
                    "graph break: {brk}; remove the value read or compile with fullgraph=false"
                ),
            });
        }
        self.flush(Some(brk))?;
        if t.is_deferred() {
            return Err(Error::arg(
                "compile",
                "a traced tensor was read after its trace ended without producing it",
            ));
        }
        Ok(())
    }
}

/// Drops nodes no output depends on and inputs no node reads; returns the pruned graph and, for
/// each kept input, its index in the original graph.
fn prune(g: Graph) -> (Graph, Vec<usize>) {
    let mut needed = vec![false; g.nodes.len()];
    for &o in &g.outputs {
        needed[o] = true;
    }
    for id in (0..g.nodes.len()).rev() {
        if needed[id] {
            for &a in &g.nodes[id].args {
                needed[a] = true;
            }
        }
    }
    let mut remap = vec![usize::MAX; g.nodes.len()];
    let mut out = Graph {
        rng_span: g.rng_span,
        ..Graph::default()
    };
    out.nodes.reserve(needed.iter().filter(|&&n| n).count());
    let mut kept_inputs = Vec::new();
    // the kept nodes are moved, not cloned: a recorded graph has thousands of nodes, each with
    // its own vectors, and copying then dropping them was a third of a DenseNet trace's flush
    for (id, mut n) in g.nodes.into_iter().enumerate() {
        if !needed[id] {
            continue;
        }
        if let Op::Input(i) = n.op {
            kept_inputs.push(i);
            n.op = Op::Input(out.num_inputs);
            out.num_inputs += 1;
        }
        n.args.iter_mut().for_each(|a| *a = remap[*a]);
        remap[id] = out.push(n);
    }
    out.outputs = g.outputs.iter().map(|&o| remap[o]).collect();
    (out, kept_inputs)
}
