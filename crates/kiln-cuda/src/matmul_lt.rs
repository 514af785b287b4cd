//! `act(a @ b + bias)` in one cuBLASLt call: the bias, ReLU and GELU epilogues a compiler fuses
//! into a matmul instead of running them as separate kernels. A building block for compiled GPU
//! graphs, so it records no autograd (the compiler differentiates the prims it replaces).
//!
//! Row-major `D = A B` is column-major `Dᵀ = Bᵀ Aᵀ`, so cuBLASLt's first operand is `b`, and the bias
//! (one value per column of D) is per row of cuBLASLt's Dᵀ, which is the vector it broadcasts.
//! cuBLASLt's GELU is the tanh approximation (PyTorch's `gelu(approximate='tanh')`), hence the
//! variant's name. TF32 follows `set_allow_tf32`, as cuBLAS matmul does.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::cublaslt::{result as lt, sys as ltsys};
use kiln_core::prim::{self, Activation};
use kiln_core::shape::Layout;
use kiln_core::{DType, Device, Error, Result, Tensor};

use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;

/// What cuBLASLt applies to `a @ b` before writing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// `a @ b`
    None,
    /// `a @ b + bias`
    Bias,
    /// `relu(a @ b)`
    Relu,
    /// `relu(a @ b + bias)`
    BiasRelu,
    /// `gelu_tanh(a @ b)`
    GeluTanh,
    /// `gelu_tanh(a @ b + bias)`
    BiasGeluTanh,
}

impl Epilogue {
    /// The compiler's epilogue (`Prim::MatmulEpilogue`'s) as cuBLASLt's.
    pub fn of(e: prim::Epilogue) -> Epilogue {
        match (e.bias, e.act) {
            (false, Activation::None) => Epilogue::None,
            (true, Activation::None) => Epilogue::Bias,
            (false, Activation::Relu) => Epilogue::Relu,
            (true, Activation::Relu) => Epilogue::BiasRelu,
            (false, Activation::GeluTanh) => Epilogue::GeluTanh,
            (true, Activation::GeluTanh) => Epilogue::BiasGeluTanh,
        }
    }
    pub(crate) fn has_bias(self) -> bool {
        matches!(
            self,
            Epilogue::Bias | Epilogue::BiasRelu | Epilogue::BiasGeluTanh
        )
    }
    pub(crate) fn lt(self) -> ltsys::cublasLtEpilogue_t {
        use ltsys::cublasLtEpilogue_t::*;
        match self {
            Epilogue::None => CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => CUBLASLT_EPILOGUE_BIAS,
            Epilogue::Relu => CUBLASLT_EPILOGUE_RELU,
            Epilogue::BiasRelu => CUBLASLT_EPILOGUE_RELU_BIAS,
            Epilogue::GeluTanh => CUBLASLT_EPILOGUE_GELU,
            Epilogue::BiasGeluTanh => CUBLASLT_EPILOGUE_GELU_BIAS,
        }
    }
}

static EPILOGUE_GEMMS: AtomicU64 = AtomicU64::new(0);

/// `Prim::MatmulEpilogue` calls this process ran on a GPU through cuBLASLt (the compiler's fused
/// bias and ReLU), tuned or not.
pub fn epilogue_gemms() -> u64 {
    EPILOGUE_GEMMS.load(Ordering::Relaxed)
}

pub(crate) fn count_epilogue_gemm() {
    EPILOGUE_GEMMS.fetch_add(1, Ordering::Relaxed);
}

/// A device's cuBLASLt handle.
pub(crate) struct LtHandle(pub(crate) ltsys::cublasLtHandle_t);
// SAFETY: used only under the device's mutex
unsafe impl Send for LtHandle {}

/// Workspace offered to cuBLASLt's heuristics (cuBLAS's own default on Hopper is 32 MiB).
pub(crate) const WORKSPACE: usize = 32 << 20;

const OP: &str = "matmul_epilogue";

fn lt_err(dev: usize, what: &str, e: impl std::fmt::Debug) -> Error {
    lt_error(OP, dev, what, e)
}

/// A cuBLASLt call `what` that failed on device `dev`, for op `op`.
pub(crate) fn lt_error(op: &'static str, dev: usize, what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device {
        op,
        lhs: Device::Cuda(dev),
        rhs: Device::Cuda(dev),
        msg: format!("cuBLASLt {what} failed: {e:?}"),
    }
}

/// `epilogue(a @ b [+ bias])`: `a` [M, K], `b` [K, N], `bias` [N], all on one CUDA device, one
/// dtype of f32, f16 or bf16. Returns a new [M, N] tensor on that device.
pub fn matmul_epilogue(
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    epilogue: Epilogue,
) -> Result<Tensor> {
    check(a, b, bias, epilogue)?;
    let dev = CudaDevice::get(crate::runtime::ordinal(OP, a.device())?)?;
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let dtype = a.dtype();
    if k == 0 {
        return Err(Error::unsupported(
            OP,
            format!(
                "an empty inner dimension (a {:?} @ b {:?})",
                a.shape(),
                b.shape()
            ),
        ));
    }
    let out = dev.alloc(m * n, dtype)?;
    if m * n > 0 {
        let (ab, al) = crate::runtime::operand(OP, a)?;
        let (bb, bl) = crate::runtime::operand(OP, b)?;
        let bias = bias.map(|t| crate::runtime::operand(OP, t)).transpose()?;
        run(&dev, (ab, al), (bb, bl), bias, epilogue, &out, [m, k, n])?;
    }
    Ok(Tensor::from_device_buffer(
        Arc::new(out),
        Layout::contiguous(&[m, n]),
    ))
}

/// `[m, k, n]` of `Prim::MatmulEpilogue`'s operands when cuBLASLt's epilogues take them: f32,
/// f16 or bf16, one batch, a non-empty inner dim, sizes an `i32` holds. The compiler writes no
/// other; the runtime runs any other as the matmul and the ops (`kiln_core::ops::epilogue`).
pub(crate) fn epilogue_dims(ops: &[(&CudaBuffer, &Layout)]) -> Option<[usize; 3]> {
    let ((a, la), (_, lb)) = (ops[0], ops[1]);
    let (batch, m, k, n) = (la.shape[0], la.shape[1], la.shape[2], lb.shape[2]);
    let fits = [m, k, n].iter().all(|&x| x <= i32::MAX as usize);
    let typed = matches!(a.dtype, DType::F32 | DType::F16 | DType::BF16);
    (typed && batch == 1 && k > 0 && fits).then_some([m, k, n])
}

/// `Prim::MatmulEpilogue` (`[1, M, K] x [1, K, N] (+ [N])`) into `out` on `dev`, its operands
/// of `[m, k, n]` as `epilogue_dims` gave them.
pub(crate) fn execute(
    dev: &Arc<CudaDevice>,
    ops: &[(&CudaBuffer, &Layout)],
    [m, k, n]: [usize; 3],
    e: prim::Epilogue,
    out: &CudaBuffer,
) -> Result<()> {
    if m * n == 0 {
        return Ok(());
    }
    let ((a, la), (b, lb)) = (ops[0], ops[1]);
    let matrix = |l: &Layout| Layout {
        shape: l.shape[1..].into(),
        strides: l.strides[1..].into(),
        offset: l.offset,
    };
    let bias = ops.get(2).copied().filter(|_| e.bias);
    let (la2, lb2) = (matrix(la), matrix(lb));
    run(
        dev,
        (a, &la2),
        (b, &lb2),
        bias,
        Epilogue::of(e),
        out,
        [m, k, n],
    )
}

fn check(a: &Tensor, b: &Tensor, bias: Option<&Tensor>, epilogue: Epilogue) -> Result<()> {
    let mut all = vec![a, b];
    all.extend(bias);
    for t in &all {
        if !matches!(t.device(), Device::Cuda(_)) || t.device() != a.device() {
            return Err(Error::Device {
                op: OP,
                lhs: a.device(),
                rhs: t.device(),
                msg: format!(
                    "operands must be on one CUDA device: a {:?} on {}, b {:?} on {}",
                    a.shape(),
                    a.device(),
                    b.shape(),
                    b.device()
                ),
            });
        }
        if t.dtype() != a.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: a.dtype(),
                rhs: t.dtype(),
            });
        }
    }
    if !matches!(a.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::dtype(
            OP,
            a.dtype(),
            "cuBLASLt epilogues take f32, f16 or bf16",
        ));
    }
    if a.rank() != 2 || b.rank() != 2 || a.shape()[1] != b.shape()[0] {
        return Err(Error::shape(
            OP,
            format!(
                "a {:?} @ b {:?}: expected [M, K] @ [K, N]",
                a.shape(),
                b.shape()
            ),
        ));
    }
    let n = b.shape()[1];
    match (bias, epilogue.has_bias()) {
        (Some(t), true) if t.shape() != [n] => Err(Error::shape(
            OP,
            format!(
                "bias {:?} for an output of {n} columns: expected [{n}]",
                t.shape()
            ),
        )),
        (None, true) => Err(Error::arg(OP, format!("{epilogue:?} needs a bias"))),
        (Some(_), false) => Err(Error::arg(
            OP,
            format!("{epilogue:?} takes no bias (use a Bias variant)"),
        )),
        _ => Ok(()),
    }
}

/// How cuBLASLt reads one operand: pointer, stored rows x cols (column-major), leading dimension,
/// transposed?; a copy when the view is neither row-major nor transposed.
struct Operand {
    ptr: u64,
    rows: u64,
    cols: u64,
    ld: i64,
    trans: bool,
    _keep: Option<CudaBuffer>,
}

/// A row-major [r, c] view, as cuBLASLt's column-major operand of its transpose [c, r].
fn operand(dev: &Arc<CudaDevice>, buf: &CudaBuffer, l: &Layout) -> Result<Operand> {
    let (r, c) = (l.shape[0], l.shape[1]);
    let st = &l.strides;
    if (c == 1 || st[1] == 1) && (r == 1 || st[0] == c) {
        // row-major [r, c] = column-major [c, r], ld c
        return Ok(Operand {
            ptr: buf.at(l.offset),
            rows: c as u64,
            cols: r as u64,
            ld: c.max(1) as i64,
            trans: false,
            _keep: None,
        });
    }
    if (r == 1 || st[0] == 1) && (c == 1 || st[1] == r) {
        // the transpose of a row-major [c, r]: column-major [r, c], read transposed
        return Ok(Operand {
            ptr: buf.at(l.offset),
            rows: r as u64,
            cols: c as u64,
            ld: r.max(1) as i64,
            trans: true,
            _keep: None,
        });
    }
    let copy = crate::kernels::elementwise::copy_strided(dev, buf, l)?;
    Ok(Operand {
        ptr: copy.ptr,
        rows: c as u64,
        cols: r as u64,
        ld: c.max(1) as i64,
        trans: false,
        _keep: Some(copy),
    })
}

/// Descriptors destroyed on every path out of a GEMM (null until created).
pub(crate) struct Descs {
    pub(crate) matmul: ltsys::cublasLtMatmulDesc_t,
    pub(crate) layouts: Vec<ltsys::cublasLtMatrixLayout_t>,
    pub(crate) pref: ltsys::cublasLtMatmulPreference_t,
}

// SAFETY: the descriptors are host objects that cuBLASLt only reads once they are set up; a
// tuned GEMM's are kept in a process-wide table (`matmul_tune.rs`) and used under the device's
// cuBLASLt handle mutex
unsafe impl Send for Descs {}
unsafe impl Sync for Descs {}

impl Default for Descs {
    fn default() -> Self {
        Descs {
            matmul: std::ptr::null_mut(),
            layouts: Vec::new(),
            pref: std::ptr::null_mut(),
        }
    }
}

/// One matrix of a cuBLASLt GEMM as stored: column-major `rows` x `cols` (before its
/// transpose), leading dimension `ld`, `batch_stride` elements between the batch's matrices.
#[derive(Clone, Copy)]
pub(crate) struct Stored {
    pub(crate) rows: u64,
    pub(crate) cols: u64,
    pub(crate) ld: i64,
    pub(crate) batch_stride: i64,
}

/// The descriptors of `D = epilogue(op(A) op(B))` over `batch` matrices each (cuBLASLt's A, B
/// and D in `[a, b, d]`, A and B read transposed where `trans` says), with a preference that
/// allows `WORKSPACE` bytes: what a heuristic GEMM (`plan`) and a timed one (`matmul_tune.rs`)
/// both start from.
pub(crate) fn descriptors(
    o: usize,
    (dtype, tf32): (DType, bool),
    epilogue: Epilogue,
    trans: [bool; 2],
    stored: [Stored; 3],
    batch: usize,
) -> Result<Descs> {
    let e = |what: &'static str| move |x| lt_err(o, what, x);
    let (data, compute) = lt_types(dtype, tf32);
    let mut d = Descs::default();
    d.matmul =
        lt::create_matmul_desc(compute, ltsys::cudaDataType::CUDA_R_32F).map_err(e("desc"))?;
    let op = |t: bool| match t {
        true => cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
        false => cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
    };
    use ltsys::cublasLtMatmulDescAttributes_t::*;
    set_desc(d.matmul, CUBLASLT_MATMUL_DESC_TRANSA, &op(trans[0])).map_err(e("transa"))?;
    set_desc(d.matmul, CUBLASLT_MATMUL_DESC_TRANSB, &op(trans[1])).map_err(e("transb"))?;
    set_desc(d.matmul, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue.lt()).map_err(e("epilogue"))?;
    for m in stored {
        let l = lt::create_matrix_layout(data, m.rows, m.cols, m.ld).map_err(e("layout"))?;
        d.layouts.push(l);
        if batch > 1 {
            use ltsys::cublasLtMatrixLayoutAttribute_t::*;
            let count = batch as i32;
            // SAFETY: a live layout; each value has its attribute's type and size
            unsafe {
                lt::set_matrix_layout_attribute(
                    l,
                    CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    (&count as *const i32).cast(),
                    std::mem::size_of::<i32>(),
                )
                .map_err(e("batch count"))?;
                lt::set_matrix_layout_attribute(
                    l,
                    CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    (&m.batch_stride as *const i64).cast(),
                    std::mem::size_of::<i64>(),
                )
                .map_err(e("batch stride"))?;
            }
        }
    }
    d.pref = preference().map_err(e("preference"))?;
    Ok(d)
}

/// The device's cuBLASLt handle (created at its first use), its mutex held by the guard.
pub(crate) fn lt_handle(
    dev: &CudaDevice,
) -> Result<(MutexGuard<'_, Option<LtHandle>>, ltsys::cublasLtHandle_t)> {
    dev.bind()?;
    let mut guard = dev.cublaslt.lock().unwrap_or_else(|x| x.into_inner());
    if guard.is_none() {
        let h = lt::create_handle().map_err(|x| lt_err(dev.ordinal, "create", x))?;
        *guard = Some(LtHandle(h));
    }
    match guard.as_ref().map(|h| h.0) {
        Some(h) => Ok((guard, h)),
        None => Err(lt_err(dev.ordinal, "handle", "missing")),
    }
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each was created once below and is destroyed once here
        unsafe {
            if !self.pref.is_null() {
                let _ = lt::destroy_matmul_pref(self.pref);
            }
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            if !self.matmul.is_null() {
                let _ = lt::destroy_matmul_desc(self.matmul);
            }
        }
    }
}

pub(crate) fn set_desc<T>(
    d: ltsys::cublasLtMatmulDesc_t,
    attr: ltsys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> std::result::Result<(), lt::CublasError> {
    // SAFETY: `v` is a live value of the attribute's type and size
    unsafe {
        lt::set_matmul_desc_attribute(d, attr, (v as *const T).cast(), std::mem::size_of::<T>())
    }
}

/// The address cuBLASLt reads a bias vector at (0 for none): the vector's own where its
/// elements are adjacent, else a contiguous copy's, returned with it to be kept alive until the
/// GEMM is queued.
pub(crate) fn bias_address(
    dev: &Arc<CudaDevice>,
    bias: Option<(&CudaBuffer, &Layout)>,
) -> Result<(u64, Option<CudaBuffer>)> {
    Ok(match bias {
        Some((buf, l)) if l.shape[0] <= 1 || l.strides[0] == 1 => (buf.at(l.offset), None),
        Some((buf, l)) => {
            let copy = crate::kernels::elementwise::copy_strided(dev, buf, l)?;
            (copy.ptr, Some(copy))
        }
        None => (0, None),
    })
}

/// What a GEMM's setup depends on: the device, the element and math types, the sizes, how
/// cuBLASLt reads each operand (transposed?, leading dimension), the epilogue, and the alignment
/// of each address (an algorithm may need 16-byte operands).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    ordinal: usize,
    dtype: DType,
    tf32: bool,
    mkn: [usize; 3],
    first: (bool, i64),
    second: (bool, i64),
    epilogue: Epilogue,
    /// Of A, B, D and the bias, in bytes (at most 256; 0 for no bias).
    align: [u32; 4],
}

/// A GEMM's descriptors and the algorithm the heuristic gave for them.
struct Plan {
    descs: Descs,
    algo: ltsys::cublasLtMatmulAlgo_t,
    workspace: usize,
}

// SAFETY: the algorithm is plain data; the descriptors are `Descs` (see there)
unsafe impl Send for Plan {}
unsafe impl Sync for Plan {}

fn plans() -> &'static Mutex<HashMap<PlanKey, Arc<Plan>>> {
    static PLANS: OnceLock<Mutex<HashMap<PlanKey, Arc<Plan>>>> = OnceLock::new();
    PLANS.get_or_init(Default::default)
}

/// The largest power of two (at most 256) that divides the address.
fn alignment(ptr: u64) -> u32 {
    match ptr {
        0 => 256,
        p => 1 << p.trailing_zeros().min(8),
    }
}

fn run(
    dev: &Arc<CudaDevice>,
    (a, la): (&CudaBuffer, &Layout),
    (b, lb): (&CudaBuffer, &Layout),
    bias: Option<(&CudaBuffer, &Layout)>,
    epilogue: Epilogue,
    out: &CudaBuffer,
    [m, k, n]: [usize; 3],
) -> Result<()> {
    let o = dev.ordinal;
    let e = |what: &'static str| move |x| lt_err(o, what, x);
    // cuBLASLt's A is `b` (Bᵀ, [n, k]) and its B is `a` (Aᵀ, [k, m])
    let first = operand(dev, b, lb)?;
    let second = operand(dev, a, la)?;
    let (bias_ptr, _bias_copy) = bias_address(dev, bias)?;
    let key = PlanKey {
        ordinal: o,
        dtype: out.dtype,
        tf32: out.dtype == DType::F32 && crate::matmul::allow_tf32(),
        mkn: [m, k, n],
        first: (first.trans, first.ld),
        second: (second.trans, second.ld),
        epilogue,
        align: [first.ptr, second.ptr, out.ptr, bias_ptr].map(alignment),
    };
    let (_guard, handle) = lt_handle(dev)?;
    let cached = plans()
        .lock()
        .unwrap_or_else(|x| x.into_inner())
        .get(&key)
        .cloned();
    let plan = match cached {
        Some(p) => p,
        None => {
            let p = Arc::new(plan(handle, &key, [&first, &second], o)?);
            plans()
                .lock()
                .unwrap_or_else(|x| x.into_inner())
                .insert(key, p.clone());
            p
        }
    };
    if epilogue.has_bias() {
        use ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER;
        // the descriptor is shared by every call of this key: set under the handle's mutex,
        // which is held until the launch is queued
        set_desc(
            plan.descs.matmul,
            CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &bias_ptr,
        )
        .map_err(e("bias"))?;
    }
    // SAFETY: the pointers address live buffers of the sizes the plan's layouts describe
    unsafe {
        launch(
            dev,
            handle,
            &plan.descs,
            [first.ptr, second.ptr, out.ptr],
            &plan.algo,
            plan.workspace,
            e("matmul"),
        )
    }
}

/// The descriptors for `key` and the heuristic's first algorithm for them, asking for
/// algorithms that work at the operands' alignment.
fn plan(
    handle: ltsys::cublasLtHandle_t,
    key: &PlanKey,
    [first, second]: [&Operand; 2],
    o: usize,
) -> Result<Plan> {
    let e = |what: &'static str| move |x| lt_err(o, what, x);
    let [m, k, n] = key.mkn;
    let epilogue = key.epilogue;
    let stored = |x: &Operand| Stored {
        rows: x.rows,
        cols: x.cols,
        ld: x.ld,
        batch_stride: 0,
    };
    let out = Stored {
        rows: n as u64,
        cols: m as u64,
        ld: n.max(1) as i64,
        batch_stride: 0,
    };
    let d = descriptors(
        o,
        (key.dtype, key.tf32),
        epilogue,
        [first.trans, second.trans],
        [stored(first), stored(second), out],
        1,
    )?;
    let (la_, lb_, lc_) = (d.layouts[0], d.layouts[1], d.layouts[2]);
    use ltsys::cublasLtMatmulPreferenceAttributes_t::*;
    let [aa, ab, ad, abias] = key.align;
    for (attr, bytes) in [
        (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aa),
        (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ab),
        (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ad),
        (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ad.min(abias)),
    ] {
        // SAFETY: a live preference; the value is a u32 as the attribute requires
        unsafe {
            lt::set_matmul_pref_attribute(
                d.pref,
                attr,
                (&bytes as *const u32).cast(),
                std::mem::size_of::<u32>(),
            )
        }
        .map_err(e("alignment"))?;
    }
    // SAFETY: live handle and descriptors
    let heuristic =
        unsafe { lt::get_matmul_algo_heuristic(handle, d.matmul, la_, lb_, lc_, lc_, d.pref) }
            .map_err(|x| {
                lt_err(
                    o,
                    "heuristic",
                    format!(
                        "{x:?} for {epilogue:?} [{m}, {k}] @ [{k}, {n}] {}",
                        key.dtype
                    ),
                )
            })?;
    Ok(Plan {
        algo: heuristic.algo,
        workspace: heuristic.workspaceSize,
        descs: d,
    })
}

/// cuBLASLt's element type for `dtype` (f32, f16 or bf16) and its compute type: f32, with TF32
/// math when `tf32`.
pub(crate) fn lt_types(
    dtype: DType,
    tf32: bool,
) -> (ltsys::cudaDataType, ltsys::cublasComputeType_t) {
    let data = match dtype {
        DType::F32 => ltsys::cudaDataType::CUDA_R_32F,
        DType::F16 => ltsys::cudaDataType::CUDA_R_16F,
        _ => ltsys::cudaDataType::CUDA_R_16BF,
    };
    let compute = match tf32 {
        true => ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        false => ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    (data, compute)
}

/// A matmul preference that allows `WORKSPACE` bytes of workspace.
pub(crate) fn preference() -> std::result::Result<ltsys::cublasLtMatmulPreference_t, lt::CublasError>
{
    let pref = lt::create_matmul_pref()?;
    let ws_limit = WORKSPACE as u64;
    // SAFETY: a live preference; the value is a u64 as the attribute requires
    let set = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            ltsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&ws_limit as *const u64).cast(),
            std::mem::size_of::<u64>(),
        )
    };
    match set {
        Ok(()) => Ok(pref),
        Err(x) => {
            // SAFETY: created above, not used after
            let _ = unsafe { lt::destroy_matmul_pref(pref) };
            Err(x)
        }
    }
}

/// Queues `D = A B` on `dev`'s stream with `algo` and `workspace` bytes of workspace (allocated
/// here): `[a, b, d]` the device addresses of cuBLASLt's A, B and D as `desc`'s layouts 0, 1 and
/// 2 describe them; alpha 1, beta 0, so C (given as D) is not read. `err` words cuBLASLt's
/// errors.
///
/// # Safety
/// The addresses must point at live buffers of the sizes the layouts describe.
pub(crate) unsafe fn launch(
    dev: &Arc<CudaDevice>,
    handle: ltsys::cublasLtHandle_t,
    desc: &Descs,
    [a, b, d]: [u64; 3],
    algo: &ltsys::cublasLtMatmulAlgo_t,
    workspace: usize,
    err: impl Fn(lt::CublasError) -> Error,
) -> Result<()> {
    let ws = match workspace {
        0 => None,
        bytes => Some(dev.alloc(bytes, DType::U8)?),
    };
    let l = &desc.layouts;
    let (one, zero) = (1f32, 0f32);
    dev.bind()?;
    lt::matmul(
        handle,
        desc.matmul,
        (&one as *const f32).cast(),
        (&zero as *const f32).cast(),
        a as *const c_void,
        l[0],
        b as *const c_void,
        l[1],
        d as *const c_void,
        l[2],
        d as *mut c_void,
        l[2],
        algo,
        ws.as_ref()
            .map_or(std::ptr::null_mut(), |w| w.ptr as *mut c_void),
        workspace,
        dev.stream as ltsys::cudaStream_t,
    )
    .map_err(err)
}
