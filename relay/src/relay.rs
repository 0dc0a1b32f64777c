//! The relay: forwards data-plane streams to workers that can only dial out.
//!
//! A worker keeps a connection to the relay and registers on it by signing a challenge (the
//! nonce and the relay's PeerId) with its node key; the relay checks the signature against the
//! PeerId the worker's certificate proved. A router, registered the same way, opens a stream
//! to the relay and asks for "PeerId X"; the relay opens a stream to X on X's registration,
//! tells each end who is at the other, and splices bytes both ways without parsing them. Each
//! registered worker has a cap on streams at once, shared fairly among its callers; each stream
//! a cap on bytes, on time and on time without traffic; each registrant a byte rate; the
//! registry a size (see [`crate::registry`]). Unregistered or unauthenticated peers are
//! refused.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{bail, Context, Error, Result};
use libp2p_identity::{Keypair, PeerId};
use moeswarm_protocol::relay::{from_hex, registration_bytes, to_hex, RelayMessage, RELAY_ALPN};

use crate::endpoint::DataEndpoint;
#[cfg(feature = "test-faults")]
use crate::faults::Tamper;
use crate::faults::{Direction, PayloadFlip, RelayHooks};
use crate::framing::{read_control, write_control};
use crate::registry::{NoSlot, Registry, StreamSlot, TokenBucket};

/// How long a control exchange may take.
pub const CONTROL_DEADLINE: Duration = Duration::from_secs(10);

/// The relay's bounds.
#[derive(Debug, Clone, Copy)]
pub struct RelayLimits {
    /// Spliced streams to one worker at once.
    pub streams_per_worker: usize,
    /// Bytes one spliced stream may carry, both ways together.
    pub bytes_per_stream: u64,
    /// Longest life of one spliced stream.
    pub stream_deadline: Duration,
    /// A spliced stream with no bytes either way for this long is closed.
    pub stream_idle: Duration,
    /// Nodes registered at once; a new one evicts the one idle longest of the address with
    /// the most registrations.
    pub max_registrations: usize,
    /// Nodes registered at once from one IP address.
    pub registrations_per_ip: usize,
    /// Bytes per second one registrant's streams may carry, sustained (as caller or target).
    pub bytes_per_second: u64,
    /// Bytes one registrant may carry in a burst above that rate.
    pub byte_burst: u64,
    /// Streams per second one registrant may open as a caller, sustained.
    pub streams_per_second: u64,
    /// Streams one registrant may open in a burst above that rate.
    pub stream_burst: u64,
}

impl Default for RelayLimits {
    fn default() -> Self {
        Self {
            streams_per_worker: 64,
            bytes_per_stream: 1 << 30,
            stream_deadline: Duration::from_secs(120),
            stream_idle: Duration::from_secs(20),
            max_registrations: 4096,
            registrations_per_ip: 32,
            bytes_per_second: 256 << 20,
            byte_burst: 1 << 30,
            streams_per_second: 4096,
            stream_burst: 8192,
        }
    }
}

/// What a relay did.
#[derive(Debug, Default)]
pub struct RelayStats {
    /// Registrations accepted.
    pub registered: AtomicU64,
    /// Registrations or connects refused.
    pub refused: AtomicU64,
    /// Streams spliced.
    pub spliced: AtomicU64,
    /// Bytes forwarded.
    pub bytes: AtomicU64,
}

/// A running relay.
pub struct RelayServer {
    endpoint: DataEndpoint,
    /// What it did.
    pub stats: Arc<RelayStats>,
    task: tokio::task::JoinHandle<()>,
}

/// Whether `signature` over the registration bytes verifies for `peer`.
fn check_registration(peer: &PeerId, nonce: &[u8], relay: &PeerId, signature: &[u8]) -> bool {
    crate::identity::verify(
        peer,
        &registration_bytes(nonce, &relay.to_bytes()),
        signature,
    )
}

pub(crate) async fn refuse(send: &mut quinn::SendStream, stats: &RelayStats, reason: String) {
    stats.refused.fetch_add(1, Ordering::Relaxed);
    let _ = write_control(send, &RelayMessage::Refused { reason }).await;
    let _ = send.finish();
}

/// Copies one direction, capped by `budget` (shared by both directions), paced by the byte
/// buckets of both ends, and closed after `idle` without a byte.
async fn pump(
    mut from: quinn::RecvStream,
    mut to: quinn::SendStream,
    budget: Arc<AtomicU64>,
    buckets: [Option<Arc<Mutex<TokenBucket>>>; 2],
    idle: Duration,
    stats: Arc<RelayStats>,
    mut rewrite: Option<PayloadFlip>,
) -> Result<()> {
    loop {
        let chunk = match tokio::time::timeout(idle, from.read_chunk(64 * 1024, true)).await {
            Ok(c) => c?,
            Err(_) => {
                let _ = to.reset(3u32.into());
                let _ = from.stop(3u32.into());
                bail!("stream idle for {idle:?}");
            }
        };
        let Some(chunk) = chunk else { break };
        let n = chunk.bytes.len() as u64;
        let now = std::time::Instant::now();
        let pause = buckets
            .iter()
            .flatten()
            .map(|b| b.lock().unwrap_or_else(|p| p.into_inner()).take(n, now))
            .max()
            .unwrap_or_default();
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        if budget
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| b.checked_sub(n))
            .is_err()
        {
            let _ = to.reset(2u32.into());
            let _ = from.stop(2u32.into());
            bail!("stream over its byte limit");
        }
        stats.bytes.fetch_add(n, Ordering::Relaxed);
        if let Some(flip) = &mut rewrite {
            let mut bytes = chunk.bytes.to_vec();
            flip.apply(&mut bytes);
            to.write_all(&bytes).await?;
        } else {
            to.write_all(&chunk.bytes).await?;
        }
    }
    let _ = to.finish();
    Ok(())
}

impl RelayServer {
    /// Starts a relay on `addr` with `keypair`'s identity.
    pub fn spawn(keypair: &Keypair, addr: SocketAddr, limits: RelayLimits) -> Result<Self> {
        Self::spawn_with(keypair, addr, limits, RelayHooks::default())
    }

    /// Starts a relay that rewrites what it carries as `tamper` says (test builds only).
    #[cfg(feature = "test-faults")]
    pub fn spawn_tampering(
        keypair: &Keypair,
        addr: SocketAddr,
        limits: RelayLimits,
        tamper: Tamper,
    ) -> Result<Self> {
        Self::spawn_with(keypair, addr, limits, RelayHooks::new(tamper))
    }

    fn spawn_with(
        keypair: &Keypair,
        addr: SocketAddr,
        limits: RelayLimits,
        hooks: RelayHooks,
    ) -> Result<Self> {
        let endpoint = DataEndpoint::bind(keypair, addr, &[RELAY_ALPN])?;
        let stats = Arc::new(RelayStats::default());
        let registry = Registry::default();
        let (ep, st) = (endpoint.clone(), stats.clone());
        let task = tokio::spawn(async move {
            while let Some((conn, peer, _)) = ep.accept().await {
                let (ep, st, reg) = (ep.clone(), st.clone(), registry.clone());
                tokio::spawn(serve_connection(ep, conn, peer, reg, st, limits, hooks));
            }
        });
        Ok(Self {
            endpoint,
            stats,
            task,
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// Its PeerId.
    pub fn peer_id(&self) -> PeerId {
        self.endpoint.peer_id()
    }

    /// What its endpoint turned away.
    pub fn accept_stats(&self) -> &crate::endpoint::AcceptStats {
        self.endpoint.accept_stats()
    }

    /// Stops it.
    pub fn shutdown(self) {
        self.task.abort();
        self.endpoint.close();
    }
}

async fn serve_connection(
    ep: DataEndpoint,
    conn: quinn::Connection,
    peer: PeerId,
    registry: Registry,
    stats: Arc<RelayStats>,
    limits: RelayLimits,
    hooks: RelayHooks,
) {
    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
        let first = tokio::time::timeout(CONTROL_DEADLINE, read_control(&mut recv)).await;
        let Ok(Ok(first)) = first else {
            refuse(&mut send, &stats, "no control message".into()).await;
            continue;
        };
        match first {
            RelayMessage::Hello => {
                let r = tokio::time::timeout(
                    CONTROL_DEADLINE,
                    register(&ep, &conn, peer, &mut send, &mut recv, &registry, &limits),
                )
                .await;
                match r {
                    Ok(Ok(())) => {
                        stats.registered.fetch_add(1, Ordering::Relaxed);
                        let _ = write_control(&mut send, &RelayMessage::Registered).await;
                        let _ = send.finish();
                    }
                    Ok(Err(e)) => refuse(&mut send, &stats, format!("{e:#}")).await,
                    Err(_) => refuse(&mut send, &stats, "registration timed out".into()).await,
                }
            }
            RelayMessage::Connect { target } => {
                let (reg, st) = (registry.clone(), stats.clone());
                tokio::spawn(async move {
                    if let Err(e) =
                        connect(peer, &target, send, recv, reg, st.clone(), limits, hooks).await
                    {
                        tracing::debug!("relayed stream from {peer} ended: {e:#}");
                    }
                });
            }
            RelayMessage::Punch { target } => {
                let (reg, st, from_addr) = (registry.clone(), stats.clone(), conn.remote_address());
                tokio::spawn(async move {
                    let r =
                        crate::punch::introduce(peer, from_addr, &target, send, reg, st, limits);
                    if let Err(e) = r.await {
                        tracing::debug!("punch from {peer} ended: {e:#}");
                    }
                });
            }
            other => refuse(&mut send, &stats, format!("unexpected {other:?}")).await,
        }
    }
    // The connection is gone: so is its registration.
    registry.remove_if_on(&peer, conn.stable_id());
}

async fn register(
    ep: &DataEndpoint,
    conn: &quinn::Connection,
    peer: PeerId,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    registry: &Registry,
    limits: &RelayLimits,
) -> Result<()> {
    let mut nonce = [0u8; 32];
    rand::fill(&mut nonce);
    write_control(
        send,
        &RelayMessage::Challenge {
            nonce: to_hex(&nonce),
        },
    )
    .await?;
    let RelayMessage::Register { signature } = read_control(recv).await? else {
        bail!("expected a signed registration");
    };
    let sig = from_hex(&signature).context("signature is not hex")?;
    if !check_registration(&peer, &nonce, &ep.peer_id(), &sig) {
        bail!("registration signature does not verify for {peer}");
    }
    if let Err(why) = registry.register(peer, conn.clone(), limits) {
        bail!("{why}");
    }
    Ok(())
}

/// For a stream from `from` to `target` (a splice or a punch): checks the caller is
/// registered and `target` is a PeerId, and takes a slot on the target's streams, with the
/// target's connection; or refuses on `send`, saying why.
pub(crate) async fn take_slot(
    from: PeerId,
    target: &str,
    send: &mut quinn::SendStream,
    registry: &Registry,
    stats: &RelayStats,
    limits: &RelayLimits,
) -> Result<(PeerId, StreamSlot, quinn::Connection)> {
    if !registry.contains(&from) {
        refuse(send, stats, format!("{from} is not registered here")).await;
        bail!("unregistered caller");
    }
    let Ok(target) = target.parse::<PeerId>() else {
        refuse(send, stats, format!("{target:?} is not a PeerId")).await;
        bail!("bad target");
    };
    match registry.slot(from, target, limits) {
        Ok((slot, conn)) => Ok((target, slot, conn)),
        Err(why) => {
            let reason = match why {
                NoSlot::Unregistered => format!("{target} is not registered here"),
                NoSlot::TargetFull => format!("{target} has too many relayed streams"),
                NoSlot::CallerShare => {
                    format!("{from} holds its share of {target}'s relayed streams")
                }
                NoSlot::TooFast => format!("{from} opens relayed streams too fast"),
            };
            refuse(send, stats, reason).await;
            bail!("no stream slot: {why:?}");
        }
    }
}

#[allow(clippy::too_many_arguments)] // one splice: both ends, its streams, and the relay's shared state
async fn connect(
    from: PeerId,
    target: &str,
    mut send: quinn::SendStream,
    recv: quinn::RecvStream,
    registry: Registry,
    stats: Arc<RelayStats>,
    limits: RelayLimits,
    hooks: RelayHooks,
) -> Result<()> {
    let (target, _slot, conn) =
        take_slot(from, target, &mut send, &registry, &stats, &limits).await?;
    let (mut wsend, wrecv) = match tokio::time::timeout(CONTROL_DEADLINE, conn.open_bi()).await {
        Ok(Ok(s)) => s,
        _ => {
            refuse(&mut send, &stats, format!("{target} did not take a stream")).await;
            bail!("target unreachable");
        }
    };
    write_control(
        &mut wsend,
        &RelayMessage::Connected {
            peer: from.to_string(),
        },
    )
    .await?;
    write_control(
        &mut send,
        &RelayMessage::Connected {
            peer: target.to_string(),
        },
    )
    .await?;
    stats.spliced.fetch_add(1, Ordering::Relaxed);
    let budget = Arc::new(AtomicU64::new(limits.bytes_per_stream));
    let buckets = || [registry.bucket(&from), registry.bucket(&target)];
    let idle = limits.stream_idle;
    let both = async {
        tokio::join!(
            pump(
                recv,
                wsend,
                budget.clone(),
                buckets(),
                idle,
                stats.clone(),
                hooks.rewriter(Direction::Request),
            ),
            pump(
                wrecv,
                send,
                budget.clone(),
                buckets(),
                idle,
                stats.clone(),
                hooks.rewriter(Direction::Reply),
            ),
        )
    };
    let _ = tokio::time::timeout(limits.stream_deadline, both).await;
    Ok(())
}

/// A node's registration with a relay: the connection streams arrive on, and the means to
/// open streams through the relay to other registered nodes.
#[derive(Clone)]
pub struct RelayClient {
    conn: quinn::Connection,
    relay: PeerId,
    addr: SocketAddr,
    endpoint: DataEndpoint,
}

impl RelayClient {
    /// Connects to the relay `relay` at `addr` and registers with a signed challenge.
    pub async fn register(ep: &DataEndpoint, addr: SocketAddr, relay: PeerId) -> Result<Self> {
        let conn = ep.connect(addr, relay, RELAY_ALPN).await?;
        let run = async {
            let (mut send, mut recv) = conn.open_bi().await?;
            write_control(&mut send, &RelayMessage::Hello).await?;
            let nonce = match read_control(&mut recv).await? {
                RelayMessage::Challenge { nonce } => from_hex(&nonce).context("nonce")?,
                RelayMessage::Refused { reason } => return Err(Error::RelayRefused(reason)),
                other => bail!("relay sent {other:?}"),
            };
            let sig = ep
                .keypair()
                .sign(&registration_bytes(&nonce, &relay.to_bytes()))
                .map_err(|e| Error::invalid(format!("signing: {e}")))?;
            write_control(
                &mut send,
                &RelayMessage::Register {
                    signature: to_hex(&sig),
                },
            )
            .await?;
            match read_control(&mut recv).await? {
                RelayMessage::Registered => Ok(()),
                RelayMessage::Refused { reason } => Err(Error::RelayRefused(reason)),
                other => bail!("relay sent {other:?}"),
            }
        };
        tokio::time::timeout(CONTROL_DEADLINE, run)
            .await
            .context("registering with the relay timed out")??;
        Ok(Self {
            conn,
            relay,
            addr,
            endpoint: ep.clone(),
        })
    }

    /// Registers again with the same relay (after its connection was lost).
    pub async fn reconnect(&self) -> Result<Self> {
        Self::register(&self.endpoint, self.addr, self.relay).await
    }

    /// Keeps accepting spliced streams, registering again (backing off up to 30 s) whenever
    /// the relay's connection is lost; each stream goes to `serve` with the caller's PeerId.
    pub async fn serve_forever(
        mut self,
        mut serve: impl FnMut(quinn::SendStream, quinn::RecvStream, PeerId),
    ) {
        loop {
            match self.accept().await {
                Ok((send, recv, peer)) => serve(send, recv, peer),
                Err(_) => {
                    let mut backoff = Duration::from_millis(200);
                    loop {
                        tokio::time::sleep(backoff).await;
                        match self.reconnect().await {
                            Ok(c) => {
                                self = c;
                                break;
                            }
                            Err(_) => backoff = (backoff * 2).min(Duration::from_secs(30)),
                        }
                    }
                }
            }
        }
    }

    /// The relay's PeerId.
    pub fn relay(&self) -> PeerId {
        self.relay
    }

    /// The next stream the relay spliced to this node, with the PeerId at the other end.
    /// Punch requests that come meanwhile are answered (see [`crate::punch`]).
    pub async fn accept(&self) -> Result<(quinn::SendStream, quinn::RecvStream, PeerId)> {
        loop {
            let (send, mut recv) = self.conn.accept_bi().await?;
            let msg = tokio::time::timeout(CONTROL_DEADLINE, read_control(&mut recv)).await;
            match msg {
                Ok(Ok(RelayMessage::Connected { peer })) => {
                    if let Ok(peer) = peer.parse() {
                        return Ok((send, recv, peer));
                    }
                }
                Ok(Ok(RelayMessage::PunchTo { peer, addr })) => {
                    let endpoint = self.endpoint.clone();
                    tokio::spawn(async move {
                        let r = crate::punch::answer(&endpoint, &peer, &addr, send);
                        if let Err(e) = r.await {
                            tracing::debug!("answering a punch for {peer}: {e:#}");
                        }
                    });
                }
                _ => {}
            }
        }
    }

    /// Asks the relay to introduce this node to the registered node `target` for a direct
    /// path: `target` has sent towards this node's address, and this is the address to dial it
    /// at (see [`crate::punch`]).
    pub async fn punch(&self, target: PeerId) -> Result<SocketAddr> {
        crate::punch::ask(&self.conn, target).await
    }

    /// Opens a stream through the relay to the registered node `target`.
    pub async fn open(&self, target: PeerId) -> Result<(quinn::SendStream, quinn::RecvStream)> {
        let run = async {
            let (mut send, mut recv) = self.conn.open_bi().await?;
            write_control(
                &mut send,
                &RelayMessage::Connect {
                    target: target.to_string(),
                },
            )
            .await?;
            match read_control(&mut recv).await? {
                RelayMessage::Connected { peer } if peer == target.to_string() => Ok((send, recv)),
                RelayMessage::Refused { reason } => Err(Error::RelayRefused(reason)),
                other => bail!("relay sent {other:?}"),
            }
        };
        tokio::time::timeout(CONTROL_DEADLINE, run)
            .await
            .context("opening a stream through the relay timed out")?
    }

    /// Whether the registration's connection still lives.
    pub fn is_open(&self) -> bool {
        self.conn.close_reason().is_none()
    }
}
