//! Names and checks of signed records (holdings, demand) as the swarm carries them: gossip
//! topics, DHT keys, and verification against the peer a record came from.

use std::time::{SystemTime, UNIX_EPOCH};

use libp2p::kad::RecordKey;
use libp2p::{gossipsub, PeerId};
use moeswarm_protocol::{ModelId, NodeKey, RecordBody, RecordError, Signed};

use super::identity::peer_id_of;

pub(crate) fn topic(model: &ModelId) -> gossipsub::IdentTopic {
    gossipsub::IdentTopic::new(format!("/moeswarm/holdings/{model}"))
}

pub(crate) fn demand_topic(model: &ModelId) -> gossipsub::IdentTopic {
    gossipsub::IdentTopic::new(format!("/moeswarm/demand/{model}"))
}

/// The DHT key of a model: its providers are the nodes that serve its manifest.
pub fn model_key(model: &ModelId) -> RecordKey {
    RecordKey::new(&[b"/moeswarm/model/".as_slice(), &model.0 .0].concat())
}

/// The DHT key of one node's holdings record of one model.
pub fn holdings_key(model: &ModelId, node: &NodeKey) -> RecordKey {
    RecordKey::new(&[b"/moeswarm/holdings/".as_slice(), &model.0 .0, &node.0].concat())
}

/// The DHT key of one router's demand record of one model.
pub fn demand_key(model: &ModelId, router: &NodeKey) -> RecordKey {
    RecordKey::new(&[b"/moeswarm/demand/".as_slice(), &model.0 .0, &router.0].concat())
}

/// Which kind of signed record a DHT key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecordKind {
    Holdings,
    Demand,
}

impl RecordKind {
    /// The gossip topic records of this kind of `model` travel on.
    pub(crate) fn topic(self, model: &ModelId) -> gossipsub::IdentTopic {
        match self {
            RecordKind::Holdings => topic(model),
            RecordKind::Demand => demand_topic(model),
        }
    }

    /// The DHT key of the record `wire` (of this kind, of `model`) and when it expires; `None`
    /// for what does not parse.
    pub(crate) fn dht_key(self, model: &ModelId, wire: &[u8]) -> Option<(RecordKey, u64)> {
        fn body<T: RecordBody>(wire: &[u8]) -> Option<T> {
            let signed = Signed::<T>::from_wire(wire).ok()?;
            serde_json::from_slice::<T>(&signed.body).ok()
        }
        match self {
            RecordKind::Holdings => body::<moeswarm_protocol::Holdings>(wire)
                .map(|h| (holdings_key(model, &h.node), h.expires_at)),
            RecordKind::Demand => body::<moeswarm_protocol::Demand>(wire)
                .map(|d| (demand_key(model, &d.router), d.expires_at)),
        }
    }
}

/// The kind, model and signer a DHT key names, if it is one of this swarm's record keys.
pub(crate) fn parse_record_key(key: &RecordKey) -> Option<(RecordKind, ModelId, NodeKey)> {
    let k = key.as_ref();
    let (kind, rest) = if let Some(rest) = k.strip_prefix(b"/moeswarm/holdings/".as_slice()) {
        (RecordKind::Holdings, rest)
    } else {
        (
            RecordKind::Demand,
            k.strip_prefix(b"/moeswarm/demand/".as_slice())?,
        )
    };
    if rest.len() != 64 {
        return None;
    }
    let model = ModelId(moeswarm_protocol::BlobId(rest[..32].try_into().ok()?));
    Some((kind, model, NodeKey(rest[32..].try_into().ok()?)))
}

/// A sequence number that grows across restarts: microseconds since the epoch.
pub(crate) fn fresh_seq() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
}

/// Unix seconds now, by this node's clock (off by [`crate::faults::clock_skew_secs`] in tests
/// of skewed clocks).
pub(crate) fn now_secs() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    now.saturating_add_signed(crate::faults::clock_skew_secs())
}

/// How far apart two honest nodes' clocks (and a record's trip to here) may put its expiry: a
/// record expired by less than this on arrival, or claiming a lifetime longer by less than
/// this, is dropped without holding it against the peer that passed it on.
pub const CLOCK_SKEW_ALLOWANCE_SECS: u64 = 60;

/// Whether a record that failed verification with `e` is held against the peer that passed it
/// on: not when it is merely not newer than what is known (it may have crossed a fresher one),
/// nor when its expiry is off by no more than [`CLOCK_SKEW_ALLOWANCE_SECS`] (clocks differ,
/// and a record may expire on its way); anything else, yes.
pub(crate) fn sender_at_fault(e: &RecordError) -> bool {
    match *e {
        RecordError::Stale { .. } => false,
        RecordError::Expired { expires_at, now } => {
            let late = now.saturating_sub(expires_at);
            let max_ttl = moeswarm_protocol::record::MAX_TTL_SECS;
            let early = expires_at.saturating_sub(now.saturating_add(max_ttl));
            late.max(early) > CLOCK_SKEW_ALLOWANCE_SECS
        }
        _ => true,
    }
}

/// Parses a record and checks it came from `source` (when known) and is newer than `last`.
pub(crate) fn verify_record<T: RecordBody>(
    wire: &[u8],
    source: Option<PeerId>,
    last_seq: impl Fn(&NodeKey) -> Option<u64>,
) -> Result<T, RecordError> {
    let signed = Signed::<T>::from_wire(wire)?;
    let claimed = signed.claimed_signer()?;
    if let Some(src) = source {
        if peer_id_of(&claimed) != Some(src) {
            return Err(RecordError::WrongSigner);
        }
    }
    signed.verify(Some(&claimed), last_seq(&claimed), now_secs())
}
