//! Elementwise ops: PyTorch's broadcasting and type promotion in front of the strict prims.

use super::Operand;
use crate::dispatch::apply;
use crate::prim::{BinaryOp, Prim, UnaryOp};
use crate::shape::broadcast_shapes;
use crate::{DType, Result, Tensor};

fn unary(x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    // float-only ops promote integer inputs to float32 (torch.exp(int_tensor) is float)
    let x = if op.float_only() {
        x.to_dtype(x.dtype().to_float())?
    } else {
        x.clone()
    };
    apply(Prim::Unary(op), &[&x])
}

/// Broadcasts operands to one shape and casts them to `dtype`.
pub(crate) fn align(op: &'static str, xs: &[&Tensor], dtype: Option<DType>) -> Result<Vec<Tensor>> {
    let mut shape = xs[0].shape().to_vec();
    for x in &xs[1..] {
        shape = broadcast_shapes(op, &shape, x.shape())?;
    }
    xs.iter()
        .map(|x| {
            let x = match dtype {
                Some(d) => x.to_dtype(d)?,
                None => (*x).clone(),
            };
            x.broadcast_to(&shape)
        })
        .collect()
}

fn binary(a: &Tensor, b: impl Operand, op: BinaryOp) -> Result<Tensor> {
    let b = b.to_operand(a)?;
    let mut dtype = DType::promote(a.dtype(), b.dtype());
    if op == BinaryOp::Div && !dtype.is_float() {
        dtype = DType::F32; // true division
    }
    if op.is_logical() {
        dtype = DType::Bool;
    }
    let v = align(op_name(op), &[a, &b], Some(dtype))?;
    apply(Prim::Binary(op), &[&v[0], &v[1]])
}

fn op_name(op: BinaryOp) -> &'static str {
    match op {
        BinaryOp::Add => "add",
        BinaryOp::Sub => "sub",
        BinaryOp::Mul => "mul",
        BinaryOp::Div => "div",
        BinaryOp::Pow => "pow",
        BinaryOp::Max => "maximum",
        BinaryOp::Min => "minimum",
        BinaryOp::Eq => "eq",
        BinaryOp::Ne => "ne",
        BinaryOp::Lt => "lt",
        BinaryOp::Le => "le",
        BinaryOp::Gt => "gt",
        BinaryOp::Ge => "ge",
        BinaryOp::And => "logical_and",
        BinaryOp::Or => "logical_or",
    }
}

macro_rules! unary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        impl Tensor {$(
            pub fn $name(&self) -> Result<Tensor> { unary(self, UnaryOp::$op) }
        )*}
    };
}
unary_methods!(
    neg => Neg, abs => Abs, exp => Exp, log => Log, log1p => Log1p, sqrt => Sqrt, sin => Sin,
    cos => Cos, tanh => Tanh, erf => Erf, floor => Floor, sign => Sign, reciprocal => Recip,
);

macro_rules! binary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        impl Tensor {$(
            pub fn $name(&self, other: impl Operand) -> Result<Tensor> { binary(self, other, BinaryOp::$op) }
        )*}
    };
}
binary_methods!(
    add => Add, sub => Sub, mul => Mul, div => Div, pow => Pow, maximum => Max, minimum => Min,
    eq => Eq, ne => Ne, lt => Lt, le => Le, gt => Gt, ge => Ge, logical_or => Or,
);

impl Tensor {
    pub fn logical_and(&self, other: impl Operand) -> Result<Tensor> {
        binary(self, other, BinaryOp::And)
    }
    pub fn logical_not(&self) -> Result<Tensor> {
        apply(Prim::Unary(UnaryOp::Not), &[&self.to_dtype(DType::Bool)?])
    }
    /// `1 / sqrt(x)`.
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.sqrt()?.reciprocal()
    }
    pub fn square(&self) -> Result<Tensor> {
        self.mul(self)
    }
    /// `torch.where(cond, a, b)` with broadcasting and promotion of `a` and `b`.
    pub fn where_(cond: &Tensor, a: impl Operand, b: impl Operand) -> Result<Tensor> {
        // a scalar branch takes the dtype of the tensor branch, not of the bool condition
        let (a, b) = if a.is_scalar() && !b.is_scalar() {
            let b = b.to_operand(cond)?;
            (a.to_operand(&b)?, b)
        } else {
            let a = a.to_operand(cond)?;
            let b = b.to_operand(&a)?;
            (a, b)
        };
        let dtype = DType::promote(a.dtype(), b.dtype());
        let c = cond.to_dtype(DType::Bool)?;
        // cast before broadcasting: a scalar branch stays one element
        let (a, b) = (a.to_dtype(dtype)?, b.to_dtype(dtype)?);
        let v = align("where", &[&c, &a, &b], None)?;
        apply(Prim::Where, &[&v[0], &v[1], &v[2]])
    }
    /// `clamp(min, max)`; either bound may be absent. NaN stays NaN.
    ///
    /// Bounds are `f64`; an integral bound on an integer tensor acts as PyTorch's integer bound (the
    /// result stays integer), any other bound as a float one (an integer tensor becomes float32).
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Tensor> {
        let mut x = self.clone();
        let int_bound =
            |x: &Tensor, v: f64| !x.dtype().is_float() && v.fract() == 0.0 && v.is_finite();
        if let Some(lo) = min {
            x = if int_bound(&x, lo) {
                Tensor::where_(&x.lt(lo as i64)?, lo as i64, &x)?
            } else {
                Tensor::where_(&x.lt(lo)?, lo, &x)?
            };
        }
        if let Some(hi) = max {
            x = if int_bound(&x, hi) {
                Tensor::where_(&x.gt(hi as i64)?, hi as i64, &x)?
            } else {
                Tensor::where_(&x.gt(hi)?, hi, &x)?
            };
        }
        Ok(x)
    }
}
