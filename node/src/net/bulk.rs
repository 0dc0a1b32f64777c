//! Blob ranges over plain TCP: the bytes of a fetch off the encrypted libp2p stream.
//!
//! A blob's bytes need integrity, not secrecy: they are content-addressed, and the receiver
//! checks every 16 KiB of a range against the blob's id as it arrives. So a node also answers
//! range requests on a plain TCP port beside its libp2p listeners ([`BulkServer`]), in the
//! blob exchange's own frames, one request after another on a connection. A fetcher learns
//! the port over libp2p (an authenticated [`ExchangeRequest::BulkPort`]), uses it only at an
//! address from the peer's own signed record, and asks there first ([`BulkLanes`]).
//!
//! Nothing on such a connection is trusted more than the rest: what fails there — a broken
//! connection, a refusal, bytes that fail verification — turns the lane off for that peer for
//! a while and the range is asked again over libp2p, whose answers are judged as before. Nobody
//! is penalized for bytes on a path anyone between could have rewritten.
//!
//! What a client can make a server do is bounded: [`MAX_CONNECTIONS`] connections (more are
//! closed at once), [`MAX_ANSWERING`] answers being built at a time (each at most one range
//! and its proof), a request frame of at most the protocol's limit, [`IDLE`] between requests
//! and [`DEADLINE`] to send a request or take an answer.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p::PeerId;
use moeswarm_model::store::Store;
use moeswarm_protocol::exchange::{MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES};
use moeswarm_protocol::{ExchangeRequest, ExchangeResponse, ResponseHeader};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::error::{bail, Context, Error, Result};
use crate::net::serve::{answer, ServeFault};

/// Connections a server holds at once; more are closed as they come.
pub const MAX_CONNECTIONS: usize = 64;
/// Answers a server builds at once (each reads and proves one range on a blocking thread).
pub const MAX_ANSWERING: usize = 8;
/// A connection with no request for this long is closed.
pub const IDLE: Duration = Duration::from_secs(30);
/// Time for a started request to arrive whole, for an answer to be sent, and for a client to
/// get its answer.
pub const DEADLINE: Duration = Duration::from_secs(10);
/// Time a client gives a connection to open.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(2);
/// How long a lane that failed stays off for its peer.
pub const OFF_FOR: Duration = Duration::from_secs(60);
/// Idle connections a client keeps to one address.
pub const MAX_IDLE_PER_ADDR: usize = 16;

/// A node's plain range service; stops when dropped, its connections with it.
pub struct BulkServer {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for BulkServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl BulkServer {
    /// Listens on `addr` (port 0: a free one) and answers range requests from `store`.
    pub async fn bind(addr: SocketAddr, store: Arc<Store>, fault: ServeFault) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the plain range service on {addr}"))?;
        let port = listener.local_addr()?.port();
        let task = tokio::spawn(accept_loop(listener, store, fault));
        Ok(Self { port, task })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }
}

async fn accept_loop(listener: TcpListener, store: Arc<Store>, fault: ServeFault) {
    let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let answering = Arc::new(Semaphore::new(MAX_ANSWERING));
    // Owned here, so that stopping the service ends its connections too.
    let mut served = tokio::task::JoinSet::new();
    loop {
        while served.try_join_next().is_some() {}
        let sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                // Out of descriptors, say: wait a little instead of spinning.
                tracing::debug!("plain range service: accepting failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = connections.clone().try_acquire_owned() else {
            continue; // over the limit: closed at once
        };
        let (store, answering) = (store.clone(), answering.clone());
        served.spawn(async move {
            if let Err(e) = serve_connection(sock, &store, fault, &answering).await {
                tracing::debug!("plain range service: connection ended: {e:#}");
            }
            drop(slot);
        });
    }
}

async fn serve_connection(
    mut sock: TcpStream,
    store: &Arc<Store>,
    fault: ServeFault,
    answering: &Arc<Semaphore>,
) -> Result<()> {
    sock.set_nodelay(true)?;
    loop {
        let mut len = [0u8; 4];
        match tokio::time::timeout(IDLE, sock.read_exact(&mut len)).await {
            Err(_) => return Ok(()),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(r) => r?,
        };
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_REQUEST_BYTES {
            bail!("a request frame of {len} bytes, over the limit of {MAX_REQUEST_BYTES}");
        }
        let mut body = vec![0u8; len];
        tokio::time::timeout(DEADLINE, sock.read_exact(&mut body))
            .await
            .context("a request that did not arrive in time")??;
        let res = match ExchangeRequest::decode(&body)? {
            req @ ExchangeRequest::Range { .. } => {
                let _permit = tokio::time::timeout(DEADLINE, answering.acquire())
                    .await
                    .context("too busy to answer in time")?
                    .map_err(|_| Error::invalid("the service is stopping"))?;
                let store = store.clone();
                tokio::task::spawn_blocking(move || answer(&store, &req, fault.on_bulk_lane()))
                    .await
                    .context("answering a range")?
            }
            _ => ExchangeResponse::bare(ResponseHeader::Refused {
                reason: "only ranges are answered on this port; ask over libp2p".into(),
            }),
        };
        tokio::time::timeout(DEADLINE, write_response(&mut sock, &res))
            .await
            .context("an answer not taken in time")??;
    }
}

/// Writes `res` as one frame without copying its payload.
async fn write_response(sock: &mut TcpStream, res: &ExchangeResponse) -> std::io::Result<()> {
    let head = res.encode_head();
    let mut start = Vec::with_capacity(4 + head.len());
    start.extend_from_slice(&((head.len() + res.payload.len()) as u32).to_le_bytes());
    start.extend_from_slice(&head);
    sock.write_all(&start).await?;
    sock.write_all(&res.payload).await
}

/// Reads one response frame, its payload straight into its own buffer, every length checked
/// before anything is allocated for it.
async fn read_response(sock: &mut TcpStream) -> Result<ExchangeResponse> {
    let mut lens = [0u8; 8];
    sock.read_exact(&mut lens).await?;
    let body_len = u32::from_le_bytes([lens[0], lens[1], lens[2], lens[3]]) as usize;
    if body_len > MAX_RESPONSE_BYTES {
        bail!("an answer of {body_len} bytes, over the limit of {MAX_RESPONSE_BYTES}");
    }
    let header_len = ExchangeResponse::header_len([lens[4], lens[5], lens[6], lens[7]])?;
    let payload_len = body_len
        .checked_sub(4 + header_len)
        .context("an answer shorter than its header")?;
    let mut header = vec![0u8; header_len];
    sock.read_exact(&mut header).await?;
    let mut payload = vec![0u8; payload_len];
    sock.read_exact(&mut payload).await?;
    Ok(ExchangeResponse::from_parts(&header, payload)?)
}

/// Whether a peer's lane can be used.
#[derive(Debug, Clone, Copy)]
enum Lane {
    /// Its plain range service, at an address of its signed record.
    At(SocketAddr),
    /// Not to be used before then (it failed, or the peer has none).
    Off(Instant),
}

/// The plain range services of peers, as a fetcher knows them, and connections to them kept
/// for the next range.
#[derive(Default)]
pub struct BulkLanes {
    lanes: Mutex<HashMap<PeerId, Lane>>,
    idle: Mutex<HashMap<SocketAddr, Vec<TcpStream>>>,
}

impl BulkLanes {
    /// Where `peer`'s lane is, when it is known and on.
    pub fn at(&self, peer: &PeerId) -> Option<SocketAddr> {
        match self.lanes.lock().ok()?.get(peer) {
            Some(Lane::At(addr)) => Some(*addr),
            _ => None,
        }
    }

    /// Whether `peer` is worth asking for its port: neither known nor off.
    pub fn unknown(&self, peer: &PeerId) -> bool {
        let now = Instant::now();
        self.lanes
            .lock()
            .map(|l| match l.get(peer) {
                None => true,
                Some(Lane::Off(until)) => *until <= now,
                Some(Lane::At(_)) => false,
            })
            .unwrap_or(false)
    }

    /// Records what `peer` said of its lane: its port at `ip`, or none.
    pub fn learn(&self, peer: PeerId, at: Option<SocketAddr>) {
        let lane = at.map_or(Lane::Off(Instant::now() + OFF_FOR), Lane::At);
        if let Ok(mut l) = self.lanes.lock() {
            l.insert(peer, lane);
        }
    }

    /// Turns `peer`'s lane off for [`OFF_FOR`] (its connections are dropped).
    pub fn turn_off(&self, peer: PeerId) {
        let Ok(mut lanes) = self.lanes.lock() else {
            return;
        };
        if let Some(Lane::At(addr)) = lanes.insert(peer, Lane::Off(Instant::now() + OFF_FOR)) {
            if let Ok(mut idle) = self.idle.lock() {
                idle.remove(&addr);
            }
        }
    }

    /// Asks `addr` for a range, on a kept connection or a new one, within [`DEADLINE`]. A
    /// kept connection the server has closed meanwhile (it closes idle ones) costs one more try
    /// on a new one, not the lane.
    pub async fn range(&self, addr: SocketAddr, req: &ExchangeRequest) -> Result<ExchangeResponse> {
        let kept = self
            .idle
            .lock()
            .ok()
            .and_then(|mut idle| idle.get_mut(&addr).and_then(Vec::pop));
        let body = req.encode();
        let (sock, res) = match kept {
            Some(sock) => match ask(sock, addr, &body).await {
                Ok(done) => done,
                Err(e) => {
                    tracing::debug!("a kept connection to {addr} failed ({e:#}): a new one");
                    ask(connect(addr).await?, addr, &body).await?
                }
            },
            None => ask(connect(addr).await?, addr, &body).await?,
        };
        if let Ok(mut idle) = self.idle.lock() {
            let kept = idle.entry(addr).or_default();
            if kept.len() < MAX_IDLE_PER_ADDR {
                kept.push(sock);
            }
        }
        Ok(res)
    }
}

async fn connect(addr: SocketAddr) -> Result<TcpStream> {
    let sock = tokio::time::timeout(CONNECT_DEADLINE, TcpStream::connect(addr))
        .await
        .with_context(|| format!("connecting to {addr} timed out"))?
        .with_context(|| format!("connecting to {addr}"))?;
    sock.set_nodelay(true)?;
    Ok(sock)
}

/// One request frame (`body`) and its answer on `sock`, within [`DEADLINE`].
async fn ask(
    mut sock: TcpStream,
    addr: SocketAddr,
    body: &[u8],
) -> Result<(TcpStream, ExchangeResponse)> {
    let exchange = async {
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(body);
        sock.write_all(&frame).await?;
        read_response(&mut sock).await
    };
    let res = tokio::time::timeout(DEADLINE, exchange)
        .await
        .with_context(|| format!("{addr} did not answer in time"))??;
    Ok((sock, res))
}

/// The address of a peer's lane: `port` at the first IP of its record's direct addresses (a
/// relayed address names the relay's IP, not the peer's).
pub fn lane_addr(record_addrs: &[libp2p::Multiaddr], port: u16) -> Option<SocketAddr> {
    use libp2p::multiaddr::Protocol;
    record_addrs
        .iter()
        .filter(|a| !a.iter().any(|p| matches!(p, Protocol::P2pCircuit)))
        .find_map(|a| {
            a.iter().find_map(|p| match p {
                Protocol::Ip4(ip) => Some(SocketAddr::new(IpAddr::V4(ip), port)),
                Protocol::Ip6(ip) => Some(SocketAddr::new(IpAddr::V6(ip), port)),
                _ => None,
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_is_at_the_first_direct_ip_of_the_record_never_at_a_relay() {
        let a = |s: &str| s.parse::<libp2p::Multiaddr>().unwrap();
        let relayed = a("/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWJzqvdnZeLWp2zFkehosyXvnJqvNU68T7FwQKGbNoucqd/p2p-circuit");
        let direct = a("/ip4/192.168.1.7/udp/4002/quic-v1");
        assert_eq!(
            lane_addr(&[relayed.clone(), direct], 9000),
            Some("192.168.1.7:9000".parse().unwrap())
        );
        assert_eq!(lane_addr(&[relayed], 9000), None);
        assert_eq!(
            lane_addr(&[a("/ip6/::1/tcp/1")], 7),
            Some("[::1]:7".parse().unwrap())
        );
        assert_eq!(lane_addr(&[a("/dns4/example.org/tcp/1")], 7), None);
    }
}
