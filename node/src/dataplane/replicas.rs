//! Who can answer for a slab, and how the router reaches them: the replica table built from
//! verified holdings records.

use std::net::SocketAddr;

use moeswarm_protocol::{Holdings, Manifest, NodeKey, Reach};
use moeswarm_relay::PeerId;

use crate::net::identity::peer_id_of;

/// How the router reaches a worker's data plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// At this address.
    Direct(SocketAddr),
    /// Through the relay `relay` at `addr`.
    ViaRelay {
        /// The relay's PeerId.
        relay: PeerId,
        /// Its data-plane address.
        addr: SocketAddr,
    },
}

/// One holder of a slab, and how to reach it.
#[derive(Debug, Clone)]
pub struct Replica {
    /// The worker.
    pub peer: PeerId,
    /// Its record key.
    pub key: NodeKey,
    /// How to reach it.
    pub route: Route,
}

/// The most holders of one slab a router keeps: a flood of made-up records cannot make its
/// choices, second opinions or referee fetches go through thousands (as a fetch takes 8
/// sources).
pub const MAX_REPLICAS: usize = 8;

/// `[layer][expert]` → the replicas the router may send to.
#[derive(Debug, Clone, Default)]
pub struct ReplicaTable {
    slabs: Vec<Vec<Vec<Replica>>>,
}

/// A data-plane address as records carry it: `quic://ip:port`.
pub fn parse_quic_addr(s: &str) -> Option<SocketAddr> {
    let a: SocketAddr = s.strip_prefix("quic://")?.parse().ok()?;
    // An unspecified address or port names no one to dial.
    (!a.ip().is_unspecified() && a.port() != 0).then_some(a)
}

impl ReplicaTable {
    /// The replicas named by verified holdings records, leaving out `me`.
    pub fn from_records<'a>(
        manifest: &Manifest,
        records: impl IntoIterator<Item = &'a Holdings>,
        me: Option<&NodeKey>,
    ) -> Self {
        let h = &manifest.hyper;
        let mut slabs =
            vec![vec![Vec::new(); h.n_expert as usize]; manifest.slab_layers() as usize];
        for rec in records {
            if Some(&rec.node) == me || rec.model != manifest.id() {
                continue;
            }
            let (Some(peer), Some(addr)) = (
                peer_id_of(&rec.node),
                rec.addrs.iter().find_map(|a| parse_quic_addr(a)),
            ) else {
                continue;
            };
            let route = match rec.reach {
                Reach::Direct => Route::Direct(addr),
                Reach::ViaRelay(relay) => match peer_id_of(&relay) {
                    Some(relay) => Route::ViaRelay { relay, addr },
                    None => continue,
                },
            };
            for (l, e) in rec.slabs() {
                if let Some(v) = slabs
                    .get_mut(l as usize)
                    .and_then(|x| x.get_mut(e as usize))
                {
                    v.push(Replica {
                        peer,
                        key: rec.node,
                        route: route.clone(),
                    });
                }
            }
        }
        Self { slabs }
    }

    /// The table with at most [`MAX_REPLICAS`] holders of each slab: the first by `rank`
    /// (smaller first; the router's standing of each, see `HealthTable::rank`).
    pub fn capped<K: Ord>(mut self, rank: impl Fn(&Replica) -> K) -> Self {
        for v in self.slabs.iter_mut().flatten() {
            if v.len() > MAX_REPLICAS {
                v.sort_by_cached_key(|r| rank(r));
                v.truncate(MAX_REPLICAS);
            }
        }
        self
    }

    /// How each worker in the table is reached, and why, by its peer id.
    pub fn paths(&self) -> std::collections::BTreeMap<String, String> {
        self.slabs
            .iter()
            .flatten()
            .flatten()
            .map(|r| {
                let path = match &r.route {
                    Route::Direct(a) => format!("direct {a} (its own address)"),
                    Route::ViaRelay { relay, addr } => {
                        format!("relay {relay} at {addr} (it registered there; not hole punched)")
                    }
                };
                (r.peer.to_string(), path)
            })
            .collect()
    }

    /// Each worker in the table once, with its route.
    pub fn workers(&self) -> Vec<(PeerId, Route)> {
        let mut seen = std::collections::BTreeMap::new();
        for r in self.slabs.iter().flatten().flatten() {
            seen.entry(r.peer).or_insert_with(|| r.route.clone());
        }
        seen.into_iter().collect()
    }

    /// The replicas of `(layer, expert)`.
    pub fn replicas(&self, layer: u32, expert: u32) -> &[Replica] {
        self.slabs
            .get(layer as usize)
            .and_then(|x| x.get(expert as usize))
            .map_or(&[], Vec::as_slice)
    }
}
