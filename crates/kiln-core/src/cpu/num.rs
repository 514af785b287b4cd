//! Element arithmetic the kernels are generic over. Integer ops wrap (no overflow panics) and integer
//! division by zero yields 0 rather than aborting the process.

use crate::storage::StorageElement;

pub(crate) trait Num: StorageElement + PartialOrd {
    const ZERO: Self;
    const ONE: Self;
    const MIN: Self;
    const MAX: Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn pow(self, o: Self) -> Self;
    fn neg(self) -> Self;
    fn abs(self) -> Self;
    fn sign(self) -> Self;
    fn floor(self) -> Self;
    fn is_nan(self) -> bool;
}

macro_rules! num_float {
    ($t:ty) => {
        impl Num for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const MIN: Self = <$t>::NEG_INFINITY;
            const MAX: Self = <$t>::INFINITY;
            #[inline]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline]
            fn sub(self, o: Self) -> Self {
                self - o
            }
            #[inline]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline]
            fn div(self, o: Self) -> Self {
                self / o
            }
            #[inline]
            fn pow(self, o: Self) -> Self {
                self.powf(o)
            }
            #[inline]
            fn neg(self) -> Self {
                -self
            }
            #[inline]
            fn abs(self) -> Self {
                self.abs()
            }
            #[inline]
            fn sign(self) -> Self {
                // (0 < x) - (x < 0), as PyTorch: sign(-0.0) is +0.0
                if self > 0.0 {
                    1.0
                } else if self < 0.0 {
                    -1.0
                } else if self.is_nan() {
                    self
                } else {
                    0.0
                }
            }
            #[inline]
            fn floor(self) -> Self {
                self.floor()
            }
            #[inline]
            fn is_nan(self) -> bool {
                self.is_nan()
            }
        }
    };
}
num_float!(f32);
num_float!(f64);

macro_rules! num_int {
    ($t:ty) => {
        impl Num for $t {
            const ZERO: Self = 0;
            const ONE: Self = 1;
            const MIN: Self = <$t>::MIN;
            const MAX: Self = <$t>::MAX;
            #[inline]
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline]
            fn sub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            #[inline]
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline]
            fn div(self, o: Self) -> Self {
                if o == 0 {
                    0
                } else {
                    self.wrapping_div(o)
                }
            }
            #[inline]
            fn pow(self, o: Self) -> Self {
                if (o as i64) < 0 {
                    0
                } else {
                    self.wrapping_pow(o as u32)
                }
            }
            #[inline]
            fn neg(self) -> Self {
                (0 as $t).wrapping_sub(self)
            }
            #[inline]
            fn abs(self) -> Self {
                if self < 0 as $t {
                    self.neg()
                } else {
                    self
                }
            }
            #[inline]
            fn sign(self) -> Self {
                if self > 0 as $t {
                    1
                } else if self < 0 as $t {
                    // not `-(min(-x, 1))`: -MIN wraps to MIN
                    (0 as $t).wrapping_sub(1)
                } else {
                    0
                }
            }
            #[inline]
            fn floor(self) -> Self {
                self
            }
            #[inline]
            fn is_nan(self) -> bool {
                false
            }
        }
    };
}
num_int!(i32);
num_int!(i64);
num_int!(u8);

/// Transcendental functions, for f32 and f64.
pub(crate) trait Float: Num {
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn ln_1p(self) -> Self;
    fn sqrt(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tanh(self) -> Self;
    fn erf(self) -> Self;
}

impl Float for f32 {
    #[inline]
    fn exp(self) -> Self {
        self.exp()
    }
    #[inline]
    fn ln(self) -> Self {
        self.ln()
    }
    #[inline]
    fn ln_1p(self) -> Self {
        self.ln_1p()
    }
    #[inline]
    fn sqrt(self) -> Self {
        self.sqrt()
    }
    #[inline]
    fn sin(self) -> Self {
        self.sin()
    }
    #[inline]
    fn cos(self) -> Self {
        self.cos()
    }
    #[inline]
    fn tanh(self) -> Self {
        self.tanh()
    }
    #[inline]
    fn erf(self) -> Self {
        libm::erff(self)
    }
}
impl Float for f64 {
    #[inline]
    fn exp(self) -> Self {
        self.exp()
    }
    #[inline]
    fn ln(self) -> Self {
        self.ln()
    }
    #[inline]
    fn ln_1p(self) -> Self {
        self.ln_1p()
    }
    #[inline]
    fn sqrt(self) -> Self {
        self.sqrt()
    }
    #[inline]
    fn sin(self) -> Self {
        self.sin()
    }
    #[inline]
    fn cos(self) -> Self {
        self.cos()
    }
    #[inline]
    fn tanh(self) -> Self {
        self.tanh()
    }
    #[inline]
    fn erf(self) -> Self {
        libm::erf(self)
    }
}
