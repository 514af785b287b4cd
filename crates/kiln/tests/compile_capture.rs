//! Capture (issue 3): compiled == eager, replay without re-running Rust code, recompiles, fallback,
//! graph breaks, fullgraph errors with locations, custom backends, parameters by reference.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kiln::nn::{Linear, Module};
use kiln::prelude::*;
use kiln::{compile_fn, Backend, BackendContext, CompiledGraph, Graph};

fn close(a: &Tensor, b: &Tensor, tol: f64) {
    assert_eq!(a.shape(), b.shape());
    let (x, y) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    for (p, q) in x.iter().zip(&y) {
        assert!((p - q).abs() <= tol * (1.0 + q.abs()), "{p} vs {q}");
    }
}

fn mlp(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.matmul(w)?.relu()?.add(1.0)?.softmax(-1)?.sum(&[0], false)
}

#[test]
fn compiled_equals_eager_and_replays_without_running_rust_code() -> Result<()> {
    let w = Tensor::randn(&[8, 5], DType::F32)?;
    let runs = AtomicUsize::new(0);
    let f = compile_fn(
        |a: &[Tensor]| {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(vec![mlp(&a[0], &w)?])
        },
        CompileOptions::default(),
    )?;
    for _ in 0..3 {
        let x = Tensor::randn(&[4, 8], DType::F32)?;
        let got = f.call(std::slice::from_ref(&x))?;
        close(&got[0], &mlp(&x, &w)?, 1e-6);
    }
    let s = f.stats();
    assert_eq!((s.traces, s.compiles, s.replays), (1, 1, 2));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "replays must not run the Rust code"
    );
    Ok(())
}

#[test]
fn shape_change_recompiles_and_the_limit_falls_back_to_eager_with_a_warning() -> Result<()> {
    let f = compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].sin()?.mul(2.0)?]),
        // static shapes: with automatic dynamic the second size would make one symbolic entry
        CompileOptions::default()
            .recompile_limit(2)
            .dynamic(Some(false)),
    )?;
    for n in [2usize, 3, 2, 4, 5] {
        let x = Tensor::randn(&[n], DType::F32)?;
        close(
            &f.call(std::slice::from_ref(&x))?[0],
            &x.sin()?.mul(2.0)?,
            1e-6,
        );
    }
    let s = f.stats();
    assert_eq!(s.compiles, 2);
    assert_eq!(s.replays, 1);
    assert_eq!(s.eager_fallbacks, 2);
    let w = s.fallback_warning.expect("a warning");
    assert!(
        w.contains("recompile_limit (2)") && w.contains("argument 0: size mismatch"),
        "{w}"
    );
    Ok(())
}

fn branchy(x: &Tensor) -> Result<Tensor> {
    let y = x.sin()?.mul(3.0)?;
    // a value read in the middle: a graph break
    let s: f32 = y.sum_all()?.item()?;
    if s > 0.0 {
        y.exp()?.add(1.0)
    } else {
        y.neg()?.mul(2.0)
    }
}

#[test]
fn graph_break_splits_the_function_and_replays_take_the_right_branch() -> Result<()> {
    let f = compile_fn(
        |a: &[Tensor]| Ok(vec![branchy(&a[0])?]),
        CompileOptions::default(),
    )?;
    let pos = Tensor::from_vec(vec![0.5f32, 1.0, 0.2], &[3])?;
    let neg = pos.neg()?;
    for x in [&pos, &neg, &pos, &neg] {
        close(&f.call(std::slice::from_ref(x))?[0], &branchy(x)?, 1e-6);
    }
    let s = f.stats();
    assert_eq!(s.graph_breaks, 4, "one break per call");
    let e = kiln::explain(
        |a: &[Tensor]| Ok(vec![branchy(&a[0])?]),
        std::slice::from_ref(&pos),
    )?;
    assert_eq!((e.graph_count(), e.graph_break_count()), (2, 1));
    assert!(
        e.to_string()
            .contains("`item` reads a traced tensor's values at"),
        "{e}"
    );
    Ok(())
}

#[test]
fn fullgraph_turns_a_break_into_an_error_naming_the_location() -> Result<()> {
    let f = compile_fn(
        |a: &[Tensor]| Ok(vec![branchy(&a[0])?]),
        CompileOptions::default().fullgraph(true),
    )?;
    let err = f
        .call(&[Tensor::ones(&[3], DType::F32)?])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("graph break") && err.contains("item") && err.contains("compile_capture.rs"),
        "{err}"
    );
    Ok(())
}

struct Recording {
    graphs: Mutex<Vec<Graph>>,
}

impl Backend for Recording {
    fn name(&self) -> &str {
        "recording"
    }
    fn compile(&self, g: &Graph, ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        self.graphs.lock().unwrap().push(g.clone());
        kiln::compiler::backends::EagerBackend.compile(g, ctx)
    }
}

#[test]
fn a_user_backend_receives_the_graph_by_value_and_by_name() -> Result<()> {
    let rec = Arc::new(Recording {
        graphs: Mutex::new(Vec::new()),
    });
    let x = Tensor::randn(&[3, 3], DType::F32)?;
    // a distinctive constant so the structure is unique to this test (the compile cache is global)
    let f = compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].mul(12345.0)?.tanh()?]),
        CompileOptions::default().custom_backend(rec.clone()),
    )?;
    f.call(std::slice::from_ref(&x))?;
    let graphs = rec.graphs.lock().unwrap();
    assert_eq!(graphs.len(), 1);
    // the scalar is a `full` of the tensor's rank, broadcast by one expand, then mul and tanh
    let code = graphs[0].to_code("f");
    assert_eq!(graphs[0].num_ops(), 4, "{code}");
    assert!(
        code.contains("= mul(") && code.contains("= tanh(") && code.contains("= full["),
        "{code}"
    );
    drop(graphs);
    kiln::register_backend("recording_test", rec.clone())?;
    assert!(kiln::list_backends().contains(&"recording_test".to_string()));
    assert!(
        kiln::register_backend("recording_test", rec).is_err(),
        "names register once"
    );
    assert!(compile_fn(
        |a: &[Tensor]| Ok(a.to_vec()),
        CompileOptions::default().backend("nope")
    )
    .is_err());
    Ok(())
}

/// The compiled-graph cache is per backend instance: two user backends of one name each receive
/// the graph (as `torch.compile` caches per backend callable), while one backend compiles a
/// structure once however many functions trace it.
#[test]
fn two_user_backends_of_one_name_each_receive_the_graph() -> Result<()> {
    let x = Tensor::randn(&[3, 3], DType::F32)?;
    let recorders: Vec<Arc<Recording>> = (0..2)
        .map(|_| {
            Arc::new(Recording {
                graphs: Mutex::new(Vec::new()),
            })
        })
        .collect();
    for rec in recorders.iter().chain(&recorders) {
        let f = compile_fn(
            |a: &[Tensor]| Ok(vec![a[0].mul(23456.0)?.tanh()?.neg()?]),
            CompileOptions::default().custom_backend(rec.clone()),
        )?;
        close(
            &f.call(std::slice::from_ref(&x))?[0],
            &x.mul(23456.0)?.tanh()?.neg()?,
            1e-6,
        );
    }
    for rec in &recorders {
        assert_eq!(rec.graphs.lock().unwrap().len(), 1);
    }
    Ok(())
}

#[test]
fn parameters_are_inputs_by_reference_and_identical_layers_share_a_compile() -> Result<()> {
    let a = Linear::new(10, 10, true)?;
    let b = Linear::new(10, 10, true)?;
    let x = Tensor::randn(&[4, 10], DType::F32)?;
    // a backend of its own, so compiles by tests running in parallel do not count
    let rec = Arc::new(Recording {
        graphs: Mutex::new(Vec::new()),
    });
    let opts = CompileOptions::default().custom_backend(rec.clone());
    let ca = kiln::compile(&a, opts.clone())?;
    let cb = kiln::compile(&b, opts)?;
    close(&ca.forward(&x)?, &a.forward(&x)?, 1e-6);
    close(&cb.forward(&x)?, &b.forward(&x)?, 1e-6);
    assert_eq!(
        rec.graphs.lock().unwrap().len(),
        1,
        "identical structure compiles once"
    );
    assert_eq!((ca.stats().compiles, cb.stats().compiles), (1, 1));
    // an in-place update (what an optimizer does) is seen without recompiling
    no_grad(|| a.parameters()[0].assign(&a.parameters()[0].mul(2.0)?))?;
    close(&ca.forward(&x)?, &a.forward(&x)?, 1e-6);
    assert_eq!(ca.stats().compiles, 1);
    Ok(())
}

#[test]
fn backward_through_a_compiled_module_matches_eager() -> Result<()> {
    let m = Linear::new(6, 3, true)?;
    let c = kiln::compile(&m, CompileOptions::default())?;
    let x = Tensor::randn(&[5, 6], DType::F32)?;
    let mut grads = Vec::new();
    for run in [&c as &dyn Module, &m, &c] {
        m.zero_grad();
        run.forward(&x)?.tanh()?.sum_all()?.backward()?;
        grads.push(
            m.parameters()
                .iter()
                .map(|p| p.grad().unwrap())
                .collect::<Vec<_>>(),
        );
    }
    for ((compiled, eager), again) in grads[0].iter().zip(&grads[1]).zip(&grads[2]) {
        close(compiled, eager, 1e-6);
        close(again, eager, 1e-6);
    }
    Ok(())
}

#[test]
fn dropout_draws_fresh_masks_on_replay_exactly_as_eager() -> Result<()> {
    let f = compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].dropout(0.5, true)?]),
        CompileOptions::default(),
    )?;
    let x = Tensor::ones(&[64], DType::F32)?;
    let mut compiled = Vec::new();
    kiln::manual_seed(7);
    for _ in 0..3 {
        compiled.push(
            f.call(std::slice::from_ref(&x))?
                .remove(0)
                .to_vec::<f32>()?,
        );
    }
    kiln::manual_seed(7);
    for c in &compiled {
        assert_eq!(c, &x.dropout(0.5, true)?.to_vec::<f32>()?);
    }
    assert_ne!(compiled[0], compiled[1], "each call draws a new mask");
    Ok(())
}

/// A compiled optimizer-style step reads `p.grad()`: backward replaces that tensor every step, so a
/// replay must read the current gradient, not the one seen while tracing.
#[test]
fn gradients_read_in_a_compiled_fn_are_re_read_on_every_call() -> Result<()> {
    let p = Tensor::from_vec(vec![1.0f32, 2.0], &[2])?.with_grad()?;
    let step = || -> Result<Vec<Tensor>> {
        let g = p
            .grad()
            .ok_or_else(|| kiln::Error::arg("test", "no grad"))?;
        kiln::no_grad(|| p.assign(&p.sub(&g.mul(0.5)?)?))?;
        Ok(vec![])
    };
    let f = compile_fn(|_: &[Tensor]| step(), CompileOptions::default())?;
    for (k, g) in [[1.0f32, 1.0], [10.0, -4.0], [0.0, 2.0]].iter().enumerate() {
        p.set_grad(Some(Tensor::from_vec(g.to_vec(), &[2])?));
        let before = p.to_vec::<f32>()?;
        f.call(&[])?;
        let want: Vec<f32> = before.iter().zip(g).map(|(a, b)| a - 0.5 * b).collect();
        assert_eq!(p.to_vec::<f32>()?, want, "call {k}");
    }
    assert_eq!(
        f.stats().compiles,
        1,
        "a new gradient tensor of the same shape is no recompile"
    );
    // no gradient at all: the guard fails and the step runs (and errs) as eager code would
    p.set_grad(None);
    assert!(f.call(&[]).is_err());
    Ok(())
}
