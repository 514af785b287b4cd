//! Eager launch overhead: 1000 tiny adds on a CUDA tensor, host time per op (queueing only, then
//! including the final synchronize), beside the same loop on the CPU. Prints one line per figure;
//! on a machine without CUDA it says so and exits.

use std::time::Instant;

use kiln_core::{DType, Device, Tensor};

fn per_op(ops: usize, f: impl Fn()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e6 / ops as f64
}

fn main() -> kiln_core::Result<()> {
    kiln_cuda::init();
    if let Some(e) = kiln_cuda::unavailable_reason() {
        println!("launch_overhead: CUDA unavailable, skipped: {e}");
        return Ok(());
    }
    let dev = Device::Cuda(0);
    const N: usize = 1000;
    let x = Tensor::ones(&[16], DType::F32)?.to(dev)?;
    let y = Tensor::ones(&[16], DType::F32)?.to(dev)?;
    // warm-up: NVRTC compiles, module loads, the allocator's first blocks
    let mut z = x.add(&y)?;
    for _ in 0..100 {
        z = z.add(&y)?;
    }
    kiln_cuda::synchronize(dev)?;
    let mut queue = Vec::new();
    let mut total = Vec::new();
    for _ in 0..15 {
        let mut z = x.clone();
        let t = Instant::now();
        for _ in 0..N {
            z = z.add(&y)?;
        }
        queue.push(t.elapsed().as_secs_f64() * 1e6 / N as f64);
        kiln_cuda::synchronize(dev)?;
        total.push(t.elapsed().as_secs_f64() * 1e6 / N as f64);
        std::hint::black_box(&z);
    }
    // device time per op, between events around the same loop
    let mut z = x.clone();
    let start = kiln_cuda::Event::record(dev)?;
    for _ in 0..N {
        z = z.add(&y)?;
    }
    let end = kiln_cuda::Event::record(dev)?;
    let device_us = start.elapsed_ms(&end)? as f64 * 1e3 / N as f64;
    std::hint::black_box(&z);
    queue.sort_by(f64::total_cmp);
    total.sort_by(f64::total_cmp);
    let xc = Tensor::ones(&[16], DType::F32)?;
    let cpu = per_op(N, || {
        let mut z = xc.clone();
        for _ in 0..N {
            z = z.add(&xc).expect("cpu add");
        }
        std::hint::black_box(&z);
    });
    let stats = kiln_cuda::memory_stats(dev)?;
    let (compiles, disk_hits) = kiln_cuda::kernel_cache_stats();
    println!("launch_overhead cuda add [16] x{N}: median {:.2} us/op queued, {:.2} us/op incl. sync (min {:.2}/{:.2})", queue[7], total[7], queue[0], total[0]);
    println!(
        "launch_overhead cuda add [16] x{N}: {device_us:.2} us/op of device time between events"
    );
    println!("launch_overhead cpu  add [16] x{N}: {cpu:.2} us/op");
    println!("memory: allocated {} reserved {} peak {} driver allocs {}; nvrtc compiles {compiles}, disk hits {disk_hits}", stats.allocated, stats.reserved, stats.peak_allocated, stats.driver_allocs);
    Ok(())
}
