//! QUIC endpoints whose certificates carry the node's libp2p identity.
//!
//! Certificates follow libp2p's TLS scheme (`libp2p-tls`): self-signed, with an extension
//! signed by the node's ed25519 key. A client pins the PeerId it expects (the one the coverage
//! named), so a connection to anyone else fails in the handshake; a server learns each
//! client's PeerId from its certificate ([`peer_of`]). Only this project's ALPN names are
//! spoken. A node's stateless reset key comes from its identity, so a node that restarted at
//! its address tells the peers of its last run at once that their connections are gone.
//!
//! Accepting is guarded against handshake floods and greedy peers: handshakes run in parallel
//! (at most [`MAX_PENDING_HANDSHAKES`] at once; beyond it new ones are refused), and once
//! [`RETRY_ABOVE`] are pending a client must first prove its address with a QUIC Retry, which a
//! spoofed or fire-and-forget sender never answers. One PeerId may hold at most
//! [`MAX_CONNECTIONS_PER_PEER`] connections, each with [`MAX_STREAMS`] streams and
//! [`RECEIVE_WINDOW`] bytes unread, so what one peer makes this node buffer is bounded.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, OnceCell, Semaphore};

use crate::error::{Context, Error, Result};
use libp2p_identity::{Keypair, PeerId};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};

/// How long a handshake may take.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(10);
/// A connection with nothing on it for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Streams a peer may have open on one connection at once.
pub const MAX_STREAMS: u32 = 64;
/// Bytes a peer may have sent on one connection that this node has not read yet.
pub const RECEIVE_WINDOW: u32 = 16 << 20;
/// Handshakes in progress at once; more are refused.
pub const MAX_PENDING_HANDSHAKES: usize = 64;
/// Handshakes in progress above which a client must validate its address first (Retry).
pub const RETRY_ABOVE: usize = 4;
/// Connections one PeerId may hold to this endpoint at once.
pub const MAX_CONNECTIONS_PER_PEER: usize = 4;
/// The UDP socket's kernel buffers asked for, each way (the kernel caps them at
/// `net.core.rmem_max` / `wmem_max`). The default (about 200 KiB) drops datagrams when a
/// megabyte of activations arrives at once, and each drop costs a loss-recovery delay: the
/// round trip's tail.
pub const SOCKET_BUFFER_BYTES: usize = 8 << 20;

type Accepted = (quinn::Connection, PeerId, Vec<u8>);

/// A quinn endpoint that accepts and dials data-plane connections.
#[derive(Clone)]
pub struct DataEndpoint {
    endpoint: quinn::Endpoint,
    keypair: Keypair,
    accepted: Arc<OnceCell<tokio::sync::Mutex<mpsc::Receiver<Accepted>>>>,
    stats: Arc<AcceptStats>,
    /// Hole punches in flight (see [`DataEndpoint::punch`]).
    punching: Arc<std::sync::atomic::AtomicUsize>,
}

/// What the accepting side turned away.
#[derive(Debug, Default)]
pub struct AcceptStats {
    /// Clients asked to validate their address first.
    pub retried: std::sync::atomic::AtomicU64,
    /// Handshakes refused because too many were pending.
    pub refused: std::sync::atomic::AtomicU64,
    /// Handshakes that failed or did not finish in time.
    pub failed: std::sync::atomic::AtomicU64,
    /// Connections closed because their peer held too many.
    pub over_peer_limit: std::sync::atomic::AtomicU64,
}

fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(MAX_STREAMS.into())
        .receive_window(RECEIVE_WINDOW.into())
        .max_concurrent_uni_streams(0u32.into())
        .keep_alive_interval(Some(Duration::from_secs(5)))
        .max_idle_timeout(IDLE_TIMEOUT.try_into().ok());
    Arc::new(t)
}

/// The key a node's stateless reset tokens are made with: the same in every run of the node
/// (derived from its identity), so that a node that restarted tells its peers at once that
/// their connections to the node's last run are gone, and they dial afresh instead of waiting
/// out the idle timeout. Only the node can make it (it comes from a signature by its key).
struct ResetKey([u8; 32]);

impl ResetKey {
    fn of(keypair: &Keypair) -> Result<Self> {
        let sig = keypair
            .sign(b"moeswarm data plane: stateless reset key")
            .map_err(|e| Error::invalid(format!("deriving the stateless reset key: {e}")))?;
        Ok(Self(blake3::derive_key(
            "moeswarm 2026 data plane stateless reset key",
            &sig,
        )))
    }
}

/// Connection IDs of 8 random bytes.
struct RandomCids;

impl quinn::ConnectionIdGenerator for RandomCids {
    fn generate_cid(&mut self) -> quinn::ConnectionId {
        quinn::ConnectionId::new(&rand::random::<[u8; 8]>())
    }

    fn cid_len(&self) -> usize {
        8
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

impl quinn::crypto::HmacKey for ResetKey {
    fn sign(&self, data: &[u8], out: &mut [u8]) {
        let mac = blake3::keyed_hash(&self.0, data);
        let n = out.len().min(32);
        out[..n].copy_from_slice(&mac.as_bytes()[..n]);
    }

    fn signature_len(&self) -> usize {
        32
    }

    fn verify(
        &self,
        data: &[u8],
        signature: &[u8],
    ) -> std::result::Result<(), quinn::crypto::CryptoError> {
        let mac = blake3::keyed_hash(&self.0, data);
        let ok = signature.len() == 32
            && mac == blake3::Hash::from_bytes(signature.try_into().unwrap_or([0; 32]));
        ok.then_some(()).ok_or(quinn::crypto::CryptoError)
    }
}

/// A UDP socket bound to `addr`, with kernel buffers as large as the system allows up to
/// [`SOCKET_BUFFER_BYTES`].
fn udp_socket(addr: SocketAddr) -> Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .context("making the data plane's UDP socket")?;
    // Larger buffers are an improvement, not a need: a system that refuses them keeps its own.
    if let Err(e) = socket
        .set_recv_buffer_size(SOCKET_BUFFER_BYTES)
        .and_then(|()| socket.set_send_buffer_size(SOCKET_BUFFER_BYTES))
    {
        tracing::debug!("data plane socket buffers left as they were: {e}");
    }
    socket
        .bind(&addr.into())
        .with_context(|| format!("binding the data plane on {addr}"))?;
    Ok(socket.into())
}

impl DataEndpoint {
    /// Binds `addr` (port 0 picks a free one), accepting connections for `alpns`.
    pub fn bind(keypair: &Keypair, addr: SocketAddr, alpns: &[&[u8]]) -> Result<Self> {
        let mut tls = crate::tls::server_config(keypair).context("server TLS config")?;
        tls.alpn_protocols = alpns.iter().map(|a| a.to_vec()).collect();
        let crypto = QuicServerConfig::try_from(tls)
            .map_err(|e| Error::invalid(format!("QUIC server: {e}")))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server.transport_config(transport());
        let socket = udp_socket(addr)?;
        let runtime = quinn::default_runtime().context("no async runtime to run QUIC on")?;
        let mut config = quinn::EndpointConfig::new(Arc::new(ResetKey::of(keypair)?));
        // Every run takes a packet for a connection it does not know as one of a peer's
        // connections to its last run (so it answers with a reset): no CID is told apart by
        // a per-run key.
        config.cid_generator(|| Box::new(RandomCids));
        let endpoint = quinn::Endpoint::new(config, Some(server), socket, runtime)
            .with_context(|| format!("starting the data plane on {addr}"))?;
        Ok(Self {
            endpoint,
            keypair: keypair.clone(),
            accepted: Arc::default(),
            stats: Arc::default(),
            punching: Arc::default(),
        })
    }

    /// What accepting turned away so far.
    pub fn accept_stats(&self) -> &AcceptStats {
        &self.stats
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.endpoint.local_addr()?)
    }

    /// This node's PeerId.
    pub fn peer_id(&self) -> PeerId {
        self.keypair.public().to_peer_id()
    }

    /// The node's keys.
    pub fn keypair(&self) -> &Keypair {
        &self.keypair
    }

    /// Dials `addr` speaking `alpn`, and succeeds only if the other end is `peer`.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        peer: PeerId,
        alpn: &[u8],
    ) -> Result<quinn::Connection> {
        let connecting = self
            .endpoint
            .connect_with(self.client_config(peer, alpn)?, addr, "l")
            .with_context(|| format!("dialing {addr}"))?;
        let conn = tokio::time::timeout(CONNECT_DEADLINE, connecting)
            .await
            .with_context(|| format!("handshake with {peer} at {addr} timed out"))?
            .with_context(|| format!("handshake with {peer} at {addr}"))?;
        let got = peer_of(&conn)?;
        if got != peer {
            conn.close(1u32.into(), b"wrong peer");
            return Err(Error::WrongPeer {
                addr,
                expected: peer.to_string(),
                got: got.to_string(),
            });
        }
        Ok(conn)
    }

    /// Sends a QUIC Initial from this endpoint's socket to `peer` at `addr`, so that a NAT in
    /// front of this node lets `addr`'s answer — and its dial — in (a hole punch; see
    /// [`crate::punch`]). It speaks an ALPN no endpoint offers: the other end turns the
    /// handshake away, and only the packets matter. False when [`crate::punch::MAX_PUNCHES`]
    /// are in flight already, or the dial could not start.
    pub fn punch(&self, addr: SocketAddr, peer: PeerId) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let in_flight = self.punching.clone();
        if in_flight.fetch_add(1, SeqCst) >= crate::punch::MAX_PUNCHES {
            in_flight.fetch_sub(1, SeqCst);
            return false;
        }
        let connecting = self
            .client_config(peer, crate::punch::PUNCH_ALPN)
            .ok()
            .and_then(|c| self.endpoint.connect_with(c, addr, "l").ok());
        let Some(connecting) = connecting else {
            in_flight.fetch_sub(1, SeqCst);
            return false;
        };
        tokio::spawn(async move {
            let _ = tokio::time::timeout(crate::punch::PUNCH_DEADLINE, connecting).await;
            in_flight.fetch_sub(1, SeqCst);
        });
        true
    }

    /// A client configuration that pins `peer` and speaks `alpn`.
    fn client_config(&self, peer: PeerId, alpn: &[u8]) -> Result<quinn::ClientConfig> {
        let mut tls =
            crate::tls::client_config(&self.keypair, peer).context("client TLS config")?;
        tls.alpn_protocols = vec![alpn.to_vec()];
        let crypto = QuicClientConfig::try_from(tls)
            .map_err(|e| Error::invalid(format!("QUIC client: {e}")))?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(transport());
        Ok(config)
    }

    /// The next incoming connection, handshake done, with its PeerId and ALPN; `None` once the
    /// endpoint is closed. Failed handshakes, and connections of a peer over its limit, are
    /// skipped. The first call starts the accepting (handshakes run in parallel from then on).
    pub async fn accept(&self) -> Option<(quinn::Connection, PeerId, Vec<u8>)> {
        let rx = self
            .accepted
            .get_or_init(|| async {
                let (tx, rx) = mpsc::channel(16);
                tokio::spawn(accept_loop(self.endpoint.clone(), tx, self.stats.clone()));
                tokio::sync::Mutex::new(rx)
            })
            .await;
        rx.lock().await.recv().await
    }

    /// Stops accepting and closes every connection.
    pub fn close(&self) {
        self.endpoint.close(0u32.into(), b"bye");
    }
}

/// Takes incoming connections as they come, each handshake in its own task.
async fn accept_loop(
    endpoint: quinn::Endpoint,
    tx: mpsc::Sender<Accepted>,
    stats: Arc<AcceptStats>,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let pending = Arc::new(Semaphore::new(MAX_PENDING_HANDSHAKES));
    let per_peer: Arc<Mutex<HashMap<PeerId, usize>>> = Arc::default();
    while let Some(incoming) = endpoint.accept().await {
        if tx.is_closed() {
            return;
        }
        let in_progress = MAX_PENDING_HANDSHAKES - pending.available_permits();
        if in_progress >= RETRY_ABOVE && !incoming.remote_address_validated() {
            if incoming.may_retry() {
                stats.retried.fetch_add(1, Relaxed);
                let _ = incoming.retry();
            } else {
                // A retried client's token did not validate: not someone we asked.
                incoming.ignore();
            }
            continue;
        }
        let Ok(permit) = pending.clone().try_acquire_owned() else {
            stats.refused.fetch_add(1, Relaxed);
            incoming.refuse();
            continue;
        };
        let (tx, stats, per_peer) = (tx.clone(), stats.clone(), per_peer.clone());
        tokio::spawn(async move {
            let handshake = tokio::time::timeout(CONNECT_DEADLINE, incoming).await;
            drop(permit);
            let Ok(Ok(conn)) = handshake else {
                stats.failed.fetch_add(1, Relaxed);
                return;
            };
            let alpn = conn
                .handshake_data()
                .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                .and_then(|d| d.protocol)
                .unwrap_or_default();
            let Ok(peer) = peer_of(&conn) else {
                conn.close(1u32.into(), b"no identity");
                return;
            };
            {
                let mut held = per_peer.lock().unwrap_or_else(|p| p.into_inner());
                let n = held.entry(peer).or_default();
                if *n >= MAX_CONNECTIONS_PER_PEER {
                    stats.over_peer_limit.fetch_add(1, Relaxed);
                    conn.close(2u32.into(), b"too many connections");
                    return;
                }
                *n += 1;
            }
            let watched = conn.clone();
            tokio::spawn(async move {
                watched.closed().await;
                let mut held = per_peer.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(n) = held.get_mut(&peer) {
                    *n -= 1;
                    if *n == 0 {
                        held.remove(&peer);
                    }
                }
            });
            let _ = tx.send((conn, peer, alpn)).await;
        });
    }
}

/// The PeerId the other end of `conn` proved in its certificate.
pub fn peer_of(conn: &quinn::Connection) -> Result<PeerId> {
    let certs = conn
        .peer_identity()
        .and_then(|i| {
            i.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .context("the peer presented no certificate")?;
    let cert = certs.first().context("the peer presented no certificate")?;
    let parsed = libp2p_tls::certificate::parse(cert)
        .map_err(|e| Error::invalid(format!("the peer's certificate is not a libp2p one: {e}")))?;
    Ok(parsed.peer_id())
}
