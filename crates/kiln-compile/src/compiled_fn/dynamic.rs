//! Dynamic shapes in `compile_fn`: automatic dynamic (`dynamic: None`), `dynamic: Some(true)` and
//! `mark_dynamic` / `mark_static`.
//!
//! A call that misses every entry is traced with the graph kept uncompiled (`TraceMode::
//! CaptureFinal`). Then, in order:
//! 1. if the trace instantiates a symbolic entry (same structure; every size equal to its
//!    expression at this trace's symbol values; the symbol guards hold), that entry runs it: no
//!    compile, and the argument sizes are remembered, so the next call at them is a guard hit;
//! 2. else, if some argument dimensions are to be symbolic (they changed since a static entry of
//!    the same structure, or are marked, or `dynamic: Some(true)`), the code is traced again at
//!    other sizes (`Probe` traces on zero-filled stand-ins: nothing runs, nothing is written) and
//!    the traces are unified into a `SymGraph`, compiled once, as a new entry;
//! 3. else a static entry, as without dynamic shapes.
//!
//! Soundness: the compiled code of a symbolic entry only ever runs at argument sizes at which the
//! user's code was traced and produced exactly the symbolic graph at those sizes. Rust code may
//! branch on sizes where no tracer sees it; the branch it took is in the trace, and a trace that
//! differs fails step 1 and gets its own entry.

use std::collections::{BTreeSet, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, RwLock};

use kiln_core::intercept;
use kiln_core::ops::{default_draw, set_default_generator_state};
use kiln_core::{Result, Tensor};

use super::{build_entry, out_slots, replay, CompiledFn, Entry, OutSlot};
use crate::backends::CompiledGraph;
use crate::cache;
use crate::explain::{SymbolReport, SymbolicReport};
use crate::graph::{Graph, Op};
use crate::logs::{self, Channel};
use crate::symbolic::compiled::PerSizeCompiled;
use crate::symbolic::marks::marks_of;
use crate::symbolic::slots::erased_key;
use crate::symbolic::sym_graph::{show_values, SymGraph, Symbol};
use crate::trace::{CapturedGraph, Source, TraceMode};

/// A symbolic entry: its graph, and the argument sizes traced and found to instantiate it.
pub(super) struct SymEntry {
    pub graph: Arc<SymGraph>,
    seen: RwLock<HashSet<Vec<Vec<usize>>>>,
}

fn arg_shapes(args: &[Tensor]) -> Vec<Vec<usize>> {
    args.iter().map(|a| a.shape().to_vec()).collect()
}

impl SymEntry {
    pub fn seen(&self, args: &[Tensor]) -> bool {
        let seen = self.seen.read().unwrap_or_else(|e| e.into_inner());
        seen.iter().any(|shapes| {
            shapes.len() == args.len() && shapes.iter().zip(args).all(|(s, a)| s == a.shape())
        })
    }
    /// For `CompiledFn::explain`: the symbols as argument dimensions, the guards, the sizes seen.
    pub fn report(&self, sources: &[Source]) -> SymbolicReport {
        let mut sizes_seen: Vec<Vec<Vec<usize>>> = self
            .seen
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        sizes_seen.sort();
        SymbolicReport {
            symbols: self
                .graph
                .symbols
                .iter()
                .enumerate()
                .map(|(k, s)| SymbolReport {
                    name: format!("s{k}"),
                    // symbols are made from argument dimensions only
                    dims: s
                        .dims
                        .iter()
                        .filter_map(|&(j, d)| match sources.get(j) {
                            Some(Source::Arg(i)) => Some((*i, d)),
                            _ => None,
                        })
                        .collect(),
                })
                .collect(),
            guards: self.graph.guards.iter().map(|g| g.to_string()).collect(),
            sizes_seen,
        }
    }
    fn remember(&self, args: &[Tensor]) {
        self.seen
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(arg_shapes(args));
    }
}

/// Whether any argument carries a `mark_dynamic`.
pub(super) fn has_marks(args: &[Tensor]) -> bool {
    args.iter().any(|a| !marks_of(a).0.is_empty())
}

fn same_sources(a: &[Source], b: &[Source]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| match (x, y) {
            (Source::Arg(i), Source::Arg(j)) => i == j,
            (Source::Captured(s), Source::Captured(t)) | (Source::Grad(s), Source::Grad(t)) => {
                s.same_tensor(t)
            }
            _ => false,
        })
}

fn same_outputs(a: &[OutSlot], b: &[OutSlot]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| match (x, y) {
            (OutSlot::Graph(i), OutSlot::Graph(j)) | (OutSlot::Arg(i), OutSlot::Arg(j)) => i == j,
            (OutSlot::Const(s), OutSlot::Const(t)) => s.same_tensor(t),
            _ => false,
        })
}

/// A capture's in-place writes as an entry keeps them (see `build_entry`).
fn mutation_sources(args: &[Tensor], m: &[(Tensor, usize)]) -> Vec<(Source, usize)> {
    m.iter()
        .map(
            |(dst, k)| match args.iter().position(|a| a.same_tensor(dst)) {
                Some(i) => (Source::Arg(i), *k),
                None => (Source::Captured(dst.clone()), *k),
            },
        )
        .collect()
}

/// Whether entry `e` was made for a call like this one but for sizes: same non-size guards,
/// inputs, returned values and in-place writes.
fn same_call(
    e: &Entry,
    args: &[Tensor],
    extra: u64,
    cap: &CapturedGraph,
    outs: &[OutSlot],
) -> bool {
    let muts = mutation_sources(args, &cap.mutations);
    e.guards.hold_except_sizes(args, extra)
        && same_sources(&e.sources, &cap.sources)
        && same_outputs(&e.outputs, outs)
        && e.mutations.len() == muts.len()
        && e.mutations.iter().zip(&muts).all(|((s, k), (t, j))| {
            k == j && same_sources(std::slice::from_ref(s), std::slice::from_ref(t))
        })
}

/// The shape of graph input `j` in `g`.
fn input_shape(g: &Graph, j: usize) -> Option<&[usize]> {
    g.nodes.iter().find_map(|n| match n.op {
        Op::Input(i) if i == j => Some(n.shape.as_slice()),
        _ => None,
    })
}

/// One symbol's dimensions: as (argument, dim) for probing and (graph input, dim) for binding.
#[derive(Clone)]
struct DimGroup {
    arg_dims: Vec<(usize, usize)>,
    input_dims: Vec<(usize, usize)>,
}

impl<'f> CompiledFn<'f> {
    pub(super) fn trace_dynamic(
        &self,
        args: &[Tensor],
        extra: u64,
        why: Option<String>,
    ) -> Result<Vec<Tensor>> {
        let (tracer, _end) = self.new_tracer(args, TraceMode::CaptureFinal);
        let outs = {
            let _on = intercept::install(Some(tracer.clone()));
            (self.f)(args)
        };
        let records = tracer.finish();
        let outs = outs?;
        let records = records?;
        let captured = tracer.take_captured();
        let retrace = tracer.retrace_reason();
        {
            let mut st = self.lock();
            st.stats.traces += 1;
            st.stats.graph_breaks += records.iter().filter(|r| r.ended_by.is_some()).count();
        }
        if let Some(why) = retrace {
            logs::emit(Channel::GraphBreaks, || {
                format!("{} is traced on every call: {why}", self.name)
            });
        }
        let Some(cap) = captured else {
            // the trace broke into segments that already ran, or made no graph: as `trace` does
            let mut st = self.lock();
            if !records.is_empty() || retrace.is_some() {
                st.has_breaks = true;
            } else {
                st.entries
                    .push(Arc::new(super::make_entry(args, extra, None, &outs)));
                st.stats.compiles += 1;
            }
            return Ok(outs);
        };
        let rng_base = cap.rng_base;
        let entry = if retrace.is_some() {
            // traced on every call: run this call's graph, keep no entry
            self.lock().has_breaks = true;
            Arc::new(self.static_entry(args, extra, cap, &outs)?)
        } else {
            self.entry_for(args, extra, cap, &outs, why)?
        };
        if let Some((seed, offset)) = rng_base {
            // the traced code drew from here: the run draws the same numbers again
            set_default_generator_state(seed, offset);
        }
        replay(&entry, args)
    }

    fn static_entry(
        &self,
        args: &[Tensor],
        extra: u64,
        cap: CapturedGraph,
        outs: &[Tensor],
    ) -> Result<Entry> {
        let ctx = self.backend_context();
        let compiled = cache::compile_cached(&self.backend, &ctx, &cap.graph, &self.name)?;
        let mut e = build_entry(
            args,
            extra,
            Some(compiled),
            cap.sources,
            &cap.out_ids,
            cap.mutations,
            outs,
        );
        e.graph = Some(cap.graph);
        Ok(e)
    }

    /// The entry that runs this call's captured graph: a symbolic one it instantiates, or a new one.
    fn entry_for(
        &self,
        args: &[Tensor],
        extra: u64,
        cap: CapturedGraph,
        outs: &[Tensor],
        why: Option<String>,
    ) -> Result<Arc<Entry>> {
        let slots = out_slots(args, &cap.out_ids, outs);
        let entries: Vec<Arc<Entry>> = self.lock().entries.clone();
        let mut misses = Vec::new();
        for (k, e) in entries.iter().enumerate() {
            let Some(s) = &e.sym else { continue };
            if !same_call(e, args, extra, &cap, &slots) {
                continue;
            }
            match s.graph.instantiates(&cap.graph) {
                Ok(values) => {
                    s.remember(args);
                    // size 1 is where PyTorch specialises: say so when it reused the entry
                    let ones: Vec<String> = values
                        .iter()
                        .enumerate()
                        .filter(|&(_, &v)| v == 1)
                        .map(|(k, _)| format!("s{k}"))
                        .collect();
                    let size_one = if ones.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " (size 1 for {}: the trace at 1 is the symbolic graph there, identity \
                             expands aside, so it is reused rather than specialised)",
                            ones.join(", ")
                        )
                    };
                    let msg = format!(
                        "{}: {}; the trace instantiates symbolic entry {k} at {}: no compile{size_one}",
                        self.name,
                        why.as_deref().unwrap_or("new sizes"),
                        show_values(&values)
                    );
                    let mut st = self.lock();
                    st.stats.symbolic_reuses += 1;
                    st.stats.log_recompile(msg);
                    return Ok(e.clone());
                }
                Err(r) => misses.push(format!("not symbolic entry {k}: {r}")),
            }
        }
        let key = erased_key(&cap.graph);
        let candidates: Vec<&Graph> = entries
            .iter()
            .rev()
            .filter(|e| e.sym.is_none() && same_call(e, args, extra, &cap, &slots))
            .filter_map(|e| e.graph.as_ref())
            .filter(|g| erased_key(g) == key)
            .collect();
        // the latest static entry of this structure, preferring one whose sizes can join the
        // fit (every dimension it differs in is >= 2 in both): after entries at 7 and at 1, a
        // call at 12 unifies with 7
        let prev_graph = candidates
            .iter()
            .find(|p| fit_compatible(p, &cap.graph, &cap.sources))
            .or(candidates.first())
            .map(|p| (*p).clone());
        let (entry, how) = match self.symbolize(args, &cap, prev_graph.as_ref()) {
            Ok((sg, changed)) => {
                let sg = Arc::new(sg);
                let ctx = self.backend_context();
                let compiled: Arc<dyn CompiledGraph> =
                    match self.backend.compile_symbolic(&sg, &ctx) {
                        Some(c) => c?,
                        None => Arc::new(PerSizeCompiled::new(
                            sg.clone(),
                            self.backend.clone(),
                            ctx,
                            &self.name,
                        )),
                    };
                let how = format!(
                    "{}: compiling one graph for all sizes, with {}",
                    changed.join(", "),
                    self.describe_symbols(&sg, &cap.sources).join("; ")
                );
                let mut e = build_entry(
                    args,
                    extra,
                    Some(compiled),
                    cap.sources,
                    &cap.out_ids,
                    cap.mutations,
                    outs,
                );
                let seen = RwLock::new(HashSet::from([arg_shapes(args)]));
                e.sym = Some(SymEntry { graph: sg, seen });
                self.lock().stats.symbolic_compiles += 1;
                (e, how)
            }
            Err(reason) => {
                let e = self.static_entry(args, extra, cap, outs)?;
                (e, format!("static: {reason}"))
            }
        };
        misses.push(how);
        let msg = match why {
            Some(w) => format!(
                "Recompiling function {}: {w}; {}",
                self.name,
                misses.join("; ")
            ),
            None => format!("Compiling function {}: {}", self.name, misses.join("; ")),
        };
        let entry = Arc::new(entry);
        let mut st = self.lock();
        st.stats.log_recompile(msg);
        st.entries.push(entry.clone());
        st.stats.compiles += 1;
        Ok(entry)
    }

    /// `s0 = argument 0 dim 0 (= argument 1 dim 0)`, and the guards.
    fn describe_symbols(&self, sg: &SymGraph, sources: &[Source]) -> Vec<String> {
        let arg_of = |j: usize| match sources.get(j) {
            Some(Source::Arg(i)) => format!("argument {i}"),
            _ => format!("input {j}"),
        };
        let mut v: Vec<String> = sg
            .symbols
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let dims: Vec<String> = s
                    .dims
                    .iter()
                    .map(|&(j, d)| format!("{} dim {d}", arg_of(j)))
                    .collect();
                format!("s{k} = {}", dims.join(" = "))
            })
            .collect();
        v.push(format!(
            "guards {}",
            sg.guards
                .iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
        v
    }

    /// A symbolic graph for this capture, or why there is none. Also returns, in words, which
    /// dimensions were made symbolic and why.
    fn symbolize(
        &self,
        args: &[Tensor],
        cap: &CapturedGraph,
        prev: Option<&Graph>,
    ) -> std::result::Result<(SymGraph, Vec<String>), String> {
        let g = &cap.graph;
        let input_of = |i: usize| {
            cap.sources
                .iter()
                .position(|s| matches!(s, Source::Arg(a) if *a == i))
        };
        let mut wanted: BTreeSet<(usize, usize)> = BTreeSet::new();
        let mut notes = Vec::new();
        let mut fixed: BTreeSet<(usize, usize)> = BTreeSet::new();
        for (i, a) in args.iter().enumerate() {
            let (dynamic, stat) = marks_of(a);
            fixed.extend(stat.iter().map(|&d| (i, d)));
            if self.opts.dynamic == Some(true) {
                wanted.extend((0..a.shape().len()).map(|d| (i, d)));
            }
            for d in dynamic {
                if wanted.insert((i, d)) {
                    notes.push(format!("argument {i} dim {d} is marked dynamic"));
                }
            }
        }
        if let Some(p) = prev {
            for (j, s) in cap.sources.iter().enumerate() {
                let Source::Arg(i) = s else { continue };
                let (Some(old), Some(new)) = (input_shape(p, j), input_shape(g, j)) else {
                    continue;
                };
                for (d, (a, b)) in old.iter().zip(new).enumerate() {
                    if a != b && !fixed.contains(&(*i, d)) {
                        wanted.insert((*i, d));
                        notes.push(format!("argument {i} dim {d} changed ({a} -> {b})"));
                    }
                }
            }
        }
        let mut groups: Vec<(Vec<usize>, DimGroup)> = Vec::new();
        for &(i, d) in &wanted {
            let Some(j) = input_of(i) else { continue };
            let Some(&v) = input_shape(g, j).and_then(|s| s.get(d)) else {
                continue;
            };
            if fixed.contains(&(i, d)) {
                continue;
            }
            if v < 2 {
                // a size-1 trace may still run a symbolic entry it instantiates (`entry_for`),
                // but symbols are made from sizes that broadcasting and squeezing leave alone
                notes.push(format!(
                    "argument {i} dim {d} = {v} is specialised (symbols are made from sizes >= 2)"
                ));
                continue;
            }
            // duck sizing: dimensions of different arguments equal in every real trace share one
            // symbol (two dims of one tensor that happen to be equal, [n, n], do not), the same
            // dim index preferred: ids [b, l] and mask [b, l] make two symbols even when b == l
            let mut key = vec![v];
            key.extend(
                prev.and_then(|p| input_shape(p, j))
                    .and_then(|s| s.get(d))
                    .copied(),
            );
            let joinable = |k: &Vec<usize>, grp: &DimGroup| {
                *k == key && grp.arg_dims.iter().all(|&(a, _)| a != i)
            };
            let same_dim = groups
                .iter()
                .position(|(k, grp)| joinable(k, grp) && grp.arg_dims.iter().any(|&(_, e)| e == d));
            let at = same_dim.or_else(|| groups.iter().position(|(k, grp)| joinable(k, grp)));
            match at.map(|p| &mut groups[p]) {
                Some((_, grp)) => {
                    grp.arg_dims.push((i, d));
                    grp.input_dims.push((j, d));
                }
                None => groups.push((
                    key,
                    DimGroup {
                        arg_dims: vec![(i, d)],
                        input_dims: vec![(j, d)],
                    },
                )),
            }
        }
        let mut groups: Vec<DimGroup> = groups.into_iter().map(|(_, g)| g).collect();
        let mut last_err = String::from("no dimension to make symbolic");
        for _ in 0..4 {
            if groups.is_empty() {
                break;
            }
            let mut traces = vec![g.clone()];
            // the earlier trace counts only if every input dimension it differs in is a symbol
            if let Some(p) = prev {
                let explained = cap.sources.iter().enumerate().all(|(j, _)| {
                    let (a, b) = (input_shape(p, j), input_shape(g, j));
                    a.zip(b).is_some_and(|(a, b)| {
                        a.len() == b.len()
                            && (0..a.len()).all(|d| {
                                a[d] == b[d]
                                    || (a[d] >= 2
                                        && groups
                                            .iter()
                                            .any(|grp| grp.input_dims.contains(&(j, d))))
                            })
                    })
                });
                if explained {
                    traces.push(p.clone());
                }
            }
            let mut failed = Vec::new();
            for k in 0..groups.len() {
                // even steps keep a size's parity, which code branches on most
                match self.probe(args, &cap.sources, &groups, &|q| {
                    if q == k {
                        4 + 2 * k
                    } else {
                        0
                    }
                }) {
                    Some(t) => traces.push(t),
                    None => failed.push(k),
                }
            }
            if !failed.is_empty() {
                for &k in failed.iter().rev() {
                    let grp = groups.remove(k);
                    last_err = format!(
                        "the code does not trace with {} at another size",
                        show_dims(&grp.arg_dims)
                    );
                }
                continue;
            }
            if let Some(t) = self.probe(args, &cap.sources, &groups, &|q| 5 + q) {
                traces.push(t);
            }
            // a probe that took another branch of the Rust code shows a different graph: that
            // size will get its own entry; the fit uses the traces like this one
            let key = erased_key(g);
            traces.retain(|t| erased_key(t) == key);
            let symbols: Vec<Symbol> = groups
                .iter()
                .map(|grp| Symbol {
                    dims: grp.input_dims.clone(),
                })
                .collect();
            match SymGraph::unify(&traces, &symbols) {
                Ok(sg) => return Ok((sg, notes)),
                Err(e) => {
                    last_err = e.message;
                    if e.culprits.is_empty() {
                        break;
                    }
                    for &k in e.culprits.iter().rev() {
                        groups.remove(k);
                    }
                }
            }
        }
        notes.push(last_err);
        Err(notes.join("; "))
    }

    /// The graph of a trace of the user's code on zero-filled stand-ins whose dimensions in group
    /// `k` are larger by `delta(k)`; `None` if that trace fails, breaks, or reads other inputs. It
    /// runs nothing and writes nothing; the default generator is put back as it was.
    fn probe(
        &self,
        args: &[Tensor],
        sources: &[Source],
        groups: &[DimGroup],
        delta: &dyn Fn(usize) -> usize,
    ) -> Option<Graph> {
        let mut shapes = arg_shapes(args);
        for (k, grp) in groups.iter().enumerate() {
            for &(i, d) in &grp.arg_dims {
                shapes[i][d] += delta(k);
            }
        }
        let mut standins: Vec<Tensor> = Vec::with_capacity(args.len());
        for (i, a) in args.iter().enumerate() {
            if let Some(j) = (0..i).find(|&j| args[j].same_tensor(a)) {
                let t = standins[j].clone();
                standins.push(t);
            } else if shapes[i] == a.shape() {
                standins.push(a.clone());
            } else {
                // on the argument's device: a device graph's prims carry their device, and a
                // stand-in elsewhere would trace another graph (nothing runs on it: a probe only
                // traces)
                let z = Tensor::zeros_on(&shapes[i], a.dtype(), a.device()).ok()?;
                if a.requires_grad() {
                    z.set_requires_grad(true).ok()?;
                }
                standins.push(z);
            }
        }
        let rng = default_draw(0);
        let (tracer, _) = self.new_tracer(&standins, TraceMode::Probe);
        // the outputs stay alive until the trace ends: they are what the graph computes
        let ran = catch_unwind(AssertUnwindSafe(|| {
            let _on = intercept::install(Some(tracer.clone()));
            (self.f)(&standins)
        }));
        let finished = tracer.finish().is_ok();
        set_default_generator_state(rng.0, rng.1);
        if !(matches!(ran, Ok(Ok(_))) && finished) {
            return None;
        }
        let cap = tracer.take_captured()?;
        same_sources(&cap.sources, sources).then_some(cap.graph)
    }
}

/// Whether every graph-input dimension in which traces `a` and `b` differ is at least 2 in both
/// (a size 0 or 1 never joins a fit).
fn fit_compatible(a: &Graph, b: &Graph, sources: &[Source]) -> bool {
    (0..sources.len()).all(|j| match (input_shape(a, j), input_shape(b, j)) {
        (Some(x), Some(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p == q || (*p >= 2 && *q >= 2))
        }
        _ => false,
    })
}

fn show_dims(dims: &[(usize, usize)]) -> String {
    let v: Vec<String> = dims
        .iter()
        .map(|(i, d)| format!("argument {i} dim {d}"))
        .collect();
    v.join(" = ")
}
