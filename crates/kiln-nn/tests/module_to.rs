//! `Module::to(device)` on any machine: a mock runtime whose "cuda:0" memory is host memory stands
//! in for the GPU (the real move is tested in kiln-cuda's gpu_ops). Checked here: names, values,
//! leaves with requires_grad, gradients, buffers, tied weights, what old handles see, and that a
//! module the move cannot fully reach is refused unchanged.

mod common;

#[path = "../../kiln-core/tests/support/mock_device.rs"]
mod mock_device;

use common::*;
use kiln_core::{DType, Device, Result, Tensor};
use kiln_nn::*;
use mock_device::{setup, DEV};

fn net() -> Sequential {
    Sequential::new()
        .add(Linear::new(3, 4, true).unwrap())
        .add(LayerNorm::new(&[4]).unwrap())
        .add(ReLU::new())
        .add(Linear::new(4, 2, false).unwrap())
}

fn named_values(v: Vec<(String, Tensor)>) -> Vec<(String, Vec<f64>)> {
    v.into_iter().map(|(n, t)| (n, f64s(&t))).collect()
}

#[test]
fn parameters_and_buffers_move_under_the_same_names_as_leaves() {
    setup();
    let mut m = Sequential::new()
        .add(Conv2d::new(2, 3, [3, 3], Conv2dConfig::default()).unwrap())
        .add(BatchNorm2d::new(3).unwrap());
    let params = named_values(m.named_parameters());
    let buffers = named_values(m.named_buffers());
    m.to(DEV).unwrap();
    assert_eq!(named_values(m.named_parameters()), params);
    assert_eq!(named_values(m.named_buffers()), buffers);
    for (name, p) in m.named_parameters() {
        assert_eq!(p.device(), DEV, "{name}");
        assert!(
            p.requires_grad() && p.is_leaf(),
            "{name} is no longer a leaf parameter"
        );
    }
    for (name, b) in m.named_buffers() {
        assert_eq!(b.device(), DEV, "{name}");
        assert!(!b.requires_grad(), "{name}");
    }
    // and back
    m.to(Device::Cpu).unwrap();
    assert!(m.parameters().iter().all(|p| p.device() == Device::Cpu));
    assert_eq!(named_values(m.named_parameters()), params);
}

#[test]
fn forward_and_backward_run_on_the_device_after_the_move() {
    setup();
    let mut m = net();
    let x = tensor_f32(&values(6, 1, 1.0), &[2, 3]);
    let want = f64s(&m.forward(&x).unwrap());
    m.to(DEV).unwrap();
    let y = m.forward(&x.to(DEV).unwrap()).unwrap();
    assert_eq!(y.device(), DEV);
    assert_close(&f64s(&y), &want, 1e-6);
    y.sum_all().unwrap().backward().unwrap();
    for (name, p) in m.named_parameters() {
        let g = p.grad().unwrap_or_else(|| panic!("{name} has no gradient"));
        assert_eq!(g.device(), DEV, "{name}");
    }
}

#[test]
fn gradients_move_with_their_parameters() {
    setup();
    let mut m = Linear::new(3, 2, true).unwrap();
    let g = tensor_f32(&values(6, 2, 1.0), &[2, 3]);
    m.weight.set_grad(Some(g.clone()));
    m.to(DEV).unwrap();
    let moved = m.weight.grad().expect("the gradient was dropped");
    assert_eq!(moved.device(), DEV);
    assert_eq!(f64s(&moved), f64s(&g));
    assert!(m.bias.as_ref().unwrap().grad().is_none());
}

struct Tied {
    a: Linear,
    b: Linear,
    training: TrainFlag,
}

impl Module for Tied {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.b.forward(&self.a.forward(x)?)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("a".into(), &self.a as &dyn Module), ("b".into(), &self.b)]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("a".into(), &mut self.a as &mut dyn Module),
            ("b".into(), &mut self.b),
        ]
    }
}

#[test]
fn tied_weights_stay_one_tensor() {
    setup();
    let a = Linear::new(3, 3, false).unwrap();
    let mut b = Linear::new(3, 3, false).unwrap();
    b.weight = a.weight.clone();
    let mut m = Tied {
        a,
        b,
        training: TrainFlag::default(),
    };
    assert_eq!(m.named_parameters().len(), 1);
    m.to(DEV).unwrap();
    assert_eq!(m.a.weight.device(), DEV);
    assert_eq!(m.a.weight.id(), m.b.weight.id(), "the tie was broken");
    assert_eq!(m.named_parameters().len(), 1);
}

#[test]
fn handles_taken_before_the_move_keep_the_old_copy() {
    // documented: the module gets new handles (move the model before building its optimizer)
    setup();
    let mut m = Linear::new(3, 2, true).unwrap();
    let old = m.parameters();
    m.to(DEV).unwrap();
    assert!(old.iter().all(|p| p.device() == Device::Cpu));
    assert!(m.parameters().iter().all(|p| p.device() == DEV));
}

#[test]
fn a_tensor_already_on_the_device_keeps_its_handle() {
    setup();
    let mut m = net();
    m.to(DEV).unwrap();
    let ids: Vec<u64> = m.parameters().iter().map(|p| p.id()).collect();
    m.to(DEV).unwrap();
    assert_eq!(
        m.parameters().iter().map(|p| p.id()).collect::<Vec<_>>(),
        ids
    );
}

/// Lists a tensor through `visit_own` but gives no mutable access to it.
struct Opaque {
    scale: Tensor,
    inner: Linear,
    training: TrainFlag,
}

impl Module for Opaque {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.inner.forward(x)?.mul(&self.scale)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn visit_own(&self, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f("scale", &self.scale, TensorKind::Parameter);
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("inner".into(), &self.inner as &dyn Module)]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![("inner".into(), &mut self.inner as &mut dyn Module)]
    }
}

#[test]
fn a_module_without_mutable_visitors_is_refused_unchanged() {
    setup();
    let mut m = Opaque {
        scale: init::parameter(Tensor::ones(&[2], DType::F32).unwrap()).unwrap(),
        inner: Linear::new(3, 2, true).unwrap(),
        training: TrainFlag::default(),
    };
    let ids: Vec<u64> = m.parameters().iter().map(|p| p.id()).collect();
    let err = m.to(DEV).unwrap_err().to_string();
    assert!(err.contains("Module::to"), "{err}");
    assert!(
        err.contains("\"scale\""),
        "names the unreached tensor: {err}"
    );
    assert!(
        err.contains("visit_own_mut"),
        "says what to implement: {err}"
    );
    assert_eq!(
        m.parameters().iter().map(|p| p.id()).collect::<Vec<_>>(),
        ids
    );
    assert!(m.parameters().iter().all(|p| p.device() == Device::Cpu));
}
