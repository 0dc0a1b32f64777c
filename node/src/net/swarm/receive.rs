//! Records arriving at the swarm task (gossip, answers to record pages, this node's own
//! publications): verified against the table of their kind and model, admitted to a full
//! holdings table by standing, applied, counted. What gossip should do with each follows from
//! how it ended: forward what was taken in, drop what is merely stale or over a bound, hold
//! against its forwarder what does not verify.
//!
//! The tables themselves are [`super::table`]; DHT puts are checked in [`super::inbound`].

use libp2p::gossipsub::MessageAcceptance;
use libp2p::{Multiaddr, PeerId};
use moeswarm_protocol::{Holdings, ModelId, NodeKey, RecordError};

use super::table::{Book, RecordTable};
use super::{State, MAX_NODES_PER_MODEL};
use crate::net::identity::peer_id_of;
use crate::net::records::{now_secs, sender_at_fault, RecordKind};
use crate::net::stats::RecordRefusal;

/// What gossip does with a record that failed verification: dropped quietly when the peer
/// that forwarded it is not at fault ([`sender_at_fault`]: merely not newer, or an expiry off
/// by clock skew), held against it otherwise.
pub(super) fn verdict_of(e: &RecordError) -> MessageAcceptance {
    if sender_at_fault(e) {
        MessageAcceptance::Reject
    } else {
        MessageAcceptance::Ignore
    }
}

/// How one record ended here.
enum Received {
    /// Taken in: forwarded.
    Applied,
    /// Not taken in, for this reason; what gossip does with it.
    Refused(RecordRefusal, MessageAcceptance),
    /// A model this node does not follow.
    Unfollowed,
}

/// Verifies `wire` against `table` and applies it.
fn take_in<B: Book>(table: &mut RecordTable<B>, source: Option<PeerId>, wire: &[u8]) -> Received {
    match table.verify(wire, source) {
        Ok(body) => apply_to(table, body, wire),
        Err(e) => Received::Refused(RecordRefusal::from(&e), verdict_of(&e)),
    }
}

/// Applies a verified record `body`, which came as `wire`.
fn apply_to<B: Book>(table: &mut RecordTable<B>, body: B::Body, wire: &[u8]) -> Received {
    match table.apply(body, wire, now_secs()) {
        Ok(()) => Received::Applied,
        Err(r) => Received::Refused(RecordRefusal::from(r), MessageAcceptance::Ignore),
    }
}

impl State {
    /// Counts a record refused.
    pub(super) fn refuse(&mut self, e: &RecordError) {
        *self
            .stats
            .records_refused
            .entry(RecordRefusal::from(e))
            .or_default() += 1;
    }

    /// Verifies a record of `kind` as coming from `source` (this node's own, or one vetted,
    /// when `None`) and applies it; what gossip should do with it.
    pub(super) fn receive(
        &mut self,
        kind: RecordKind,
        model: ModelId,
        source: Option<PeerId>,
        wire: &[u8],
    ) -> MessageAcceptance {
        let received = match kind {
            RecordKind::Holdings => self.receive_holdings(model, source, wire),
            RecordKind::Demand => match self.demand.get_mut(&model) {
                Some(table) => take_in(table, source, wire),
                None => Received::Unfollowed,
            },
        };
        let (applied, refused) = match kind {
            RecordKind::Holdings => (
                &mut self.stats.records_applied,
                &mut self.stats.records_refused,
            ),
            RecordKind::Demand => (
                &mut self.stats.demand_applied,
                &mut self.stats.demand_refused,
            ),
        };
        match received {
            Received::Applied => {
                *applied += 1;
                MessageAcceptance::Accept
            }
            Received::Refused(why, verdict) => {
                *refused.entry(why).or_default() += 1;
                verdict
            }
            Received::Unfollowed => MessageAcceptance::Ignore,
        }
    }

    /// A holdings record: a full table takes in a new signer only in place of one of lower
    /// standing, or once a dial has proved a stranger's key; a signer taken in gets a window
    /// to be heard ([`super::liveness`]).
    fn receive_holdings(
        &mut self,
        model: ModelId,
        source: Option<PeerId>,
        wire: &[u8],
    ) -> Received {
        let Some(table) = self.holdings.get(&model) else {
            return Received::Unfollowed;
        };
        let body = match table.verify(wire, source) {
            Ok(body) => body,
            Err(e) => return Received::Refused(RecordRefusal::from(&e), verdict_of(&e)),
        };
        let node = body.node;
        if table.len() >= MAX_NODES_PER_MODEL
            && !table.holds(&node)
            && !self.make_room(model, &node)
        {
            let why = if self.met.contains_key(&node) {
                RecordRefusal::TooManyNodes
            } else {
                self.wait_for_a_dial(model, &body, wire)
            };
            return Received::Refused(why, MessageAcceptance::Ignore);
        }
        let Some(table) = self.holdings.get_mut(&model) else {
            return Received::Unfollowed;
        };
        let received = apply_to(table, body, wire);
        if matches!(received, Received::Applied) {
            self.liveness.noticed(node, std::time::Instant::now());
        }
        received
    }

    /// Makes room in `model`'s full table for a record of `newcomer`, dropping the record of
    /// the lowest standing ([`moeswarm_market::table`]) if the newcomer stands above it.
    fn make_room(&mut self, model: ModelId, newcomer: &NodeKey) -> bool {
        use moeswarm_market::table::{evict_for, Standing};
        // A stranger, newest of all, never stands above a record kept: refused without a scan
        // of the table (a flood of made-up records costs one lookup each).
        if !self.met.contains_key(newcomer) {
            return false;
        }
        let at = std::time::Instant::now();
        let standing = |k: &NodeKey, first_seen: u64| Standing {
            met: self.met.contains_key(k),
            useful: self.met.get(k).map_or(0, |m| m.useful),
            // Strikes against the signer as a peer (its bad records and answers), banned
            // lowest of all.
            strikes: peer_id_of(k).map_or(0, |p| self.bans.strikes(&p, at)),
            first_seen,
        };
        let Some(table) = self.holdings.get(&model) else {
            return false;
        };
        let victim = evict_for(
            table.signers().map(|(k, first)| (k, standing(&k, first))),
            standing(newcomer, now_secs()),
        );
        let Some(victim) = victim else {
            return false;
        };
        if let Some(t) = self.holdings.get_mut(&model) {
            t.remove(&victim);
        }
        *self
            .stats
            .records_refused
            .entry(RecordRefusal::EvictedForABetterStanding)
            .or_default() += 1;
        true
    }

    /// A stranger's record `h` (as `wire`) that found the table full: it waits for a dial to
    /// the addresses it gives ([`super::vetting`]); what to count it as.
    fn wait_for_a_dial(&mut self, model: ModelId, h: &Holdings, wire: &[u8]) -> RecordRefusal {
        use super::vetting::Offer;
        let Some(peer) = peer_id_of(&h.node) else {
            return RecordRefusal::TooManyNodes;
        };
        let addrs = h
            .addrs
            .iter()
            .filter(|a| a.starts_with('/'))
            .filter_map(|a| a.parse::<Multiaddr>().ok())
            .collect();
        let now = std::time::Instant::now();
        match self
            .vetting
            .offer(peer, model, wire.to_vec(), addrs, now, &mut self.rng)
        {
            Offer::Queued => {
                self.vet();
                RecordRefusal::WaitingForADial
            }
            Offer::Refused => RecordRefusal::TooManyNodes,
        }
    }

    /// Lets go of `model`'s holdings records that have expired (kept while valid; only live
    /// holders' are handed out).
    pub(super) fn expire_records(&mut self, model: &ModelId) {
        if let Some(t) = self.holdings.get_mut(model) {
            t.expire(now_secs());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::records::CLOCK_SKEW_ALLOWANCE_SECS;
    use moeswarm_protocol::record::MAX_TTL_SECS;

    #[test]
    fn an_expiry_off_by_clock_skew_is_dropped_quietly_and_one_far_off_is_held_against_its_forwarder(
    ) {
        let verdict = |expires_at, now| verdict_of(&RecordError::Expired { expires_at, now });
        let now = 1_000_000;
        // Expired a second ago, or just as it arrived (a record timed to a second boundary).
        assert_eq!(verdict(now - 1, now), MessageAcceptance::Ignore);
        assert_eq!(verdict(now, now), MessageAcceptance::Ignore);
        assert_eq!(
            verdict(now - CLOCK_SKEW_ALLOWANCE_SECS, now),
            MessageAcceptance::Ignore
        );
        // A lifetime a little over the most, by a clock ahead of ours.
        assert_eq!(
            verdict(now + MAX_TTL_SECS + 5, now),
            MessageAcceptance::Ignore
        );
        // Long expired, or claiming far too long a life: a forwarder that should have known.
        assert_eq!(
            verdict(now - CLOCK_SKEW_ALLOWANCE_SECS - 1, now),
            MessageAcceptance::Reject
        );
        assert_eq!(verdict(now - 3600, now), MessageAcceptance::Reject);
        assert_eq!(
            verdict(now + MAX_TTL_SECS + CLOCK_SKEW_ALLOWANCE_SECS + 1, now),
            MessageAcceptance::Reject
        );
    }
}
