//! The router's connections to workers: one QUIC connection per directly reached worker and
//! one registered client per relay, opened on first use and reused; streams are opened on
//! them per dispatch. A worker reached through a relay is also hole punched (in the
//! background, see [`super::punch`]); while that direct path lives, its streams take it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_relay::{DataEndpoint, PeerId, RelayClient};

use super::punch::Punches;
use super::replicas::Route;

/// Open connections, by worker (direct) and by relay.
pub struct Connections {
    endpoint: DataEndpoint,
    direct: Mutex<HashMap<PeerId, quinn::Connection>>,
    /// By relay: its registration, made by one task at a time (two registrations of one node
    /// at a relay replace each other, and the one dropped would take the other with it).
    relays: Mutex<HashMap<PeerId, Arc<tokio::sync::Mutex<Option<RelayClient>>>>>,
    punches: Punches,
    /// Whether to punch at all.
    punching: bool,
}

/// A stream to a worker, and whether it goes through a relay (whose replies the worker signs).
pub struct WorkerStream {
    /// Towards the worker.
    pub send: quinn::SendStream,
    /// From the worker.
    pub recv: quinn::RecvStream,
    /// Whether a relay carries it.
    pub via_relay: bool,
    /// The pooled direct connection it was opened on, when one was reused (a connection found
    /// closed after a failed exchange was gone before it: the worker restarted).
    pub pooled: Option<quinn::Connection>,
}

impl WorkerStream {
    fn on((send, recv): (quinn::SendStream, quinn::RecvStream), via_relay: bool) -> Self {
        Self {
            send,
            recv,
            via_relay,
            pooled: None,
        }
    }
}

impl Connections {
    /// No connections yet; new ones are dialed from `endpoint`.
    pub fn new(endpoint: DataEndpoint) -> Self {
        Self {
            endpoint,
            direct: Mutex::default(),
            relays: Mutex::default(),
            punches: Punches::default(),
            punching: true,
        }
    }

    /// Whether workers reached through a relay are hole punched.
    pub fn set_hole_punching(&mut self, on: bool) {
        self.punching = on;
    }

    /// How the workers reached through a relay are reached now (direct when hole punched), and
    /// why, by PeerId.
    pub fn punched_paths(&self) -> std::collections::BTreeMap<String, String> {
        self.punches.paths()
    }

    /// A fresh stream to `peer` along `route`, dialing (or registering at the relay) when no
    /// live connection is there; through a relay, on the hole-punched path when there is one.
    pub async fn open_stream(&self, peer: PeerId, route: &Route) -> Result<WorkerStream> {
        // No lock is held while dialing: a dead peer must not hold up dispatches to others.
        match route {
            Route::Direct(addr) => {
                let known = self.direct.lock().ok().and_then(|c| c.get(&peer).cloned());
                if let Some(c) = known {
                    if let Ok(s) = c.open_bi().await {
                        let mut s = WorkerStream::on(s, false);
                        s.pooled = Some(c);
                        return Ok(s);
                    }
                    if let Ok(mut conns) = self.direct.lock() {
                        conns.remove(&peer);
                    }
                }
                let c = self.endpoint.connect(*addr, peer, DISPATCH_ALPN).await?;
                let s = c.open_bi().await?;
                if let Ok(mut conns) = self.direct.lock() {
                    conns.insert(peer, c);
                }
                Ok(WorkerStream::on(s, false))
            }
            Route::ViaRelay { relay, addr } => {
                if let Some(c) = self.punches.direct(&peer) {
                    match c.open_bi().await {
                        Ok(s) => return Ok(WorkerStream::on(s, false)),
                        Err(e) => self.punches.lost(peer, e.to_string()),
                    }
                }
                let client = self.through_relay(peer, *relay, *addr).await?;
                Ok(WorkerStream::on(client.open(peer).await?, true))
            }
        }
    }

    /// Drops the pooled direct connection to `peer`: the next stream dials afresh.
    pub fn forget(&self, peer: PeerId) {
        if let Ok(mut conns) = self.direct.lock() {
            conns.remove(&peer);
        }
    }

    /// Gets ready to send to `peer` along `route` before the first dispatch: registers at its
    /// relay and starts the hole punch (a direct route needs nothing).
    pub async fn prepare(&self, peer: PeerId, route: &Route) -> Result<()> {
        if let Route::ViaRelay { relay, addr } = route {
            self.through_relay(peer, *relay, *addr).await?;
        }
        Ok(())
    }

    /// The registration at `relay` to reach `peer` through, with a hole punch to `peer`
    /// started when one is due.
    async fn through_relay(
        &self,
        peer: PeerId,
        relay: PeerId,
        addr: std::net::SocketAddr,
    ) -> Result<RelayClient> {
        let client = self.relay_client(relay, addr).await?;
        if self.punching {
            self.punches.start_if_due(peer, &client, &self.endpoint);
        }
        Ok(client)
    }

    /// Waits until no hole punch is in flight, or until `until`.
    pub async fn punches_settled(&self, until: tokio::time::Instant) {
        self.punches.settled(until).await;
    }

    /// This router's registration at the relay `relay` (at `addr`), made when it has none.
    async fn relay_client(&self, relay: PeerId, addr: std::net::SocketAddr) -> Result<RelayClient> {
        let entry = match self.relays.lock() {
            Ok(mut r) => r.entry(relay).or_default().clone(),
            Err(_) => Arc::default(),
        };
        // Only callers of this one relay wait here, while one of them registers.
        let mut held = entry.lock().await;
        if let Some(c) = held.as_ref().filter(|c| c.is_open()) {
            return Ok(c.clone());
        }
        let c = RelayClient::register(&self.endpoint, addr, relay).await?;
        *held = Some(c.clone());
        Ok(c)
    }
}
