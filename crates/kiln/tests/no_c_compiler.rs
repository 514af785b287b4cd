//! Without a C compiler the `kiln` backend warns once and runs compiled graphs on the interpreter;
//! with `fullgraph` (strictness) it is an error naming the problem. One test: the compiler is looked
//! up once per process.

use kiln::prelude::*;

#[test]
fn missing_c_compiler_falls_back_or_errs_under_fullgraph() -> Result<()> {
    // before any kiln call in this process: the toolchain probe reads CC once
    std::env::set_var("CC", "/nonexistent/kiln-test-cc");
    let f = |a: &[Tensor]| Ok(vec![a[0].sin()?.mul(2.0)?]);
    let x = Tensor::randn(&[5], DType::F32)?;
    let strict = kiln::compile_fn(f, CompileOptions::default().fullgraph(true))?;
    let err = strict
        .call(std::slice::from_ref(&x))
        .expect_err("fullgraph must refuse the fallback");
    assert!(err.to_string().contains("no C compiler"), "{err}");
    let lenient = kiln::compile_fn(f, CompileOptions::default())?;
    let got = lenient.call(std::slice::from_ref(&x))?;
    assert_eq!(
        got[0].to_vec::<f32>()?,
        f(std::slice::from_ref(&x))?[0].to_vec::<f32>()?
    );
    Ok(())
}
