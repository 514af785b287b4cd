//! The memory plan at work: intermediate buffers reused within a call and kept between calls, kernels
//! writing a mutated input's storage directly, several threads calling one compiled function, and
//! overlapping views as arguments. Each check reads the executor's counters of the calling thread
//! (`kiln_inductor::exec_stats`), so the tests need not run alone.

use kiln_compile::graph::{Graph, Node, Op};
use kiln_compile::{compile_fn, Backend, BackendContext, CompileOptions};
use kiln_core::prim::{BinaryOp, Prim};
use kiln_core::{DType, Result, Tensor};
use kiln_inductor::{exec_stats, CpuCodegen, ExecStats};

const N: usize = 64;
const BYTES: u64 = (N * N * 4) as u64;

fn have_cc() -> bool {
    kiln_inductor::register();
    let ok = kiln_inductor::runtime::cc::toolchain().is_some();
    if !ok {
        eprintln!("SKIPPED: no C compiler");
    }
    ok
}

/// The counters' change over `f`.
fn delta<R>(f: impl FnOnce() -> R) -> (R, ExecStats) {
    let a = exec_stats();
    let r = f();
    let b = exec_stats();
    let d = ExecStats {
        calls: b.calls - a.calls,
        allocated_bytes: b.allocated_bytes - a.allocated_bytes,
        reused_bytes: b.reused_bytes - a.reused_bytes,
        inplace_bytes: b.inplace_bytes - a.inplace_bytes,
        inplace_fallbacks: b.inplace_fallbacks - a.inplace_fallbacks,
        graph_replays: b.graph_replays - a.graph_replays,
        replay_copied_bytes: b.replay_copied_bytes - a.replay_copied_bytes,
        kernel_launches: b.kernel_launches - a.kernel_launches,
        kernels_tuned: b.kernels_tuned - a.kernels_tuned,
        tuning_hits: b.tuning_hits - a.tuning_hits,
    };
    (r, d)
}

/// Four kernels of one [N, N] shape, each feeding a matmul (so each is a buffer that dies at the
/// matmul), then a last kernel whose value is returned (an `exp`: a ReLU there would join the
/// matmul's call as its epilogue).
fn chain(a: &[Tensor]) -> Result<Vec<Tensor>> {
    let mut x = a[0].clone();
    for _ in 0..4 {
        x = x.tanh()?.mul(0.5)?.matmul(&a[1])?;
    }
    Ok(vec![x.exp()?])
}

fn close(a: &Tensor, b: &Tensor) -> Result<()> {
    for (p, q) in a.to_vec::<f32>()?.iter().zip(b.to_vec::<f32>()?) {
        assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
    }
    Ok(())
}

#[test]
fn intermediates_share_one_buffer_and_it_is_kept_between_calls() -> Result<()> {
    if !have_cc() {
        return Ok(());
    }
    let args = [
        Tensor::randn(&[N, N], DType::F32)?,
        Tensor::randn(&[N, N], DType::F32)?.mul(0.1)?,
    ];
    let f = compile_fn(chain, CompileOptions::default())?;
    let want = chain(&args)?;
    let (first, s1) = delta(|| f.call(&args));
    let first = first?;
    close(&first[0], &want[0])?;
    // four intermediates, one live at a time: one pooled buffer, plus the returned value
    assert_eq!(s1.calls, 1);
    assert_eq!(s1.allocated_bytes, 2 * BYTES, "{s1:?}");
    assert_eq!(s1.reused_bytes, 3 * BYTES, "{s1:?}");
    // the next call allocates only what it returns
    let (second, s2) = delta(|| f.call(&args));
    let second = second?;
    assert_eq!(s2.allocated_bytes, BYTES, "{s2:?}");
    assert_eq!(s2.reused_bytes, 4 * BYTES, "{s2:?}");
    // what the caller holds is its own: a later call does not write it
    let before = first[0].to_vec::<f32>()?;
    let other = [Tensor::randn(&[N, N], DType::F32)?, args[1].clone()];
    f.call(&other)?;
    assert_eq!(first[0].to_vec::<f32>()?, before);
    // SAFETY: addresses compared only
    let (p1, p2) = unsafe { (first[0].data_ptr(), second[0].data_ptr()) };
    assert_ne!(p1, p2);
    Ok(())
}

#[test]
fn an_output_that_views_an_intermediate_is_never_pooled() -> Result<()> {
    if !have_cc() {
        return Ok(());
    }
    // the kernel's value is returned only through a view (the transposed reshape)
    let g = |a: &[Tensor]| -> Result<Vec<Tensor>> {
        let h = a[0].exp()?.matmul(&a[0])?.tanh()?;
        Ok(vec![h.reshape([N * N])?, h.sum(&[1], false)?])
    };
    let x = Tensor::randn(&[N, N], DType::F32)?.mul(0.1)?;
    let f = compile_fn(g, CompileOptions::default())?;
    let a = f.call(std::slice::from_ref(&x))?;
    let keep = a[0].to_vec::<f32>()?;
    let b = f.call(&[x.mul(2.0)?])?;
    assert_eq!(
        a[0].to_vec::<f32>()?,
        keep,
        "a second call wrote the first call's output"
    );
    assert!(!a[0].shares_storage(&b[0]));
    Ok(())
}

#[test]
fn two_threads_calling_one_compiled_function() -> Result<()> {
    if !have_cc() {
        return Ok(());
    }
    // a shape of its own: the graph `chain` traces to at [N, N] is the one compiled graph the
    // test of its pool counts (the structural cache is process-wide), which these threads'
    // calls would take buffers from
    let w = Tensor::randn(&[N, N], DType::F32)?.mul(0.1)?;
    let f = compile_fn(chain, CompileOptions::default())?;
    let inputs: Vec<[Tensor; 2]> = (0..2)
        .map(|_| Ok([Tensor::randn(&[N + 8, N], DType::F32)?, w.clone()]))
        .collect::<Result<_>>()?;
    let wants: Vec<Vec<f32>> = inputs
        .iter()
        .map(|a| chain(a)?[0].to_vec::<f32>())
        .collect::<Result<_>>()?;
    f.call(&inputs[0])?; // trace and compile once
    std::thread::scope(|s| {
        for (args, want) in inputs.iter().zip(&wants) {
            let f = &f;
            s.spawn(move || {
                for _ in 0..40 {
                    let got = f.call(args).expect("call")[0]
                        .to_vec::<f32>()
                        .expect("values");
                    for (p, q) in got.iter().zip(want) {
                        assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
                    }
                }
            });
        }
    });
    Ok(())
}

/// p ← p - g, as a graph the backend is handed directly: the returned value is `p` itself.
#[test]
fn a_mutated_input_is_written_in_its_own_storage() -> Result<()> {
    if !have_cc() {
        return Ok(());
    }
    let node = |op, args| Node {
        op,
        args,
        shape: vec![N, N],
        dtype: DType::F32,
        grad_enabled: false,
        requires_grad: false,
        device: kiln_core::Device::Cpu,
    };
    let mut g = Graph::default();
    let p = g.push(node(Op::Input(0), vec![]));
    let x = g.push(node(Op::Input(1), vec![]));
    let new = g.push(node(Op::Prim(Prim::Binary(BinaryOp::Sub)), vec![p, x]));
    g.num_inputs = 2;
    g.outputs = vec![new];
    g.mutated_inputs = vec![(0, 0)];
    let compiled = CpuCodegen.compile(&g, &BackendContext::default())?;
    let (pt, xt) = (
        Tensor::randn(&[N, N], DType::F32)?,
        Tensor::randn(&[N, N], DType::F32)?,
    );
    let want = pt.sub(&xt)?.to_vec::<f32>()?;
    let (out, s) = delta(|| compiled.run(&[pt.clone(), xt.clone()]));
    let out = out?;
    assert!(
        out[0].same_tensor(&pt),
        "the destination itself is handed back"
    );
    assert_eq!(pt.to_vec::<f32>()?, want);
    assert_eq!((s.inplace_bytes, s.allocated_bytes), (BYTES, 0), "{s:?}");
    // one tensor fed to both inputs (an argument that is also a captured tensor): the kernel must
    // not overwrite what it reads as the other input, so it computes into a copy
    let q = Tensor::randn(&[N, N], DType::F32)?;
    let (out, s) = delta(|| compiled.run(&[q.clone(), q.clone()]));
    let out = out?;
    assert_eq!((s.inplace_fallbacks, s.inplace_bytes), (1, 0), "{s:?}");
    assert!(!out[0].same_tensor(&q));
    assert!(out[0].to_vec::<f32>()?.iter().all(|&v| v == 0.0));
    // without the permission the same graph writes a new buffer
    g.mutated_inputs.clear();
    let plain = CpuCodegen.compile(&g, &BackendContext::default())?;
    let out = plain.run(&[pt.clone(), xt])?;
    assert!(!out[0].shares_storage(&pt));
    Ok(())
}

/// An optimizer-like update through `compile_fn`: parameters and state updated with `assign`,
/// m ← 0.9 m + g; p ← p - 0.1 m. The two updates are one kernel (one pass over memory, the new
/// m passed to p's update in a register), both in place, equal to eager.
#[test]
fn compiled_updates_of_captured_tensors_run_in_place_and_match_eager() -> Result<()> {
    if !have_cc() {
        return Ok(());
    }
    // one draw, copied: re-seeding the process's generator for each copy races with the tests
    // that draw beside this one
    let drawn = [
        Tensor::randn(&[N, N], DType::F32)?,
        Tensor::zeros(&[N, N], DType::F32)?,
        Tensor::randn(&[N, N], DType::F32)?,
    ];
    let make = || -> Result<[Tensor; 3]> {
        Ok([
            drawn[0].clone_data()?,
            drawn[1].clone_data()?,
            drawn[2].clone_data()?,
        ])
    };
    // m ← 0.9 m + g; p ← p - 0.1 m (the new m): both in place
    let step = |[p, m, g]: &[Tensor; 3]| -> Result<()> {
        m.assign(&m.mul(0.9)?.add(g)?)?;
        p.assign(&p.sub(&m.mul(0.1)?)?)
    };
    let eager = make()?;
    let compiled = make()?;
    let ptrs: Vec<usize> = compiled
        .iter()
        .map(|t| unsafe { t.data_ptr() } as usize)
        .collect();
    let f = compile_fn(
        |_: &[Tensor]| {
            step(&compiled)?;
            Ok(vec![])
        },
        CompileOptions::default(),
    )?;
    for k in 0..3 {
        step(&eager)?;
        let (r, s) = delta(|| f.call(&[]));
        r?;
        assert_eq!(s.inplace_bytes, 2 * BYTES, "call {k}: {s:?}");
        // this thread's counters (the process-wide kernel cache's are shared with the tests
        // running beside this one)
        assert_eq!(s.kernel_launches, 1, "call {k}, one grouped kernel: {s:?}");
        if k > 0 {
            assert_eq!(s.allocated_bytes, 0, "call {k}: {s:?}");
        }
    }
    for (e, c) in eager.iter().zip(&compiled) {
        assert_eq!(e.to_vec::<f32>()?, c.to_vec::<f32>()?);
    }
    let after: Vec<usize> = compiled
        .iter()
        .map(|t| unsafe { t.data_ptr() } as usize)
        .collect();
    assert_eq!(ptrs, after, "identities and storages kept");
    Ok(())
}

/// x ← x + y where y is x shifted by one element in one buffer: writing x element by element
/// would feed already-written values into later elements, so the executor detects the overlap
/// and computes into a copy instead.
#[test]
fn overlapping_argument_views_fall_back_to_a_copy() -> Result<()> {
    if !have_cc() {
        return Ok(());
    }
    let f = compile_fn(
        |a: &[Tensor]| {
            a[0].assign(&a[0].add(&a[1])?)?;
            Ok(vec![])
        },
        CompileOptions::default(),
    )?;
    let n = 4096;
    let data: Vec<f32> = (0..n + 1).map(|i| (i % 17) as f32).collect();
    let run = |compiled: bool| -> Result<(Vec<f32>, ExecStats)> {
        let base = Tensor::from_vec(data.clone(), &[n + 1])?;
        let (x, y) = (base.narrow(0, 1, n)?, base.narrow(0, 0, n)?);
        let (r, s) = delta(|| {
            if compiled {
                f.call(&[x.clone(), y.clone()]).map(drop)
            } else {
                x.assign(&x.add(&y)?)
            }
        });
        r?;
        Ok((base.to_vec::<f32>()?, s))
    };
    let (want, _) = run(false)?;
    for _ in 0..2 {
        let (got, s) = run(true)?;
        assert_eq!(got, want);
        assert_eq!((s.inplace_fallbacks, s.inplace_bytes), (1, 0), "{s:?}");
    }
    // separate buffers: in place
    let (x, y) = (
        Tensor::randn(&[n], DType::F32)?,
        Tensor::randn(&[n], DType::F32)?,
    );
    let want = x.add(&y)?.to_vec::<f32>()?;
    let (r, s) = delta(|| f.call(&[x.clone(), y]));
    r?;
    assert_eq!(x.to_vec::<f32>()?, want);
    assert_eq!(s.inplace_bytes, (n * 4) as u64, "{s:?}");
    Ok(())
}
