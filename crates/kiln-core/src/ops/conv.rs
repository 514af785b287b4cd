//! conv2d (an extern prim plus a broadcast bias add) and pooling as compositions of strided slices.

use crate::dispatch::apply;
use crate::prim::{ConvParams, Prim};
use crate::{DType, Error, Result, Tensor};

fn check_nchw(op: &'static str, x: &Tensor) -> Result<()> {
    if x.rank() != 4 {
        return Err(Error::shape(
            op,
            format!("expects a 4-D [N, C, H, W] input, got {:?}", x.shape()),
        ));
    }
    Ok(())
}

/// The kernel window positions of a pooling op: for each (ki, kj), the strided view of the padded
/// input that the window's (ki, kj) element visits.
fn windows(x: &Tensor, k: [usize; 2], s: [usize; 2], out: [usize; 2]) -> Result<Vec<Tensor>> {
    let mut views = Vec::with_capacity(k[0] * k[1]);
    for ki in 0..k[0] {
        for kj in 0..k[1] {
            let v = apply(
                Prim::Slice {
                    dim: 2,
                    start: ki,
                    end: ki + s[0] * (out[0].max(1) - 1) + 1,
                    step: s[0],
                },
                &[x],
            )?;
            let v = apply(
                Prim::Slice {
                    dim: 3,
                    start: kj,
                    end: kj + s[1] * (out[1].max(1) - 1) + 1,
                    step: s[1],
                },
                &[&v],
            )?;
            views.push(v);
        }
    }
    Ok(views)
}

fn pool_geometry(
    op: &'static str,
    x: &Tensor,
    k: [usize; 2],
    s: [usize; 2],
    p: [usize; 2],
) -> Result<[usize; 2]> {
    check_nchw(op, x)?;
    if k.contains(&0) || s.contains(&0) {
        return Err(Error::arg(
            op,
            format!("kernel {k:?} and stride {s:?} must be positive"),
        ));
    }
    if p[0] * 2 > k[0] || p[1] * 2 > k[1] {
        return Err(Error::arg(
            op,
            format!("padding {p:?} should be at most half of kernel {k:?}"),
        ));
    }
    let (h, w) = (x.shape()[2] + 2 * p[0], x.shape()[3] + 2 * p[1]);
    if h < k[0] || w < k[1] {
        return Err(Error::shape(
            op,
            format!("kernel {k:?} larger than padded input {:?}", x.shape()),
        ));
    }
    Ok([(h - k[0]) / s[0] + 1, (w - k[1]) / s[1] + 1])
}

impl Tensor {
    /// `F.conv2d(x, w, b, stride, padding, dilation, groups)`.
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        groups: usize,
    ) -> Result<Tensor> {
        check_nchw("conv2d", self)?;
        let y = apply(
            Prim::Conv2d(ConvParams {
                stride,
                padding,
                dilation,
                groups,
                channels_last: false,
            }),
            &[self, weight],
        )?;
        match bias {
            Some(b) => y.add(&b.reshape([1, b.numel(), 1, 1])?),
            None => Ok(y),
        }
    }
    /// `F.max_pool2d(x, kernel, stride, padding)`.
    pub fn max_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<Tensor> {
        let out = pool_geometry("max_pool2d", self, kernel, stride, padding)?;
        let x = self.pad(
            &[padding[1], padding[1], padding[0], padding[0]],
            f64::NEG_INFINITY,
        )?;
        let views = windows(&x, kernel, stride, out)?;
        let mut largest = views[0].clone();
        for v in &views[1..] {
            largest = largest.maximum(v)?;
        }
        // under no_grad the largest is the output: the index below only makes the backward reach
        // one window position (an inference graph traced under no_grad has no index to compute
        // or write). Grad mode, not `requires_grad`, decides: a traced value does not know yet
        // whether it will be differentiated. The two agree bit for bit but where the largest is
        // -0.0, which the index's sum of selected terms returns as +0.0.
        if views.len() == 1 || !crate::autograd::is_grad_enabled() {
            return Ok(largest);
        }
        // where the largest came from: the first window position holding it, a NaN counting as
        // holding it (PyTorch's max_pool2d_with_indices records that position)
        let last = (views.len() - 1) as f64;
        let mut index = Tensor::full_on(largest.shape(), last, DType::F32, largest.device())?;
        for (j, v) in views.iter().enumerate().rev().skip(1) {
            let holds = v.eq(&largest)?.logical_or(&v.ne(v)?)?;
            index = Tensor::where_(&holds, j as f64, &index)?;
        }
        // the output is that position's value (the other terms are exact zeros), so the
        // gradient reaches it alone, as in PyTorch, and the backward reads one saved index per
        // output where a chain of pairwise maxima would split ties and keep a mask per link
        let mut out: Option<Tensor> = None;
        for (j, v) in views.iter().enumerate() {
            let term = Tensor::where_(&index.eq(j as f64)?, v, 0.0)?;
            out = Some(match out {
                None => term,
                Some(acc) => acc.add(&term)?,
            });
        }
        out.ok_or_else(|| Error::arg("max_pool2d", "no window"))
    }
    /// `F.avg_pool2d(x, kernel, stride, padding, count_include_pad)`.
    pub fn avg_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
    ) -> Result<Tensor> {
        let out = pool_geometry("avg_pool2d", self, kernel, stride, padding)?;
        let pads = [padding[1], padding[1], padding[0], padding[0]];
        let x = self.to_dtype(self.dtype().to_float())?.pad(&pads, 0.0)?;
        let views = windows(&x, kernel, stride, out)?;
        let mut acc = views[0].clone();
        for v in &views[1..] {
            acc = acc.add(v)?;
        }
        if count_include_pad || padding == [0, 0] {
            return acc.div((kernel[0] * kernel[1]) as f64);
        }
        let ones = Tensor::full_on(
            &[1, 1, self.shape()[2], self.shape()[3]],
            1.0,
            x.dtype(),
            x.device(),
        )?
        .pad(&pads, 0.0)?;
        let counts = windows(&ones, kernel, stride, out)?;
        let mut c = counts[0].clone();
        for v in &counts[1..] {
            c = c.add(v)?;
        }
        acc.div(&c)
    }
    /// `F.adaptive_avg_pool2d(x, (oh, ow))`: PyTorch's bins, start = floor(i*H/oh), end = ceil((i+1)*H/oh).
    pub fn adaptive_avg_pool2d(&self, out: [usize; 2]) -> Result<Tensor> {
        check_nchw("adaptive_avg_pool2d", self)?;
        if out.contains(&0) {
            return Err(Error::arg(
                "adaptive_avg_pool2d",
                format!("output size {out:?} must be positive"),
            ));
        }
        let mut x = self.to_dtype(self.dtype().to_float())?;
        for (axis, &o) in out.iter().enumerate() {
            let dim = 2 + axis;
            let n = x.shape()[dim];
            if n % o == 0 {
                // equal bins: a reshape and one mean
                let mut s = x.shape().to_vec();
                s[dim] = o;
                s.insert(dim + 1, n / o);
                x = x.reshape(s)?.mean(&[dim as isize + 1], false)?;
                continue;
            }
            let bins = (0..o)
                .map(|i| {
                    let (a, b) = (i * n / o, ((i + 1) * n).div_ceil(o));
                    x.narrow(dim as isize, a, b - a)?
                        .mean(&[dim as isize], true)
                })
                .collect::<Result<Vec<_>>>()?;
            x = Tensor::cat(&bins.iter().collect::<Vec<_>>(), dim as isize)?;
        }
        Ok(x)
    }
}
