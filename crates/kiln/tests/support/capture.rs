//! A backend that records the graphs AOT autograd hands it (the joint graph rewritten as the
//! `kiln` backend rewrites it: `kiln::inductor::prepare_joint`) and runs them on the
//! interpreter, rewritten first by `rewrite` when one is given: what tests read to see what the
//! `kiln` backend would compile. Shared by `fusion_traffic.rs` and `matmul_epilogues.rs`.

#![allow(dead_code)] // each test binary uses part of it

use std::sync::{Arc, Mutex};

use kiln::compiler::graph::Graph;
use kiln::compiler::{Backend, BackendContext, CompiledGraph};
use kiln::prelude::*;

pub struct Capture {
    graphs: Mutex<Vec<Graph>>,
    rewrite: Option<fn(&Graph) -> Option<Graph>>,
}

impl Capture {
    pub fn new() -> Arc<Capture> {
        Arc::new(Capture {
            graphs: Mutex::new(Vec::new()),
            rewrite: None,
        })
    }

    /// A capture that runs each graph as `rewrite` rewrites it (the recorded graph is the one
    /// handed in).
    pub fn rewriting(rewrite: fn(&Graph) -> Option<Graph>) -> Arc<Capture> {
        Arc::new(Capture {
            graphs: Mutex::new(Vec::new()),
            rewrite: Some(rewrite),
        })
    }

    /// The graphs recorded so far, in compile order.
    pub fn graphs(&self) -> Vec<Graph> {
        self.graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Backend for Capture {
    fn name(&self) -> &str {
        "capture"
    }
    fn prepare_joint(&self, joint: &Graph) -> Result<Option<Graph>> {
        kiln::inductor::prepare_joint(joint)
    }
    fn compile(&self, graph: &Graph, _ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        self.graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(graph.clone());
        let run = self.rewrite.and_then(|f| f(graph));
        Ok(Arc::new(kiln::compiler::backends::Interpreter::new(
            run.unwrap_or_else(|| graph.clone()),
        )))
    }
}
