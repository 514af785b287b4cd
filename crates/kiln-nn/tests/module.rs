//! The Module contract: PyTorch's names and shapes, init, state dicts, train/eval, zero_grad.

mod common;

use common::*;
use kiln_core::{DType, Result, Tensor};
use kiln_nn::*;

fn small_cnn() -> Sequential {
    Sequential::new()
        .add(Conv2d::new(3, 8, [3, 3], Conv2dConfig::default()).unwrap())
        .add(BatchNorm2d::new(8).unwrap())
        .add(ReLU::new())
        .add(Flatten::default())
        .add(Linear::new(8 * 4 * 4, 10, true).unwrap())
}

fn keys_shapes(v: &[(String, Tensor)]) -> Vec<(String, Vec<usize>)> {
    v.iter()
        .map(|(k, t)| (k.clone(), t.shape().to_vec()))
        .collect()
}

fn owned(v: &[(&str, &[usize])]) -> Vec<(String, Vec<usize>)> {
    v.iter().map(|(k, s)| (k.to_string(), s.to_vec())).collect()
}

#[test]
fn sequential_names_and_shapes_match_pytorch() {
    let m = small_cnn();
    // torch: [(k, tuple(v.shape)) for k, v in m.named_parameters()]
    assert_eq!(
        keys_shapes(&m.named_parameters()),
        owned(&[
            ("0.weight", &[8, 3, 3, 3]),
            ("0.bias", &[8]),
            ("1.weight", &[8]),
            ("1.bias", &[8]),
            ("4.weight", &[10, 128]),
            ("4.bias", &[10]),
        ])
    );
    // torch: list(m.state_dict().keys()) — parameters then buffers, per module
    let sd = m.state_dict();
    assert_eq!(
        sd.keys().collect::<Vec<_>>(),
        [
            "0.weight",
            "0.bias",
            "1.weight",
            "1.bias",
            "1.running_mean",
            "1.running_var",
            "1.num_batches_tracked",
            "4.weight",
            "4.bias"
        ]
    );
    assert_eq!(
        sd.get("1.num_batches_tracked").unwrap().shape(),
        &[] as &[usize]
    );
    assert_eq!(
        keys_shapes(&m.named_buffers())
            .iter()
            .map(|(k, _)| k.as_str())
            .collect::<Vec<_>>(),
        ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    );
    assert_eq!(m.num_parameters(), 8 * 27 + 8 + 16 + 1280 + 10);
    assert!(m
        .parameters()
        .iter()
        .all(|p| p.requires_grad() && p.is_leaf()));
    assert!(m.buffers().iter().all(|b| !b.requires_grad()));
    let y = m
        .forward(&Tensor::randn(&[2, 3, 6, 6], DType::F32).unwrap())
        .unwrap();
    assert_eq!(y.shape(), &[2, 10]);
}

/// A user module with named children, as a PyTorch user would write it.
struct Block {
    linear1: Linear,
    norm: LayerNorm,
    training: TrainFlag,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.norm.forward(&self.linear1.forward(x)?.relu()?)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("linear1".into(), &self.linear1 as &dyn Module),
            ("norm".into(), &self.norm),
        ]
    }
}

struct Model {
    embed: Embedding,
    layers: ModuleList,
    scale: Tensor,
    training: TrainFlag,
}

impl Module for Model {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.embed.forward(x)?;
        for l in self.layers.iter() {
            h = l.forward(&h)?;
        }
        h.mul(&self.scale)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn visit_own(&self, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f("scale", &self.scale, TensorKind::Parameter);
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("embed".into(), &self.embed as &dyn Module),
            ("layers".into(), &self.layers),
        ]
    }
}

fn model() -> Model {
    let mut layers = ModuleList::new();
    for _ in 0..2 {
        layers.push(Block {
            linear1: Linear::new(4, 4, true).unwrap(),
            norm: LayerNorm::new(&[4]).unwrap(),
            training: TrainFlag::default(),
        });
    }
    Model {
        embed: Embedding::new(7, 4).unwrap(),
        layers,
        scale: init::parameter(Tensor::ones(&[4], DType::F32).unwrap()).unwrap(),
        training: TrainFlag::default(),
    }
}

#[test]
fn nested_dotted_names() {
    let m = model();
    let names: Vec<String> = m.named_parameters().into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        names,
        [
            "scale",
            "embed.weight",
            "layers.0.linear1.weight",
            "layers.0.linear1.bias",
            "layers.0.norm.weight",
            "layers.0.norm.bias",
            "layers.1.linear1.weight",
            "layers.1.linear1.bias",
            "layers.1.norm.weight",
            "layers.1.norm.bias",
        ]
    );
    let idx = Tensor::from_vec(vec![1i64, 6, 3], &[3]).unwrap();
    assert_eq!(m.forward(&idx).unwrap().shape(), &[3, 4]);
}

#[test]
fn default_initialisation_bounds() {
    let lin = Linear::new(100, 300, true).unwrap();
    let bound = 1.0 / 100f64.sqrt();
    for t in [&lin.weight, lin.bias.as_ref().unwrap()] {
        let v = f64s(t);
        let max = v.iter().fold(0.0f64, |a, b| a.max(b.abs()));
        assert!(max <= bound + 1e-7, "{max} > {bound}");
        assert!(max > 0.9 * bound, "values should fill the range");
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.1 * bound);
    }
    // Conv2d fan_in = in/groups * kh * kw
    let conv = Conv2d::new(8, 16, [3, 2], Conv2dConfig::default().groups(2)).unwrap();
    assert_eq!(conv.weight.shape(), &[16, 4, 3, 2]);
    let bound = 1.0 / 24f64.sqrt();
    for t in [&conv.weight, conv.bias.as_ref().unwrap()] {
        let max = f64s(t).iter().fold(0.0f64, |a, b| a.max(b.abs()));
        assert!(max <= bound + 1e-7 && max > 0.8 * bound);
    }
    // Embedding ~ N(0, 1)
    let e = f64s(&Embedding::new(100, 50).unwrap().weight);
    let mean = e.iter().sum::<f64>() / e.len() as f64;
    let var = e.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / e.len() as f64;
    assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.1, "{mean} {var}");
    // norms: weight 1, bias 0; running stats 0 / 1
    let bn = BatchNorm2d::new(3).unwrap();
    let sd = bn.state_dict();
    assert_eq!(f64s(sd.get("weight").unwrap()), vec![1.0; 3]);
    assert_eq!(f64s(sd.get("bias").unwrap()), vec![0.0; 3]);
    assert_eq!(f64s(sd.get("running_mean").unwrap()), vec![0.0; 3]);
    assert_eq!(f64s(sd.get("running_var").unwrap()), vec![1.0; 3]);
    let ln = LayerNorm::new(&[2, 2]).unwrap();
    assert_eq!(f64s(ln.weight.as_ref().unwrap()), vec![1.0; 4]);
    assert_eq!(f64s(ln.bias.as_ref().unwrap()), vec![0.0; 4]);
}

fn snapshot(m: &dyn Module) -> Vec<(String, Vec<f64>)> {
    m.state_dict()
        .iter()
        .map(|(k, t)| (k.to_string(), f64s(t)))
        .collect()
}

#[test]
fn load_state_dict_copies_in_place() {
    let a = small_cnn();
    let b = small_cnn();
    let ids: Vec<u64> = b.parameters().iter().map(|p| p.id()).collect();
    b.load_state_dict(&a.state_dict(), true).unwrap();
    assert_eq!(snapshot(&a), snapshot(&b));
    // identity kept: the same parameter handles now hold a's values
    assert_eq!(
        ids,
        b.parameters().iter().map(|p| p.id()).collect::<Vec<_>>()
    );
    assert!(b.parameters().iter().all(|p| p.requires_grad()));
}

#[test]
fn load_state_dict_errors_leave_module_unchanged() {
    let m = small_cnn();
    let before = snapshot(&m);
    let good = small_cnn().state_dict();

    // missing key
    let mut sd = good.clone();
    sd.remove("4.bias");
    let err = m.load_state_dict(&sd, true).unwrap_err().to_string();
    assert!(
        err.contains("Missing key(s)") && err.contains("\"4.bias\""),
        "{err}"
    );
    assert_eq!(snapshot(&m), before);

    // shape mismatch on one key, every other key valid: nothing is applied
    let mut sd = good.clone();
    sd.insert("0.bias", Tensor::zeros(&[7], DType::F32).unwrap());
    let err = m.load_state_dict(&sd, true).unwrap_err().to_string();
    assert!(
        err.contains("size mismatch for 0.bias") && err.contains("[7]") && err.contains("[8]"),
        "{err}"
    );
    assert_eq!(snapshot(&m), before);
    // ... also when not strict
    assert!(m.load_state_dict(&sd, false).is_err());
    assert_eq!(snapshot(&m), before);

    // unexpected key
    let mut sd = good.clone();
    sd.insert("9.weight", Tensor::zeros(&[1], DType::F32).unwrap());
    let err = m.load_state_dict(&sd, true).unwrap_err().to_string();
    assert!(
        err.contains("Unexpected key(s)") && err.contains("\"9.weight\""),
        "{err}"
    );
    assert_eq!(snapshot(&m), before);

    // non-strict: missing and unexpected keys are tolerated, the rest is loaded
    sd.remove("4.bias");
    m.load_state_dict(&sd, false).unwrap();
    let after = snapshot(&m);
    for (k, v) in &after {
        if k == "4.bias" {
            assert_eq!(v, &before.iter().find(|(n, _)| n == k).unwrap().1);
        } else {
            assert_eq!(v, &f64s(good.get(k).unwrap()), "{k}");
        }
    }
}

#[test]
fn train_eval_propagates_and_changes_behaviour() {
    let m = Sequential::new()
        .add(BatchNorm2d::new(2).unwrap())
        .add(Dropout::new(0.5).unwrap());
    assert!(m.is_training() && m[0].is_training() && m[1].is_training());
    let x = tensor_f32(&values(2 * 2 * 3 * 3, 5, 1.0), &[2, 2, 3, 3]);

    m.eval();
    assert!(!m.is_training() && !m[0].is_training() && !m[1].is_training());
    // eval: BN uses running stats (0, 1): y = x / sqrt(1 + eps); dropout is the identity
    let y = f64s(&m.forward(&x).unwrap());
    let want: Vec<f64> = f64s(&x)
        .iter()
        .map(|v| v / (1.0f64 + 1e-5).sqrt())
        .collect();
    assert_close(&y, &want, 1e-6);
    assert_eq!(
        f64s(&m.state_dict().get("0.num_batches_tracked").unwrap().clone()),
        vec![0.0]
    );

    m.train(true);
    assert!(m[1].is_training());
    let y = f64s(&m.forward(&x).unwrap());
    assert!(
        y.iter().filter(|&&v| v == 0.0).count() > 3,
        "dropout is active in training"
    );
    assert_eq!(
        f64s(m.state_dict().get("0.num_batches_tracked").unwrap()),
        vec![1.0]
    );
}

#[test]
fn zero_grad_clears_gradients() {
    let m = small_cnn();
    let y = m
        .forward(&Tensor::randn(&[2, 3, 6, 6], DType::F32).unwrap())
        .unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert!(m.parameters().iter().all(|p| p.grad().is_some()));
    m.zero_grad();
    assert!(m.parameters().iter().all(|p| p.grad().is_none()));
}

/// Weight tying: one tensor under two names.
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
}

#[test]
fn tied_parameters_listed_once_saved_twice() {
    let a = Linear::new(3, 3, false).unwrap();
    let mut b = Linear::new(3, 3, false).unwrap();
    b.weight = a.weight.clone();
    let t = Tied {
        a,
        b,
        training: TrainFlag::default(),
    };
    let names: Vec<String> = t.named_parameters().into_iter().map(|(k, _)| k).collect();
    assert_eq!(names, ["a.weight"]);
    assert_eq!(
        t.state_dict().keys().collect::<Vec<_>>(),
        ["a.weight", "b.weight"]
    );
}

// ---- Module::to without a device runtime (the moves themselves: tests/module_to.rs) ----

#[test]
fn to_a_device_without_its_runtime_errs_naming_the_tensor_and_changes_nothing() {
    let mut m = small_cnn();
    let ids: Vec<u64> = m.parameters().iter().map(|p| p.id()).collect();
    let err = m.to(kiln_core::Device::Cuda(0)).unwrap_err().to_string();
    assert!(err.contains("Module::to"), "{err}");
    assert!(err.contains("`0.weight`"), "names the first tensor: {err}");
    assert!(err.contains("kiln_cuda::init"), "says what to do: {err}");
    assert_eq!(
        m.parameters().iter().map(|p| p.id()).collect::<Vec<_>>(),
        ids
    );
    assert!(m
        .parameters()
        .iter()
        .all(|p| p.device() == kiln_core::Device::Cpu));
}

#[test]
fn to_the_device_a_module_is_on_keeps_every_handle() {
    let mut m = small_cnn();
    let before: Vec<u64> = m.parameters().iter().map(|p| p.id()).collect();
    m.to(kiln_core::Device::Cpu).unwrap();
    assert_eq!(
        m.parameters().iter().map(|p| p.id()).collect::<Vec<_>>(),
        before
    );
}
