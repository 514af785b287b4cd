//! The CPU code-generating backend: schedule, generate C, build and load, run.

use std::sync::{Arc, Once};

use kiln_compile::backends::Interpreter;
use kiln_compile::graph::Graph;
use kiln_compile::{Backend, BackendContext, CompiledGraph};
use kiln_core::Result;

use crate::codegen::c::{pointwise_kernel, reduction_kernel, Kernel};
use crate::ir::lower::Kind;
use crate::runtime::cc::{self, toolchain};
use crate::runtime::exec::{CompiledCpu, Exec};
use crate::schedule::{schedule, Step};

/// Generates and compiles C/OpenMP kernels for a graph (forward or backward; `kiln` wraps it in AOT
/// autograd).
pub struct CpuCodegen;

/// The kernels of a graph, in step order, and the steps that run them.
pub fn generate(graph: &Graph) -> (Vec<Step>, Vec<Option<Kernel>>) {
    let sched = schedule(graph);
    let kernels = sched
        .steps
        .iter()
        .map(|s| match s {
            Step::Kernel { node } if sched.kinds[*node] == Kind::Reduction => {
                Some(reduction_kernel(graph, &sched, *node))
            }
            Step::Kernel { node } => Some(pointwise_kernel(graph, &sched, *node)),
            Step::Extern { .. } => None,
        })
        .collect();
    (sched.steps, kernels)
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
        let (steps, kernels) = generate(graph);
        let wanted: Vec<Kernel> = kernels.iter().flatten().cloned().collect();
        let fns = cc::load(tc, &wanted)?;
        let mut fns = fns.into_iter();
        let exec = steps
            .iter()
            .zip(&kernels)
            .map(|(s, k)| match (s, k) {
                (Step::Kernel { node }, Some(k)) => Ok(Exec::Kernel {
                    node: *node,
                    f: fns.next().ok_or_else(|| {
                        kiln_core::Error::arg("kiln backend", "kernel count mismatch")
                    })?,
                    inputs: k.inputs.clone(),
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
