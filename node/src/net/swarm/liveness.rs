//! Who is alive: heartbeats heard, judged by this node's clock.
//!
//! A node is live here while it is connected to this node, and for
//! [`LIVE_FOR_SECS`](moeswarm_protocol::heartbeat::LIVE_FOR_SECS) after its last heartbeat,
//! after its last connection here ended, or (for a node not heard from yet) after its first
//! record was taken in here; a node none of that applies to counts only during this node's
//! own first window (it has not had the time to hear anyone yet). Only a heartbeat that verifies (signed by the node it
//! names, sent by it, newer than the last) counts; nothing any peer says makes another node
//! dead. Coverage, the records served to others, and so the market and the router's replica
//! table, count only live holders.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::gossipsub::{self, MessageAcceptance};
use libp2p::PeerId;
use moeswarm_market::coverage::CoverageMap;
use moeswarm_protocol::heartbeat::LIVE_FOR_SECS;
use moeswarm_protocol::{Heartbeat, NodeKey};

use super::State;
use crate::net::identity::peer_id_of;
use crate::net::records::verify_record;
use crate::net::stats::RecordRefusal;

/// Most nodes whose heartbeats are remembered (the oldest heard is forgotten first).
const MAX_REMEMBERED: usize = 16_384;

/// The global topic heartbeats travel on.
pub(crate) fn alive_topic() -> gossipsub::IdentTopic {
    gossipsub::IdentTopic::new("/moeswarm/alive/1")
}

/// Heartbeats heard: each node's last sequence and when it was heard.
pub(super) struct Liveness {
    heard: HashMap<NodeKey, (u64, Instant)>,
    started: Instant,
    window: Duration,
}

impl Liveness {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            heard: HashMap::new(),
            started: now,
            window: Duration::from_secs(LIVE_FOR_SECS),
        }
    }

    /// The last sequence heard from `key`.
    pub(super) fn last_seq(&self, key: &NodeKey) -> Option<u64> {
        self.heard.get(key).map(|h| h.0)
    }

    /// `key` said it lives, with sequence `seq`, heard at `now`.
    pub(super) fn heard(&mut self, key: NodeKey, seq: u64, now: Instant) {
        if self.heard.len() >= MAX_REMEMBERED && !self.heard.contains_key(&key) {
            if let Some(oldest) = self.heard.iter().min_by_key(|(_, h)| h.1).map(|(k, _)| *k) {
                self.heard.remove(&oldest);
            }
        }
        self.heard.insert(key, (seq, now));
    }

    /// `key` was seen alive at `now` without a heartbeat: a connection of its own (its key
    /// proven by the handshake) opened or closed. Its sequence stays as it was.
    pub(super) fn touch(&mut self, key: NodeKey, now: Instant) {
        let seq = self.last_seq(&key).unwrap_or(0);
        self.heard(key, seq, now);
    }

    /// A record of `key`'s was first taken in at `now`: a node not heard from yet gets one
    /// window from then to be heard (a node that joined a moment ago has not sent a heartbeat
    /// yet). Nothing changes for a node already heard from.
    pub(super) fn noticed(&mut self, key: NodeKey, now: Instant) {
        if !self.heard.contains_key(&key) {
            self.heard(key, 0, now);
        }
    }

    /// Whether `key` counts as live at `now` (`connected`: it has a connection to this node).
    pub(super) fn is_live(&self, key: &NodeKey, connected: bool, now: Instant) -> bool {
        if connected {
            return true;
        }
        match self.heard.get(key) {
            Some(&(_, at)) => now.saturating_duration_since(at) < self.window,
            None => now.saturating_duration_since(self.started) < self.window,
        }
    }
}

impl State {
    /// Whether the holder `key` counts now (this node itself always does).
    pub(super) fn holder_is_live(&self, key: &NodeKey, now: Instant) -> bool {
        if *key == self.own_key {
            return true;
        }
        let connected = peer_id_of(key).is_some_and(|p| self.swarm.is_connected(&p));
        self.liveness.is_live(key, connected, now)
    }

    /// `model`'s coverage with only its live holders.
    pub(super) fn live_coverage(&self, model: &moeswarm_protocol::ModelId) -> Option<CoverageMap> {
        let now = Instant::now();
        let mut map = self.holdings.get(model)?.book().clone();
        let dead: Vec<NodeKey> = map
            .nodes()
            .map(|h| h.node)
            .filter(|k| !self.holder_is_live(k, now))
            .collect();
        for k in &dead {
            map.remove(k);
        }
        Some(map)
    }

    /// Verifies a heartbeat as coming from `source` and notes it; what gossip should do with
    /// it (forward only what verifies; a forger's is rejected, an old one ignored).
    pub(super) fn receive_heartbeat(
        &mut self,
        source: Option<PeerId>,
        wire: &[u8],
    ) -> MessageAcceptance {
        match verify_record::<Heartbeat>(wire, source, |k| self.liveness.last_seq(k)) {
            Ok(h) => {
                self.liveness.heard(h.node, h.seq, Instant::now());
                self.stats.heartbeats_heard += 1;
                MessageAcceptance::Accept
            }
            Err(e) => {
                *self
                    .stats
                    .heartbeats_refused
                    .entry(RecordRefusal::from(&e))
                    .or_default() += 1;
                super::receive::verdict_of(&e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_lives_for_a_window_after_its_last_heartbeat_or_while_connected() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0);
        let (a, b) = (NodeKey([1; 32]), NodeKey([2; 32]));
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Never heard: live only during this node's own first window.
        assert!(l.is_live(&a, false, at(LIVE_FOR_SECS - 1)));
        assert!(!l.is_live(&a, false, at(LIVE_FOR_SECS)));
        assert!(l.is_live(&a, true, at(LIVE_FOR_SECS * 10)));
        l.heard(b, 7, at(100));
        assert_eq!(l.last_seq(&b), Some(7));
        assert!(l.is_live(&b, false, at(100 + LIVE_FOR_SECS - 1)));
        assert!(!l.is_live(&b, false, at(100 + LIVE_FOR_SECS)));
    }
}
