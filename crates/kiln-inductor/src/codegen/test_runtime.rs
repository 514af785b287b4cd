//! A device runtime with no device, for the CPU tests of how units are loaded
//! (`cuda_units.rs`, `cuda_prefetch.rs`).

use std::sync::{Arc, Mutex};

use kiln_core::device::{BuiltUnits, DeviceBuffer, DeviceKernel, DeviceRuntime, Route};
use kiln_core::prim::{OutMeta, Prim};
use kiln_core::shape::Layout;
use kiln_core::storage::CpuStorage;
use kiln_core::{DType, Device, Result, Tensor};

/// A runtime whose units with "BUILT" in their source are built already; `load_kernels`
/// notes each unit it is asked to build and fails on a source with "BROKEN" in it; a unit's id
/// is "id:" and its source, and `prefetch_units` notes what it is asked to load.
/// A convolution `prepare` readied: its operands' shapes, the units prefetched by then, and
/// whether it was to run on generated kernels.
pub(crate) type Readied = (Vec<Vec<usize>>, usize, bool);

#[derive(Default)]
pub(crate) struct Units {
    pub built_asked: Mutex<usize>,
    pub compiled: Mutex<Vec<String>>,
    /// What `prefetch_units` was asked to load.
    pub prefetched: Mutex<Vec<(String, Vec<String>)>>,
    /// Each convolution `prepare` was asked to ready.
    pub prepared: Mutex<Vec<Readied>>,
}

struct NoOp;
impl DeviceKernel for NoOp {
    fn launch(&self, _: [u32; 3], _: u32, _: u32, _: &[u64]) -> Result<()> {
        Ok(())
    }
}

fn kernels(names: &[String]) -> Vec<Arc<dyn DeviceKernel>> {
    names
        .iter()
        .map(|_| Arc::new(NoOp) as Arc<dyn DeviceKernel>)
        .collect()
}

fn none<T>() -> Result<T> {
    Err(kiln_core::Error::arg("test runtime", "not a real device"))
}

impl DeviceRuntime for Units {
    fn name(&self) -> &'static str {
        "units"
    }
    fn upload(&self, _: Device, _: &CpuStorage) -> Result<Arc<dyn DeviceBuffer>> {
        none()
    }
    fn download(&self, _: &Arc<dyn DeviceBuffer>, _: &Layout) -> Result<CpuStorage> {
        none()
    }
    fn execute(
        &self,
        _: Device,
        _: &Prim,
        _: &[&Tensor],
        _: &OutMeta,
    ) -> Result<Arc<dyn DeviceBuffer>> {
        none()
    }
    fn assign(&self, _: &Tensor, _: &Tensor) -> Result<()> {
        none()
    }
    fn synchronize(&self, _: Device) -> Result<()> {
        Ok(())
    }
    fn empty(&self, _: Device, _: DType, _: usize) -> Result<Arc<dyn DeviceBuffer>> {
        none()
    }
    fn load_kernels(
        &self,
        _: Device,
        source: &str,
        names: &[String],
    ) -> Result<Vec<Arc<dyn DeviceKernel>>> {
        self.compiled.lock().unwrap().push(source.to_string());
        if source.contains("BROKEN") {
            return Err(kiln_core::Error::arg("test runtime", "NVRTC refused it"));
        }
        Ok(kernels(names))
    }
    fn load_built_units(&self, _: Device, units: &[(String, Vec<String>)]) -> Result<BuiltUnits> {
        *self.built_asked.lock().unwrap() += 1;
        Ok(units
            .iter()
            .map(|(src, names)| src.contains("BUILT").then(|| kernels(names)))
            .collect())
    }
    fn unit_id(&self, _: Device, source: &str) -> Option<String> {
        Some(format!("id:{source}"))
    }
    fn prefetch_units(&self, _: Device, ids: &[(String, Vec<String>)]) -> Result<()> {
        self.prefetched.lock().unwrap().extend_from_slice(ids);
        Ok(())
    }
    fn prepare(
        &self,
        _: Device,
        _: &Prim,
        shapes: &[&[usize]],
        _: &[DType],
        route: Route,
    ) -> Result<bool> {
        let generated = route == Route::Generated;
        let prefetched = self.prefetched.lock().unwrap().len();
        let shapes = shapes.iter().map(|s| s.to_vec()).collect();
        self.prepared
            .lock()
            .unwrap()
            .push((shapes, prefetched, generated));
        Ok(true)
    }
    fn multiprocessors(&self, _: Device) -> Result<u32> {
        Ok(1)
    }
}

pub(crate) fn unit(src: &str, names: &[&str]) -> (String, Vec<String>) {
    (
        src.to_string(),
        names.iter().map(|n| n.to_string()).collect(),
    )
}
