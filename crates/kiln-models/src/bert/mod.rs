//! BERT (Hugging Face architecture and state-dict key names) and sentence-embedding pooling.
