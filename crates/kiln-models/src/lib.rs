//! Reference models written with `kiln::nn`, with the parameter names of their PyTorch originals
//! (torchvision, Hugging Face transformers) so state dicts exported from PyTorch load directly.

pub mod bert;
pub mod densenet;
pub mod fetch;
pub mod resnet;
mod vision_layers;
