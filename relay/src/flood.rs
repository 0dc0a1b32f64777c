//! A handshake flood, to test that endpoints stay open under one (test builds only).
//!
//! Each tick a throwaway quinn client starts a handshake towards a socket of the flood's own;
//! the flood forwards the client's packets to the target from another socket and never
//! answers what comes back. The target sees a stream of genuine QUIC Initials, each opening a
//! handshake that will never finish: what a hostile peer sends for the price of one packet.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use libp2p_identity::Keypair;
use tokio::net::UdpSocket;

use crate::endpoint::DataEndpoint;
use crate::error::Result;

/// A running flood; it stops when dropped.
pub struct HandshakeFlood {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Packets sent to the targets.
    pub packets: Arc<AtomicU64>,
}

fn throwaway_key() -> Keypair {
    let mut seed = [0u8; 32];
    rand::fill(&mut seed);
    Keypair::ed25519_from_bytes(seed).expect("32 bytes make a key")
}

impl HandshakeFlood {
    /// Starts one handshake every `every` at each `(address, ALPN)` target.
    pub async fn start(targets: &[(SocketAddr, Vec<u8>)], every: Duration) -> Result<Self> {
        let local: SocketAddr = "127.0.0.1:0".parse().expect("an address");
        let client = DataEndpoint::bind(&throwaway_key(), local, &[])?;
        let out = Arc::new(UdpSocket::bind(local).await?);
        let packets = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for (target, alpn) in targets.iter().cloned() {
            let sniffer = UdpSocket::bind(local).await?;
            let at = sniffer.local_addr()?;
            let (out, n) = (out.clone(), packets.clone());
            tasks.push(tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok((len, _)) = sniffer.recv_from(&mut buf).await {
                    if out.send_to(&buf[..len], target).await.is_ok() {
                        n.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    let (client, alpn) = (client.clone(), alpn.clone());
                    let nobody = throwaway_key().public().to_peer_id();
                    // Never completes: the sniffer does not answer. Dropped at its deadline.
                    tokio::spawn(async move {
                        let _ = client.connect(at, nobody, &alpn).await;
                    });
                }
            }));
        }
        // Whatever the targets answer is read and dropped.
        let drain = out.clone();
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while drain.recv_from(&mut buf).await.is_ok() {}
        }));
        Ok(Self { tasks, packets })
    }
}

impl Drop for HandshakeFlood {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
