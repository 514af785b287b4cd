//! Deferred index checks. gather and scatter_add kernels check every index on the device; an index
//! out of range used to be read back after each launch (a synchronization per call). Now a kernel
//! that finds one records the number of its launch in a flag that lives in pinned host memory
//! mapped into the device, and the flag is read at the device's next synchronization point (a value
//! read, `synchronize`), which returns that launch's `Err` — PyTorch's device-side asserts surface
//! the same way. Reading the flag after a stream synchronization costs a load from host memory.

use std::sync::Mutex;

use cudarc::driver::{result, sys};
use kiln_core::{Error, Result};

use crate::device::cu_err;

/// What an index-checking launch was, to word its error.
#[derive(Clone, Copy)]
struct Launch {
    op: &'static str,
    dim: usize,
    dim_size: usize,
}

/// Launches kept between synchronizations before one is forced (bounds the table's memory).
const MAX_PENDING: usize = 1 << 20;

pub(crate) struct IndexChecks {
    /// The flag as the host reads it: 0, or the 1-based number of the first failing launch.
    host: *mut i32,
    /// The same flag's address on the device.
    pub(crate) device_ptr: sys::CUdeviceptr,
    /// Launches since the last synchronization, numbered from 1.
    pending: Mutex<Vec<Launch>>,
}

// SAFETY: the flag is written by kernels and read by the host only after a stream
// synchronization; the table sits behind a mutex
unsafe impl Send for IndexChecks {}
unsafe impl Sync for IndexChecks {}

impl IndexChecks {
    /// Allocates the flag (the device's context is current).
    pub(crate) fn new(ordinal: usize) -> Result<IndexChecks> {
        // SAFETY: a 4-byte pinned, device-mapped allocation, kept for the process
        let host = unsafe { result::malloc_host(4, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(|e| cu_err("cuMemHostAlloc", ordinal, e))?
            .cast::<i32>();
        let mut device_ptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP just above
        unsafe {
            host.write_volatile(0);
            sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, host.cast(), 0)
                .result()
                .map_err(|e| cu_err("cuMemHostGetDevicePointer", ordinal, e))?;
        }
        Ok(IndexChecks {
            host,
            device_ptr,
            pending: Mutex::new(Vec::new()),
        })
    }

    /// Registers a launch; returns the number its kernel writes into the flag on a bad index, or
    /// `None` when the table is full and the caller must synchronize first.
    pub(crate) fn register(&self, op: &'static str, dim: usize, dim_size: usize) -> Option<i32> {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.len() >= MAX_PENDING {
            return None;
        }
        p.push(Launch { op, dim, dim_size });
        Some(p.len() as i32)
    }

    /// After a stream synchronization: the first failing launch's error since the last one, if
    /// any. Resets the flag and the table.
    pub(crate) fn take_error(&self) -> Result<()> {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the stream is idle, so no kernel writes the flag now
        let bad = unsafe { self.host.read_volatile() };
        let failed = usize::try_from(bad)
            .ok()
            .and_then(|n| n.checked_sub(1))
            .and_then(|i| p.get(i).copied());
        p.clear();
        if bad == 0 {
            return Ok(());
        }
        // SAFETY: as above
        unsafe { self.host.write_volatile(0) };
        Err(match failed {
            Some(l) => Error::index(
                l.op,
                format!(
                    "an index is out of range for dim {} of size {} (found on the device; \
                     reported at the next synchronization)",
                    l.dim, l.dim_size
                ),
            ),
            None => Error::index(
                "gather/scatter_add",
                "an index was out of range (found on the device)",
            ),
        })
    }
}
