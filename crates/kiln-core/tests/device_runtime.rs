//! Dispatch's routing to a registered device runtime, checked on any machine with a mock runtime
//! whose "device memory" is host memory and whose kernels are the CPU kernels. What is under test
//! is the core: which prims reach the runtime, views over device buffers, CPU scalars meeting device
//! tensors, value readers, autograd on device tensors.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kiln_core::device::{register_runtime, DeviceBuffer, DeviceRuntime};
use kiln_core::prim::{OutMeta, Prim};
use kiln_core::shape::Layout;
use kiln_core::storage::CpuStorage;
use kiln_core::{DType, Device, Error, Result, Tensor};

const DEV: Device = Device::Cuda(0);

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
    fn as_any(&self) -> &dyn Any {
        self
    }
}

static EXECS: AtomicUsize = AtomicUsize::new(0);

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
        EXECS.fetch_add(1, Ordering::SeqCst);
        let host = inputs
            .iter()
            .map(|t| {
                let buf = t
                    .device_buffer()
                    .ok_or_else(|| Error::unsupported("mock", "host operand"))?;
                Tensor::from_storage(read(buf, t.layout())?, t.shape())
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = host.iter().collect();
        let out = kiln_core::no_grad(|| kiln_core::dispatch::apply(prim.clone(), &refs))?;
        self.upload(DEV, &kiln_core::cpu::materialize(&out))
    }
    fn assign(&self, _: &Tensor, _: &Tensor) -> Result<()> {
        Err(Error::unsupported("mock", "assign"))
    }
    fn synchronize(&self, _: Device) -> Result<()> {
        Ok(())
    }
}

fn setup() {
    register_runtime(Arc::new(Mock));
}

#[test]
fn prims_on_device_operands_run_on_the_runtime_and_views_do_not() {
    setup();
    let x = Tensor::from_vec((0..6).map(|v| v as f32).collect::<Vec<_>>(), &[2, 3]).unwrap();
    let d = x.to(DEV).unwrap();
    assert_eq!(d.device(), DEV);
    let before = EXECS.load(Ordering::SeqCst);
    let v = d.t().unwrap().narrow(0, 1, 2).unwrap();
    assert_eq!(
        EXECS.load(Ordering::SeqCst),
        before,
        "views reached the runtime"
    );
    assert!(v.shares_storage(&d));
    let y = v.exp().unwrap().add(&v).unwrap();
    assert!(EXECS.load(Ordering::SeqCst) > before);
    assert_eq!(y.device(), DEV);
    let want = x.t().unwrap().narrow(0, 1, 2).unwrap();
    let want = want.exp().unwrap().add(&want).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
    assert_eq!(y.to(Device::Cpu).unwrap().device(), Device::Cpu);
    // readers: item, display, into_vec
    assert_eq!(d.sum_all().unwrap().item::<f32>().unwrap(), 15.0);
    assert!(format!("{d}").contains("5."));
    assert_eq!(d.clone().into_vec::<f32>().unwrap().len(), 6);
}

#[test]
fn scalars_and_like_constructors_follow_the_device() {
    setup();
    let d = Tensor::ones(&[3], DType::F32).unwrap().to(DEV).unwrap();
    assert_eq!(d.mul(2.0).unwrap().device(), DEV);
    assert_eq!(Tensor::zeros_like(&d).unwrap().device(), DEV);
    // a CPU 0-dim tensor meets a device tensor as PyTorch's CPU scalar does
    let s = Tensor::scalar(3.0f32);
    assert_eq!(d.mul(&s).unwrap().to_vec::<f32>().unwrap(), vec![3.0; 3]);
    // a CPU tensor with several elements is a device mismatch naming both devices
    let c = Tensor::ones(&[3], DType::F32).unwrap();
    let err = d.add(&c).unwrap_err().to_string();
    assert!(err.contains("Cuda(0)") && err.contains("Cpu"), "{err}");
}

#[test]
fn autograd_runs_on_the_device() {
    setup();
    let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], &[3]).unwrap();
    let d = x.to(DEV).unwrap().with_grad().unwrap();
    let loss = d.mul(&d).unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let g = d.grad().unwrap();
    assert_eq!(g.device(), DEV);
    assert_eq!(g.to_vec::<f32>().unwrap(), vec![2.0, -4.0, 6.0]);
}
