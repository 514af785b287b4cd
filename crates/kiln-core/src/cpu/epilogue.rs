//! The epilogue prims' fused CPU kernels: the ops after a convolution applied to each image's
//! output right after its GEMM wrote it, while it is in cache, instead of in another pass over the
//! whole result. Each element goes through the same operations, in the same order and precision,
//! as the ops the prim stands for (`ops/epilogue.rs`: `mul`, `add`, `add`, then `relu` or
//! `gelu_tanh` as the core composes them), so the result is theirs bit for bit; the tests check
//! that against the composed ops. f32 and f64 only: a half-precision result rounds after each op,
//! which the composed ops do.

use std::borrow::Cow;

use super::num::Float;
use crate::prim::{Activation, ConvEpilogue};

/// `act(x)` as the core's `relu` and `gelu_tanh` compute it for one element.
#[inline]
pub(super) fn activate<T: Float>(act: Activation, x: T) -> T {
    match act {
        Activation::None => x,
        // `where(le(x, 0), 0, x)`: NaN is not <= 0, so it stays NaN
        Activation::Relu => {
            if x <= T::ZERO {
                T::ZERO
            } else {
                x
            }
        }
        // `x * (tanh((x + x*x*x*c) * k) + 1) * 0.5`, each scalar in the tensor's dtype
        Activation::GeluTanh => {
            let c = T::from_f64(Activation::GELU_CUBE);
            let k = T::from_f64(Activation::gelu_scale());
            let inner = x.add(x.mul(x).mul(x).mul(c)).mul(k);
            x.mul(inner.tanh().add(T::ONE)).mul(T::from_f64(0.5))
        }
    }
}

/// A convolution epilogue's operands as contiguous slices: `scale` and `shift` of `[C]`, the
/// residual of the output's NCHW shape.
pub(super) struct EpilogueSlices<'a, T> {
    scale: Option<&'a [T]>,
    shift: Option<&'a [T]>,
    residual: Option<&'a [T]>,
    act: Activation,
}

impl<'a, T: Float> EpilogueSlices<'a, T> {
    /// The operands after `x` and `w` (`rest`: those of the parts `e` has, in the prim's order).
    pub(super) fn new(rest: &'a [Cow<'a, [T]>], e: ConvEpilogue) -> Self {
        let parts = e.split(rest);
        let slice = |v: Option<&'a Cow<'a, [T]>>| v.map(|v| &v[..]);
        EpilogueSlices {
            scale: slice(parts.scale),
            shift: slice(parts.shift),
            residual: slice(parts.residual),
            act: e.act,
        }
    }

    /// Applies the epilogue to image `b`'s output `[C, hw]`.
    pub(super) fn apply(&self, b: usize, out: &mut [T], hw: usize) {
        if hw == 0 {
            return;
        }
        let residual = self.residual.map(|r| &r[b * out.len()..][..out.len()]);
        for (c, plane) in out.chunks_mut(hw).enumerate() {
            // one pass per part over a plane in cache: each is a plain vector loop, and each
            // element still sees the parts in the prim's order
            if let Some(s) = self.scale.map(|s| s[c]) {
                plane.iter_mut().for_each(|v| *v = v.mul(s));
            }
            if let Some(s) = self.shift.map(|s| s[c]) {
                plane.iter_mut().for_each(|v| *v = v.add(s));
            }
            if let Some(r) = residual {
                let r = &r[c * hw..][..hw];
                plane.iter_mut().zip(r).for_each(|(v, &r)| *v = v.add(r));
            }
            if self.act != Activation::None {
                plane.iter_mut().for_each(|v| *v = activate(self.act, *v));
            }
        }
    }
}
