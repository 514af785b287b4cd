//! Running a compiled graph: each step either calls a generated kernel on raw buffer addresses or
//! applies a prim through the core's kernels; values are dropped after their last use, so the
//! pooled buffer behind an intermediate is free for a later kernel (see `plan.rs`, `pool.rs`).

use std::cell::OnceCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kiln_compile::graph::{rand_at, Graph, NodeId, Op};
use kiln_compile::CompiledGraph;
use kiln_core::device::{runtime_for, DeviceKernel, Route};
use kiln_core::dispatch::apply_on;
use kiln_core::ops::default_draw;
use kiln_core::prim::Prim;
use kiln_core::profiler;
use kiln_core::shape::Layout;
use kiln_core::{no_grad, DType, Device, Error, Result, Tensor};

use super::cc::KernelFn;
use super::plan::Alloc;
use super::pool::{self, BufferPool, CallBuffers};

/// How a generated kernel is called.
pub enum Launch {
    /// A C function of the CPU translation unit: `f(args)`, the buffer addresses in order.
    Cpu(KernelFn),
    /// A kernel loaded on the graph's device: launched with `grid` blocks of `block` threads, the
    /// buffers' device addresses as its arguments (then a size-generic kernel's sizes).
    Device {
        kernel: Arc<dyn DeviceKernel>,
        grid: [u32; 3],
        block: u32,
        /// Bytes of dynamic shared memory per block.
        shared: u32,
    },
    /// A device kernel with several launch shapes, the fastest chosen at its first launch
    /// (max-autotune: `autotune.rs`).
    Tuned(Arc<super::autotune::Tuned>),
}

pub enum Exec {
    /// A generated kernel writing one value, or several of one shape in one loop (`outs`, in the
    /// kernel's output order, each with where it is written).
    Kernel {
        outs: Vec<(NodeId, Alloc)>,
        f: Launch,
        inputs: Vec<NodeId>,
        /// The kernel's C name (the hash of its source), for the profiler.
        name: Arc<str>,
        /// A size-generic kernel's size arguments (`codegen/template.rs`), passed after the
        /// buffers; empty for a kernel generated for one size.
        sizes: Vec<i64>,
    },
    Extern {
        node: NodeId,
    },
}

/// A compiled graph on the CPU or on a device (the steps' launches say which).
pub struct CompiledCpu {
    pub graph: Graph,
    device: Device,
    pub steps: Vec<Exec>,
    /// For each step, the values no later step reads.
    pub free_after: Vec<Vec<NodeId>>,
    pool: BufferPool,
    /// Whether extern matmuls and convolutions run tuned (`Route::Tuned`: max-autotune's, the
    /// fastest algorithm) rather than as eager execution runs them.
    tuned: bool,
    /// Whether convolutions run on the runtime's generated kernels (`Route::Generated`): the
    /// compiled function's choice (`DeviceRuntime::generated_convs`), shared by the graphs
    /// compiled together and set once their compile has made it.
    generated_convs: Arc<AtomicBool>,
}

impl CompiledCpu {
    pub fn new(graph: Graph, steps: Vec<Exec>) -> Self {
        let mut last = vec![usize::MAX; graph.nodes.len()];
        for (s, step) in steps.iter().enumerate() {
            let reads: Vec<NodeId> = match step {
                // an in-place input is read through the output: it lives until this step
                Exec::Kernel { inputs, outs, .. } => inputs
                    .iter()
                    .copied()
                    .chain(outs.iter().filter_map(|(_, a)| match a {
                        Alloc::InPlace(input) => Some(*input),
                        _ => None,
                    }))
                    .collect(),
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
            device: graph.device(),
            graph,
            steps,
            free_after,
            pool: BufferPool::default(),
            tuned: false,
            generated_convs: Arc::default(),
        }
    }

    /// The graph with its extern matmuls and convolutions run tuned (`Route::Tuned`) when `on`.
    pub fn with_tuned_externs(mut self, on: bool) -> Self {
        self.tuned = on;
        self
    }

    /// The graph with its convolutions on the runtime's generated kernels when `on` holds
    /// (read at each call; see the field).
    pub fn with_generated_convs(mut self, on: Arc<AtomicBool>) -> Self {
        self.generated_convs = on;
        self
    }

    /// How extern step `p` runs: tuned, on generated kernels, or as eager execution runs it.
    fn route(&self, p: &Prim) -> Route {
        if self.tuned && tunable(p) {
            Route::Tuned
        } else if p.conv_params().is_some() && self.generated_convs.load(Ordering::Relaxed) {
            Route::Generated
        } else {
            Route::Eager
        }
    }

    /// The buffer kernel step `node` writes.
    fn output_buffer(
        &self,
        node: NodeId,
        alloc: Alloc,
        vals: &[Option<Tensor>],
        inputs: &[Tensor],
        spans: &OnceCell<InputSpans>,
        bufs: &mut CallBuffers<'_>,
    ) -> Result<Tensor> {
        let n = &self.graph.nodes[node];
        match alloc {
            Alloc::Output => pool::fresh(&n.shape, n.dtype, self.device),
            Alloc::Pooled => bufs.get(&n.shape, n.dtype, self.device),
            Alloc::InPlace(input) => {
                let t = vals[input].clone().ok_or_else(|| {
                    Error::arg("kiln backend", format!("in-place input %{input} missing"))
                })?;
                let bytes = pool::nbytes(&n.shape, n.dtype);
                let Op::Input(index) = self.graph.nodes[input].op else {
                    return Err(Error::arg(
                        "kiln backend",
                        format!("in-place destination %{input} is not a graph input"),
                    ));
                };
                let spans = spans.get_or_init(|| InputSpans::new(inputs));
                if writable_in_place(index, n.shape.as_slice(), n.dtype, inputs, spans) {
                    pool::count(|s| s.inplace_bytes += bytes);
                    return Ok(t);
                }
                // the kernel reads the old values through its output: start from a copy of them
                pool::count(|s| s.inplace_fallbacks += 1);
                let out = pool::fresh(&n.shape, n.dtype, self.device)?;
                out.assign(&t)?;
                Ok(out)
            }
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
        pool::count(|s| s.calls += 1);
        // declared before the values: dropped after them, so it sees which buffers escaped
        let mut bufs = self.pool.take();
        // the inputs' memory, for in-place writes: measured once per call, at the first
        let spans = OnceCell::new();
        let mut vals: Vec<Option<Tensor>> = vec![None; g.nodes.len()];
        for (id, n) in g.nodes.iter().enumerate() {
            if let Op::Input(i) = n.op {
                let t = &inputs[i];
                // a CPU scalar a device graph reads (PyTorch's CPU-scalar rule) is copied over
                vals[id] = Some(if t.device() != self.device {
                    t.to_device(self.device)?
                } else {
                    t.clone()
                });
            }
        }
        let get = |vals: &[Option<Tensor>], id: NodeId| {
            vals[id]
                .clone()
                .ok_or_else(|| Error::arg("kiln backend", format!("value %{id} missing")))
        };
        for (s, step) in self.steps.iter().enumerate() {
            match step {
                Exec::Kernel {
                    outs,
                    f,
                    inputs: reads,
                    name,
                    sizes,
                } => {
                    let mut args_t = Vec::with_capacity(reads.len());
                    for &i in reads {
                        let mut t = get(&vals, i)?;
                        if !t.is_contiguous() {
                            // kernels read dense buffers: a strided value (an argument that is
                            // a view, a view an extern returned) is copied once per call, and
                            // the copy serves every later kernel that reads it
                            t = t.contiguous()?;
                            vals[i] = Some(t.clone());
                        }
                        args_t.push(t);
                    }
                    let mut out_t = Vec::with_capacity(outs.len());
                    for &(node, alloc) in outs {
                        out_t.push(
                            self.output_buffer(node, alloc, &vals, inputs, &spans, &mut bufs)?,
                        );
                    }
                    if out_t.iter().all(|t| t.numel() > 0) {
                        let _span =
                            profiler::span_on(profiler::Category::Kernel, self.device, || {
                                name.to_string().into()
                            });
                        call(f, &args_t, &out_t, sizes)?;
                        pool::count(|s| s.kernel_launches += 1);
                    }
                    for (&(node, _), t) in outs.iter().zip(out_t) {
                        vals[node] = Some(t);
                    }
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
                    // a device graph computes everything on its device (see `Graph::device`)
                    vals[*node] = Some(match self.route(&p) {
                        Route::Eager => apply_on(p, &refs, self.device)?,
                        route => execute_routed(&p, &refs, self.device, route)?,
                    });
                }
            }
            for &id in &self.free_after[s] {
                vals[id] = None;
            }
        }
        g.outputs
            .iter()
            .map(|&o| {
                let t = get(&vals, o)?;
                // a CPU value of a device graph, computed on the device, is handed back on the CPU
                match g.nodes[o].device {
                    d if d != t.device() => t.to_device(d),
                    _ => Ok(t),
                }
            })
            .collect()
    }
}

/// Whether max-autotune runs `p` tuned: GEMMs and convolutions, whose runtime chooses among
/// implementations by time.
fn tunable(p: &Prim) -> bool {
    matches!(
        p,
        Prim::Matmul | Prim::MatmulEpilogue(_) | Prim::Conv2dEpilogue { .. }
    ) || p.conv_params().is_some()
}

/// `p` on `device` as its runtime runs it by `route` (`DeviceRuntime::execute_routed`). A
/// compiled graph's step: no autograd, no interceptor, every operand already on the device.
pub(crate) fn execute_routed(
    p: &Prim,
    inputs: &[&Tensor],
    device: Device,
    route: Route,
) -> Result<Tensor> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
    let dtypes: Vec<DType> = inputs.iter().map(|t| t.dtype()).collect();
    let meta = p.infer(&shapes, &dtypes)?;
    let buf = runtime_for(p.name(), device)?.execute_routed(device, p, inputs, &meta, route)?;
    Ok(Tensor::from_device_buffer(
        buf,
        Layout::contiguous(&meta.shape),
    ))
}

/// Runs one kernel on its input and output buffers.
/// `sizes`: a size-generic kernel's symbol values, passed after the buffers (empty otherwise): a
/// C kernel reads them from an array, a device kernel takes them as parameters.
fn call(f: &Launch, args_t: &[Tensor], out_t: &[Tensor], sizes: &[i64]) -> Result<()> {
    match f {
        Launch::Cpu(f) => {
            // SAFETY: every buffer is alive (held in `args_t`/`out_t`) and contiguous with the
            // shape and dtype the kernel was generated for. Each output is a buffer no live value
            // reads (new, a pooled buffer with no other handle, or a mutated input that
            // `writable_in_place` found overlapping no other input and that the plan found no
            // later step reading).
            let mut args: Vec<*mut c_void> = args_t
                .iter()
                .chain(out_t)
                .map(|t| unsafe { t.data_ptr() } as *mut c_void)
                .collect();
            if !sizes.is_empty() {
                args.push(sizes.as_ptr() as *mut c_void);
            }
            unsafe { f(args.as_ptr()) };
            Ok(())
        }
        Launch::Device {
            kernel,
            grid,
            block,
            shared,
        } => {
            // the same conditions as above, on the device; buffers dropped after the launch are
            // reused only by work queued after it (one stream per device)
            let mut params = device_addresses(args_t, out_t)?;
            // a size-generic kernel's sizes are `long long` parameters after the buffers
            params.extend(sizes.iter().map(|&s| s as u64));
            kernel.launch(*grid, *block, *shared, &params)
        }
        Launch::Tuned(t) => {
            // tuned kernels are never size-generic (`codegen/cuda.rs`: no tuning under a size
            // context)
            let params = device_addresses(args_t, out_t)?;
            t.launch(&params, &params[..args_t.len()], out_t)
        }
    }
}

/// The device addresses of a kernel's inputs, then its outputs: its arguments.
fn device_addresses(args_t: &[Tensor], out_t: &[Tensor]) -> Result<Vec<u64>> {
    args_t
        .iter()
        .chain(out_t)
        .map(|t| {
            t.device_address().ok_or_else(|| {
                Error::arg(
                    "kiln backend",
                    format!("a kernel operand on {} has no device buffer", t.device()),
                )
            })
        })
        .collect()
}

/// Whether a kernel may overwrite graph input `index` element by element: contiguous, of the
/// kernel's shape and dtype, and sharing no memory with any other graph input — not even by being
/// the same tensor fed to a second input (guards pin which arguments are the same tensor, not
/// whether two views overlap, nor whether an argument is a tensor the graph also captured).
fn writable_in_place(
    index: usize,
    shape: &[usize],
    dtype: kiln_core::DType,
    inputs: &[Tensor],
    spans: &InputSpans,
) -> bool {
    let Some(t) = inputs.get(index) else {
        return false;
    };
    if !t.is_contiguous() || t.shape() != shape || t.dtype() != dtype || t.is_deferred() {
        return false;
    }
    let (lo, hi) = span(t);
    !spans.overlaps_other(index, lo, hi)
}

/// The byte ranges of a call's inputs, sorted by start, with the largest end over each prefix
/// (and the input it belongs to, and the largest end of any other input): whether a range
/// overlaps another input's is one binary search. A compiled optimizer step writes every
/// parameter and moment in place, thousands of them; checking each against every input was
/// quadratic (38 ms of host time per step for DenseNet-121's 364 parameters).
pub(super) struct InputSpans {
    /// (start, end, input index), empty ranges left out.
    sorted: Vec<(usize, usize, usize)>,
    /// Per prefix of `sorted`: (largest end, its input, largest end of another input).
    prefix: Vec<(usize, usize, usize)>,
}

impl InputSpans {
    pub(super) fn new(inputs: &[Tensor]) -> InputSpans {
        InputSpans::of_ranges(inputs.iter().enumerate().map(|(i, t)| {
            let (lo, hi) = span(t);
            (lo, hi, i)
        }))
    }

    /// From (start, end, input index) ranges.
    fn of_ranges(ranges: impl Iterator<Item = (usize, usize, usize)>) -> InputSpans {
        let mut sorted: Vec<(usize, usize, usize)> =
            ranges.filter(|&(lo, hi, _)| lo < hi).collect();
        sorted.sort_unstable();
        let mut prefix = Vec::with_capacity(sorted.len());
        let (mut best, mut best_at, mut second) = (0usize, usize::MAX, 0usize);
        for &(_, hi, i) in &sorted {
            if hi > best {
                if best_at != i {
                    second = best;
                }
                (best, best_at) = (hi, i);
            } else if i != best_at && hi > second {
                second = hi;
            }
            prefix.push((best, best_at, second));
        }
        InputSpans { sorted, prefix }
    }

    /// Whether `lo..hi` overlaps the range of an input other than `index`: some input starting
    /// before `hi` ends after `lo`.
    fn overlaps_other(&self, index: usize, lo: usize, hi: usize) -> bool {
        let before = self.sorted.partition_point(|&(start, _, _)| start < hi);
        let Some(&(best, best_at, second)) = before.checked_sub(1).and_then(|k| self.prefix.get(k))
        else {
            return false;
        };
        let end = if best_at == index { second } else { best };
        end > lo
    }
}

/// The byte range a tensor's elements occupy (empty when it has none).
fn span(t: &Tensor) -> (usize, usize) {
    if t.numel() == 0 {
        return (0, 0);
    }
    let last: usize = t
        .shape()
        .iter()
        .zip(t.strides())
        .map(|(&n, &s)| (n - 1) * s)
        .sum();
    // SAFETY: only the address is used, to compare ranges; nothing is read through it
    let start = match t.device_address() {
        Some(a) => a as usize,
        None => (unsafe { t.data_ptr() }) as usize,
    };
    (start, start + (last + 1) * t.dtype().size_in_bytes())
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

#[cfg(test)]
mod tests {
    use super::InputSpans;

    /// The sorted sweep answers as checking every other input would, on ranges that nest, touch,
    /// repeat and are empty.
    #[test]
    fn input_spans_find_the_same_overlaps_as_a_scan() {
        let mut state = 12345u64;
        let mut next = |n: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % n) as usize
        };
        for _ in 0..200 {
            let count = 1 + next(12);
            let ranges: Vec<(usize, usize, usize)> = (0..count)
                .map(|i| {
                    let lo = next(40);
                    (lo, lo + next(10), i)
                })
                .collect();
            let spans = InputSpans::of_ranges(ranges.iter().copied());
            for &(lo, hi, i) in &ranges {
                if lo >= hi {
                    continue;
                }
                let scan = ranges
                    .iter()
                    .any(|&(a, b, j)| j != i && a < b && b > lo && a < hi);
                assert_eq!(spans.overlaps_other(i, lo, hi), scan, "{ranges:?} at {i}");
            }
        }
    }
}
