//! Demand records: how many token rows a router sent to each slab of a model over a recent
//! window, signed by the router.
//!
//! Nodes merge the demand of every router to decide which slabs deserve more replicas. One
//! record per router per model, so it fits a Kademlia record and a gossipsub message: the
//! hottest [`MAX_DEMAND_ENTRIES`] slabs with their exact row counts (ascending by layer, then
//! expert), and the total over every slab, so a reader knows the share of the unlisted ones
//! together. For the target model (48 × 256 slabs, 8 experts a token) that is one token's worth
//! of slabs: the hot ones are named exactly and the cold tail shares the rest.

use serde::{Deserialize, Serialize};

use crate::ids::ModelId;
use crate::limits::{MAX_EXPERTS, MAX_LAYERS};
use crate::record::{NodeKey, RecordError, Signed, MAX_TTL_SECS};

/// The tag the signature covers before the body.
pub const DEMAND_SIGNING_DOMAIN: &[u8] = b"moeswarm/demand/v1\0";
/// Most slabs one record names.
pub const MAX_DEMAND_ENTRIES: usize = 384;

/// One slab's rows: `(layer, expert, rows)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DemandEntry(pub u32, pub u32, pub u32);

/// What one router dispatched of one model. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Demand {
    /// The model.
    pub model: ModelId,
    /// The router (the signer).
    pub router: NodeKey,
    /// Layers of the model.
    pub n_layer: u32,
    /// Experts per layer.
    pub n_expert: u32,
    /// Seconds the counts cover, ending at `issued_at`.
    pub window_secs: u64,
    /// Rows sent to every slab in the window, listed or not.
    pub total_rows: u64,
    /// The hottest slabs, ascending by (layer, expert), each with rows > 0.
    pub slabs: Vec<DemandEntry>,
    /// Unix seconds the counts were taken.
    pub issued_at: u64,
    /// Grows with every new record from this router.
    pub seq: u64,
    /// Unix seconds after which the record is void.
    pub expires_at: u64,
}

/// A demand body and its signature, as it travels.
pub type SignedDemand = Signed<Demand>;

impl Demand {
    /// The entries of a full count table `counts[layer][expert]`: the hottest
    /// [`MAX_DEMAND_ENTRIES`] (ties to the lower layer, then expert), ascending, and the total
    /// of all of them (saturating).
    pub fn entries_of(counts: &[Vec<u64>]) -> (Vec<DemandEntry>, u64) {
        let mut all: Vec<DemandEntry> = Vec::new();
        let mut total = 0u64;
        for (l, row) in counts.iter().enumerate() {
            for (e, &n) in row.iter().enumerate() {
                total = total.saturating_add(n);
                if n > 0 {
                    all.push(DemandEntry(
                        l as u32,
                        e as u32,
                        n.min(u32::MAX as u64) as u32,
                    ));
                }
            }
        }
        all.sort_by(|a, b| b.2.cmp(&a.2).then((a.0, a.1).cmp(&(b.0, b.1))));
        all.truncate(MAX_DEMAND_ENTRIES);
        all.sort_by_key(|d| (d.0, d.1));
        (all, total)
    }

    fn check_shape(&self) -> Result<(), RecordError> {
        let bad = |m: String| Err(RecordError::Malformed(m));
        if self.n_expert == 0 || self.n_expert > MAX_EXPERTS {
            return bad(format!("n_expert {}", self.n_expert));
        }
        if self.n_layer == 0 || self.n_layer > MAX_LAYERS {
            return bad(format!("n_layer {}", self.n_layer));
        }
        if self.slabs.len() > MAX_DEMAND_ENTRIES {
            return bad(format!(
                "{} slabs named, at most {MAX_DEMAND_ENTRIES}",
                self.slabs.len()
            ));
        }
        if self.window_secs == 0 || self.window_secs > MAX_TTL_SECS {
            return bad(format!("window of {} s", self.window_secs));
        }
        if self.issued_at > self.expires_at {
            return bad("issued after it expires".into());
        }
        let mut listed = 0u64;
        let mut last: Option<(u32, u32)> = None;
        for d in &self.slabs {
            if d.0 >= self.n_layer || d.1 >= self.n_expert {
                return bad(format!("slab {}/{} is outside the model", d.0, d.1));
            }
            if d.2 == 0 {
                return bad(format!("slab {}/{} listed with no rows", d.0, d.1));
            }
            if last.is_some_and(|p| p >= (d.0, d.1)) {
                return bad("slabs not strictly ascending".into());
            }
            last = Some((d.0, d.1));
            listed += d.2 as u64;
        }
        if listed > self.total_rows {
            return bad(format!(
                "{listed} rows listed but a total of {}",
                self.total_rows
            ));
        }
        Ok(())
    }
}

crate::record::record_body!(Demand, DEMAND_SIGNING_DOMAIN, router);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::holdings::SignedHoldings;
    use crate::ids::BlobId;
    use crate::record::RecordBody;
    use crate::record::MAX_RECORD_BYTES;
    use ed25519_dalek::SigningKey;
    use proptest::prelude::*;

    const NOW: u64 = 1_800_000_000;

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn demand(k: &SigningKey, seq: u64, counts: &[Vec<u64>]) -> Demand {
        let (slabs, total_rows) = Demand::entries_of(counts);
        Demand {
            model: ModelId(BlobId::of(b"model")),
            router: NodeKey(k.verifying_key().to_bytes()),
            n_layer: counts.len() as u32,
            n_expert: counts[0].len() as u32,
            window_secs: 60,
            total_rows,
            slabs,
            issued_at: NOW,
            seq,
            expires_at: NOW + 120,
        }
    }

    #[test]
    fn a_record_of_the_target_model_at_its_largest_fits_the_limit() {
        let k = key(1);
        // Every count at its widest, on the highest layers and experts a record may name.
        let counts = vec![vec![u32::MAX as u64; 4096]; 1024];
        let mut d = demand(&k, u64::MAX, &counts);
        d.total_rows = u64::MAX;
        d.slabs = (0..MAX_DEMAND_ENTRIES as u32)
            .map(|i| DemandEntry(1023, 4095 - MAX_DEMAND_ENTRIES as u32 + 1 + i, u32::MAX))
            .collect();
        d.expires_at = u64::MAX;
        d.issued_at = u64::MAX;
        let wire = d.sign(&k).to_wire();
        assert!(wire.len() <= MAX_RECORD_BYTES, "{}", wire.len());
    }

    #[test]
    fn the_hottest_slabs_are_listed_and_the_total_counts_them_all() {
        let mut counts = vec![vec![1u64; 256]; 48];
        counts[3][7] = 500;
        counts[47][0] = 400;
        let (slabs, total) = Demand::entries_of(&counts);
        assert_eq!(slabs.len(), MAX_DEMAND_ENTRIES);
        assert_eq!(total, 48 * 256 - 2 + 900);
        assert!(slabs.contains(&DemandEntry(3, 7, 500)));
        assert!(slabs.contains(&DemandEntry(47, 0, 400)));
        let k = key(2);
        let d = demand(&k, 1, &counts);
        assert_eq!(d.sign(&k).verify(None, None, NOW).unwrap(), d);
    }

    #[test]
    fn forged_replayed_malformed_and_cross_kind_records_are_refused() {
        let (k, other) = (key(1), key(2));
        let mut counts = vec![vec![0u64; 16]; 3];
        counts[1][2] = 9;
        let d = demand(&k, 5, &counts);
        let good = d.sign(&k);
        let me = NodeKey(k.verifying_key().to_bytes());
        assert_eq!(good.verify(Some(&me), Some(4), NOW).unwrap(), d);
        let them = NodeKey(other.verifying_key().to_bytes());
        assert_eq!(
            good.verify(Some(&them), None, NOW),
            Err(RecordError::WrongSigner)
        );
        assert_eq!(
            good.verify(None, Some(5), NOW),
            Err(RecordError::Stale { seq: 5, last: 5 })
        );
        assert!(matches!(
            good.verify(None, None, NOW + 120),
            Err(RecordError::Expired { .. })
        ));
        // Signed by another key but naming this router.
        let forged = SignedDemand::from_parts(good.body.clone(), sign_raw(&other, &good.body));
        assert_eq!(
            forged.verify(None, None, NOW),
            Err(RecordError::BadSignature)
        );
        // A demand signature does not make a holdings record, even with the same bytes.
        let as_holdings = SignedHoldings::from_parts(good.body.clone(), good.signature);
        assert!(as_holdings.verify(None, None, NOW).is_err());
        // Bodies that break the shape rules.
        let mut bad = vec![];
        let mut x = d.clone();
        x.slabs = vec![DemandEntry(1, 2, 3), DemandEntry(1, 2, 3)];
        bad.push(x);
        let mut x = d.clone();
        x.slabs = vec![DemandEntry(3, 0, 1)];
        bad.push(x);
        let mut x = d.clone();
        x.total_rows = 1;
        bad.push(x);
        let mut x = d.clone();
        x.slabs = vec![DemandEntry(0, 0, 0)];
        bad.push(x);
        let mut x = d.clone();
        x.window_secs = 0;
        bad.push(x);
        for x in bad {
            assert!(
                matches!(
                    x.sign(&k).verify(None, None, NOW),
                    Err(RecordError::Malformed(_))
                ),
                "{x:?}"
            );
        }
        let huge = vec![0u8; MAX_RECORD_BYTES + 1];
        assert_eq!(
            SignedDemand::from_wire(&huge),
            Err(RecordError::Oversized(huge.len()))
        );
    }

    fn sign_raw(k: &SigningKey, body: &[u8]) -> [u8; 64] {
        use ed25519_dalek::Signer;
        k.sign(&[DEMAND_SIGNING_DOMAIN, body].concat()).to_bytes()
    }

    proptest! {
        #[test]
        fn counts_round_trip_and_any_changed_byte_breaks_the_record(
            cells in proptest::collection::vec((0usize..4, 0usize..32, 1u64..10_000), 0..60),
            pos in 0usize..4000, flip in 1u8..=255,
        ) {
            let mut counts = vec![vec![0u64; 32]; 4];
            for (l, e, n) in cells {
                counts[l][e] = n;
            }
            let k = key(7);
            let d = demand(&k, 1, &counts);
            let got = d.sign(&k).verify(None, None, NOW).unwrap();
            for DemandEntry(l, e, n) in &got.slabs {
                prop_assert_eq!(counts[*l as usize][*e as usize], *n as u64);
            }
            let listed = got.slabs.len();
            prop_assert_eq!(listed, counts.iter().flatten().filter(|&&n| n > 0).count());
            let mut wire = d.sign(&k).to_wire();
            let i = pos % wire.len();
            wire[i] ^= flip;
            let parsed = SignedDemand::from_wire(&wire).unwrap();
            prop_assert!(parsed.verify(None, None, NOW).is_err());
        }
    }
}
