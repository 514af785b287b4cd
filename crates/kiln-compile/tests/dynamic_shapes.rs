//! Dynamic shapes (issue 9) on the `eager` and `aot_eager` backends: automatic dynamic, marks,
//! `dynamic: Some(true/false)`, size 1 reusing a symbolic entry it instantiates, the specialised
//! size 0, recompile messages, and Rust code that branches on a size where the tracer cannot see it.

use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_compile::{compile_fn, mark_dynamic, mark_static, CompileOptions};
use kiln_core::{DType, Result, Tensor};

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Reshape, slice and mean: sizes flow into prim parameters and a float constant.
fn body(x: &Tensor) -> Result<Tensor> {
    let n = x.shape()[0];
    let flat = x.reshape(&[(n * x.shape()[1]) as i64][..])?;
    let head = flat.narrow(0, 1, n * x.shape()[1] - 1)?;
    head.sin()?
        .mul(2.0)?
        .add(&head.mean(&[0], true)?.expand_as(&head)?)
}

fn opts(backend: &str) -> CompileOptions {
    CompileOptions::default().backend(backend)
}

#[test]
fn automatic_dynamic_compiles_twice_for_many_sizes_and_equals_eager() -> Result<()> {
    for backend in ["eager", "aot_eager"] {
        let f = compile_fn(|a: &[Tensor]| Ok(vec![body(&a[0])?]), opts(backend))?;
        let sizes = [4usize, 6, 9, 13, 4, 6, 9, 30, 2];
        for &n in &sizes {
            let x = Tensor::randn(&[n, 3], DType::F32)?;
            let got = f.call(std::slice::from_ref(&x))?;
            assert_eq!(bits(&got[0]), bits(&body(&x)?), "{backend}, n = {n}");
        }
        let s = f.stats();
        assert_eq!(s.compiles, 2, "{backend}: one static, one symbolic: {s:?}");
        assert_eq!(s.symbolic_compiles, 1, "{s:?}");
        // 9, 13, 30, 2 are new sizes: traced, checked against the symbolic graph, not compiled
        assert_eq!(s.symbolic_reuses, 4, "{s:?}");
        // 4 hits the static entry, 6 and 9 hit the symbolic entry's remembered sizes
        assert_eq!(s.replays, 3, "{s:?}");
    }
    Ok(())
}

#[test]
fn the_recompile_message_names_the_dimension_and_the_symbol() -> Result<()> {
    let f = compile_fn(|a: &[Tensor]| Ok(vec![body(&a[0])?]), opts("eager"))?;
    for n in [4usize, 6] {
        f.call(&[Tensor::randn(&[n, 3], DType::F32)?])?;
    }
    let log = f.stats().recompile_log;
    assert_eq!(log.len(), 1, "{log:?}");
    let m = &log[0];
    assert!(
        m.starts_with("Recompiling function fn: argument 0: size mismatch"),
        "{m}"
    );
    assert!(m.contains("argument 0 dim 0 changed (4 -> 6)"), "{m}");
    assert!(m.contains("s0 = argument 0 dim 0"), "{m}");
    assert!(m.contains("s0 >= 1"), "{m}");
    Ok(())
}

#[test]
fn size_1_reuses_a_symbolic_entry_it_instantiates_and_0_is_specialised() -> Result<()> {
    // `w` is expanded to [n, 3], except at n = 1, where broadcasting needs no expand: the trace at
    // 1 is the symbolic graph but for that identity
    let w = Tensor::randn(&[1, 3], DType::F32)?;
    let scaled = |x: &Tensor| x.sin()?.mul(3.0)?.add(&w)?.sum(&[1], true);
    let f = compile_fn(|a: &[Tensor]| Ok(vec![scaled(&a[0])?]), opts("eager"))?;
    for n in [4usize, 6, 1, 8, 1, 0] {
        let x = Tensor::randn(&[n, 3], DType::F32)?;
        let got = f.call(std::slice::from_ref(&x))?;
        assert_eq!(bits(&got[0]), bits(&scaled(&x)?), "n = {n}");
    }
    let s = f.stats();
    assert_eq!(
        (
            s.compiles,
            s.symbolic_compiles,
            s.symbolic_reuses,
            s.replays
        ),
        (3, 1, 2, 1),
        "1 and 8 reuse the symbolic entry, the second 1 replays it, 0 has its own: {s:?}"
    );
    let one = &s.recompile_log[1];
    assert!(
        one.contains("instantiates symbolic entry 1 at s0=1"),
        "{one}"
    );
    assert!(one.contains("size 1 for s0"), "{one}");
    let zero = s.recompile_log.last().expect("a message for size 0");
    assert!(zero.contains("s0 = 0 fails the guard s0 >= 1"), "{zero}");
    assert!(
        zero.contains("argument 0 dim 0 = 0 is specialised"),
        "{zero}"
    );
    Ok(())
}

/// Before any symbolic entry, a size-1 call gets a static entry (symbols are made from sizes >= 2
/// only); the next size unifies with the static entry at 7, not with the one at 1, and the
/// symbolic entry then serves size 1 too.
#[test]
fn a_static_entry_at_size_1_is_not_what_a_symbol_is_fitted_from() -> Result<()> {
    let scaled = |x: &Tensor| x.sin()?.mul(3.0)?.sum(&[1], true);
    let f = compile_fn(|a: &[Tensor]| Ok(vec![scaled(&a[0])?]), opts("eager"))?;
    for n in [7usize, 1, 12, 5] {
        let x = Tensor::randn(&[n, 3], DType::F32)?;
        let got = f.call(std::slice::from_ref(&x))?;
        assert_eq!(bits(&got[0]), bits(&scaled(&x)?), "n = {n}");
    }
    let s = f.stats();
    assert_eq!(
        (s.compiles, s.symbolic_compiles, s.symbolic_reuses),
        (3, 1, 1),
        "{s:?}"
    );
    assert!(
        s.recompile_log[0].contains("argument 0 dim 0 = 1 is specialised"),
        "{s:?}"
    );
    assert!(
        s.recompile_log[1].contains("argument 0 dim 0 changed (7 -> 12)"),
        "{s:?}"
    );
    Ok(())
}

/// `squeeze` drops every size-1 dim: at batch 1 the sum runs over another axis and returns
/// another shape, so the trace at 1 is not the symbolic graph and gets its own entry.
fn squeezed(x: &Tensor) -> Result<Tensor> {
    x.squeeze()?.sin()?.sum(&[0], false)
}

#[test]
fn a_size_1_trace_of_another_structure_gets_its_own_entry() -> Result<()> {
    for backend in ["eager", "aot_eager"] {
        let f = compile_fn(|a: &[Tensor]| Ok(vec![squeezed(&a[0])?]), opts(backend))?;
        for n in [4usize, 6, 1, 9, 1] {
            let x = Tensor::randn(&[n, 3], DType::F32)?;
            let got = f.call(std::slice::from_ref(&x))?;
            let want = squeezed(&x)?;
            assert_eq!(got[0].shape(), want.shape(), "{backend}, n = {n}");
            assert_eq!(bits(&got[0]), bits(&want), "{backend}, n = {n}");
        }
        let s = f.stats();
        assert_eq!(
            (
                s.compiles,
                s.symbolic_compiles,
                s.symbolic_reuses,
                s.replays
            ),
            (3, 1, 1, 1),
            "{backend}: static 4, symbolic from 6, 9 reuses it, 1 its own entry: {s:?}"
        );
        let m = &s.recompile_log[1];
        assert!(
            m.contains("not symbolic entry 1: the new trace has a different structure"),
            "{m}"
        );
        assert!(m.contains("static"), "{m}");
    }
    Ok(())
}

#[test]
fn mark_dynamic_compiles_symbolic_at_once_and_mark_static_never() -> Result<()> {
    let f = compile_fn(|a: &[Tensor]| Ok(vec![body(&a[0])?]), opts("eager"))?;
    for n in [5usize, 7, 11] {
        let x = Tensor::randn(&[n, 3], DType::F32)?;
        mark_dynamic(&x, 0)?;
        assert_eq!(
            bits(&f.call(std::slice::from_ref(&x))?[0]),
            bits(&body(&x)?)
        );
    }
    let s = f.stats();
    assert_eq!(
        (s.compiles, s.symbolic_compiles, s.symbolic_reuses),
        (1, 1, 2),
        "{s:?}"
    );
    assert!(
        s.recompile_log[0].contains("argument 0 dim 0 is marked dynamic"),
        "{s:?}"
    );

    let g = compile_fn(|a: &[Tensor]| Ok(vec![body(&a[0])?]), opts("eager"))?;
    for n in [5usize, 7, 11] {
        let x = Tensor::randn(&[n, 3], DType::F32)?;
        mark_static(&x, 0)?;
        assert_eq!(
            bits(&g.call(std::slice::from_ref(&x))?[0]),
            bits(&body(&x)?)
        );
    }
    let s = g.stats();
    assert_eq!((s.compiles, s.symbolic_compiles), (3, 0), "{s:?}");
    assert!(mark_dynamic(&Tensor::zeros(&[2], DType::F32)?, 1).is_err());
    Ok(())
}

#[test]
fn dynamic_true_is_symbolic_from_the_first_call_and_false_never() -> Result<()> {
    let f = compile_fn(
        |a: &[Tensor]| Ok(vec![body(&a[0])?]),
        opts("eager").dynamic(Some(true)),
    )?;
    for n in [5usize, 7, 3] {
        let x = Tensor::randn(&[n, 3], DType::F32)?;
        assert_eq!(
            bits(&f.call(std::slice::from_ref(&x))?[0]),
            bits(&body(&x)?)
        );
    }
    let s = f.stats();
    assert_eq!(
        (s.compiles, s.symbolic_compiles, s.symbolic_reuses),
        (1, 1, 2),
        "{s:?}"
    );

    let g = compile_fn(
        |a: &[Tensor]| Ok(vec![body(&a[0])?]),
        opts("eager").dynamic(Some(false)),
    )?;
    for n in [5usize, 7, 3] {
        g.call(&[Tensor::randn(&[n, 3], DType::F32)?])?;
    }
    assert_eq!((g.stats().compiles, g.stats().symbolic_compiles), (3, 0));
    Ok(())
}

/// Rust code that branches on a size: the branch is invisible to the tracer, but each new size is
/// traced, so a size that takes the other branch cannot reuse the graph of the first.
fn parity(x: &Tensor) -> Result<Tensor> {
    if x.shape()[0] % 2 == 0 {
        x.sin()
    } else {
        x.cos()?.mul(if x.shape()[0] > 8 { 2.0 } else { 0.5 })
    }
}

#[test]
fn a_size_branch_in_rust_code_stays_correct() -> Result<()> {
    let runs = AtomicUsize::new(0);
    let f = compile_fn(
        |a: &[Tensor]| {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(vec![parity(&a[0])?])
        },
        opts("eager"),
    )?;
    for n in [4usize, 6, 5, 7, 8, 9, 11, 10, 3, 13, 12] {
        let x = Tensor::randn(&[n], DType::F32)?;
        assert_eq!(
            bits(&f.call(std::slice::from_ref(&x))?[0]),
            bits(&parity(&x)?),
            "n = {n}"
        );
    }
    let s = f.stats();
    // even sizes: static 4, symbolic from 6. odd ≤ 8: static 5, symbolic from 7.
    // odd > 8 multiply by another constant: static 9, symbolic from 11.
    assert_eq!((s.compiles, s.symbolic_compiles), (6, 3), "{s:?}");
    assert!(
        runs.load(Ordering::SeqCst) >= 11,
        "every new size runs the Rust code"
    );
    Ok(())
}

#[test]
fn two_symbols_and_backward_through_aot_eager() -> Result<()> {
    let w = Tensor::randn(&[3, 5], DType::F32)?;
    let model = |x: &Tensor, y: &Tensor| -> Result<Tensor> {
        // x: [b, l, 3], y: [b, l]
        let h = x
            .matmul(&w.expand(&[x.shape()[0] as i64, 3, 5][..])?)?
            .tanh()?;
        h.sum(&[2], false)?
            .mul(y)?
            .softmax(-1)?
            .mean(&[0, 1], false)
    };
    let f = compile_fn(
        |a: &[Tensor]| {
            let loss = model(&a[0], &a[1])?;
            Ok(vec![loss])
        },
        opts("aot_eager"),
    )?;
    for (b, l) in [(2usize, 3usize), (3, 5), (4, 7), (6, 2), (2, 9)] {
        let x = Tensor::randn(&[b, l, 3], DType::F32)?;
        x.set_requires_grad(true)?;
        let y = Tensor::randn(&[b, l], DType::F32)?;
        let got = f.call(&[x.clone(), y.clone()])?;
        got[0].backward()?;
        let gx = x.grad().expect("a gradient");
        let x2 = x.detach();
        x2.set_requires_grad(true)?;
        let want = model(&x2, &y)?;
        want.backward()?;
        assert_eq!(bits(&got[0]), bits(&want), "({b}, {l})");
        assert_eq!(
            bits(&gx),
            bits(&x2.grad().expect("a gradient")),
            "({b}, {l})"
        );
    }
    let s = f.stats();
    assert_eq!(
        (s.compiles, s.symbolic_compiles, s.symbolic_reuses),
        (2, 1, 3),
        "{s:?}"
    );
    Ok(())
}

#[test]
fn explain_reports_symbolic_entries() -> Result<()> {
    use kiln_compile::{EntryReport, SymbolReport, SymbolicReport};
    let f = compile_fn(|a: &[Tensor]| Ok(vec![body(&a[0])?]), opts("eager"))?;
    for n in [4usize, 6, 9, 1] {
        f.call(&[Tensor::randn(&[n, 3], DType::F32)?])?;
    }
    let x = Tensor::randn(&[5, 3], DType::F32)?;
    let report = f.explain(std::slice::from_ref(&x))?;
    assert_eq!(bits(&report.outputs[0]), bits(&body(&x)?));
    assert_eq!(
        report.entries,
        vec![
            EntryReport::Static {
                shapes: vec![vec![4, 3]]
            },
            EntryReport::Symbolic(SymbolicReport {
                symbols: vec![SymbolReport {
                    name: "s0".into(),
                    dims: vec![(0, 0)],
                }],
                guards: vec!["s0 >= 1".into()],
                sizes_seen: vec![vec![vec![1, 3]], vec![vec![6, 3]], vec![vec![9, 3]]],
            }),
        ]
    );
    let text = report.to_string();
    assert!(
        text.contains(
            "Entry 1: symbolic, s0 = argument 0 dim 0; guards s0 >= 1; \
             sizes seen [[1, 3]] [[6, 3]] [[9, 3]]"
        ),
        "{text}"
    );
    assert_eq!(
        f.stats().traces,
        4,
        "explain leaves the function's caches alone"
    );

    // arguments of one size share a symbol (duck sizing): both dims are named
    let g = compile_fn(|a: &[Tensor]| Ok(vec![a[0].mul(&a[1])?]), opts("eager"))?;
    for n in [4usize, 6] {
        let t = Tensor::randn(&[n, 3], DType::F32)?;
        g.call(&[t.clone(), t.sin()?])?;
    }
    let t = Tensor::randn(&[2, 3], DType::F32)?;
    let e = g.explain(&[t.clone(), t])?;
    match &e.entries[..] {
        [EntryReport::Static { .. }, EntryReport::Symbolic(s)] => {
            assert_eq!(s.symbols[0].dims, vec![(0, 0), (1, 0)], "{e}");
        }
        other => panic!("a static and a symbolic entry, not {other:?}"),
    }
    assert!(
        kiln_compile::explain(|a: &[Tensor]| Ok(vec![a[0].sin()?]), &[x])?
            .entries
            .is_empty()
    );
    Ok(())
}
