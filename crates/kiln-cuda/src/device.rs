//! One GPU: its context, the stream every op is queued on, its caching allocator, its loaded
//! kernels and its cuBLAS handle. Devices are opened on first use and live for the process.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{result, sys, DriverError};
use kiln_core::shape::Layout;
use kiln_core::storage::CpuStorage;
use kiln_core::{with_storage, DType, Device, Error, Result};

use crate::alloc::{MemoryStats, Pool};
use crate::buffer::CudaBuffer;

pub struct CudaDevice {
    pub(crate) ordinal: usize,
    ctx: sys::CUcontext,
    pub(crate) stream: sys::CUstream,
    pool: Mutex<Pool>,
    pub(crate) kernels: Mutex<HashMap<String, sys::CUfunction>>,
    pub(crate) cublas: Mutex<Option<crate::matmul::Blas>>,
    pub(crate) cublaslt: Mutex<Option<crate::matmul_lt::LtHandle>>,
    /// The flag gather and scatter_add kernels raise on a bad index, read at synchronization.
    pub(crate) checks: crate::index_check::IndexChecks,
    /// cuDNN's handle and conv plans, made at the first convolution.
    pub(crate) dnn: Mutex<Option<crate::conv::Dnn>>,
    /// NVRTC's target: "compute_90" on an H100.
    pub(crate) arch: &'static str,
    pub(crate) sm_count: u32,
    /// Bytes of L2 cache (what a timing run evicts before each repetition: `event::time_cold`).
    pub(crate) l2_bytes: usize,
    /// The most dynamic shared memory a block may opt in to (227 KiB on Hopper).
    pub(crate) shared_per_block: u32,
    /// The driver's name for the model ("NVIDIA H100 80GB HBM3"): part of max-autotune's keys.
    pub(crate) name: String,
    /// The thread recording a CUDA graph from the stream (`capture.rs`, `thread_token`), 0 when
    /// none. Work another thread queued meanwhile would join the recording (one stream serves
    /// every thread), so it is refused instead (`bind`, `launch_grid`), as PyTorch's global
    /// capture mode refuses it.
    pub(crate) recorder: AtomicU64,
}

/// A number for the calling thread, never 0 (`CudaDevice::recorder`).
pub(crate) fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TOKEN.with(|t| *t)
}

// SAFETY: the raw handles are process-wide driver objects; every use binds the context first and
// the mutable state sits behind mutexes.
unsafe impl Send for CudaDevice {}
unsafe impl Sync for CudaDevice {}

pub(crate) fn cu_err(op: &str, device: usize, e: DriverError) -> Error {
    Error::Device {
        op: "cuda",
        lhs: Device::Cuda(device),
        rhs: Device::Cuda(device),
        msg: format!("{op} failed: {e:?}"),
    }
}

thread_local! {
    static CURRENT: Cell<sys::CUcontext> = const { Cell::new(std::ptr::null_mut()) };
}

impl CudaDevice {
    /// The device `ordinal`, opened on first use.
    pub fn get(ordinal: usize) -> Result<Arc<CudaDevice>> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
        crate::probe::probe().map_err(|msg| Error::Device {
            op: "cuda",
            lhs: Device::Cpu,
            rhs: Device::Cuda(ordinal),
            msg,
        })?;
        let mut all = DEVICES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(d) = all.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(CudaDevice::open(ordinal)?);
        all.insert(ordinal, d.clone());
        Ok(d)
    }

    fn open(ordinal: usize) -> Result<CudaDevice> {
        let err = |op: &str, e| cu_err(op, ordinal, e);
        result::init().map_err(|e| err("cuInit", e))?;
        let count = result::device::get_count().map_err(|e| err("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::Device {
                op: "cuda",
                lhs: Device::Cpu,
                rhs: Device::Cuda(ordinal),
                msg: format!("there are {count} CUDA devices; cuda:{ordinal} does not exist"),
            });
        }
        let dev = result::device::get(ordinal as i32).map_err(|e| err("cuDeviceGet", e))?;
        // SAFETY: `dev` is a valid device; the primary context is retained for the process
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| err("retain", e))?;
        unsafe { result::ctx::set_current(ctx) }.map_err(|e| err("cuCtxSetCurrent", e))?;
        CURRENT.with(|c| c.set(ctx));
        let attr = |a| unsafe { result::device::get_attribute(dev, a) };
        use sys::CUdevice_attribute::*;
        let major =
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).map_err(|e| err("attr", e))?;
        let minor =
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).map_err(|e| err("attr", e))?;
        let sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| err("attr", e))?;
        // a driver that does not say gets Hopper's 50 MiB
        let l2 = attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE).unwrap_or(50 << 20);
        // a driver that does not say gets the limit every device gives without opting in
        let shared =
            attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).unwrap_or(48 << 10);
        // only a key for tuned choices: a driver that cannot name the model still runs
        let name = result::device::get_name(dev).unwrap_or_else(|_| "cuda".into());
        // non-blocking: kiln's stream never waits on work other libraries queue on stream 0
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| err("cuStreamCreate", e))?;
        let checks = crate::index_check::IndexChecks::new(ordinal)?;
        Ok(CudaDevice {
            ordinal,
            checks,
            ctx,
            stream,
            pool: Mutex::new(Pool::default()),
            kernels: Mutex::new(HashMap::new()),
            cublas: Mutex::new(None),
            dnn: Mutex::new(None),
            cublaslt: Mutex::new(None),
            arch: Box::leak(format!("compute_{major}{minor}").into_boxed_str()),
            sm_count: sms.max(1) as u32,
            l2_bytes: l2.max(0) as usize,
            shared_per_block: shared.max(48 << 10) as u32,
            name,
            recorder: AtomicU64::new(0),
        })
    }

    /// Makes this device's context current on the calling thread (once per thread and device).
    pub(crate) fn bind(&self) -> Result<()> {
        self.not_recording_elsewhere()?;
        if CURRENT.with(|c| c.get()) != self.ctx {
            // SAFETY: the context is retained for the process
            unsafe { result::ctx::set_current(self.ctx) }
                .map_err(|e| cu_err("cuCtxSetCurrent", self.ordinal, e))?;
            CURRENT.with(|c| c.set(self.ctx));
        }
        Ok(())
    }

    /// `Err` while another thread records a CUDA graph on this device (`recorder`).
    fn not_recording_elsewhere(&self) -> Result<()> {
        match self.recorder.load(Ordering::Acquire) {
            0 => Ok(()),
            t if t == thread_token() => Ok(()),
            _ => Err(Error::Device {
                op: "cuda",
                lhs: Device::Cuda(self.ordinal),
                rhs: Device::Cuda(self.ordinal),
                msg: "another thread is recording a CUDA graph on this device (the first call of \
                      a function compiled with Mode::ReduceOverhead or MaxAutotune): work queued \
                      now would join its recording. Run this after that call returns, or compile \
                      that function with a mode without CUDA graphs"
                    .into(),
            }),
        }
    }

    pub(crate) fn pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of `len` elements of `dtype`, contents undefined.
    pub(crate) fn alloc(self: &Arc<Self>, len: usize, dtype: DType) -> Result<CudaBuffer> {
        self.bind()?;
        let (ptr, class) = self
            .pool()
            .alloc(len * dtype.size_in_bytes())
            .map_err(|msg| Error::Device {
                op: "cuda alloc",
                lhs: Device::Cuda(self.ordinal),
                rhs: Device::Cuda(self.ordinal),
                msg,
            })?;
        Ok(CudaBuffer {
            ptr,
            class,
            len,
            dtype,
            dev: self.clone(),
        })
    }

    pub(crate) fn upload(self: &Arc<Self>, data: &CpuStorage) -> Result<CudaBuffer> {
        let buf = self.alloc(data.len(), data.dtype())?;
        if data.is_empty() {
            return Ok(buf);
        }
        // SAFETY: `buf` holds data.len() elements of this dtype; a copy from pageable memory returns
        // once the host bytes are staged, so `data` may be dropped after it
        with_storage!(data, v => unsafe { result::memcpy_htod_async(buf.ptr, &v[..], self.stream) })
            .map_err(|e| cu_err("copy to device", self.ordinal, e))?;
        Ok(buf)
    }

    /// The elements `layout` addresses in `buf`, row-major, on the host; waits for queued work.
    pub(crate) fn download(
        self: &Arc<Self>,
        buf: &CudaBuffer,
        layout: &Layout,
    ) -> Result<CpuStorage> {
        self.bind()?;
        let n = layout.numel();
        let mut out = CpuStorage::full(buf.dtype, n, 0.0);
        if n == 0 {
            return Ok(out);
        }
        let tmp;
        let src = if layout.is_contiguous() {
            buf.at(layout.offset)
        } else {
            tmp = crate::kernels::elementwise::copy_strided(self, buf, layout)?;
            tmp.ptr
        };
        // SAFETY: `out` holds n elements of the buffer's dtype; the stream sync below completes the
        // copy before `out` is read or moved
        with_storage!(&mut out, v => unsafe { result::memcpy_dtoh_async(&mut v[..], src, self.stream) })
            .map_err(|e| cu_err("copy to host", self.ordinal, e))?;
        self.synchronize()?;
        Ok(out)
    }

    /// Waits for the queued work; then reports an index error a gather or scatter_add kernel
    /// found since the last synchronization (`index_check.rs`).
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the stream lives for the process
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(|e| cu_err("cuStreamSynchronize", self.ordinal, e))?;
        self.checks.take_error()
    }

    /// Queues `f` on the stream over a one-dimensional grid. `params` point at each argument's
    /// value.
    pub(crate) fn launch(
        &self,
        f: sys::CUfunction,
        grid: u32,
        block: u32,
        shared: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_grid(f, [grid, 1, 1], block, shared, params)
    }

    /// `launch` over a grid of up to three dimensions.
    pub(crate) fn launch_grid(
        &self,
        f: sys::CUfunction,
        grid: [u32; 3],
        block: u32,
        shared: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.not_recording_elsewhere()?;
        let grid = (grid[0], grid[1], grid[2]);
        // SAFETY: callers pass the argument list the kernel was generated with
        unsafe { result::launch_kernel(f, grid, (block, 1, 1), shared, self.stream, params) }
            .map_err(|e| cu_err("cuLaunchKernel", self.ordinal, e))
    }

    pub fn memory_stats(&self) -> MemoryStats {
        self.pool().stats
    }

    pub fn empty_cache(&self) -> Result<()> {
        self.synchronize()?;
        self.pool().release_cached();
        Ok(())
    }

    pub fn reset_peak(&self) {
        let mut p = self.pool();
        p.stats.peak_allocated = p.stats.allocated;
    }
}
