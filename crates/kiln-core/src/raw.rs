//! Raw element addresses, for generated kernels called through FFI. The core never hands these out
//! for its own use; code generators hold the tensor (and so its storage) alive around every call.

use crate::Tensor;

impl Tensor {
    /// Address of the tensor's first element (its layout offset applied), in host memory. A tensor on
    /// a device has no host address: this returns null for it, so callers check `device()` first.
    ///
    /// # Safety
    /// The pointer is valid while `self` is alive and the storage is not replaced (only deferred
    /// tensors have their storage replaced, when they are filled). Reading through it races with
    /// concurrent in-place writes (`assign`); writing through it is only sound for a tensor whose
    /// storage no other handle can reach (a fresh allocation).
    pub unsafe fn data_ptr(&self) -> *const u8 {
        if self.device() != crate::Device::Cpu {
            return std::ptr::null();
        }
        let s = self.storage();
        let base: *const u8 = crate::with_storage!(&*s, v => v.as_ptr().cast::<u8>());
        base.wrapping_add(self.offset() * self.dtype().size_in_bytes())
    }

    /// Address of the tensor's first element (its layout offset applied) in its device's memory;
    /// `None` on the CPU and for a traced tensor not computed yet. Same validity rules as
    /// `data_ptr`; device work is queued in stream order, so a buffer freed after a launch is
    /// only reused by work queued after it.
    pub fn device_address(&self) -> Option<u64> {
        let buf = self.device_buffer()?;
        let base = buf.address();
        (base != 0).then(|| base + (self.offset() * self.dtype().size_in_bytes()) as u64)
    }
}
