//! A training step's batch norm on the CPU: `BatchNorm2d(64)` in train mode, forward and backward
//! on a [16, 64, 56, 56] activation (ResNet's first stage at batch 16), eager and compiled with the
//! default backend. The compiled step's backward sums per channel (the gradient, and the gradient
//! times the normalized input) in one walk over the activation (`codegen/c_siblings.rs`).
//!
//! Run: cargo bench -p kiln --bench batch_norm_cpu

use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kiln::nn::{BatchNorm2d, Module, Sequential};
use kiln::prelude::*;

fn step(m: &dyn Module, x: &Tensor) -> Result<()> {
    let loss = m.forward(x)?.sum(&[], false)?;
    loss.backward()
}

fn bench(c: &mut Criterion) {
    let setup = || -> Result<(Sequential, Tensor)> {
        kiln::manual_seed(0);
        let m = Sequential::new().add(BatchNorm2d::new(64)?);
        m.train(true);
        let x = Tensor::randn(&[16, 64, 56, 56], DType::F32)?;
        x.set_requires_grad(true)?;
        Ok((m, x))
    };
    let Ok((m, x)) = setup() else {
        eprintln!("batch_norm_cpu: setup failed");
        return;
    };
    let mut g = c.benchmark_group("batch_norm_cpu_fwd_bwd_16x64x56x56");
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    g.bench_function("eager", |b| b.iter(|| black_box(step(&m, &x))));
    let Ok(compiled) = kiln::compile(&m, CompileOptions::default()) else {
        eprintln!("batch_norm_cpu: compile failed");
        return;
    };
    g.bench_function("compiled", |b| b.iter(|| black_box(step(&compiled, &x))));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
