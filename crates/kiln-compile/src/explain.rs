//! `kiln::explain`: what compiling a function would do — graphs, breaks with their source locations,
//! ops per graph, guards — from one traced run (`torch._dynamo.explain`). `CompiledFn::explain`
//! adds what the compiled function holds: its cache entries, static or symbolic (each symbol's
//! argument dimensions, the symbol guards, the sizes the entry has run at).

use std::fmt;

use kiln_core::intercept;
use kiln_core::{Result, Tensor};

use crate::backends::{BackendContext, EagerBackend};
use crate::graph::Graph;
use crate::guards::Guards;
use crate::trace::{GraphBreak, Tracer};

pub struct ExplainOutput {
    pub graphs: Vec<Graph>,
    pub breaks: Vec<GraphBreak>,
    /// Guards of the first graph's call (the arguments and the captured tensors).
    pub guards: Vec<String>,
    /// The function's outputs from this run.
    pub outputs: Vec<Tensor>,
    /// The cache entries of a compiled function, oldest first (`CompiledFn::explain`; empty for
    /// `explain` of a plain function, which has none).
    pub entries: Vec<EntryReport>,
}

/// One cache entry of a compiled function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryReport {
    /// Specialised to these argument shapes.
    Static { shapes: Vec<Vec<usize>> },
    /// One graph for many sizes.
    Symbolic(SymbolicReport),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymbolReport {
    /// `s0`, `s1`: as guards and `KILN_LOGS=recompiles` name it.
    pub name: String,
    /// The (argument, dim) pairs it stands for; more than one when arguments share a size (duck
    /// sizing: a call where they differ does not instantiate the entry).
    pub dims: Vec<(usize, usize)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymbolicReport {
    pub symbols: Vec<SymbolReport>,
    /// The guards on the symbols' values (`s0 >= 1`).
    pub guards: Vec<String>,
    /// The argument shapes the entry has run at (each traced and found to instantiate it), sorted.
    pub sizes_seen: Vec<Vec<Vec<usize>>>,
}

impl fmt::Display for EntryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryReport::Static { shapes } => write!(f, "static, argument shapes {shapes:?}"),
            EntryReport::Symbolic(s) => {
                let syms: Vec<String> = s
                    .symbols
                    .iter()
                    .map(|sym| {
                        let dims: Vec<String> = sym
                            .dims
                            .iter()
                            .map(|(a, d)| format!("argument {a} dim {d}"))
                            .collect();
                        format!("{} = {}", sym.name, dims.join(" = "))
                    })
                    .collect();
                let seen: Vec<String> = s.sizes_seen.iter().map(|v| format!("{v:?}")).collect();
                write!(
                    f,
                    "symbolic, {}; guards {}; sizes seen {}",
                    syms.join(", "),
                    s.guards.join(", "),
                    seen.join(" ")
                )
            }
        }
    }
}

impl ExplainOutput {
    pub fn graph_count(&self) -> usize {
        self.graphs.len()
    }
    pub fn graph_break_count(&self) -> usize {
        self.breaks.len()
    }
    pub fn op_count(&self) -> usize {
        self.graphs.iter().map(Graph::num_ops).sum()
    }
}

/// Traces `f` once on `args` (with the interpreter, bypassing every cache) and reports.
pub fn explain<F>(f: F, args: &[Tensor]) -> Result<ExplainOutput>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>>,
{
    let tracer = Tracer::new(
        "explain",
        args,
        std::sync::Arc::new(EagerBackend),
        BackendContext::default(),
        false,
    );
    let outputs = {
        let _on = intercept::install(Some(tracer.clone()));
        f(args)
    };
    let records = tracer.finish()?;
    let outputs = outputs?;
    let sources: Vec<_> = records
        .iter()
        .flat_map(|r| r.sources.iter().cloned())
        .collect();
    Ok(ExplainOutput {
        breaks: records.iter().filter_map(|r| r.ended_by.clone()).collect(),
        guards: Guards::new(args, &sources, 0).describe(),
        graphs: records.into_iter().map(|r| r.graph).collect(),
        outputs,
        entries: Vec::new(),
    })
}

impl fmt::Display for ExplainOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Graph Count: {}", self.graph_count())?;
        writeln!(f, "Graph Break Count: {}", self.graph_break_count())?;
        writeln!(f, "Op Count: {}", self.op_count())?;
        writeln!(f, "Break Reasons:")?;
        for (i, b) in self.breaks.iter().enumerate() {
            writeln!(f, "  Break Reason {}: {b}", i + 1)?;
        }
        writeln!(f, "Ops per Graph:")?;
        for (i, g) in self.graphs.iter().enumerate() {
            writeln!(
                f,
                "  Graph {i}: {} ops, {} inputs, {} outputs",
                g.num_ops(),
                g.num_inputs,
                g.outputs.len()
            )?;
        }
        writeln!(f, "Guards:")?;
        for g in &self.guards {
            writeln!(f, "  {g}")?;
        }
        if !self.entries.is_empty() {
            writeln!(f, "Cache Entries:")?;
            for (i, e) in self.entries.iter().enumerate() {
                writeln!(f, "  Entry {i}: {e}")?;
            }
        }
        Ok(())
    }
}
