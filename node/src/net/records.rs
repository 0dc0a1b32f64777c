//! Names and checks of holdings records as the swarm carries them: gossip topics, DHT keys,
//! and verification against the peer a record came from.

use std::time::{SystemTime, UNIX_EPOCH};

use libp2p::kad::RecordKey;
use libp2p::{gossipsub, PeerId};
use moeswarm_protocol::{Holdings, ModelId, NodeKey, RecordError, SignedHoldings};

use super::identity::peer_id_of;

pub(crate) fn topic(model: &ModelId) -> gossipsub::IdentTopic {
    gossipsub::IdentTopic::new(format!("/moeswarm/holdings/{model}"))
}

/// The DHT key of a model: its providers are the nodes that serve its manifest.
pub fn model_key(model: &ModelId) -> RecordKey {
    RecordKey::new(&[b"/moeswarm/model/".as_slice(), &model.0 .0].concat())
}

/// The DHT key of one node's holdings record of one model.
pub fn holdings_key(model: &ModelId, node: &NodeKey) -> RecordKey {
    RecordKey::new(&[b"/moeswarm/holdings/".as_slice(), &model.0 .0, &node.0].concat())
}

pub(crate) fn parse_holdings_key(key: &RecordKey) -> Option<(ModelId, NodeKey)> {
    let rest = key
        .as_ref()
        .strip_prefix(b"/moeswarm/holdings/".as_slice())?;
    if rest.len() != 64 {
        return None;
    }
    let model = ModelId(moeswarm_protocol::BlobId(rest[..32].try_into().ok()?));
    Some((model, NodeKey(rest[32..].try_into().ok()?)))
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(crate) fn refusal_reason(e: &RecordError) -> &'static str {
    match e {
        RecordError::Oversized(_) => "oversized",
        RecordError::Malformed(_) => "malformed",
        RecordError::BadSignature => "bad_signature",
        RecordError::WrongSigner => "wrong_signer",
        RecordError::Stale { .. } => "stale",
        RecordError::Expired { .. } => "expired",
    }
}

/// Parses a record and checks it came from `source` (when known) and is newer than `last`.
pub(crate) fn verify_record(
    wire: &[u8],
    source: Option<PeerId>,
    last_seq: impl Fn(&NodeKey) -> Option<u64>,
) -> Result<Holdings, RecordError> {
    let signed = SignedHoldings::from_wire(wire)?;
    let claimed = serde_json::from_slice::<Holdings>(&signed.body)
        .map_err(|e| RecordError::Malformed(e.to_string()))?
        .node;
    if let Some(src) = source {
        if peer_id_of(&claimed) != Some(src) {
            return Err(RecordError::WrongSigner);
        }
    }
    signed.verify(Some(&claimed), last_seq(&claimed), now_secs())
}
