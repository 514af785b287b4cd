//! The compiler's epilogue prims (`MatmulEpilogue`, `Conv2dEpilogue`) as the ops they stand for:
//! the product or convolution, then the core's own `mul`, `add`, `relu` or `gelu_tanh` — their one
//! definition — so each prim equals those ops bit for bit. The compiler writes the prims for a GPU,
//! where cuBLASLt's epilogues and cuDNN's operation graphs run them, and `Conv2dEpilogue` for the
//! CPU, whose fused kernel (`cpu/epilogue.rs`, NCHW f32/f64) must equal these; these run them
//! everywhere else: the CPU's other cases (matmuls, half types, channels-last) and a device whose
//! library has no fused kernel for a case (cuDNN without a fusion engine for it).

use crate::dispatch::apply;
use crate::prim::{Activation, ConvEpilogue, ConvParams, Epilogue, Prim};
use crate::{Result, Tensor};

impl Activation {
    /// The activation applied to `y`, as the core's ops compute it.
    pub fn apply(self, y: Tensor) -> Result<Tensor> {
        match self {
            Activation::None => Ok(y),
            Activation::Relu => y.relu(),
            Activation::GeluTanh => y.gelu_tanh(),
        }
    }
}

/// An epilogue prim (`MatmulEpilogue`, `Conv2dEpilogue`) computed as the ops it stands for: what
/// a backend runs where it has no fused kernel for the case.
pub fn as_ops(prim: &Prim, inputs: &[&Tensor]) -> Result<Tensor> {
    match prim {
        Prim::MatmulEpilogue(e) => matmul_epilogue(inputs, *e),
        Prim::Conv2dEpilogue { params, epilogue } => conv2d_epilogue(inputs, *params, *epilogue),
        _ => Err(crate::Error::arg(prim.name(), "is no epilogue prim")),
    }
}

/// Runs `f` as eager code calls the ops: not recorded by autograd or a tracer.
fn untraced(f: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
    let _off = crate::intercept::install(None);
    crate::no_grad(f)
}

/// `act(a @ b + bias)` (`Prim::MatmulEpilogue`; operands `a`, `b`, then `bias` if it has one).
pub fn matmul_epilogue(inputs: &[&Tensor], e: Epilogue) -> Result<Tensor> {
    untraced(|| {
        let product = apply(Prim::Matmul, &inputs[..2])?;
        let y = match inputs.get(2).filter(|_| e.bias) {
            Some(bias) => product.add(*bias)?,
            None => product,
        };
        e.act.apply(y)
    })
}

/// `act(conv2d(x, w) * scale + shift + residual)` (`Prim::Conv2dEpilogue`; operands `x`, `w`,
/// then those of the parts it has, in that order): `scale` and `shift` (`[C]`) broadcast along the
/// output's channel dim, as `batch_norm` and `conv2d`'s bias reshape theirs.
pub fn conv2d_epilogue(inputs: &[&Tensor], p: ConvParams, e: ConvEpilogue) -> Result<Tensor> {
    let channel_dim = if p.channels_last { 3 } else { 1 };
    let per_channel = |t: &Tensor| {
        let mut shape = [1usize; 4];
        shape[channel_dim] = t.numel();
        t.reshape(shape)
    };
    // `Prim::infer` checked their count and shapes
    let parts = e.split(&inputs[2..]);
    untraced(|| {
        let mut y = apply(Prim::Conv2d(p), &inputs[..2])?;
        if let Some(scale) = parts.scale {
            y = y.mul(&per_channel(scale)?)?;
        }
        if let Some(shift) = parts.shift {
            y = y.add(&per_channel(shift)?)?;
        }
        if let Some(residual) = parts.residual {
            y = y.add(*residual)?;
        }
        e.act.apply(y)
    })
}
