//! Activations, as compositions chosen to be numerically stable in both directions.

use crate::{Result, Tensor};

impl Tensor {
    /// `max(x, 0)` with gradient 0 at 0, as PyTorch; NaN stays NaN.
    pub fn relu(&self) -> Result<Tensor> {
        Tensor::where_(&self.le(0.0)?, 0.0, self)
    }
    /// `0.5 * tanh(x/2) + 0.5`: no overflow for large |x| in value or gradient.
    pub fn sigmoid(&self) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        x.mul(0.5)?.tanh()?.mul(0.5)?.add(0.5)
    }
    pub fn silu(&self) -> Result<Tensor> {
        self.mul(&self.sigmoid()?)
    }
    /// `x * Φ(x)` (the erf form, PyTorch's default).
    pub fn gelu(&self) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        x.mul(&x.mul(std::f64::consts::FRAC_1_SQRT_2)?.erf()?.add(1.0)?)?
            .mul(0.5)
    }
    /// GELU's tanh approximation (`approximate='tanh'`).
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        use crate::prim::Activation;
        let x = self.to_dtype(self.dtype().to_float())?;
        // the compiler's GELU epilogue (`Activation::GeluTanh`) matches these ops and constants
        let k = Activation::gelu_scale();
        let inner = x
            .add(&x.mul(&x)?.mul(&x)?.mul(Activation::GELU_CUBE)?)?
            .mul(k)?;
        x.mul(&inner.tanh()?.add(1.0)?)?.mul(0.5)
    }
    pub fn leaky_relu(&self, slope: f64) -> Result<Tensor> {
        Tensor::where_(&self.gt(0.0)?, self, &self.mul(slope)?)
    }
}
