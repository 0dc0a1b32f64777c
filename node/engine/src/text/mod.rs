//! Tokens in, tokens out: the tokenizer from a GGUF's own metadata, and sampling.

pub mod sampling;
pub mod tokenizer;

pub use sampling::{Sampler, SamplingConfig};
pub use tokenizer::TextTokenizer;
