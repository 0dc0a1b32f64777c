//! The router's connections to workers: one QUIC connection per directly reached worker and
//! one registered client per relay, opened on first use and reused; streams are opened on
//! them per dispatch.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::error::Result;
use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_relay::{DataEndpoint, PeerId, RelayClient};

use super::replicas::Route;

/// Open connections, by worker (direct) and by relay.
pub struct Connections {
    endpoint: DataEndpoint,
    direct: Mutex<HashMap<PeerId, quinn::Connection>>,
    relays: Mutex<HashMap<PeerId, RelayClient>>,
}

impl Connections {
    /// No connections yet; new ones are dialed from `endpoint`.
    pub fn new(endpoint: DataEndpoint) -> Self {
        Self {
            endpoint,
            direct: Mutex::default(),
            relays: Mutex::default(),
        }
    }

    /// A fresh stream to `peer` along `route`, dialing (or registering at the relay) when no
    /// live connection is there.
    pub async fn open_stream(
        &self,
        peer: PeerId,
        route: &Route,
    ) -> Result<(quinn::SendStream, quinn::RecvStream)> {
        // No lock is held while dialing: a dead peer must not hold up dispatches to others.
        match route {
            Route::Direct(addr) => {
                let known = self.direct.lock().ok().and_then(|c| c.get(&peer).cloned());
                if let Some(c) = known {
                    if let Ok(s) = c.open_bi().await {
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
                Ok(s)
            }
            Route::ViaRelay { relay, addr } => {
                let known = self
                    .relays
                    .lock()
                    .ok()
                    .and_then(|r| r.get(relay).filter(|c| c.is_open()).cloned());
                let client = match known {
                    Some(c) => c,
                    None => {
                        let c = RelayClient::register(&self.endpoint, *addr, *relay).await?;
                        if let Ok(mut r) = self.relays.lock() {
                            r.insert(*relay, c.clone());
                        }
                        c
                    }
                };
                Ok(client.open(peer).await?)
            }
        }
    }
}
