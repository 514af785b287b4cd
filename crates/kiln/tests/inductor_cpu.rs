//! The `kiln` backend's CPU code generation (issue 5): fusion, the kernel cache (memory and disk,
//! damaged entries rebuilt), and regional reuse. The checks share process-wide caches, so they run
//! as one test, in order.

use kiln::inductor::{cache_dir, forget_loaded_kernels, kernel_cache_stats, with_fresh_cache};
use kiln::nn::{Linear, Module, ReLU, Sequential, Sigmoid};
use kiln::prelude::*;

fn assert_close(a: &Tensor, b: &Tensor, tol: f64) {
    let (x, y) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    assert_eq!(x.len(), y.len());
    for (p, q) in x.iter().zip(&y) {
        assert!((p - q).abs() <= tol * (1.0 + q.abs()), "{p} vs {q}");
    }
}

/// Kernels a fresh process would build for `f(args)`, and the compiled result.
fn kernels_for(
    f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync,
    args: &[Tensor],
) -> Result<(usize, Vec<Tensor>)> {
    with_fresh_cache(|| {
        let before = kernel_cache_stats().kernels;
        let c = kiln::compile_fn(&f, CompileOptions::default())?;
        let out = kiln::no_grad(|| c.call(args))?;
        Ok((kernel_cache_stats().kernels - before, out))
    })
}

fn block() -> Result<Sequential> {
    Ok(Sequential::new()
        .add(Linear::new(10, 10, true)?)
        .add(ReLU::new())
        .add(Sigmoid::new())
        .add(Linear::new(10, 10, true)?)
        .add(ReLU::new()))
}

fn fusion() -> Result<()> {
    let x = Tensor::randn(&[64, 33], DType::F32)?;
    // a chain of elementwise ops is one loop
    let chain = |a: &[Tensor]| Ok(vec![a[0].exp()?.add(1.0)?.log()?.tanh()?.mul(&a[0])?]);
    let (n, out) = kernels_for(chain, std::slice::from_ref(&x))?;
    assert_eq!(n, 1, "elementwise chain");
    assert_close(&out[0], &chain(std::slice::from_ref(&x))?[0], 1e-6);
    // softmax: max, then sum of exp (the exp fused into the reduction), then the normalisation
    let softmax = |a: &[Tensor]| Ok(vec![a[0].softmax(-1)?]);
    let (n, out) = kernels_for(softmax, std::slice::from_ref(&x))?;
    assert!(n <= 3, "softmax took {n} kernels");
    assert_close(&out[0], &x.softmax(-1)?, 1e-6);
    Ok(())
}

fn regional_reuse() -> Result<()> {
    // eight identical blocks compile exactly the kernels of one block
    let one = block()?;
    let mut eight = Sequential::new();
    for _ in 0..8 {
        eight.push(block()?);
    }
    let x = Tensor::randn(&[4, 10], DType::F32)?;
    fn count(m: &Sequential, x: &Tensor) -> Result<usize> {
        with_fresh_cache(|| {
            let before = kernel_cache_stats().kernels;
            let c = kiln::compile(m, CompileOptions::default())?;
            let y = kiln::no_grad(|| c.forward(x))?;
            assert_close(&y, &kiln::no_grad(|| m.forward(x))?, 1e-5);
            Ok(kernel_cache_stats().kernels - before)
        })
    }
    let (k1, k8) = (count(&one, &x)?, count(&eight, &x)?);
    println!("kernels: one block {k1}, eight blocks {k8}");
    assert!(k1 > 0);
    assert_eq!(k8, k1, "identical blocks share their kernels");
    Ok(())
}

fn disk_cache() -> Result<()> {
    let f = |a: &[Tensor]| Ok(vec![a[0].sin()?.add(&a[0].cos()?)?]);
    let x = Tensor::randn(&[1000], DType::F32)?;
    let want = f(std::slice::from_ref(&x))?;
    with_fresh_cache(|| -> Result<()> {
        let run = || -> Result<()> {
            let c = kiln::compile_fn(f, CompileOptions::default())?;
            assert_close(&c.call(std::slice::from_ref(&x))?[0], &want[0], 1e-6);
            Ok(())
        };
        let s0 = kernel_cache_stats();
        run()?;
        let s1 = kernel_cache_stats();
        assert_eq!(s1.compiles, s0.compiles + 1, "cold: the C compiler runs");
        // a new process: the library comes from disk, nothing is compiled
        forget_loaded_kernels();
        run()?;
        let s2 = kernel_cache_stats();
        assert_eq!((s2.compiles, s2.disk_hits), (s1.compiles, s1.disk_hits + 1));
        // the same process compiling again: nothing at all
        kiln::reset();
        run()?;
        assert_eq!(kernel_cache_stats(), s2, "loaded kernels are reused");
        // a damaged entry is detected and rebuilt
        let mut damaged = 0;
        for e in std::fs::read_dir(cache_dir()).map_err(|e| Error::arg("test", e.to_string()))? {
            let p = e.map_err(|e| Error::arg("test", e.to_string()))?.path();
            if p.extension().is_some_and(|x| x == "so") {
                // a new file in its place (writing into the mapped one would crash this process)
                std::fs::remove_file(&p).map_err(|e| Error::arg("test", e.to_string()))?;
                std::fs::write(&p, b"not a library")
                    .map_err(|e| Error::arg("test", e.to_string()))?;
                damaged += 1;
            }
        }
        assert!(damaged > 0);
        forget_loaded_kernels();
        run()?;
        assert_eq!(kernel_cache_stats().compiles, s2.compiles + 1, "rebuilt");
        Ok(())
    })
}

use kiln::Error;

#[test]
fn generated_cpu_kernels_fuse_cache_and_reuse() -> Result<()> {
    if kiln::inductor::runtime::cc::toolchain().is_none() {
        eprintln!("SKIPPED: no C compiler; the kiln backend runs the interpreter");
        return Ok(());
    }
    fusion()?;
    regional_reuse()?;
    disk_cache()?;
    Ok(())
}
