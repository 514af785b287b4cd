//! Convolution plans through cuDNN's graph (backend) API: an operation graph of one convolution,
//! engine configs ranked by cuDNN's heuristics, and the first that finalizes into an execution plan
//! (and keeps f32 off tensor cores unless TF32 is allowed) kept per shape. Running a finalized
//! plan costs a few microseconds of host time. cuDNN 9's legacy entry points
//! (`cudnnConvolutionForward` and the gradients) took about 100 µs of host time per call on the
//! H100 machine with the device idle, which made an eager ResNet-18 host-bound (BENCHMARKS.md).

use std::ffi::c_void;

use cudarc::cudnn::{result::CudnnError, sys as dsys};
use kiln_core::prim::{Activation, ConvEpilogue};
use kiln_core::profiler::{self, Category};

use crate::conv_plan_cache;
use dsys::cudnnBackendAttributeName_t as A;
use dsys::cudnnBackendAttributeType_t as T;
use dsys::cudnnBackendDescriptorType_t as D;

type DnnResult<X> = std::result::Result<X, CudnnError>;

/// Which convolution the graph computes; the tensors are named as for the forward one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    Forward,
    GradInput,
    GradWeight,
}

/// The unique ids of x, w and y in every graph (the variant pack's order), then of an epilogue's
/// scale, shift and residual (those it has, in that order).
const IDS: [i64; 3] = [1, 2, 3];
const EPILOGUE_IDS: [i64; 3] = [4, 5, 6];
/// The first id of the virtual tensors between an epilogue's operations.
const VIRTUAL_ID: i64 = 100;

/// A backend descriptor, destroyed on drop.
pub(crate) struct Desc(dsys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor, destroyed once
        let _ = unsafe { dsys::cudnnBackendDestroyDescriptor(self.0) };
    }
}

impl Desc {
    pub(crate) fn new(kind: D) -> DnnResult<Desc> {
        let mut d: dsys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `d` receives a new descriptor
        unsafe { dsys::cudnnBackendCreateDescriptor(kind, &mut d) }.result()?;
        Ok(Desc(d))
    }
    /// Reads up to `out.len()` elements of attribute `name` into `out` (none: a count query);
    /// how many the attribute holds. The caller pairs `V` with the C type `ty` names, as `set`.
    pub(crate) fn get<V>(&self, name: A, ty: T, out: &mut [V]) -> DnnResult<usize> {
        let mut count = 0i64;
        let ptr = match out.is_empty() {
            true => std::ptr::null_mut(),
            false => out.as_mut_ptr().cast::<c_void>(),
        };
        // SAFETY: `out` has room for `out.len()` elements of the type `ty` names
        unsafe {
            dsys::cudnnBackendGetAttribute(self.0, name, ty, out.len() as i64, &mut count, ptr)
        }
        .result()?;
        Ok(count.max(0) as usize)
    }
    pub(crate) fn set<V>(&self, name: A, ty: T, values: &[V]) -> DnnResult<()> {
        // SAFETY: `values` holds `len` elements of the C type `ty` names (the callers pair them)
        unsafe {
            dsys::cudnnBackendSetAttribute(
                self.0,
                name,
                ty,
                values.len() as i64,
                values.as_ptr().cast(),
            )
        }
        .result()
    }
    pub(crate) fn finalize(self) -> DnnResult<Desc> {
        // SAFETY: a live descriptor
        unsafe { dsys::cudnnBackendFinalize(self.0) }.result()?;
        Ok(self)
    }
}

/// A finalized plan and the descriptors it was made from (kept alive with it: its engine
/// config, then the operation graph and its tensors, which the chosen candidate takes).
pub(crate) struct GraphPlan {
    plan: Desc,
    pub(crate) workspace: usize,
    _config: Option<Desc>,
    _graph: Vec<Desc>,
}

// SAFETY: descriptors are host structures used under the device's mutex
unsafe impl Send for GraphPlan {}

/// What a plan is made for (its `Debug` text keys the plan's disk cache entry).
#[derive(Debug)]
pub(crate) struct Spec {
    pub direction: Direction,
    pub data: dsys::cudnnDataType_t,
    pub compute: dsys::cudnnDataType_t,
    pub x: [i64; 4],
    pub w: [i64; 4],
    pub y: [i64; 4],
    pub stride: [i64; 2],
    pub padding: [i64; 2],
    pub dilation: [i64; 2],
    /// Bytes every data pointer is aligned to.
    pub alignment: i64,
    /// f32 data held to FMA kernels (no TF32, no down-conversion).
    pub strict_f32: bool,
    /// x, w and y are NHWC in memory (`ConvParams::channels_last`); the dims stay in NCHW order.
    pub channels_last: bool,
    pub max_workspace: usize,
    /// Pointwise operations on the forward convolution's result, in the same graph
    /// (`Prim::Conv2dEpilogue`).
    pub epilogue: Option<ConvEpilogue>,
    /// The plan is the fastest of several candidates by time (max-autotune), not heuristics'
    /// first: a choice of its own on disk.
    pub timed: bool,
}

/// The strides of packed NCHW dims `s`, in NCHW or channels-last memory order.
fn packed_strides(s: [i64; 4], channels_last: bool) -> [i64; 4] {
    match channels_last {
        true => [s[1] * s[2] * s[3], 1, s[3] * s[1], s[1]],
        false => [s[1] * s[2] * s[3], s[2] * s[3], s[3], 1],
    }
}

fn tensor(spec: &Spec, dims: [i64; 4], id: i64) -> DnnResult<Desc> {
    tensor_of(spec, dims, id, false)
}

/// A tensor of the graph: packed in the spec's memory order; a virtual one (an intermediate of an
/// epilogue, never in memory) holds the compute type.
fn tensor_of(spec: &Spec, dims: [i64; 4], id: i64, is_virtual: bool) -> DnnResult<Desc> {
    let t = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    let data = if is_virtual { spec.compute } else { spec.data };
    t.set(
        A::CUDNN_ATTR_TENSOR_DATA_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[data],
    )?;
    if is_virtual {
        t.set(
            A::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
            T::CUDNN_TYPE_BOOLEAN,
            &[true],
        )?;
    }
    t.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, T::CUDNN_TYPE_INT64, &dims)?;
    t.set(
        A::CUDNN_ATTR_TENSOR_STRIDES,
        T::CUDNN_TYPE_INT64,
        &packed_strides(dims, spec.channels_last),
    )?;
    t.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, T::CUDNN_TYPE_INT64, &[id])?;
    t.set(
        A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
        T::CUDNN_TYPE_INT64,
        &[spec.alignment],
    )?;
    t.finalize()
}

fn convolution(spec: &Spec) -> DnnResult<Desc> {
    let c = Desc::new(D::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    c.set(
        A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[spec.compute],
    )?;
    c.set(
        A::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
        T::CUDNN_TYPE_CONVOLUTION_MODE,
        &[dsys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
    )?;
    c.set(
        A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS,
        T::CUDNN_TYPE_INT64,
        &[2i64],
    )?;
    c.set(
        A::CUDNN_ATTR_CONVOLUTION_DILATIONS,
        T::CUDNN_TYPE_INT64,
        &spec.dilation,
    )?;
    c.set(
        A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
        T::CUDNN_TYPE_INT64,
        &spec.stride,
    )?;
    c.set(
        A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS,
        T::CUDNN_TYPE_INT64,
        &spec.padding,
    )?;
    c.set(
        A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS,
        T::CUDNN_TYPE_INT64,
        &spec.padding,
    )?;
    c.finalize()
}

fn operation(spec: &Spec, x: &Desc, w: &Desc, y: &Desc, conv: &Desc) -> DnnResult<Desc> {
    let (kind, [ax, aw, ay, ac, aa, ab]) = match spec.direction {
        Direction::Forward => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
            ],
        ),
        Direction::GradInput => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
            ],
        ),
        Direction::GradWeight => (
            D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
            [
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
            ],
        ),
    };
    let op = Desc::new(kind)?;
    let bd = T::CUDNN_TYPE_BACKEND_DESCRIPTOR;
    op.set(ax, bd, &[x.0])?;
    op.set(aw, bd, &[w.0])?;
    op.set(ay, bd, &[y.0])?;
    op.set(ac, bd, &[conv.0])?;
    if spec.compute == dsys::cudnnDataType_t::CUDNN_DATA_DOUBLE {
        op.set(aa, T::CUDNN_TYPE_DOUBLE, &[1f64])?;
        op.set(ab, T::CUDNN_TYPE_DOUBLE, &[0f64])?;
    } else {
        op.set(aa, T::CUDNN_TYPE_FLOAT, &[1f32])?;
        op.set(ab, T::CUDNN_TYPE_FLOAT, &[0f32])?;
    }
    op.finalize()
}

/// One pointwise operation `y = mode(x, b)` (`b` absent for a unary mode).
fn pointwise(
    spec: &Spec,
    mode: dsys::cudnnPointwiseMode_t,
    x: &Desc,
    b: Option<&Desc>,
    y: &Desc,
) -> DnnResult<[Desc; 2]> {
    let pw = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
    pw.set(
        A::CUDNN_ATTR_POINTWISE_MODE,
        T::CUDNN_TYPE_POINTWISE_MODE,
        &[mode],
    )?;
    pw.set(
        A::CUDNN_ATTR_POINTWISE_MATH_PREC,
        T::CUDNN_TYPE_DATA_TYPE,
        &[spec.compute],
    )?;
    let pw = pw.finalize()?;
    let op = Desc::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
    let bd = T::CUDNN_TYPE_BACKEND_DESCRIPTOR;
    op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, bd, &[pw.0])?;
    op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, bd, &[x.0])?;
    if let Some(b) = b {
        op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, bd, &[b.0])?;
    }
    op.set(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, bd, &[y.0])?;
    Ok([op.finalize()?, pw])
}

/// The operations of `spec`'s graph, in order, and every descriptor they refer to (kept alive
/// with the plan). Without an epilogue: the convolution alone, writing y. With one: the
/// convolution writes a virtual tensor, and each step of `act(v * scale + shift + residual)` the
/// next, the last step y.
fn operations(spec: &Spec) -> DnnResult<(Vec<Desc>, Vec<Desc>)> {
    let x = tensor(spec, spec.x, IDS[0])?;
    let w = tensor(spec, spec.w, IDS[1])?;
    let conv = convolution(spec)?;
    let Some(e) = spec.epilogue else {
        let y = tensor(spec, spec.y, IDS[2])?;
        let op = operation(spec, &x, &w, &y, &conv)?;
        return Ok((vec![op], vec![conv, y, w, x]));
    };
    use dsys::cudnnPointwiseMode_t::*;
    let channel = [1, spec.y[1], 1, 1];
    // the operands' ids, in the prim's operand order
    let ids = e.split(&EPILOGUE_IDS);
    let mut steps: Vec<(dsys::cudnnPointwiseMode_t, Option<Desc>)> = Vec::new();
    for (id, mode, dims) in [
        (ids.scale, CUDNN_POINTWISE_MUL, channel),
        (ids.shift, CUDNN_POINTWISE_ADD, channel),
        (ids.residual, CUDNN_POINTWISE_ADD, spec.y),
    ] {
        if let Some(&id) = id {
            steps.push((mode, Some(tensor(spec, dims, id)?)));
        }
    }
    match e.act {
        Activation::None => {}
        Activation::Relu => steps.push((CUDNN_POINTWISE_RELU_FWD, None)),
        Activation::GeluTanh => steps.push((CUDNN_POINTWISE_GELU_APPROX_TANH_FWD, None)),
    }
    let mut parts = Vec::new();
    let mut ops = Vec::new();
    let mut cur = tensor_of(spec, spec.y, VIRTUAL_ID, true)?;
    ops.push(operation(spec, &x, &w, &cur, &conv)?);
    let last = steps.len().saturating_sub(1);
    for (i, (mode, b)) in steps.into_iter().enumerate() {
        let next = match i == last {
            true => tensor(spec, spec.y, IDS[2])?,
            false => tensor_of(spec, spec.y, VIRTUAL_ID + 1 + i as i64, true)?,
        };
        let [op, pw] = pointwise(spec, mode, &cur, b.as_ref(), &next)?;
        ops.push(op);
        parts.push(pw);
        parts.extend(b);
        parts.push(std::mem::replace(&mut cur, next));
    }
    parts.extend([cur, conv, w, x]);
    Ok((ops, parts))
}

/// The unique ids of the graph's tensors in memory, the variant pack's order: x, w, y, then the
/// epilogue's operands.
pub(crate) fn variant_ids(epilogue: Option<ConvEpilogue>) -> Vec<i64> {
    let extra = epilogue.map_or(0, |e| e.operands());
    IDS.iter().chain(&EPILOGUE_IDS[..extra]).copied().collect()
}

/// Whether an engine config's numerical notes allow it under `spec` (for f32 held to FMA math: no
/// tensor cores, no down-converted inputs, no reduced-precision reduction).
fn allowed(spec: &Spec, cfg: &Desc) -> DnnResult<bool> {
    if !spec.strict_f32 {
        return Ok(true);
    }
    let notes = engine_notes(
        cfg,
        A::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
        T::CUDNN_TYPE_NUMERICAL_NOTE,
    )?;
    use dsys::cudnnBackendNumericalNote_t::*;
    let banned = [
        CUDNN_NUMERICAL_NOTE_TENSOR_CORE as u32,
        CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS as u32,
        CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION as u32,
    ];
    Ok(!notes.iter().any(|n| banned.contains(n)))
}

/// The notes of kind `name` (numerical or behaviour) of an engine config's engine, each read as
/// a u32: a note this binding does not know stays a number, not an invalid enum.
fn engine_notes(cfg: &Desc, name: A, ty: T) -> DnnResult<Vec<u32>> {
    let engine = Desc::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    cfg.get(
        A::CUDNN_ATTR_ENGINECFG_ENGINE,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &mut [engine.0],
    )?;
    let mut notes = vec![0u32; 32];
    let count = engine.get(name, ty, &mut notes)?;
    notes.truncate(count);
    Ok(notes)
}

/// Engine configs for `graph` from the heuristics of `mode`, best first.
fn configs(
    graph: dsys::cudnnBackendDescriptor_t,
    mode: dsys::cudnnBackendHeurMode_t,
) -> DnnResult<Vec<Desc>> {
    let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set(
        A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &[graph],
    )?;
    heur.set(
        A::CUDNN_ATTR_ENGINEHEUR_MODE,
        T::CUDNN_TYPE_HEUR_MODE,
        &[mode],
    )?;
    let heur = heur.finalize()?;
    let count = heur
        .get::<dsys::cudnnBackendDescriptor_t>(
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            &mut [],
        )?
        .min(64);
    let cfgs: Vec<Desc> = (0..count)
        .map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<DnnResult<_>>()?;
    let mut raw: Vec<dsys::cudnnBackendDescriptor_t> = cfgs.iter().map(|d| d.0).collect();
    // the pre-created engine-config descriptors receive the results
    let got = heur.get(
        A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &mut raw,
    )?;
    let mut cfgs = cfgs;
    cfgs.truncate(got.min(count));
    Ok(cfgs)
}

/// How a timed plan's candidates are measured (`Spec::timed`): device milliseconds of one run
/// of the plan, `None` where it cannot run (its workspace cannot be had).
pub(crate) type Timer<'a> = &'a mut dyn FnMut(&GraphPlan) -> Option<f32>;

/// Candidates timed for a max-autotune plan: heuristics' first and up to this many more.
const TIMED_CANDIDATES: usize = 8;

/// The plan for `spec` on `device` (its name and architecture): rebuilt from the disk cache
/// when an earlier process stored it (`conv_plan_cache.rs`), else chosen and stored — by
/// heuristics (their first engine config that is allowed, finalizes and fits the workspace), or
/// when `spec.timed` (max-autotune) the fastest of heuristics' first few by `time`.
/// `Ok(None)` when no engine config is allowed and finalizes.
pub(crate) fn make_plan(
    handle: dsys::cudnnHandle_t,
    spec: &Spec,
    device: &str,
    time: Timer<'_>,
) -> DnnResult<Option<GraphPlan>> {
    let entry = conv_plan_cache::entry(spec, device);
    let read = profiler::span(Category::Compile, || "cuDNN: plan read from disk".into());
    if let Some(plan) = conv_plan_cache::load(handle, spec, &entry) {
        return Ok(Some(plan));
    }
    drop(read);
    let plan = match spec.timed {
        true => {
            let _span = profiler::span(Category::Compile, || "cuDNN: engines timed".into());
            let (plans, graph) = candidates(handle, spec, 1 + TIMED_CANDIDATES)?;
            fastest(plans, time).map(|p| p.with_graph(graph))
        }
        false => {
            let (mut plans, graph) = candidates(handle, spec, 1)?;
            plans.pop().map(|p| p.with_graph(graph))
        }
    };
    if let Some(plan) = &plan {
        conv_plan_cache::store(plan, &entry);
    }
    Ok(plan)
}

/// The candidate `time` measures fastest; heuristics' first where none can be timed.
fn fastest(mut plans: Vec<GraphPlan>, time: Timer<'_>) -> Option<GraphPlan> {
    let times: Vec<Option<f32>> = plans.iter().map(time).collect();
    TIMED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let best = times
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(0, |(i, _)| i);
    (best < plans.len()).then(|| plans.swap_remove(best))
}

static TIMED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Convolution shapes whose plan this process chose by timing cuDNN's engines (max-autotune).
pub fn cudnn_plans_timed() -> usize {
    TIMED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Up to `limit` finalized plans for `spec`, best first by cuDNN's heuristics: engine configs
/// that are allowed, finalize and fit the workspace. After the first, configs whose engines
/// compile at run time (NVRTC inside cuDNN: seconds each) are passed over. With them, the
/// operation graph's descriptors, which the plan kept must hold (`GraphPlan::with_graph`).
fn candidates(
    handle: dsys::cudnnHandle_t,
    spec: &Spec,
    limit: usize,
) -> DnnResult<(Vec<GraphPlan>, Vec<Desc>)> {
    let (ops, mut parts) = operations(spec)?;
    let graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    graph.set(
        A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
        T::CUDNN_TYPE_HANDLE,
        &[handle],
    )?;
    let raw: Vec<dsys::cudnnBackendDescriptor_t> = ops.iter().map(|d| d.0).collect();
    graph.set(
        A::CUDNN_ATTR_OPERATIONGRAPH_OPS,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &raw,
    )?;
    let graph = graph.finalize()?;
    let graph_handle = graph.0;
    // users before what they refer to, as the descriptors are dropped in order
    let mut keep = vec![graph];
    keep.extend(ops);
    keep.append(&mut parts);
    let mut plans: Vec<GraphPlan> = Vec::new();
    use dsys::cudnnBackendHeurMode_t::*;
    for mode in [CUDNN_HEUR_MODE_INSTANT, CUDNN_HEUR_MODE_FALLBACK] {
        let heuristics = profiler::span(Category::Compile, || "cuDNN: heuristics".into());
        let Ok(cfgs) = configs(graph_handle, mode) else {
            continue;
        };
        drop(heuristics);
        for cfg in cfgs {
            if !allowed(spec, &cfg).unwrap_or(false)
                || (!plans.is_empty() && compiles_at_run_time(&cfg).unwrap_or(true))
            {
                continue;
            }
            let _finalize = profiler::span(Category::Compile, || "cuDNN: finalize a plan".into());
            let Ok(plan) = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR) else {
                continue;
            };
            let made = plan
                .set(
                    A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                    T::CUDNN_TYPE_HANDLE,
                    &[handle],
                )
                .and_then(|_| {
                    plan.set(
                        A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                        &[cfg.0],
                    )
                })
                .and_then(|_| plan.finalize());
            let Ok(plan) = made else {
                continue;
            };
            let Some(workspace) = workspace(&plan, spec) else {
                continue;
            };
            plans.push(GraphPlan {
                plan,
                workspace,
                _config: Some(cfg),
                _graph: Vec::new(),
            });
            // enough: no further finalization, nor the fallback heuristics' query
            if plans.len() == limit {
                return Ok((plans, keep));
            }
        }
    }
    Ok((plans, keep))
}

/// Whether an engine config's engine is compiled when its plan is finalized (cuDNN's runtime
/// fusion engines).
fn compiles_at_run_time(cfg: &Desc) -> DnnResult<bool> {
    let notes = engine_notes(
        cfg,
        A::CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE,
        T::CUDNN_TYPE_BEHAVIOR_NOTE,
    )?;
    let runtime = dsys::cudnnBackendBehaviorNote_t::CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION as u32;
    Ok(notes.contains(&runtime))
}

/// The workspace a finalized plan needs, or `None` when it cannot be read or exceeds
/// `spec.max_workspace`.
fn workspace(plan: &Desc, spec: &Spec) -> Option<usize> {
    let mut ws = [0i64];
    plan.get(
        A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
        T::CUDNN_TYPE_INT64,
        &mut ws,
    )
    .ok()?;
    (ws[0] >= 0 && ws[0] as usize <= spec.max_workspace).then_some(ws[0] as usize)
}

impl GraphPlan {
    /// A plan rebuilt from its serialization (it holds no other descriptors).
    pub(crate) fn rebuilt(plan: Desc, spec: &Spec) -> Option<GraphPlan> {
        let workspace = workspace(&plan, spec)?;
        Some(GraphPlan {
            plan,
            workspace,
            _config: None,
            _graph: Vec::new(),
        })
    }

    /// The plan holding the descriptors of the operation graph it was made from.
    fn with_graph(mut self, graph: Vec<Desc>) -> GraphPlan {
        self._graph = graph;
        self
    }

    /// The finalized execution plan.
    pub(crate) fn descriptor(&self) -> &Desc {
        &self.plan
    }

    /// Queues the convolution on the handle's stream: `ptrs` are x, w, y (as the forward
    /// convolution names them), then the epilogue's operands (`variant_ids(spec)`'s order);
    /// `workspace` holds `self.workspace` bytes.
    pub(crate) fn execute(
        &self,
        handle: dsys::cudnnHandle_t,
        ids: &[i64],
        ptrs: &[*mut c_void],
        workspace: *mut c_void,
    ) -> DnnResult<()> {
        let pack = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            T::CUDNN_TYPE_INT64,
            ids,
        )?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            T::CUDNN_TYPE_VOID_PTR,
            ptrs,
        )?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            T::CUDNN_TYPE_VOID_PTR,
            &[workspace],
        )?;
        let pack = pack.finalize()?;
        // SAFETY: a finalized plan and variant pack whose pointers address live buffers of the
        // plan's shapes
        unsafe { dsys::cudnnBackendExecute(handle, self.plan.0, pack.0) }.result()
    }
}
