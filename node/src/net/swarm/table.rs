//! The records a node keeps, one [`RecordTable`] per record kind and model: the book the
//! market reads ([`CoverageMap`] for holdings, [`DemandBook`] for demand), each signer's record
//! as it came on the wire (handed on to askers, page by page), and when each signer was first
//! taken in (its standing when a full table must choose whom to keep).
//!
//! Bookkeeping only: what to admit into a full table, liveness and counting are the swarm
//! task's ([`super::inbound`]).

use std::collections::{BTreeMap, HashMap};

use libp2p::PeerId;
use moeswarm_market::coverage::{CoverageMap, Refusal};
use moeswarm_market::demand::DemandBook;
use moeswarm_protocol::exchange::MAX_RECORDS_PER_RESPONSE;
use moeswarm_protocol::{Demand, Holdings, NodeKey, RecordBody, RecordError};

use crate::net::records::verify_record;

/// What the market keeps of one kind of record: applied one at a time, by signer.
pub(super) trait Book {
    /// The record kind.
    type Body: RecordBody;
    /// Applies a verified record at `now` (unix seconds).
    fn apply(&mut self, body: Self::Body, now: u64) -> Result<(), Refusal>;
    /// The last sequence applied from `signer`.
    fn last_seq(&self, signer: &NodeKey) -> Option<u64>;
    /// Drops what has expired at `now`.
    fn expire(&mut self, now: u64);
    /// Forgets `signer`'s record.
    fn remove(&mut self, signer: &NodeKey);
    /// How many signers' records are held.
    fn len(&self) -> usize;
}

impl Book for CoverageMap {
    type Body = Holdings;
    fn apply(&mut self, body: Holdings, now: u64) -> Result<(), Refusal> {
        CoverageMap::apply(self, body, now)
    }
    fn last_seq(&self, signer: &NodeKey) -> Option<u64> {
        CoverageMap::last_seq(self, signer)
    }
    fn expire(&mut self, now: u64) {
        CoverageMap::expire(self, now);
    }
    fn remove(&mut self, signer: &NodeKey) {
        CoverageMap::remove(self, signer);
    }
    fn len(&self) -> usize {
        CoverageMap::len(self)
    }
}

impl Book for DemandBook {
    type Body = Demand;
    fn apply(&mut self, body: Demand, now: u64) -> Result<(), Refusal> {
        DemandBook::apply(self, body, now)
    }
    fn last_seq(&self, signer: &NodeKey) -> Option<u64> {
        DemandBook::last_seq(self, signer)
    }
    fn expire(&mut self, now: u64) {
        DemandBook::expire(self, now);
    }
    fn remove(&mut self, signer: &NodeKey) {
        DemandBook::remove(self, signer);
    }
    fn len(&self) -> usize {
        DemandBook::len(self)
    }
}

/// One model's records of one kind.
pub(super) struct RecordTable<B: Book> {
    book: B,
    /// Each signer's record as it came: what askers are handed.
    wire: BTreeMap<NodeKey, Vec<u8>>,
    /// When each signer's record was first taken in (unix seconds).
    first_seen: HashMap<NodeKey, u64>,
}

impl<B: Book> RecordTable<B> {
    pub(super) fn new(book: B) -> Self {
        Self {
            book,
            wire: BTreeMap::new(),
            first_seen: HashMap::new(),
        }
    }

    /// The market's view of the records.
    pub(super) fn book(&self) -> &B {
        &self.book
    }

    /// Parses `wire` and checks its signature, that it came from `source` (when known) and
    /// that it is newer than the signer's record held.
    pub(super) fn verify(
        &self,
        wire: &[u8],
        source: Option<PeerId>,
    ) -> Result<B::Body, RecordError> {
        verify_record::<B::Body>(wire, source, |k| self.book.last_seq(k))
    }

    /// Applies a verified record `body`, which came as `wire`, at `now`.
    pub(super) fn apply(&mut self, body: B::Body, wire: &[u8], now: u64) -> Result<(), Refusal> {
        let signer = body.signer();
        self.book.apply(body, now)?;
        self.wire.insert(signer, wire.to_vec());
        self.first_seen.entry(signer).or_insert(now);
        self.follow_book();
        Ok(())
    }

    /// Lets go of the records expired at `now`.
    pub(super) fn expire(&mut self, now: u64) {
        self.book.expire(now);
        self.follow_book();
    }

    /// Forgets `signer`'s record (its place went to another).
    pub(super) fn remove(&mut self, signer: &NodeKey) {
        self.book.remove(signer);
        self.follow_book();
    }

    /// Whether `signer` has a record here.
    pub(super) fn holds(&self, signer: &NodeKey) -> bool {
        self.book.last_seq(signer).is_some()
    }

    /// How many signers have a record here.
    pub(super) fn len(&self) -> usize {
        self.book.len()
    }

    /// Each signer with a record here, and when it was first taken in.
    pub(super) fn signers(&self) -> impl Iterator<Item = (NodeKey, u64)> + '_ {
        self.wire
            .keys()
            .map(|k| (*k, self.first_seen.get(k).copied().unwrap_or(0)))
    }

    /// One page of the records as they came: those whose signers follow `after` and pass
    /// `counts`, at most [`MAX_RECORDS_PER_RESPONSE`] of them, and whether more follow.
    pub(super) fn page(
        &self,
        after: Option<NodeKey>,
        counts: impl Fn(&NodeKey) -> bool,
    ) -> (Vec<Vec<u8>>, bool) {
        use std::ops::Bound;
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        let mut it = self
            .wire
            .range((from, Bound::Unbounded))
            .filter(|(k, _)| counts(k));
        let out: Vec<Vec<u8>> = it
            .by_ref()
            .take(MAX_RECORDS_PER_RESPONSE)
            .map(|(_, w)| w.clone())
            .collect();
        (out, it.next().is_some())
    }

    /// Keeps the wire forms and first sightings to the signers the book holds (it may have
    /// dropped some: expired, or over its bound).
    fn follow_book(&mut self) {
        if self.wire.len() != self.book.len() {
            let book = &self.book;
            self.wire.retain(|k, _| book.last_seq(k).is_some());
        }
        if self.first_seen.len() > self.wire.len() {
            let wire = &self.wire;
            self.first_seen.retain(|k, _| wire.contains_key(k));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeswarm_protocol::{ModelId, Signed};

    fn key(seed: u8) -> ed25519_dalek::SigningKey {
        ed25519_dalek::SigningKey::from_bytes(&[seed; 32])
    }

    const MODEL: ModelId = ModelId(moeswarm_protocol::BlobId([7; 32]));

    fn demand(seed: u8, seq: u64, issued_at: u64, expires_at: u64) -> Signed<Demand> {
        let k = key(seed);
        Demand {
            model: MODEL,
            router: NodeKey(k.verifying_key().to_bytes()),
            n_layer: 1,
            n_expert: 2,
            window_secs: 60,
            total_rows: 0,
            slabs: Vec::new(),
            issued_at,
            seq,
            expires_at,
        }
        .sign(&k)
    }

    fn signer(seed: u8) -> NodeKey {
        NodeKey(key(seed).verifying_key().to_bytes())
    }

    #[test]
    fn a_table_hands_out_each_signers_newest_record_as_it_came_until_it_expires() {
        let now = crate::net::records::now_secs();
        let mut t = RecordTable::new(DemandBook::new(MODEL, 1, 2));
        let old = demand(1, 1, now, now + 100).to_wire();
        let new = demand(1, 2, now, now + 100).to_wire();
        let short = demand(2, 1, now, now + 5).to_wire();
        for w in [&old, &new, &short] {
            let body = t.verify(w, None).unwrap();
            t.apply(body, w, now).unwrap();
        }
        // The older record of signer 1 no longer verifies: it is not newer.
        assert!(matches!(
            t.verify(&old, None),
            Err(RecordError::Stale { .. })
        ));
        assert_eq!(t.len(), 2);
        let (page, more) = t.page(None, |_| true);
        assert!(!more);
        assert_eq!(page.len(), 2);
        assert!(page.contains(&new) && page.contains(&short) && !page.contains(&old));
        assert!(t.signers().all(|(_, first)| first == now));

        t.expire(now + 10);
        assert!(!t.holds(&signer(2)) && t.holds(&signer(1)));
        assert_eq!(t.page(None, |_| true).0, vec![new.clone()]);
        t.remove(&signer(1));
        assert_eq!(t.len(), 0);
        assert!(t.page(None, |_| true).0.is_empty());
        assert_eq!(t.signers().count(), 0);
    }

    #[test]
    fn pages_follow_the_signers_order_and_skip_those_that_do_not_count() {
        let now = crate::net::records::now_secs();
        let mut t = RecordTable::new(DemandBook::new(MODEL, 1, 2));
        for seed in 1..=5 {
            let w = demand(seed, 1, now, now + 100).to_wire();
            let body = t.verify(&w, None).unwrap();
            t.apply(body, &w, now).unwrap();
        }
        let mut keys: Vec<NodeKey> = (1..=5).map(signer).collect();
        keys.sort();
        let skipped = keys[1];
        let (page, more) = t.page(Some(keys[0]), |k| *k != skipped);
        assert!(!more);
        assert_eq!(page.len(), 3);
        let signers: Vec<NodeKey> = page
            .iter()
            .map(|w| {
                Signed::<Demand>::from_wire(w)
                    .unwrap()
                    .claimed_signer()
                    .unwrap()
            })
            .collect();
        assert_eq!(signers, keys[2..].to_vec());
    }
}
