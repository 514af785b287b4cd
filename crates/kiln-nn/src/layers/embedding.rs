//! `nn.Embedding`: a lookup table of `num_embeddings` rows of size `embedding_dim`.

use kiln_core::{DType, Error, Result, Tensor};

use crate::init::parameter;
use crate::module::{Module, TensorKind, TrainFlag};

pub struct Embedding {
    pub weight: Tensor,
    pub num_embeddings: usize,
    pub embedding_dim: usize,
    training: TrainFlag,
}

impl Embedding {
    /// `nn.Embedding(num_embeddings, embedding_dim)`, weight from N(0, 1), float32.
    pub fn new(num_embeddings: usize, embedding_dim: usize) -> Result<Embedding> {
        let w = Tensor::randn(&[num_embeddings, embedding_dim], DType::F32)?;
        Embedding::from_weights(w)
    }

    /// `nn.Embedding.from_pretrained(weight, freeze=False)`.
    pub fn from_weights(weight: Tensor) -> Result<Embedding> {
        if weight.rank() != 2 {
            return Err(Error::shape(
                "Embedding",
                format!(
                    "weight must be [num_embeddings, embedding_dim], got {:?}",
                    weight.shape()
                ),
            ));
        }
        Ok(Embedding {
            num_embeddings: weight.shape()[0],
            embedding_dim: weight.shape()[1],
            weight: parameter(weight)?,
            training: TrainFlag::default(),
        })
    }
}

impl Module for Embedding {
    /// `x` holds integer indices of any shape; the output appends `embedding_dim`.
    /// Out-of-range indices are an `Err` (checked by the gather kernel).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype().is_float() || x.dtype() == DType::Bool {
            return Err(Error::dtype(
                "Embedding",
                x.dtype(),
                "indices must be an integer tensor (int64 or int32)",
            ));
        }
        self.weight.embedding(x)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn visit_own(&self, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f("weight", &self.weight, TensorKind::Parameter);
    }
    fn visit_own_mut(&mut self, f: &mut dyn FnMut(&str, &mut Tensor, TensorKind)) {
        f("weight", &mut self.weight, TensorKind::Parameter);
    }
}
