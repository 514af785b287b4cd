//! Element types and PyTorch's type-promotion lattice.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
    U8,
    Bool,
}

impl DType {
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
    ];

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64 | DType::U8)
    }
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }
    /// PyTorch's name, as printed in `dtype=torch.float16`.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        }
    }
    /// The safetensors dtype tag.
    /// A short tag (`f32`, `bf16`, `b8`) for kernel signatures and graph listings.
    pub fn tag(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Bool => "b8",
        }
    }

    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
        }
    }

    fn rank(self) -> u8 {
        match self {
            DType::Bool => 0,
            DType::U8 => 1,
            DType::I32 => 2,
            DType::I64 => 3,
            DType::F16 | DType::BF16 => 4,
            DType::F32 => 5,
            DType::F64 => 6,
        }
    }

    /// `torch.promote_types`: the smallest dtype both values fit in.
    pub fn promote(a: DType, b: DType) -> DType {
        if a == b {
            return a;
        }
        if a.is_half() && b.is_half() {
            return DType::F32; // f16 + bf16 has no common half type
        }
        if a.rank() >= b.rank() {
            a
        } else {
            b
        }
    }

    /// The dtype a float-only op (exp, mean, ...) computes in for an input of this dtype.
    pub fn to_float(self) -> DType {
        if self.is_float() {
            self
        } else {
            DType::F32
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.torch_name())
    }
}

/// A Rust type that can be a tensor element.
pub trait Element: Copy + Send + Sync + 'static + std::fmt::Debug {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

macro_rules! element {
    ($t:ty, $d:ident, |$x:ident| $to:expr, |$v:ident| $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline]
            fn to_f64(self) -> f64 {
                let $x = self;
                $to
            }
            #[inline]
            fn from_f64($v: f64) -> Self {
                $from
            }
        }
    };
}
element!(f32, F32, |x| x as f64, |v| v as f32);
element!(f64, F64, |x| x, |v| v);
element!(f16, F16, |x| x.to_f64(), |v| f16::from_f64(v));
element!(bf16, BF16, |x| x.to_f64(), |v| bf16::from_f64(v));
element!(i32, I32, |x| x as f64, |v| v as i32);
element!(i64, I64, |x| x as f64, |v| v as i64);
element!(u8, U8, |x| x as f64, |v| v as u8);
element!(bool, Bool, |x| if x { 1.0 } else { 0.0 }, |v| v != 0.0);
