//! Typed CPU buffers. A tensor's storage is shared between views (`Arc`) and mutable in place (`RwLock`)
//! so optimizer steps and running-stat updates change parameters without changing their identity.

use std::sync::{Arc, RwLock};

use crate::device::DeviceBuffer;
use crate::{DType, Device, Element};
use half::{bf16, f16};

/// A tensor's memory: a host buffer the CPU kernels lock to read or write, or a buffer in a device's
/// memory that only the registered device runtime touches (`device.rs`). Views share either by `Arc`.
#[derive(Clone)]
pub enum Storage {
    Cpu(Arc<RwLock<CpuStorage>>),
    Device(Arc<dyn DeviceBuffer>),
}

impl Storage {
    pub fn cpu(s: CpuStorage) -> Storage {
        Storage::Cpu(Arc::new(RwLock::new(s)))
    }
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Device(b) => b.device(),
        }
    }
    /// Identity of the underlying buffer (equal for views of one buffer).
    pub fn key(&self) -> usize {
        match self {
            Storage::Cpu(a) => Arc::as_ptr(a) as *const u8 as usize,
            Storage::Device(b) => Arc::as_ptr(b) as *const u8 as usize,
        }
    }
    /// Capacity in elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(a) => a.read().unwrap_or_else(|e| e.into_inner()).len(),
            Storage::Device(b) => b.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Clone, Debug)]
pub enum CpuStorage {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    Bool(Vec<bool>),
}

/// Large buffers go back to the caching allocator (`cpu/alloc.rs`) rather than to the system.
impl Drop for CpuStorage {
    fn drop(&mut self) {
        crate::cpu::alloc::recycle(self);
    }
}

/// Runs `$body` with `$v` bound to the typed Vec inside a storage, whatever its dtype.
#[macro_export]
macro_rules! with_storage {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            $crate::storage::CpuStorage::F32($v) => $body,
            $crate::storage::CpuStorage::F64($v) => $body,
            $crate::storage::CpuStorage::F16($v) => $body,
            $crate::storage::CpuStorage::BF16($v) => $body,
            $crate::storage::CpuStorage::I32($v) => $body,
            $crate::storage::CpuStorage::I64($v) => $body,
            $crate::storage::CpuStorage::U8($v) => $body,
            $crate::storage::CpuStorage::Bool($v) => $body,
        }
    };
}

impl CpuStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I32(_) => DType::I32,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::U8(_) => DType::U8,
            CpuStorage::Bool(_) => DType::Bool,
        }
    }
    pub fn len(&self) -> usize {
        with_storage!(self, v => v.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A buffer of `n` copies of `value` converted to `dtype`.
    pub fn full(dtype: DType, n: usize, value: f64) -> CpuStorage {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![value as f32; n]),
            DType::F64 => CpuStorage::F64(vec![value; n]),
            DType::F16 => CpuStorage::F16(vec![f16::from_f64(value); n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::from_f64(value); n]),
            DType::I32 => CpuStorage::I32(vec![value as i32; n]),
            DType::I64 => CpuStorage::I64(vec![value as i64; n]),
            DType::U8 => CpuStorage::U8(vec![value as u8; n]),
            DType::Bool => CpuStorage::Bool(vec![value != 0.0; n]),
        }
    }
    /// Sets every element to `value`, converted to the buffer's dtype (`Element::from_f64`).
    pub fn fill(&mut self, value: f64) {
        with_storage!(self, v => v.fill(crate::dtype::Element::from_f64(value)))
    }
    /// Builds a buffer of `dtype` from f64 values (used for creation ops and tests).
    pub fn from_f64s(dtype: DType, it: impl Iterator<Item = f64>) -> CpuStorage {
        match dtype {
            DType::F32 => CpuStorage::F32(it.map(|v| v as f32).collect()),
            DType::F64 => CpuStorage::F64(it.collect()),
            DType::F16 => CpuStorage::F16(it.map(f16::from_f64).collect()),
            DType::BF16 => CpuStorage::BF16(it.map(bf16::from_f64).collect()),
            DType::I32 => CpuStorage::I32(it.map(|v| v as i32).collect()),
            DType::I64 => CpuStorage::I64(it.map(|v| v as i64).collect()),
            DType::U8 => CpuStorage::U8(it.map(|v| v as u8).collect()),
            DType::Bool => CpuStorage::Bool(it.map(|v| v != 0.0).collect()),
        }
    }
    pub fn get_f64(&self, i: usize) -> f64 {
        with_storage!(self, v => v[i].to_f64())
    }
    /// Raw little-endian bytes (for safetensors).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
            let n = std::mem::size_of_val(v);
            // SAFETY: plain-old-data element types; x86_64 and aarch64 are little-endian.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, n).to_vec() }
        }
        with_storage!(self, v => bytes(v))
    }
}

/// Conversion between typed Vecs and `CpuStorage`.
pub trait StorageElement: Element {
    fn wrap(v: Vec<Self>) -> CpuStorage;
    fn view(s: &CpuStorage) -> Option<&[Self]>;
    fn view_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>>;
}

macro_rules! storage_element {
    ($t:ty, $v:ident) => {
        impl StorageElement for $t {
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$v(v)
            }
            fn view(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn view_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
storage_element!(f32, F32);
storage_element!(f64, F64);
storage_element!(f16, F16);
storage_element!(bf16, BF16);
storage_element!(i32, I32);
storage_element!(i64, I64);
storage_element!(u8, U8);
storage_element!(bool, Bool);
