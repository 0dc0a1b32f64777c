//! [`NodeStats`]: what a node's swarm received, refused and served.

use std::collections::BTreeMap;

use serde::Serialize;

/// Counts of what arrived and what was refused.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeStats {
    /// Records verified and applied to a coverage map.
    pub records_applied: u64,
    /// Records refused in verification, by reason.
    pub records_refused: BTreeMap<String, u64>,
    /// Demand records verified and applied.
    pub demand_applied: u64,
    /// Demand records refused, by reason.
    pub demand_refused: BTreeMap<String, u64>,
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
