//! `kiln::profile`: spans for eager ops, compiled regions and their backward, a table sorted by
//! self time, and a Chrome trace that parses.

use kiln::prelude::*;
use kiln::profiler::Category;
use kiln::Profile;
use std::sync::Mutex;

/// A profile records every thread: the tests of this binary must not run side by side.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn eager_ops_are_counted_by_name() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let x = Tensor::randn(&[8, 8], DType::F32)?;
    let ((), p) = kiln::profile(|| {
        for _ in 0..3 {
            let _ = x.matmul(&x).unwrap().exp().unwrap();
        }
    });
    let rows = p.rows();
    let row = |name: &str| {
        rows.iter()
            .find(|r| r.name == name && r.category == Category::Op)
            .unwrap_or_else(|| panic!("no row {name}: {rows:?}"))
    };
    assert_eq!(row("matmul").calls, 3);
    assert_eq!(row("exp").calls, 3);
    assert!(row("matmul").total_ns > 0);
    // nothing is recorded outside a profile
    let _ = x.exp()?;
    let ((), empty) = kiln::profile(|| {});
    assert!(empty.events.is_empty(), "{:?}", empty.events);
    Ok(())
}

#[test]
fn compiled_regions_and_their_backward_nest_the_work_they_run() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let w = Tensor::randn(&[16, 16], DType::F32)?;
    w.set_requires_grad(true)?;
    let f = kiln::compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].matmul(&w)?.tanh()?.sum_all()?]),
        CompileOptions::default().backend("aot_eager"),
    )?;
    let x = Tensor::randn(&[4, 16], DType::F32)?;
    f.call(std::slice::from_ref(&x))?; // compile outside the profile
    let (r, p) = kiln::profile(|| -> Result<()> {
        for _ in 0..2 {
            f.call(std::slice::from_ref(&x))?[0].backward()?;
        }
        Ok(())
    });
    r?;
    let rows = p.rows();
    let region = rows
        .iter()
        .find(|r| r.category == Category::CompiledRegion)
        .expect("a compiled-region row");
    assert_eq!(region.calls, 2);
    assert!(region.name.contains("compiled region"), "{}", region.name);
    // the interpreter's matmul runs inside the region: the region's self time excludes it
    assert!(region.self_ns < region.total_ns, "{region:?}");
    let backward = rows
        .iter()
        .find(|r| r.category == Category::CompiledBackward)
        .expect("a compiled-backward row");
    assert_eq!(backward.calls, 2);
    // self times add up to the time of the outermost spans
    let self_sum: u64 = rows.iter().map(|r| r.self_ns).sum();
    assert!(self_sum <= p.events.iter().map(|e| e.dur_ns).sum::<u64>());
    let table = p.table(20);
    assert!(table.lines().next().unwrap().contains("self"), "{table}");
    assert!(table.contains("CompiledFunctionBackward"), "{table}");

    let trace: serde_json::Value = serde_json::from_str(&p.chrome_trace()).expect("valid JSON");
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    assert_eq!(events.len(), p.events.len());
    assert!(events
        .iter()
        .all(|e| e["ph"] == "X" && e["dur"].as_f64().is_some()));
    let dir = std::env::temp_dir().join(format!("kiln-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    p.save_chrome_trace(dir.join("trace.json"))?;
    assert!(std::fs::metadata(dir.join("trace.json")).unwrap().len() > 10);
    let bad = p.save_chrome_trace(dir.join("no/such/dir/trace.json"));
    assert!(bad.unwrap_err().to_string().contains("cannot write"));
    Ok(())
}

#[test]
fn generated_kernels_get_their_own_rows() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if kiln::inductor::runtime::cc::toolchain().is_none() {
        eprintln!("SKIPPED: no C compiler, so no generated kernels to profile");
        return Ok(());
    }
    let f = kiln::compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].sin()?.add(&a[0].cos()?)?]),
        CompileOptions::default(),
    )?;
    let x = Tensor::randn(&[1024], DType::F32)?;
    f.call(std::slice::from_ref(&x))?;
    let (r, p) = kiln::profile(|| f.call(std::slice::from_ref(&x)));
    r?;
    let rows = p.rows();
    let kernel = rows
        .iter()
        .find(|r| r.category == Category::Kernel)
        .unwrap_or_else(|| panic!("no kernel row: {rows:?}"));
    assert_eq!(kernel.calls, 1);
    // the fused sin+cos+add is one kernel inside the compiled region
    let region = rows
        .iter()
        .find(|r| r.category == Category::CompiledRegion)
        .expect("a compiled-region row");
    assert!(region.total_ns >= kernel.total_ns);
    Ok(())
}

/// A profile inside another (a library profiling its own step inside a user's profile) returns
/// the ops run within it; the outer one sees those and its own. It used to hang: both took one
/// session lock on the same thread.
#[test]
fn a_profile_inside_a_profile_sees_its_own_ops() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let x = Tensor::randn(&[8, 8], DType::F32)?;
    let (r, outer) = kiln::profile(|| -> Result<Profile> {
        let _ = x.exp()?;
        let (r, inner) = kiln::profile(|| x.matmul(&x));
        r?;
        let _ = x.tanh()?;
        Ok(inner)
    });
    let inner = r?;
    let ops = |p: &Profile| -> Vec<String> {
        p.rows()
            .into_iter()
            .filter(|r| r.category == Category::Op)
            .map(|r| r.name)
            .collect()
    };
    // (matmul runs a reshape of its own)
    let inner = ops(&inner);
    assert!(inner.contains(&"matmul".into()), "{inner:?}");
    assert!(
        !inner.contains(&"exp".into()) && !inner.contains(&"tanh".into()),
        "{inner:?}"
    );
    let outer = ops(&outer);
    for op in ["exp", "matmul", "tanh"] {
        assert!(outer.contains(&op.into()), "{op}: {outer:?}");
    }
    Ok(())
}
