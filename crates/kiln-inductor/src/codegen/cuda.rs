//! CUDA C generation: the same schedule, planning (`backend::plan_graph`) and expression builder
//! (`codegen::builder::Builder`, whose C is also CUDA C) as the CPU target; only the loops differ. A
//! pointwise kernel is a grid-stride loop over the output's elements, the flat index split into
//! one index per dimension; a reduction gives each output element a thread, a warp or a block
//! by the length of what it reduces (`codegen/cuda_reduce.rs`). A graph's kernels are a few
//! translation units compiled by NVRTC (`codegen/cuda_units.rs`, through kiln-core's
//! `DeviceRuntime::load_kernels`, which caches by source); a symbolic graph's kernels take its
//! sizes as parameters (`codegen/cuda_sizes.rs`).

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId};
use kiln_core::device::ReduceSplit;

pub use super::cuda_shared::{static_shared_bytes, STATIC_SHARED_MAX};
use crate::backend::{plan_graph, Planned, Side, Target};
use crate::codegen::builder::{ty, Builder};
use crate::codegen::c::{pointwise_body, split_index};
use crate::codegen::cuda_vector::{lane_grid, vector_loop};
use crate::ir::lower::{small_matmul, MatmulDims};
use crate::schedule::Schedule;
use crate::sequential::Sequence;
use crate::split_reduction::split_reductions;

/// Names the builder's C uses, mapped for NVRTC (which has no C headers): fixed-width integer
/// types, the infinities, NaN tests that need no header, and the sine/cosine the CPU target
/// routes through libmvec.
pub(crate) const PRELUDE: &str = r#"#define int64_t long long
#define int32_t int
#define uint64_t unsigned long long
#define uint32_t unsigned int
#define uint8_t unsigned char
#undef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#undef NAN
#define NAN __int_as_float(0x7fffffff)
#undef isnan
#define isnan(x) ((x) != (x))
#define kiln_sinf sinf
#define kiln_cosf cosf
#define kiln_sin sin
#define kiln_cos cos
#define kiln_sincosf sincosf
#define kiln_sincos sincos
template <typename T> struct alignas(4 * sizeof(T)) kiln_v4 { T v[4]; };
"#;

/// Elements from which a pointwise kernel's threads take `UNROLL` elements per iteration.
const UNROLL_FROM: usize = 1 << 20;
const UNROLL: usize = 4;
/// Elements from which a pointwise kernel moves four consecutive elements per load and store
/// (16 bytes of f32): the size of the accesses, not only their number, decides how much of the
/// bandwidth a memory-bound kernel reaches.
pub(super) const VECTOR_FROM: usize = 4096;

/// One generated CUDA kernel and how to launch it.
#[derive(Clone, Debug)]
pub struct CudaKernel {
    pub name: String,
    /// The `extern "C" __global__` definition.
    pub source: String,
    /// The `__device__` functions the definition calls (name, definition): the members of a
    /// horizontal kernel, emitted once per translation unit however many kernels call them.
    pub device_fns: Vec<(String, String)>,
    /// The buffers it reads, in argument order (the outputs come after them).
    pub inputs: Vec<NodeId>,
    pub grid: [u32; 3],
    pub block: u32,
    /// Bytes of dynamic shared memory per block (a composed launch's staged inputs).
    pub shared: u32,
    /// The parameter list, with names, and the body (which reads its block index and block
    /// count from `kbid` and `knblk`): what a horizontal kernel calls it by.
    pub(super) sig: String,
    pub(super) text: String,
    /// The C type of each parameter (inputs, then outputs).
    pub(super) param_types: Vec<String>,
}

/// The launch shape of generated kernels: what max-autotune varies (`runtime/autotune.rs`).
/// Every kernel is a grid-stride loop, so each configuration computes the same values; they
/// differ in speed only. `Default` is the configuration every other mode uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TuneConfig {
    /// Threads per block of pointwise kernels and of per-thread reductions.
    pub block: u32,
    /// Threads per block of a reduction that gives each output element a whole block (a
    /// multiple of 32, at most 1024: its warps' partial sums are combined by one warp).
    pub row_block: u32,
    /// Output elements (one per warp) per block of a warp reduction (at most 32).
    pub warp_rows: u32,
    /// Most blocks per multiprocessor of a grid-stride loop (the grid multiplier). A vector
    /// loop without hoisted per-lane values launches a thread per vector (`lane_grid`).
    pub waves: u32,
}

impl Default for TuneConfig {
    fn default() -> Self {
        TuneConfig {
            block: 256,
            row_block: 512,
            warp_rows: 8,
            waves: 32,
        }
    }
}

impl TuneConfig {
    /// The configurations max-autotune tries, the default first: smaller and larger blocks,
    /// fewer and more waves (a short kernel gains from fewer blocks, a long memory-bound one
    /// from more in flight). The waves do not change a vector loop without hoisted per-lane
    /// values: it launches a thread per vector (`lane_grid`).
    pub fn candidates() -> Vec<TuneConfig> {
        let d = TuneConfig::default();
        vec![
            d,
            TuneConfig {
                block: 128,
                row_block: 256,
                warp_rows: 4,
                ..d
            },
            TuneConfig {
                block: 512,
                row_block: 1024,
                warp_rows: 16,
                ..d
            },
            TuneConfig { waves: 8, ..d },
            TuneConfig {
                block: 1024,
                waves: 4,
                ..d
            },
        ]
    }

    /// Whether the generator can use it (block sizes a CUDA launch and the reductions accept).
    pub fn valid(&self) -> bool {
        let warps = |n: u32| (32..=1024).contains(&n) && n % 32 == 0;
        warps(self.block)
            && warps(self.row_block)
            && (1..=32).contains(&self.warp_rows)
            && self.waves >= 1
    }
}

/// The CUDA target for a device with `sm_count` multiprocessors (grid-stride loops launch a few
/// waves of blocks, not one block per element), generating kernels of launch shape `cfg`.
/// Its `Debug` text keys plans in the disk cache (`plan_cache.rs`): every field is in it.
#[derive(Debug)]
pub struct Cuda {
    pub sm_count: u32,
    /// Small matmuls as generated reductions (`Target::inline_matmul`).
    pub inline_matmul: bool,
    /// Whether kernels may share a launch: side by side (`horizontal.rs`), in sequence
    /// (`sequential.rs`) or row by row (`codegen/cuda_rows.rs`). Not for a symbolic graph:
    /// the dispatcher of such a launch bakes each member's block count and sizes into its
    /// text, which then differs at every size (and its members are device functions that
    /// `codegen/template.rs` does not make size-generic).
    pub horizontal: bool,
    /// The launch shape (max-autotune varies it).
    pub cfg: TuneConfig,
    /// Dynamic shared memory a block may take (`DeviceRuntime::shared_memory_per_block`).
    pub shared_per_block: u32,
    /// Index arithmetic in 32 bits where a kernel's buffers and loops are small enough
    /// (`narrow_index`). Not for a symbolic graph: its kernels become templates over 64-bit
    /// size parameters that serve larger sizes too.
    pub int_index: bool,
}

impl Cuda {
    /// The target with small matmuls generated, launches fused and the default launch shape
    /// (what a compile on a GPU uses).
    pub fn new(sm_count: u32) -> Cuda {
        Cuda {
            sm_count,
            inline_matmul: true,
            horizontal: true,
            cfg: TuneConfig::default(),
            shared_per_block: 48 << 10,
            int_index: true,
        }
    }

    /// `text` with its index variables in 32 bits (`int`) when `int_index` is on and every
    /// buffer it touches (`buffers`) and its iteration space (`extent` elements) are under
    /// `INT_INDEX_BELOW` elements; else unchanged. On a GPU a 64-bit integer multiply, division
    /// or modulo by a constant is emulated with several 32-bit instructions, and index-heavy
    /// kernels are bound by them: a fused max-pool backward evaluates 45 clamped and divided
    /// indices per element.
    pub(super) fn narrow_index(
        &self,
        g: &Graph,
        buffers: impl IntoIterator<Item = NodeId>,
        extent: usize,
        text: String,
    ) -> String {
        let largest = buffers
            .into_iter()
            .map(|id| g.nodes[id].shape.iter().product::<usize>())
            .fold(extent, usize::max);
        if !self.int_index || largest >= INT_INDEX_BELOW {
            return text;
        }
        // only index variables are spelled `long long` in a kernel's text: values of 64-bit
        // dtypes are `int64_t` (`ty`, the prelude's define) and stay 64-bit; pointer alignment
        // tests cast to `unsigned long long`, which stays too
        text.replace("unsigned long long", "\u{0}")
            .replace("long long", "int")
            .replace('\u{0}', "unsigned long long")
    }

    pub(super) fn blocks(&self, units: usize, per_block: usize) -> u32 {
        let want = units.div_ceil(per_block).max(1);
        want.min(self.sm_count.max(1) as usize * self.cfg.waves as usize) as u32
    }
}

/// Elements below which a kernel's index arithmetic is 32-bit (`Cuda::narrow_index`). Every
/// index value and subexpression is bounded by the buffers' and loops' extents (a clamped pad
/// index, a flat index split by division and modulo) plus the grid-stride step (at most
/// `sm_count * waves * block` threads, a few million, or in a vector loop of a thread per
/// vector a quarter of the elements, `lane_grid`); 2^27 leaves that a factor of 12 below
/// `int`'s range.
const INT_INDEX_BELOW: usize = 1 << 27;

/// The kernel's parameters, each (C type, name): its input buffers, then one per output.
pub(super) fn parameters(
    b: &Builder<'_>,
    g: &Graph,
    outputs: &[(NodeId, String)],
) -> Vec<(String, String)> {
    let mut params: Vec<(String, String)> = b
        .params
        .iter()
        .enumerate()
        .map(|(p, &id)| {
            let t = ty(g.nodes[id].dtype);
            (format!("const {t} *__restrict__"), format!("b{p}"))
        })
        .collect();
    for (root, name) in outputs {
        let t = ty(g.nodes[*root].dtype);
        params.push((format!("{t} *__restrict__"), name.clone()));
    }
    params
}

/// Names the kernel by the hash of its text (identical kernels of repeated blocks are one).
pub(super) fn finish(
    inputs: Vec<NodeId>,
    params: Vec<(String, String)>,
    text: String,
    grid: u32,
    block: u32,
) -> CudaKernel {
    let text = super::cuda_sincos::pair(&text);
    let sig = params
        .iter()
        .map(|(t, n)| format!("{t} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let hash = xxhash_rust::xxh3::xxh3_64(format!("{sig}{text}{block}").as_bytes());
    let name = format!("k_{hash:016x}");
    CudaKernel {
        source: format!(
            "extern \"C\" __global__ void __launch_bounds__({block}) {name}({sig}) {{\n  const \
             long long kbid = blockIdx.x, knblk = gridDim.x;\n{text}}}\n"
        ),
        name,
        device_fns: Vec::new(),
        inputs,
        grid: [grid, 1, 1],
        block,
        shared: 0,
        sig,
        text,
        param_types: params.into_iter().map(|(t, _)| t).collect(),
    }
}

/// A parameter type without `__restrict__`: a launch that calls several kernels passes one
/// buffer to more than one of them (two members may read it, or one write what another reads).
pub(super) fn unrestricted(t: &str) -> String {
    t.replace(" *__restrict__", " *")
}

/// `k` as a `__device__` function named `prefix` + its hash, with parameters `sig`, told its
/// block index and count (`kbid`, `knblk`), added to `fns` once: a member of a horizontal or a
/// sequential launch.
pub(super) fn member_fn(
    fns: &mut Vec<(String, String)>,
    prefix: char,
    k: &CudaKernel,
    sig: &str,
) -> String {
    let f = format!("{prefix}{}", &k.name[1..]);
    if !fns.iter().any(|(n, _)| *n == f) {
        let def = format!(
            "__device__ __noinline__ void {f}({sig}, const long long kbid, const long long knblk) \
             {{\n{}}}\n",
            k.text
        );
        fns.push((f.clone(), def));
    }
    f
}

impl Target for Cuda {
    type Kernel = CudaKernel;

    fn pointwise(
        &self,
        g: &Graph,
        sched: &Schedule,
        roots: &[(NodeId, Option<NodeId>)],
    ) -> (CudaKernel, bool) {
        let shape = &g.nodes[roots[0].0].shape;
        let numel: usize = shape.iter().product();
        let scalar = pointwise_body(g, sched, roots, false);
        if let Some(k) = super::cuda_residues::split(self, g, sched, roots, &scalar) {
            return (k, scalar.ok);
        }
        let vars: Vec<(usize, usize)> = shape.iter().copied().enumerate().collect();
        // one element at flat index `e`, in a scope of its own
        let element = |indent: &str| {
            let mut t = String::new();
            split_index(&mut t, "e", &vars, indent, "rem");
            t.push_str(&scalar.b.body);
            t.push_str(&scalar.stores);
            t
        };
        let mut text = scalar.b.pre.clone();
        let _ = writeln!(
            text,
            "  const long long stride = knblk * blockDim.x;\n  long long e0 = kbid * \
             blockDim.x + threadIdx.x;"
        );
        // a thread per vector of four where the vector loop can run (one per element would
        // leave three blocks in four with nothing to do); the loops are grid-stride, so the
        // scalar fallback is correct with these blocks too
        let per_thread = if numel >= VECTOR_FROM { 4 } else { 1 };
        let block = self.cfg.block;
        let mut grid = self.blocks(numel.div_ceil(per_thread), block as usize);
        let mut vectorized = false;
        if numel >= VECTOR_FROM {
            let lanes = pointwise_body(g, sched, roots, true);
            // the same traversal loads the same buffers in the same order (and names the
            // hoisted values alike)
            if lanes.b.params == scalar.b.params && lanes.b.pre == scalar.b.pre {
                grid = lane_grid(self, &lanes, &vars, numel);
                vector_loop(&mut text, g, &lanes, &vars, numel, (block, grid));
                vectorized = true;
            }
        }
        if numel >= UNROLL_FROM && !vectorized {
            // UNROLL elements a stride apart per iteration, in one basic block: their loads are
            // independent, so they are in flight together. Not behind a vector loop, which
            // takes every element of aligned buffers: there it was the largest part of the
            // kernel's source (four copies of the body, for buffers that are 16-byte aligned in
            // practice), and NVRTC's time grows with the source (DenseNet-121's training step:
            // 600+ kernels, most of its cold compile).
            let _ = writeln!(
                text,
                "  for (; e0 + {} * stride < {numel}; e0 += {UNROLL} * stride) {{",
                UNROLL - 1
            );
            for k in 0..UNROLL {
                let _ = writeln!(text, "    {{\n    const long long e = e0 + {k} * stride;");
                let _ = writeln!(text, "{}    }}", element("    "));
            }
            let _ = writeln!(text, "  }}");
        }
        let _ = writeln!(
            text,
            "  for (; e0 < {numel}; e0 += stride) {{\n    const long long e = e0;"
        );
        let _ = writeln!(text, "{}  }}", element("    "));
        let buffers = scalar
            .b
            .params
            .iter()
            .chain(scalar.outputs.iter().map(|o| &o.0));
        let text = self.narrow_index(g, buffers.copied(), numel, text);
        let params = parameters(&scalar.b, g, &scalar.outputs);
        let ok = scalar.ok;
        (finish(scalar.b.params, params, text, grid, block), ok)
    }

    fn reduction(&self, g: &Graph, sched: &Schedule, root: NodeId) -> CudaKernel {
        super::cuda_reduce::reduction(self, g, sched, &[root])
    }

    /// Not for a symbolic graph (`horizontal` off), as `rows`.
    fn sibling_reductions(
        &self,
        g: &Graph,
        sched: &Schedule,
        roots: &[NodeId],
    ) -> Option<CudaKernel> {
        self.horizontal
            .then(|| super::cuda_reduce::reduction(self, g, sched, roots))
    }

    /// Not for a symbolic graph (`horizontal` off): its kernels stay the ones
    /// `codegen/template.rs` fits across sizes.
    fn rows(&self, g: &Graph, sched: &Schedule, roots: &[NodeId]) -> Option<CudaKernel> {
        self.horizontal
            .then(|| super::cuda_rows::row_kernel(self, g, sched, roots))
            .flatten()
    }

    fn row_reach(&self) -> crate::rows::RowReach {
        super::cuda_rows::REACH
    }

    fn inputs<'k>(&self, k: &'k CudaKernel) -> &'k [NodeId] {
        &k.inputs
    }

    fn rebind(&self, k: &CudaKernel, inputs: Vec<NodeId>) -> CudaKernel {
        CudaKernel {
            inputs,
            ..k.clone()
        }
    }

    /// A small matmul costs a cuBLAS launch (and, on its own, a launch per layer) many times
    /// what its few thousand multiply-adds cost in a thread per output element.
    fn inline_matmul(&self, dims: MatmulDims) -> bool {
        self.inline_matmul && small_matmul(dims)
    }
    /// Recomputing a short chain (a bias add, ReLU and sigmoid: 7 ops) per output costs a few
    /// hundred instructions spread over the threads; realizing it costs a kernel (a launch, or
    /// a barrier and a round trip through L2 in a composed launch: `sequential.rs`).
    fn matmul_operand_ops(&self) -> usize {
        8
    }

    fn side_by_side(&self, k: &CudaKernel) -> Option<Side> {
        self.horizontal.then(|| Side {
            block: k.block,
            params: k.param_types.len(),
            shared: static_shared_bytes(k),
        })
    }

    /// A dispatcher over the members' blocks: the first `grid[0]` blocks run member 0 (as a
    /// `__device__` function told its block index and count), the next ones member 1, and so
    /// on. Every member is a grid-stride loop, correct for any block count, and the branch is
    /// uniform over a block, so the members' `__syncthreads` stay sound.
    fn horizontal(&self, members: &[&CudaKernel]) -> Option<CudaKernel> {
        // (`horizontal.rs` joins only kernels of one block size whose `__shared__` arrays fit
        // together: `Side`)
        let block = members.first()?.block;
        if members.iter().any(|m| m.block != block) {
            return None;
        }
        let mut device_fns: Vec<(String, String)> = Vec::new();
        let mut inputs = Vec::new();
        let mut ins = Vec::new();
        let mut outs = Vec::new();
        let mut text = String::new();
        let mut start = 0u64;
        for (i, m) in members.iter().enumerate() {
            // a member's own buffers are distinct: it keeps `__restrict__`
            let f = member_fn(&mut device_fns, 'd', m, &m.sig);
            inputs.extend_from_slice(&m.inputs);
            let names: Vec<String> = (0..m.param_types.len())
                .map(|j| format!("a{i}_{j}"))
                .collect();
            for (j, (t, n)) in m.param_types.iter().zip(&names).enumerate() {
                let param = (unrestricted(t), n.clone());
                match j < m.inputs.len() {
                    true => ins.push(param),
                    false => outs.push(param),
                }
            }
            let g = u64::from(m.grid[0]);
            let _ = writeln!(
                text,
                "  if (kbid < {}) {{ {f}({}, kbid - {start}, {g}); return; }}",
                start + g,
                names.join(", ")
            );
            start += g;
        }
        let grid = u32::try_from(start).ok()?;
        ins.extend(outs);
        let mut k = finish(inputs, ins, text, grid, block);
        k.device_fns = device_fns;
        Some(k)
    }
    /// The members in order in one block (`codegen/cuda_sequential.rs`).
    fn sequential(&self, seq: &Sequence<'_, CudaKernel>) -> Option<CudaKernel> {
        super::cuda_sequential::sequential(self, seq)
    }
}

/// What `target` runs for `graph` (as the backend prepared it): the graph with its long
/// reductions split (`split_reduction.rs`; not for a symbolic graph, whose kernels serve every
/// size: the chunk count, a divisor of a size, would tie them to this one) and its planned
/// steps. `compile` builds these; `traffic.rs` counts their bytes.
pub(crate) fn plan<'g>(
    graph: &'g Graph,
    target: &Cuda,
    symbolic: bool,
) -> (std::borrow::Cow<'g, Graph>, Vec<Planned<CudaKernel>>) {
    let split = match symbolic {
        false => split_reductions(graph, ReduceSplit::for_gpu(target.sm_count)),
        true => None,
    };
    let graph = split.map_or(std::borrow::Cow::Borrowed(graph), std::borrow::Cow::Owned);
    let planned = plan_graph(target, &graph);
    (graph, planned)
}

#[cfg(test)]
pub(crate) mod tests {
    use kiln_compile::graph::Op;
    use kiln_core::prim::{BinaryOp, Prim, ReduceOp, UnaryOp};

    use super::*;
    use crate::test_graphs::{binary, expand, input, kernels, push, slice, unary};

    /// NVRTC has no C headers: every integer type the builder's C names is the prelude's (a
    /// type missing there fails its whole unit's compile, on the GPU only).
    #[test]
    fn the_prelude_defines_every_integer_type_the_generated_code_names() {
        use kiln_core::DType;
        let mut names = vec![];
        for d in DType::ALL {
            names.extend(crate::ir::lower::c_dtype(d).filter(|n| n.contains("int")));
            if let Some((s, u)) = crate::ir::lower::wrapping_c(d) {
                names.extend([s, u]);
            }
        }
        assert!(names.contains(&"uint64_t"), "{names:?}");
        for n in names {
            assert!(
                PRELUDE.contains(&format!("#define {n} ")),
                "{n} is not in the CUDA prelude"
            );
        }
    }

    /// Every kind of kernel the generator writes: a vectorized and unrolled pointwise chain,
    /// reductions by a thread, a warp and a block per output element, and in-place updates of
    /// several shapes run side by side.
    pub(crate) fn sample_graph() -> Graph {
        let mut g = Graph::default();
        let x = input(&mut g, &[64, 1 << 15]);
        let e = push(
            &mut g,
            Op::Prim(Prim::Unary(UnaryOp::Exp)),
            vec![x],
            &[64, 1 << 15],
        );
        let y = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Mul)),
            vec![e, x],
            &[64, 1 << 15],
        );
        g.outputs.push(y);
        for (dim, keep) in [(0usize, vec![1usize, 1 << 15]), (1, vec![64, 1])] {
            let r = push(
                &mut g,
                Op::Prim(Prim::Reduce {
                    op: ReduceOp::Sum,
                    dims: vec![dim],
                }),
                vec![y],
                &keep,
            );
            g.outputs.push(r);
        }
        let m = input(&mut g, &[512, 100]);
        let r = push(
            &mut g,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::Max,
                dims: vec![1],
            }),
            vec![m],
            &[512, 1],
        );
        g.outputs.push(r);
        let s = push(
            &mut g,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::Sum,
                dims: vec![0],
            }),
            vec![m],
            &[1, 100],
        );
        g.outputs.push(s);
        let small = input(&mut g, &[1000, 7]);
        let s = push(
            &mut g,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::Sum,
                dims: vec![1],
            }),
            vec![small],
            &[1000, 1],
        );
        g.outputs.push(s);
        for shape in [&[300usize, 7][..], &[10]] {
            let index = g.num_inputs;
            let p = input(&mut g, shape);
            let grad = input(&mut g, shape);
            let new = push(
                &mut g,
                Op::Prim(Prim::Binary(BinaryOp::Sub)),
                vec![p, grad],
                shape,
            );
            g.mutated_inputs.push((g.outputs.len(), index));
            g.outputs.push(new);
        }
        g
    }

    /// A digest of every planned kernel: its source and launch shape.
    fn digest(t: &Cuda, g: &Graph) -> (usize, u64) {
        let mut all = String::new();
        let mut n = 0;
        for p in plan_graph(t, g) {
            if let Planned::Kernel { kernel, .. } = p {
                n += 1;
                for (_, f) in &kernel.device_fns {
                    all.push_str(f);
                }
                let _ = write!(all, "{}{:?}{}", kernel.source, kernel.grid, kernel.block);
            }
        }
        (n, xxhash_rust::xxh3::xxh3_64(all.as_bytes()))
    }

    /// A channels-last window tap (a pad's operand read at a shifted pixel) times a per-channel
    /// vector, plus a transposed operand: the vector loop splits lane 0's index once, reads the
    /// tap and the per-channel values as four-element vectors at lane 0's index, and reads the
    /// transposed operand (its innermost variable at stride 576) a lane at a time.
    #[test]
    fn lanes_read_unit_stride_operands_as_vectors() {
        let mut g = Graph::default();
        let shape = [4usize, 12, 12, 16];
        let x = input(&mut g, &shape);
        let w = input(&mut g, &[1, 1, 1, 16]);
        let t = input(&mut g, &[16, 12, 12, 4]);
        let pads = vec![(0, 0), (1, 1), (1, 1), (0, 0)];
        let padded = push(
            &mut g,
            Op::Prim(Prim::Pad { pads, value: 0.0 }),
            vec![x],
            &[4, 14, 14, 16],
        );
        let rows = slice(&mut g, padded, 1, 2, 14);
        let tap = slice(&mut g, rows, 2, 1, 13);
        let wide = expand(&mut g, w, &shape);
        let scaled = binary(&mut g, BinaryOp::Mul, tap, wide);
        let turned = push(
            &mut g,
            Op::Prim(Prim::Permute(vec![3, 1, 2, 0])),
            vec![t],
            &shape,
        );
        let y = binary(&mut g, BinaryOp::Add, scaled, turned);
        g.outputs.push(y);
        let planned = kernels(&Cuda::new(132), &g);
        assert_eq!(planned.len(), 1);
        let src = &planned[0].0.source;
        let vector_loop = &src[..src.find("\n    e0 = ").expect("a vector loop")];
        assert!(vector_loop.contains("const int i3_l0 = rem % 16"), "{src}");
        assert!(vector_loop.contains("const int i3 = i3_l0 + k;"), "{src}");
        // the tap (x, in bounds at h + 1, w) and the per-channel vector, at lane 0's index
        assert!(
            vector_loop.contains("((const kiln_v4<float> *)b0)[("),
            "{src}"
        );
        assert!(
            vector_loop.contains("((const kiln_v4<float> *)b1)[i3_l0 / 4]"),
            "{src}"
        );
        // the transposed operand: a load per lane, stride 576 in i3
        assert!(
            vector_loop.contains("b2[") && vector_loop.contains("576*i3"),
            "{src}"
        );
        assert!(!vector_loop.contains("b0["), "{src}");
    }

    /// A channels-last tensor scaled by a per-channel `1/sqrt(var)`: the value depends on the
    /// channel alone, and where the grid-stride step keeps each thread's channels a thread
    /// computes it once, before its loop, for its four lanes, behind a run-time test of the
    /// step: 64 channels divide a block's 1024 elements; 160 do not, and the full grid of
    /// 132 × 32 blocks is trimmed to 4220, a multiple of 5, so that its step is a whole number
    /// of rows. 8212 channels (4 × 2053) would need a grid of 2053 blocks' multiples: each lane
    /// computes the value in the loop.
    #[test]
    fn per_channel_values_are_computed_once_per_thread() {
        let cases = [
            ([8usize, 32, 32, 64], Some(("(blockDim.x * 4) % 64", 512))),
            ([64, 56, 56, 160], Some(("(stride * 4) % 160", 4220))),
            ([1, 2, 64, 8212], None),
        ];
        for (shape, hoisted) in cases {
            let mut g = Graph::default();
            let c = shape[3];
            let x = input(&mut g, &shape);
            let var = input(&mut g, &[1, 1, 1, c]);
            let root = unary(&mut g, UnaryOp::Sqrt, var);
            let rstd = unary(&mut g, UnaryOp::Recip, root);
            let wide = expand(&mut g, rstd, &shape);
            let y = binary(&mut g, BinaryOp::Mul, x, wide);
            g.outputs.push(y);
            let planned = kernels(&Cuda::new(132), &g);
            assert_eq!(planned.len(), 1);
            let k = &planned[0].0;
            let src = &k.source;
            let vector_loop = &src[..src.find("\n    e0 = ").expect("a vector loop")];
            let q_loop = vector_loop.find("q = e0;").expect("a vector loop");
            let sqrt = vector_loop.find("sqrtf(").expect("the square root");
            assert_eq!(vector_loop.matches("sqrtf(").count(), 1, "{src}");
            assert_eq!(sqrt < q_loop, hoisted.is_some(), "{src}");
            assert_eq!(vector_loop.contains("_h[k]"), hoisted.is_some(), "{src}");
            if let Some((test, grid)) = hoisted {
                assert!(vector_loop.contains(test), "{src}");
                assert_eq!(k.grid[0], grid, "{shape:?}");
            }
        }
    }

    /// The default launch shape generates, byte for byte, the kernels kiln generated before
    /// launch shapes could be tuned (the digest was taken from that generator, and taken again
    /// when outer reductions got a thread per output element: the sample's column sums over
    /// [64, 32768], and when a vector loop's lanes shared lane 0's index variables and read
    /// unit-stride operands as vectors, and when outer reductions with few rows got a block
    /// per four rows: the sample's column sums over [512, 100], and when a vector loop's
    /// scalar fallback lost its unrolled copies, and when column reductions took fewer rows a
    /// block where blocks were few and combined their warps' partials by shuffles): default and
    /// reduce-overhead modes are unchanged by max-autotune.
    #[test]
    fn default_config_kernels_are_unchanged() {
        // the digest predates 32-bit index arithmetic, which every launch shape shares
        let t = Cuda {
            int_index: false,
            ..Cuda::new(132)
        };
        let d = digest(&t, &sample_graph());
        assert_eq!(d, (3, 15885927782089688521));
    }

    /// Channels-last batch norm's per-channel sum (an outer reduction over N, H, W of
    /// [64, 112, 112, 64]) is split into chunks of whole dims and a dim cut in two, and its first
    /// pass has a thread per (chunk, channel): the load is a sum of the loop variables, with no
    /// division or modulo, and consecutive threads read consecutive channels.
    #[test]
    fn outer_reductions_read_coalesced_without_index_division() {
        let mut g = Graph::default();
        let shape = [64, 112, 112, 64];
        let x = input(&mut g, &shape);
        let e = push(&mut g, Op::Prim(Prim::Unary(UnaryOp::Exp)), vec![x], &shape);
        let r = push(
            &mut g,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::Sum,
                dims: vec![0, 1, 2],
            }),
            vec![e],
            &[1, 1, 1, 64],
        );
        g.outputs.push(r);
        let split = split_reductions(&g, ReduceSplit::for_gpu(132)).expect("a split");
        let kernels: Vec<CudaKernel> = plan_graph(&Cuda::new(132), &split)
            .into_iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, .. } => Some(kernel),
                Planned::Extern { .. } => None,
            })
            .collect();
        assert_eq!(
            kernels.len(),
            2,
            "a chunked pass and a pass over the chunks"
        );
        let first = &kernels[0];
        let text: String = first
            .device_fns
            .iter()
            .map(|(_, f)| f.as_str())
            .chain([first.source.as_str()])
            .collect();
        assert!(
            // 64 x 56 chunks of 2 x 112 rows: 229376 threads, about 1700 per multiprocessor
            text.contains("row < 229376"),
            "a thread per (chunk, channel):\n{text}"
        );
        let load = text
            .lines()
            .find(|l| l.contains("= b0["))
            .expect("the load of x");
        assert!(
            !load.contains('/') && !load.contains('%'),
            "the load indexes without division: {load}"
        );
    }

    /// Index variables are 32-bit where every buffer and loop of a kernel is under 2^27
    /// elements (the kernel header's block index and the pointer alignment tests keep their
    /// 64-bit types), 64-bit from there on, and 64-bit wherever `int_index` is off.
    #[test]
    fn index_arithmetic_is_32_bit_for_small_kernels() {
        let index_types = |t: &Cuda, n: usize| -> (bool, bool) {
            let mut g = Graph::default();
            let x = input(&mut g, &[n, 4]);
            let e = push(
                &mut g,
                Op::Prim(Prim::Unary(UnaryOp::Exp)),
                vec![x],
                &[n, 4],
            );
            let r = push(
                &mut g,
                Op::Prim(Prim::Reduce {
                    op: ReduceOp::Sum,
                    dims: vec![1],
                }),
                vec![e],
                &[n, 1],
            );
            g.outputs = vec![e, r];
            let mut int = true;
            let mut long = false;
            for p in plan_graph(t, &g) {
                if let Planned::Kernel { kernel, .. } = p {
                    let body = kernel.text.replace("unsigned long long", "");
                    int &= body.contains("int e") || body.contains("int row");
                    long |= body.contains("long long");
                }
            }
            (int, long)
        };
        let t = Cuda::new(132);
        // 8000 elements: too many for one composed launch, so each kernel is its own
        assert_eq!(index_types(&t, 2000), (true, false));
        assert_eq!(index_types(&t, 1 << 25), (false, true), "2^27 elements");
        let wide = Cuda {
            int_index: false,
            ..Cuda::new(132)
        };
        assert_eq!(index_types(&wide, 2000), (false, true));
    }

    /// The candidates are valid, distinct, the default first, and each one changes the
    /// generated launches of the sample with a channels-last tensor scaled per channel (whose
    /// vector loop hoists the scale and so loops in a few waves of blocks: `lane_grid`) — a
    /// candidate that changed nothing would be timed for nothing.
    #[test]
    fn candidates_are_valid_and_each_changes_the_kernels() {
        let cs = TuneConfig::candidates();
        assert_eq!(cs[0], TuneConfig::default());
        let mut g = sample_graph();
        let shape = [64usize, 56, 56, 64];
        let x = input(&mut g, &shape);
        let var = input(&mut g, &[1, 1, 1, 64]);
        let root = unary(&mut g, UnaryOp::Sqrt, var);
        let rstd = unary(&mut g, UnaryOp::Recip, root);
        let wide = expand(&mut g, rstd, &shape);
        let y = binary(&mut g, BinaryOp::Mul, x, wide);
        g.outputs.push(y);
        let mut seen = Vec::new();
        for c in &cs {
            assert!(c.valid(), "{c:?}");
            let d = digest(
                &Cuda {
                    cfg: *c,
                    ..Cuda::new(132)
                },
                &g,
            );
            assert!(
                !seen.contains(&d),
                "{c:?} generates what another candidate does"
            );
            seen.push(d);
        }
        let bad = TuneConfig {
            row_block: 2048,
            ..TuneConfig::default()
        };
        assert!(!bad.valid());
    }
}
