//! Horizontal fusion on the CPU (`kiln_inductor`'s `codegen/c_horizontal.rs`): independent
//! kernels of a compiled graph run as one C function with one OpenMP parallel region. Checked on
//! the generated source (the `output_code` log channel), the executor's launch counter, and the
//! results, which equal eager's bit for bit.
//!
//! One test running its checks in order: the log channel is chosen once per process, before the
//! first compile, and the source of a kernel is logged only by the compile that builds it.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use kiln::inductor::{exec_stats, with_fresh_cache};
use kiln::nn::optim::{Adam, AdamConfig, Optimizer};
use kiln::prelude::*;

/// Everything the `output_code` channel printed.
fn logged() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(Default::default)
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut log = self.0.lock().unwrap_or_else(|e| e.into_inner());
        log.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Turns the `output_code` channel on into `logged()`: before anything of kiln logs (the channel
/// reads `KILN_LOGS` once; a subscriber installed here wins over kiln's own).
fn capture_output_code() {
    std::env::set_var("KILN_LOGS", "output_code");
    let _ = tracing_subscriber::fmt()
        .with_writer(|| Capture(Arc::clone(logged())))
        .with_ansi(false)
        .without_time()
        .try_init();
}

/// The generated C the compiles inside `f` logged.
fn source_of<R>(f: impl FnOnce() -> R) -> (R, String) {
    let start = logged().lock().unwrap_or_else(|e| e.into_inner()).len();
    let r = f();
    let log = logged().lock().unwrap_or_else(|e| e.into_inner());
    (r, String::from_utf8_lossy(&log[start..]).into_owned())
}

/// Kernel launches per call of `f(args)` (after a first call that compiles).
fn launches(f: &kiln::CompiledFn<'_>, args: &[Tensor]) -> Result<u64> {
    f.call(args)?;
    let before = exec_stats().kernel_launches;
    f.call(args)?;
    Ok(exec_stats().kernel_launches - before)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

/// Shapes of the independent products: distinct, so that no two are one grouped loop; three
/// large enough for threads, two small.
const SHAPES: [&[usize]; 5] = [&[256, 256], &[300, 200], &[64, 1024], &[10], &[3, 7]];

/// Per shape `k`: `tanh(a_k) * b_k + 0.5`, and a row sum of the first; all independent.
fn independent(a: &[Tensor]) -> Result<Vec<Tensor>> {
    let mut out = Vec::new();
    for pair in a.chunks(2) {
        out.push(pair[0].tanh()?.mul(&pair[1])?.add(0.5)?);
    }
    out.push(a[0].sum(&[1], false)?);
    Ok(out)
}

fn independent_ops_share_one_region() -> Result<()> {
    manual_seed(3);
    let mut args = Vec::new();
    for s in SHAPES {
        args.push(Tensor::randn(s, DType::F32)?);
        args.push(Tensor::randn(s, DType::F32)?);
    }
    let (compiled, src) = source_of(|| {
        with_fresh_cache(|| -> Result<_> {
            let f = kiln::compile_fn(independent, CompileOptions::default())?;
            let out = no_grad(|| f.call(&args))?;
            let n = no_grad(|| launches(&f, &args))?;
            Ok((out, n))
        })
    });
    let (out, n) = compiled?;
    // six kernels (five products, a row sum) before horizontal fusion
    assert_eq!(n, 1, "launches per call");
    assert_eq!(src.matches("#pragma omp parallel\n").count(), 1, "{src}");
    assert_eq!(src.matches("parallel for").count(), 0, "{src}");
    assert_eq!(src.matches("schedule(static) nowait").count(), 4, "{src}");
    assert_eq!(src.matches("#pragma omp single nowait").count(), 2, "{src}");
    let want = independent(&args)?;
    assert_eq!(out.len(), want.len());
    for (k, (o, w)) in out.iter().zip(&want).enumerate() {
        assert_eq!(bits(o)?, bits(w)?, "output {k} differs from eager");
    }
    Ok(())
}

/// Adam over parameters of several shapes, compiled, against eager, three steps.
fn adam_step_in_two_launches() -> Result<()> {
    let shapes: [&[usize]; 4] = [&[256, 256], &[300, 200], &[64], &[5, 5]];
    let params = |seed| -> Result<Vec<Tensor>> {
        manual_seed(seed);
        shapes
            .iter()
            .map(|s| {
                let p = Tensor::randn(s, DType::F32)?.with_grad()?;
                p.set_grad(Some(Tensor::randn(s, DType::F32)?));
                Ok(p)
            })
            .collect()
    };
    let (eager_ps, compiled_ps) = (params(11)?, params(11)?);
    let config = AdamConfig {
        lr: 0.01,
        ..AdamConfig::default()
    };
    let mut eager = Adam::new(eager_ps.clone(), config)?;
    let opt = Mutex::new(Adam::new(compiled_ps.clone(), config)?);
    let (compiled, src) = source_of(|| {
        with_fresh_cache(|| -> Result<Vec<u64>> {
            let step = kiln::compile_fn(
                |_: &[Tensor]| {
                    opt.lock().unwrap_or_else(|e| e.into_inner()).step()?;
                    Ok(vec![])
                },
                CompileOptions::default(),
            )?;
            let mut per_step = Vec::new();
            for _ in 0..3 {
                eager.step()?;
                let before = exec_stats().kernel_launches;
                step.call(&[])?;
                per_step.push(exec_stats().kernel_launches - before);
            }
            Ok(per_step)
        })
    });
    let per_step = compiled?;
    for (e, c) in eager_ps.iter().zip(&compiled_ps) {
        assert_eq!(bits(e)?, bits(c)?, "compiled Adam step differs from eager");
    }
    // before horizontal fusion: a step-count kernel and an update kernel per parameter (8)
    assert_eq!(per_step[1..], [2, 2], "launches per step: {per_step:?}");
    // one region: the two large parameters' updates work-shared in it, the two small ones on
    // one thread each (the step counts are too little work for threads)
    assert_eq!(src.matches("#pragma omp parallel").count(), 1, "{src}");
    assert_eq!(src.matches("schedule(static) nowait").count(), 2, "{src}");
    assert_eq!(src.matches("#pragma omp single nowait").count(), 2, "{src}");
    Ok(())
}

#[test]
fn independent_kernels_run_in_one_parallel_region() -> Result<()> {
    capture_output_code();
    if kiln::inductor::runtime::cc::toolchain().is_none() {
        eprintln!("SKIPPED: no C compiler; the kiln backend runs the interpreter");
        return Ok(());
    }
    independent_ops_share_one_region()?;
    adam_step_in_two_launches()
}
