//! QUIC endpoints whose certificates carry the node's libp2p identity.
//!
//! Certificates follow libp2p's TLS scheme (`libp2p-tls`): self-signed, with an extension
//! signed by the node's ed25519 key. A client pins the PeerId it expects (the one the coverage
//! named), so a connection to anyone else fails in the handshake; a server learns each
//! client's PeerId from its certificate ([`peer_of`]). Only this project's ALPN names are
//! spoken.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{bail, Context, Error, Result};
use libp2p_identity::{Keypair, PeerId};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};

/// How long a handshake may take.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(10);
/// A connection with nothing on it for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Streams a peer may have open on one connection at once.
pub const MAX_STREAMS: u32 = 256;

/// A quinn endpoint that accepts and dials data-plane connections.
#[derive(Clone)]
pub struct DataEndpoint {
    endpoint: quinn::Endpoint,
    keypair: Keypair,
}

fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(MAX_STREAMS.into())
        .max_concurrent_uni_streams(0u32.into())
        .keep_alive_interval(Some(Duration::from_secs(5)))
        .max_idle_timeout(IDLE_TIMEOUT.try_into().ok());
    Arc::new(t)
}

impl DataEndpoint {
    /// Binds `addr` (port 0 picks a free one), accepting connections for `alpns`.
    pub fn bind(keypair: &Keypair, addr: SocketAddr, alpns: &[&[u8]]) -> Result<Self> {
        let mut tls = libp2p_tls::make_server_config(keypair).context("server TLS config")?;
        tls.alpn_protocols = alpns.iter().map(|a| a.to_vec()).collect();
        let crypto = QuicServerConfig::try_from(tls)
            .map_err(|e| Error::invalid(format!("QUIC server: {e}")))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server.transport_config(transport());
        let endpoint = quinn::Endpoint::server(server, addr)
            .with_context(|| format!("binding the data plane on {addr}"))?;
        Ok(Self {
            endpoint,
            keypair: keypair.clone(),
        })
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
        let mut tls = libp2p_tls::make_client_config(&self.keypair, Some(peer))
            .context("client TLS config")?;
        tls.alpn_protocols = vec![alpn.to_vec()];
        let crypto = QuicClientConfig::try_from(tls)
            .map_err(|e| Error::invalid(format!("QUIC client: {e}")))?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(transport());
        let connecting = self
            .endpoint
            .connect_with(config, addr, "l")
            .with_context(|| format!("dialing {addr}"))?;
        let conn = tokio::time::timeout(CONNECT_DEADLINE, connecting)
            .await
            .with_context(|| format!("handshake with {peer} at {addr} timed out"))?
            .with_context(|| format!("handshake with {peer} at {addr}"))?;
        let got = peer_of(&conn)?;
        if got != peer {
            conn.close(1u32.into(), b"wrong peer");
            bail!("{addr} is {got}, not {peer}");
        }
        Ok(conn)
    }

    /// The next incoming connection, handshake done, with its PeerId and ALPN; `None` once the
    /// endpoint is closed. Failed handshakes are skipped.
    pub async fn accept(&self) -> Option<(quinn::Connection, PeerId, Vec<u8>)> {
        loop {
            let incoming = self.endpoint.accept().await?;
            let Ok(Ok(conn)) = tokio::time::timeout(CONNECT_DEADLINE, incoming).await else {
                continue;
            };
            let alpn = conn
                .handshake_data()
                .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                .and_then(|d| d.protocol)
                .unwrap_or_default();
            match peer_of(&conn) {
                Ok(peer) => return Some((conn, peer, alpn)),
                Err(_) => conn.close(1u32.into(), b"no identity"),
            }
        }
    }

    /// Stops accepting and closes every connection.
    pub fn close(&self) {
        self.endpoint.close(0u32.into(), b"bye");
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
