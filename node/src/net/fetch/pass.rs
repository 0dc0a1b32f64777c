//! One blob's transfer: its missing ranges handed out to its sources, each answer verified and
//! kept or asked again elsewhere (see the parent module).

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use indicatif::ProgressBar;
use libp2p::PeerId;
use moeswarm_model::store::transfer::PartialBlob;
use moeswarm_protocol::{ExchangeRequest, ExchangeResponse, ResponseHeader};

use super::{range_reply_ok, BlobFetch, Fetcher};
use super::{MAX_IN_FLIGHT, MAX_PEER_FAILURES, PIECE_BYTES};
use crate::error::{bail, Error, Result};
use crate::net::stats::RequestFailure;

/// What a blob's transfer knows as it goes.
struct Pass {
    /// Ranges still to ask for, first first.
    queue: VecDeque<Range<u64>>,
    /// Sources still worth asking.
    usable: Vec<PeerId>,
    /// Failed requests (not lies) by source.
    failures: HashMap<PeerId, u32>,
    last_error: String,
    report: BlobFetch,
}

impl Pass {
    fn drop_source(&mut self, peer: PeerId) {
        self.usable.retain(|p| *p != peer);
    }

    /// Counts a failed request against `peer` (`fatal`: it will not get better), dropping it
    /// after [`MAX_PEER_FAILURES`]; how many it has now.
    fn failed(&mut self, peer: PeerId, fatal: bool) -> u32 {
        let n = self.failures.entry(peer).or_default();
        *n = if fatal { MAX_PEER_FAILURES } else { *n + 1 };
        let n = *n;
        if n >= MAX_PEER_FAILURES {
            self.drop_source(peer);
        }
        n
    }

    /// Counts `n` verified bytes from `peer`.
    fn got(&mut self, peer: PeerId, n: u64, progress: &ProgressBar) {
        self.report.bytes += n;
        *self.report.served.entry(peer).or_default() += n;
        progress.inc(n);
    }
}

/// What became of an answer that came over libp2p.
enum Taken {
    /// Its bytes were kept, or it failed in a way that blames nobody.
    Fine,
    /// It was a lie: the peer is counted against and dropped for this blob.
    Lie,
}

impl Fetcher {
    pub(super) async fn fill(
        &self,
        partial: &mut PartialBlob,
        sources: &[PeerId],
        progress: &ProgressBar,
    ) -> Result<BlobFetch> {
        let id = partial.id();
        let mut pass = Pass {
            queue: VecDeque::new(),
            usable: sources.to_vec(),
            failures: HashMap::new(),
            last_error: String::new(),
            report: BlobFetch::default(),
        };
        for gap in partial.missing()? {
            let mut s = gap.start;
            while s < gap.end {
                let e = (s + PIECE_BYTES).min(gap.end);
                pass.queue.push_back(s..e);
                s = e;
            }
        }
        let mut next = 0usize;
        let mut in_flight = FuturesUnordered::new();
        loop {
            while in_flight.len() < MAX_IN_FLIGHT && !pass.usable.is_empty() {
                let Some(range) = pass.queue.pop_front() else {
                    break;
                };
                let peer = pass.usable[next % pass.usable.len()];
                next += 1;
                in_flight.push(self.ask(peer, id, range));
            }
            let Some((peer, range, by_lane, answer)) = in_flight.next().await else {
                break;
            };
            if by_lane {
                self.take_from_lane(partial, peer, (range, answer), &mut pass, progress)?;
                continue;
            }
            let taken = (range, answer);
            if let Taken::Lie = self
                .take_from_peer(partial, peer, taken, &mut pass, progress)
                .await?
            {
                *pass.report.rejected.entry(peer).or_default() += 1;
                self.node.penalize(peer).await;
                pass.drop_source(peer);
            }
        }
        if !pass.queue.is_empty() {
            bail!(
                "blob {id}: no usable source left with {} bytes missing (verified bytes are kept \
                 for the next attempt); last error: {}",
                pass.queue.iter().map(|r| r.end - r.start).sum::<u64>(),
                pass.last_error
            );
        }
        Ok(pass.report)
    }

    /// Asks `peer` for `range` of blob `id`: on its plain lane when it has one on, else over
    /// libp2p. Says which it was.
    fn ask(
        &self,
        peer: PeerId,
        id: moeswarm_protocol::BlobId,
        range: Range<u64>,
    ) -> impl std::future::Future<Output = (PeerId, Range<u64>, bool, Result<ExchangeResponse>)>
    {
        let (node, lanes) = (self.node.clone(), self.lanes.clone());
        let lane = self.lanes.at(&peer);
        async move {
            let req = ExchangeRequest::Range {
                id,
                start: range.start,
                end: range.end,
            };
            let answer = match lane {
                Some(addr) => lanes.range(addr, &req).await,
                None => node.request(peer, req).await,
            };
            (peer, range, lane.is_some(), answer)
        }
    }

    /// Keeps what verified of an answer `peer` gave over libp2p; puts back what is left of the
    /// range, and says whether the answer was a lie. Fails only when the bytes could not be
    /// written here.
    async fn take_from_peer(
        &self,
        partial: &mut PartialBlob,
        peer: PeerId,
        (range, answer): (Range<u64>, Result<ExchangeResponse>),
        pass: &mut Pass,
        progress: &ProgressBar,
    ) -> Result<Taken> {
        let id = partial.id();
        let r = match answer {
            Ok(r) => r,
            Err(e) => {
                pass.queue.push_front(range);
                pass.last_error = format!("{e:#}");
                // One that is no moeswarm node will not become one: given up at once.
                let fatal = matches!(e.root(),
                    Error::Request(f) if matches!(**f, RequestFailure::Unsupported { .. }));
                let n = pass.failed(peer, fatal);
                if n < MAX_PEER_FAILURES {
                    // A transient failure (a dial under way, a busy peer): back off a little.
                    tokio::time::sleep(std::time::Duration::from_millis(100 << n)).await;
                }
                return Ok(Taken::Fine);
            }
        };
        if !range_reply_ok(&r.header, &id, &range) {
            pass.queue.push_front(range);
            return Ok(match r.header {
                ResponseHeader::NotFound => {
                    pass.drop_source(peer);
                    pass.last_error = format!("{peer} does not hold {id}");
                    Taken::Fine
                }
                ResponseHeader::Refused { reason } => {
                    pass.last_error = format!("{peer} refused: {reason}");
                    pass.failed(peer, false);
                    Taken::Fine
                }
                other => {
                    pass.last_error = format!("{peer} answered {other:?} to a range request");
                    Taken::Lie
                }
            });
        }
        let (at, failed) = keep(partial, peer, &range, &r.payload)?;
        let Some(why) = failed else {
            pass.got(peer, at - range.start, progress);
            return Ok(Taken::Fine);
        };
        pass.last_error = why;
        pass.report.bytes += at - range.start;
        progress.inc(at - range.start);
        pass.queue.push_front(at..range.end);
        Ok(Taken::Lie)
    }

    /// Keeps what verified of an answer that came over `peer`'s plain lane. Whatever failed
    /// there turns the lane off for the peer and puts the rest of the range back (asked over
    /// libp2p next); nobody is counted against for it. Fails only when the bytes could not be
    /// written here.
    fn take_from_lane(
        &self,
        partial: &mut PartialBlob,
        peer: PeerId,
        (range, answer): (Range<u64>, Result<ExchangeResponse>),
        pass: &mut Pass,
        progress: &ProgressBar,
    ) -> Result<()> {
        let id = partial.id();
        let kept = match answer {
            Ok(r) if range_reply_ok(&r.header, &id, &range) => {
                let (at, failed) = keep(partial, peer, &range, &r.payload)?;
                if let Some(why) = failed {
                    tracing::debug!("{peer}'s plain lane: {why}");
                }
                at
            }
            Ok(r) => {
                tracing::debug!("{peer}'s plain lane answered {:?}", r.header);
                range.start
            }
            Err(e) => {
                tracing::debug!("{peer}'s plain lane: {e:#}");
                range.start
            }
        };
        pass.got(peer, kept - range.start, progress);
        pass.report.lane_bytes += kept - range.start;
        if kept < range.end {
            self.lanes.turn_off(peer);
            pass.queue.push_front(kept..range.end);
        }
        Ok(())
    }
}

/// Verifies and keeps `payload`, `peer`'s answer for `range`: where its verified bytes end
/// (`range.end` when all did) and, short of that, why. Fails only when the bytes could not be
/// written here, which is not the sender's doing.
fn keep(
    partial: &mut PartialBlob,
    peer: PeerId,
    range: &Range<u64>,
    payload: &[u8],
) -> Result<(u64, Option<String>)> {
    match partial.accept(range.clone(), payload) {
        Ok(()) => Ok((range.end, None)),
        Err(e) if e.local => bail!(
            "blob {}: writing what {peer} sent failed here ({}); verified bytes are kept for \
             the next attempt",
            partial.id(),
            e.reason
        ),
        Err(e) => Ok((e.at.clamp(range.start, range.end - 1), Some(e.to_string()))),
    }
}
