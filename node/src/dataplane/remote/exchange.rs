//! One dispatch's exchange with a worker: the stream opened (on a pooled connection, dialed
//! afresh once when the pool's one turns out gone), the request written, the reply read and
//! judged, each under the dispatch's one deadline.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use moeswarm_protocol::{DispatchReply, DispatchRequest, ReplyStatus};
use moeswarm_relay::framing::{
    encode_head, read_frame, read_head, read_payload, write_encoded, Payload,
};

use super::reply::{dropped, judge};
use super::{RemoteExecutor, LATE_WATCH, REFUSAL_WAIT};
use crate::dataplane::assign::Outbound;
use crate::dataplane::connections::WorkerStream;
use crate::dataplane::stats::{DispatchFailure, DropReason};
use crate::dataplane::timeline::{mark, Mark};

/// Why one attempt failed: the reason it is to be counted under, and what happened.
type Failed = (DropReason, String);

impl RemoteExecutor {
    /// Sends `header` and `payload` to `out.peer` and reads its answer: the reply's body, or
    /// the typed failure (counted in the stats by its reason).
    pub(super) async fn exchange(
        &self,
        out: &Outbound,
        header: &DispatchRequest,
        payload: &Bytes,
    ) -> Result<Payload, DispatchFailure> {
        // One deadline for the whole exchange: a worker that never reads, or freezes
        // mid-reply, costs at most the deadline.
        let end = tokio::time::Instant::now() + self.retry.deadline;
        let (mut result, pooled) = self.attempt(out, header, payload, end).await;
        // The pooled connection was gone (the worker restarted, and its stateless reset said
        // so): dialed afresh, once, within the same deadline.
        let gone = pooled.is_some_and(|c| c.close_reason().is_some());
        if gone && matches!(result, Err((DropReason::Failed, _))) {
            self.connections.forget(out.peer);
            result = self.attempt(out, header, payload, end).await.0;
        }
        result.map_err(|(reason, why)| dropped(&self.stats, out.peer, reason, why))
    }

    /// A stream opened to `out.peer` and one exchange on it: the reply's body or why not (not
    /// yet counted), and the pooled connection the stream was opened on, if one was reused.
    async fn attempt(
        &self,
        out: &Outbound,
        header: &DispatchRequest,
        payload: &Bytes,
        end: tokio::time::Instant,
    ) -> (Result<Payload, Failed>, Option<quinn::Connection>) {
        let opened =
            tokio::time::timeout_at(end, self.connections.open_stream(out.peer, &out.route));
        match opened.await {
            Err(_) => {
                let why = format!("no stream to {} in time", out.peer);
                (Err((DropReason::Failed, why)), None)
            }
            Ok(Err(e)) => (Err((DropReason::Failed, format!("{e:#}"))), None),
            Ok(Ok(stream)) => {
                let pooled = stream.pooled.clone();
                let result = self.exchange_on(out, stream, header, payload, end).await;
                (result, pooled)
            }
        }
    }

    /// One exchange on `stream`, until `end`: the reply's body, or why it failed (not yet
    /// counted).
    async fn exchange_on(
        &self,
        out: &Outbound,
        stream: WorkerStream,
        header: &DispatchRequest,
        payload: &Bytes,
        end: tokio::time::Instant,
    ) -> Result<Payload, Failed> {
        let stats = &self.stats;
        let deadline = self.retry.deadline;
        let fail = |reason: DropReason, detail: String| (reason, detail);
        let WorkerStream {
            mut send,
            mut recv,
            via_relay,
            ..
        } = stream;
        let seq = header.ticket.seq;
        mark(seq, Mark::StreamOpened);
        let head = match encode_head(header, payload.len() as u64) {
            Ok(h) => h,
            Err(e) => return Err(fail(DropReason::Failed, format!("{e:#}"))),
        };
        mark(seq, Mark::HeadEncoded);
        stats.sent.fetch_add(1, Ordering::Relaxed);
        stats
            .bytes_out
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        let write_failed = match tokio::time::timeout_at(
            end,
            write_encoded(&mut send, head, vec![payload.clone()]),
        )
        .await
        {
            Ok(Ok(())) => None,
            // A worker that refuses once it has read the header (busy, over its share) stops
            // the stream while the payload is still going out; its answer is there to read.
            Ok(Err(e)) => Some(e),
            Err(_) => {
                let _ = send.reset(0u32.into());
                let why = format!("{} did not take the dispatch within {deadline:?}", out.peer);
                return Err(fail(DropReason::Failed, why));
            }
        };
        let end = match &write_failed {
            Some(_) => end.min(tokio::time::Instant::now() + REFUSAL_WAIT),
            None => {
                let _ = send.finish();
                mark(seq, Mark::RequestWritten);
                end
            }
        };
        let expected = |h: &DispatchReply| -> moeswarm_relay::Result<u64> {
            h.validate()?;
            Ok(if h.status == ReplyStatus::Ok {
                h.payload_len()
            } else {
                0
            })
        };
        let frame = tokio::time::timeout_at(end, read_reply(&mut recv, expected, seq)).await;
        let frame = match (frame, write_failed) {
            // A refusal read after a failed write stands; anything else, the write's error.
            (Ok(Ok(Some(f))), Some(_)) if f.0.status != ReplyStatus::Ok => Ok(Ok(Some(f))),
            (_, Some(e)) => {
                let why = format!("sending the dispatch to {}: {e:#}", out.peer);
                return Err(fail(DropReason::Failed, why));
            }
            (frame, None) => frame,
        };
        let (reply, body) = match frame {
            Err(_) => {
                // Watch for the reply a while, to count it when it comes late.
                let st = stats.clone();
                tokio::spawn(async move {
                    let late = tokio::time::timeout(
                        LATE_WATCH,
                        read_frame::<DispatchReply>(&mut recv, expected),
                    )
                    .await;
                    if let Ok(Ok(Some(_))) = late {
                        st.drop_reply(DropReason::Late);
                    }
                });
                let why = format!("{} did not answer within {deadline:?}", out.peer);
                return Err(fail(DropReason::Failed, why));
            }
            Ok(Err(e)) => {
                // A frame that breaks the protocol is malformed; a stream or connection that
                // broke (a worker that went away) is a failure.
                let reason = if e.broke_protocol() {
                    DropReason::Malformed
                } else {
                    DropReason::Failed
                };
                return Err(fail(reason, format!("reply from {}: {e:#}", out.peer)));
            }
            Ok(Ok(None)) => {
                let why = format!("{} closed the stream without answering", out.peer);
                return Err(fail(DropReason::Failed, why));
            }
            Ok(Ok(Some(f))) => f,
        };
        if let Err((reason, why)) = judge(out, header, payload, &reply, &body, via_relay) {
            return Err(fail(reason, why));
        }
        mark(seq, Mark::ReplyJudged);
        // Anything more on this stream is a second answer: dropped and counted.
        let st = stats.clone();
        tokio::spawn(async move {
            let more =
                tokio::time::timeout(LATE_WATCH, read_frame::<DispatchReply>(&mut recv, expected))
                    .await;
            if let Ok(Ok(Some(_))) = more {
                st.drop_reply(DropReason::Duplicate);
            }
        });
        Ok(body)
    }
}

/// Reads a reply frame as [`read_frame`] does, marking when its head and its payload are in.
async fn read_reply(
    recv: &mut quinn::RecvStream,
    expected: impl FnOnce(&DispatchReply) -> moeswarm_relay::Result<u64>,
    seq: u64,
) -> moeswarm_relay::Result<Option<(DispatchReply, Payload)>> {
    let Some((reply, declared)) = read_head::<DispatchReply>(recv).await? else {
        return Ok(None);
    };
    mark(seq, Mark::ReplyHeadRead);
    let want = expected(&reply)?;
    let body = read_payload(recv, declared, want).await?;
    mark(seq, Mark::ReplyRead);
    Ok(Some((reply, body)))
}
