//! The errors of `moeswarm-relay`: the kind of failure (to match on, see [`Error::root`]) and
//! what was being done when it happened (its context, part of the message).

use moeswarm_protocol::dispatch::DispatchError;
use moeswarm_protocol::relay::RelayMessageError;

moeswarm_protocol::context_error! {
    /// What went wrong on the data plane.
    #[derive(Debug, thiserror::Error)]
    pub enum Error {
        /// A socket could not be bound or used.
        #[error(transparent)]
        Io(#[from] std::io::Error),
        /// A QUIC connection could not be started.
        #[error(transparent)]
        Connect(#[from] quinn::ConnectError),
        /// A QUIC connection broke or was refused.
        #[error(transparent)]
        Connection(#[from] quinn::ConnectionError),
        /// Writing to a stream failed.
        #[error(transparent)]
        Write(#[from] quinn::WriteError),
        /// Reading from a stream failed.
        #[error(transparent)]
        Read(#[from] quinn::ReadError),
        /// A stream ended inside a frame.
        #[error(transparent)]
        ReadExact(#[from] quinn::ReadExactError),
        /// A stream was used after it was finished.
        #[error(transparent)]
        Closed(#[from] quinn::ClosedStream),
        /// No TLS certificate could be made from the node's key.
        #[error("TLS certificate: {0}")]
        Tls(#[from] libp2p_tls::certificate::GenError),
        /// A deadline passed.
        #[error("deadline passed")]
        Timeout(#[from] tokio::time::error::Elapsed),
        /// A dispatch frame that breaks the protocol's rules.
        #[error(transparent)]
        Dispatch(#[from] DispatchError),
        /// A relay control message that breaks the protocol's rules.
        #[error(transparent)]
        RelayMessage(#[from] RelayMessageError),
        /// A frame header that is not the JSON it should be.
        #[error(transparent)]
        Json(#[from] serde_json::Error),
        /// The peer at an address proved another identity than the one dialed.
        #[error("{addr} is {got}, not {expected}")]
        WrongPeer {
            /// Where it was dialed.
            addr: std::net::SocketAddr,
            /// The PeerId dialed.
            expected: String,
            /// The PeerId its handshake proved.
            got: String,
        },
        /// A control message over its size limit.
        #[error("relay message of {len} bytes is over the limit of {limit}")]
        TooLarge {
            /// Its length.
            len: usize,
            /// The limit.
            limit: usize,
        },
        /// The relay said no (the reason is its words).
        #[error("relay refused: {0}")]
        RelayRefused(String),
    }
}

impl Error {
    /// Whether the root of this error is a frame or message that broke the protocol's rules
    /// (the peer misbehaved), rather than a stream or connection that failed.
    pub fn broke_protocol(&self) -> bool {
        matches!(
            self.root(),
            Error::Dispatch(_)
                | Error::RelayMessage(_)
                | Error::Json(_)
                | Error::TooLarge { .. }
                | Error::WrongPeer { .. }
        )
    }
}
