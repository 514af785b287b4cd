//! Vector-Jacobian products, one rule per prim. Rules are written with tensor ops, so they execute
//! eagerly here and, when the compiler traces a backward pass, they record prims like any other code.

use crate::dispatch::apply;
use crate::ops::reduce::{mean_over, sum_over};
use crate::prim::{BinaryOp, Prim, ReduceOp, UnaryOp};
use crate::{Error, Result, Tensor};

type Grads = Vec<Option<Tensor>>;

/// Gradient of a strided slice: spread `g` back into zeros of the input's size along `dim`.
fn unslice(g: &Tensor, dim: usize, start: usize, step: usize, size: usize) -> Result<Tensor> {
    let rank = g.rank();
    let mut g = g.clone();
    let len = g.shape()[dim];
    if step > 1 && len > 0 {
        // [.., L, ..] -> [.., L, 1, ..] -> pad to [.., L, step, ..] -> [.., L*step, ..]
        let mut s = g.shape().to_vec();
        s.insert(dim + 1, 1);
        g = apply(Prim::Reshape(s.clone()), &[&g])?;
        let mut pads = vec![(0, 0); rank + 1];
        pads[dim + 1] = (0, step - 1);
        g = apply(Prim::Pad { pads, value: 0.0 }, &[&g])?;
        let mut s2 = g.shape().to_vec();
        s2.remove(dim + 1);
        s2[dim] = len * step;
        g = apply(Prim::Reshape(s2), &[&g])?;
        let keep = (len * step).min(size - start);
        g = apply(
            Prim::Slice {
                dim,
                start: 0,
                end: keep,
                step: 1,
            },
            &[&g],
        )?;
    }
    let got = g.shape()[dim];
    let mut pads = vec![(0, 0); rank];
    pads[dim] = (start, size - start - got);
    apply(Prim::Pad { pads, value: 0.0 }, &[&g])
}

fn unary_vjp(op: UnaryOp, x: &Tensor, out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
    Ok(Some(match op {
        UnaryOp::Neg => g.neg()?,
        UnaryOp::Abs => g.mul(&x.sign()?)?,
        UnaryOp::Exp => g.mul(out)?,
        UnaryOp::Log => g.div(x)?,
        UnaryOp::Log1p => g.div(&x.add(1.0)?)?,
        UnaryOp::Sqrt => g.div(&out.mul(2.0)?)?,
        UnaryOp::Sin => g.mul(&x.cos()?)?,
        UnaryOp::Cos => g.mul(&x.sin()?.neg()?)?,
        UnaryOp::Tanh => g.mul(&out.mul(out)?.neg()?.add(1.0)?)?,
        UnaryOp::Erf => g.mul(
            &x.mul(x)?
                .neg()?
                .exp()?
                .mul(std::f64::consts::FRAC_2_SQRT_PI)?,
        )?,
        UnaryOp::Recip => g.mul(&out.mul(out)?.neg()?)?,
        UnaryOp::Floor | UnaryOp::Sign => Tensor::zeros_like(x)?,
        UnaryOp::Not => return Ok(None),
    }))
}

/// One operand may be a CPU scalar broadcast to the op's shape (a Rust number a device took by
/// value, `DeviceRuntime::takes_host_scalar`): a rule computes with it only in ops that meet the
/// device's tensors, where it stays one value; an op of its own on it would run on the CPU over
/// the whole broadcast shape (pow's exponent - 1), so pow moves its one element to the device
/// first (`dispatch::on_device`).
fn binary_vjp(op: BinaryOp, a: &Tensor, b: &Tensor, out: &Tensor, g: &Tensor) -> Result<Grads> {
    let (ga, gb) = match op {
        BinaryOp::Add => (g.clone(), g.clone()),
        BinaryOp::Sub => (g.clone(), g.neg()?),
        BinaryOp::Mul => (g.mul(b)?, g.mul(a)?),
        BinaryOp::Div => (g.div(b)?, g.mul(out)?.div(b)?.neg()?),
        BinaryOp::Pow => {
            let on_device = |t: &Tensor| crate::dispatch::on_device(t, g.device());
            let (a, b) = (&on_device(a)?, &on_device(b)?);
            // b * a^(b-1), defined as 0 where b == 0 (0 * 0^-1 would be NaN), as PyTorch
            let ga = Tensor::where_(
                &b.eq(0.0)?,
                &Tensor::zeros_like(g)?,
                &g.mul(b)?.mul(&a.pow(&b.sub(1.0)?)?)?,
            )?;
            // d/db a^b = a^b ln a, defined as 0 where a == 0 and b >= 0 (as PyTorch does)
            let zero_base = a.eq(0.0)?.logical_and(&b.ge(0.0)?)?;
            let gb = Tensor::where_(
                &zero_base,
                &Tensor::zeros_like(g)?,
                &g.mul(out)?.mul(&a.log()?)?,
            )?;
            (ga, gb)
        }
        BinaryOp::Max | BinaryOp::Min => {
            // ties split the gradient evenly, as torch.maximum does
            let wins = if op == BinaryOp::Max {
                a.gt(b)?
            } else {
                a.lt(b)?
            };
            let tie = a.eq(b)?.to_dtype(g.dtype())?.mul(0.5)?;
            let wa = wins.to_dtype(g.dtype())?.add(&tie)?;
            let wb = wa.neg()?.add(1.0)?;
            (g.mul(&wa)?, g.mul(&wb)?)
        }
        _ => return Ok(vec![None, None]),
    };
    Ok(vec![Some(ga), Some(gb)])
}

fn reduce_vjp(
    op: ReduceOp,
    dims: &[usize],
    x: &Tensor,
    out: &Tensor,
    g: &Tensor,
) -> Result<Tensor> {
    let shape = x.shape().to_vec();
    let g_full = apply(Prim::Expand(shape.clone()), &[g])?;
    let out_full = apply(Prim::Expand(shape.clone()), &[out])?;
    match op {
        ReduceOp::Sum => Ok(g_full),
        // d/dx_i Σ (x - mean)² = 2 (x_i - mean) (the mean's own gradient, Σ 2 (x - mean) / n,
        // is zero). The mean is `mean_over`'s, as a norm's forward writes it, so a graph holding
        // both (a norm's forward and backward) computes it once (`kiln_compile::cse`).
        ReduceOp::SumSqDev => g_full.mul(&x.sub(&mean_over(x, dims)?)?)?.mul(2.0),
        ReduceOp::Max | ReduceOp::Min => {
            let mask = x.eq(&out_full)?.to_dtype(g.dtype())?;
            let count = sum_over(&mask, dims)?;
            let count = apply(Prim::Expand(shape), &[&count])?;
            g_full.mul(&mask)?.div(&count)
        }
        ReduceOp::Prod => {
            // d prod / d x_i = prod_{j != i} x_j, exact with zeros: one zero keeps the product of the
            // others at its position, two or more zeros make every gradient 0.
            let is_zero = x.eq(0.0)?;
            let zeros = sum_over(&is_zero.to_dtype(x.dtype())?, dims)?;
            let nonzero_x = Tensor::where_(&is_zero, &Tensor::ones_like(x)?, x)?;
            let prod_nz = apply(
                Prim::Reduce {
                    op: ReduceOp::Prod,
                    dims: dims.to_vec(),
                },
                &[&nonzero_x],
            )?;
            let prod_nz = apply(Prim::Expand(shape.clone()), &[&prod_nz])?;
            let zeros = apply(Prim::Expand(shape), &[&zeros])?;
            let at_zero = Tensor::where_(&zeros.eq(1.0)?, &prod_nz, &Tensor::zeros_like(x)?)?;
            let local = Tensor::where_(&is_zero, &at_zero, &out_full.div(&nonzero_x)?)?;
            g_full.mul(&local)
        }
    }
}

/// The gradients of `prim`'s operands `ins`, given its output `out` and the output's gradient `g`.
pub(super) fn vjp(prim: &Prim, ins: &[Tensor], out: &Tensor, g: &Tensor) -> Result<Grads> {
    let out = &out.clone();
    let one = |t: Tensor| Ok(vec![Some(t)]);
    match prim {
        Prim::Unary(op) => Ok(vec![unary_vjp(*op, &ins[0], out, g)?]),
        Prim::Binary(op) => binary_vjp(*op, &ins[0], &ins[1], out, g),
        Prim::Where => {
            let z = Tensor::zeros_like(g)?;
            Ok(vec![
                None,
                Some(Tensor::where_(&ins[0], g, &z)?),
                Some(Tensor::where_(&ins[0], &z, g)?),
            ])
        }
        Prim::Cast(_) => one(g.to_dtype(ins[0].dtype())?),
        Prim::Reduce { op, dims } => one(reduce_vjp(*op, dims, &ins[0], out, g)?),
        Prim::Reshape(_) | Prim::Contiguous => {
            one(apply(Prim::Reshape(ins[0].shape().to_vec()), &[g])?)
        }
        Prim::Permute(p) => {
            let mut inv = vec![0; p.len()];
            for (i, &d) in p.iter().enumerate() {
                inv[d] = i;
            }
            one(apply(Prim::Permute(inv), &[g])?)
        }
        Prim::Expand(shape) => {
            let dims: Vec<usize> = (0..shape.len())
                .filter(|&d| ins[0].shape()[d] == 1 && shape[d] != 1)
                .collect();
            if dims.is_empty() {
                one(g.clone())
            } else {
                one(sum_over(g, &dims)?)
            }
        }
        Prim::Slice {
            dim, start, step, ..
        } => one(unslice(g, *dim, *start, *step, ins[0].shape()[*dim])?),
        Prim::Pad { pads, .. } => {
            let mut t = g.clone();
            for (d, &(before, _)) in pads.iter().enumerate() {
                let len = ins[0].shape()[d];
                if (before, len) != (0, t.shape()[d]) {
                    t = apply(
                        Prim::Slice {
                            dim: d,
                            start: before,
                            end: before + len,
                            step: 1,
                        },
                        &[&t],
                    )?;
                }
            }
            one(t)
        }
        Prim::Cat { dim } => {
            let mut at = 0;
            let mut grads = Vec::with_capacity(ins.len());
            for x in ins {
                let len = x.shape()[*dim];
                grads.push(Some(apply(
                    Prim::Slice {
                        dim: *dim,
                        start: at,
                        end: at + len,
                        step: 1,
                    },
                    &[g],
                )?));
                at += len;
            }
            Ok(grads)
        }
        Prim::Gather { dim } => {
            let z = Tensor::zeros_like(&ins[0])?;
            Ok(vec![
                Some(apply(Prim::ScatterAdd { dim: *dim }, &[&z, &ins[1], g])?),
                None,
            ])
        }
        Prim::ScatterAdd { dim } => Ok(vec![
            Some(g.clone()),
            None,
            Some(apply(Prim::Gather { dim: *dim }, &[g, &ins[1]])?),
        ]),
        Prim::Matmul => {
            let (a, b) = (&ins[0], &ins[1]);
            let bt = apply(Prim::Permute(vec![0, 2, 1]), &[b])?;
            let at = apply(Prim::Permute(vec![0, 2, 1]), &[a])?;
            Ok(vec![
                Some(apply(Prim::Matmul, &[g, &bt])?),
                Some(apply(Prim::Matmul, &[&at, g])?),
            ])
        }
        Prim::Conv2d(params) => {
            let (x, w) = (&ins[0], &ins[1]);
            let s = |t: &Tensor| [t.shape()[0], t.shape()[1], t.shape()[2], t.shape()[3]];
            let gx = apply(
                Prim::Conv2dGradInput {
                    params: *params,
                    input_shape: s(x),
                },
                &[g, w],
            )?;
            let gw = apply(
                Prim::Conv2dGradWeight {
                    params: *params,
                    weight_shape: s(w),
                },
                &[g, x],
            )?;
            Ok(vec![Some(gx), Some(gw)])
        }
        Prim::ArgReduce { .. }
        | Prim::Full { .. }
        | Prim::Iota { .. }
        | Prim::Rand { .. }
        | Prim::Conv2dGradInput { .. }
        | Prim::Conv2dGradWeight { .. } => Ok(vec![None; ins.len()]),
        // written by the compiler after autodiff (`is_differentiable` says so): never recorded
        Prim::MatmulEpilogue(_) | Prim::Conv2dEpilogue { .. } => Err(Error::unsupported(
            prim.name(),
            "has no derivative: the compiler writes it after differentiating the ops it replaces",
        )),
    }
}
