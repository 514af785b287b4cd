//! CPU matmul, 1024^3 f32: kiln's `Tensor::matmul` (dispatch + prim + gemm) against calling the
//! `gemm` crate directly with the same parallelism. The bar: kiln >= 80% of gemm's speed.
//! Run: cargo bench -p kiln --bench matmul

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::{DType, Tensor};

const N: usize = 1024;

fn bench(c: &mut Criterion) {
    let a = Tensor::randn(&[N, N], DType::F32).expect("randn");
    let b = Tensor::randn(&[N, N], DType::F32).expect("randn");
    let av = a.to_vec::<f32>().expect("to_vec");
    let bv = b.to_vec::<f32>().expect("to_vec");
    let mut out = vec![0f32; N * N];
    let mut g = c.benchmark_group("matmul_1024_f32");
    g.sample_size(20);
    g.bench_function("gemm_crate", |bch| {
        bch.iter(|| unsafe {
            gemm::gemm(
                N,
                N,
                N,
                out.as_mut_ptr(),
                1,
                N as isize,
                false,
                av.as_ptr(),
                1,
                N as isize,
                bv.as_ptr(),
                1,
                N as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(rayon::current_num_threads()),
            )
        })
    });
    g.bench_function("kiln_matmul", |bch| {
        bch.iter(|| a.matmul(&b).expect("matmul"))
    });
    g.bench_function("kiln_matmul_transposed_rhs", |bch| {
        let bt = b.t().expect("t");
        bch.iter(|| a.matmul(&bt).expect("matmul"))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
