//! A mock device runtime for tests on machines without a GPU: "device memory" is host memory and
//! its kernels are the CPU kernels. Shared by kiln-core's dispatch tests and the facade's capture
//! tests (included with `#[path]`).

#![allow(dead_code)] // each test binary uses part of it

use std::any::Any;
use std::cell::Cell;
use std::sync::{Arc, Mutex};

use kiln_core::device::{register_runtime, DeviceBuffer, DeviceKernel, DeviceRuntime};
use kiln_core::prim::{OutMeta, Prim};
use kiln_core::shape::Layout;
use kiln_core::storage::CpuStorage;
use kiln_core::{DType, Device, Error, Result, Tensor};

pub const DEV: Device = Device::Cuda(0);

struct HostBuf(Mutex<CpuStorage>);

impl DeviceBuffer for HostBuf {
    fn device(&self) -> Device {
        DEV
    }
    fn dtype(&self) -> DType {
        self.0.lock().unwrap().dtype()
    }
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn address(&self) -> u64 {
        // a stand-in address: distinct buffers never compare as overlapping
        self as *const HostBuf as u64
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

thread_local! {
    /// This thread's uploads, the CPU scalars its calls took by value and its prims executed
    /// (thread-local: a test counts its own calls while others run beside it).
    static UPLOADS: Cell<usize> = const { Cell::new(0) };
    static HOST_SCALARS: Cell<usize> = const { Cell::new(0) };
    static EXECS_HERE: Cell<usize> = const { Cell::new(0) };
    static UPLOADED_ELEMENTS: Cell<usize> = const { Cell::new(0) };
}

/// Elements this thread's uploads copied to the mock.
pub fn uploaded_elements() -> usize {
    UPLOADED_ELEMENTS.get()
}

/// The prims this thread's calls executed on the mock.
pub fn execs_here() -> usize {
    EXECS_HERE.get()
}

/// (uploads, CPU scalars taken by value) on this thread so far.
pub fn host_traffic() -> (usize, usize) {
    (UPLOADS.get(), HOST_SCALARS.get())
}

struct Mock;

fn read(buf: &Arc<dyn DeviceBuffer>, layout: &Layout) -> Result<CpuStorage> {
    let b = buf
        .as_any()
        .downcast_ref::<HostBuf>()
        .ok_or_else(|| Error::unsupported("mock", "foreign buffer"))?;
    let s = b.0.lock().unwrap();
    let mut vals = Vec::new();
    layout.for_each_offset(|o| vals.push(s.get_f64(o)));
    Ok(CpuStorage::from_f64s(s.dtype(), vals.into_iter()))
}

impl DeviceRuntime for Mock {
    fn name(&self) -> &'static str {
        "mock"
    }
    fn upload(&self, _: Device, data: &CpuStorage) -> Result<Arc<dyn DeviceBuffer>> {
        UPLOADS.set(UPLOADS.get() + 1);
        UPLOADED_ELEMENTS.set(UPLOADED_ELEMENTS.get() + data.len());
        Ok(Arc::new(HostBuf(Mutex::new(data.clone()))))
    }
    fn download(&self, buf: &Arc<dyn DeviceBuffer>, layout: &Layout) -> Result<CpuStorage> {
        read(buf, layout)
    }
    fn execute(
        &self,
        _: Device,
        prim: &Prim,
        inputs: &[&Tensor],
        _: &OutMeta,
    ) -> Result<Arc<dyn DeviceBuffer>> {
        EXECS_HERE.set(EXECS_HERE.get() + 1);
        let host = inputs
            .iter()
            .map(|t| {
                if t.device() == Device::Cpu {
                    // a scalar taken by value (`takes_host_scalar`)
                    HOST_SCALARS.set(HOST_SCALARS.get() + 1);
                    t.host_scalar_f64()?;
                    return Ok((*t).clone());
                }
                let buf = t
                    .device_buffer()
                    .ok_or_else(|| Error::unsupported("mock", "host operand"))?;
                Tensor::from_storage(read(buf, t.layout())?, t.shape())
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = host.iter().collect();
        let out = kiln_core::no_grad(|| kiln_core::dispatch::apply(prim.clone(), &refs))?;
        let out = kiln_core::cpu::materialize(&out);
        Ok(Arc::new(HostBuf(Mutex::new(out))))
    }
    /// As kiln-cuda: a binary op's or `where`'s scalar operand.
    fn takes_host_scalar(&self, _: Device, prim: &Prim, _: &Tensor) -> bool {
        matches!(prim, Prim::Binary(_) | Prim::Where)
    }
    fn assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let sbuf = src
            .device_buffer()
            .ok_or_else(|| Error::unsupported("mock", "host source"))?;
        let vals = read(sbuf, src.layout())?;
        let dbuf = dst
            .device_buffer()
            .and_then(|b| b.as_any().downcast_ref::<HostBuf>())
            .ok_or_else(|| Error::unsupported("mock", "foreign destination"))?;
        let mut d = dbuf.0.lock().unwrap();
        let mut all: Vec<f64> = (0..d.len()).map(|i| d.get_f64(i)).collect();
        let mut k = 0;
        dst.layout().for_each_offset(|o| {
            all[o] = vals.get_f64(k);
            k += 1;
        });
        *d = CpuStorage::from_f64s(d.dtype(), all.into_iter());
        Ok(())
    }
    fn synchronize(&self, _: Device) -> Result<()> {
        Ok(())
    }
    fn empty(&self, _: Device, dtype: DType, len: usize) -> Result<Arc<dyn DeviceBuffer>> {
        Ok(Arc::new(HostBuf(Mutex::new(CpuStorage::full(
            dtype, len, 0.0,
        )))))
    }
    fn load_kernels(&self, _: Device, _: &str, _: &[String]) -> Result<Vec<Arc<dyn DeviceKernel>>> {
        Err(Error::unsupported(
            "mock",
            "the mock device runs no generated kernels",
        ))
    }
    /// One, or `KILN_MOCK_SMS` (to generate the kernels a given GPU would get, e.g. 132 for an
    /// H100: split reductions and launch shapes depend on the count).
    fn multiprocessors(&self, _: Device) -> Result<u32> {
        Ok(std::env::var("KILN_MOCK_SMS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1))
    }
    /// 48 KiB, or `KILN_MOCK_SHARED` bytes (232448 for an H100's opt-in limit).
    fn shared_memory_per_block(&self, _: Device) -> Result<u32> {
        Ok(std::env::var("KILN_MOCK_SHARED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(48 << 10))
    }
}

/// Registers the mock as the device runtime (idempotent).
pub fn setup() {
    register_runtime(Arc::new(Mock));
}
