//! cuDNN's legacy convolution API: descriptors, an algorithm chosen by its heuristics (or, in
//! benchmark mode, by `cudnnFind*`'s timings) among those the math and workspace limits allow,
//! and the call that runs it. `conv.rs` makes such a plan where the graph API (`conv_graph.rs`)
//! has none, and in benchmark mode.

use std::ffi::c_void;

use cudarc::cudnn::{result as dnn, sys as dsys};
use kiln_core::DType;

use crate::conv::{data_type, dims, DnnResult, Kind, PlanKey, MAX_WORKSPACE};

#[derive(Clone, Copy)]
enum Algo {
    Forward(dsys::cudnnConvolutionFwdAlgo_t),
    GradInput(dsys::cudnnConvolutionBwdDataAlgo_t),
    GradWeight(dsys::cudnnConvolutionBwdFilterAlgo_t),
}

struct TensorDesc(dsys::cudnnTensorDescriptor_t);
struct FilterDesc(dsys::cudnnFilterDescriptor_t);
struct ConvDesc(dsys::cudnnConvolutionDescriptor_t);

impl Drop for TensorDesc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreateTensorDescriptor, destroyed once
        let _ = unsafe { dnn::destroy_tensor_descriptor(self.0) };
    }
}
impl Drop for FilterDesc {
    fn drop(&mut self) {
        // SAFETY: as above
        let _ = unsafe { dnn::destroy_filter_descriptor(self.0) };
    }
}
impl Drop for ConvDesc {
    fn drop(&mut self) {
        // SAFETY: as above
        let _ = unsafe { dnn::destroy_convolution_descriptor(self.0) };
    }
}

/// One convolution's descriptors, the algorithm chosen for it, and the workspace it needs.
pub(crate) struct Plan {
    x: TensorDesc,
    w: FilterDesc,
    y: TensorDesc,
    conv: ConvDesc,
    algo: Algo,
    pub(crate) workspace: usize,
}

/// Runs a legacy-API plan: `pa`, `pb` the prim's operands, `po` its output.
pub(crate) fn execute(
    handle: dsys::cudnnHandle_t,
    plan: &Plan,
    dtype: DType,
    [pa, pb, po]: [*mut c_void; 3],
    ws_ptr: *mut c_void,
) -> DnnResult<()> {
    let (one64, zero64, one32, zero32) = (1f64, 0f64, 1f32, 0f32);
    let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
        (
            (&one64 as *const f64).cast(),
            (&zero64 as *const f64).cast(),
        )
    } else {
        (
            (&one32 as *const f32).cast(),
            (&zero32 as *const f32).cast(),
        )
    };
    let (pa, pb) = (pa as *const c_void, pb as *const c_void);
    let ws = plan.workspace;
    // SAFETY: the descriptors describe the contiguous buffers passed with them; the workspace
    // holds `plan.workspace` bytes; everything is queued on the handle's stream (the device's)
    unsafe {
        match plan.algo {
            Algo::Forward(algo) => dnn::convolution_forward(
                handle,
                alpha,
                plan.x.0,
                pa,
                plan.w.0,
                pb,
                plan.conv.0,
                algo,
                ws_ptr,
                ws,
                beta,
                plan.y.0,
                po,
            ),
            Algo::GradInput(algo) => dnn::convolution_backward_data(
                handle,
                alpha,
                plan.w.0,
                pb,
                plan.y.0,
                pa,
                plan.conv.0,
                algo,
                ws_ptr,
                ws,
                beta,
                plan.x.0,
                po,
            ),
            Algo::GradWeight(algo) => dnn::convolution_backward_filter(
                handle,
                alpha,
                plan.x.0,
                pb,
                plan.y.0,
                pa,
                plan.conv.0,
                algo,
                ws_ptr,
                ws,
                beta,
                plan.w.0,
                po,
            ),
        }
    }
}

/// The legacy API's memory order: NCHW, or NHWC for channels-last operands (dims in NCHW order
/// either way).
fn format(channels_last: bool) -> dsys::cudnnTensorFormat_t {
    match channels_last {
        true => dsys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
        false => dsys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
    }
}

fn tensor_desc(
    dt: dsys::cudnnDataType_t,
    s: [i32; 4],
    channels_last: bool,
) -> DnnResult<TensorDesc> {
    let d = TensorDesc(dnn::create_tensor_descriptor()?);
    // SAFETY: a live descriptor
    unsafe { dnn::set_tensor4d_descriptor(d.0, format(channels_last), dt, s) }?;
    Ok(d)
}

fn filter_desc(
    dt: dsys::cudnnDataType_t,
    s: [i32; 4],
    channels_last: bool,
) -> DnnResult<FilterDesc> {
    let d = FilterDesc(dnn::create_filter_descriptor()?);
    // SAFETY: a live descriptor
    unsafe { dnn::set_filter4d_descriptor(d.0, dt, format(channels_last), s) }?;
    Ok(d)
}

fn conv_desc(key: &PlanKey, math: dsys::cudnnMathType_t) -> DnnResult<ConvDesc> {
    let i = |v: usize| v as i32; // checked by `make_plan`
    let compute = if key.dtype == DType::F64 {
        dsys::cudnnDataType_t::CUDNN_DATA_DOUBLE
    } else {
        // half types accumulate in f32, as the CPU kernels and PyTorch do
        dsys::cudnnDataType_t::CUDNN_DATA_FLOAT
    };
    let d = ConvDesc(dnn::create_convolution_descriptor()?);
    // SAFETY: a live descriptor
    unsafe {
        dnn::set_convolution2d_descriptor(
            d.0,
            i(key.padding[0]),
            i(key.padding[1]),
            i(key.stride[0]),
            i(key.stride[1]),
            i(key.dilation[0]),
            i(key.dilation[1]),
            dsys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
            compute,
        )?;
        dnn::set_convolution_group_count(d.0, i(key.groups))?;
        dnn::set_convolution_math_type(d.0, math)?;
    }
    Ok(d)
}

/// The math cuDNN may use: f32 without TF32 is held to FMA kernels; half types use tensor cores.
fn math_type(key: &PlanKey) -> dsys::cudnnMathType_t {
    use dsys::cudnnMathType_t::*;
    match key.dtype {
        DType::F16 | DType::BF16 => CUDNN_TENSOR_OP_MATH,
        DType::F32 if key.tf32 => CUDNN_DEFAULT_MATH,
        _ => CUDNN_FMA_MATH,
    }
}

fn math_allowed(key: &PlanKey, m: dsys::cudnnMathType_t) -> bool {
    key.dtype != DType::F32 || key.tf32 || m == dsys::cudnnMathType_t::CUDNN_FMA_MATH
}

/// Descriptors and the first algorithm that is allowed, reports success and fits the workspace
/// limit, in the order cuDNN ranks them: by measured time (benchmark mode) or by its heuristics.
/// `Ok(None)` when there is none.
pub(crate) fn make_plan(handle: dsys::cudnnHandle_t, key: &PlanKey) -> DnnResult<Option<Plan>> {
    let (Some(dt), Some(x), Some(w), Some(y)) =
        (data_type(key.dtype), dims(key.x), dims(key.w), dims(key.y))
    else {
        return Ok(None);
    };
    let fits = [key.stride, key.padding, key.dilation]
        .iter()
        .flatten()
        .chain([&key.groups])
        .all(|&v| i32::try_from(v).is_ok());
    if !fits {
        return Ok(None);
    }
    let math = math_type(key);
    let (xd, wd, yd, cd) = (
        tensor_desc(dt, x, key.channels_last)?,
        filter_desc(dt, w, key.channels_last)?,
        tensor_desc(dt, y, key.channels_last)?,
        conv_desc(key, math)?,
    );
    const N: usize = 8;
    let mut count = 0i32;
    // the three directions differ in the query pair, the perf struct and the descriptor order
    macro_rules! choose {
        ($perf:ty, $find:path, $get:path, ($a:expr, $b:expr, $c:expr, $d:expr), $algo:path) => {{
            let mut perf: [$perf; N] = std::mem::zeroed();
            let query = if key.benchmark { $find } else { $get };
            query(
                handle,
                $a,
                $b,
                $c,
                $d,
                N as i32,
                &mut count,
                perf.as_mut_ptr(),
            )
            .result()?;
            perf[..count.clamp(0, N as i32) as usize]
                .iter()
                .find(|r| usable(key, r.status, r.memory, r.mathType))
                .map(|r| ($algo(r.algo), r.mathType))
        }};
    }
    // SAFETY: live handle and descriptors; the result arrays hold N entries (all-zero bytes are a
    // valid value of each perf struct: algorithm 0, success, math type 0)
    let chosen: Option<(Algo, dsys::cudnnMathType_t)> = unsafe {
        match key.kind {
            Kind::Forward => choose!(
                dsys::cudnnConvolutionFwdAlgoPerf_t,
                dsys::cudnnFindConvolutionForwardAlgorithm,
                dsys::cudnnGetConvolutionForwardAlgorithm_v7,
                (xd.0, wd.0, cd.0, yd.0),
                Algo::Forward
            ),
            Kind::GradInput => choose!(
                dsys::cudnnConvolutionBwdDataAlgoPerf_t,
                dsys::cudnnFindConvolutionBackwardDataAlgorithm,
                dsys::cudnnGetConvolutionBackwardDataAlgorithm_v7,
                (wd.0, yd.0, cd.0, xd.0),
                Algo::GradInput
            ),
            Kind::GradWeight => choose!(
                dsys::cudnnConvolutionBwdFilterAlgoPerf_t,
                dsys::cudnnFindConvolutionBackwardFilterAlgorithm,
                dsys::cudnnGetConvolutionBackwardFilterAlgorithm_v7,
                (xd.0, yd.0, cd.0, wd.0),
                Algo::GradWeight
            ),
        }
    };
    let Some((algo, algo_math)) = chosen else {
        return Ok(None);
    };
    // SAFETY: live handle and descriptors
    let workspace = unsafe {
        dnn::set_convolution_math_type(cd.0, algo_math)?;
        match algo {
            Algo::Forward(a) => {
                dnn::get_convolution_forward_workspace_size(handle, xd.0, wd.0, cd.0, yd.0, a)?
            }
            Algo::GradInput(a) => dnn::get_convolution_backward_data_workspace_size(
                handle, wd.0, yd.0, cd.0, xd.0, a,
            )?,
            Algo::GradWeight(a) => dnn::get_convolution_backward_filter_workspace_size(
                handle, xd.0, yd.0, cd.0, wd.0, a,
            )?,
        }
    };
    Ok(Some(Plan {
        x: xd,
        w: wd,
        y: yd,
        conv: cd,
        algo,
        workspace,
    }))
}

fn usable(
    key: &PlanKey,
    status: dsys::cudnnStatus_t,
    memory: usize,
    math: dsys::cudnnMathType_t,
) -> bool {
    status == dsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS
        && memory <= MAX_WORKSPACE
        && math_allowed(key, math)
}
