//! Dispatch's routing to a registered device runtime, checked on any machine with a mock runtime
//! whose "device memory" is host memory and whose kernels are the CPU kernels. What is under test
//! is the core: which prims reach the runtime, views over device buffers, CPU scalars meeting device
//! tensors, value readers, autograd on device tensors.

#[path = "support/mock_device.rs"]
mod mock_device;

use std::sync::atomic::Ordering;

use kiln_core::{DType, Device, Tensor};
use mock_device::{setup, DEV, EXECS};

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
    // in any operand position: the op runs on the device
    let first = Tensor::scalar(10.0f32).sub(&d).unwrap();
    assert_eq!(first.device(), DEV);
    assert_eq!(first.to_vec::<f32>().unwrap(), vec![9.0; 3]);
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

#[test]
fn assign_many_writes_every_pair_as_assign_would() {
    setup();
    let seq = |n: usize, at: f32| (0..n).map(|v| at + v as f32).collect::<Vec<_>>();
    // device destinations (one a strided view), a host destination, a source of another dtype
    // and one on the host
    let a = Tensor::zeros(&[2, 3], DType::F32).unwrap().to(DEV).unwrap();
    let b_base = Tensor::zeros(&[4, 2], DType::F32).unwrap().to(DEV).unwrap();
    let b = b_base.t().unwrap(); // [2, 4], not contiguous
    let c = Tensor::zeros(&[3], DType::F32).unwrap();
    let d = Tensor::zeros(&[2], DType::F32).unwrap().to(DEV).unwrap();
    let sa = Tensor::from_vec(seq(6, 1.0), &[2, 3])
        .unwrap()
        .to(DEV)
        .unwrap();
    let sb = Tensor::from_vec(seq(8, 10.0), &[2, 4])
        .unwrap()
        .to(DEV)
        .unwrap();
    let sc = Tensor::from_vec(seq(3, 20.0), &[3])
        .unwrap()
        .to(DEV)
        .unwrap();
    let sd = Tensor::from_vec(vec![7i64, 8], &[2]).unwrap();
    Tensor::assign_many(&[(&a, &sa), (&b, &sb), (&c, &sc), (&d, &sd)]).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), seq(6, 1.0));
    assert_eq!(b.to_vec::<f32>().unwrap(), seq(8, 10.0));
    assert_eq!(c.to_vec::<f32>().unwrap(), seq(3, 20.0));
    assert_eq!(d.to_vec::<f32>().unwrap(), vec![7.0, 8.0]);
    assert_eq!(
        (a.device(), c.device(), d.dtype()),
        (DEV, Device::Cpu, DType::F32)
    );
}

#[test]
fn assign_many_checks_every_pair_before_writing_any() {
    setup();
    let a = Tensor::zeros(&[3], DType::F32).unwrap().to(DEV).unwrap();
    let b = Tensor::zeros(&[2], DType::F32).unwrap().to(DEV).unwrap();
    let ones = Tensor::ones(&[3], DType::F32).unwrap().to(DEV).unwrap();
    // the second pair's shapes differ: the first pair must not have been written
    let err = Tensor::assign_many(&[(&a, &ones), (&b, &ones)])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("assign_many") && err.contains("pair 1") && err.contains("[3]"),
        "{err}"
    );
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![0.0; 3]);
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![0.0; 2]);
}
