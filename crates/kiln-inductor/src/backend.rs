//! The CPU code-generating backend: schedule, generate C, build and load, run.

use std::sync::{Arc, Once};

use kiln_compile::backends::Interpreter;
use kiln_compile::graph::Graph;
use kiln_compile::{Backend, BackendContext, CompiledGraph};
use kiln_core::Result;

use kiln_compile::graph::NodeId;

use crate::codegen::c::{pointwise_kernels, reduction_kernel, Kernel};
use crate::codegen::template;
use crate::ir::lower::Kind;
use crate::runtime::cc::{self, toolchain};
use crate::runtime::exec::{CompiledCpu, Exec, Launch};
use crate::runtime::plan::{self, Alloc};
use crate::schedule::{schedule, Schedule, Step};
use kiln_compile::symbolic;

/// Generates and compiles C/OpenMP kernels for a graph (forward or backward; `kiln` wraps it in AOT
/// autograd). A graph on a CUDA device goes to the CUDA generator instead (`codegen/cuda.rs`).
pub struct CpuCodegen;

/// What a code generator provides to the shared planning (`plan_graph`): the kernel computing
/// several values of one shape in one loop (each into its own output or in place into a graph
/// input; with whether that is sound, see `codegen::c::pointwise_body`), and a reduction's kernel.
pub trait Target {
    type Kernel: Clone;
    fn pointwise(
        &self,
        g: &Graph,
        sched: &Schedule,
        roots: &[(NodeId, Option<NodeId>)],
    ) -> (Self::Kernel, bool);
    fn reduction(&self, g: &Graph, sched: &Schedule, root: NodeId) -> Self::Kernel;
    /// The buffers a kernel reads, in argument order.
    fn inputs<'k>(&self, k: &'k Self::Kernel) -> &'k [NodeId];
    /// For a kernel that one launch can run beside others (`horizontal.rs`): its block size and
    /// parameter count. `None` where the target has no such kernels.
    fn side_by_side(&self, _k: &Self::Kernel) -> Option<(u32, usize)> {
        None
    }
    /// One kernel running `members` side by side, or `None` when they do not fit in one.
    fn horizontal(&self, _members: &[&Self::Kernel]) -> Option<Self::Kernel> {
        None
    }
}

/// The C target (`codegen/c.rs`).
pub struct C;

impl Target for C {
    type Kernel = Kernel;
    fn pointwise(
        &self,
        g: &Graph,
        sched: &Schedule,
        roots: &[(NodeId, Option<NodeId>)],
    ) -> (Kernel, bool) {
        pointwise_kernels(g, sched, roots)
    }
    fn reduction(&self, g: &Graph, sched: &Schedule, root: NodeId) -> Kernel {
        reduction_kernel(g, sched, root)
    }
    fn inputs<'k>(&self, k: &'k Kernel) -> &'k [NodeId] {
        &k.inputs
    }
}

/// The C kernels of a graph, in step order, and the steps that run them.
pub fn generate(graph: &Graph) -> (Vec<Step>, Vec<Option<Kernel>>) {
    kernels_of(&C, graph, &schedule(graph))
}

fn kernels_of<T: Target>(
    t: &T,
    graph: &Graph,
    sched: &Schedule,
) -> (Vec<Step>, Vec<Option<T::Kernel>>) {
    let kernels = sched
        .steps
        .iter()
        .map(|s| match s {
            Step::Kernel { node } if sched.kinds[*node] == Kind::Reduction => {
                Some(t.reduction(graph, sched, *node))
            }
            Step::Kernel { node } => Some(t.pointwise(graph, sched, &[(*node, None)]).0),
            Step::Extern { .. } => None,
        })
        .collect();
    (sched.steps.clone(), kernels)
}

/// A step of the executor as planned: a generated kernel and the values it writes (with where),
/// or an extern call.
pub enum Planned<K> {
    Kernel {
        kernel: K,
        outs: Vec<(NodeId, Alloc)>,
    },
    Extern {
        node: NodeId,
    },
}

/// Most values one grouped kernel computes.
const MAX_GROUP: usize = 8;

/// The executor's steps: each kernel with where it writes (`runtime/plan.rs`) — in place into a
/// mutated input where that is safe (with the in-place variant of its kernel), a new buffer for
/// what the caller receives, a pooled buffer otherwise — and consecutive kernels of one shape
/// grouped into one loop where they can be.
pub fn plan_graph<T: Target>(t: &T, graph: &Graph) -> Vec<Planned<T::Kernel>> {
    let sched = schedule(graph);
    let (steps, kernels) = kernels_of(t, graph, &sched);
    let reads: Vec<Vec<NodeId>> = steps
        .iter()
        .zip(&kernels)
        .map(|(s, k)| match (s, k) {
            (_, Some(k)) => t.inputs(k).to_vec(),
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
        // the in-place variant reads its input through the output: sound only when every read
        // of the old value is at the element being written
        let inplace = graph.mutated_inputs.iter().find_map(|&(k, i)| {
            let input = *input_nodes.get(i)?;
            let ok = graph.outputs.get(k) == Some(&node)
                && sched.kinds[node] != Kind::Reduction
                && plan::inplace_allowed(graph, &steps, &reads, &roots, at, k, input);
            if !ok {
                return None;
            }
            let (kernel, sound) = t.pointwise(graph, &sched, &[(node, Some(input))]);
            sound.then_some((input, kernel))
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
    let planned = group(t, graph, &sched, planned);
    crate::horizontal::fuse(t, graph, &roots, planned)
}

/// Merges runs of consecutive single-value pointwise kernels of one shape into grouped kernels:
/// one loop, several outputs, where no value of the group reads another one (or an in-place
/// input) at another element than the one being written.
fn group<T: Target>(
    t: &T,
    graph: &Graph,
    sched: &Schedule,
    planned: Vec<Planned<T::Kernel>>,
) -> Vec<Planned<T::Kernel>> {
    let groupable = |p: &Planned<T::Kernel>| match p {
        Planned::Kernel { outs, .. } => {
            outs.len() == 1 && sched.kinds[outs[0].0] != Kind::Reduction
        }
        Planned::Extern { .. } => false,
    };
    let mut out: Vec<Planned<T::Kernel>> = Vec::with_capacity(planned.len());
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
                let (kernel, sound) = t.pointwise(graph, sched, &roots);
                let reads_group = t
                    .inputs(&kernel)
                    .iter()
                    .any(|i| roots.iter().any(|(r, _)| r == i));
                (sound && !reads_group).then_some(Planned::Kernel { kernel, outs })
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
        if graph.device() != kiln_core::Device::Cpu {
            // torch.compile's modes: reduce-overhead and max-autotune record CUDA graphs; both
            // max-autotune modes time launch shapes of the generated kernels
            let mode = ctx.mode.as_str();
            let cuda_graphs = matches!(mode, "reduce-overhead" | "max-autotune");
            let autotune = matches!(mode, "max-autotune" | "max-autotune-no-cudagraphs");
            return match crate::codegen::cuda::compile(graph, cuda_graphs, autotune) {
                Ok(compiled) => Ok(compiled),
                Err(e) if !ctx.fullgraph => {
                    static WARN: Once = Once::new();
                    WARN.call_once(|| {
                        eprintln!(
                            "kiln: kernels for {} could not be generated ({e}); compiled graphs \
                             there run on the interpreter (eager device kernels)",
                            graph.device()
                        )
                    });
                    Ok(Arc::new(Interpreter::new(graph.clone())))
                }
                Err(e) => Err(e),
            };
        }
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
        let planned = plan_graph(&C, graph);
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
                        f: Launch::Cpu(f),
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
