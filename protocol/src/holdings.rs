//! Holdings records: what a node holds of one model, signed by the node's ed25519 key.
//!
//! One record per node per model (not one per slab), so it fits a Kademlia record and a
//! gossipsub message: the slabs held as a bitmap per layer, free capacity, data-plane
//! addresses and how the node is reached, a sequence number and an expiry. The body has one
//! canonical encoding; the signature covers a domain tag and those bytes.
//! [`SignedHoldings::verify`] checks size, form, signature, signer, freshness and expiry.

use serde::{Deserialize, Serialize};

use crate::ids::ModelId;
use crate::limits::{MAX_EXPERTS, MAX_LAYERS};
pub use crate::record::{NodeKey, RecordBody, RecordError, Signed, MAX_RECORD_BYTES, MAX_TTL_SECS};

/// Most data-plane addresses in one record.
pub const MAX_ADDRS: usize = 8;
/// Longest address, in bytes.
pub const MAX_ADDR_BYTES: usize = 256;
/// The tag the signature covers before the body, so a holdings signature means nothing else.
pub const SIGNING_DOMAIN: &[u8] = b"moeswarm/holdings/v1\0";

/// How the router reaches a worker's data plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reach {
    /// At its own addresses.
    Direct,
    /// Only through this relay node.
    ViaRelay(NodeKey),
}

/// The experts of one layer a node holds: bit `e` of byte `e / 8` (LSB first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerBits(#[serde(with = "hexbytes")] pub Vec<u8>);

mod hexbytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&b.iter().map(|x| format!("{x:02x}")).collect::<String>())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        if s.len() % 2 != 0 || !s.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(serde::de::Error::custom("bitmap is not lowercase hex"));
        }
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(serde::de::Error::custom))
            .collect()
    }
}

impl LayerBits {
    /// No experts of `n_expert`.
    pub fn empty(n_expert: u32) -> Self {
        Self(vec![0; (n_expert as usize).div_ceil(8)])
    }

    /// Marks expert `e`.
    pub fn set(&mut self, e: u32) {
        if let Some(b) = self.0.get_mut(e as usize / 8) {
            *b |= 1 << (e % 8);
        }
    }

    /// Whether expert `e` is held.
    pub fn has(&self, e: u32) -> bool {
        self.0
            .get(e as usize / 8)
            .is_some_and(|b| b & (1 << (e % 8)) != 0)
    }

    /// The experts held, ascending.
    pub fn experts(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.0.len() as u32 * 8).filter(|&e| self.has(e))
    }
}

/// What one node holds of one model. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holdings {
    /// The model.
    pub model: ModelId,
    /// The node (the signer).
    pub node: NodeKey,
    /// Experts per layer (the manifest's shape).
    pub n_expert: u32,
    /// `layers[l]`: the experts of layer `l` held.
    pub layers: Vec<LayerBits>,
    /// Bytes of blobs the node holds now (of every model).
    pub used_bytes: u64,
    /// Bytes the node could still take.
    pub free_bytes: u64,
    /// Where the node is reached: data-plane addresses (`quic://127.0.0.1:4433`, or the
    /// relay's when reached through one) and libp2p multiaddrs (`/ip4/…/tcp/…`).
    pub addrs: Vec<String>,
    /// How it is reached.
    pub reach: Reach,
    /// Grows with every new record from this node.
    pub seq: u64,
    /// Unix seconds after which the record is void.
    pub expires_at: u64,
}

/// A holdings body and its signature, as it travels.
pub type SignedHoldings = Signed<Holdings>;

impl Holdings {
    fn check_shape(&self) -> Result<(), RecordError> {
        let bad = |m: String| Err(RecordError::Malformed(m));
        if self.n_expert == 0 || self.n_expert > MAX_EXPERTS {
            return bad(format!("n_expert {}", self.n_expert));
        }
        if self.layers.len() > MAX_LAYERS as usize {
            return bad(format!("{} layers", self.layers.len()));
        }
        let width = (self.n_expert as usize).div_ceil(8);
        for (l, bits) in self.layers.iter().enumerate() {
            if bits.0.len() != width {
                return bad(format!(
                    "layer {l} bitmap of {} bytes, want {width}",
                    bits.0.len()
                ));
            }
            let spare = width * 8 - self.n_expert as usize;
            if spare > 0 && bits.0[width - 1] >> (8 - spare) != 0 {
                return bad(format!("layer {l} marks experts past {}", self.n_expert));
            }
        }
        if self.addrs.len() > MAX_ADDRS || self.addrs.iter().any(|a| a.len() > MAX_ADDR_BYTES) {
            return bad("too many or too long addresses".into());
        }
        Ok(())
    }

    /// Every (layer, expert) held.
    pub fn slabs(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(l, bits)| bits.experts().map(move |e| (l as u32, e)))
    }
}

crate::record::record_body!(Holdings, SIGNING_DOMAIN, node);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::BlobId;
    use ed25519_dalek::{Signer, SigningKey};
    use proptest::prelude::*;

    const NOW: u64 = 1_800_000_000;

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn record(k: &SigningKey, seq: u64, held: &[(u32, u32)]) -> Holdings {
        let mut layers = vec![LayerBits::empty(256); 48];
        for &(l, e) in held {
            layers[l as usize].set(e);
        }
        Holdings {
            model: ModelId(BlobId::of(b"model")),
            node: NodeKey(k.verifying_key().to_bytes()),
            n_expert: 256,
            layers,
            used_bytes: 1 << 20,
            free_bytes: 1 << 30,
            addrs: vec!["quic://127.0.0.1:4433".into()],
            reach: Reach::Direct,
            seq,
            expires_at: NOW + 3600,
        }
    }

    #[test]
    fn a_full_target_record_fits_the_limit() {
        let k = key(1);
        let all: Vec<(u32, u32)> = (0..48)
            .flat_map(|l| (0..256).map(move |e| (l, e)))
            .collect();
        let s = record(&k, 1, &all).sign(&k);
        assert!(
            s.to_wire().len() <= MAX_RECORD_BYTES,
            "{}",
            s.to_wire().len()
        );
        let h = s.verify(None, None, NOW).unwrap();
        assert_eq!(h.slabs().count(), 48 * 256);
    }

    #[test]
    fn forged_replayed_stale_expired_and_oversized_records_are_refused() {
        let (k, other) = (key(1), key(2));
        let h = record(&k, 5, &[(0, 3), (47, 255)]);
        let good = h.sign(&k);
        let me = NodeKey(k.verifying_key().to_bytes());
        assert_eq!(good.verify(Some(&me), Some(4), NOW).unwrap(), h);
        // Signed by another key but naming this node: forged.
        let sig = other
            .sign(&[SIGNING_DOMAIN, &good.body].concat())
            .to_bytes();
        let forged = SignedHoldings::from_parts(good.body.clone(), sig);
        assert_eq!(
            forged.verify(None, None, NOW),
            Err(RecordError::BadSignature)
        );
        // Sent by a peer other than the signer.
        let them = NodeKey(other.verifying_key().to_bytes());
        assert_eq!(
            good.verify(Some(&them), None, NOW),
            Err(RecordError::WrongSigner)
        );
        // Replayed.
        assert_eq!(
            good.verify(None, Some(5), NOW),
            Err(RecordError::Stale { seq: 5, last: 5 })
        );
        // Expired, or claiming too long a life.
        assert!(matches!(
            good.verify(None, None, NOW + 3600),
            Err(RecordError::Expired { .. })
        ));
        let mut long = h.clone();
        long.expires_at = NOW + MAX_TTL_SECS + 1;
        assert!(matches!(
            long.sign(&k).verify(None, None, NOW),
            Err(RecordError::Expired { .. })
        ));
        // Oversized.
        let huge = vec![0u8; MAX_RECORD_BYTES + 1];
        assert_eq!(
            SignedHoldings::from_wire(&huge),
            Err(RecordError::Oversized(huge.len()))
        );
        // Bits past n_expert.
        let mut odd = h.clone();
        odd.n_expert = 250;
        odd.layers = vec![LayerBits(vec![0xff; 32]); 48];
        assert!(matches!(
            odd.sign(&k).verify(None, None, NOW),
            Err(RecordError::Malformed(_))
        ));
    }

    proptest! {
        #[test]
        fn any_changed_byte_breaks_the_record(pos in 0usize..4000, flip in 1u8..=255) {
            let k = key(7);
            let wire = record(&k, 1, &[(1, 2), (3, 4)]).sign(&k).to_wire();
            let mut bad = wire.clone();
            let i = pos % bad.len();
            bad[i] ^= flip;
            let parsed = SignedHoldings::from_wire(&bad).unwrap();
            prop_assert!(parsed.verify(None, None, NOW).is_err());
        }

        #[test]
        fn bitmaps_round_trip(held in proptest::collection::btree_set((0u32..48, 0u32..256), 0..200)) {
            let k = key(3);
            let held: Vec<_> = held.into_iter().collect();
            let h = record(&k, 9, &held).sign(&k).verify(None, None, NOW).unwrap();
            prop_assert_eq!(h.slabs().collect::<Vec<_>>(), held);
        }
    }
}
