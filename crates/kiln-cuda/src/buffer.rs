//! A tensor's device memory: a block from the device's caching allocator, returned to it on drop.

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::sys;
use kiln_core::device::DeviceBuffer;
use kiln_core::{DType, Device};

use crate::device::CudaDevice;

pub struct CudaBuffer {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) class: usize,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    pub(crate) dev: Arc<CudaDevice>,
}

impl CudaBuffer {
    /// Address of element `offset`.
    pub(crate) fn at(&self, offset: usize) -> sys::CUdeviceptr {
        self.ptr + (offset * self.dtype.size_in_bytes()) as u64
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        self.dev.pool().free(self.ptr, self.class);
    }
}

impl DeviceBuffer for CudaBuffer {
    fn device(&self) -> Device {
        Device::Cuda(self.dev.ordinal)
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
    fn address(&self) -> u64 {
        self.ptr
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
