//! `kiln::explain`: what compiling a function would do — graphs, breaks with their source locations,
//! ops per graph, guards — from one traced run (`torch._dynamo.explain`).

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
        Ok(())
    }
}
