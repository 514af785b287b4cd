//! The one error type of kiln. Every public entry point returns `Result<T, Error>`; each variant names
//! the op and the offending shapes, dtypes or devices, so a user can tell what to change.

use crate::{DType, Device};

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("{op}: shape mismatch: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("{op}: unsupported dtype {dtype:?}: {msg}")]
    DType {
        op: &'static str,
        dtype: DType,
        msg: String,
    },
    #[error("{op}: dtype mismatch: {lhs:?} vs {rhs:?}")]
    DTypeMismatch {
        op: &'static str,
        lhs: DType,
        rhs: DType,
    },
    #[error("{op}: device mismatch or unavailable device: {lhs:?} vs {rhs:?}: {msg}")]
    Device {
        op: &'static str,
        lhs: Device,
        rhs: Device,
        msg: String,
    },
    #[error("{op}: index out of range: {msg}")]
    Index { op: &'static str, msg: String },
    #[error("{op}: invalid argument: {msg}")]
    Arg { op: &'static str, msg: String },
    #[error("autograd: {0}")]
    Autograd(String),
    #[error("io: {0}")]
    Io(String),
    #[error("{op}: not supported: {msg}")]
    Unsupported { op: &'static str, msg: String },
}

impl Error {
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape {
            op,
            msg: msg.into(),
        }
    }
    pub fn arg(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Arg {
            op,
            msg: msg.into(),
        }
    }
    pub fn index(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Index {
            op,
            msg: msg.into(),
        }
    }
    pub fn dtype(op: &'static str, dtype: DType, msg: impl Into<String>) -> Self {
        Error::DType {
            op,
            dtype,
            msg: msg.into(),
        }
    }
    pub fn unsupported(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Unsupported {
            op,
            msg: msg.into(),
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}
