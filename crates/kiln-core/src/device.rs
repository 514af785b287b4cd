//! Where a tensor lives, and the hook through which a device runtime plugs into the core.
//!
//! CUDA is detected, never assumed (DESIGN.md invariant 6), and the core knows nothing of CUDA (layers
//! point downward): a higher crate (kiln-cuda) implements [`DeviceRuntime`] and registers it with
//! [`register_runtime`]. `dispatch::apply` hands every prim whose operands live on a device to that
//! runtime; view prims (permute, expand, slice, reshape of a viewable layout) never reach it, the core
//! re-lays them over the same buffer as it does on the CPU.

use std::any::Any;
use std::sync::{Arc, RwLock};

use crate::prim::{OutMeta, Prim};
use crate::shape::Layout;
use crate::storage::CpuStorage;
use crate::{DType, Error, Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A buffer of elements in a device's memory, owned by the runtime that allocated it. The core only
/// shares it between views and asks the runtime to read or write it; freeing happens on drop (the
/// runtime's caching allocator takes the memory back).
pub trait DeviceBuffer: Send + Sync + Any {
    fn device(&self) -> Device;
    fn dtype(&self) -> DType;
    /// Capacity in elements.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// For the owning runtime to recover its own buffer type.
    fn as_any(&self) -> &dyn Any;
}

/// What a device runtime provides. All work is queued in order on the device's stream; the methods
/// that hand values to the host (`download`) wait for that work first, so a user who reads a value
/// (`to_vec`, `item`, printing) always sees the result of every op queued before.
pub trait DeviceRuntime: Send + Sync + 'static {
    /// For messages: "cuda".
    fn name(&self) -> &'static str;
    /// Copies host values onto `device` (contiguous, `data.len()` elements).
    fn upload(&self, device: Device, data: &CpuStorage) -> Result<Arc<dyn DeviceBuffer>>;
    /// The elements `layout` addresses in `buf`, in row-major order, as a contiguous host buffer.
    fn download(&self, buf: &Arc<dyn DeviceBuffer>, layout: &Layout) -> Result<CpuStorage>;
    /// Runs a (non-view) prim whose operands all live on `device` (none for creation prims) and
    /// returns a fresh contiguous buffer of `meta`'s shape and dtype. `Prim::infer` has checked the
    /// operands.
    fn execute(
        &self,
        device: Device,
        prim: &Prim,
        inputs: &[&Tensor],
        meta: &OutMeta,
    ) -> Result<Arc<dyn DeviceBuffer>>;
    /// Writes `src`'s elements into the positions `dst` addresses (same device, shape, dtype).
    fn assign(&self, dst: &Tensor, src: &Tensor) -> Result<()>;
    /// Waits for all work queued on `device`.
    fn synchronize(&self, device: Device) -> Result<()>;
}

static RUNTIME: RwLock<Option<Arc<dyn DeviceRuntime>>> = RwLock::new(None);

/// Installs the runtime that executes prims on non-CPU devices (kiln-cuda calls this from `init`).
/// A later registration replaces an earlier one.
pub fn register_runtime(rt: Arc<dyn DeviceRuntime>) {
    *RUNTIME.write().unwrap_or_else(|e| e.into_inner()) = Some(rt);
}

/// The runtime for `device`, or an error that says how to get one.
pub fn runtime_for(op: &'static str, device: Device) -> Result<Arc<dyn DeviceRuntime>> {
    RUNTIME
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .ok_or_else(|| Error::Device {
            op,
            lhs: Device::Cpu,
            rhs: device,
            msg: format!(
                "no runtime for {device} is registered: depend on the kiln-cuda crate and call \
                 kiln_cuda::init() (or kiln::cuda::init() through the facade) before using it"
            ),
        })
}

/// `torch.cuda.synchronize(device)`: waits for every op queued on `device`. A no-op on the CPU.
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        d => runtime_for("synchronize", d)?.synchronize(d),
    }
}
