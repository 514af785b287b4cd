//! Capture and AOT autograd over device tensors, on any machine: a mock device runtime (host memory,
//! CPU kernels; shared with kiln-core's dispatch tests) stands in for CUDA. What is under test is
//! the compiler's device plumbing: traced values that live on a device until the graph fills them,
//! graphs whose prims carry their device, CPU scalars read by device graphs on every call,
//! in-place writes into device tensors, and the `kiln` backend falling back to the interpreter on
//! a device whose runtime cannot load generated kernels (the GPU runs them: `gpu_compile.rs`).

#[path = "../../kiln-core/tests/support/mock_device.rs"]
mod mock_device;

use kiln::nn::optim::{Optimizer, SGDConfig, SGD};
use kiln::prelude::*;
use mock_device::{setup, DEV};

fn on_dev(v: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(v, shape)?.to(DEV)
}

fn values(n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 % 11) as f32 - 5.0) * scale)
        .collect()
}

#[test]
fn a_compiled_function_over_device_tensors_equals_eager_forward_and_backward() -> Result<()> {
    setup();
    let f = |a: &[Tensor]| -> Result<Vec<Tensor>> {
        let h = a[0].matmul(&a[1])?.relu()?;
        Ok(vec![h.softmax(-1)?.sum(&[1], false)?, h.t()?.exp()?])
    };
    let compiled = kiln::compile_fn(f, CompileOptions::default())?;
    for call in 0..2 {
        let scale = 0.1 * (call + 1) as f32;
        let x = on_dev(values(12, scale), &[3, 4])?.with_grad()?;
        let w = on_dev(values(20, 0.2), &[4, 5])?.with_grad()?;
        let (xe, we) = (
            on_dev(values(12, scale), &[3, 4])?.with_grad()?,
            on_dev(values(20, 0.2), &[4, 5])?.with_grad()?,
        );
        let got = compiled.call(&[x.clone(), w.clone()])?;
        let want = f(&[xe.clone(), we.clone()])?;
        for (g, e) in got.iter().zip(&want) {
            assert_eq!(g.device(), DEV, "compiled output left the device");
            assert_eq!(g.to_vec::<f32>()?, e.to_vec::<f32>()?);
        }
        got[0].add(&got[1].sum_all()?)?.sum_all()?.backward()?;
        want[0].add(&want[1].sum_all()?)?.sum_all()?.backward()?;
        for (c, e) in [(&x, &xe), (&w, &we)] {
            let (gc, ge) = (
                c.grad().expect("compiled grad"),
                e.grad().expect("eager grad"),
            );
            assert_eq!(gc.device(), DEV, "gradient left the device");
            assert_eq!(gc.to_vec::<f32>()?, ge.to_vec::<f32>()?);
        }
    }
    let stats = compiled.stats();
    assert_eq!((stats.traces, stats.replays), (1, 1), "{stats:?}");
    Ok(())
}

#[test]
fn a_cpu_scalar_read_by_a_device_graph_is_read_on_every_call() -> Result<()> {
    setup();
    let compiled = kiln::compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].mul(&a[1])?]),
        CompileOptions::default(),
    )?;
    let x = on_dev(values(6, 1.0), &[2, 3])?;
    for v in [2.0f32, -0.5] {
        let s = Tensor::scalar(v);
        let got = compiled.call(&[x.clone(), s])?;
        assert_eq!(got[0].device(), DEV);
        let want: Vec<f32> = values(6, 1.0).iter().map(|e| e * v).collect();
        assert_eq!(got[0].to_vec::<f32>()?, want);
    }
    Ok(())
}

#[test]
fn a_compiled_optimizer_step_updates_device_parameters_in_place() -> Result<()> {
    setup();
    let make = || -> Result<Tensor> {
        let p = on_dev(values(8, 0.5), &[2, 4])?.with_grad()?;
        p.set_grad(Some(on_dev(values(8, 0.25), &[2, 4])?));
        Ok(p)
    };
    let (pe, pc) = (make()?, make()?);
    let config = || SGDConfig {
        lr: 0.1,
        momentum: 0.9,
        ..SGDConfig::default()
    };
    let mut eager = SGD::new(vec![pe.clone()], config())?;
    let opt = std::sync::Mutex::new(SGD::new(vec![pc.clone()], config())?);
    let step = kiln::compile_fn(
        |_: &[Tensor]| {
            opt.lock().unwrap_or_else(|e| e.into_inner()).step()?;
            Ok(vec![])
        },
        CompileOptions::default(),
    )?;
    for _ in 0..3 {
        eager.step()?;
        step.call(&[])?;
        assert_eq!(pc.device(), DEV);
        assert_eq!(pc.to_vec::<f32>()?, pe.to_vec::<f32>()?);
    }
    Ok(())
}

#[test]
fn fullgraph_on_a_device_without_kernel_support_is_an_error_naming_it() -> Result<()> {
    setup();
    let compiled = kiln::compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].exp()?]),
        CompileOptions::default().fullgraph(true),
    )?;
    let err = compiled
        .call(&[on_dev(values(4, 1.0), &[4])?])
        .expect_err("the mock device cannot load kernels")
        .to_string();
    assert!(err.contains("generated kernels"), "{err}");
    Ok(())
}

/// A BERT moved to a device compiles into one graph with no graph break: everything its forward
/// creates (position ids) is made on the device, not on the CPU and copied over (a copy of a
/// traced value across devices would break the graph at every call).
#[test]
fn a_bert_on_a_device_compiles_without_graph_breaks() -> Result<()> {
    use kiln::models::bert::{BertConfig, BertModel};
    setup();
    let cfg = BertConfig {
        vocab_size: 30,
        hidden_size: 8,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        intermediate_size: 16,
        max_position_embeddings: 8,
        ..BertConfig::bert_base_uncased()
    };
    manual_seed(3);
    let mut model = BertModel::without_pooler(&cfg)?;
    model.eval();
    model.to(DEV)?;
    let ids = Tensor::from_vec(vec![1i64, 5, 9, 2, 4, 7], &[2, 3])?.to(DEV)?;
    let mask = Tensor::from_vec(vec![1i64, 1, 1, 1, 1, 0], &[2, 3])?.to(DEV)?;
    let m = &model;
    let f = move |a: &[Tensor]| -> Result<Vec<Tensor>> {
        Ok(vec![m.encode(&a[0], Some(&a[1]), None)?])
    };
    let compiled = kiln::compile_fn(f, CompileOptions::default())?;
    no_grad(|| -> Result<()> {
        for _ in 0..2 {
            let got = compiled.call(&[ids.clone(), mask.clone()])?;
            let want = f(&[ids.clone(), mask.clone()])?;
            assert_eq!(got[0].device(), DEV);
            assert_eq!(got[0].to_vec::<f32>()?, want[0].to_vec::<f32>()?);
        }
        Ok(())
    })?;
    let stats = compiled.stats();
    assert_eq!(stats.graph_breaks, 0, "{stats:?}");
    assert_eq!((stats.compiles, stats.replays), (1, 1), "{stats:?}");
    Ok(())
}

/// The `cudagraphs` backend (eager kernels, recorded as CUDA graphs on a GPU — `gpu_compile.rs`
/// checks the replays) is registered, and where nothing can be recorded (the CPU, a device
/// without graph capture) it runs the captured graphs on the eager kernels: equal to eager,
/// forward and backward, call after call.
#[test]
fn the_cudagraphs_backend_equals_eager_where_it_cannot_record() -> Result<()> {
    setup();
    let f = |a: &[Tensor]| -> Result<Vec<Tensor>> {
        Ok(vec![a[0]
            .matmul(&a[1])?
            .relu()?
            .softmax(-1)?
            .sum(&[1], false)?])
    };
    let compiled = kiln::compile_fn(f, CompileOptions::default().backend("cudagraphs"))?;
    assert!(kiln::list_backends().contains(&"cudagraphs".to_string()));
    for dev in [Device::Cpu, DEV] {
        for call in 0..3 {
            let scale = 0.1 * (call + 1) as f32;
            let mk = |n, shape: &[usize], s| -> Result<Tensor> {
                Tensor::from_vec(values(n, s), shape)?.to(dev)?.with_grad()
            };
            let (x, w) = (mk(12, &[3, 4], scale)?, mk(20, &[4, 5], 0.2)?);
            let (xe, we) = (mk(12, &[3, 4], scale)?, mk(20, &[4, 5], 0.2)?);
            let got = compiled.call(&[x.clone(), w.clone()])?;
            let want = f(&[xe.clone(), we.clone()])?;
            assert_eq!(got[0].device(), dev);
            assert_eq!(got[0].to_vec::<f32>()?, want[0].to_vec::<f32>()?);
            got[0].sum_all()?.backward()?;
            want[0].sum_all()?.backward()?;
            for (c, e) in [(&x, &xe), (&w, &we)] {
                let (gc, ge) = (
                    c.grad().expect("compiled grad"),
                    e.grad().expect("eager grad"),
                );
                assert_eq!(gc.to_vec::<f32>()?, ge.to_vec::<f32>()?);
            }
        }
    }
    let stats = compiled.stats();
    assert_eq!(stats.graph_breaks, 0, "{stats:?}");
    Ok(())
}

/// Dynamic shapes over device tensors: the second size makes a symbolic entry (its probes trace
/// stand-ins on the device), later sizes reuse it without compiling, forward and backward, and
/// every call equals eager. (On the mock device the entry's graphs run on the interpreter; the
/// GPU's size-generic kernels are checked in `gpu_compile.rs`.)
#[test]
fn device_tensors_of_new_sizes_reuse_one_symbolic_entry() -> Result<()> {
    setup();
    let w = on_dev(values(20, 0.2), &[4, 5])?.with_grad()?;
    let f = |a: &[Tensor], w: &Tensor| -> Result<Vec<Tensor>> {
        let h = a[0].matmul(w)?.tanh()?.mul(2.0)?;
        Ok(vec![h.softmax(-1)?.mul(&h)?.sum_all()?])
    };
    let wc = w.clone();
    let compiled = kiln::compile_fn(move |a: &[Tensor]| f(a, &wc), CompileOptions::default())?;
    let sizes = [3usize, 6, 9, 14, 6, 11];
    for (k, &n) in sizes.iter().enumerate() {
        let x = on_dev(values(4 * n, 0.1 * (k + 1) as f32), &[n, 4])?.with_grad()?;
        let xe = on_dev(values(4 * n, 0.1 * (k + 1) as f32), &[n, 4])?.with_grad()?;
        let got = compiled.call(std::slice::from_ref(&x))?;
        got[0].backward()?;
        let gw = w.grad().expect("compiled grad w");
        w.zero_grad();
        let want = f(std::slice::from_ref(&xe), &w)?;
        want[0].backward()?;
        let ew = w.grad().expect("eager grad w");
        w.zero_grad();
        assert_eq!(got[0].device(), DEV, "n = {n}");
        assert_eq!(got[0].to_vec::<f32>()?, want[0].to_vec::<f32>()?, "n = {n}");
        let (gx, ex) = (x.grad().expect("grad x"), xe.grad().expect("grad x"));
        assert_eq!(gx.device(), DEV, "n = {n}");
        assert_eq!(gx.to_vec::<f32>()?, ex.to_vec::<f32>()?, "n = {n}");
        assert_eq!(gw.to_vec::<f32>()?, ew.to_vec::<f32>()?, "n = {n}");
    }
    let s = compiled.stats();
    // 3: static; 6: symbolic (made on the device); 9, 14, 11: its instances; the second 6: a
    // guard hit
    assert_eq!(
        (s.compiles, s.symbolic_compiles, s.symbolic_reuses),
        (2, 1, 3),
        "{s:?}"
    );
    Ok(())
}

/// max-autotune on a runtime that neither loads generated kernels nor times work (the mock):
/// compiling and running is no error, the results are eager's, and nothing is tuned.
#[test]
fn max_autotune_on_a_device_that_cannot_time_runs_untuned() -> Result<()> {
    setup();
    for mode in [Mode::MaxAutotune, Mode::MaxAutotuneNoCudagraphs] {
        let f = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            Ok(vec![a[0].mul(&a[1])?.exp()?.softmax(-1)?])
        };
        let compiled = kiln::compile_fn(
            f,
            CompileOptions {
                mode,
                ..Default::default()
            },
        )?;
        let before = kiln::inductor::exec_stats();
        for call in 0..3 {
            let x = on_dev(values(24, 0.1 * (call + 1) as f32), &[4, 6])?;
            let y = on_dev(values(24, 0.3), &[4, 6])?;
            let got = compiled.call(&[x.clone(), y.clone()])?;
            let want = f(&[x, y])?;
            assert_eq!(
                got[0].to_vec::<f32>()?,
                want[0].to_vec::<f32>()?,
                "{mode:?}"
            );
        }
        let after = kiln::inductor::exec_stats();
        assert_eq!(after.kernels_tuned, before.kernels_tuned, "{mode:?}");
        assert_eq!(after.tuning_hits, before.tuning_hits, "{mode:?}");
    }
    Ok(())
}
