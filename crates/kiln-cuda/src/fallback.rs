//! The host path for prims without a CUDA kernel yet (and ranks above the kernels' limit): operands
//! are copied to the host, the CPU kernel runs, the result is copied back. Correct but slow (two
//! synchronizing copies); `host_fallbacks()` counts each use so tests and users can see it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kiln_core::device::DeviceBuffer;
use kiln_core::prim::Prim;
use kiln_core::{Device, Result, Tensor};

use crate::device::CudaDevice;

static USES: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

/// How often each prim took the host path in this process.
pub fn host_fallbacks() -> Vec<(&'static str, u64)> {
    USES.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(k, v)| (*k, *v))
        .collect()
}

pub(crate) fn run(
    dev: &Arc<CudaDevice>,
    prim: &Prim,
    inputs: &[&Tensor],
) -> Result<Arc<dyn DeviceBuffer>> {
    *USES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(prim.name())
        .or_default() += 1;
    let host: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_device(Device::Cpu))
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = host.iter().collect();
    let out = kiln_core::no_grad(|| kiln_core::dispatch::apply(prim.clone(), &refs))?;
    let data = kiln_core::cpu::materialize(&out);
    Ok(Arc::new(dev.upload(&data)?))
}
