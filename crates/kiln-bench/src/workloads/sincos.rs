//! torch_baseline.py's `sincos`: f(x) = sin(x) + cos(x). On a scalar tensor it measures per-call
//! overhead (eager dispatch vs a compiled replay); on 2^26 f32 elements, memory bandwidth — beside
//! plain copies of the same bytes (the floor: read 2^26·4 bytes, write 2^26·4 bytes).

use std::hint::black_box;

use kiln::inductor::with_fresh_cache;
use kiln::{DType, Tensor};

use super::BenchResult;
use crate::harness::{once, Ctx, Timing};

const W: &str = "sincos";
const BIG: usize = 1 << 26;

fn f(x: &Tensor) -> kiln::Result<Tensor> {
    x.sin()?.add(&x.cos()?)
}

/// `dst ← src` with the work split over `threads` threads (a memcpy per chunk).
fn par_copy(dst: &mut [f32], src: &[f32], threads: usize) {
    let chunk = src.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        for (d, x) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            s.spawn(move || d.copy_from_slice(x));
        }
    });
}

/// One pass over the 2^26 elements: its time per call, and the bandwidth of reading and writing
/// them once.
fn emit_pass(ctx: &mut Ctx, variant: &str, t: &Timing) {
    let bytes = (2 * BIG * 4) as f64; // read 4 B and write 4 B per element
    ctx.emit(W, variant, "call", t.us(), "us");
    ctx.emit(W, variant, "bandwidth", bytes / t.s() / 1e9, "GB/s");
}

/// On a GPU the floor is a device copy of the same bytes (a contiguous copy of a permuted view:
/// read 4 B, write 4 B per element); torch_baseline.py's figure is bytes over its `bw` rating.
fn gpu_floor(ctx: &mut Ctx, xb: &Tensor, variant: &str, compiled: &Timing) -> BenchResult {
    let timer = ctx.timer();
    let view = xb.reshape([2, BIG / 2])?.permute(&[1, 0])?;
    let copy = timer.time("sincos: device copy", || view.contiguous())?;
    emit_pass(ctx, "copy_64M_device", &copy);
    ctx.emit(
        W,
        variant,
        "ratio_to_copy_floor",
        compiled.s() / copy.s(),
        "x",
    );
    Ok(())
}

/// Rounds of `paired_ratio`.
const PAIRED_ROUNDS: usize = 21;

/// The compiled call against the all-threads copy, timed back to back: the median over rounds
/// of (one compiled call) / (one copy). The separate medians above are taken seconds apart, and
/// on the GPU machine's shared host the copy alone moves by a third between such runs (5.0 to
/// 7.8 ms in one day's calls); a ratio of neighbours sees the same host.
fn paired_ratio(
    g: &kiln::CompiledFn<'_>,
    args: &[Tensor],
    dst: &mut [f32],
    src: &[f32],
    threads: usize,
) -> kiln::Result<f64> {
    let mut ratios = Vec::with_capacity(PAIRED_ROUNDS);
    for _ in 0..PAIRED_ROUNDS {
        let t = std::time::Instant::now();
        black_box(g.call(args)?);
        let compiled = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        par_copy(dst, src, threads);
        black_box(dst[BIG / 2]);
        ratios.push(compiled / t.elapsed().as_secs_f64());
    }
    ratios.sort_by(f64::total_cmp);
    Ok(ratios[ratios.len() / 2])
}

pub fn run(ctx: &mut Ctx) -> BenchResult {
    let timer = ctx.timer();
    let mode = ctx.mode_name();

    // the scalar: overhead per call
    let x = Tensor::scalar(1.0f32).to(ctx.dev)?;
    let t = timer.time("sincos: eager call", || f(&x))?;
    ctx.emit(W, "eager", "call", t.us(), "us");
    let g = kiln::compile_fn(|a: &[Tensor]| Ok(vec![f(&a[0])?]), ctx.opts())?;
    let args = [x.clone()];
    let (r, t) = with_fresh_cache(|| once("sincos: cold compile", || g.call(&args)));
    black_box(r?);
    ctx.emit(W, mode, "cold_compile", t.as_secs_f64(), "s");
    let t = timer.time("sincos: compiled call", || g.call(&args))?;
    ctx.emit(W, mode, "call", t.us(), "us");

    // 2^26 elements: bandwidth
    let xb = Tensor::randn(&[BIG], DType::F32)?.to(ctx.dev)?;
    let t = timer.time("sincos: eager 64M", || f(&xb))?;
    emit_pass(ctx, "eager_64M", &t);
    let g = kiln::compile_fn(|a: &[Tensor]| Ok(vec![f(&a[0])?]), ctx.opts())?;
    let args = [xb.clone()];
    let compiled = timer.time("sincos: compiled 64M", || g.call(&args))?;
    let variant = format!("{mode}_64M");
    emit_pass(ctx, &variant, &compiled);

    if ctx.on_gpu() {
        return gpu_floor(ctx, &xb, &variant, &compiled);
    }
    // the copies: memcpy into a buffer allocated once (the floor), with one thread and with all;
    // memcpy into a new buffer each call (what an output allocation costs without a caching
    // allocator: fresh pages fault in); kiln's own copies (a permuted view made contiguous)
    let src = xb.to_vec::<f32>()?;
    let mut dst = vec![0f32; BIG];
    let one = timer.time("sincos: memcpy, 1 thread", || {
        dst.copy_from_slice(&src);
        Ok::<_, kiln::Error>(dst[BIG / 2])
    })?;
    emit_pass(ctx, "copy_64M_memcpy_1thread", &one);
    let n = crate::threads();
    let all = timer.time("sincos: memcpy, all threads", || {
        par_copy(&mut dst, &src, n);
        Ok::<_, kiln::Error>(dst[BIG / 2])
    })?;
    let v = format!("copy_64M_memcpy_{n}threads");
    emit_pass(ctx, &v, &all);
    let paired = paired_ratio(&g, &args, &mut dst, &src, n)?;
    drop(dst);
    let fresh = timer.time("sincos: memcpy into a new buffer", || {
        let mut d = Vec::<f32>::with_capacity(BIG);
        d.extend_from_slice(&src);
        Ok::<_, kiln::Error>(d)
    })?;
    emit_pass(ctx, "copy_64M_new_buffer", &fresh);
    drop(src);
    let view = xb.reshape([2, BIG / 2])?.permute(&[1, 0])?;
    let t = timer.time("sincos: eager contiguous copy", || view.contiguous())?;
    emit_pass(ctx, "copy_64M_eager_contiguous", &t);
    let c = kiln::compile_fn(|a: &[Tensor]| Ok(vec![a[0].contiguous()?]), ctx.opts())?;
    let cargs = [view.clone()];
    let t = timer.time("sincos: compiled contiguous copy", || c.call(&cargs))?;
    let v = format!("copy_64M_{mode}_contiguous");
    emit_pass(ctx, &v, &t);

    let floor = one.s().min(all.s());
    ctx.emit(
        W,
        &variant,
        "ratio_to_copy_floor",
        compiled.s() / floor,
        "x",
    );
    ctx.emit(W, &variant, "ratio_to_copy_floor_paired", paired, "x");
    ctx.emit(
        W,
        &variant,
        "ratio_to_copy_new_buffer",
        compiled.s() / fresh.s(),
        "x",
    );
    Ok(())
}
