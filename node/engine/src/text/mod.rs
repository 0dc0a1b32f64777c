//! Tokens in, tokens out: the tokenizer from a GGUF's own metadata, the chat template that
//! makes a conversation a prompt, and sampling.

pub mod chat;
mod markers;
pub mod sampling;
pub mod tokenizer;

pub use chat::{ChatError, ChatInputs, ChatTemplate};
pub use sampling::{Sampler, SamplingConfig};
pub use tokenizer::TextTokenizer;
