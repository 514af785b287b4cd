//! A backend that records the graphs AOT autograd hands it (the joint graph rewritten as the
//! `kiln` backend rewrites it: `kiln::inductor::prepare_joint`) and runs them on the
//! interpreter: what tests read to see what the `kiln` backend would compile. Shared by
//! `fusion_traffic.rs` and `matmul_epilogues.rs`.

use std::sync::{Arc, Mutex};

use kiln::compiler::graph::Graph;
use kiln::compiler::{Backend, BackendContext, CompiledGraph};
use kiln::prelude::*;

pub struct Capture(pub Mutex<Vec<Graph>>);

impl Capture {
    pub fn new() -> Arc<Capture> {
        Arc::new(Capture(Mutex::new(Vec::new())))
    }

    /// The graphs recorded so far, in compile order.
    pub fn graphs(&self) -> Vec<Graph> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Backend for Capture {
    fn name(&self) -> &str {
        "capture"
    }
    fn prepare_joint(&self, joint: &Graph) -> Option<Graph> {
        kiln::inductor::prepare_joint(joint)
    }
    fn compile(&self, graph: &Graph, _ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(graph.clone());
        Ok(Arc::new(kiln::compiler::backends::Interpreter::new(
            graph.clone(),
        )))
    }
}
