//! BERT (Hugging Face architecture and state-dict key names) and sentence-embedding pooling.
//!
//! `BertModel::from_pretrained(dir)` reads a Hugging Face model folder (`config.json` +
//! `model.safetensors`); `BertTokenizer` reads its `tokenizer.json`; `pooling::sentence_embedding`
//! turns the last hidden state into sentence-transformers' normalized mean-pooled embeddings.

mod attention;
mod config;
mod embeddings;
mod encoder;
mod model;
pub mod pooling;
mod tokenizer;

pub use attention::{BertAttention, BertResidualOutput, BertSelfAttention};
pub use config::BertConfig;
pub use embeddings::BertEmbeddings;
pub use encoder::{BertEncoder, BertIntermediate, BertLayer, BertLayerList};
pub use model::{BertModel, BertOutput, BertPooler, LoadReport};
pub use pooling::{l2_normalize, mean_pooling, sentence_embedding};
pub use tokenizer::{BatchEncoding, BertTokenizer};
