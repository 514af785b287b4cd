//! conv2d and its two gradients (`Conv2dGradInput`, `Conv2dGradWeight`) through cuDNN.
//!
//! cuDNN is optional: it is probed at the first convolution (`probe::probe_cudnn`), and when it is
//! missing, or cannot run a configuration, the prim takes the host path (`fallback.rs`) with one
//! warning per process. A plan is made once per (kind, shapes, params, dtype, TF32, pointer
//! alignment) and cached on the device: a graph-API execution plan (`conv_graph.rs`; cheap to run),
//! or, in benchmark mode and where the graph API has none, the legacy API's descriptors and the
//! algorithm its heuristics (or timings) rank first among those allowed (`conv_legacy.rs`).
//!
//! TF32 has its own switch, as in PyTorch (`set_cudnn_allow_tf32`, on by default like
//! `torch.backends.cudnn.allow_tf32`; matmul's `set_allow_tf32` is off by default): with it off,
//! f32 convolutions are restricted to FMA kernels (`CUDNN_FMA_MATH`).

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};

use cudarc::cudnn::{result as dnn, sys as dsys};
use kiln_core::backends::{self, Switch};
use kiln_core::device::{DeviceBuffer, Route};
use kiln_core::prim::{ConvEpilogue, ConvParams, OutMeta, Prim};
use kiln_core::{DType, Device, Error, Result, Tensor};

use crate::buffer::CudaBuffer;
use crate::conv_generated::ConvEngine;
use crate::device::CudaDevice;

static GRAPH_PLANS: AtomicUsize = AtomicUsize::new(0);
static LEGACY_PLANS: AtomicUsize = AtomicUsize::new(0);
static GRAPH_REFUSAL: Mutex<Option<String>> = Mutex::new(None);
static FUSED_PLANS: AtomicUsize = AtomicUsize::new(0);

/// Plans this process made (or read back) for convolutions with a fused epilogue
/// (`Prim::Conv2dEpilogue` run as one cuDNN operation graph).
pub fn cudnn_fused_plans() -> usize {
    FUSED_PLANS.load(Ordering::Relaxed)
}

/// Convolution plans made in this process: (graph API, legacy API). Graph-API plans rebuilt from
/// the disk cache count too (`cudnn_plan_disk_hits` counts those).
pub fn cudnn_plan_counts() -> (usize, usize) {
    (
        GRAPH_PLANS.load(Ordering::Relaxed),
        LEGACY_PLANS.load(Ordering::Relaxed),
    )
}

/// Why the graph API first gave no plan (the legacy API then ran that convolution), if it did.
pub fn cudnn_graph_error() -> Option<String> {
    GRAPH_REFUSAL
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// `torch.backends.cudnn.benchmark` (off by default, as in PyTorch): choose each convolution's
/// algorithm by timing the candidates (`cudnnFind*`, the legacy API) the first time its shapes are
/// seen. Off, plans come from cuDNN's graph API and its heuristics (`conv_graph.rs`), falling back
/// to the legacy API's heuristics where the graph API has no plan.
pub fn set_cudnn_benchmark(on: bool) {
    backends::set(Switch::CudnnBenchmark, on);
}
pub fn cudnn_benchmark() -> bool {
    backends::get(Switch::CudnnBenchmark)
}

/// `torch.backends.cudnn.allow_tf32` (on by default, as in PyTorch, unlike matmul's
/// `set_allow_tf32`): f32 convolutions may round their operands to TF32 on tensor cores (about
/// 10 mantissa bits, several times the f32 rate). A test that compares convolutions with f32
/// precision turns it off.
pub fn set_cudnn_allow_tf32(on: bool) {
    backends::set(Switch::CudnnTf32, on);
}
pub fn cudnn_allow_tf32() -> bool {
    backends::get(Switch::CudnnTf32)
}

/// Plans kept per device before the cache is cleared (a model has tens of distinct convolutions).
const MAX_PLANS: usize = 4096;
/// Algorithms needing more workspace than this are passed over.
pub(crate) const MAX_WORKSPACE: usize = 1 << 30;
/// Timed runs of each candidate plan in max-autotune, after one untimed run.
const TIMED_REPS: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Forward,
    GradInput,
    GradWeight,
}

#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    pub(crate) kind: Kind,
    pub(crate) dtype: DType,
    pub(crate) x: [usize; 4],
    pub(crate) w: [usize; 4],
    pub(crate) y: [usize; 4],
    pub(crate) stride: [usize; 2],
    pub(crate) padding: [usize; 2],
    pub(crate) dilation: [usize; 2],
    pub(crate) groups: usize,
    pub(crate) tf32: bool,
    /// `torch.backends.cudnn.benchmark`: the legacy API's algorithms timed (`cudnnFind*`).
    pub(crate) benchmark: bool,
    /// max-autotune: the graph API's plan timed among heuristics' first few candidates.
    pub(crate) timed: bool,
    /// Bytes every data pointer is aligned to (a graph plan is made for an alignment).
    pub(crate) alignment: usize,
    /// NHWC operands (`ConvParams::channels_last`); `x`, `w`, `y` are in NCHW order either way.
    pub(crate) channels_last: bool,
    /// A forward convolution's pointwise epilogue (`Prim::Conv2dEpilogue`): graph plans only.
    pub(crate) epilogue: Option<ConvEpilogue>,
    /// The fresh-cache scope the plan was made in (`kiln_core::cache::scope_id`): a cold compile
    /// measured in one makes its plans anew, from disk or heuristics, as a new process would.
    pub(crate) scope: u64,
}

/// How a cached convolution runs: a graph-API execution plan (the default), or the legacy API's
/// descriptors and algorithm (benchmark mode, and where the graph API finds no plan).
enum Engine {
    Graph(crate::conv_graph::GraphPlan),
    Legacy(crate::conv_legacy::Plan),
}

impl Engine {
    fn workspace(&self) -> usize {
        match self {
            Engine::Graph(g) => g.workspace,
            Engine::Legacy(p) => p.workspace,
        }
    }
}

/// A device's cuDNN handle (bound to its stream) and plan cache.
pub(crate) struct Dnn {
    handle: dsys::cudnnHandle_t,
    plans: HashMap<PlanKey, Engine>,
    /// Epilogue convolutions cuDNN has no fused plan for: asked once, then run as the
    /// convolution and the ops without asking again (a refusal costs heuristics and failed
    /// finalizations, milliseconds).
    unfused: HashSet<PlanKey>,
    /// max-autotune's choices: whether kiln's generated kernel runs the convolution
    /// (`conv_choice.rs`).
    generated: HashMap<PlanKey, bool>,
}

// SAFETY: used only under the device's mutex; the descriptors are plain host structures
unsafe impl Send for Dnn {}

pub(crate) type DnnResult<T> = std::result::Result<T, dnn::CudnnError>;

pub(crate) fn data_type(d: DType) -> Option<dsys::cudnnDataType_t> {
    use dsys::cudnnDataType_t::*;
    Some(match d {
        DType::F32 => CUDNN_DATA_FLOAT,
        DType::F64 => CUDNN_DATA_DOUBLE,
        DType::F16 => CUDNN_DATA_HALF,
        DType::BF16 => CUDNN_DATA_BFLOAT16,
        _ => return None,
    })
}

pub(crate) fn dims(s: [usize; 4]) -> Option<[i32; 4]> {
    let mut out = [0i32; 4];
    for (o, &v) in out.iter_mut().zip(&s) {
        *o = i32::try_from(v).ok()?;
    }
    Some(out)
}

fn shape4(s: &[usize]) -> [usize; 4] {
    let mut out = [0; 4];
    out.copy_from_slice(&s[..4]);
    out
}

/// cuDNN is missing: said once per process.
fn warn_missing(why: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "kiln-cuda warning: {why}; conv2d and its gradients run through the host instead \
             (correct but slow; counted by kiln::cuda::host_fallbacks())"
        )
    });
}

/// cuDNN declined a configuration: said once per process (the first one), the rest are counted
/// by `host_fallbacks()`.
fn warn_declined(what: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "kiln-cuda warning: cuDNN has no algorithm for {what}; such convolutions run through \
             the host (counted by kiln::cuda::host_fallbacks())"
        )
    });
}

/// A convolution prim's kind, geometry, epilogue and x, w, y shapes in NCHW order (cuDNN's
/// names: x the input, w the filter, y the output of the forward convolution, whatever the
/// memory order).
type Geometry<'p> = (Kind, &'p ConvParams, Option<ConvEpilogue>, [[usize; 4]; 3]);

/// `prim`'s `Geometry`, from its operands' `shapes` and its output's; None for other prims or
/// operands of another rank.
fn geometry<'p>(prim: &'p Prim, shapes: &[&[usize]], out: &[usize]) -> Option<Geometry<'p>> {
    let (kind, p, epilogue) = match prim {
        Prim::Conv2d(p) => (Kind::Forward, p, None),
        Prim::Conv2dEpilogue { params, epilogue } => (Kind::Forward, params, Some(*epilogue)),
        Prim::Conv2dGradInput { params, .. } => (Kind::GradInput, params, None),
        Prim::Conv2dGradWeight { params, .. } => (Kind::GradWeight, params, None),
        _ => return None,
    };
    if shapes.len() < 2 || shapes[..2].iter().any(|s| s.len() != 4) {
        return None;
    }
    let nchw = |s: &[usize]| shape4(&p.nchw(s));
    let out = nchw(out);
    let xwy = match kind {
        Kind::Forward => [nchw(shapes[0]), nchw(shapes[1]), out],
        Kind::GradInput => [out, nchw(shapes[1]), nchw(shapes[0])],
        Kind::GradWeight => [nchw(shapes[1]), out, nchw(shapes[0])],
    };
    Some((kind, p, epilogue, xwy))
}

/// Whether kiln's generated kernels can run the convolution `prim` on operands of `shapes` and
/// `dtypes` (`conv_generated::eligible`; an empty one runs on neither engine).
pub(crate) fn generated_can_take(prim: &Prim, shapes: &[&[usize]], dtypes: &[DType]) -> bool {
    let Ok(meta) = prim.infer(shapes, dtypes) else {
        return false;
    };
    geometry(prim, shapes, &meta.shape).is_some_and(|(_, p, epilogue, xwy)| {
        !xwy.iter().any(|s| s.contains(&0))
            && crate::conv_generated::eligible(meta.dtype, p, xwy, epilogue.is_some())
    })
}

/// Loads the generated kernel the convolution `prim` would run on, without running it (the
/// runtime's `prepare`): `true` where `route` sends it to kiln's generated kernels (`take`;
/// max-autotune's choices are made by running), `false` where cuDNN would take it.
pub(crate) fn prepare(
    dev: &Arc<CudaDevice>,
    prim: &Prim,
    shapes: &[&[usize]],
    dtypes: &[DType],
    route: Route,
) -> Result<bool> {
    if take(route) != Take::Generated {
        return Ok(false);
    }
    let meta = prim.infer(shapes, dtypes)?;
    let Some((kind, p, epilogue, xwy)) = geometry(prim, shapes, &meta.shape) else {
        return Ok(false);
    };
    if xwy.iter().any(|s| s.contains(&0)) {
        // an empty convolution writes zeros or nothing: no kernel of its own
        return Ok(true);
    }
    if !crate::conv_generated::eligible(meta.dtype, p, xwy, epilogue.is_some()) {
        return Ok(false);
    }
    crate::conv_generated::prepare(dev, kind, p, xwy)?;
    Ok(true)
}

/// Which engine takes a convolution (where kiln's generated kernels can run it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Take {
    Cudnn,
    Generated,
    /// The faster of cuDNN's plan and kiln's kernel (`conv_choice::generated_wins`).
    Faster,
}

/// Which engine takes a convolution asked to run by `route`, under the engine `conv_engine`
/// names: a forced engine holds for every route (cuDNN's over a compiled function's choice);
/// under `Auto` eager convolutions run on cuDNN, max-autotune's on the faster, and a compiled
/// function's on kiln's kernels where it chose them.
fn take(route: Route) -> Take {
    match (crate::conv_generated::conv_engine(), route) {
        (ConvEngine::Generated, _) | (ConvEngine::Auto, Route::Generated) => Take::Generated,
        (ConvEngine::Cudnn, _) | (ConvEngine::Auto, Route::Eager) => Take::Cudnn,
        (ConvEngine::Auto, Route::Tuned) => Take::Faster,
    }
}

/// Runs a conv prim through cuDNN, or kiln's generated kernels where `route` takes them.
/// `Ok(None)`: cuDNN cannot take it here (not installed, an unsupported dtype or size, no
/// algorithm); the caller takes the host path.
pub(crate) fn run(
    dev: &Arc<CudaDevice>,
    prim: &Prim,
    inputs: &[&Tensor],
    meta: &OutMeta,
    route: Route,
) -> Result<Option<Arc<dyn DeviceBuffer>>> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
    let Some((kind, p, epilogue, [x, w, y])) = geometry(prim, &shapes, &meta.shape) else {
        return Ok(None);
    };
    let dtype = meta.dtype;
    if data_type(dtype).is_none() {
        return Ok(None);
    }
    let empty = [x, w, y].iter().any(|s| s.contains(&0));
    if empty && epilogue.is_some() {
        // the epilogue of an empty sum is not zeros: the ops compute it
        return Ok(None);
    }
    let out = dev.alloc(meta.shape.iter().product(), dtype)?;
    if empty {
        // an empty operand: the output is empty, or an empty sum (zeros)
        zero(dev, &out)?;
        return Ok(Some(Arc::new(out)));
    }
    // kiln's generated kernel: where the route sends it there, or where max-autotune times it
    // faster
    let take = take(route);
    let eligible = take != Take::Cudnn
        && crate::conv_generated::eligible(dtype, p, [x, w, y], epilogue.is_some());
    if eligible && take == Take::Generated {
        generated(dev, kind, p, [x, w, y], inputs, &out)?;
        return Ok(Some(Arc::new(out)));
    }
    let a = contiguous(dev, inputs[0])?;
    let b = contiguous(dev, inputs[1])?;
    let generated = || {
        let aligned = alignment(&[a.ptr(), b.ptr(), out.ptr]) >= 16;
        let (pa, pb) = (a.pixels(), b.pixels());
        crate::conv_generated::launch(dev, kind, p, [x, w, y], pa, pb, out.ptr, aligned)
    };
    // cuDNN from here on: probed at its first use (a process whose convolutions are all
    // generated never loads it)
    if let Err(msg) = crate::probe::probe_cudnn() {
        warn_missing(&msg);
        return Ok(None);
    }
    // an epilogue's operands: per-channel vectors, and a residual in the output's memory order
    let extra = inputs[2..]
        .iter()
        .map(|t| contiguous(dev, t))
        .collect::<Result<Vec<_>>>()?;
    let mut addresses = vec![a.ptr(), b.ptr(), out.ptr];
    addresses.extend(extra.iter().map(Operand::ptr));
    // the legacy API has no epilogue: an epilogue's plan is a graph's, timed or not
    let benchmark = cudnn_benchmark() && epilogue.is_none();
    let mut key = PlanKey {
        kind,
        dtype,
        x,
        w,
        y,
        stride: p.stride,
        padding: p.padding,
        dilation: p.dilation,
        groups: p.groups,
        tf32: cudnn_allow_tf32(),
        benchmark,
        timed: route == Route::Tuned && !benchmark,
        alignment: alignment(&addresses),
        channels_last: p.channels_last,
        epilogue,
        scope: kiln_core::cache::scope_id(),
    };
    let mut guard = dev.dnn.lock().unwrap_or_else(|e| e.into_inner());
    dev.bind()?;
    if guard.is_none() {
        *guard = Some(new_handle(dev)?);
    }
    let Some(state) = guard.as_mut() else {
        return Err(dnn_err(dev, "handle", "missing"));
    };
    // nothing can be timed while the device records a CUDA graph: a convolution max-autotune
    // did not time before (its warm-up does) takes heuristics' plan
    let recording = dev.recorder.load(Ordering::Acquire) != 0;
    if key.timed && recording && !state.plans.contains_key(&key) {
        key.timed = false;
    }
    if state.unfused.contains(&key) {
        return Ok(None);
    }
    // the graph's x, w, y (as the forward convolution names them), then the epilogue's operands
    let (pa, pb, po) = (
        a.ptr() as *mut c_void,
        b.ptr() as *mut c_void,
        out.ptr as *mut c_void,
    );
    let mut ptrs = match kind {
        Kind::Forward => vec![pa, pb, po],
        Kind::GradInput => vec![po, pb, pa],
        Kind::GradWeight => vec![pb, po, pa],
    };
    ptrs.extend(extra.iter().map(|t| t.ptr() as *mut c_void));
    let ids = crate::conv_graph::variant_ids(epilogue);
    if !state.plans.contains_key(&key) {
        let handle = state.handle;
        // a candidate's time on the call's own operands (it writes only the output), asked for
        // by a timed key only
        let mut time = |g: &crate::conv_graph::GraphPlan| -> Option<f32> {
            let ws = match g.workspace {
                0 => None,
                bytes => Some(dev.alloc(bytes, DType::U8).ok()?),
            };
            let ws_ptr = ws
                .as_ref()
                .map_or(std::ptr::null_mut(), |b| b.ptr as *mut c_void);
            let mut run = || {
                g.execute(handle, &ids, &ptrs, ws_ptr)
                    .map_err(|e| dnn_err(dev, prim.name(), e))
            };
            // once untimed: the engine's kernels load at their first launch
            run().ok()?;
            crate::event::time_cold(dev, TIMED_REPS, &mut run).ok()
        };
        let graph = match key.benchmark {
            true => None,
            false => match crate::conv_graph::make_plan(
                state.handle,
                &graph_spec(&key),
                &format!("{} {}", dev.name, dev.arch),
                &mut time,
            ) {
                Ok(Some(g)) => Some(g),
                refused => {
                    let mut first = GRAPH_REFUSAL.lock().unwrap_or_else(|e| e.into_inner());
                    if first.is_none() {
                        *first = Some(format!(
                            "{} {dtype} x {x:?} w {w:?}: {}",
                            prim.name(),
                            match refused {
                                Err(e) => format!("{e:?}"),
                                _ => "no engine config allowed and finalized".into(),
                            }
                        ));
                    }
                    None
                }
            },
        };
        let made = match graph {
            Some(g) => {
                GRAPH_PLANS.fetch_add(1, Ordering::Relaxed);
                if epilogue.is_some() {
                    FUSED_PLANS.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Some(Engine::Graph(g)))
            }
            // no fused plan: the caller runs the convolution and the epilogue's ops
            None if epilogue.is_some() => {
                if state.unfused.len() >= MAX_PLANS {
                    state.unfused.clear();
                }
                state.unfused.insert(key);
                return Ok(None);
            }
            None => {
                LEGACY_PLANS.fetch_add(1, Ordering::Relaxed);
                crate::conv_legacy::make_plan(state.handle, &key).map(|p| p.map(Engine::Legacy))
            }
        };
        match made {
            Ok(Some(plan)) => {
                if state.plans.len() >= MAX_PLANS {
                    state.plans.clear();
                    state.generated.clear();
                }
                state.plans.insert(key.clone(), plan);
            }
            Ok(None) | Err(_) => {
                warn_declined(&format!(
                    "{} {dtype} x {x:?} w {w:?} (stride {:?}, padding {:?}, dilation {:?}, \
                     groups {})",
                    prim.name(),
                    p.stride,
                    p.padding,
                    p.dilation,
                    p.groups
                ));
                return Ok(None);
            }
        }
    }
    let handle = state.handle;
    let execute = |plan: &Engine| -> Result<()> {
        let ws = match plan.workspace() {
            0 => None,
            bytes => Some(dev.alloc(bytes, DType::U8)?),
        };
        let ws_ptr = ws
            .as_ref()
            .map_or(std::ptr::null_mut(), |b| b.ptr as *mut c_void);
        let status = match plan {
            Engine::Graph(g) => g.execute(handle, &ids, &ptrs, ws_ptr),
            Engine::Legacy(plan) => {
                crate::conv_legacy::execute(handle, plan, dtype, [pa, pb, po], ws_ptr)
            }
        };
        status.map_err(|e| dnn_err(dev, prim.name(), e))
    };
    if eligible && key.timed {
        // max-autotune: cuDNN's plan or kiln's kernel, whichever ran faster (decided once, not
        // while a CUDA graph records)
        let chosen = match state.generated.get(&key) {
            Some(&g) => Some(g),
            None if recording => None,
            None => {
                let Some(plan) = state.plans.get(&key) else {
                    return Err(dnn_err(dev, "plan", "missing"));
                };
                let spec = format!("{:?}", graph_spec(&key));
                let g = crate::conv_choice::generated_wins(
                    dev,
                    &spec,
                    &mut || execute(plan),
                    &mut || generated(),
                )?;
                state.generated.insert(key.clone(), g);
                Some(g)
            }
        };
        if chosen == Some(true) {
            drop(guard);
            generated()?;
            return Ok(Some(Arc::new(out)));
        }
    }
    let Some(plan) = state.plans.get(&key) else {
        return Err(dnn_err(dev, "plan", "missing"));
    };
    execute(plan)?;
    Ok(Some(Arc::new(out)))
}

/// The largest power of two up to 16 that divides every address.
fn alignment(ptrs: &[u64]) -> usize {
    let mut a = 16u64;
    while a > 1 && ptrs.iter().any(|p| p % a != 0) {
        a /= 2;
    }
    a as usize
}

/// A plan key as the graph API takes it.
fn graph_spec(key: &PlanKey) -> crate::conv_graph::Spec {
    use crate::conv_graph::Direction;
    let i = |s: [usize; 4]| s.map(|v| v as i64);
    let two = |s: [usize; 2]| s.map(|v| v as i64);
    crate::conv_graph::Spec {
        direction: match key.kind {
            Kind::Forward => Direction::Forward,
            Kind::GradInput => Direction::GradInput,
            Kind::GradWeight => Direction::GradWeight,
        },
        data: data_type(key.dtype).unwrap_or(dsys::cudnnDataType_t::CUDNN_DATA_FLOAT),
        compute: if key.dtype == DType::F64 {
            dsys::cudnnDataType_t::CUDNN_DATA_DOUBLE
        } else {
            dsys::cudnnDataType_t::CUDNN_DATA_FLOAT
        },
        x: i(key.x),
        w: i(key.w),
        y: i(key.y),
        stride: two(key.stride),
        padding: two(key.padding),
        dilation: two(key.dilation),
        alignment: key.alignment as i64,
        strict_f32: key.dtype == DType::F32 && !key.tf32,
        channels_last: key.channels_last,
        max_workspace: MAX_WORKSPACE,
        epilogue: key.epilogue,
        timed: key.timed,
    }
}

/// An operand packed in its own order (NCHW, or NHWC when channels-last): its own memory when it
/// is one, else a copy; or, for the generated kernels, a channel slice of a wider channels-last
/// tensor in place (`conv_generated::Pixels`).
enum Operand<'a> {
    Borrowed(&'a CudaBuffer, usize),
    Copied(CudaBuffer),
    /// The buffer, the slice's offset and its pixels' stride in elements.
    Slice(&'a CudaBuffer, usize, usize),
}

impl Operand<'_> {
    fn ptr(&self) -> u64 {
        match self {
            Operand::Borrowed(b, offset) | Operand::Slice(b, offset, _) => b.at(*offset),
            Operand::Copied(b) => b.ptr,
        }
    }

    fn pixels(&self) -> crate::conv_generated::Pixels {
        crate::conv_generated::Pixels {
            ptr: self.ptr(),
            slice_row: match self {
                Operand::Slice(_, _, row) => Some(*row),
                _ => None,
            },
        }
    }
}

/// Runs a convolution on kiln's generated kernels (`conv_generated.rs`; `xwy` its shapes in
/// NCHW order) into `out`: an operand the kernel walks pixel by pixel is read in place when it
/// is a channel slice of a wider channels-last tensor, the rest packed.
fn generated(
    dev: &Arc<CudaDevice>,
    kind: Kind,
    p: &ConvParams,
    xwy: [[usize; 4]; 3],
    inputs: &[&Tensor],
    out: &CudaBuffer,
) -> Result<()> {
    let in_place = crate::conv_generated::in_place(dev, kind, p, xwy);
    let mut ops = Vec::with_capacity(2);
    for (t, slice_ok) in inputs[..2].iter().zip(in_place) {
        ops.push(match slice_ok {
            true => channel_slice(dev, t)?,
            false => contiguous(dev, t)?,
        });
    }
    let mut aligned = alignment(&[ops[0].ptr(), ops[1].ptr(), out.ptr]) >= 16;
    if !aligned && ops.iter().any(|o| matches!(o, Operand::Slice(..))) {
        // `in_place` holds for aligned operands only: an unaligned one packs them all
        ops = vec![contiguous(dev, inputs[0])?, contiguous(dev, inputs[1])?];
        aligned = alignment(&[ops[0].ptr(), ops[1].ptr(), out.ptr]) >= 16;
    }
    let (a, b) = (ops[0].pixels(), ops[1].pixels());
    crate::conv_generated::launch(dev, kind, p, xwy, a, b, out.ptr, aligned)
}

/// `t` in place when it is a channel slice of a wider channels-last tensor: rank 4 in NHWC
/// order, its channels adjacent and its pixels evenly `row` elements apart, `row` a multiple of
/// 4 and its start 16-byte aligned (the tensor maps' rules); else as `contiguous` gives it.
fn channel_slice<'a>(dev: &Arc<CudaDevice>, t: &'a Tensor) -> Result<Operand<'a>> {
    let (buf, layout) = crate::runtime::operand("conv2d", t)?;
    if layout.is_contiguous() {
        return Ok(Operand::Borrowed(buf, layout.offset));
    }
    let (shape, strides) = (&layout.shape, &layout.strides);
    if shape.len() != 4 || shape[3] < 2 || strides[3] != 1 {
        return contiguous(dev, t);
    }
    // the pixels' stride: the innermost pixel dim's of more than one element (pixel p of the
    // walk lies p * row elements in; a dim of one element may have any stride)
    let Some(row) = (0..3).rev().find(|&d| shape[d] > 1).map(|d| strides[d]) else {
        return contiguous(dev, t);
    };
    let evenly = (0..3)
        .all(|d| shape[d] == 1 || strides[d] == row * shape[d + 1..3].iter().product::<usize>());
    if evenly && row >= shape[3] && row % 4 == 0 && buf.at(layout.offset) % 16 == 0 {
        return Ok(Operand::Slice(buf, layout.offset, row));
    }
    contiguous(dev, t)
}

fn contiguous<'a>(dev: &Arc<CudaDevice>, t: &'a Tensor) -> Result<Operand<'a>> {
    let (buf, layout) = crate::runtime::operand("conv2d", t)?;
    if layout.is_contiguous() {
        Ok(Operand::Borrowed(buf, layout.offset))
    } else {
        Ok(Operand::Copied(crate::kernels::elementwise::copy_strided(
            dev, buf, layout,
        )?))
    }
}

fn zero(dev: &Arc<CudaDevice>, out: &CudaBuffer) -> Result<()> {
    let bytes = out.len * out.dtype.size_in_bytes();
    if bytes == 0 {
        return Ok(());
    }
    dev.bind()?;
    // SAFETY: `out` holds `bytes` bytes; queued on the device's stream
    unsafe { cudarc::driver::result::memset_d8_async(out.ptr, 0, bytes, dev.stream) }
        .map_err(|e| dnn_err(dev, "conv2d", e))
}

fn dnn_err(dev: &CudaDevice, what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device {
        op: "conv2d",
        lhs: Device::Cuda(dev.ordinal),
        rhs: Device::Cuda(dev.ordinal),
        msg: format!("cuDNN {what} failed: {e:?}"),
    }
}

fn new_handle(dev: &CudaDevice) -> Result<Dnn> {
    let handle = dnn::create_handle().map_err(|e| dnn_err(dev, "create", e))?;
    // SAFETY: a live handle; the stream lives for the process
    unsafe { dnn::set_stream(handle, dev.stream as dsys::cudaStream_t) }
        .map_err(|e| dnn_err(dev, "set stream", e))?;
    Ok(Dnn {
        handle,
        plans: HashMap::new(),
        unfused: HashSet::new(),
        generated: HashMap::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv_generated::{conv_engine, set_conv_engine, set_generated_conv};

    /// Which engine takes each route's convolutions under each engine setting: a forced engine
    /// holds for every route (cuDNN's over a compiled function's choice), `Auto` takes kiln's
    /// kernels only where a compiled function chose them; `set_generated_conv(false)` is `Auto`.
    #[test]
    fn each_engine_routes_convolutions() {
        let routes = [Route::Eager, Route::Tuned, Route::Generated];
        for (engine, takes) in [
            (
                ConvEngine::Auto,
                [Take::Cudnn, Take::Faster, Take::Generated],
            ),
            (ConvEngine::Cudnn, [Take::Cudnn; 3]),
            (ConvEngine::Generated, [Take::Generated; 3]),
        ] {
            set_conv_engine(engine);
            assert_eq!(conv_engine(), engine);
            assert_eq!(routes.map(take), takes, "{engine:?}");
        }
        set_generated_conv(true);
        assert_eq!(conv_engine(), ConvEngine::Generated);
        set_generated_conv(false);
        assert_eq!(conv_engine(), ConvEngine::Auto);
    }

    /// What a compiled function's choice counts (`generated_can_take`): channels-last f32
    /// convolutions with TF32 allowed (the default), forward and both gradients; not f64, not an
    /// empty one, not NCHW.
    #[test]
    fn generated_kernels_take_channels_last_f32_convolutions() {
        let p = |channels_last| ConvParams {
            stride: [1, 1],
            padding: [1, 1],
            dilation: [1, 1],
            groups: 1,
            channels_last,
        };
        // channels-last operands in NHWC order: x [2, 8, 8, 16], w [32, 3, 3, 16]
        let (x, w, y): (&[usize], &[usize], &[usize]) =
            (&[2, 8, 8, 16], &[32, 3, 3, 16], &[2, 8, 8, 32]);
        let f32s = [DType::F32; 2];
        let forward = Prim::Conv2d(p(true));
        let data = Prim::Conv2dGradInput {
            params: p(true),
            input_shape: [2, 8, 8, 16],
        };
        let weight = Prim::Conv2dGradWeight {
            params: p(true),
            weight_shape: [32, 3, 3, 16],
        };
        assert!(generated_can_take(&forward, &[x, w], &f32s));
        assert!(generated_can_take(&data, &[y, w], &f32s));
        assert!(generated_can_take(&weight, &[y, x], &f32s));
        assert!(!generated_can_take(&forward, &[x, w], &[DType::F64; 2]));
        assert!(!generated_can_take(&forward, &[&[0, 8, 8, 16], w], &f32s));
        let nchw: (&[usize], &[usize]) = (&[2, 16, 8, 8], &[32, 16, 3, 3]);
        assert!(!generated_can_take(
            &Prim::Conv2d(p(false)),
            &[nchw.0, nchw.1],
            &f32s
        ));
    }
}
