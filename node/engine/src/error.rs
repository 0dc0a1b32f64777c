//! The errors of `moeswarm-engine`: the kind of failure (to match on, see [`Error::root`]) and
//! what was being done when it happened (its context, part of the message).

moeswarm_protocol::context_error! {
    /// What went wrong computing.
    #[derive(Debug, thiserror::Error)]
    pub enum Error {
        /// Reading the model or the store failed.
        #[error(transparent)]
        Model(#[from] moeswarm_model::Error),
        /// A GGUF that breaks the format.
        #[error(transparent)]
        Gguf(#[from] moeswarm_model::gguf::GgufError),
        /// candle refused or failed a tensor operation.
        #[error("candle: {0}")]
        Candle(#[from] candle_core::Error),
        /// The tokenizer could not be built or could not encode or decode.
        #[error("tokenizer: {0}")]
        Tokenizer(String),
        /// A conversation that could not be made into a prompt.
        #[error(transparent)]
        Chat(#[from] crate::text::ChatError),
        /// A file could not be read or written.
        #[error(transparent)]
        Io(#[from] std::io::Error),
        /// A manifest that is not valid.
        #[error(transparent)]
        Manifest(#[from] moeswarm_protocol::ManifestError),
        /// An expert executor of another crate (a remote one) failed; its error says how.
        #[error(transparent)]
        Executor(Box<dyn std::error::Error + Send + Sync>),
    }
}
