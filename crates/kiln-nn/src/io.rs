//! State dicts to and from safetensors files, with PyTorch's key names (`0.weight`, `bn.running_mean`),
//! so files interchange with `safetensors.torch.save_file` / `load_file`.

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use kiln_core::{DType, Error, Result, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::{Module, StateDict};

/// Anything that can be saved: a `StateDict`, or any module (its `state_dict()`).
pub trait ToStateDict {
    fn to_state_dict(&self) -> StateDict;
}

impl ToStateDict for StateDict {
    fn to_state_dict(&self) -> StateDict {
        self.clone()
    }
}

impl<M: Module + ?Sized> ToStateDict for M {
    fn to_state_dict(&self) -> StateDict {
        self.state_dict()
    }
}

fn io_err(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {what}", path.display()))
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
    }
}

/// A tensor's elements as little-endian bytes in row-major order (any layout).
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    fn le<T, const N: usize>(v: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        v.into_iter().flat_map(f).collect()
    }
    Ok(match t.dtype() {
        DType::F32 => le(t.to_vec::<f32>()?, f32::to_le_bytes),
        DType::F64 => le(t.to_vec::<f64>()?, f64::to_le_bytes),
        DType::F16 => le(t.to_vec::<f16>()?, f16::to_le_bytes),
        DType::BF16 => le(t.to_vec::<bf16>()?, bf16::to_le_bytes),
        DType::I32 => le(t.to_vec::<i32>()?, i32::to_le_bytes),
        DType::I64 => le(t.to_vec::<i64>()?, i64::to_le_bytes),
        DType::U8 => t.to_vec::<u8>()?,
        DType::Bool => le(t.to_vec::<bool>()?, |b| [b as u8]),
    })
}

/// Decodes one safetensors tensor. The data length was checked by the safetensors parser.
fn view_to_tensor(path: &Path, name: &str, v: &TensorView<'_>) -> Result<Tensor> {
    fn decode<T: kiln_core::storage::StorageElement, const N: usize>(
        b: &[u8],
        shape: &[usize],
        f: impl Fn([u8; N]) -> T,
    ) -> Result<Tensor> {
        let data = b
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect();
        Tensor::from_vec(data, shape)
    }
    let (b, s) = (v.data(), v.shape());
    match v.dtype() {
        Dtype::F32 => decode(b, s, f32::from_le_bytes),
        Dtype::F64 => decode(b, s, f64::from_le_bytes),
        Dtype::F16 => decode(b, s, f16::from_le_bytes),
        Dtype::BF16 => decode(b, s, bf16::from_le_bytes),
        Dtype::I32 => decode(b, s, i32::from_le_bytes),
        Dtype::I64 => decode(b, s, i64::from_le_bytes),
        Dtype::U8 => decode(b, s, |[x]: [u8; 1]| x),
        Dtype::BOOL => decode(b, s, |[x]: [u8; 1]| x != 0),
        other => Err(io_err(
            path,
            format!(
                "tensor \"{name}\" has dtype {other:?}, which kiln does not support \
                 (supported: F32, F64, F16, BF16, I32, I64, U8, BOOL)"
            ),
        )),
    }
}

/// Serialises a state dict (or a module's) to safetensors bytes.
pub fn to_safetensors_bytes<S: ToStateDict + ?Sized>(src: &S) -> Result<Vec<u8>> {
    let (views, meta) = prepare(&src.to_state_dict())?;
    let views: Vec<(String, TensorView<'_>)> = views
        .iter()
        .map(|(k, d, shape, b)| {
            TensorView::new(*d, shape.clone(), b)
                .map(|v| (k.clone(), v))
                .map_err(|e| Error::Io(format!("safetensors: tensor \"{k}\": {e}")))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize(views, &meta).map_err(|e| Error::Io(format!("safetensors: {e}")))
}

type Prepared = (
    Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    Option<HashMap<String, String>>,
);

fn prepare(sd: &StateDict) -> Result<Prepared> {
    let entries = sd
        .iter()
        .map(|(k, t)| {
            Ok((
                k.to_string(),
                st_dtype(t.dtype()),
                t.shape().to_vec(),
                tensor_bytes(t)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    // what transformers writes; safetensors.torch ignores it
    let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    Ok((entries, meta))
}

/// `safetensors.torch.save_file(model.state_dict(), path)`.
pub fn save_safetensors<S: ToStateDict + ?Sized>(src: &S, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let bytes = to_safetensors_bytes(src).map_err(|e| io_err(path, e))?;
    std::fs::write(path, bytes).map_err(|e| io_err(path, e))
}

/// Parses safetensors bytes into a state dict (keys sorted, the file keeps no order of its own).
pub fn from_safetensors_bytes(bytes: &[u8]) -> Result<StateDict> {
    parse(Path::new("<bytes>"), bytes)
}

fn parse(path: &Path, bytes: &[u8]) -> Result<StateDict> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| io_err(path, format!("not a valid safetensors file: {e}")))?;
    let mut entries = st.tensors();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    entries
        .into_iter()
        .map(|(k, v)| Ok((k.clone(), view_to_tensor(path, &k, &v)?)))
        .collect()
}

/// `safetensors.torch.load_file(path)`: every tensor of the file, on the CPU.
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<StateDict> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| io_err(path, e))?;
    parse(path, &bytes)
}
