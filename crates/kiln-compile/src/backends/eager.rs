//! The `eager` backend: runs the captured prims one by one through the core's dispatcher, so autograd
//! records them exactly as in eager mode. Also the reference every other backend is tested against.

use std::sync::Arc;

use kiln_core::autograd::{is_grad_enabled, GradModeGuard};
use kiln_core::dispatch::apply_on;
use kiln_core::ops::default_draw;
use kiln_core::{Error, Result, Tensor};

use super::{Backend, BackendContext, CompiledGraph};
use crate::graph::{rand_at, Graph, Op};

pub struct EagerBackend;

impl Backend for EagerBackend {
    fn name(&self) -> &str {
        "eager"
    }
    fn compile(&self, graph: &Graph, _: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        Ok(Arc::new(Interpreter::new(graph.clone())))
    }
}

/// Executes a graph node by node, freeing each value after its last use.
pub struct Interpreter {
    graph: Graph,
    last_use: Vec<usize>,
}

impl Interpreter {
    pub fn new(graph: Graph) -> Self {
        let last_use = graph.last_uses();
        Interpreter { graph, last_use }
    }
}

impl CompiledGraph for Interpreter {
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let rng = if self.graph.rng_span > 0 {
            default_draw(self.graph.rng_span as usize)
        } else {
            (0, 0)
        };
        self.run_with_rng(inputs, rng)
    }

    fn run_with_rng(&self, inputs: &[Tensor], (seed, base): (u64, u64)) -> Result<Vec<Tensor>> {
        let g = &self.graph;
        if inputs.len() != g.num_inputs {
            return Err(Error::arg(
                "eager backend",
                format!("graph takes {} inputs, got {}", g.num_inputs, inputs.len()),
            ));
        }
        let mut vals: Vec<Option<Tensor>> = vec![None; g.nodes.len()];
        let outer = is_grad_enabled();
        for (id, n) in g.nodes.iter().enumerate() {
            let v = match &n.op {
                Op::Input(i) => inputs[*i].clone(),
                Op::Prim(p) => {
                    let args = n
                        .args
                        .iter()
                        .map(|&a| {
                            vals[a].as_ref().ok_or_else(|| {
                                Error::arg("eager backend", format!("value %{a} used after free"))
                            })
                        })
                        .collect::<Result<Vec<&Tensor>>>()?;
                    let _mode = (n.grad_enabled != outer)
                        .then(|| GradModeGuard::new(n.grad_enabled && outer));
                    let p = rand_at(p, seed, base);
                    apply_on(p, &args, n.device)?
                }
            };
            vals[id] = Some(v);
            for &a in &n.args {
                if self.last_use[a] == id {
                    vals[a] = None;
                }
            }
        }
        g.outputs
            .iter()
            .map(|&o| {
                vals[o]
                    .clone()
                    .ok_or_else(|| Error::arg("eager backend", "missing output"))
            })
            .collect()
    }
}
