//! The compiled-graph cache on disk (issue 5's warm start; PyTorch's FX graph and AOTAutograd
//! caches): a new process that captures a graph compiled before reads AOT autograd's split and
//! each graph's plan from disk, builds nothing, and computes what the first compile computed,
//! bit for bit; a damaged entry is replaced; `KILN_GRAPH_CACHE=0` turns it off. The checks
//! share process-wide counters (and set an environment variable), so they run as one test, in
//! order, the only one of this binary.

use kiln::compiler::disk_cache::{self, DiskCacheStats};
use kiln::compiler::prefetch;
use kiln::inductor::{forget_loaded_kernels, kernel_cache_stats, with_fresh_cache};
use kiln::nn::{
    BatchNorm2d, Conv2d, Conv2dConfig, Dropout, Flatten, Linear, MaxPool2d, Module, ReLU,
    Sequential,
};
use kiln::prelude::*;
use kiln::Error;

/// Convolution, batch norm (its running statistics are written in place), dropout (random
/// numbers), pooling and a linear layer: every kind of step a plan stores.
fn model() -> Result<Sequential> {
    Ok(Sequential::new()
        .add(Conv2d::new(
            2,
            4,
            [3, 3],
            Conv2dConfig::default().padding(1),
        )?)
        .add(BatchNorm2d::new(4)?)
        .add(ReLU::new())
        .add(MaxPool2d::new(2)?)
        .add(Flatten::new(1, -1))
        .add(Dropout::new(0.25)?)
        .add(Linear::new(4 * 3 * 3, 5, true)?))
}

/// Everything one training step computes: the output, each parameter's gradient, each buffer
/// (batch norm's running statistics) after it, as bits.
fn step(
    compiled: &dyn Module,
    m: &Sequential,
    x: &Tensor,
    state: &kiln::nn::StateDict,
) -> Result<Vec<Vec<u64>>> {
    m.load_state_dict(state, true)?;
    m.zero_grad();
    manual_seed(11);
    let out = compiled.forward(x)?;
    out.square()?.mean_all()?.backward()?;
    let mut all = vec![out];
    all.extend(m.parameters().iter().filter_map(|p| p.grad()));
    all.extend(m.state_dict().iter().map(|(_, t)| t.clone()));
    all.iter()
        .map(|t| Ok(t.to_vec_f64()?.iter().map(|v| v.to_bits()).collect()))
        .collect()
}

fn copy(m: &Sequential) -> Result<kiln::nn::StateDict> {
    let mut sd = kiln::nn::StateDict::new();
    for (k, t) in m.state_dict().iter() {
        let c = Tensor::zeros_like(t)?;
        c.assign(t)?;
        sd.insert(k, c);
    }
    Ok(sd)
}

fn delta(a: DiskCacheStats, b: DiskCacheStats) -> (u64, u64, u64, u64) {
    (
        b.hits - a.hits,
        b.misses - a.misses,
        b.stores - a.stores,
        b.damaged - a.damaged,
    )
}

/// A new process's view: the structural graph cache and the loaded kernels forgotten.
fn as_a_new_process() {
    kiln::reset();
    forget_loaded_kernels();
}

#[test]
fn a_training_step_compiled_in_a_new_process_comes_from_the_disk_cache() -> Result<()> {
    if kiln::inductor::runtime::cc::toolchain().is_none() {
        eprintln!("SKIPPED: no C compiler; the kiln backend runs the interpreter");
        return Ok(());
    }
    if !disk_cache::enabled() {
        eprintln!("SKIPPED: KILN_GRAPH_CACHE=0 turns the cache off");
        return Ok(());
    }
    manual_seed(3);
    let m = model()?;
    m.train(true);
    let x = Tensor::randn(&[3, 2, 6, 6], DType::F32)?;
    let state = copy(&m)?;
    let eager = step(&m, &m, &x, &state)?;
    with_fresh_cache(|| -> Result<()> {
        let compile = || kiln::compile(&m, CompileOptions::default());
        // cold: AOT autograd's split and the two graphs' plans are stored
        let (s0, k0) = (disk_cache::stats(), kernel_cache_stats());
        let first = step(&compile()?, &m, &x, &state)?;
        let (s1, k1) = (disk_cache::stats(), kernel_cache_stats());
        assert_eq!(delta(s0, s1), (0, 3, 3, 0), "cold: 3 misses, 3 stores");
        assert!(k1.compiles > k0.compiles, "cold: the C compiler runs");
        assert_eq!(first, eager, "compiled equals eager bit for bit");

        // a new process: all three read back, nothing stored or built, the same bits; all
        // three were read ahead while the step was traced (the function's manifest, written by
        // the cold compile, names the split; the split's graphs key the plans)
        as_a_new_process();
        let taken = prefetch::taken();
        let second = step(&compile()?, &m, &x, &state)?;
        let (s2, k2) = (disk_cache::stats(), kernel_cache_stats());
        assert_eq!(
            delta(s1, s2),
            (3, 0, 0, 0),
            "warm: 3 hits, each counted once"
        );
        assert_eq!(prefetch::taken() - taken, 3, "warm: all 3 read ahead");
        assert_eq!(k2.compiles, k1.compiles, "warm: nothing built");
        assert_eq!(second, first, "from the cache: the same results");

        // damaged plans are detected, removed, rebuilt and stored again
        let plans = kiln::core::cache::cache_root().join("graphs").join("c");
        let mut damaged = 0;
        for e in std::fs::read_dir(&plans).map_err(|e| Error::arg("test", e.to_string()))? {
            let p = e.map_err(|e| Error::arg("test", e.to_string()))?.path();
            let mut bytes = std::fs::read(&p).map_err(|e| Error::arg("test", e.to_string()))?;
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0xff;
            std::fs::write(&p, &bytes).map_err(|e| Error::arg("test", e.to_string()))?;
            damaged += 1;
        }
        assert_eq!(damaged, 2, "one plan per graph");
        as_a_new_process();
        let third = step(&compile()?, &m, &x, &state)?;
        let s3 = disk_cache::stats();
        assert_eq!(
            delta(s2, s3),
            (1, 2, 2, 2),
            "the split hits; both plans damaged (found so by their read-ahead: counted once), \
             rebuilt, stored"
        );
        assert_eq!(third, first);

        // another model's graph is another key: a miss, not a wrong hit
        as_a_new_process();
        let wider = Sequential::new().add(Linear::new(6, 3, true)?);
        let z = Tensor::randn(&[9, 6], DType::F32)?;
        let y = kiln::compile(&wider, CompileOptions::default())?.forward(&z)?;
        y.sum_all()?.backward()?;
        let s4 = disk_cache::stats();
        assert_eq!(
            delta(s3, s4),
            (0, 3, 3, 0),
            "a new graph misses; what was read ahead for the other model (the same function \
             name) is not taken, nor counted"
        );

        // an inference graph (no AOT autograd): its one plan stored, then read back
        let infer = || -> Result<Vec<u64>> {
            as_a_new_process();
            let y =
                kiln::no_grad(|| kiln::compile(&wider, CompileOptions::default())?.forward(&z))?;
            Ok(y.to_vec_f64()?.iter().map(|v| v.to_bits()).collect())
        };
        let (cold, s5) = (infer()?, disk_cache::stats());
        assert_eq!(
            delta(s4, s5),
            (0, 1, 1, 0),
            "inference cold: one plan stored"
        );
        let (warm, s6) = (infer()?, disk_cache::stats());
        assert_eq!(delta(s5, s6), (1, 0, 0, 0), "inference warm: one plan read");
        assert_eq!(warm, cold);

        // KILN_READ_AHEAD=0: the same three records, read by the compile itself, the same
        // results (this binary's only test, so the variable reaches no other)
        std::env::set_var("KILN_READ_AHEAD", "0");
        as_a_new_process();
        let (s_before, taken) = (disk_cache::stats(), prefetch::taken());
        let unread = step(&compile()?, &m, &x, &state);
        std::env::remove_var("KILN_READ_AHEAD");
        assert_eq!(unread?, first);
        assert_eq!(delta(s_before, disk_cache::stats()), (3, 0, 0, 0), "3 hits");
        assert_eq!(prefetch::taken(), taken, "nothing read ahead");
        let s4 = disk_cache::stats();

        // KILN_GRAPH_CACHE=0: nothing read or stored, the same results (this binary's only
        // test, so the variable reaches no other)
        std::env::set_var("KILN_GRAPH_CACHE", "0");
        as_a_new_process();
        let off = step(&compile()?, &m, &x, &state);
        std::env::remove_var("KILN_GRAPH_CACHE");
        assert_eq!(off?, first);
        assert_eq!(
            delta(s4, disk_cache::stats()),
            (0, 0, 0, 0),
            "the cache is off"
        );
        Ok(())
    })
}
