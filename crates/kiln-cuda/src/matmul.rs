//! Matmul through cuBLAS: `[B,M,K] x [B,K,N]` as one strided-batched GEMM. Operands whose matrices
//! are row-major or transposed (any batch stride, broadcast batches included) are used in place;
//! other layouts are copied contiguous first. TF32 is off unless `set_allow_tf32(true)`, as in
//! PyTorch's default for matmul (`torch.backends.cuda.matmul.allow_tf32 = False`).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as bsys};
use kiln_core::backends::{self, Switch};
use kiln_core::shape::Layout;
use kiln_core::{DType, Device, Error, Result};

use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;

/// `torch.backends.cuda.matmul.allow_tf32`: lets f32 matmuls round operands to TF32 on tensor
/// cores (about 10 mantissa bits; several times faster). Held by `kiln_core::backends`, which
/// compiled functions guard on.
pub fn set_allow_tf32(on: bool) {
    backends::set(Switch::MatmulTf32, on);
}
pub fn allow_tf32() -> bool {
    backends::get(Switch::MatmulTf32)
}

/// A cuBLAS handle bound to a device's stream.
pub(crate) struct Blas(bsys::cublasHandle_t);
// SAFETY: used only under the device's mutex
unsafe impl Send for Blas {}

fn blas_err(what: &str, dev: usize, e: impl std::fmt::Debug) -> Error {
    Error::Device {
        op: "matmul",
        lhs: Device::Cuda(dev),
        rhs: Device::Cuda(dev),
        msg: format!("cuBLAS {what} failed: {e:?}"),
    }
}

/// How a matrix operand is read: pointer, leading dimension, transposed?, batch stride.
pub(crate) struct Mat {
    pub(crate) ptr: u64,
    pub(crate) ld: i32,
    pub(crate) trans: bool,
    pub(crate) batch_stride: i64,
    _keep: Option<CudaBuffer>,
}

/// `rows x cols` matrices at `layout` (rank 3): row-major or transposed in place, else a copy.
pub(crate) fn operand(dev: &Arc<CudaDevice>, buf: &CudaBuffer, l: &Layout) -> Result<Mat> {
    let (b, r, c) = (l.shape[0], l.shape[1], l.shape[2]);
    let st = &l.strides;
    let bs = if b == 1 { 0 } else { st[0] as i64 };
    if (c == 1 || st[2] == 1) && (r == 1 || st[1] == c) {
        return Ok(Mat {
            ptr: buf.at(l.offset),
            ld: c.max(1) as i32,
            trans: false,
            batch_stride: bs,
            _keep: None,
        });
    }
    if (r == 1 || st[1] == 1) && (c == 1 || st[2] == r) {
        return Ok(Mat {
            ptr: buf.at(l.offset),
            ld: r.max(1) as i32,
            trans: true,
            batch_stride: bs,
            _keep: None,
        });
    }
    let copy = crate::kernels::elementwise::copy_strided(dev, buf, l)?;
    Ok(Mat {
        ptr: copy.ptr,
        ld: c.max(1) as i32,
        trans: false,
        batch_stride: (r * c) as i64,
        _keep: Some(copy),
    })
}

/// cuBLAS's element type and compute type for `d` (TF32 for f32 when allowed).
fn blas_types(d: DType) -> Result<(bsys::cudaDataType, bsys::cublasComputeType_t)> {
    Ok(match d {
        DType::F32 if allow_tf32() => (
            bsys::cudaDataType::CUDA_R_32F,
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        ),
        DType::F32 => (
            bsys::cudaDataType::CUDA_R_32F,
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F64 => (
            bsys::cudaDataType::CUDA_R_64F,
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
        ),
        DType::F16 => (
            bsys::cudaDataType::CUDA_R_16F,
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::BF16 => (
            bsys::cudaDataType::CUDA_R_16BF,
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        other => {
            return Err(Error::dtype(
                "matmul",
                other,
                "cuBLAS matmul takes f32, f64, f16 or bf16",
            ))
        }
    })
}

/// `out = a @ b` over `[batch, m, k]` and `[batch, k, n]` operands, as eager execution runs it.
pub(crate) fn matmul(
    dev: &Arc<CudaDevice>,
    (a, la): (&CudaBuffer, &Layout),
    (b, lb): (&CudaBuffer, &Layout),
    out: &CudaBuffer,
) -> Result<()> {
    let (batch, m, k, n) = (la.shape[0], la.shape[1], la.shape[2], lb.shape[2]);
    if batch * m * n == 0 {
        return Ok(());
    }
    let too_big = [batch, m, n, k].iter().any(|&x| x > i32::MAX as usize);
    if too_big {
        return Err(Error::unsupported(
            "matmul",
            format!(
                "sizes {:?} x {:?} exceed cuBLAS's 32-bit dims",
                la.shape, lb.shape
            ),
        ));
    }
    blas_types(a.dtype)?;
    let out_bytes = (batch * m * n) as u64;
    if k == 0 {
        // an empty sum: zeros (cuBLAS would leave C untouched with beta 0 only if it ran)
        dev.bind()?;
        unsafe {
            cudarc::driver::result::memset_d8_async(
                out.ptr,
                0,
                (out_bytes as usize) * a.dtype.size_in_bytes(),
                dev.stream,
            )
        }
        .map_err(|e| blas_err("memset", dev.ordinal, e))?;
        return Ok(());
    }
    let ma = operand(dev, a, la)?;
    let mb = operand(dev, b, lb)?;
    gemm(dev, a.dtype, (batch, m, n, k), (&ma, &mb), out)
}

/// `out = a @ b` by cuBLAS's strided-batched GEMM for operands already read as matrices
/// (`operand`), `(batch, m, n, k)` within cuBLAS's 32-bit dims and `k` not 0: what `matmul`
/// runs, and max-autotune's default candidate (`matmul_tune.rs`) on the operands it derived.
pub(crate) fn gemm(
    dev: &Arc<CudaDevice>,
    d: DType,
    (batch, m, n, k): (usize, usize, usize, usize),
    (ma, mb): (&Mat, &Mat),
    out: &CudaBuffer,
) -> Result<()> {
    let (ty, compute) = blas_types(d)?;
    let mut guard = dev.cublas.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        dev.bind()?;
        let h = blas::create_handle().map_err(|e| blas_err("create", dev.ordinal, e))?;
        // SAFETY: both handles are valid; the stream lives for the process
        unsafe { blas::set_stream(h, dev.stream as bsys::cudaStream_t) }
            .map_err(|e| blas_err("set stream", dev.ordinal, e))?;
        *guard = Some(Blas(h));
    }
    let Some(h) = guard.as_ref().map(|b| b.0) else {
        return Err(blas_err("handle", dev.ordinal, "missing"));
    };
    dev.bind()?;
    let op = |t: bool| {
        if t {
            bsys::cublasOperation_t::CUBLAS_OP_T
        } else {
            bsys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (one64, zero64) = (1f64, 0f64);
    let (one32, zero32) = (1f32, 0f32);
    let (alpha, beta): (*const c_void, *const c_void) = if d == DType::F64 {
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
    // row-major C = A B is column-major C^T = B^T A^T: cuBLAS's first operand is B
    // SAFETY: pointers address live buffers of the sizes the dims and strides describe
    unsafe {
        blas::gemm_strided_batched_ex(
            h,
            op(mb.trans),
            op(ma.trans),
            n as i32,
            m as i32,
            k as i32,
            alpha,
            mb.ptr as *const c_void,
            ty,
            mb.ld,
            mb.batch_stride,
            ma.ptr as *const c_void,
            ty,
            ma.ld,
            ma.batch_stride,
            beta,
            out.ptr as *mut c_void,
            ty,
            n as i32,
            (m * n) as i64,
            batch as i32,
            compute,
            bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| blas_err("GEMM", dev.ordinal, e))
}
