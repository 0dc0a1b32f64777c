//! The router's hole punches: for each worker it reaches through a relay, a try at a direct
//! path (the relay introduces the two, see `moeswarm_relay::punch`), made in the background on
//! first use so that no dispatch waits for it; the worker's later streams take the direct path
//! while it lives. A failed try is tried again after [`RETRY_AFTER`]; a direct path that breaks
//! (its NAT mapping expired, the worker moved) goes back to the relay at once and is punched
//! again.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_relay::punch::PUNCH_DEADLINE;
use moeswarm_relay::{DataEndpoint, PeerId, RelayClient};

/// How long after a failed punch the router tries again.
pub const RETRY_AFTER: Duration = Duration::from_secs(120);

/// Where one worker's punch stands.
#[derive(Clone)]
enum Punch {
    /// Asked, not answered yet.
    Trying { relay: PeerId },
    /// A direct connection, at the address the relay saw the worker at.
    Direct {
        relay: PeerId,
        conn: quinn::Connection,
        addr: SocketAddr,
    },
    /// It failed (or its path broke) for this reason; tried again from `retry_at`.
    Failed {
        relay: PeerId,
        why: String,
        retry_at: Instant,
    },
}

/// The punches of one router, by worker.
#[derive(Clone)]
pub struct Punches {
    state: Arc<Mutex<HashMap<PeerId, Punch>>>,
    /// Bumped whenever a punch ends (made or failed).
    ended: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for Punches {
    fn default() -> Self {
        Self {
            state: Arc::default(),
            ended: Arc::new(tokio::sync::watch::channel(0).0),
        }
    }
}

impl Punches {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PeerId, Punch>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live direct connection to `peer`, if a punch made one.
    pub fn direct(&self, peer: &PeerId) -> Option<quinn::Connection> {
        match self.lock().get(peer) {
            Some(Punch::Direct { conn, .. }) if conn.close_reason().is_none() => Some(conn.clone()),
            _ => None,
        }
    }

    /// The direct path to `peer` broke (`why`): back to the relay, and punch again on next use.
    pub fn lost(&self, peer: PeerId, why: String) {
        let mut s = self.lock();
        if let Some(Punch::Direct { relay, .. }) = s.get(&peer) {
            let relay = *relay;
            let why = format!("its direct path broke ({why}); punching again");
            let retry_at = Instant::now();
            s.insert(
                peer,
                Punch::Failed {
                    relay,
                    why,
                    retry_at,
                },
            );
        }
    }

    /// Starts a punch to `peer` through `client`'s relay, dialing from `endpoint`, unless one
    /// is in flight, has made a path, or failed less than [`RETRY_AFTER`] ago.
    pub fn start_if_due(&self, peer: PeerId, client: &RelayClient, endpoint: &DataEndpoint) {
        let relay = client.relay();
        {
            let mut s = self.lock();
            let due = match s.get(&peer) {
                None => true,
                Some(Punch::Failed { retry_at, .. }) => Instant::now() >= *retry_at,
                Some(Punch::Direct { conn, .. }) => conn.close_reason().is_some(),
                Some(Punch::Trying { .. }) => false,
            };
            if !due {
                return;
            }
            s.insert(peer, Punch::Trying { relay });
        }
        let (me, client, endpoint) = (self.clone(), client.clone(), endpoint.clone());
        tokio::spawn(async move {
            let began = Instant::now();
            tracing::debug!("punching {peer}");
            let made = async {
                let addr = client.punch(peer).await?;
                tracing::debug!(
                    "relay introduced {peer} at {addr} after {:?}",
                    began.elapsed()
                );
                let dial = endpoint.connect(addr, peer, DISPATCH_ALPN);
                let conn = tokio::time::timeout(PUNCH_DEADLINE, dial)
                    .await
                    .map_err(|_| {
                        moeswarm_relay::Error::invalid(format!(
                            "no answer at {addr}, where the relay sees it, within \
                             {PUNCH_DEADLINE:?} (a NAT that maps each destination apart lets \
                             no direct path in)"
                        ))
                    })??;
                Ok::<_, moeswarm_relay::Error>((conn, addr))
            };
            let next = match made.await {
                Ok((conn, addr)) => {
                    tracing::debug!("punched {peer} at {addr} in {:?}", began.elapsed());
                    Punch::Direct { relay, conn, addr }
                }
                Err(e) => Punch::Failed {
                    relay,
                    why: {
                        tracing::debug!(
                            "punching {peer} failed after {:?}: {e:#}",
                            began.elapsed()
                        );
                        format!("{e:#}")
                    },
                    retry_at: Instant::now() + RETRY_AFTER,
                },
            };
            me.lock().insert(peer, next);
            me.ended.send_modify(|n| *n += 1);
        });
    }

    /// Waits until no punch is in flight, or until `until`.
    pub async fn settled(&self, until: tokio::time::Instant) {
        let mut ended = self.ended.subscribe();
        loop {
            let trying = self
                .lock()
                .values()
                .any(|p| matches!(p, Punch::Trying { .. }));
            if !trying {
                return;
            }
            match tokio::time::timeout_at(until, ended.changed()).await {
                Ok(Ok(())) => {}
                _ => return,
            }
        }
    }

    /// How each punched worker is reached, and why, by its PeerId.
    pub fn paths(&self) -> BTreeMap<String, String> {
        self.lock()
            .iter()
            .map(|(peer, p)| {
                let path = match p {
                    Punch::Trying { relay } => {
                        format!("relay {relay} (hole punch in progress)")
                    }
                    Punch::Direct { relay, addr, conn } if conn.close_reason().is_none() => {
                        format!("direct {addr} (hole punched, introduced by relay {relay})")
                    }
                    Punch::Direct { relay, .. } => {
                        format!("relay {relay} (its hole-punched path closed)")
                    }
                    Punch::Failed { relay, why, .. } => {
                        format!("relay {relay} (hole punch failed: {why})")
                    }
                };
                (peer.to_string(), path)
            })
            .collect()
    }
}
