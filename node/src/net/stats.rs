//! [`NodeStats`]: what a node's swarm received, refused and served.

use std::collections::BTreeMap;

use serde::Serialize;

/// Why a record (holdings or demand) was not taken in. Counts are keyed by it; its name
/// (`as_str`, and the JSON key) is for people and reports only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordRefusal {
    /// Larger than a record may be.
    Oversized,
    /// Not a record.
    Malformed,
    /// Its signature does not verify.
    BadSignature,
    /// Signed by another node than the one that sent it.
    WrongSigner,
    /// Not newer than the one held.
    Stale,
    /// Already expired.
    Expired,
    /// For another model than the topic's.
    OtherModel,
    /// Its shape (layers, experts) is not the model's.
    WrongShape,
    /// From a stranger to a full table that could not wait for a dial.
    TooManyNodes,
    /// From a stranger to a full table, waiting for a dial to prove it.
    WaitingForADial,
    /// A kept record let go for a newcomer of better standing.
    EvictedForABetterStanding,
}

impl RecordRefusal {
    /// The name reports use.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordRefusal::Oversized => "oversized",
            RecordRefusal::Malformed => "malformed",
            RecordRefusal::BadSignature => "bad_signature",
            RecordRefusal::WrongSigner => "wrong_signer",
            RecordRefusal::Stale => "stale",
            RecordRefusal::Expired => "expired",
            RecordRefusal::OtherModel => "other_model",
            RecordRefusal::WrongShape => "wrong_shape",
            RecordRefusal::TooManyNodes => "too_many_nodes",
            RecordRefusal::WaitingForADial => "waiting_for_a_dial",
            RecordRefusal::EvictedForABetterStanding => "evicted_for_a_better_standing",
        }
    }
}

impl std::fmt::Display for RecordRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&moeswarm_protocol::record::RecordError> for RecordRefusal {
    fn from(e: &moeswarm_protocol::record::RecordError) -> Self {
        use moeswarm_protocol::record::RecordError as E;
        match e {
            E::Oversized(_) => RecordRefusal::Oversized,
            E::Malformed(_) => RecordRefusal::Malformed,
            E::BadSignature => RecordRefusal::BadSignature,
            E::WrongSigner => RecordRefusal::WrongSigner,
            E::Stale { .. } => RecordRefusal::Stale,
            E::Expired { .. } => RecordRefusal::Expired,
        }
    }
}

impl From<moeswarm_market::coverage::Refusal> for RecordRefusal {
    fn from(r: moeswarm_market::coverage::Refusal) -> Self {
        use moeswarm_market::coverage::Refusal as R;
        match r {
            R::OtherModel => RecordRefusal::OtherModel,
            R::WrongShape => RecordRefusal::WrongShape,
            R::NotNewer => RecordRefusal::Stale,
            R::Expired => RecordRefusal::Expired,
            R::TooMany => RecordRefusal::TooManyNodes,
        }
    }
}

/// Counts of what arrived and what was refused.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeStats {
    /// Records verified and applied to a coverage map.
    pub records_applied: u64,
    /// Records refused in verification, by reason.
    pub records_refused: BTreeMap<RecordRefusal, u64>,
    /// Demand records verified and applied.
    pub demand_applied: u64,
    /// Demand records refused, by reason.
    pub demand_refused: BTreeMap<RecordRefusal, u64>,
    /// Heartbeats verified and noted.
    pub heartbeats_heard: u64,
    /// Heartbeats refused, by reason.
    pub heartbeats_refused: BTreeMap<RecordRefusal, u64>,
    /// Peers connected now.
    pub connected_peers: usize,
    /// Exchange requests answered.
    pub requests_served: u64,
    /// Exchange requests refused because too many were being answered.
    pub requests_shed: u64,
    /// Bad answers (failed verification, malformed) received, by peer.
    pub penalties: BTreeMap<String, u64>,
    /// Peers banned for repeated bad records or answers, with how often.
    pub banned: BTreeMap<String, u64>,
    /// DHT bootstrap queries finished (answered or timed out): after the first, the node
    /// knows the peers its bootstrap nodes know.
    pub dht_bootstraps: u64,
    /// Strangers whose records wait for a dial to prove them (a full table's newcomers), and
    /// the bytes of those records: both bounded.
    pub strangers_waiting: usize,
    /// Bytes of the records they wait with.
    pub strangers_waiting_bytes: usize,
    /// Strangers proven by a dial and taken in.
    pub strangers_vetted: u64,
}

/// What waiting callers watch: how joined the node is, and how many records it took in. Published by the swarm task whenever
/// it changes ([`crate::net::NodeHandle::wait_joined`] waits on it, no polling).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwarmStatus {
    /// Peers connected now.
    pub connected_peers: usize,
    /// DHT bootstrap queries finished.
    pub dht_bootstraps: u64,
    /// Holdings records taken in so far (a change means the coverage may have grown).
    pub records_taken: u64,
}

/// Why an exchange request to a peer got no answer: what the fetcher and the record
/// collection tell apart (a peer to give up on at once, or one to try again later).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestFailure {
    /// No connection could be made to it (or it is banned here).
    #[error("{peer} could not be reached: {why}")]
    Unreachable {
        /// The peer.
        peer: libp2p::PeerId,
        /// What the dial met.
        why: String,
    },
    /// It did not answer within the request deadline.
    #[error("{peer} did not answer in time")]
    Timeout {
        /// The peer.
        peer: libp2p::PeerId,
    },
    /// The connection closed, or the stream broke, before its answer came.
    #[error("the exchange with {peer} broke off: {why}")]
    BrokeOff {
        /// The peer.
        peer: libp2p::PeerId,
        /// What the stream met.
        why: String,
    },
    /// It does not speak the exchange protocol: not a moeswarm node.
    #[error("{peer} does not speak the exchange protocol")]
    Unsupported {
        /// The peer.
        peer: libp2p::PeerId,
    },
    /// This node has too many requests waiting for peers to connect; ask again later.
    #[error("too many requests wait for a connection here: {0}")]
    Overloaded(String),
    /// A node does not send itself requests.
    #[error("a node does not ask itself")]
    ToItself,
}
