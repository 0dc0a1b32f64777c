//! Hole punching through the relay's signalling: a direct QUIC path to a worker behind a NAT.
//!
//! Both ends are registered with the relay, so the relay sees the address each one's packets
//! come from (their NATs' mappings of their data-plane sockets). A router asks for a punch
//! ([`RelayMessage::Punch`]); the relay tells the worker where the router's packets come from
//! ([`RelayMessage::PunchTo`]), the worker sends a QUIC Initial there from its data-plane socket
//! ([`DataEndpoint::punch`]) — which opens its NAT to the router's address — and says so
//! ([`RelayMessage::Punched`]); the relay then answers the router with where the worker's packets
//! come from ([`RelayMessage::PunchAt`]), and the router dials it there. Behind a NAT that maps
//! each destination apart ("symmetric"), the worker's packets to the router leave from another
//! port than the relay saw, the dial gets no answer, and the router stays with the relay.
//!
//! Bounded: a punch takes one of the worker's relayed-stream slots and one of the caller's
//! stream opens (the relay's limits), every step has [`PUNCH_DEADLINE`], and a worker runs at
//! most [`MAX_PUNCHES`] punches at once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use libp2p_identity::PeerId;
use moeswarm_protocol::relay::RelayMessage;

use crate::endpoint::DataEndpoint;
use crate::error::{bail, Context, Error, Result};
use crate::framing::{read_control, write_control};
use crate::registry::Registry;
use crate::relay::{RelayLimits, RelayStats};

/// How long each step of a punch may take: the worker's answer, the router's dial.
pub const PUNCH_DEADLINE: Duration = Duration::from_secs(2);
/// Punches one worker sends at once; beyond that it answers that it is busy.
pub const MAX_PUNCHES: usize = 8;
/// The ALPN of a punch's packets: no endpoint offers it, so no connection comes of them.
pub const PUNCH_ALPN: &[u8] = b"moeswarm-punch/1";

/// An `ip:port` a peer may be asked to send to, or why not.
pub fn parse_punch_addr(s: &str) -> Result<SocketAddr> {
    let a: SocketAddr = s
        .parse()
        .map_err(|_| Error::invalid(format!("{s:?} is not an ip:port")))?;
    if a.ip().is_unspecified() || a.ip().is_multicast() || a.port() == 0 {
        bail!("{a} names no one to send to");
    }
    Ok(a)
}

/// The relay's side: introduces `from` (whose packets come from `from_addr`) to `target`, on
/// the caller's stream `send`/`recv`. Refusals are written to the caller, with the reason.
#[allow(clippy::too_many_arguments)] // one introduction: both ends, the stream, the relay's state
pub(crate) async fn introduce(
    from: PeerId,
    from_addr: SocketAddr,
    target: &str,
    mut send: quinn::SendStream,
    registry: Registry,
    stats: Arc<RelayStats>,
    limits: RelayLimits,
) -> Result<()> {
    let (target, _slot, conn) =
        crate::relay::take_slot(from, target, &mut send, &registry, &stats, &limits).await?;
    let ask = async {
        let (mut wsend, mut wrecv) = conn.open_bi().await?;
        let to = RelayMessage::PunchTo {
            peer: from.to_string(),
            addr: from_addr.to_string(),
        };
        write_control(&mut wsend, &to).await?;
        let answer = read_control(&mut wrecv).await?;
        let _ = wsend.finish();
        Ok::<_, Error>(answer)
    };
    let why = match tokio::time::timeout(PUNCH_DEADLINE, ask).await {
        Ok(Ok(RelayMessage::Punched)) => {
            let at = RelayMessage::PunchAt {
                addr: conn.remote_address().to_string(),
            };
            write_control(&mut send, &at).await?;
            let _ = send.finish();
            return Ok(());
        }
        Ok(Ok(RelayMessage::Refused { reason })) => format!("{target}: {reason}"),
        Ok(Ok(other)) => format!("{target} answered {other:?}"),
        Ok(Err(e)) => format!("{target} did not take the punch: {e:#}"),
        Err(_) => format!("{target} did not punch within {PUNCH_DEADLINE:?}"),
    };
    crate::relay::refuse(&mut send, &stats, why).await;
    Ok(())
}

/// The worker's side: on the relay's stream, `peer` at `addr` will dial; send there and say so.
pub(crate) async fn answer(
    endpoint: &DataEndpoint,
    peer: &str,
    addr: &str,
    mut send: quinn::SendStream,
) -> Result<()> {
    let reply = match (peer.parse::<PeerId>(), parse_punch_addr(addr)) {
        (Ok(peer), Ok(addr)) => {
            if endpoint.punch(addr, peer) {
                RelayMessage::Punched
            } else {
                RelayMessage::Refused {
                    reason: format!("{MAX_PUNCHES} punches in flight already"),
                }
            }
        }
        (Err(_), _) => RelayMessage::Refused {
            reason: format!("{peer:?} is not a PeerId"),
        },
        (_, Err(e)) => RelayMessage::Refused {
            reason: format!("{e:#}"),
        },
    };
    write_control(&mut send, &reply).await?;
    let _ = send.finish();
    Ok(())
}

/// The router's side: asks the relay on `conn` to introduce this node to `target`; the
/// address to dial `target` at.
pub(crate) async fn ask(conn: &quinn::Connection, target: PeerId) -> Result<SocketAddr> {
    let run = async {
        let (mut send, mut recv) = conn.open_bi().await?;
        let punch = RelayMessage::Punch {
            target: target.to_string(),
        };
        write_control(&mut send, &punch).await?;
        let _ = send.finish();
        match read_control(&mut recv).await? {
            RelayMessage::PunchAt { addr } => parse_punch_addr(&addr),
            RelayMessage::Refused { reason } => Err(Error::RelayRefused(reason)),
            other => bail!("relay sent {other:?}"),
        }
    };
    tokio::time::timeout(2 * PUNCH_DEADLINE, run)
        .await
        .context("the relay's introduction timed out")?
}
