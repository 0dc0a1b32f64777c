//! `/metrics`: what the API and its batch did, in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::ApiState;

/// Upper bounds of the latency histograms' buckets, in seconds.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A latency histogram with [`BUCKETS`].
#[derive(Debug, Default)]
struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn observe(&self, secs: f64) {
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            if secs <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
    }

    /// Count, mean and the buckets' bounds at the median and the 99th percentile.
    fn summary(&self) -> LatencySummary {
        let count = self.count.load(Ordering::Relaxed);
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let bound = |q: f64| {
            let want = (q * count as f64).ceil().max(1.0) as u64;
            BUCKETS
                .iter()
                .zip(&self.counts)
                .find(|(_, c)| c.load(Ordering::Relaxed) >= want)
                .map(|(b, _)| *b)
        };
        LatencySummary {
            count,
            mean_s: if count == 0 { 0.0 } else { sum / count as f64 },
            p50_le_s: if count == 0 { None } else { bound(0.5) },
            p99_le_s: if count == 0 { None } else { bound(0.99) },
        }
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {n}");
    }
}

/// A latency histogram in brief: what the dashboard shows.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LatencySummary {
    /// Observations.
    pub count: u64,
    /// Their mean, in seconds (0 when none).
    pub mean_s: f64,
    /// The smallest bucket bound at or above the median (`None`: none yet, or above 30 s).
    pub p50_le_s: Option<f64>,
    /// The same at the 99th percentile.
    pub p99_le_s: Option<f64>,
}

/// The API's counts.
#[derive(Debug, Default)]
pub struct ApiMetrics {
    ids: AtomicU64,
    by_status: Mutex<BTreeMap<u16, u64>>,
    ttft: Histogram,
    inter_token: Histogram,
}

/// Times one request's tokens: the first against the request's start, the rest against the
/// one before.
pub(super) struct TokenTimer {
    metrics: Arc<ApiMetrics>,
    start: Instant,
    last: Option<Instant>,
}

impl TokenTimer {
    /// A token (a piece of text) was sent.
    pub(super) fn token(&mut self) {
        let now = Instant::now();
        match self.last {
            None => self.metrics.ttft.observe((now - self.start).as_secs_f64()),
            Some(l) => self.metrics.inter_token.observe((now - l).as_secs_f64()),
        }
        self.last = Some(now);
    }
}

impl ApiMetrics {
    /// A fresh number for a response id.
    pub(super) fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }

    /// Counts `response` under `status` and hands it on.
    pub(super) fn answered(&self, status: StatusCode, response: Response) -> Response {
        if let Ok(mut m) = self.by_status.lock() {
            *m.entry(status.as_u16()).or_default() += 1;
        }
        response
    }

    /// Time to first token so far.
    pub fn time_to_first_token(&self) -> LatencySummary {
        self.ttft.summary()
    }

    /// A timer for the tokens of a request that started at `start`.
    pub(super) fn timer(self: &Arc<Self>, start: Instant) -> TokenTimer {
        TokenTimer {
            metrics: self.clone(),
            start,
            last: None,
        }
    }
}

/// `GET /metrics`.
pub(super) async fn metrics(State(st): State<ApiState>) -> Response {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP moeswarm_requests_total Requests answered, by HTTP status.\n# TYPE moeswarm_requests_total counter"
    );
    if let Ok(m) = st.metrics.by_status.lock() {
        for (status, n) in m.iter() {
            let _ = writeln!(out, "moeswarm_requests_total{{status=\"{status}\"}} {n}");
        }
    }
    let b = &st.batcher.stats;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    for (name, kind, help, v) in [
        (
            "moeswarm_tokens_generated_total",
            "counter",
            "Tokens generated.",
            get(&b.tokens_generated),
        ),
        (
            "moeswarm_draft_tokens_total",
            "counter",
            "Drafted tokens checked (speculative decoding).",
            get(&b.drafted),
        ),
        (
            "moeswarm_draft_tokens_accepted_total",
            "counter",
            "Drafted tokens kept.",
            get(&b.accepted),
        ),
        (
            "moeswarm_sequences_active",
            "gauge",
            "Sequences in the running batch.",
            get(&b.active),
        ),
        (
            "moeswarm_sequences_queued",
            "gauge",
            "Requests waiting to join the batch.",
            get(&b.queued),
        ),
        (
            "moeswarm_sequences_abandoned_total",
            "counter",
            "Sequences whose client went away.",
            get(&b.abandoned),
        ),
        (
            "moeswarm_batch_steps_total",
            "counter",
            "Forward steps of the batch.",
            get(&b.steps),
        ),
        (
            "moeswarm_batch_sequences_total",
            "counter",
            "Sequences over all steps (over steps: the mean batch size).",
            get(&b.step_sequences),
        ),
        (
            "moeswarm_batch_rows_total",
            "counter",
            "Token rows over all steps.",
            get(&b.step_rows),
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    }
    st.metrics.ttft.write(
        &mut out,
        "moeswarm_time_to_first_token_seconds",
        "From the request to its first token.",
    );
    st.metrics.inter_token.write(
        &mut out,
        "moeswarm_inter_token_seconds",
        "Between two tokens of one request.",
    );
    if let Some(extra) = &st.extra_metrics {
        out += &extra();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// The router's dispatch counts, as metrics lines.
pub(super) fn dispatch_lines(d: &crate::dataplane::DispatchSummary) -> String {
    let mut out = String::new();
    for (name, help, v) in [
        (
            "moeswarm_dispatches_sent_total",
            "Dispatches sent to workers.",
            d.sent,
        ),
        (
            "moeswarm_dispatches_accepted_total",
            "Dispatch replies accepted.",
            d.accepted,
        ),
        (
            "moeswarm_dispatch_groups_retried_total",
            "Groups sent again to another replica.",
            d.retried,
        ),
        (
            "moeswarm_dispatch_groups_local_total",
            "Groups the router computed itself.",
            d.local,
        ),
        (
            "moeswarm_dispatch_bytes_out_total",
            "Activation bytes sent.",
            d.bytes_out,
        ),
        (
            "moeswarm_dispatch_bytes_in_total",
            "Output bytes received.",
            d.bytes_in,
        ),
        (
            "moeswarm_dispatches_checked_total",
            "Accepted dispatches whose answers were re-computed and compared.",
            d.checked,
        ),
        (
            "moeswarm_dispatch_groups_unverified_total",
            "Checked groups no second opinion could be had for.",
            d.unverified,
        ),
        (
            "moeswarm_dispatch_slabs_refereed_total",
            "Slabs the router fetched to settle a dispute between two workers.",
            d.refereed,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
        );
    }
    let name = "moeswarm_dispatch_latency_ms";
    let _ = writeln!(
        out,
        "# HELP {name} Dispatch round trips per MoE layer, by quantile (recent).\n# TYPE {name} gauge"
    );
    for (layer, qs) in &d.latency_ms {
        for (q, v) in ["0.5", "0.9", "0.99"].iter().zip(qs) {
            let _ = writeln!(out, "{name}{{layer=\"{layer}\",quantile=\"{q}\"}} {v}");
        }
    }
    let name = "moeswarm_worker_dispatch_latency_ms";
    let _ = writeln!(
        out,
        "# HELP {name} Dispatch round trips per worker, by quantile (recent).\n# TYPE {name} gauge"
    );
    for (worker, qs) in &d.worker_latency_ms {
        for (q, v) in ["0.5", "0.9", "0.99"].iter().zip(qs) {
            let _ = writeln!(out, "{name}{{worker=\"{worker}\",quantile=\"{q}\"}} {v}");
        }
    }
    let name = "moeswarm_worker_checks_total";
    let _ = writeln!(
        out,
        "# HELP {name} Checks of a worker's answers, by result.\n# TYPE {name} counter"
    );
    for (worker, [passed, failed]) in &d.worker_checks {
        let _ = writeln!(
            out,
            "{name}{{worker=\"{worker}\",result=\"passed\"}} {passed}"
        );
        let _ = writeln!(
            out,
            "{name}{{worker=\"{worker}\",result=\"failed\"}} {failed}"
        );
    }
    let name = "moeswarm_workers_quarantined";
    let _ = writeln!(
        out,
        "# HELP {name} Workers caught answering wrong and quarantined.\n# TYPE {name} gauge\n{name} {}",
        d.quarantined.len()
    );
    let name = "moeswarm_dispatch_replies_dropped_total";
    let _ = writeln!(
        out,
        "# HELP {name} Replies dropped, by reason.\n# TYPE {name} counter"
    );
    for (reason, n) in &d.dropped {
        let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {n}");
    }
    out
}
