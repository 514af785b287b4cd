//! The CPU code-generating backend: schedule, generate C, build and load, run.

use std::sync::{Arc, Once};

use kiln_compile::backends::Interpreter;
use kiln_compile::graph::Graph;
use kiln_compile::{Backend, BackendContext, CompiledGraph};
use kiln_core::Result;

use kiln_compile::graph::NodeId;

use crate::codegen::c::{
    group_kernel, pointwise_kernel, pointwise_kernel_inplace, reduction_kernel, Kernel,
};
use crate::codegen::template;
use crate::ir::lower::Kind;
use crate::runtime::cc::{self, toolchain};
use crate::runtime::exec::{CompiledCpu, Exec};
use crate::runtime::plan::{self, Alloc};
use crate::schedule::{schedule, Schedule, Step};
use kiln_compile::symbolic;

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

/// A step of the executor as planned: a generated kernel and the values it writes (with where),
/// or an extern call.
pub enum Planned {
    Kernel {
        kernel: Kernel,
        outs: Vec<(NodeId, Alloc)>,
    },
    Extern {
        node: NodeId,
    },
}

/// Most values one grouped kernel computes (`group_kernel`).
const MAX_GROUP: usize = 8;

/// The executor's steps: each kernel with where it writes (`runtime/plan.rs`) — in place into a
/// mutated input where that is safe (with the in-place variant of its kernel), a new buffer for
/// what the caller receives, a pooled buffer otherwise — and consecutive kernels of one shape
/// grouped into one loop where they can be (`group_kernel`).
pub fn plan_graph(graph: &Graph) -> Vec<Planned> {
    let sched = schedule(graph);
    let (steps, kernels) = kernels_of(graph, &sched);
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
    let mut planned = Vec::with_capacity(steps.len());
    for (at, (s, kernel)) in steps.iter().zip(kernels).enumerate() {
        let (node, kernel) = match (s, kernel) {
            (Step::Kernel { node }, Some(k)) => (*node, k),
            (Step::Kernel { node } | Step::Extern { node }, _) => {
                planned.push(Planned::Extern { node: *node });
                continue;
            }
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
        planned.push(match inplace {
            Some((input, kernel)) => Planned::Kernel {
                kernel,
                outs: vec![(node, Alloc::InPlace(input))],
            },
            None => Planned::Kernel {
                kernel,
                outs: vec![(
                    node,
                    if escaping[node] {
                        Alloc::Output
                    } else {
                        Alloc::Pooled
                    },
                )],
            },
        });
    }
    group(graph, &sched, planned)
}

/// Merges runs of consecutive single-value pointwise kernels of one shape into grouped kernels.
fn group(graph: &Graph, sched: &Schedule, planned: Vec<Planned>) -> Vec<Planned> {
    let groupable = |p: &Planned| match p {
        Planned::Kernel { outs, .. } => {
            outs.len() == 1 && sched.kinds[outs[0].0] != Kind::Reduction
        }
        Planned::Extern { .. } => false,
    };
    let mut out: Vec<Planned> = Vec::with_capacity(planned.len());
    for p in planned {
        let joined = match (out.last(), &p) {
            (
                Some(last @ Planned::Kernel { outs: have, .. }),
                Planned::Kernel { outs: add, .. },
            ) if groupable(&p)
                && have.len() < MAX_GROUP
                && (have.len() > 1 || groupable(last))
                && graph.nodes[have[0].0].shape == graph.nodes[add[0].0].shape =>
            {
                let outs: Vec<(NodeId, Alloc)> = have.iter().chain(add).copied().collect();
                let roots: Vec<(NodeId, Option<NodeId>)> = outs
                    .iter()
                    .map(|&(n, a)| match a {
                        Alloc::InPlace(i) => (n, Some(i)),
                        _ => (n, None),
                    })
                    .collect();
                group_kernel(graph, sched, &roots).map(|kernel| Planned::Kernel { kernel, outs })
            }
            _ => None,
        };
        match joined {
            Some(j) => {
                out.pop();
                out.push(j);
            }
            None => out.push(p),
        }
    }
    out
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
        let planned = plan_graph(graph);
        // one size of a symbolic graph: kernels that differ between sizes only in constants
        // become one size-generic kernel (`codegen/template.rs`)
        let sizes = symbolic::context::current();
        let kernels: Vec<&Kernel> = planned
            .iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, .. } => Some(kernel),
                Planned::Extern { .. } => None,
            })
            .collect();
        // a kernel's place: its index in a graph of this size (a forward and a backward graph
        // compiled for one size are told apart by their node and kernel counts)
        let place = |i: usize| {
            ((graph.nodes.len() as u64) << 40) ^ ((kernels.len() as u64) << 20) ^ i as u64
        };
        let wanted: Vec<(Kernel, Vec<i64>)> = kernels
            .iter()
            .enumerate()
            .map(|(i, kernel)| match &sizes {
                Some(ctx) => template::resolve(ctx, place(i), kernel),
                None => ((*kernel).clone(), Vec::new()),
            })
            .collect();
        let (wanted, mut sizes): (Vec<Kernel>, Vec<Vec<i64>>) = wanted.into_iter().unzip();
        let fns = cc::load(tc, &wanted)?;
        let mut fns = fns.into_iter().zip(wanted).zip(sizes.drain(..));
        let exec = planned
            .into_iter()
            .map(|p| match p {
                Planned::Kernel { outs, .. } => {
                    let ((f, kernel), sizes) = fns.next().ok_or_else(|| {
                        kiln_core::Error::arg("kiln backend", "kernel count mismatch")
                    })?;
                    Ok(Exec::Kernel {
                        outs,
                        f,
                        inputs: kernel.inputs,
                        name: kernel.name.into(),
                        sizes,
                    })
                }
                Planned::Extern { node } => Ok(Exec::Extern { node }),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(CompiledCpu::new(graph.clone(), exec)))
    }
}
