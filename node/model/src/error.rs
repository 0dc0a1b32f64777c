//! The errors of `moeswarm-model`: the kind of failure (to match on, see [`Error::root`]) and
//! what was being done when it happened (its context, part of the message).

use moeswarm_protocol::{IdParseError, ManifestError};

use crate::gguf::GgufError;
use crate::size::SizeError;
use crate::store::transfer::TransferError;

moeswarm_protocol::context_error! {
    /// What went wrong reading, slicing or storing a model.
    #[derive(Debug, thiserror::Error)]
    pub enum Error {
        /// A file or directory could not be read or written.
        #[error(transparent)]
        Io(#[from] std::io::Error),
        /// A GGUF file that breaks the format.
        #[error(transparent)]
        Gguf(#[from] GgufError),
        /// The files of a split model that do not make one model.
        #[error(transparent)]
        Split(#[from] crate::gguf::SplitError),
        /// A manifest that is not valid or not canonical.
        #[error(transparent)]
        Manifest(#[from] ManifestError),
        /// Text that is not a blob or model id.
        #[error(transparent)]
        Id(#[from] IdParseError),
        /// A size that could not be read.
        #[error(transparent)]
        Size(#[from] SizeError),
        /// Bytes of a transfer that failed verification.
        #[error(transparent)]
        Transfer(#[from] TransferError),
        /// Another process has the store open (its lock says which).
        #[error(
            "the store at {} is in use by another process ({holder}): stop it, or give another \
             store directory",
            dir.display()
        )]
        StoreInUse {
            /// The store's directory.
            dir: std::path::PathBuf,
            /// What its lock file says of the holder (`pid N`).
            holder: String,
        },
        /// The disk holding the store is full: nothing in it was moved or rebuilt.
        #[error(
            "the disk holding the store at {} is full ({what}): free some space; nothing in the \
             store was moved or changed",
            dir.display()
        )]
        StoreFull {
            /// The store's directory.
            dir: std::path::PathBuf,
            /// What could not be written.
            what: String,
        },
        /// A write asked of a store that can only be read (read-only media, or a directory
        /// this user cannot write).
        #[error(
            "the store at {} is read-only (read-only media, or not writable by this user): it \
             can be read, not {what}",
            dir.display()
        )]
        StoreReadOnly {
            /// The store's directory.
            dir: std::path::PathBuf,
            /// What was asked of it.
            what: &'static str,
        },
        /// The store's index (sled) failed.
        #[error("store index: {0}")]
        Index(#[from] sled::Error),
        /// An index entry or report that is not the JSON it should be.
        #[error(transparent)]
        Json(#[from] serde_json::Error),
        /// A devices file that is not the TOML it should be.
        #[error(transparent)]
        Toml(#[from] Box<toml::de::Error>),
        /// Slabs that do not fit on the devices given.
        #[error(transparent)]
        Placement(#[from] moeswarm_market::placement::PlacementError),
    }
}

impl From<toml::de::Error> for Error {
    fn from(e: toml::de::Error) -> Self {
        Error::Toml(Box::new(e))
    }
}
