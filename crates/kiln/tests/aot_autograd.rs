//! AOT autograd (issue 4): compiled backward graphs. The default backend (`aot_eager`) derives the
//! backward at compile time; these tests compare its gradients, training steps and memory with eager.

use std::sync::{Arc, Mutex};

use kiln::autograd::saved_bytes;
use kiln::compiler::aot::AotBackend;
use kiln::compiler::backends::EagerBackend;
use kiln::nn::optim::{Optimizer, SGDConfig, SGD};
use kiln::nn::{
    BatchNorm2d, Conv2d, Conv2dConfig, Dropout, Flatten, Linear, MaxPool2d, Module, ReLU,
    Sequential,
};
use kiln::prelude::*;
use kiln::{compile_fn, Backend, BackendContext, CompiledGraph, Graph};

fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
    assert_eq!(a.shape(), b.shape(), "{what}: shapes");
    let (x, y) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        assert!(
            (p - q).abs() <= tol * (1.0 + q.abs()),
            "{what}[{i}]: compiled {p} vs eager {q}"
        );
    }
}

fn cnn() -> Result<Sequential> {
    Ok(Sequential::new()
        .add(Conv2d::new(
            1,
            8,
            [3, 3],
            Conv2dConfig::default().padding(1),
        )?)
        .add(BatchNorm2d::new(8)?)
        .add(ReLU::new())
        .add(MaxPool2d::new(2)?)
        .add(Conv2d::new(
            8,
            16,
            [3, 3],
            Conv2dConfig::default().padding(1),
        )?)
        .add(BatchNorm2d::new(16)?)
        .add(ReLU::new())
        .add(Flatten::new(1, -1))
        .add(Linear::new(16 * 4 * 4, 10, true)?))
}

/// A copy of the module's state (`state_dict` hands out live handles).
fn snapshot(m: &dyn Module) -> Result<kiln::nn::StateDict> {
    let mut sd = kiln::nn::StateDict::new();
    for (k, t) in m.state_dict().iter() {
        let c = Tensor::zeros_like(t)?;
        c.assign(t)?;
        sd.insert(k, c);
    }
    Ok(sd)
}

fn grads(m: &dyn Module) -> Vec<Option<Tensor>> {
    m.parameters().iter().map(|p| p.grad()).collect()
}

/// One forward+backward of `m` (compiled when `compiled` is given) on fixed data; returns the loss.
fn step(m: &dyn Module, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    m.zero_grad();
    let loss = m.forward(x)?.cross_entropy(y, None, 0.0, Reduction::Mean)?;
    loss.backward()?;
    Ok(loss)
}

#[test]
fn compiled_cnn_with_batchnorm_matches_eager_gradients_and_running_stats() -> Result<()> {
    manual_seed(1);
    let model = cnn()?;
    let x = Tensor::randn(&[6, 1, 8, 8], DType::F32)?;
    let y = Tensor::from_vec(vec![0i64, 3, 9, 1, 1, 7], &[6])?;
    let state0 = snapshot(&model)?;
    let eager_loss = step(&model, &x, &y)?;
    let eager_grads = grads(&model);
    let eager_state = snapshot(&model)?;
    model.load_state_dict(&state0, true)?;
    let compiled = kiln::compile(&model, CompileOptions::default())?;
    for call in 0..2 {
        if call == 1 {
            model.load_state_dict(&state0, true)?;
        }
        let loss = step(&compiled, &x, &y)?;
        assert_close(&loss, &eager_loss, 1e-6, "loss");
        for (k, (c, e)) in grads(&model).iter().zip(&eager_grads).enumerate() {
            let (Some(c), Some(e)) = (c, e) else {
                panic!("parameter {k}: gradient missing");
            };
            assert_close(c, e, 1e-5, &format!("grad of parameter {k}"));
        }
        // BatchNorm running statistics (buffer mutations inside the compiled forward)
        for (name, t) in model.state_dict().iter() {
            let e = eager_state.get(name).expect("same keys");
            assert_close(t, e, 1e-6, name);
        }
    }
    Ok(())
}

#[test]
fn compiled_forward_saves_no_more_bytes_for_backward_than_eager() -> Result<()> {
    manual_seed(2);
    let model = cnn()?;
    let x = Tensor::randn(&[16, 1, 8, 8], DType::F32)?;
    let y = Tensor::zeros(&[16], DType::I64)?;
    let eager_loss = model
        .forward(&x)?
        .cross_entropy(&y, None, 0.0, Reduction::Mean)?;
    let eager = saved_bytes(&[eager_loss]);
    let compiled = kiln::compile(&model, CompileOptions::default())?;
    let logits = compiled.forward(&x)?;
    let compiled_loss = logits.cross_entropy(&y, None, 0.0, Reduction::Mean)?;
    let comp = saved_bytes(&[compiled_loss]);
    println!(
        "bytes saved for backward (CNN with BatchNorm and ReLU, batch 16): eager {} B, compiled {} B \
         (parameters referenced: eager {} B, compiled {} B)",
        eager.activations, comp.activations, eager.leaves, comp.leaves
    );
    assert!(comp.activations > 0, "the compiled graph saves something");
    assert!(
        comp.activations <= eager.activations,
        "compiled saves {} B, eager {} B",
        comp.activations,
        eager.activations
    );
    Ok(())
}

#[test]
fn no_grad_calls_compile_a_separate_inference_graph() -> Result<()> {
    let model = Sequential::new()
        .add(Linear::new(4, 4, true)?)
        .add(ReLU::new());
    let compiled = kiln::compile(&model, CompileOptions::default())?;
    let x = Tensor::randn(&[2, 4], DType::F32)?;
    let train = compiled.forward(&x)?;
    assert!(train.requires_grad());
    let inf = no_grad(|| compiled.forward(&x))?;
    assert!(!inf.requires_grad());
    assert_close(&inf, &train.detach(), 0.0, "inference output");
    let s = compiled.stats();
    assert_eq!(s.compiles, 2, "grad mode is guarded: a second entry");
    Ok(())
}

#[test]
fn frozen_parameters_get_no_gradient() -> Result<()> {
    let a = Linear::new(3, 3, true)?;
    let b = Linear::new(3, 2, true)?;
    for p in a.parameters() {
        p.set_requires_grad(false)?;
    }
    let model = Sequential::new().add(a).add(ReLU::new()).add(b);
    let compiled = kiln::compile(&model, CompileOptions::default())?;
    let x = Tensor::randn(&[5, 3], DType::F32)?;
    compiled.forward(&x)?.sum_all()?.backward()?;
    let g = grads(&model);
    assert!(g[0].is_none() && g[1].is_none(), "frozen layer");
    assert!(g[2].is_some() && g[3].is_some(), "trainable layer");
    Ok(())
}

#[test]
fn a_compiled_block_inside_eager_code_passes_gradients_through() -> Result<()> {
    let w = Tensor::randn(&[4, 4], DType::F32)?.with_grad()?;
    let block = compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].matmul(&a[1])?.tanh()?.mul(&a[0])?]),
        CompileOptions::default(),
    )?;
    let x = Tensor::randn(&[3, 4], DType::F32)?.with_grad()?;
    let run = |compiled: bool| -> Result<(Tensor, Tensor)> {
        x.set_grad(None);
        w.set_grad(None);
        // eager before and after the block
        let h = x.exp()?;
        let out = if compiled {
            block.call(&[h.clone(), w.clone()])?.remove(0)
        } else {
            h.matmul(&w)?.tanh()?.mul(&h)?
        };
        out.sin()?.sum_all()?.backward()?;
        Ok((x.grad().expect("x grad"), w.grad().expect("w grad")))
    };
    let (ex, ew) = run(false)?;
    for _ in 0..2 {
        let (cx, cw) = run(true)?;
        assert_close(&cx, &ex, 1e-5, "x grad");
        assert_close(&cw, &ew, 1e-5, "w grad");
    }
    assert_eq!(block.stats().replays, 1);
    Ok(())
}

/// A whole training step compiled, with a graph break (`item`) and `backward` inside.
#[test]
fn a_compiled_training_step_with_graph_breaks_matches_eager() -> Result<()> {
    manual_seed(3);
    let model = Sequential::new()
        .add(Linear::new(5, 8, true)?)
        .add(ReLU::new())
        .add(Linear::new(8, 3, true)?);
    let state0 = snapshot(&model)?;
    let x = Tensor::randn(&[7, 5], DType::F32)?;
    let y = Tensor::from_vec(vec![0i64, 1, 2, 0, 1, 2, 0], &[7])?;
    let train = |steps: usize, compiled: bool| -> Result<Vec<f32>> {
        model.load_state_dict(&state0, true)?;
        let opt = Mutex::new(SGD::new(
            model.parameters(),
            SGDConfig {
                lr: 0.1,
                momentum: 0.9,
                ..SGDConfig::default()
            },
        )?);
        let body = |_: &[Tensor]| -> Result<Vec<Tensor>> {
            let mut opt = opt.lock().unwrap_or_else(|e| e.into_inner());
            opt.zero_grad();
            let loss = model
                .forward(&x)?
                .cross_entropy(&y, None, 0.0, Reduction::Mean)?;
            // a data-dependent branch: a graph break in the middle of the step
            let scale = if loss.item::<f32>()? > 0.5 { 1.0 } else { 0.5 };
            loss.mul(scale)?.backward()?;
            opt.step()?;
            Ok(vec![loss])
        };
        let f = compile_fn(body, CompileOptions::default().disable(!compiled))?;
        (0..steps).map(|_| f.call(&[])?[0].item::<f32>()).collect()
    };
    let eager = train(6, false)?;
    let compiled = train(6, true)?;
    for (k, (c, e)) in compiled.iter().zip(&eager).enumerate() {
        assert!(
            (c - e).abs() <= 1e-5 * e.abs().max(1.0),
            "step {k}: compiled {c} vs eager {e}"
        );
    }
    assert!(eager.last() < eager.first(), "the loss goes down");
    Ok(())
}

/// Records every graph an inner backend is asked to compile.
struct Recording(Mutex<Vec<Graph>>);

impl Backend for Recording {
    fn name(&self) -> &str {
        "recording"
    }
    fn compile(&self, g: &Graph, ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(g.clone());
        EagerBackend.compile(g, ctx)
    }
}

fn has_rand(g: &Graph) -> bool {
    g.nodes.iter().any(|n| {
        matches!(
            &n.op,
            kiln::compiler::Op::Prim(kiln::core::prim::Prim::Rand { .. })
        )
    })
}

#[test]
fn dropout_masks_are_regenerated_in_the_backward_not_saved() -> Result<()> {
    let inner = Arc::new(Recording(Mutex::new(Vec::new())));
    let aot = Arc::new(AotBackend::new("aot_recording", inner.clone()));
    let model = Sequential::new()
        .add(Linear::new(16, 16, true)?)
        .add(Dropout::new(0.5)?)
        .add(Linear::new(16, 4, true)?);
    let compiled = kiln::compile(&model, CompileOptions::default().custom_backend(aot))?;
    let x = Tensor::randn(&[8, 16], DType::F32)?;
    for seed in [10u64, 11] {
        let mut runs = Vec::new();
        for use_compiled in [false, true] {
            manual_seed(seed);
            model.zero_grad();
            let m: &dyn Module = if use_compiled { &compiled } else { &model };
            m.forward(&x)?.sum_all()?.backward()?;
            runs.push(grads(&model));
        }
        for (c, e) in runs[1].iter().zip(&runs[0]) {
            assert_close(
                c.as_ref().unwrap(),
                e.as_ref().unwrap(),
                1e-5,
                "dropout grad",
            );
        }
    }
    let graphs = inner.0.lock().unwrap_or_else(|e| e.into_inner());
    assert_eq!(graphs.len(), 2, "one forward and one backward graph");
    let (fwd, bwd) = (&graphs[0], &graphs[1]);
    assert!(
        has_rand(fwd) && has_rand(bwd),
        "the backward redraws the mask"
    );
    let bool_inputs = bwd
        .nodes
        .iter()
        .filter(|n| matches!(n.op, kiln::compiler::Op::Input(_)) && n.dtype == DType::Bool)
        .count();
    assert_eq!(bool_inputs, 0, "no mask is saved");
    Ok(())
}

#[test]
fn min_cut_saves_the_input_and_recomputes_a_cheap_elementwise_chain() -> Result<()> {
    let inner = Arc::new(Recording(Mutex::new(Vec::new())));
    let aot = Arc::new(AotBackend::new("aot_recording2", inner.clone()));
    // eager autograd saves x, sin x, exp(sin x), ... ; the min-cut keeps only x (1 KiB) and
    // recomputes the rest in the backward
    let f = compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].sin()?.exp()?.mul(&a[0].cos()?)?.tanh()?]),
        CompileOptions::default().custom_backend(aot),
    )?;
    let x = Tensor::randn(&[256], DType::F32)?.with_grad()?;
    let out = f.call(std::slice::from_ref(&x))?.remove(0);
    out.sum_all()?.backward()?;
    let compiled_grad = x.grad().expect("grad");
    x.set_grad(None);
    x.sin()?
        .exp()?
        .mul(&x.cos()?)?
        .tanh()?
        .sum_all()?
        .backward()?;
    assert_close(&compiled_grad, &x.grad().expect("grad"), 1e-5, "grad");
    let graphs = inner.0.lock().unwrap_or_else(|e| e.into_inner());
    let fwd = &graphs[0];
    assert_eq!(
        fwd.outputs.len(),
        2,
        "the forward returns its output and one saved value"
    );
    let saved = &fwd.nodes[fwd.outputs[1]];
    assert!(
        matches!(saved.op, kiln::compiler::Op::Input(0)),
        "x itself is saved"
    );
    // x is a leaf the caller holds anyway: the compiled tape keeps no activation at all, where
    // eager's keeps every intermediate
    assert_eq!(saved_bytes(std::slice::from_ref(&out)).activations, 0);
    assert_eq!(saved_bytes(&[out]).leaves, 256 * 4);
    let eager_out = x.sin()?.exp()?.mul(&x.cos()?)?.tanh()?;
    assert!(saved_bytes(&[eager_out]).activations >= 4 * 256 * 4);
    Ok(())
}

/// A forward value a backward extern reads (`tanh(x)`, which the weight gradient
/// `tanh(x)ᵀ @ g` multiplies) is saved, not recomputed from `x`: the backward would have to
/// write it whole before the matmul could read it, where the forward computed it anyway
/// (functorch's partitioner bans that recompute too). Without the rule the backward recomputed
/// it (the cut is the same size either way).
#[test]
fn a_value_a_backward_matmul_reads_is_saved_not_recomputed() -> Result<()> {
    let inner = Arc::new(Recording(Mutex::new(Vec::new())));
    let aot = Arc::new(AotBackend::new("aot_recording3", inner.clone()));
    let f = compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].tanh()?.matmul(&a[1])?]),
        CompileOptions::default().custom_backend(aot),
    )?;
    let x = Tensor::randn(&[32, 16], DType::F32)?.with_grad()?;
    let w = Tensor::randn(&[16, 8], DType::F32)?.with_grad()?;
    f.call(&[x.clone(), w.clone()])?
        .remove(0)
        .sum_all()?
        .backward()?;
    let compiled = w.grad().expect("grad");
    w.set_grad(None);
    x.tanh()?.matmul(&w)?.sum_all()?.backward()?;
    assert_close(&compiled, &w.grad().expect("grad"), 1e-5, "weight grad");
    let graphs = inner.0.lock().unwrap_or_else(|e| e.into_inner());
    let (fwd, bwd) = (&graphs[0], &graphs[1]);
    let tanh = |g: &Graph| {
        g.nodes
            .iter()
            .filter(|n| {
                matches!(
                    n.op,
                    kiln::compiler::Op::Prim(kiln::core::prim::Prim::Unary(
                        kiln::core::prim::UnaryOp::Tanh
                    ))
                )
            })
            .count()
    };
    assert_eq!(tanh(bwd), 0, "the backward does not recompute tanh(x)");
    assert!(
        fwd.outputs[1..]
            .iter()
            .any(|&o| fwd.nodes[o].shape == [32, 16] && tanh(fwd) == 1),
        "the forward saves tanh(x)"
    );
    Ok(())
}

/// Layer norm's backward needs its forward's mean (the derivative of the squared deviations is
/// `2 (x - mean)`), and its rule computes the mean as the forward did; the joint graph keeps one
/// (`kiln_compile::cse`), so the forward sums its input once for the mean — one sum saved or
/// recomputed, not a second sum of the same row. Gradients as eager's.
#[test]
fn a_norms_backward_reuses_its_forwards_mean() -> Result<()> {
    use kiln::compiler::Op;
    use kiln::core::prim::{Prim, ReduceOp};
    let inner = Arc::new(Recording(Mutex::new(Vec::new())));
    let aot = Arc::new(AotBackend::new("aot_recording_norm", inner.clone()));
    let f = compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].layer_norm(&[40], None, None, 1e-5)?.square()?]),
        CompileOptions::default().custom_backend(aot),
    )?;
    let x = Tensor::randn(&[6, 40], DType::F32)?.with_grad()?;
    f.call(std::slice::from_ref(&x))?
        .remove(0)
        .sum_all()?
        .backward()?;
    let compiled_grad = x.grad().expect("grad");
    x.set_grad(None);
    x.layer_norm(&[40], None, None, 1e-5)?
        .square()?
        .sum_all()?
        .backward()?;
    assert_close(&compiled_grad, &x.grad().expect("grad"), 1e-5, "grad");
    let graphs = inner.0.lock().unwrap_or_else(|e| e.into_inner());
    let sums_of_input = |g: &Graph| {
        g.nodes
            .iter()
            .filter(|n| {
                matches!(
                    &n.op,
                    Op::Prim(Prim::Reduce {
                        op: ReduceOp::Sum,
                        ..
                    })
                ) && matches!(g.nodes[n.args[0]].op, Op::Input(_))
            })
            .count()
    };
    let (fwd, bwd) = (&graphs[0], &graphs[1]);
    assert_eq!(
        sums_of_input(fwd),
        1,
        "the forward sums x once, for its mean"
    );
    assert_eq!(
        sums_of_input(bwd),
        0,
        "the backward takes the forward's mean"
    );
    Ok(())
}
