//! Whether a worker's reply may be used: it answers the request exactly, comes signed when a
//! relay carried it, and carries outputs; and how a dropped one is counted and described.

use moeswarm_protocol::relay::from_hex;
use moeswarm_protocol::{DispatchReply, DispatchRequest, ReplyStatus};
use moeswarm_relay::framing::Payload;
use moeswarm_relay::PeerId;

use super::super::assign::Outbound;
use super::super::stats::{DispatchFailure, DispatchStats, DropReason};

/// A dispatch to `peer` dropped for `reason`: counted, logged, and described.
pub(super) fn dropped(
    stats: &DispatchStats,
    peer: PeerId,
    reason: DropReason,
    detail: String,
) -> DispatchFailure {
    stats.drop_reply(reason);
    tracing::debug!("dispatch to {peer} dropped ({reason:?}): {detail}");
    DispatchFailure {
        peer,
        reason,
        detail,
    }
}

/// Whether a relayed reply is signed by `peer` over itself and the request the router sent
/// (`header` with `payload`; busy and refused replies, decided on the header alone, over the
/// header's digest).
fn verify_signature(
    peer: &PeerId,
    reply: &DispatchReply,
    body: &[u8],
    header: &DispatchRequest,
    payload: &[u8],
) -> bool {
    let Some(sig) = reply.signature.as_deref().and_then(from_hex) else {
        return false;
    };
    let answered = if reply.status == ReplyStatus::Ok {
        header.digest(payload)
    } else {
        header.digest_of_header()
    };
    moeswarm_relay::identity::verify(peer, &reply.signed_bytes(body, &answered), &sig)
}

/// Whether `reply` (with `body`) from `out.peer` answers `header` exactly, is signed by it when
/// it came through a relay, and carries outputs; otherwise why not.
pub(super) fn judge(
    out: &Outbound,
    header: &DispatchRequest,
    payload: &[u8],
    reply: &DispatchReply,
    body: &Payload,
    via_relay: bool,
) -> std::result::Result<(), (DropReason, String)> {
    if let Err(e) = reply.check_answers(header) {
        return Err((
            DropReason::Mismatched,
            format!("reply from {}: {e}", out.peer),
        ));
    }
    if via_relay && !verify_signature(&out.peer, reply, &body.contiguous(), header, payload) {
        let why = format!("reply through the relay is not signed by {}", out.peer);
        return Err((DropReason::BadSignature, why));
    }
    match &reply.status {
        ReplyStatus::Ok => Ok(()),
        ReplyStatus::Busy => Err((DropReason::Busy, format!("{} is busy", out.peer))),
        ReplyStatus::Refused { reason } => Err((
            DropReason::Refused,
            format!("{} refused: {reason}", out.peer),
        )),
    }
}
