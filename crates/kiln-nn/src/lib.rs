//! kiln-nn: `torch.nn` and `torch.optim` for kiln — the `Module` trait with PyTorch's parameter
//! naming and state dicts, the common layers with PyTorch's default initialisation, SGD/Adam/AdamW
//! (per-parameter and multi-tensor), LR schedulers, and safetensors IO.
//!
//! Layering (DESIGN.md invariant 6): this crate builds only on kiln-core's eager tensor API.

pub mod init;
pub mod io;
mod layers;
mod module;
mod module_to;
pub mod optim;
mod state_dict;

pub use layers::*;
pub use module::{join_name, train_flag_generation, Module, TensorKind, TrainFlag};
pub use state_dict::StateDict;

/// `kiln_nn::nn::Linear` etc., for code that likes the PyTorch path.
pub mod nn {
    pub use crate::layers::*;
    pub use crate::module::{Module, TensorKind};
    pub use crate::{init, StateDict};
}
