//! The CPU code-generating backend: schedule, generate C, build and load, run.

use std::sync::{Arc, Once};

use kiln_compile::backends::Interpreter;
use kiln_compile::graph::Graph;
use kiln_compile::{Backend, BackendContext, CompiledGraph};
use kiln_core::Result;

use kiln_compile::graph::NodeId;

use crate::codegen::c::{pointwise_kernel, pointwise_kernel_inplace, reduction_kernel, Kernel};
use crate::ir::lower::Kind;
use crate::runtime::cc::{self, toolchain};
use crate::runtime::exec::{CompiledCpu, Exec};
use crate::runtime::plan::{self, Alloc};
use crate::schedule::{schedule, Schedule, Step};

/// Generates and compiles C/OpenMP kernels for a graph (forward or backward; `kiln` wraps it in AOT
/// autograd).
pub struct CpuCodegen;

/// The kernels of a graph, in step order, and the steps that run them.
pub fn generate(graph: &Graph) -> (Vec<Step>, Vec<Option<Kernel>>) {
    kernels_of(graph, &schedule(graph))
}

fn kernels_of(graph: &Graph, sched: &Schedule) -> (Vec<Step>, Vec<Option<Kernel>>) {
    let kernels = sched
        .steps
        .iter()
        .map(|s| match s {
            Step::Kernel { node } if sched.kinds[*node] == Kind::Reduction => {
                Some(reduction_kernel(graph, sched, *node))
            }
            Step::Kernel { node } => Some(pointwise_kernel(graph, sched, *node)),
            Step::Extern { .. } => None,
        })
        .collect();
    (sched.steps.clone(), kernels)
}

/// The steps, their kernels and where each kernel writes (`runtime/plan.rs`): in place into a
/// mutated input where that is safe (with the in-place variant of its kernel), a new buffer for
/// what the caller receives, a pooled buffer otherwise.
pub fn plan_graph(graph: &Graph) -> (Vec<Step>, Vec<Option<Kernel>>, Vec<Alloc>) {
    let sched = schedule(graph);
    let (steps, mut kernels) = kernels_of(graph, &sched);
    let reads: Vec<Vec<NodeId>> = steps
        .iter()
        .zip(&kernels)
        .map(|(s, k)| match (s, k) {
            (_, Some(k)) => k.inputs.clone(),
            (Step::Kernel { node } | Step::Extern { node }, None) => {
                graph.nodes[*node].args.clone()
            }
        })
        .collect();
    let roots = plan::alias_roots(graph, &steps, &sched.kinds);
    let escaping = plan::escaping(graph, &roots);
    let input_nodes = graph.input_nodes();
    let mut allocs = Vec::with_capacity(steps.len());
    for (at, s) in steps.iter().enumerate() {
        let node = match s {
            Step::Kernel { node } | Step::Extern { node } => *node,
        };
        let inplace = graph.mutated_inputs.iter().find_map(|&(k, i)| {
            let input = *input_nodes.get(i)?;
            let ok = graph.outputs.get(k) == Some(&node)
                && sched.kinds[node] != Kind::Reduction
                && plan::inplace_allowed(graph, &steps, &reads, &roots, at, k, input);
            ok.then(|| pointwise_kernel_inplace(graph, &sched, node, input))
                .flatten()
                .map(|kernel| (input, kernel))
        });
        allocs.push(match inplace {
            Some((input, kernel)) => {
                kernels[at] = Some(kernel);
                Alloc::InPlace(input)
            }
            None if escaping[node] => Alloc::Output,
            None => Alloc::Pooled,
        });
    }
    (steps, kernels, allocs)
}

impl Backend for CpuCodegen {
    fn name(&self) -> &str {
        "kiln_cpu"
    }

    fn compile(&self, graph: &Graph, ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        let Some(tc) = toolchain() else {
            if ctx.fullgraph {
                return Err(kiln_core::Error::Unsupported {
                    op: "compile(backend=kiln, fullgraph=true)",
                    msg: "no C compiler found for the generated kernels: install gcc or clang, or \
                          set CC (without fullgraph, kiln falls back to its interpreter)"
                        .into(),
                });
            }
            static WARN: Once = Once::new();
            WARN.call_once(|| {
                eprintln!(
                    "kiln: no C compiler found (set CC or install gcc/clang); compiled graphs run \
                     on the interpreter instead of generated kernels"
                )
            });
            return Ok(Arc::new(Interpreter::new(graph.clone())));
        };
        let (steps, kernels, allocs) = plan_graph(graph);
        let wanted: Vec<Kernel> = kernels.iter().flatten().cloned().collect();
        let fns = cc::load(tc, &wanted)?;
        let mut fns = fns.into_iter();
        let exec = steps
            .iter()
            .zip(kernels.iter().zip(&allocs))
            .map(|(s, (k, alloc))| match (s, k) {
                (Step::Kernel { node }, Some(k)) => Ok(Exec::Kernel {
                    node: *node,
                    f: fns.next().ok_or_else(|| {
                        kiln_core::Error::arg("kiln backend", "kernel count mismatch")
                    })?,
                    inputs: k.inputs.clone(),
                    alloc: *alloc,
                }),
                (s, _) => Ok(Exec::Extern {
                    node: match s {
                        Step::Kernel { node } | Step::Extern { node } => *node,
                    },
                }),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(CompiledCpu::new(graph.clone(), exec)))
    }
}
