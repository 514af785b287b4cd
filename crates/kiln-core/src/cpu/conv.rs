//! 2-D convolution and its two gradients by im2col + gemm, per image and per group. Images run in
//! parallel; the weight gradient sums per-thread partials.

use rayon::prelude::*;

use super::num::Num;
use super::{as_f32, from_f32_like, typed};
use crate::prim::ConvParams;
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
}

impl Geom {
    /// Unfolds one image's channels [c0, c0+cg) into col [cg*kh*kw, oh*ow].
    fn im2col<T: Num>(&self, img: &[T], c0: usize, cg: usize, col: &mut [T]) {
        let (s, pd, d) = (self.p.stride, self.p.padding, self.p.dilation);
        let ohw = self.oh * self.ow;
        for ci in 0..cg {
            let plane = &img[(c0 + ci) * self.h * self.w..][..self.h * self.w];
            for ki in 0..self.kh {
                for kj in 0..self.kw {
                    let row = &mut col[((ci * self.kh + ki) * self.kw + kj) * ohw..][..ohw];
                    for oy in 0..self.oh {
                        let iy = (oy * s[0] + ki * d[0]) as isize - pd[0] as isize;
                        for ox in 0..self.ow {
                            let ix = (ox * s[1] + kj * d[1]) as isize - pd[1] as isize;
                            row[oy * self.ow + ox] = if iy >= 0
                                && ix >= 0
                                && (iy as usize) < self.h
                                && (ix as usize) < self.w
                            {
                                plane[iy as usize * self.w + ix as usize]
                            } else {
                                T::ZERO
                            };
                        }
                    }
                }
            }
        }
    }

    /// Adds col [cg*kh*kw, oh*ow] back into image channels [c0, c0+cg).
    fn col2im<T: Num>(&self, col: &[T], c0: usize, cg: usize, img: &mut [T]) {
        let (s, pd, d) = (self.p.stride, self.p.padding, self.p.dilation);
        let ohw = self.oh * self.ow;
        for ci in 0..cg {
            let plane = &mut img[(c0 + ci) * self.h * self.w..][..self.h * self.w];
            for ki in 0..self.kh {
                for kj in 0..self.kw {
                    let row = &col[((ci * self.kh + ki) * self.kw + kj) * ohw..][..ohw];
                    for oy in 0..self.oh {
                        let iy = (oy * s[0] + ki * d[0]) as isize - pd[0] as isize;
                        if iy < 0 || iy as usize >= self.h {
                            continue;
                        }
                        for ox in 0..self.ow {
                            let ix = (ox * s[1] + kj * d[1]) as isize - pd[1] as isize;
                            if ix >= 0 && (ix as usize) < self.w {
                                let p = &mut plane[iy as usize * self.w + ix as usize];
                                *p = p.add(row[oy * self.ow + ox]);
                            }
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
            gemm::Parallelism::None,
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
    }
}

fn forward<T: Num + 'static>(x: &[T], w: &[T], n: usize, o: usize, g: &Geom) -> Vec<T> {
    let groups = g.p.groups;
    let (cg, og) = (g.c / groups, o / groups);
    let (ohw, kk) = (g.oh * g.ow, cg * g.kh * g.kw);
    let mut out = vec![T::ZERO; n * o * ohw];
    if out.is_empty() {
        return out;
    }
    out.par_chunks_mut(o * ohw)
        .enumerate()
        .for_each(|(b, out_img)| {
            let img = &x[b * g.c * g.h * g.w..][..g.c * g.h * g.w];
            let mut col = vec![T::ZERO; kk * ohw];
            for gi in 0..groups {
                g.im2col(img, gi * cg, cg, &mut col);
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
                    &col,
                    ohw,
                    1,
                );
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
            mm(kk, ohw, og, &mut col, false, wg, 1, kk, go, ohw, 1);
            g.col2im(&col, gi * cg, cg, gimg);
        }
    });
    gin
}

fn grad_weight<T: Num + 'static>(gout: &[T], x: &[T], n: usize, o: usize, g: &Geom) -> Vec<T> {
    let groups = g.p.groups;
    let (cg, og) = (g.c / groups, o / groups);
    let (ohw, kk) = (g.oh * g.ow, cg * g.kh * g.kw);
    let chw = g.c * g.h * g.w;
    let zero = || vec![T::ZERO; o * kk];
    (0..n)
        .into_par_iter()
        .fold(zero, |mut acc, b| {
            let mut col = vec![T::ZERO; kk * ohw];
            for gi in 0..groups {
                g.im2col(&x[b * chw..][..chw], gi * cg, cg, &mut col);
                let go = &gout[(b * o + gi * og) * ohw..][..og * ohw];
                // acc_g [og, kk] += go [og, ohw] @ col^T [ohw, kk]
                mm(
                    og,
                    kk,
                    ohw,
                    &mut acc[gi * og * kk..][..og * kk],
                    true,
                    go,
                    ohw,
                    1,
                    &col,
                    1,
                    ohw,
                );
            }
            acc
        })
        .reduce(zero, |mut a, b| {
            a.iter_mut().zip(b).for_each(|(x, y)| *x = x.add(y));
            a
        })
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
        |x, w| forward(x, w, n, o, &g),
        |x, w| forward(x, w, n, o, &g),
    )
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
