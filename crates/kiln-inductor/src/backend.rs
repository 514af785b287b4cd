//! The CPU code-generating backend: schedule, generate C, build and load, run.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Once};

use kiln_compile::backends::Interpreter;
use kiln_compile::graph::Graph;
use kiln_compile::{Backend, BackendContext, CompiledGraph};
use kiln_core::Result;

use kiln_compile::graph::NodeId;

use crate::codegen::c::{pointwise_kernels, reduction_kernel, Kernel};
use crate::codegen::cuda_compile::{self, CudaFlags};
use crate::codegen::template;
use crate::ir::lower::{small_cpu_matmul, Kind, MatmulDims};
use crate::plan_cache::{Plan, PlanStep, C_KIND};
use crate::repeats::{self, Cone};
use crate::runtime::cc::{self, toolchain};
use crate::runtime::exec::{CompiledCpu, Launch};
use crate::runtime::plan::{self, Alloc};
use crate::schedule::{schedule, MatmulFusion, Schedule, Step};
use crate::sequential::Sequence;
use kiln_compile::symbolic;

/// Generates and compiles C/OpenMP kernels for a graph (forward or backward; `kiln` wraps it in AOT
/// autograd). A graph on a CUDA device goes to the CUDA generator instead (`codegen/cuda.rs`).
pub struct CpuCodegen;

/// What a code generator provides to the shared planning (`plan_graph`): the kernel computing
/// several values of one shape in one loop (each into its own output or in place into a graph
/// input; with whether that is sound, see `codegen::c::pointwise_body`), and a reduction's kernel.
pub trait Target: Sync {
    type Kernel: Clone + Send;
    fn pointwise(
        &self,
        g: &Graph,
        sched: &Schedule,
        roots: &[(NodeId, Option<NodeId>)],
    ) -> (Self::Kernel, bool);
    fn reduction(&self, g: &Graph, sched: &Schedule, root: NodeId) -> Self::Kernel;
    /// One kernel computing `roots` row by row (`rows.rs`): a reduction over dims of an operand
    /// that `row_reach` allows, then values of that operand's shape and reductions over the
    /// same dims that read the earlier ones. `None` where the target has no such kernels.
    fn rows(&self, _g: &Graph, _sched: &Schedule, _roots: &[NodeId]) -> Option<Self::Kernel> {
        None
    }
    /// Which reductions open a row kernel (`rows.rs`); only asked where `rows` makes kernels.
    fn row_reach(&self) -> crate::rows::RowReach {
        crate::rows::RowReach::Trailing
    }
    /// One kernel computing the sibling reductions `roots` (`sibling_reductions.rs`: same
    /// operand shape, reduced dims and output shape, none reading another) in one walk over
    /// their operands. `None` where the target has no such kernels.
    fn sibling_reductions(
        &self,
        _g: &Graph,
        _sched: &Schedule,
        _roots: &[NodeId],
    ) -> Option<Self::Kernel> {
        None
    }
    /// Whether the target generates `ReduceOp::SumSqDev` itself (Welford's lanes, the C target);
    /// else a graph has it as sums before it is planned (`two_pass.rs`).
    fn generates_sqdev(&self) -> bool {
        false
    }
    /// Whether a matmul of these sizes is generated as a reduction over k (fused with its
    /// operands' producers and its readers) instead of running as an extern call.
    fn inline_matmul(&self, _dims: MatmulDims) -> bool {
        false
    }
    /// Longest pointwise chain a generated matmul recomputes in its operand loads (see
    /// `schedule::MatmulFusion`).
    fn matmul_operand_ops(&self) -> usize {
        0
    }
    /// The buffers a kernel reads, in argument order.
    fn inputs<'k>(&self, k: &'k Self::Kernel) -> &'k [NodeId];
    /// The same kernel reading `inputs` instead (of the same shapes and dtypes, in argument
    /// order): a repeated block's step (`repeats.rs`).
    fn rebind(&self, k: &Self::Kernel, inputs: Vec<NodeId>) -> Self::Kernel;
    /// For a kernel that one launch can run beside others (`horizontal.rs`): what the launch
    /// must hold for it. `None` where the target has no such kernels.
    fn side_by_side(&self, _k: &Self::Kernel) -> Option<Side> {
        None
    }
    /// One kernel running `members` side by side, or `None` when they do not fit in one.
    fn horizontal(&self, _members: &[&Self::Kernel]) -> Option<Self::Kernel> {
        None
    }
    /// One kernel running a sequence of kernels in order in one block, with the barriers the
    /// sequence asks for (`sequential.rs`), or `None` where the target cannot.
    fn sequential(&self, _seq: &Sequence<'_, Self::Kernel>) -> Option<Self::Kernel> {
        None
    }
}

/// What a launch of several kernels side by side must hold for one of them
/// (`Target::side_by_side`): the members of a launch share its block size, and their parameters
/// and static shared memory add up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Side {
    pub block: u32,
    pub params: usize,
    /// Bytes of `__shared__` arrays the kernel declares (0 on the CPU).
    pub shared: u32,
}

/// The C target (`codegen/c.rs`).
pub struct C {
    /// Small matmuls as generated reductions (`Target::inline_matmul`); on unless the
    /// `inline_small_matmuls` option turns it off (see `INLINE_SMALL_MATMULS`).
    pub inline_matmul: bool,
    /// Whether independent kernels share one parallel region (`codegen/c_horizontal.rs`).
    pub horizontal: bool,
}

/// `CompileOptions::option` key: `"true"` or `"false"`, whether small matmuls are generated
/// inline (`ir::lower::small_matmul` on a GPU, `small_cpu_matmul` on the CPU) instead of calling
/// gemm / cuBLAS. On by default: on the CPU a generated matmul sums in the order of the eager
/// kernel for small products (`kiln_core::prim::small_cpu_matmul`), so compiled stays equal to
/// eager bit for bit (ARCHITECTURE.md invariant 2); on a GPU eager runs cuBLAS, and a generated
/// matmul agrees with it to rounding. Off, every matmul is an extern call of the eager kernel.
pub const INLINE_SMALL_MATMULS: &str = "inline_small_matmuls";

/// The `inline_small_matmuls` option of a compile, or `default` when it is not given.
pub fn inline_small_matmuls(ctx: &BackendContext, default: bool) -> Result<bool> {
    match ctx.options.get(INLINE_SMALL_MATMULS).map(String::as_str) {
        None => Ok(default),
        Some("true") => Ok(true),
        Some("false") => Ok(false),
        Some(other) => Err(kiln_core::Error::arg(
            "compile(backend=kiln)",
            format!("option {INLINE_SMALL_MATMULS} must be \"true\" or \"false\", got {other:?}"),
        )),
    }
}

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
    /// Not for a symbolic graph (`horizontal` off): its kernels stay the ones
    /// `codegen/template.rs` fits across sizes.
    fn sibling_reductions(&self, g: &Graph, sched: &Schedule, roots: &[NodeId]) -> Option<Kernel> {
        self.horizontal
            .then(|| crate::codegen::c_siblings::sibling_kernel(g, sched, roots))
            .flatten()
    }
    /// Not under a size context (`horizontal` off): a symbolic graph's kernels stay the ones
    /// `codegen/template.rs` fits across sizes.
    fn rows(&self, g: &Graph, sched: &Schedule, roots: &[NodeId]) -> Option<Kernel> {
        self.horizontal
            .then(|| crate::codegen::c_rows::row_kernel(g, sched, roots))
            .flatten()
    }
    fn row_reach(&self) -> crate::rows::RowReach {
        crate::codegen::c_rows::REACH
    }
    fn generates_sqdev(&self) -> bool {
        true
    }
    fn inline_matmul(&self, dims: MatmulDims) -> bool {
        self.inline_matmul && small_cpu_matmul(dims)
    }
    /// A function call per kernel costs less than a libm `tanh` recomputed per output column.
    /// Measured on `kiln-bench regional` (64 blocks of Linear 10→10, ReLU, sigmoid; back to
    /// back on a loaded machine): with the ReLU and sigmoid chains realized the compiled call took
    /// about 0.6x the time it took with extern gemm calls; with them recomputed in the matmul
    /// loads it was no faster than gemm.
    fn matmul_operand_ops(&self) -> usize {
        2
    }
    fn inputs<'k>(&self, k: &'k Kernel) -> &'k [NodeId] {
        &k.inputs
    }
    fn rebind(&self, k: &Kernel, inputs: Vec<NodeId>) -> Kernel {
        Kernel {
            inputs,
            ..k.clone()
        }
    }
    fn side_by_side(&self, k: &Kernel) -> Option<Side> {
        self.horizontal
            .then(|| crate::codegen::c_horizontal::side_by_side(k))
            .flatten()
    }
    fn horizontal(&self, members: &[&Kernel]) -> Option<Kernel> {
        crate::codegen::c_horizontal::horizontal(members)
    }
}

/// The C kernels of a graph, in step order, and the steps that run them.
pub fn generate(graph: &Graph) -> (Vec<Step>, Vec<Option<Kernel>>) {
    let c = C {
        inline_matmul: false,
        horizontal: false,
    };
    kernels_of(&c, graph, &schedule_for(&c, graph))
}

/// The schedule of `graph` for target `t` (which matmuls it generates).
pub fn schedule_for<T: Target>(t: &T, graph: &Graph) -> Schedule {
    let inline = |d| t.inline_matmul(d);
    schedule(
        graph,
        &MatmulFusion {
            inline: &inline,
            operand_ops: t.matmul_operand_ops(),
        },
    )
}

pub(crate) fn kernels_of<T: Target>(
    t: &T,
    graph: &Graph,
    sched: &Schedule,
) -> (Vec<Step>, Vec<Option<T::Kernel>>) {
    // repeated blocks' steps generate their kernel once, distinct ones in parallel
    // (`repeats.rs`)
    let cones: Vec<Option<Cone>> = sched
        .steps
        .iter()
        .map(|s| match s {
            Step::Kernel { node } => Some(Cone::of(graph, sched, *node)),
            Step::Extern { .. } => None,
        })
        .collect();
    let generate = |i: usize| {
        let node = sched.steps[i].node();
        match sched.kinds[node] {
            Kind::Reduction => t.reduction(graph, sched, node),
            _ => t.pointwise(graph, sched, &[(node, None)]).0,
        }
    };
    let kernels = repeats::kernels(&cones, generate, |k| t.inputs(k), |k, i| t.rebind(k, i));
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
    debug_assert!(
        t.generates_sqdev() || !crate::two_pass::has_sqdev(graph),
        "squared deviations reach a target that sums them in two passes (prepare_joint)"
    );
    let sched = schedule_for(t, graph);
    let (steps, kernels) = kernels_of(t, graph, &sched);
    let reads: Vec<Vec<NodeId>> = steps
        .iter()
        .zip(&kernels)
        .map(|(s, k)| match k {
            Some(k) => t.inputs(k).to_vec(),
            None => graph.nodes[s.node()].args.clone(),
        })
        .collect();
    let roots = plan::alias_roots(graph, &steps, &sched.kinds);
    let escaping = plan::escaping(graph, &roots);
    let input_nodes = graph.input_nodes();
    let mut planned = Vec::with_capacity(steps.len());
    for (at, (s, kernel)) in steps.iter().zip(kernels).enumerate() {
        let (node, kernel) = match (s, kernel) {
            (Step::Kernel { node }, Some(k)) => (*node, k),
            (s, _) => {
                planned.push(Planned::Extern { node: s.node() });
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
    let planned = crate::rows::group_rows(t, graph, &sched, planned);
    let planned = crate::sibling_reductions::group(t, graph, &sched, &roots, planned);
    // a small graph in one launch; else independent kernels side by side
    let planned = crate::sequential::compose(t, graph, &roots, planned);
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

/// `graph` rewritten as the code generators take it: the joint graph's rewrites
/// (`prepare_joint`: one-per-row gathers as sums over the row, NHWC values for cuDNN on a
/// device), which find nothing left in a graph AOT autograd split from a rewritten joint graph;
/// one size of a symbolic graph too: the rewrites follow the graph's structure, so every size
/// is rewritten alike and its kernels still fit the size-generic templates. Then per-channel and
/// per-row arithmetic on broadcast values runs on the small shape; on a device a matmul's bias
/// and activation join its call (`epilogue.rs`), on the CPU what follows a convolution does
/// (`conv_epilogue.rs`).
pub(crate) fn prepare(graph: &Graph) -> Result<std::borrow::Cow<'_, Graph>> {
    let mut g = match prepare_joint(graph)? {
        Some(rewritten) => std::borrow::Cow::Owned(rewritten),
        None => std::borrow::Cow::Borrowed(graph),
    };
    if let Some(sunk) = crate::sink_expands::sink_expands(&g) {
        g = std::borrow::Cow::Owned(sunk);
    }
    // a device's GEMM library takes the matmul epilogues; the CPU's gemm crate has no hook for
    // them, but its convolution finishes each image while it is in cache
    let fused = match g.device() {
        kiln_core::Device::Cpu => crate::conv_epilogue::fuse_cpu(&g),
        _ => crate::epilogue::fuse(&g),
    };
    if let Some(fused) = fused {
        g = std::borrow::Cow::Owned(fused);
    }
    Ok(g)
}

/// `prepare` for a CUDA compile: under max-autotune (`tuned`) also the convolution epilogues,
/// whose cuDNN plans cost seconds to make (`conv_epilogue.rs`).
pub(crate) fn prepare_cuda(graph: &Graph, tuned: bool) -> Result<std::borrow::Cow<'_, Graph>> {
    let g = prepare(graph)?;
    if !tuned {
        return Ok(g);
    }
    Ok(match crate::conv_epilogue::fuse(&g) {
        Some(fused) => std::borrow::Cow::Owned(fused),
        None => g,
    })
}

/// A joint graph (forward and backward, before AOT autograd partitions it) rewritten as the
/// code generators want it: on a device, squared deviations as two sums (`two_pass.rs`), then
/// one-per-row gathers and their gradients' scatter_adds as sums and
/// selects over the row (`one_hot.rs`), then NHWC values for cuDNN on a device
/// (`channels_last.rs`), then, on a device, the backward's reads of a matmul-fed ReLU's mask
/// taken from its output (`relu_mask.rs`). `None` when none rewrites anything. Tests that capture graphs call
/// it to see what the `kiln` backend partitions.
pub fn prepare_joint(joint: &Graph) -> Result<Option<Graph>> {
    let on_device = joint.device() != kiln_core::Device::Cpu;
    // a device's reductions take squared deviations as two sums (`two_pass.rs`)
    let two = match on_device {
        true => crate::two_pass::two_pass(joint)?,
        false => None,
    };
    let g = two.as_ref().unwrap_or(joint);
    let picked = crate::one_hot::one_hot(g);
    let nhwc = crate::channels_last::channels_last(picked.as_ref().unwrap_or(g)).or(picked);
    // what lets a training forward's ReLUs join their GEMMs, where `prepare` fuses epilogues
    let masks = match on_device {
        true => crate::relu_mask::relu_masks_from_outputs(nhwc.as_ref().unwrap_or(g)).or(nhwc),
        false => nhwc,
    };
    Ok(masks.or(two))
}

static INTERPRETED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Graphs this process compiled onto the interpreter because their kernels could not be
/// generated (no C compiler; a CUDA unit NVRTC refused): they run, but as eager kernels. A
/// benchmark of compiled code checks it stays 0 (kiln-bench reports an error otherwise).
pub fn interpreted_graphs() -> usize {
    INTERPRETED.load(std::sync::atomic::Ordering::Relaxed)
}

/// How `ctx` asks for CUDA graphs to be compiled. torch.compile's modes: reduce-overhead and
/// max-autotune record CUDA graphs; both max-autotune modes time launch shapes of the generated
/// kernels.
fn cuda_flags(ctx: &BackendContext) -> Result<CudaFlags> {
    let mode = ctx.mode.as_str();
    Ok(CudaFlags {
        cuda_graphs: matches!(mode, "reduce-overhead" | "max-autotune"),
        inline_matmul: inline_small_matmuls(ctx, true)?,
        autotune: matches!(mode, "max-autotune" | "max-autotune-no-cudagraphs"),
    })
}

impl Backend for CpuCodegen {
    fn name(&self) -> &str {
        "kiln_cpu"
    }

    fn prepare_joint(&self, joint: &Graph) -> Result<Option<Graph>> {
        prepare_joint(joint)
    }

    fn cache_id(&self) -> Option<String> {
        Some(crate::plan_cache::build_and_settings())
    }

    /// The plans the function's last compiles used are read ahead (`plan_cache::read_ahead_recent`),
    /// and unless `KILN_PREFETCH_UNITS=0`, a function traced on a CUDA device starts loading
    /// the units its last compile loaded (`codegen/cuda_prefetch.rs`).
    fn trace_starting(&self, ctx: &BackendContext, args: &[kiln_core::Tensor]) {
        crate::plan_cache::read_ahead_recent(ctx);
        crate::codegen::cuda_prefetch::start(ctx, args)
    }

    /// Plans read ahead for the trace and not taken are stale: dropped.
    fn trace_finished(&self, ctx: &BackendContext) {
        crate::plan_cache::discard_read_ahead(&ctx.name);
    }

    /// On a CUDA device both graphs' kernels are built by one pool of NVRTC threads: built one
    /// graph after the other, each ended in a tail of a few large units on a few threads.
    /// Anything that fails there goes through `compile` graph by graph (its fallbacks apply).
    /// On the CPU both graphs' C is built in one load, its units spread over the cores.
    fn compile_pair(
        &self,
        forward: &Graph,
        backward: &Graph,
        ctx: &BackendContext,
    ) -> Result<(Arc<dyn CompiledGraph>, Arc<dyn CompiledGraph>)> {
        let device = forward.device();
        if device != kiln_core::Device::Cpu && backward.device() == device {
            let both = cuda_compile::compile_many(
                &[forward, backward],
                cuda_flags(ctx)?,
                &memo(ctx, device),
            );
            if let Ok(mut both) = both {
                if let (Some(bc), Some(fc)) = (both.pop(), both.pop()) {
                    return Ok((fc, bc));
                }
            }
        }
        if device == kiln_core::Device::Cpu && backward.device() == device {
            // both graphs' C built together: their units share the cores
            let mut both = compile_c(&[forward, backward], ctx)?;
            if let (Some(bc), Some(fc)) = (both.pop(), both.pop()) {
                return Ok((fc, bc));
            }
        }
        Ok((self.compile(forward, ctx)?, self.compile(backward, ctx)?))
    }

    fn compile(&self, graph: &Graph, ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        if graph.device() != kiln_core::Device::Cpu {
            let memo = memo(ctx, graph.device());
            return match cuda_compile::compile(graph, cuda_flags(ctx)?, &memo) {
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
                    INTERPRETED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok(Arc::new(Interpreter::new(graph.clone())))
                }
                Err(e) => Err(e),
            };
        }
        let mut compiled = compile_c(&[graph], ctx)?;
        compiled
            .pop()
            .ok_or_else(|| kiln_core::Error::arg("kiln backend", "no graph was compiled"))
    }
}

/// What a CUDA compile of the function `ctx` names remembers for its next warm start.
fn memo(ctx: &BackendContext, device: kiln_core::Device) -> cuda_compile::Memo {
    cuda_compile::Memo {
        prefetch: crate::codegen::cuda_prefetch::manifest(ctx, device),
        plans: crate::plan_cache::recent(crate::plan_cache::CUDA_KIND, ctx),
    }
}

/// The C kernels of `graphs` (all on the CPU), planned (or read from the disk cache) graph by
/// graph and built together (`cc::load`: the units of all of them share the cores).
fn compile_c(graphs: &[&Graph], ctx: &BackendContext) -> Result<Vec<Arc<dyn CompiledGraph>>> {
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
                "kiln: no C compiler found (set CC or install gcc/clang); compiled graphs run on \
                 the interpreter instead of generated kernels"
            )
        });
        INTERPRETED.fetch_add(graphs.len(), std::sync::atomic::Ordering::Relaxed);
        return Ok(graphs
            .iter()
            .map(|&g| Arc::new(Interpreter::new(g.clone())) as Arc<dyn CompiledGraph>)
            .collect());
    };
    // one size of a symbolic graph: kernels that differ between sizes only in constants
    // become one size-generic kernel (`codegen/template.rs`)
    let sizes = symbolic::context::current();
    let c = C {
        inline_matmul: inline_small_matmuls(ctx, true)?,
        // not under a size context: a horizontal kernel's member functions are named by
        // the hash of their static text, which a size-generic kernel rewrites under the same
        // names
        horizontal: sizes.is_none(),
    };
    // what a plan's key says of the target besides the graph (`horizontal` follows from the
    // key being made at all: only concrete graphs' plans are cached)
    let target = format!(
        "inline_matmul={} {} libmvec={}",
        c.inline_matmul, tc.identity, tc.libmvec
    );
    let recent = crate::plan_cache::recent(C_KIND, ctx);
    let mut used = Vec::new();
    let plans: Vec<Plan> = graphs
        .iter()
        .map(|&graph| -> Result<Plan> {
            // a symbolic graph's kernels are fitted across sizes: not cached
            let key = match sizes {
                None => crate::plan_cache::key(C_KIND, &target, graph),
                Some(_) => None,
            };
            used.push(key);
            if let Some(plan) = key.and_then(|k| crate::plan_cache::take_or_load(C_KIND, k)) {
                return Ok(plan);
            }
            let _span = kiln_core::profiler::span(kiln_core::profiler::Category::Compile, || {
                "inductor: plan and generate C".into()
            });
            let plan = plan_c(&c, &*prepare(graph)?, sizes.as_ref());
            if let Some(k) = key {
                crate::plan_cache::store(C_KIND, k, &plan);
            }
            Ok(plan)
        })
        .collect::<Result<_>>()?;
    crate::plan_cache::remember(recent.as_ref(), used);
    // every distinct kernel of the graphs (a unit of a C plan holds one), loaded by name
    let wanted: Vec<cc::CKernel<'_>> = plans
        .iter()
        .flat_map(|p| &p.units)
        .map(|(source, names)| cc::CKernel {
            name: names.first().map_or("", String::as_str),
            source,
        })
        .collect();
    let fns: HashMap<String, cc::KernelFn> = {
        let _span = kiln_core::profiler::span(kiln_core::profiler::Category::Compile, || {
            format!("inductor: build and load {} C kernels", wanted.len()).into()
        });
        let fns = cc::load(tc, &wanted)?;
        wanted.iter().map(|k| k.name.to_string()).zip(fns).collect()
    };
    plans
        .into_iter()
        .map(|plan| {
            let exec = plan
                .steps
                .into_iter()
                .map(|step| {
                    step.into_exec(|name, _| {
                        let f = fns.get(name).copied().ok_or_else(|| {
                            kiln_core::Error::arg("kiln backend", "a C kernel was not loaded")
                        })?;
                        Ok(Launch::Cpu(f))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Arc::new(CompiledCpu::new(plan.graph, exec)) as Arc<dyn CompiledGraph>)
        })
        .collect()
}

/// The C plan of `graph` (rewritten for the code generators): its steps, each kernel resolved
/// for the size context `sizes` (`codegen/template.rs`), and one unit per distinct kernel (the
/// steps of repeated blocks share theirs).
fn plan_c(c: &C, graph: &Graph, sizes: Option<&symbolic::context::SizeContext>) -> Plan {
    let planned = plan_graph(c, graph);
    let count = planned
        .iter()
        .filter(|p| matches!(p, Planned::Kernel { .. }))
        .count();
    let mut units = Vec::with_capacity(count);
    let mut seen: HashSet<String> = HashSet::new();
    let mut i = 0;
    let steps = planned
        .into_iter()
        .map(|p| match p {
            Planned::Kernel { kernel, outs } => {
                let (kernel, sizes) = match sizes {
                    Some(ctx) => template::resolve(
                        ctx,
                        template::place(graph.nodes.len(), count, i),
                        &kernel,
                        template::SizeArgs::Array,
                    ),
                    None => (kernel, Vec::new()),
                };
                i += 1;
                if seen.insert(kernel.name.clone()) {
                    units.push((kernel.source, vec![kernel.name.clone()]));
                }
                PlanStep::Kernel {
                    outs,
                    inputs: kernel.inputs,
                    name: kernel.name,
                    sizes,
                    launch: ([0; 3], 0, 0),
                }
            }
            Planned::Extern { node } => PlanStep::Extern { node },
        })
        .collect();
    Plan {
        graph: graph.clone(),
        steps,
        units,
    }
}
