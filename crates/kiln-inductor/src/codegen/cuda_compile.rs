//! Compiling graphs for a CUDA device: plan a graph's steps, generate its kernels, build them as
//! translation units with NVRTC (`cuda_units.rs`) and assemble the executor. Graphs compiled
//! together (a training step's forward and backward, `compile_many`) share one pool of NVRTC
//! threads: built one after the other, each graph's compile ended in a tail where a few large
//! units ran on a few threads while the other cores waited.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kiln_compile::graph::Graph;
use kiln_compile::{symbolic, CompiledGraph};
use kiln_core::device::{runtime_for, DeviceKernel, DeviceRuntime};
use kiln_core::{profiler, Device, Result};

use super::cuda::{plan, Cuda, CudaKernel, PRELUDE};
use super::cuda_prefetch::Manifests;
use super::{cuda_literals, cuda_sizes, cuda_tune, cuda_units};
use crate::backend::Planned;
use crate::plan_cache::{self, Plan, PlanStep};
use crate::runtime::autotune::{Candidate, Tuned};
use crate::runtime::conv_warmup;
use crate::runtime::cudagraph::CudaGraphed;
use crate::runtime::exec::{CompiledCpu, Launch};
use kiln_compile::prefetch::{Manifest, Recent};

/// How a graph is compiled for CUDA (the backend reads them from the mode and options).
#[derive(Clone, Copy, Debug)]
pub struct CudaFlags {
    /// Record the launches once and replay them (reduce-overhead, max-autotune).
    pub cuda_graphs: bool,
    /// Small matmuls generated (the `inline_small_matmuls` option).
    pub inline_matmul: bool,
    /// Time launch shapes of each kernel at its first launch (both max-autotune modes).
    pub autotune: bool,
}

/// A graph planned and its kernels generated (or its plan read from the disk cache), waiting for
/// its units to be built.
struct Prepared {
    /// The graph the steps run, the steps, and the units to build (taken by `compile_graphs`).
    plan: Plan,
    /// Per step, under max-autotune: the launch shapes its kernel is timed in.
    choices: Vec<Option<Vec<CudaKernel>>>,
}

/// Compiles a graph whose prims run on a CUDA device: its kernels in a few translation units,
/// loaded on the device; extern steps (matmul, conv, random, 16-bit floats) run through the
/// device's eager kernels. One size of a symbolic graph (a size context is current) runs
/// size-generic kernels where they instantiate (`codegen/cuda_sizes.rs`). With `cuda_graphs`
/// (reduce-overhead, max-autotune) the launches are recorded once and replayed
/// (`runtime/cudagraph.rs`). `inline_matmul`: small matmuls generated (the
/// `inline_small_matmuls` option). With `autotune` (both max-autotune modes) each kernel is also
/// generated in the other launch shapes (`codegen/cuda_tune.rs`), compiled in the same units,
/// and the fastest chosen at its first launch (`runtime/autotune.rs`), unless a choice kept on
/// disk says which; not for one size of a symbolic graph, whose kernels serve every size.
/// `graph` is as the backend was handed it: the rewrites for the code generators
/// (`backend::prepare`) happen here, unless its plan comes from the disk cache (`plan_cache.rs`).
pub fn compile(graph: &Graph, flags: CudaFlags, memo: &Memo) -> Result<Arc<dyn CompiledGraph>> {
    let mut out = compile_many(&[graph], flags, memo)?;
    out.pop()
        .ok_or_else(|| kiln_core::Error::arg("kiln backend", "no graph was compiled"))
}

/// What a compile remembers of the function it compiles, for that function's next warm start
/// in another process: where its units and convolutions are listed (`cuda_prefetch.rs`, when
/// the prefetch is on) and the manifest of its plans' keys (`plan_cache::recent`).
#[derive(Default)]
pub struct Memo {
    pub(crate) prefetch: Option<Manifests>,
    pub(crate) plans: Option<Recent>,
}

/// Where a graph's plan comes from.
enum Source<'g> {
    /// Read from the disk cache.
    Cached(Plan),
    /// To plan: the graph rewritten for the code generators, and the key to store its plan under.
    Fresh(Cow<'g, Graph>, Option<u128>),
}

impl Source<'_> {
    fn graph(&self) -> &Graph {
        match self {
            Source::Cached(p) => &p.graph,
            Source::Fresh(g, _) => g,
        }
    }
}

/// `compile` for each graph (all on one device), their units built by one pool of threads.
/// Meanwhile another thread chooses the engine of the graphs' convolutions (cuDNN or kiln's
/// generated kernels, for all of them) and runs each distinct convolution once
/// (`runtime/conv_warmup.rs`: cuDNN's kernels load at a convolution's first execution), from
/// the start where the convolutions are already in their final (channels-last) form, else once
/// the graphs are rewritten.
/// `memo`: what the compiled function's next warm start will want remembered.
pub fn compile_many(
    graphs: &[&Graph],
    flags: CudaFlags,
    memo: &Memo,
) -> Result<Vec<Arc<dyn CompiledGraph>>> {
    let Some(first) = graphs.first() else {
        return Ok(Vec::new());
    };
    let device = first.device();
    let rt = runtime_for("compile", device)?;
    // the size context is the calling thread's
    let sizes = symbolic::context::current();
    let target = target(&rt, device, flags, sizes.is_none())?;
    let device_key = rt.device_key(device);
    // a symbolic graph's kernels are fitted across sizes, a tuned one's chosen when it runs
    let cache = (sizes.is_none() && !flags.autotune).then(|| format!("{target:?} {device_key:?}"));
    // the convolutions' engine, chosen on the warm-up's thread before the graphs are handed back
    let generated_convs = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        // graphs whose convolutions are already in their final form (a training step's
        // halves: AOT autograd rewrote the joint graph) start the warm-up before their plans
        // are read or made, their convolutions listed on its thread
        let early = !graphs.iter().any(|g| crate::channels_last::wanted(g));
        let mut warmup = match early {
            true => Some(spawn_warmup(
                s,
                || conv_warmup::distinct(graphs),
                flags,
                memo,
            )),
            false => None,
        };
        // a warm training step's two plans are keyed and read side by side: a key hashes its
        // graph (DenseNet-121's two: 0.8 ms one after the other on the H200's host), a read is
        // milliseconds of decoding (3-5 ms apiece) unless it was read ahead while the function
        // was traced (`plan_cache::read_ahead_recent`)
        let (keys, cached): (Vec<Option<u128>>, Vec<Option<Plan>>) =
            crate::parallel::map_threads(graphs.to_vec(), |g| {
                let key = {
                    let _span = profiler::span(profiler::Category::Compile, || {
                        "inductor: CUDA plan key".into()
                    });
                    cache.as_ref().and_then(|t| plan_cache::key(KIND, t, g))
                };
                let plan = key.and_then(|k| {
                    let _span = profiler::span(profiler::Category::Compile, || {
                        "inductor: CUDA plan read from the disk cache".into()
                    });
                    plan_cache::take_or_load(KIND, k)
                });
                (key, plan)
            })
            .into_iter()
            .unzip();
        let sources: Vec<Source<'_>> = graphs
            .iter()
            .zip(keys.iter().copied())
            .zip(cached)
            .map(|((&g, key), cached)| -> Result<Source<'_>> {
                Ok(match cached {
                    Some(plan) => Source::Cached(plan),
                    None => Source::Fresh(crate::backend::prepare_cuda(g, flags.autotune)?, key),
                })
            })
            .collect::<Result<_>>()?;
        if !early {
            let rewritten: Vec<&Graph> = sources.iter().map(Source::graph).collect();
            let convs = conv_warmup::distinct(&rewritten);
            warmup = Some(spawn_warmup(s, || convs, flags, memo));
        }
        let compiled = compile_graphs(
            &rt,
            &target,
            device_key.as_deref(),
            sources,
            flags,
            sizes,
            memo.prefetch.as_ref().map(|m| &m.units),
            &generated_convs,
        );
        // best effort: a failed warm-up leaves the first call to load what it needs
        if let Some(w) = warmup {
            let generated = w.join().unwrap_or(false);
            generated_convs.store(generated, Ordering::Relaxed);
        }
        if compiled.is_ok() {
            plan_cache::remember(memo.plans.as_ref(), keys);
        }
        compiled
    })
}

/// The warm-up (`runtime/conv_warmup.rs`) of the convolutions `list` gives, on a thread of the
/// scope `s`: listing them walks the graphs, work kept off the compile's own thread. First their
/// engine is chosen (`conv_warmup::choose`; not under max-autotune, which chooses per
/// convolution by running them): the thread's result, `true` for kiln's generated kernels. The
/// list is remembered with it for the function's next warm start (`memo`; not under
/// max-autotune), written on a thread of its own.
fn spawn_warmup<'scope>(
    s: &'scope std::thread::Scope<'scope, '_>,
    list: impl FnOnce() -> Vec<conv_warmup::Conv> + Send + 'scope,
    flags: CudaFlags,
    memo: &Memo,
) -> std::thread::ScopedJoinHandle<'scope, bool> {
    let manifest = memo.prefetch.as_ref().map(|m| m.convs.clone());
    s.spawn(move || {
        let mut convs = list();
        if convs.is_empty() {
            return false;
        }
        let generated = !flags.autotune && conv_warmup::choose(&mut convs);
        if let Some(manifest) = manifest.filter(|_| !flags.autotune) {
            let lines = conv_warmup::encode(&convs);
            super::cuda_prefetch::off_the_path(move || {
                super::cuda_prefetch::remember_convs(&manifest, lines)
            });
        }
        // after the units' prefetch: its module loads and the warm-up's would take turns
        super::cuda_prefetch::wait();
        // best effort: a failed warm-up leaves the first call to load what it needs
        let _ = conv_warmup::run(&convs, flags.autotune);
        generated
    })
}

/// The disk cache's kind for CUDA plans.
const KIND: &str = plan_cache::CUDA_KIND;

/// The CUDA target for `device` under `flags`; `fused`: not one size of a symbolic graph.
fn target(
    rt: &Arc<dyn DeviceRuntime>,
    device: Device,
    flags: CudaFlags,
    fused: bool,
) -> Result<Cuda> {
    Ok(Cuda {
        inline_matmul: flags.inline_matmul,
        horizontal: fused,
        shared_per_block: rt.shared_memory_per_block(device)?,
        int_index: fused,
        ..Cuda::new(rt.multiprocessors(device)?)
    })
}

#[allow(clippy::too_many_arguments)]
fn compile_graphs(
    rt: &Arc<dyn DeviceRuntime>,
    target: &Cuda,
    device_key: Option<&str>,
    sources: Vec<Source<'_>>,
    flags: CudaFlags,
    sizes: Option<symbolic::context::SizeContext>,
    manifest: Option<&Manifest>,
    generated_convs: &Arc<AtomicBool>,
) -> Result<Vec<Arc<dyn CompiledGraph>>> {
    let Some(first) = sources.first() else {
        return Ok(Vec::new());
    };
    let (device, count) = (first.graph().device(), sources.len());
    let ready = |src: Source<'_>| -> Result<Prepared> {
        match src {
            Source::Cached(plan) => {
                for (source, _) in &plan.units {
                    crate::log_output_code(source);
                }
                Ok(Prepared {
                    choices: vec![None; plan.steps.len()],
                    plan,
                })
            }
            Source::Fresh(graph, key) => {
                let p = prepare(target, &graph, device_key, flags, sizes.clone())?;
                if let Some(key) = key {
                    plan_cache::store(KIND, key, &p.plan);
                }
                Ok(p)
            }
        }
    };
    // planning and generating are single-threaded and the graphs independent: a training step's
    // forward and backward are prepared side by side (ResNet-18's: 35-54 ms one after the
    // other, most of a warm start); plans read from disk need no thread
    let mut prepared = match sources
        .iter()
        .filter(|s| matches!(s, Source::Fresh(..)))
        .count()
    {
        0 | 1 => sources.into_iter().map(ready).collect::<Result<Vec<_>>>()?,
        _ => crate::parallel::map_threads(sources, ready)
            .into_iter()
            .collect::<Result<Vec<_>>>()?,
    };
    // the sources are only built: moved out, not copied
    let mut all_units: Vec<(String, Vec<String>)> = prepared
        .iter_mut()
        .flat_map(|p| std::mem::take(&mut p.plan.units))
        .collect();
    // the threads take units in order: the largest first, so none is left for the end alone
    all_units.sort_by_key(|(src, _)| std::cmp::Reverse(src.len()));
    let loaded = {
        let _span = profiler::span(profiler::Category::Compile, || {
            format!(
                "inductor: build and load {} units (NVRTC) of {} graph(s)",
                all_units.len(),
                count
            )
            .into()
        });
        cuda_units::load(rt, device, &all_units)?
    };
    if let Some(manifest) = manifest {
        // off the first launch's path: the units' ids hash every source
        let (manifest, rt) = (manifest.clone(), rt.clone());
        super::cuda_prefetch::off_the_path(move || {
            super::cuda_prefetch::remember(&manifest, &rt, device, &all_units)
        });
    }
    // each graph's executor made side by side: a training step's two lie between the units'
    // load and the first launch (DenseNet-121's: 0.7-0.9 ms on the H200's host, side by side)
    let _span = profiler::span(profiler::Category::Compile, || {
        "inductor: executors made".into()
    });
    crate::parallel::map_threads(prepared, |p| {
        finish(p, &loaded, device, device_key, &flags, generated_convs)
    })
    .into_iter()
    .collect()
}

/// Plans `graph` (rewritten for the code generators) and generates its kernels as translation
/// units; `sizes`: the size context it is compiled in (`symbolic::context`).
fn prepare(
    target: &Cuda,
    graph: &Graph,
    device_key: Option<&str>,
    flags: CudaFlags,
    sizes: Option<symbolic::context::SizeContext>,
) -> Result<Prepared> {
    let _span = profiler::span(profiler::Category::Compile, || {
        "inductor: plan and generate CUDA C".into()
    });
    let (graph, planned) = plan(graph, target, sizes.is_some());
    let graph: Graph = graph.into_owned();
    let mut resolved = cuda_sizes::resolve(&graph, &planned, sizes.as_ref());
    // a large static graph's repeats at other sizes built once (not where each kernel is
    // tuned: its candidates are built as they are)
    if sizes.is_none() && !flags.autotune {
        cuda_literals::share_literals(&mut resolved, cuda_literals::share_from());
    }
    let choices = match flags.autotune && sizes.is_none() {
        true => cuda_tune::candidates(&graph, target, &planned, device_key),
        false => vec![None; planned.len()],
    };
    // the kernels to build: each step's (resolved) kernel, and the other launch shapes tried
    let mut building: Vec<cuda_sizes::Resolved> = resolved.clone();
    for cands in choices.iter().flatten() {
        // all of them: a choice read from disk leaves one, not necessarily the default
        building.extend(cands.iter().map(cuda_sizes::Resolved::of));
    }
    // units for the threads that will build them, not for every core
    let units = cuda_sizes::units(PRELUDE, &building, cuda_units::max_threads());
    for (source, _) in &units {
        crate::log_output_code(source);
    }
    let mut resolved = resolved.into_iter();
    let steps = planned
        .into_iter()
        .map(|step| match step {
            Planned::Kernel { kernel, outs } => {
                let r = resolved.next().ok_or_else(|| {
                    kiln_core::Error::arg("kiln backend", "kernel count mismatch")
                })?;
                Ok(PlanStep::Kernel {
                    outs,
                    inputs: kernel.inputs,
                    name: r.name,
                    sizes: r.sizes,
                    // the static kernel's grid, computed for this size: a size-generic kernel is
                    // a grid-stride loop like it, correct for any grid
                    launch: (kernel.grid, kernel.block, kernel.shared),
                })
            }
            Planned::Extern { node } => Ok(PlanStep::Extern { node }),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Prepared {
        plan: Plan {
            graph,
            steps,
            units,
        },
        choices,
    })
}

/// The executor of a prepared graph on `device`, its kernels taken from `loaded` (by name);
/// recorded as a CUDA graph with `flags.cuda_graphs`; with `flags.autotune` its GEMMs run tuned
/// (`Route::Tuned`: the fastest of cuBLAS's and cuBLASLt's algorithms).
fn finish(
    p: Prepared,
    loaded: &HashMap<String, Arc<dyn DeviceKernel>>,
    device: Device,
    device_key: Option<&str>,
    flags: &CudaFlags,
    generated_convs: &Arc<AtomicBool>,
) -> Result<Arc<dyn CompiledGraph>> {
    let handle = |name: &str| {
        loaded.get(name).cloned().ok_or_else(|| {
            kiln_core::Error::arg("kiln backend", "a generated kernel was not loaded")
        })
    };
    let graph = p.plan.graph;
    let steps = p
        .plan
        .steps
        .into_iter()
        .zip(p.choices)
        .map(|(step, choice)| {
            // every candidate reads the same inputs (`cuda_tune.rs` matched them)
            step.into_exec(|name, (grid, block, shared)| {
                Ok(match choice {
                    Some(cands) if cands.len() > 1 => Launch::Tuned(Arc::new(Tuned::new(
                        device,
                        &cands[0].name,
                        device_key,
                        cands
                            .iter()
                            .map(|k| {
                                Ok(Candidate {
                                    kernel: handle(&k.name)?,
                                    name: k.name.clone(),
                                    grid: k.grid,
                                    block: k.block,
                                    shared: k.shared,
                                })
                            })
                            .collect::<Result<_>>()?,
                    ))),
                    // one shape: the default, or the one a choice kept on disk names
                    Some(mut cands) if !cands.is_empty() => {
                        let k = cands.swap_remove(0);
                        Launch::Device {
                            kernel: handle(&k.name)?,
                            grid: k.grid,
                            block: k.block,
                            shared: k.shared,
                        }
                    }
                    _ => Launch::Device {
                        kernel: handle(name)?,
                        grid,
                        block,
                        shared,
                    },
                })
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let compiled = Arc::new(
        CompiledCpu::new(graph, steps)
            .with_tuned_externs(flags.autotune)
            .with_generated_convs(generated_convs.clone()),
    );
    Ok(match flags.cuda_graphs {
        true => Arc::new(CudaGraphed::new(compiled.clone(), &compiled.graph)),
        false => compiled,
    })
}
