//! The errors of `moeswarm-node`: the kind of failure (to match on, see [`Error::root`]) and
//! what was being done when it happened (its context, part of the message).

moeswarm_protocol::context_error! {
    /// What went wrong running a node.
    #[derive(Debug, thiserror::Error)]
    pub enum Error {
        /// Reading the model or the store failed.
        #[error(transparent)]
        Model(#[from] moeswarm_model::Error),
        /// Computing failed.
        #[error(transparent)]
        Engine(#[from] moeswarm_engine::Error),
        /// The QUIC data plane failed.
        #[error(transparent)]
        DataPlane(#[from] moeswarm_relay::Error),
        /// A QUIC connection broke or was refused.
        #[error(transparent)]
        Quic(#[from] quinn::ConnectionError),
        /// Writing to a QUIC stream failed.
        #[error(transparent)]
        QuicWrite(#[from] quinn::WriteError),
        /// A file or socket could not be used.
        #[error(transparent)]
        Io(#[from] std::io::Error),
        /// A peer's holdings record that fails verification.
        #[error(transparent)]
        Record(#[from] moeswarm_protocol::RecordError),
        /// An exchange frame that breaks the protocol.
        #[error(transparent)]
        Wire(#[from] moeswarm_protocol::WireError),
        /// A dispatch that breaks the protocol.
        #[error(transparent)]
        Dispatch(#[from] moeswarm_protocol::dispatch::DispatchError),
        /// An exchange request a peer did not answer (the kind says how).
        #[error(transparent)]
        Request(#[from] Box<crate::net::RequestFailure>),
        /// A dispatch a worker did not answer acceptably (the reason says how).
        #[error(transparent)]
        DispatchFailed(#[from] crate::dataplane::DispatchFailure),
        /// A manifest that is not valid or not canonical.
        #[error(transparent)]
        Manifest(#[from] moeswarm_protocol::ManifestError),
        /// Text that is not a blob or model id.
        #[error(transparent)]
        Id(#[from] moeswarm_protocol::IdParseError),
        /// Text that is not a libp2p address.
        #[error(transparent)]
        Multiaddr(#[from] libp2p::multiaddr::Error),
        /// libp2p could not listen on an address.
        #[error(transparent)]
        Listen(#[from] libp2p::TransportError<std::io::Error>),
        /// libp2p could not dial a peer.
        #[error(transparent)]
        Dial(#[from] Box<libp2p::swarm::DialError>),
        /// A node key that libp2p does not take.
        #[error(transparent)]
        Key(#[from] libp2p::identity::DecodingError),
        /// A JSON message or report that is not what it should be.
        #[error(transparent)]
        Json(#[from] serde_json::Error),
        /// A config file that is not the TOML it should be.
        #[error(transparent)]
        Toml(#[from] Box<toml::de::Error>),
        /// A blocking task panicked or was cancelled.
        #[error("background task: {0}")]
        Task(#[from] tokio::task::JoinError),
        /// A deadline passed.
        #[error("deadline passed")]
        Timeout(#[from] tokio::time::error::Elapsed),
        /// The node's swarm task has stopped.
        #[error("the node has stopped")]
        Stopped,
    }
}

impl From<crate::net::RequestFailure> for Error {
    fn from(f: crate::net::RequestFailure) -> Self {
        Error::Request(Box::new(f))
    }
}

impl From<Error> for moeswarm_engine::Error {
    fn from(e: Error) -> Self {
        moeswarm_engine::Error::Executor(Box::new(e))
    }
}

impl From<libp2p::swarm::DialError> for Error {
    fn from(e: libp2p::swarm::DialError) -> Self {
        Error::Dial(Box::new(e))
    }
}

impl From<toml::de::Error> for Error {
    fn from(e: toml::de::Error) -> Self {
        Error::Toml(Box::new(e))
    }
}

impl From<tokio::sync::oneshot::error::RecvError> for Error {
    fn from(_: tokio::sync::oneshot::error::RecvError) -> Self {
        Error::Stopped
    }
}
