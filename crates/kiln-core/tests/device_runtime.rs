//! Dispatch's routing to a registered device runtime, checked on any machine with a mock runtime
//! whose "device memory" is host memory and whose kernels are the CPU kernels. What is under test
//! is the core: which prims reach the runtime, views over device buffers, CPU scalars meeting device
//! tensors, value readers, autograd on device tensors.

#[path = "support/mock_device.rs"]
mod mock_device;

use kiln_core::{DType, Device, Tensor};
use mock_device::{execs_here, host_traffic, setup, uploaded_elements, DEV};

#[test]
fn prims_on_device_operands_run_on_the_runtime_and_views_do_not() {
    setup();
    let x = Tensor::from_vec((0..6).map(|v| v as f32).collect::<Vec<_>>(), &[2, 3]).unwrap();
    let d = x.to(DEV).unwrap();
    assert_eq!(d.device(), DEV);
    let before = execs_here();
    let v = d.t().unwrap().narrow(0, 1, 2).unwrap();
    assert_eq!(execs_here(), before, "views reached the runtime");
    assert!(v.shares_storage(&d));
    let y = v.exp().unwrap().add(&v).unwrap();
    assert!(execs_here() > before);
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

/// A Rust number against a device tensor is no device buffer: the runtime takes it by value
/// (PyTorch's wrapped numbers), one per call; a second scalar operand is uploaded.
#[test]
fn rust_numbers_ride_in_the_launch_as_values() {
    setup();
    let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], &[3]).unwrap();
    let d = x.to(DEV).unwrap();
    let (uploads, taken) = host_traffic();
    let y = d.mul(2.5).unwrap().add(1).unwrap().maximum(0.0).unwrap();
    assert_eq!(y.device(), DEV);
    assert_eq!(
        host_traffic(),
        (uploads, taken + 3),
        "uploads, scalars by value"
    );
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![3.5, 0.0, 8.5]);
    // both branches of `where` scalars: one by value, the other copied over
    let (uploads, taken) = host_traffic();
    let w = Tensor::where_(&d.gt(0.0).unwrap(), 1.0, -1.0).unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![1.0, -1.0, 1.0]);
    // gt's 0.0, where's first branch: by value; where's second branch: uploaded
    assert_eq!(host_traffic(), (uploads + 1, taken + 2));
    // a scalar broadcast to an empty shape, and an integer tensor's number
    let empty = Tensor::zeros(&[0, 3], DType::F32).unwrap().to(DEV).unwrap();
    assert_eq!(empty.mul(2.0).unwrap().shape(), &[0, 3]);
    let i = Tensor::from_vec(vec![7i64, -3], &[2])
        .unwrap()
        .to(DEV)
        .unwrap();
    assert_eq!(i.mul(3).unwrap().to_vec::<i64>().unwrap(), vec![21, -9]);

    // recorded ops take them by value too, and their backward computes with the saved scalars
    // (pow's moves its exponent to the device: on the CPU it would be broadcast to full size)
    let g = d.with_grad().unwrap();
    let (uploads, taken) = host_traffic();
    let y = g.mul(2.5).unwrap().maximum(0.0).unwrap();
    let p = g.pow(Tensor::scalar(2.0f32)).unwrap();
    assert_eq!(
        host_traffic(),
        (uploads, taken + 3),
        "uploads, scalars by value"
    );
    y.add(&p).unwrap().sum_all().unwrap().backward().unwrap();
    // d/dx (max(2.5x, 0) + x^2) = 2.5 [x > 0] + 2x
    assert_eq!(
        g.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![4.5, -4.0, 8.5]
    );
}

/// pow's backward computes with its exponent on the device: a number the forward took by value
/// goes over as its one element, not as a tensor of the operand's whole shape.
#[test]
fn a_scalar_exponent_crosses_over_as_one_element() {
    setup();
    let x = Tensor::from_vec((1..=1000).map(|v| v as f32 / 100.0).collect(), &[1000]).unwrap();
    let d = x.to(DEV).unwrap().with_grad().unwrap();
    let y = d.pow(3.0).unwrap().sum_all().unwrap();
    let before = uploaded_elements();
    y.backward().unwrap();
    assert!(
        uploaded_elements() - before <= 2,
        "{} elements uploaded by pow's backward",
        uploaded_elements() - before
    );
    let g = d.grad().unwrap().to_vec::<f32>().unwrap();
    // d/dx x^3 = 3 x^2
    assert!(
        (g[999] - 300.0).abs() < 1e-3 && (g[0] - 3e-4).abs() < 1e-8,
        "{g:?}"
    );
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
