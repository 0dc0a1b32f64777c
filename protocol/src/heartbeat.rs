//! Heartbeats: a node's small signed word that it is still up, sent often, so others count
//! its holdings only while it lives.
//!
//! A holdings record lives for an hour; a heartbeat says "still here" every
//! [`HEARTBEAT_PERIOD_SECS`] in under 200 bytes, whatever the node holds. Only the signer can
//! make one (it is signed like any record) and its sequence only grows, so a peer can neither
//! keep another node alive by forging nor revive it with an old one; nobody can declare
//! another node dead, since death is only the absence of its heartbeats. A receiver judges
//! liveness by its own clock from when it heard the heartbeat ([`LIVE_FOR_SECS`]): the
//! sender's timestamps only bound the record's validity, so a node whose clock is off by
//! minutes is still counted right.

use serde::{Deserialize, Serialize};

use crate::record::{NodeKey, RecordError};

/// The tag the signature covers before the body.
pub const HEARTBEAT_SIGNING_DOMAIN: &[u8] = b"moeswarm/heartbeat/v1\0";
/// How often a node says it is up.
pub const HEARTBEAT_PERIOD_SECS: u64 = 10;
/// How long, by the receiver's clock, a node counts as live after its last heartbeat: three
/// periods and a half, so one or two lost heartbeats or a pause of tens of seconds changes
/// nothing, and a crash is noticed within 35 s.
pub const LIVE_FOR_SECS: u64 = 35;
/// How long a heartbeat stays valid by the sender's clock: long enough that a sender whose
/// clock is minutes behind is not refused as expired.
pub const HEARTBEAT_VALID_SECS: u64 = 900;

/// A node's word that it is up. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// The node (the signer).
    pub node: NodeKey,
    /// Grows with every heartbeat (microseconds since the epoch at the sender).
    pub seq: u64,
    /// Unix seconds (sender's clock) after which it is void.
    pub expires_at: u64,
}

impl Heartbeat {
    fn check_shape(&self) -> Result<(), RecordError> {
        Ok(())
    }
}

crate::record::record_body!(Heartbeat, HEARTBEAT_SIGNING_DOMAIN, node);

/// A heartbeat as it travels.
pub type SignedHeartbeat = crate::record::Signed<Heartbeat>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RecordBody;
    use ed25519_dalek::SigningKey;

    fn key(b: u8) -> SigningKey {
        SigningKey::from_bytes(&[b; 32])
    }

    fn beat(k: &SigningKey, seq: u64, expires_at: u64) -> SignedHeartbeat {
        Heartbeat {
            node: NodeKey(k.verifying_key().to_bytes()),
            seq,
            expires_at,
        }
        .sign(k)
    }

    #[test]
    fn only_the_signer_can_say_it_lives_and_only_forward() {
        let (a, b) = (key(1), key(2));
        let ak = NodeKey(a.verifying_key().to_bytes());
        let h = beat(&a, 5, 1_000);
        assert_eq!(h.verify(Some(&ak), Some(4), 100).unwrap().seq, 5);
        assert!(h.to_wire().len() < 200);
        // Replayed: not newer than the last heard.
        assert!(matches!(
            h.verify(Some(&ak), Some(5), 100),
            Err(RecordError::Stale { .. })
        ));
        // Forged: b signs a heartbeat naming a.
        let mut forged = Heartbeat {
            node: ak,
            seq: 6,
            expires_at: 1_000,
        }
        .sign(&a);
        forged.signature = beat(&b, 6, 1_000).signature;
        assert!(matches!(
            forged.verify(None, Some(5), 100),
            Err(RecordError::BadSignature)
        ));
        // Sent by another node than its signer.
        let bk = NodeKey(b.verifying_key().to_bytes());
        assert!(matches!(
            h.verify(Some(&bk), None, 100),
            Err(RecordError::WrongSigner)
        ));
    }
}
