//! 2-D convolution and its two gradients by im2col + gemm, per image and per group. Images run in
//! parallel; the weight gradient sums per-thread partials.

use rayon::prelude::*;

use std::borrow::Cow;

use super::epilogue::EpilogueSlices;
use super::num::{Float, Num};
use super::{as_f32, from_f32_like, typed};
use crate::prim::{ConvEpilogue, ConvParams};
use crate::storage::CpuStorage;
use crate::{DType, Tensor};

struct Geom {
    c: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    p: ConvParams,
    /// How each image's GEMMs use threads: images run in parallel, so with fewer images than
    /// threads the GEMMs split their own work too (the same sums either way: gemm divides
    /// rows and columns among threads, never the inner dim).
    par: gemm::Parallelism,
}

impl Geom {
    /// The output columns `ox` whose input column `ox * stride + kj * dilation - padding` lies
    /// inside the image, as `lo..hi`: each row of a column matrix is zeros, then a strided run of
    /// the input row, then zeros, so the loops below copy runs instead of testing every element.
    fn valid_cols(&self, kj: usize) -> (usize, usize) {
        let (s, pd, d) = (self.p.stride[1], self.p.padding[1], self.p.dilation[1]);
        let shift = kj * d; // ix = ox * s + shift - pd
        let lo = pd.saturating_sub(shift).div_ceil(s).min(self.ow);
        let hi = (self.w + pd)
            .saturating_sub(shift)
            .div_ceil(s)
            .clamp(lo, self.ow);
        (lo, hi)
    }

    /// The input row an output row `oy` reads at kernel row `ki`, if it lies inside the image.
    fn input_row(&self, oy: usize, ki: usize) -> Option<usize> {
        let iy =
            (oy * self.p.stride[0] + ki * self.p.dilation[0]).checked_sub(self.p.padding[0])?;
        (iy < self.h).then_some(iy)
    }

    /// Whether the column matrix of an image is the image itself (`[C, H*W]`): a 1x1 kernel,
    /// stride 1 and no padding.
    fn col_is_image(&self) -> bool {
        self.kh == 1
            && self.kw == 1
            && self.p.stride == [1, 1]
            && self.p.padding == [0, 0]
            && (self.oh, self.ow) == (self.h, self.w)
    }

    /// The column matrix [cg*kh*kw, oh*ow] of one image's channels [c0, c0+cg): the image's own
    /// channels where they are it (`col_is_image`), else unfolded into `buf`.
    fn columns<'a, T: Num>(
        &self,
        img: &'a [T],
        c0: usize,
        cg: usize,
        buf: &'a mut Vec<T>,
    ) -> &'a [T] {
        let hw = self.h * self.w;
        if self.col_is_image() {
            return &img[c0 * hw..][..cg * hw];
        }
        buf.resize(cg * self.kh * self.kw * self.oh * self.ow, T::ZERO);
        self.im2col(img, c0, cg, buf);
        buf
    }

    /// Unfolds one image's channels [c0, c0+cg) into col [cg*kh*kw, oh*ow].
    fn im2col<T: Num>(&self, img: &[T], c0: usize, cg: usize, col: &mut [T]) {
        let (s, d, pd) = (self.p.stride[1], self.p.dilation[1], self.p.padding[1]);
        let ohw = self.oh * self.ow;
        if ohw == 0 {
            return; // `Prim::infer` refuses empty outputs; rows of 0 cannot be chunked
        }
        for ci in 0..cg {
            let plane = &img[(c0 + ci) * self.h * self.w..][..self.h * self.w];
            for ki in 0..self.kh {
                for kj in 0..self.kw {
                    let row = &mut col[((ci * self.kh + ki) * self.kw + kj) * ohw..][..ohw];
                    let (lo, hi) = self.valid_cols(kj);
                    for (oy, out) in row.chunks_exact_mut(self.ow).enumerate() {
                        let Some(iy) = self.input_row(oy, ki) else {
                            out.fill(T::ZERO);
                            continue;
                        };
                        out[..lo].fill(T::ZERO);
                        out[hi..].fill(T::ZERO);
                        if lo < hi {
                            let first = iy * self.w + lo * s + kj * d - pd;
                            let src = &plane[first..];
                            if s == 1 {
                                out[lo..hi].copy_from_slice(&src[..hi - lo]);
                            } else {
                                for (o, &v) in out[lo..hi].iter_mut().zip(src.iter().step_by(s)) {
                                    *o = v;
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Adds col [cg*kh*kw, oh*ow] back into image channels [c0, c0+cg).
    fn col2im<T: Num>(&self, col: &[T], c0: usize, cg: usize, img: &mut [T]) {
        let (s, d, pd) = (self.p.stride[1], self.p.dilation[1], self.p.padding[1]);
        let ohw = self.oh * self.ow;
        if ohw == 0 {
            return;
        }
        for ci in 0..cg {
            let plane = &mut img[(c0 + ci) * self.h * self.w..][..self.h * self.w];
            for ki in 0..self.kh {
                for kj in 0..self.kw {
                    let row = &col[((ci * self.kh + ki) * self.kw + kj) * ohw..][..ohw];
                    let (lo, hi) = self.valid_cols(kj);
                    if lo == hi {
                        continue;
                    }
                    for (oy, src) in row.chunks_exact(self.ow).enumerate() {
                        let Some(iy) = self.input_row(oy, ki) else {
                            continue;
                        };
                        let first = iy * self.w + lo * s + kj * d - pd;
                        let dst = plane[first..].iter_mut().step_by(s);
                        for (p, &v) in dst.zip(&src[lo..hi]) {
                            *p = p.add(v);
                        }
                    }
                }
            }
        }
    }
}

/// dst[m,n] (+)= sum_k a[m,k] b[k,n] with explicit (row, col) strides for a and b.
#[allow(clippy::too_many_arguments)]
fn mm<T: Num + 'static>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    accumulate: bool,
    a: &[T],
    a_rs: usize,
    a_cs: usize,
    b: &[T],
    b_rs: usize,
    b_cs: usize,
    par: gemm::Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: callers pass slices whose extents cover the strided m x k and k x n matrices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            par,
        )
    }
}

fn geom(x_shape: &[usize], w_shape: &[usize], out_shape: &[usize], p: &ConvParams) -> Geom {
    Geom {
        c: x_shape[1],
        h: x_shape[2],
        w: x_shape[3],
        kh: w_shape[2],
        kw: w_shape[3],
        oh: out_shape[2],
        ow: out_shape[3],
        p: *p,
        par: if x_shape[0] < rayon::current_num_threads() {
            gemm::Parallelism::Rayon(0)
        } else {
            gemm::Parallelism::None
        },
    }
}

/// The convolution of `n` images, each image's output finished by `epilogue` (if any) right after
/// its GEMMs, while it is in cache.
fn forward<T: Float + 'static>(
    x: &[T],
    w: &[T],
    n: usize,
    o: usize,
    g: &Geom,
    epilogue: Option<&EpilogueSlices<'_, T>>,
) -> Vec<T> {
    let groups = g.p.groups;
    let (cg, og) = (g.c / groups, o / groups);
    let (ohw, kk) = (g.oh * g.ow, cg * g.kh * g.kw);
    let len = n * o * ohw;
    if len == 0 {
        return Vec::new();
    }
    // every element is written by a GEMM that does not read it (no accumulation): a cached
    // buffer's pages are mapped already
    let mut out = super::alloc::take_vec(len).unwrap_or_else(|| vec![T::ZERO; len]);
    out.par_chunks_mut(o * ohw)
        .enumerate()
        .for_each(|(b, out_img)| {
            let img = &x[b * g.c * g.h * g.w..][..g.c * g.h * g.w];
            let mut col = Vec::new();
            for gi in 0..groups {
                let col = g.columns(img, gi * cg, cg, &mut col);
                let wg = &w[gi * og * kk..][..og * kk];
                mm(
                    og,
                    ohw,
                    kk,
                    &mut out_img[gi * og * ohw..][..og * ohw],
                    false,
                    wg,
                    kk,
                    1,
                    col,
                    ohw,
                    1,
                    g.par,
                );
            }
            if let Some(e) = epilogue {
                e.apply(b, out_img, ohw);
            }
        });
    out
}

fn grad_input<T: Num + 'static>(gout: &[T], w: &[T], n: usize, o: usize, g: &Geom) -> Vec<T> {
    let groups = g.p.groups;
    let (cg, og) = (g.c / groups, o / groups);
    let (ohw, kk) = (g.oh * g.ow, cg * g.kh * g.kw);
    let chw = g.c * g.h * g.w;
    let mut gin = vec![T::ZERO; n * chw];
    if gin.is_empty() {
        return gin;
    }
    gin.par_chunks_mut(chw).enumerate().for_each(|(b, gimg)| {
        let mut col = vec![T::ZERO; kk * ohw];
        for gi in 0..groups {
            let wg = &w[gi * og * kk..][..og * kk];
            let go = &gout[(b * o + gi * og) * ohw..][..og * ohw];
            // col = wg^T [kk, og] @ go [og, ohw]
            mm(kk, ohw, og, &mut col, false, wg, 1, kk, go, ohw, 1, g.par);
            g.col2im(&col, gi * cg, cg, gimg);
        }
    });
    gin
}

/// The weight gradient: `sum over images of gout[b] @ col[b]^T`, one GEMM per image and group
/// accumulating into the result in image order, each GEMM split among threads (so the sums do not
/// depend on how threads share the images: the result is the same on every run and any number of
/// threads). The column matrices of up to a thread's worth of images are unfolded in parallel
/// first.
fn grad_weight<T: Num + 'static>(gout: &[T], x: &[T], n: usize, o: usize, g: &Geom) -> Vec<T> {
    let groups = g.p.groups;
    let (cg, og) = (g.c / groups, o / groups);
    let (ohw, kk) = (g.oh * g.ow, cg * g.kh * g.kw);
    let chw = g.c * g.h * g.w;
    let mut acc = vec![T::ZERO; o * kk];
    let per_batch = rayon::current_num_threads().max(1);
    for first in (0..n).step_by(per_batch) {
        let batch = first..(first + per_batch).min(n);
        // each image's column matrix over all its channels: group gi's rows are [gi*kk, (gi+1)*kk)
        let cols: Vec<Cow<'_, [T]>> = batch
            .clone()
            .into_par_iter()
            .map(|b| {
                let img = &x[b * chw..][..chw];
                if g.col_is_image() {
                    return Cow::Borrowed(img);
                }
                let mut buf = Vec::new();
                g.columns(img, 0, g.c, &mut buf);
                Cow::Owned(buf)
            })
            .collect();
        for (b, col) in batch.zip(&cols) {
            for gi in 0..groups {
                let go = &gout[(b * o + gi * og) * ohw..][..og * ohw];
                // acc_g [og, kk] += go [og, ohw] @ col_g^T [ohw, kk]
                mm(
                    og,
                    kk,
                    ohw,
                    &mut acc[gi * og * kk..][..og * kk],
                    true,
                    go,
                    ohw,
                    1,
                    &col[gi * kk * ohw..][..kk * ohw],
                    1,
                    ohw,
                    gemm::Parallelism::Rayon(0),
                );
            }
        }
    }
    acc
}

/// Runs `f` on f32/f64 views of two operands, rounding half results back.
fn float2(
    a: &Tensor,
    b: &Tensor,
    f32f: impl Fn(&[f32], &[f32]) -> Vec<f32>,
    f64f: impl Fn(&[f64], &[f64]) -> Vec<f64>,
) -> CpuStorage {
    let (sa, sb) = (a.storage(), b.storage());
    match a.dtype() {
        DType::F64 => CpuStorage::F64(f64f(&typed(&sa, a.layout()), &typed(&sb, b.layout()))),
        d => from_f32_like(d, f32f(&as_f32(&sa, a.layout()), &as_f32(&sb, b.layout()))),
    }
}

pub(super) fn conv2d(x: &Tensor, w: &Tensor, p: &ConvParams, out_shape: &[usize]) -> CpuStorage {
    let g = geom(x.shape(), w.shape(), out_shape, p);
    let (n, o) = (x.shape()[0], w.shape()[0]);
    float2(
        x,
        w,
        |x, w| forward(x, w, n, o, &g, None),
        |x, w| forward(x, w, n, o, &g, None),
    )
}

/// `Prim::Conv2dEpilogue` on NCHW f32 or f64 operands: each image's output finished while in
/// cache (`epilogue.rs`), the ops' result bit for bit. `None` for other dtypes, which run as the
/// ops.
pub(super) fn conv2d_epilogue(
    inputs: &[&Tensor],
    p: &ConvParams,
    e: ConvEpilogue,
    out_shape: &[usize],
) -> Option<CpuStorage> {
    let (x, w) = (inputs[0], inputs[1]);
    let dtype = x.dtype();
    if p.channels_last || inputs.iter().any(|t| t.dtype() != dtype) {
        return None;
    }
    let g = geom(x.shape(), w.shape(), out_shape, p);
    let (n, o) = (x.shape()[0], w.shape()[0]);
    let guards: Vec<_> = inputs.iter().map(|t| t.storage()).collect();
    fn fused<T: Float + 'static>(
        inputs: &[&Tensor],
        guards: &[std::sync::RwLockReadGuard<'_, CpuStorage>],
        e: ConvEpilogue,
        (n, o, g): (usize, usize, &Geom),
    ) -> Vec<T> {
        let views: Vec<Cow<'_, [T]>> = inputs
            .iter()
            .zip(guards)
            .map(|(t, s)| typed::<T>(s, t.layout()))
            .collect();
        let epilogue = EpilogueSlices::new(&views[2..], e);
        forward(&views[0], &views[1], n, o, g, Some(&epilogue))
    }
    match dtype {
        DType::F32 => Some(CpuStorage::F32(fused(inputs, &guards, e, (n, o, &g)))),
        DType::F64 => Some(CpuStorage::F64(fused(inputs, &guards, e, (n, o, &g)))),
        _ => None,
    }
}

pub(super) fn conv2d_grad_input(
    gout: &Tensor,
    w: &Tensor,
    p: &ConvParams,
    input_shape: &[usize; 4],
) -> CpuStorage {
    let g = geom(input_shape, w.shape(), gout.shape(), p);
    let (n, o) = (input_shape[0], w.shape()[0]);
    float2(
        gout,
        w,
        |a, b| grad_input(a, b, n, o, &g),
        |a, b| grad_input(a, b, n, o, &g),
    )
}

pub(super) fn conv2d_grad_weight(
    gout: &Tensor,
    x: &Tensor,
    p: &ConvParams,
    weight_shape: &[usize; 4],
) -> CpuStorage {
    let g = geom(x.shape(), weight_shape, gout.shape(), p);
    let (n, o) = (x.shape()[0], weight_shape[0]);
    float2(
        gout,
        x,
        |a, b| grad_weight(a, b, n, o, &g),
        |a, b| grad_weight(a, b, n, o, &g),
    )
}
