//! Running a compiled graph: each step either calls a generated kernel on raw buffer addresses or
//! applies a prim through the core's kernels; values are dropped after their last use.

use std::ffi::c_void;

use kiln_compile::graph::{rand_at, Graph, NodeId, Op};
use kiln_compile::CompiledGraph;
use kiln_core::dispatch::apply;
use kiln_core::ops::default_draw;
use kiln_core::{no_grad, Error, Result, Tensor};

use super::cc::KernelFn;

pub enum Exec {
    Kernel {
        node: NodeId,
        f: KernelFn,
        inputs: Vec<NodeId>,
    },
    Extern {
        node: NodeId,
    },
}

pub struct CompiledCpu {
    pub graph: Graph,
    pub steps: Vec<Exec>,
    /// For each node, the index of the step after which it is no longer read.
    pub free_after: Vec<Vec<NodeId>>,
}

impl CompiledCpu {
    pub fn new(graph: Graph, steps: Vec<Exec>) -> Self {
        let mut last = vec![usize::MAX; graph.nodes.len()];
        for (s, step) in steps.iter().enumerate() {
            let reads: Vec<NodeId> = match step {
                Exec::Kernel { inputs, .. } => inputs.clone(),
                Exec::Extern { node } => graph.nodes[*node].args.clone(),
            };
            for r in reads {
                last[r] = s;
            }
        }
        for &o in &graph.outputs {
            last[o] = usize::MAX;
        }
        let mut free_after = vec![Vec::new(); steps.len()];
        for (id, &s) in last.iter().enumerate() {
            if s != usize::MAX {
                free_after[s].push(id);
            }
        }
        CompiledCpu {
            graph,
            steps,
            free_after,
        }
    }

    fn execute(&self, inputs: &[Tensor], (seed, base): (u64, u64)) -> Result<Vec<Tensor>> {
        let g = &self.graph;
        if inputs.len() != g.num_inputs {
            return Err(Error::arg(
                "kiln backend",
                format!("graph takes {} inputs, got {}", g.num_inputs, inputs.len()),
            ));
        }
        let mut vals: Vec<Option<Tensor>> = vec![None; g.nodes.len()];
        for (id, n) in g.nodes.iter().enumerate() {
            if let Op::Input(i) = n.op {
                vals[id] = Some(inputs[i].clone());
            }
        }
        let get = |vals: &[Option<Tensor>], id: NodeId| {
            vals[id]
                .clone()
                .ok_or_else(|| Error::arg("kiln backend", format!("value %{id} missing")))
        };
        for (s, step) in self.steps.iter().enumerate() {
            match step {
                Exec::Kernel { node, f, inputs } => {
                    let n = &g.nodes[*node];
                    let mut bufs = Vec::with_capacity(inputs.len());
                    for &i in inputs {
                        let t = get(&vals, i)?;
                        bufs.push(if t.is_contiguous() {
                            t
                        } else {
                            t.contiguous()?
                        });
                    }
                    let out = Tensor::zeros(n.shape.as_slice(), n.dtype)?;
                    if out.numel() > 0 {
                        // SAFETY: every buffer is alive (held in `bufs`/`out`) and contiguous with
                        // the shape and dtype the kernel was generated for; `out` is a fresh
                        // allocation no other handle reaches.
                        let mut args: Vec<*mut c_void> = bufs
                            .iter()
                            .map(|t| unsafe { t.data_ptr() } as *mut c_void)
                            .collect();
                        args.push(unsafe { out.data_ptr() } as *mut c_void);
                        unsafe { f(args.as_ptr()) };
                    }
                    vals[*node] = Some(out);
                }
                Exec::Extern { node } => {
                    let n = &g.nodes[*node];
                    let Op::Prim(p) = &n.op else { continue };
                    let args: Vec<Tensor> = n
                        .args
                        .iter()
                        .map(|&a| get(&vals, a))
                        .collect::<Result<_>>()?;
                    let refs: Vec<&Tensor> = args.iter().collect();
                    let p = rand_at(p, seed, base);
                    vals[*node] = Some(apply(p, &refs)?);
                }
            }
            for &id in &self.free_after[s] {
                vals[id] = None;
            }
        }
        g.outputs.iter().map(|&o| get(&vals, o)).collect()
    }
}

impl CompiledGraph for CompiledCpu {
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let rng = if self.graph.rng_span > 0 {
            default_draw(self.graph.rng_span as usize)
        } else {
            (0, 0)
        };
        no_grad(|| self.execute(inputs, rng))
    }

    fn run_with_rng(&self, inputs: &[Tensor], rng: (u64, u64)) -> Result<Vec<Tensor>> {
        no_grad(|| self.execute(inputs, rng))
    }
}
