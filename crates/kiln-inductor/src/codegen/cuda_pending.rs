//! Kernels whose units a staged prefetch is still loading (`cuda_prefetch.rs`; staged under
//! `KILN_PREFETCH_STAGED=1` only): a warm start's compile hands its executors these instead of
//! waiting for every unit, and each unit is resolved at its first launch, after the prefetch's
//! stage that loads it. The first graph's
//! units (a training step's forward) are loaded first, so its first launch comes once they are,
//! while the driver goes on loading the backward's units: DenseNet-121's training step waited
//! for all 36 units and every convolution module (14.4 ms into its warm start on the H200)
//! where its forward's first launch needs about half of them. Staged, the first launch came at
//! 12.3 ms, but the warm start's median did not show a gain (`cuda_prefetch::staged_on`).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use kiln_core::device::{DeviceKernel, DeviceRuntime};
use kiln_core::{Device, Error, Result};

/// One unit, resolved once: its kernels in its names' order, or why it could not be loaded.
struct PendingUnit {
    rt: Arc<dyn DeviceRuntime>,
    device: Device,
    /// The compile's units (shared, not copied: sources of hundreds of KB) and this one's index.
    units: Arc<Vec<(String, Vec<String>)>>,
    index: usize,
    /// Waits for the prefetch stage that loads the unit.
    wait: fn(),
    resolved: OnceLock<std::result::Result<Vec<Arc<dyn DeviceKernel>>, String>>,
}

impl PendingUnit {
    fn kernels(&self) -> Result<&[Arc<dyn DeviceKernel>]> {
        let resolved = self.resolved.get_or_init(|| {
            (self.wait)();
            // loaded by the prefetch, else loaded (or built) here
            let unit = &self.units[self.index];
            let mut loaded =
                super::cuda_units::load_now(&self.rt, self.device, std::slice::from_ref(unit))
                    .map_err(|e| e.to_string())?;
            unit.1
                .iter()
                .map(|n| {
                    loaded
                        .remove(n)
                        .ok_or_else(|| format!("kernel {n} not loaded"))
                })
                .collect()
        });
        match resolved {
            Ok(kernels) => Ok(kernels),
            Err(msg) => Err(Error::arg("kiln backend", msg.clone())),
        }
    }
}

/// A kernel of a pending unit: the unit is resolved at the first launch of any of its kernels.
struct PendingKernel {
    unit: Arc<PendingUnit>,
    index: usize,
}

impl DeviceKernel for PendingKernel {
    fn launch(&self, grid: [u32; 3], block: u32, shared: u32, params: &[u64]) -> Result<()> {
        let kernels = self.unit.kernels()?;
        let kernel = kernels.get(self.index).ok_or_else(|| {
            Error::arg("kiln backend", "a pending unit resolved to fewer kernels")
        })?;
        kernel.launch(grid, block, shared, params)
    }
}

/// Kernels by name for `units`, each resolved at its first launch: unit `i` after `first[i]`'s
/// stage of the prefetch (the first graph's, else all units).
pub(crate) fn kernels(
    rt: &Arc<dyn DeviceRuntime>,
    device: Device,
    units: &Arc<Vec<(String, Vec<String>)>>,
    first: &[bool],
) -> HashMap<String, Arc<dyn DeviceKernel>> {
    let mut out = HashMap::new();
    for (i, (unit, &is_first)) in units.iter().zip(first).enumerate() {
        let pending = Arc::new(PendingUnit {
            rt: rt.clone(),
            device,
            units: units.clone(),
            index: i,
            wait: match is_first {
                true => super::cuda_prefetch::wait_first,
                false => super::cuda_prefetch::wait_units,
            },
            resolved: OnceLock::new(),
        });
        for (index, name) in unit.1.iter().enumerate() {
            let kernel = PendingKernel {
                unit: pending.clone(),
                index,
            };
            out.insert(name.clone(), Arc::new(kernel) as Arc<dyn DeviceKernel>);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::test_runtime::{unit, Units};

    /// Nothing is loaded or built until a kernel launches; then its unit is, once for all of
    /// its kernels; a unit that cannot be built fails each launch with the build's error.
    #[test]
    fn units_resolve_at_their_first_launch_once() {
        let runtime = Arc::new(Units::default());
        let rt: Arc<dyn DeviceRuntime> = runtime.clone();
        let units = Arc::new(vec![
            unit("BUILT a", &["a0", "a1"]),
            unit("fresh b", &["b0"]),
            unit("BROKEN c", &["c0"]),
        ]);
        let ks = kernels(&rt, Device::Cuda(0), &units, &[true, false, false]);
        assert_eq!(ks.len(), 4);
        assert_eq!(*runtime.built_asked.lock().unwrap(), 0);
        let launch = |name: &str| ks[name].launch([1, 1, 1], 32, 0, &[]);
        launch("a0").unwrap();
        launch("a1").unwrap();
        assert_eq!(*runtime.built_asked.lock().unwrap(), 1);
        assert!(runtime.compiled.lock().unwrap().is_empty());
        launch("b0").unwrap();
        launch("b0").unwrap();
        assert_eq!(*runtime.built_asked.lock().unwrap(), 2);
        assert_eq!(*runtime.compiled.lock().unwrap(), ["fresh b"]);
        let first = launch("c0").unwrap_err().to_string();
        assert!(first.contains("NVRTC refused it"), "{first}");
        assert_eq!(launch("c0").unwrap_err().to_string(), first);
        // resolved once: the failed build is not retried
        assert_eq!(runtime.compiled.lock().unwrap().len(), 2);
    }
}
