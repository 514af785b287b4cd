//! `compile_fn`: a function of tensors that traces on first call, replays its compiled graph while
//! the guards hold, recompiles when they fail, and falls back to eager past the recompile limit.

use std::sync::{Arc, Mutex, TryLockError};

mod dynamic;

use kiln_core::intercept;
use kiln_core::profiler;
use kiln_core::{Error, Result, Tensor};

use crate::backends::{lookup_backend, Backend, BackendContext, CompiledGraph};
use crate::cache;
use crate::guards::Guards;
use crate::logs::{self, Channel};
use crate::options::{BackendChoice, CompileOptions};
use crate::trace::{write_back, SegmentRecord, Source, TraceMode, Tracer};

type UserFn<'f> = Box<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'f>;

/// Where each returned tensor comes from on a replay.
enum OutSlot {
    Graph(usize),
    Arg(usize),
    Const(Tensor),
}

/// A single-graph trace, replayable without running the user's code.
struct Entry {
    guards: Guards,
    compiled: Option<Arc<dyn CompiledGraph>>,
    sources: Vec<Source>,
    outputs: Vec<OutSlot>,
    /// In-place writes: (destination, graph output). A destination that was a call argument is
    /// `Source::Arg`, so a replay writes into that call's argument.
    mutations: Vec<(Source, usize)>,
    /// The graph's inputs kept gathered between replays, when it reads captured tensors.
    inputs: Option<InputBuffer>,
    /// A static entry's traced graph, kept where automatic dynamic may unify it with a trace at
    /// other sizes (`dynamic::SymEntry`).
    graph: Option<crate::graph::Graph>,
    /// Set on a symbolic entry: its argument sizes are checked by it, not by `guards`.
    sym: Option<dynamic::SymEntry>,
}

impl Entry {
    #[inline]
    fn holds(&self, args: &[Tensor], extra: u64) -> bool {
        match &self.sym {
            None => self.guards.hold(args, extra),
            Some(s) => self.guards.hold_except_sizes(args, extra) && s.seen(args),
        }
    }

    fn why_not(&self, args: &[Tensor], extra: u64) -> Option<String> {
        match &self.sym {
            Some(s) if self.guards.hold_except_sizes(args, extra) => (!s.seen(args)).then(|| {
                let sizes: Vec<&[usize]> = args.iter().map(|a| a.shape()).collect();
                format!("argument sizes {sizes:?} are new to the symbolic entry")
            }),
            _ => self.guards.why_not(args, extra),
        }
    }
}

/// The graph-input list of an entry, built once: the captured tensors (parameters) sit in their
/// slots for good, and a replay only writes the call's arguments into theirs, rather than cloning
/// every handle (two atomic refcount updates per parameter per call). Between calls the argument
/// slots hold `placeholder`, a handle the entry keeps anyway, so no argument outlives its call.
struct InputBuffer {
    slots: Mutex<Vec<Tensor>>,
    /// (slot, argument index) for each `Source::Arg`.
    arg_slots: Vec<(usize, usize)>,
    placeholder: Tensor,
}

impl InputBuffer {
    fn new(sources: &[Source]) -> Option<InputBuffer> {
        if sources.iter().any(|s| matches!(s, Source::Grad(_))) {
            return None; // gradients are re-read on every call
        }
        let placeholder = sources.iter().find_map(|s| match s {
            Source::Captured(t) => Some(t.clone()),
            _ => None,
        })?;
        let mut arg_slots = Vec::new();
        let slots = sources
            .iter()
            .enumerate()
            .map(|(k, s)| match s {
                Source::Arg(i) => {
                    arg_slots.push((k, *i));
                    placeholder.clone()
                }
                Source::Captured(t) | Source::Grad(t) => t.clone(),
            })
            .collect();
        Some(InputBuffer {
            slots: Mutex::new(slots),
            arg_slots,
            placeholder,
        })
    }

    /// Runs `c` on the buffered inputs with `args` in place; `None` when the buffer is in use
    /// (a concurrent or re-entrant replay of the same entry), for the caller to gather afresh.
    fn run(&self, c: &dyn CompiledGraph, args: &[Tensor]) -> Option<Result<Vec<Tensor>>> {
        let mut slots = match self.slots.try_lock() {
            Ok(g) => g,
            // a panic inside a backend left arguments in their slots: they are overwritten below
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        for &(k, i) in &self.arg_slots {
            slots[k] = args[i].clone();
        }
        let out = c.run(&slots);
        for &(k, _) in &self.arg_slots {
            slots[k] = self.placeholder.clone();
        }
        Some(out)
    }
}

/// Per-function counters (what torch's `CompileCounter` and dynamo's stats report).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FnStats {
    /// Calls that ran the user's code under the tracer.
    pub traces: usize,
    /// Cache entries created (first compile + recompiles).
    pub compiles: usize,
    /// Calls answered by replaying a cached graph.
    pub replays: usize,
    /// Graph breaks seen, over all traces.
    pub graph_breaks: usize,
    /// Calls run eagerly after the recompile limit.
    pub eager_fallbacks: usize,
    /// The warning printed when the recompile limit was hit.
    pub fallback_warning: Option<String>,
    /// Calls at a new size whose trace instantiated a symbolic entry: traced, not compiled.
    pub symbolic_reuses: usize,
    /// Cache entries with symbolic sizes (counted in `compiles` too).
    pub symbolic_compiles: usize,
    /// What `KILN_LOGS=recompiles` said for this function, newest last (the last 32).
    pub recompile_log: Vec<String>,
}

impl FnStats {
    fn log_recompile(&mut self, msg: String) {
        logs::emit(Channel::Recompiles, || msg.clone());
        if self.recompile_log.len() == 32 {
            self.recompile_log.remove(0);
        }
        self.recompile_log.push(msg);
    }
}

#[derive(Default)]
struct FnState {
    epoch: u64,
    entries: Vec<Arc<Entry>>,
    has_breaks: bool,
    /// Whether the backend was told of a trace of this function (`Backend::trace_starting`).
    announced: bool,
    stats: FnStats,
}

pub struct CompiledFn<'f> {
    f: UserFn<'f>,
    name: String,
    opts: CompileOptions,
    backend: Arc<dyn Backend>,
    state: Mutex<FnState>,
}

/// `torch.compile(fn)`: wraps `f`; nothing is traced until the first call.
pub fn compile_fn<'f, F>(f: F, opts: CompileOptions) -> Result<CompiledFn<'f>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'f,
{
    compile_named("fn", f, opts)
}

/// `compile_fn` with a name for logs, debug dumps and `explain`.
pub fn compile_named<'f, F>(name: &str, f: F, opts: CompileOptions) -> Result<CompiledFn<'f>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'f,
{
    let backend = match &opts.backend {
        BackendChoice::Named(n) => lookup_backend(n)?,
        BackendChoice::Custom(b) => b.clone(),
    };
    if opts.recompile_limit == 0 {
        return Err(Error::arg("compile", "recompile_limit must be at least 1"));
    }
    Ok(CompiledFn {
        f: Box::new(f),
        name: name.to_string(),
        opts,
        backend,
        state: Mutex::new(FnState::default()),
    })
}

impl<'f> CompiledFn<'f> {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn options(&self) -> &CompileOptions {
        &self.opts
    }
    pub fn stats(&self) -> FnStats {
        self.lock().stats.clone()
    }

    /// `kiln::explain` of this function's code on `args` (traced once on the interpreter; the
    /// function's caches are not touched), plus its cache entries: static, or symbolic with their
    /// symbols, symbol guards and the sizes they ran at.
    pub fn explain(&self, args: &[Tensor]) -> Result<crate::ExplainOutput> {
        let mut out = crate::explain(|a: &[Tensor]| (self.f)(a), args)?;
        let entries: Vec<Arc<Entry>> = self.lock().entries.clone();
        out.entries = entries
            .iter()
            .map(|e| match &e.sym {
                Some(s) => crate::explain::EntryReport::Symbolic(s.report(&e.sources)),
                None => crate::explain::EntryReport::Static {
                    shapes: e.guards.args.iter().map(|g| g.shape.clone()).collect(),
                },
            })
            .collect();
        Ok(out)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FnState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn call(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        self.call_keyed(args, 0)
    }

    /// `call`, guarding also on `extra`, a key for Rust state the traced code branches on.
    pub fn call_keyed(&self, args: &[Tensor], extra: u64) -> Result<Vec<Tensor>> {
        if self.opts.disable || intercept::current().is_some() {
            // disabled, or called from code already being traced: run inline (torch inlines too)
            return (self.f)(args);
        }
        let _span = profiler::span(profiler::Category::CompiledRegion, || {
            format!("compiled region: {}", self.name).into()
        });
        let (entry, trace_each_call) = {
            let mut st = self.lock();
            if st.epoch != cache::epoch() {
                let stats = std::mem::take(&mut st.stats);
                *st = FnState {
                    epoch: cache::epoch(),
                    stats,
                    ..FnState::default()
                };
            }
            let entry = st.entries.iter().find(|e| e.holds(args, extra)).cloned();
            if entry.is_some() {
                // counted under the lookup's lock: a replay takes the state lock once
                st.stats.replays += 1;
            }
            (entry, st.has_breaks)
        };
        if let Some(e) = entry {
            return replay(&e, args);
        }
        if !trace_each_call {
            let mut st = self.lock();
            if st.entries.len() >= self.opts.recompile_limit {
                st.stats.eager_fallbacks += 1;
                if st.stats.fallback_warning.is_none() {
                    let why = st
                        .entries
                        .last()
                        .and_then(|e| e.why_not(args, extra))
                        .unwrap_or_default();
                    let w = format!(
                        "kiln: {} hit recompile_limit ({}); running it eagerly from now on. Last recompile reason: {why}. \
                         Mark the changing dimension dynamic or raise recompile_limit.",
                        self.name, self.opts.recompile_limit
                    );
                    eprintln!("{w}");
                    tracing::warn!(target: "kiln::recompiles", "{w}");
                    st.stats.fallback_warning = Some(w);
                }
                drop(st);
                return (self.f)(args);
            }
            let why = st
                .entries
                .last()
                .map(|last| last.why_not(args, extra).unwrap_or_default());
            let capture = self.opts.dynamic != Some(false)
                && (why.is_some() || self.opts.dynamic == Some(true) || dynamic::has_marks(args));
            drop(st);
            if capture {
                return self.trace_dynamic(args, extra, why);
            }
            if let Some(why) = why {
                self.lock()
                    .stats
                    .log_recompile(format!("Recompiling function {}: {why}", self.name));
            }
        }
        self.trace(args, extra)
    }

    fn backend_context(&self) -> BackendContext {
        BackendContext {
            mode: self.opts.mode.as_str().to_string(),
            options: self.opts.options.clone(),
            fullgraph: self.opts.fullgraph,
            name: self.name.clone(),
        }
    }

    /// A tracer of a call with `args`. Before the function's first trace (since `kiln::reset`;
    /// a probe on stand-in arguments does not count) the backend is told
    /// (`Backend::trace_starting`), and told again when the returned guard drops
    /// (`Backend::trace_finished`): the caller keeps it until the trace's graphs are compiled.
    /// Only the first: what the backend starts then serves the later traces too, and a
    /// function with a graph break is traced on every call.
    fn new_tracer(&self, args: &[Tensor], mode: TraceMode) -> (Arc<Tracer>, TraceEnd) {
        let ctx = self.backend_context();
        let first =
            mode != TraceMode::Probe && !std::mem::replace(&mut self.lock().announced, true);
        let end = match first {
            true => {
                // before the backend's read-ahead threads start allocating
                kiln_core::host_memory::tune_malloc();
                self.backend.trace_starting(&ctx, args);
                TraceEnd(Some((self.backend.clone(), ctx.clone())))
            }
            false => TraceEnd(None),
        };
        let tracer = Tracer::new(
            &self.name,
            args,
            self.backend.clone(),
            ctx,
            self.opts.fullgraph,
        );
        tracer.set_mode(mode);
        (tracer, end)
    }

    fn trace(&self, args: &[Tensor], extra: u64) -> Result<Vec<Tensor>> {
        let (tracer, _end) = self.new_tracer(args, TraceMode::Run);
        let outs = {
            let _on = intercept::install(Some(tracer.clone()));
            (self.f)(args)
        };
        let records = tracer.finish();
        let outs = outs?;
        let records = records?;
        let mut st = self.lock();
        st.stats.traces += 1;
        let breaks = records.iter().filter(|r| r.ended_by.is_some()).count();
        st.stats.graph_breaks += breaks;
        let retrace = tracer.retrace_reason();
        if let Some(why) = retrace {
            logs::emit(Channel::GraphBreaks, || {
                format!("{} is traced on every call: {why}", self.name)
            });
        }
        if breaks > 0 || st.has_breaks || retrace.is_some() {
            // the Rust code between graphs must run each call: trace every call, graphs come from cache
            st.has_breaks = true;
            return Ok(outs);
        }
        let mut rec = records.into_iter().next();
        // kept for automatic dynamic: a later trace at other sizes unifies with it (moved out of
        // the record, which the entry does not keep: no copy of thousands of nodes)
        let graph = rec
            .as_mut()
            .filter(|_| self.opts.dynamic != Some(false))
            .map(|r| std::mem::take(&mut r.graph));
        let mut entry = make_entry(args, extra, rec, &outs);
        entry.graph = graph;
        logs::emit(Channel::Guards, || {
            format!(
                "guards for {}:\n  {}",
                self.name,
                entry.guards.describe().join("\n  ")
            )
        });
        st.entries.push(Arc::new(entry));
        st.stats.compiles += 1;
        Ok(outs)
    }
}

/// Tells the backend that a trace it was told of ended, its graphs compiled, when dropped.
struct TraceEnd(Option<(Arc<dyn Backend>, BackendContext)>);

impl Drop for TraceEnd {
    fn drop(&mut self) {
        if let Some((backend, ctx)) = &self.0 {
            backend.trace_finished(ctx);
        }
    }
}

fn make_entry(args: &[Tensor], extra: u64, rec: Option<SegmentRecord>, outs: &[Tensor]) -> Entry {
    let (compiled, sources, out_ids, mutations) = match rec {
        Some(r) => (Some(r.compiled), r.sources, r.out_ids, r.mutations),
        None => (None, Vec::new(), Vec::new(), Vec::new()),
    };
    build_entry(args, extra, compiled, sources, &out_ids, mutations, outs)
}

/// Where each returned tensor comes from: a graph output, an argument, or a constant.
fn out_slots(args: &[Tensor], out_ids: &[u64], outs: &[Tensor]) -> Vec<OutSlot> {
    outs.iter()
        .map(|o| {
            if let Some(k) = out_ids.iter().position(|&id| id == o.id()) {
                OutSlot::Graph(k)
            } else if let Some(i) = args.iter().position(|a| a.same_tensor(o)) {
                OutSlot::Arg(i)
            } else {
                OutSlot::Const(o.clone())
            }
        })
        .collect()
}

fn build_entry(
    args: &[Tensor],
    extra: u64,
    compiled: Option<Arc<dyn CompiledGraph>>,
    sources: Vec<Source>,
    out_ids: &[u64],
    mutations: Vec<(Tensor, usize)>,
    outs: &[Tensor],
) -> Entry {
    let outputs = out_slots(args, out_ids, outs);
    let inputs = compiled.as_ref().and_then(|_| InputBuffer::new(&sources));
    Entry {
        guards: Guards::new(args, &sources, extra),
        compiled,
        sources,
        outputs,
        mutations: mutations
            .into_iter()
            .map(
                |(dst, k)| match args.iter().position(|a| a.same_tensor(&dst)) {
                    Some(i) => (Source::Arg(i), k),
                    None => (Source::Captured(dst), k),
                },
            )
            .collect(),
        inputs,
        graph: None,
        sym: None,
    }
}

fn replay(e: &Entry, args: &[Tensor]) -> Result<Vec<Tensor>> {
    let results = match &e.compiled {
        Some(c) => {
            if let Some(out) = e.inputs.as_ref().and_then(|b| b.run(c.as_ref(), args)) {
                out?
            } else {
                gather_and_run(c.as_ref(), &e.sources, args)?
            }
        }
        None => Vec::new(),
    };
    for (dst, k) in &e.mutations {
        write_back(&dst.resolve(args)?, &results[*k])?;
    }
    Ok(e.outputs
        .iter()
        .map(|s| match s {
            OutSlot::Graph(k) => results[*k].clone(),
            OutSlot::Arg(i) => args[*i].clone(),
            OutSlot::Const(t) => t.clone(),
        })
        .collect())
}

/// Builds the input list from `sources` and runs `c` on it.
fn gather_and_run(
    c: &dyn CompiledGraph,
    sources: &[Source],
    args: &[Tensor],
) -> Result<Vec<Tensor>> {
    let inputs: Vec<Tensor> = sources
        .iter()
        .map(|s| s.resolve(args))
        .collect::<Result<_>>()?;
    c.run(&inputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::DType;

    /// Returns its inputs: shows what a replay handed the backend.
    struct Echo;
    impl CompiledGraph for Echo {
        fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
            Ok(inputs.to_vec())
        }
    }

    #[test]
    fn the_input_buffer_passes_the_arguments_and_releases_them_after_the_call() -> Result<()> {
        let w = Tensor::randn(&[3], DType::F32)?;
        let x = Tensor::randn(&[3], DType::F32)?;
        let b = InputBuffer::new(&[Source::Arg(0), Source::Captured(w.clone()), Source::Arg(0)])
            .expect("a graph with a captured tensor gets a buffer");
        let seen = b.run(&Echo, std::slice::from_ref(&x)).expect("free")?;
        assert!(seen[0].same_tensor(&x) && seen[1].same_tensor(&w) && seen[2].same_tensor(&x));
        drop(seen);
        let weak = x.downgrade();
        drop(x);
        assert!(
            weak.upgrade().is_none(),
            "the buffer must not keep an argument alive"
        );
        // busy (a concurrent or re-entrant replay): the caller gathers its own inputs
        let held = b.slots.lock().unwrap();
        assert!(b.run(&Echo, std::slice::from_ref(&w)).is_none());
        drop(held);
        assert!(
            InputBuffer::new(&[Source::Arg(0)]).is_none(),
            "nothing to keep"
        );
        Ok(())
    }

    #[test]
    fn replays_on_several_threads_match_eager() -> Result<()> {
        let w = Tensor::randn(&[4, 3], DType::F32)?;
        let f = compile_fn(
            |a: &[Tensor]| Ok(vec![a[0].matmul(&w)?.tanh()?]),
            CompileOptions::default().backend("aot_eager"),
        )?;
        let x = Tensor::randn(&[2, 4], DType::F32)?;
        let want = x.matmul(&w)?.tanh()?.to_vec::<f32>()?;
        f.call(std::slice::from_ref(&x))?;
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        let got = f.call(std::slice::from_ref(&x)).unwrap();
                        assert_eq!(got[0].to_vec::<f32>().unwrap(), want);
                    }
                });
            }
        });
        let st = f.stats();
        assert_eq!((st.traces, st.compiles, st.replays), (1, 1, 200));
        Ok(())
    }
}
