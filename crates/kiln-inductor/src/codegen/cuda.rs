//! CUDA C generation: the same schedule, planning (`backend::plan_graph`) and expression builder
//! (`codegen::c::Builder`, whose C is also CUDA C) as the CPU target; only the loops differ. A
//! pointwise kernel is a grid-stride loop over the output's elements, the flat index split into
//! one index per dimension; a reduction gives each output element a thread, a warp or a block
//! by the length of what it reduces. All kernels of a graph are one translation unit, compiled
//! once by NVRTC (through kiln-core's `DeviceRuntime::load_kernels`, which caches by source).

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::Arc;

use kiln_compile::graph::{Graph, NodeId};
use kiln_compile::CompiledGraph;
use kiln_core::device::runtime_for;
use kiln_core::Result;

use crate::backend::{plan_graph, Planned, Target};
use crate::codegen::c::{
    pointwise_body, reduction_parts, ty, Builder, PointwiseBody, ReductionParts,
};
use crate::runtime::cudagraph::CudaGraphed;
use crate::runtime::exec::{CompiledCpu, Exec, Launch};
use crate::schedule::Schedule;

/// Names the builder's C uses, mapped for NVRTC (which has no C headers): fixed-width integer
/// types, the infinities, NaN tests that need no header, and the sine/cosine the CPU target
/// routes through libmvec.
const PRELUDE: &str = r#"#define int64_t long long
#define int32_t int
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
"#;

/// Threads per block of pointwise kernels and of per-thread and per-warp reductions.
const BLOCK: u32 = 256;
/// Threads per block of a reduction that gives each output element a whole block.
const ROW_BLOCK: u32 = 512;
/// Reduced lengths from which a warp (then a block) reduces each output element.
const WARP_FROM: usize = 32;
const BLOCK_FROM: usize = 4096;
/// Elements from which a pointwise kernel's threads take `UNROLL` elements per iteration.
const UNROLL_FROM: usize = 1 << 20;
const UNROLL: usize = 4;

/// One generated CUDA kernel and how to launch it.
#[derive(Clone, Debug)]
pub struct CudaKernel {
    pub name: String,
    /// The `extern "C" __global__` definition.
    pub source: String,
    /// The buffers it reads, in argument order (the outputs come after them).
    pub inputs: Vec<NodeId>,
    pub grid: [u32; 3],
    pub block: u32,
}

/// The CUDA target for a device with `sm_count` multiprocessors (grid-stride loops launch a few
/// waves of blocks, not one block per element).
pub struct Cuda {
    pub sm_count: u32,
}

impl Cuda {
    fn blocks(&self, units: usize, per_block: usize) -> u32 {
        let want = units.div_ceil(per_block).max(1);
        want.min(self.sm_count.max(1) as usize * 32) as u32
    }
}

/// `const long long i<d> = ...;` for each (dim, extent) of `vars`, splitting the flat index
/// `flat` (row-major over `vars`) through the scratch variable `rem`.
fn split_index(out: &mut String, flat: &str, vars: &[(usize, usize)], indent: &str, rem: &str) {
    let _ = writeln!(out, "{indent}long long {rem} = {flat};");
    for (k, &(v, n)) in vars.iter().enumerate().rev() {
        if k == 0 {
            let _ = writeln!(out, "{indent}const long long i{v} = {rem};");
        } else {
            let _ = writeln!(
                out,
                "{indent}const long long i{v} = {rem} % {n}; {rem} /= {n};"
            );
        }
    }
}

/// The kernel's parameter list: its input buffers, then one pointer per output.
fn signature(b: &Builder<'_>, g: &Graph, outputs: &[(NodeId, String)]) -> String {
    let mut params: Vec<String> = b
        .params
        .iter()
        .enumerate()
        .map(|(p, &id)| {
            let t = ty(g.nodes[id].dtype);
            format!("const {t} *__restrict__ b{p}")
        })
        .collect();
    for (root, name) in outputs {
        let t = ty(g.nodes[*root].dtype);
        params.push(format!("{t} *__restrict__ {name}"));
    }
    params.join(", ")
}

/// Names the kernel by the hash of its text (identical kernels of repeated blocks are one).
fn finish(b: Builder<'_>, sig: String, text: String, grid: u32, block: u32) -> CudaKernel {
    let hash = xxhash_rust::xxh3::xxh3_64(format!("{sig}{text}{block}").as_bytes());
    let name = format!("k_{hash:016x}");
    CudaKernel {
        source: format!(
            "extern \"C\" __global__ void __launch_bounds__({block}) {name}({sig}) {{\n{text}}}\n"
        ),
        name,
        inputs: b.params,
        grid: [grid, 1, 1],
        block,
    }
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
        let PointwiseBody {
            b,
            stores,
            outputs,
            ok,
        } = pointwise_body(g, sched, roots);
        let vars: Vec<(usize, usize)> = shape.iter().copied().enumerate().collect();
        // one element at flat index `e`, in a scope of its own
        let element = |indent: &str| {
            let mut t = String::new();
            split_index(&mut t, "e", &vars, indent, "rem");
            t.push_str(&b.body);
            t.push_str(&stores);
            t
        };
        let mut text = String::new();
        let _ = writeln!(
            text,
            "  const long long stride = (long long)gridDim.x * blockDim.x;\n  long long e0 = \
             (long long)blockIdx.x * blockDim.x + threadIdx.x;"
        );
        if numel >= UNROLL_FROM {
            // UNROLL elements a stride apart per iteration, in one basic block: their loads are
            // independent, so they are in flight together (a memory-bound kernel needs the bytes
            // in flight; one 4-byte load per thread at a time leaves a third of the bandwidth)
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
        let sig = signature(&b, g, &outputs);
        let grid = self.blocks(numel, BLOCK as usize);
        (finish(b, sig, text, grid, BLOCK), ok)
    }

    fn reduction(&self, g: &Graph, sched: &Schedule, root: NodeId) -> CudaKernel {
        let ReductionParts {
            b,
            value: v,
            acc_t,
            init,
            step,
            out_offset: off,
            kept,
            reduced,
        } = reduction_parts(g, sched, root);
        let node = &g.nodes[root];
        let rows: usize = kept.iter().map(|k| k.1).product();
        let red: usize = reduced.iter().map(|k| k.1).product();
        let out_t = ty(node.dtype);
        let store = format!("out[{off}] = ({out_t})acc;");
        let accumulate = format!("{}      acc = {};\n", b.body, step("acc", &v));
        let combine = step("acc", "other");
        let mut text = String::new();
        let (grid, block) = if red < WARP_FROM {
            // a thread per output element, its reduced elements in a loop nest
            let _ = writeln!(
                text,
                "  for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; \
                 row < {rows}; row += (long long)gridDim.x * blockDim.x) {{"
            );
            split_index(&mut text, "row", &kept, "    ", "rem");
            let _ = writeln!(text, "    {acc_t} acc = {init};");
            for &(v, n) in &reduced {
                let _ = writeln!(text, "    for (long long i{v} = 0; i{v} < {n}; i{v}++)");
            }
            let _ = writeln!(text, "    {{\n{accumulate}    }}\n    {store}\n  }}");
            (self.blocks(rows, BLOCK as usize), BLOCK)
        } else {
            // a warp (or a block) per output element: strided partial sums, then shuffles
            let per_block = red < BLOCK_FROM;
            let (lanes, rows_per_block, block) = if per_block {
                (32, (BLOCK / 32) as usize, BLOCK)
            } else {
                (ROW_BLOCK as usize, 1, ROW_BLOCK)
            };
            let (first_row, lane) = if per_block {
                (
                    format!("(long long)blockIdx.x * {rows_per_block} + threadIdx.x / 32"),
                    "threadIdx.x % 32",
                )
            } else {
                ("(long long)blockIdx.x".to_string(), "threadIdx.x")
            };
            if !per_block {
                let _ = writeln!(text, "  __shared__ {acc_t} partial[{}];", ROW_BLOCK / 32);
            }
            let _ = writeln!(
                text,
                "  for (long long row = {first_row}; row < {rows}; \
                 row += (long long)gridDim.x * {rows_per_block}) {{"
            );
            split_index(&mut text, "row", &kept, "    ", "rem_row");
            let _ = writeln!(text, "    {acc_t} acc = {init};");
            let _ = writeln!(
                text,
                "    for (long long r = {lane}; r < {red}; r += {lanes}) {{"
            );
            split_index(&mut text, "r", &reduced, "      ", "rem");
            let _ = writeln!(text, "{accumulate}    }}");
            let _ = writeln!(
                text,
                "    for (int s = 16; s > 0; s >>= 1) {{ {acc_t} other = \
                 __shfl_down_sync(0xffffffffu, acc, s); acc = {combine}; }}"
            );
            if per_block {
                let _ = writeln!(text, "    if ({lane} == 0) {store}");
            } else {
                let _ = writeln!(
                    text,
                    "    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = acc;\n    \
                     __syncthreads();\n    if (threadIdx.x < 32) {{\n      acc = threadIdx.x < \
                     {w} ? partial[threadIdx.x] : ({acc_t})({init});\n      for (int s = 16; s > \
                     0; s >>= 1) {{ {acc_t} other = __shfl_down_sync(0xffffffffu, acc, s); acc = \
                     {combine}; }}\n      if (threadIdx.x == 0) {store}\n    }}\n    \
                     __syncthreads();",
                    w = ROW_BLOCK / 32
                );
            }
            let _ = writeln!(text, "  }}");
            (self.blocks(rows, rows_per_block), block)
        };
        let outputs = [(root, "out".to_string())];
        let sig = signature(&b, g, &outputs);
        finish(b, sig, text, grid, block)
    }

    fn inputs<'k>(&self, k: &'k CudaKernel) -> &'k [NodeId] {
        &k.inputs
    }
}

/// Compiles a graph whose prims run on a CUDA device: its kernels in one translation unit,
/// loaded on the device; extern steps (matmul, conv, random, 16-bit floats) run through the
/// device's eager kernels. With `cuda_graphs` (reduce-overhead, max-autotune) the launches are
/// recorded once and replayed (`runtime/cudagraph.rs`).
pub fn compile(graph: &Graph, cuda_graphs: bool) -> Result<Arc<dyn CompiledGraph>> {
    let device = graph.device();
    let rt = runtime_for("compile", device)?;
    let target = Cuda {
        sm_count: rt.multiprocessors(device)?,
    };
    let planned = plan_graph(&target, graph);
    let mut source = String::from(PRELUDE);
    let mut names: Vec<String> = Vec::new();
    for p in &planned {
        if let Planned::Kernel { kernel, .. } = p {
            if !names.contains(&kernel.name) {
                source.push_str(&kernel.source);
                names.push(kernel.name.clone());
            }
        }
    }
    crate::log_output_code(&source);
    let loaded: HashMap<String, _> = if names.is_empty() {
        HashMap::new()
    } else {
        names
            .iter()
            .cloned()
            .zip(rt.load_kernels(device, &source, &names)?)
            .collect()
    };
    let steps = planned
        .into_iter()
        .map(|p| match p {
            Planned::Kernel { kernel, outs } => {
                let handle = loaded.get(&kernel.name).cloned().ok_or_else(|| {
                    kiln_core::Error::arg("kiln backend", "a generated kernel was not loaded")
                })?;
                Ok(Exec::Kernel {
                    outs,
                    f: Launch::Device {
                        kernel: handle,
                        grid: kernel.grid,
                        block: kernel.block,
                    },
                    inputs: kernel.inputs,
                    name: kernel.name.into(),
                    sizes: Vec::new(),
                })
            }
            Planned::Extern { node } => Ok(Exec::Extern { node }),
        })
        .collect::<Result<Vec<_>>>()?;
    let compiled: Arc<dyn CompiledGraph> = Arc::new(CompiledCpu::new(graph.clone(), steps));
    Ok(match cuda_graphs {
        true => Arc::new(CudaGraphed::new(compiled, graph)),
        false => compiled,
    })
}
