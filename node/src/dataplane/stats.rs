//! What the router's dispatches did: counts, bytes, dropped replies by reason, latencies.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;

/// Why the router dropped a reply (or a dispatch that never got one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DropReason {
    /// Answered after its deadline.
    Late,
    /// A second answer on the same stream.
    Duplicate,
    /// Answered another ticket, other slabs or other shapes.
    Mismatched,
    /// Through a relay, not signed by the worker that was asked.
    BadSignature,
    /// Broke the framing or the message rules.
    Malformed,
    /// The worker's queue was full.
    Busy,
    /// The worker would not compute it (and said why).
    Refused,
    /// No stream, no answer in time, or the connection broke.
    Failed,
}

impl DropReason {
    /// The name reports use.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Late => "late",
            DropReason::Duplicate => "duplicate",
            DropReason::Mismatched => "mismatched",
            DropReason::BadSignature => "bad_signature",
            DropReason::Malformed => "malformed",
            DropReason::Busy => "busy",
            DropReason::Refused => "refused",
            DropReason::Failed => "failed",
        }
    }
}

/// Why a dispatch to a worker brought no answer the router accepts: the reason (what the
/// router's retry and health choices branch on, and what is counted) and what happened.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{detail}")]
pub struct DispatchFailure {
    /// The worker asked.
    pub peer: moeswarm_relay::PeerId,
    /// The kind of failure.
    pub reason: DropReason,
    /// What happened, for people.
    pub detail: String,
}

/// Counts and timings of the router's dispatches.
#[derive(Debug, Default)]
pub struct DispatchStats {
    /// Dispatches sent.
    pub sent: AtomicU64,
    /// Dispatches answered and accepted.
    pub accepted: AtomicU64,
    /// Tensor bytes sent.
    pub bytes_out: AtomicU64,
    /// Tensor bytes received in accepted replies.
    pub bytes_in: AtomicU64,
    /// Groups sent again to another replica.
    pub retried: AtomicU64,
    /// Groups computed by the router itself.
    pub local: AtomicU64,
    /// Replies dropped, by reason.
    pub dropped: Mutex<BTreeMap<DropReason, u64>>,
    /// Round trips of accepted dispatches, ms, per layer.
    pub latency_ms: Mutex<BTreeMap<u32, Recent>>,
    /// Round trips of accepted dispatches, ms, per worker (at most [`MAX_WORKERS_TIMED`]).
    pub worker_latency_ms: Mutex<BTreeMap<String, Recent>>,
    /// Accepted dispatches whose answers were checked.
    pub checked: AtomicU64,
    /// Rows of checked dispatches re-computed for their checks (a sample of each).
    pub checked_rows: AtomicU64,
    /// Rows the checked dispatches held in all.
    pub checked_of_rows: AtomicU64,
    /// Checked groups no second opinion could be had for (answer kept).
    pub unverified: AtomicU64,
    /// Slabs the router fetched to settle disputes between two workers.
    pub refereed: AtomicU64,
    /// Per worker (at most [`MAX_WORKERS_TIMED`]): checks passed and failed.
    pub worker_checks: Mutex<BTreeMap<String, [u64; 2]>>,
}

/// Samples kept per layer or worker: the quantiles are of the latest ones.
pub const RECENT: usize = 4096;
/// Workers whose round trips are kept apart; later ones count only in the layers' figures.
pub const MAX_WORKERS_TIMED: usize = 1024;

/// The latest [`RECENT`] round trips of one layer or worker, in ms.
#[derive(Debug, Default)]
pub struct Recent(VecDeque<f64>);

impl Recent {
    /// Adds one, forgetting the oldest when full.
    pub fn push(&mut self, ms: f64) {
        if self.0.len() == RECENT {
            self.0.pop_front();
        }
        self.0.push_back(ms);
    }

    /// p50, p90, p99.
    pub fn quantiles(&self) -> [f64; 3] {
        let mut v: Vec<f64> = self.0.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        [
            percentile(&v, 0.5),
            percentile(&v, 0.9),
            percentile(&v, 0.99),
        ]
    }
}

/// A summary of [`DispatchStats`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct DispatchSummary {
    /// Dispatches sent.
    pub sent: u64,
    /// Accepted.
    pub accepted: u64,
    /// Tensor bytes out.
    pub bytes_out: u64,
    /// Tensor bytes in.
    pub bytes_in: u64,
    /// Groups retried elsewhere.
    pub retried: u64,
    /// Groups computed locally.
    pub local: u64,
    /// Dropped replies by reason.
    pub dropped: BTreeMap<String, u64>,
    /// Per layer: p50, p90, p99 round trip in ms.
    pub latency_ms: BTreeMap<u32, [f64; 3]>,
    /// Per worker (its peer id): p50, p90, p99 round trip in ms.
    pub worker_latency_ms: BTreeMap<String, [f64; 3]>,
    /// Accepted dispatches whose answers were checked.
    pub checked: u64,
    /// Rows of checked dispatches re-computed for their checks (a sample of each).
    pub checked_rows: u64,
    /// Rows the checked dispatches held in all.
    pub checked_of_rows: u64,
    /// Checked groups no second opinion could be had for.
    pub unverified: u64,
    /// Slabs the router fetched to settle disputes between two workers.
    pub refereed: u64,
    /// Per worker: checks passed and failed.
    pub worker_checks: BTreeMap<String, [u64; 2]>,
    /// Workers caught answering wrong (and quarantined for it), with how often.
    pub quarantined: BTreeMap<String, u64>,
    /// Per worker the router knows (its peer id): how it is reached and why, e.g.
    /// `direct 203.0.113.8:4433 (its own address)` or `relay 12D3… at 198.51.100.1:4434 (it
    /// registered there: it accepts no connections)`.
    pub worker_paths: BTreeMap<String, String>,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

impl DispatchStats {
    pub(crate) fn drop_reply(&self, reason: DropReason) {
        if let Ok(mut d) = self.dropped.lock() {
            *d.entry(reason).or_default() += 1;
        }
    }

    /// Starts counting afresh.
    pub fn reset(&self) {
        for a in [
            &self.sent,
            &self.accepted,
            &self.bytes_out,
            &self.bytes_in,
            &self.retried,
            &self.local,
            &self.checked,
            &self.checked_rows,
            &self.checked_of_rows,
            &self.unverified,
            &self.refereed,
        ] {
            a.store(0, Ordering::Relaxed);
        }
        if let Ok(mut d) = self.dropped.lock() {
            d.clear();
        }
        if let Ok(mut l) = self.latency_ms.lock() {
            l.clear();
        }
        if let Ok(mut l) = self.worker_latency_ms.lock() {
            l.clear();
        }
        if let Ok(mut c) = self.worker_checks.lock() {
            c.clear();
        }
    }

    /// A check of `worker`'s answer passed (or failed).
    pub(crate) fn check(&self, worker: &str, passed: bool) {
        if let Ok(mut w) = self.worker_checks.lock() {
            let slot = if let Some(c) = w.get_mut(worker) {
                Some(c)
            } else if w.len() < MAX_WORKERS_TIMED {
                Some(w.entry(worker.to_string()).or_default())
            } else {
                None
            };
            if let Some(c) = slot {
                c[usize::from(!passed)] += 1;
            }
        }
    }

    /// An accepted dispatch of `layer` to `worker` took `ms`.
    pub(crate) fn round_trip(&self, layer: u32, worker: &str, ms: f64) {
        if let Ok(mut l) = self.latency_ms.lock() {
            l.entry(layer).or_default().push(ms);
        }
        if let Ok(mut w) = self.worker_latency_ms.lock() {
            if let Some(r) = w.get_mut(worker) {
                r.push(ms);
            } else if w.len() < MAX_WORKERS_TIMED {
                w.entry(worker.to_string()).or_default().push(ms);
            }
        }
    }

    /// Dropped replies of `reason` so far.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped
            .lock()
            .map_or(0, |d| d.get(&reason).copied().unwrap_or(0))
    }

    /// The summary now.
    pub fn summary(&self) -> DispatchSummary {
        fn quantiles<K: Ord + Clone>(m: &Mutex<BTreeMap<K, Recent>>) -> BTreeMap<K, [f64; 3]> {
            m.lock()
                .map(|m| m.iter().map(|(k, r)| (k.clone(), r.quantiles())).collect())
                .unwrap_or_default()
        }
        DispatchSummary {
            sent: self.sent.load(Ordering::Relaxed),
            accepted: self.accepted.load(Ordering::Relaxed),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            local: self.local.load(Ordering::Relaxed),
            dropped: self
                .dropped
                .lock()
                .map(|d| {
                    d.iter()
                        .map(|(k, v)| (k.as_str().to_string(), *v))
                        .collect()
                })
                .unwrap_or_default(),
            latency_ms: quantiles(&self.latency_ms),
            worker_latency_ms: quantiles(&self.worker_latency_ms),
            checked: self.checked.load(Ordering::Relaxed),
            checked_rows: self.checked_rows.load(Ordering::Relaxed),
            checked_of_rows: self.checked_of_rows.load(Ordering::Relaxed),
            unverified: self.unverified.load(Ordering::Relaxed),
            refereed: self.refereed.load(Ordering::Relaxed),
            worker_checks: self
                .worker_checks
                .lock()
                .map(|w| w.clone())
                .unwrap_or_default(),
            quarantined: self
                .worker_checks
                .lock()
                .map(|w| {
                    w.iter()
                        .filter(|(_, c)| c[1] > 0)
                        .map(|(k, c)| (k.clone(), c[1]))
                        .collect()
                })
                .unwrap_or_default(),
            // The executor knows the routes ([`super::RemoteExecutor::summary`]).
            worker_paths: BTreeMap::new(),
        }
    }
}
