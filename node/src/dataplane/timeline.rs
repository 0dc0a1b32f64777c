//! Where one dispatch's round trip goes: a [`Mark`] at each hand-off on the router and on the
//! worker, emitted as a `tracing` event of target [`TARGET`] at level TRACE that carries the
//! ticket's `seq`, the mark's `name` and, for a mark taken before the ticket was known,
//! `ago_ns` (how long before the event it happened).
//!
//! Nothing is collected here: a subscriber that wants the timeline (the dispatch benchmark)
//! enables the target and stamps each event as it comes; for everyone else a mark costs the
//! check `tracing` makes of a disabled event. Router and worker in one process share a clock,
//! so their marks for one ticket form one timeline.

use std::time::Duration;

/// The `tracing` target of every mark.
pub const TARGET: &str = "moeswarm::dispatch::timeline";

/// One point of a dispatch's round trip, in the order they happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mark {
    /// Router: the dispatch header is built and the rows gathered from the layer's input,
    /// encoded as wire bytes straight into the payload.
    RowsGathered,
    /// Router: a stream to the worker is open.
    StreamOpened,
    /// Router: the frame head (header and lengths) is encoded.
    HeadEncoded,
    /// Router: the whole frame is written to the stream and the stream finished.
    RequestWritten,
    /// Worker: the stream was accepted (stamped when its header arrived, with `ago_ns`).
    StreamAccepted,
    /// Worker: the header is read and parsed.
    HeadRead,
    /// Worker: the dispatch is checked and admitted.
    Admitted,
    /// Worker: the payload is read.
    PayloadRead,
    /// Worker: the compute began on a blocking thread.
    ComputeBegan,
    /// Worker: the payload is decoded from wire bytes.
    PayloadDecoded,
    /// Worker: every slab's outputs are computed.
    ComputeEnded,
    /// Worker: the outputs are back on the runtime.
    ComputeReturned,
    /// Worker: the outputs are encoded as wire bytes with their frame head.
    ReplyEncoded,
    /// Worker: the reply frame is written.
    ReplyWritten,
    /// Router: the reply's header is read and parsed.
    ReplyHeadRead,
    /// Router: the reply's payload is read.
    ReplyRead,
    /// Router: the reply is judged to answer the ticket.
    ReplyJudged,
    /// Router: the outputs are decoded and split by slab.
    OutputsDecoded,
}

impl Mark {
    /// Every mark, in the order of a round trip.
    pub const ALL: [Mark; 18] = [
        Mark::RowsGathered,
        Mark::StreamOpened,
        Mark::HeadEncoded,
        Mark::RequestWritten,
        Mark::StreamAccepted,
        Mark::HeadRead,
        Mark::Admitted,
        Mark::PayloadRead,
        Mark::ComputeBegan,
        Mark::PayloadDecoded,
        Mark::ComputeEnded,
        Mark::ComputeReturned,
        Mark::ReplyEncoded,
        Mark::ReplyWritten,
        Mark::ReplyHeadRead,
        Mark::ReplyRead,
        Mark::ReplyJudged,
        Mark::OutputsDecoded,
    ];

    /// The mark's name in events.
    pub fn name(self) -> &'static str {
        match self {
            Mark::RowsGathered => "rows_gathered",
            Mark::StreamOpened => "stream_opened",
            Mark::HeadEncoded => "head_encoded",
            Mark::RequestWritten => "request_written",
            Mark::StreamAccepted => "stream_accepted",
            Mark::HeadRead => "head_read",
            Mark::Admitted => "admitted",
            Mark::PayloadRead => "payload_read",
            Mark::ComputeBegan => "compute_began",
            Mark::PayloadDecoded => "payload_decoded",
            Mark::ComputeEnded => "compute_ended",
            Mark::ComputeReturned => "compute_returned",
            Mark::ReplyEncoded => "reply_encoded",
            Mark::ReplyWritten => "reply_written",
            Mark::ReplyHeadRead => "reply_head_read",
            Mark::ReplyRead => "reply_read",
            Mark::ReplyJudged => "reply_judged",
            Mark::OutputsDecoded => "outputs_decoded",
        }
    }

    /// The mark named `name` in an event.
    pub fn from_name(name: &str) -> Option<Mark> {
        Mark::ALL.into_iter().find(|m| m.name() == name)
    }
}

/// Marks `mark` of the dispatch with ticket sequence `seq`, now.
pub fn mark(seq: u64, mark: Mark) {
    tracing::trace!(target: TARGET, seq, name = mark.name());
}

/// Marks `mark` of the dispatch `seq` as having happened `ago` before now.
pub fn mark_ago(seq: u64, mark: Mark, ago: Duration) {
    let ago_ns = u64::try_from(ago.as_nanos()).unwrap_or(u64::MAX);
    tracing::trace!(target: TARGET, seq, name = mark.name(), ago_ns);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mark_is_found_by_its_name_and_they_run_in_order() {
        for m in Mark::ALL {
            assert_eq!(Mark::from_name(m.name()), Some(m));
        }
        assert!(Mark::ALL.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(Mark::from_name("nothing"), None);
    }
}
