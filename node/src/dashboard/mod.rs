//! The node's web dashboard: `GET /` is one page (embedded in the binary, no scripts from
//! elsewhere) that polls `GET /api/dashboard` every second and draws what it answers.
//!
//! - **Health**: one line, "all 12,288 slabs covered ≥ 2×" or what is missing.
//! - **Coverage**: a layers × experts heatmap on one canvas, each cell coloured by its replica
//!   count (0 red, below target orange, at target light green, above dark green), or by the
//!   routers' demand; hovering names a cell, clicking lists its holders (asked for then,
//!   `GET /api/holders/{model}/{layer}/{expert}/{page}`, 64 a page: the snapshot carries
//!   counts, never a list of holders per slab).
//! - **Peers**: every node with a live record: connected or not, direct or through a relay,
//!   bytes used and free, slabs held, and as a router sees them dispatch latency, checks and
//!   quarantine.
//! - **Throughput** (where the node serves the API): tokens/s, sequences, time to first token,
//!   the same numbers as `/metrics`.
//!
//! An answer is gathered at most every half second, whoever asks, so pages polling do not
//! add to the node's work. The data is [`Snapshot`]: the coverage of each model is `moeswarm coverage --json`'s
//! report as this node's table has it. It is not a control panel: nothing here changes the
//! node.

pub mod snapshot;

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use moeswarm_model::store::Store;
use moeswarm_protocol::ModelId;

use crate::api::batcher::BatchStats;
use crate::api::ApiMetrics;
use crate::dataplane::DispatchSummary;
use crate::net::NodeHandle;
use crate::ops::CoverageReport;
pub use snapshot::{Links, ModelView, PeerView, Snapshot, Throughput};

/// The page, with its style and script inline.
const PAGE: &str = include_str!("page.html");

/// How long one snapshot may take to gather before the answer is an error.
const GATHER_DEADLINE: Duration = Duration::from_secs(5);

/// Where the dashboard's numbers come from; every part is optional.
#[derive(Clone, Default)]
pub struct Sources {
    /// The swarm node: its table of records, links and store (the models it knows).
    pub node: Option<(NodeHandle, Arc<Store>)>,
    /// More models to show than the store has (a router's model).
    pub models: Vec<ModelId>,
    /// The API's batch and counts, where the node serves one (the model's name first).
    pub serving: Option<(String, Arc<BatchStats>, Arc<ApiMetrics>)>,
    /// The router's dispatch counts, and how it reaches each worker.
    pub dispatch: Option<DispatchView>,
}

/// What a router's dispatches did so far, asked afresh each time.
pub type DispatchView = Arc<dyn Fn() -> DispatchSummary + Send + Sync>;

#[derive(Clone)]
struct DashState {
    sources: Sources,
    rate: Arc<RateMeter>,
    /// The last answer and when it was made: however many pages poll, the node's table is
    /// read at most every [`FRESH_FOR`].
    last: Arc<tokio::sync::Mutex<Option<Answered>>>,
}

/// An answer of `/api/dashboard` (its JSON) and when it was made.
type Answered = (Instant, Arc<Vec<u8>>);

/// How long one gathered snapshot answers every poll.
const FRESH_FOR: Duration = Duration::from_millis(500);

/// The dashboard's routes: `/` and `/api/dashboard`.
pub fn routes(sources: Sources) -> Router {
    let state = DashState {
        sources,
        rate: Arc::default(),
        last: Arc::default(),
    };
    Router::new()
        .route("/", get(page))
        .route("/api/dashboard", get(data))
        .route("/api/holders/{model}/{layer}/{expert}/{page}", get(holders))
        .with_state(state)
}

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
        .into_response()
}

async fn data(State(st): State<DashState>) -> Response {
    // One gather at a time; the others wait for it and share its answer.
    let mut last = st.last.lock().await;
    let body = match last.as_ref() {
        Some((at, body)) if at.elapsed() < FRESH_FOR => body.clone(),
        _ => match tokio::time::timeout(GATHER_DEADLINE, gather(&st)).await {
            Ok(Ok(s)) => match serde_json::to_vec(&s) {
                Ok(b) => {
                    let b = Arc::new(b);
                    *last = Some((Instant::now(), b.clone()));
                    b
                }
                Err(e) => {
                    return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
                }
            },
            Ok(Err(e)) => {
                return (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")).into_response()
            }
            Err(_) => {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the node did not answer within 5 s",
                )
                    .into_response()
            }
        },
    };
    drop(last);
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body.as_ref().clone(),
    )
        .into_response()
}

/// One page of the holders of one slab, from this node's table.
async fn holders(
    State(st): State<DashState>,
    axum::extract::Path((model, layer, expert, page)): axum::extract::Path<(
        String,
        u32,
        u32,
        usize,
    )>,
) -> Response {
    let Ok(model) = model.parse::<ModelId>() else {
        return (StatusCode::BAD_REQUEST, "not a model id").into_response();
    };
    let Some((handle, _)) = &st.sources.node else {
        return (StatusCode::NOT_FOUND, "this server runs no swarm node").into_response();
    };
    let map = match tokio::time::timeout(GATHER_DEADLINE, handle.coverage(model)).await {
        Ok(Ok(Some(map))) => map,
        Ok(Ok(None)) => {
            return (
                StatusCode::NOT_FOUND,
                format!("model {model} is not followed here"),
            )
                .into_response()
        }
        Ok(Err(e)) => return (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")).into_response(),
        Err(_) => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "the node did not answer within 5 s",
            )
                .into_response()
        }
    };
    let shape = map.replicas();
    if shape
        .get(layer as usize)
        .is_none_or(|l| expert as usize >= l.len())
    {
        return (
            StatusCode::NOT_FOUND,
            format!("model {model} has no slab ({layer}, {expert})"),
        )
            .into_response();
    }
    let body = crate::ops::HoldersPage::of(&map, layer, expert, page);
    match serde_json::to_vec(&body) {
        Ok(b) => ([(header::CONTENT_TYPE, "application/json")], b).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn gather(st: &DashState) -> crate::Result<Snapshot> {
    let src = &st.sources;
    let mut reports = Vec::new();
    let mut links = Links::default();
    if let Some((handle, store)) = &src.node {
        links.node = Some(handle.peer_id.to_string());
        links.connected = handle
            .peers()
            .await?
            .into_iter()
            .map(|p| p.to_string())
            .collect();
        let mut models = store.models()?;
        for m in &src.models {
            if !models.contains(m) {
                models.push(*m);
            }
        }
        let now = crate::net::records::now_secs();
        for m in models {
            let Some(map) = handle.coverage(m).await? else {
                continue;
            };
            let demand = handle.demand(m).await?.unwrap_or_else(|| {
                let r = map.replicas();
                let n_expert = r.first().map_or(0, |l| l.len() as u32);
                moeswarm_market::demand::DemandBook::new(m, r.len() as u32, n_expert)
            });
            reports.push(CoverageReport::of(&map, &demand, now));
        }
    }
    let dispatch = src.dispatch.as_ref().map(|d| d());
    let throughput = src.serving.as_ref().map(|(name, batch, api)| {
        let tokens = batch.tokens_generated.load(Ordering::Relaxed);
        Throughput {
            model: name.clone(),
            tokens_generated: tokens,
            tokens_per_second: st.rate.sample(Instant::now(), tokens),
            sequences_active: batch.active.load(Ordering::Relaxed),
            sequences_queued: batch.queued.load(Ordering::Relaxed),
            time_to_first_token: api.time_to_first_token(),
            dispatches_sent: dispatch.as_ref().map_or(0, |d| d.sent),
            dispatches_checked: dispatch.as_ref().map_or(0, |d| d.checked),
            workers_quarantined: dispatch.as_ref().map_or(0, |d| d.quarantined.len()),
        }
    });
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Ok(Snapshot::build(
        reports,
        &links,
        dispatch.as_ref(),
        throughput,
        now_ms,
    ))
}

/// Tokens per second from the counts seen at the last requests (the page asks every second).
#[derive(Debug, Default)]
struct RateMeter(Mutex<VecDeque<(Instant, u64)>>);

/// The window the rate is taken over.
const RATE_WINDOW: Duration = Duration::from_secs(5);

impl RateMeter {
    /// Records `total` at `now`; the rate over the window, 0 until two samples half a second
    /// apart.
    fn sample(&self, now: Instant, total: u64) -> f64 {
        let Ok(mut s) = self.0.lock() else {
            return 0.0;
        };
        s.push_back((now, total));
        while s.len() > 2 && s.front().is_some_and(|(t, _)| now - *t > RATE_WINDOW) {
            s.pop_front();
        }
        // Bounded whatever the request rate: keep every other sample when many pile up.
        if s.len() > 256 {
            let kept: VecDeque<_> = s.iter().copied().step_by(2).collect();
            *s = kept;
        }
        let (Some(&(t0, n0)), Some(&(t1, n1))) = (s.front(), s.back()) else {
            return 0.0;
        };
        let dt = (t1 - t0).as_secs_f64();
        if dt < 0.5 {
            return 0.0;
        }
        n1.saturating_sub(n0) as f64 / dt
    }
}

#[cfg(test)]
mod tests {
    use super::RateMeter;
    use std::time::{Duration, Instant};

    #[test]
    fn the_rate_is_tokens_over_the_window_and_zero_at_first() {
        let m = RateMeter::default();
        let t = Instant::now();
        assert_eq!(m.sample(t, 100), 0.0);
        assert_eq!(m.sample(t + Duration::from_millis(100), 150), 0.0);
        assert_eq!(m.sample(t + Duration::from_secs(2), 300), 100.0);
        // Old samples leave the window.
        let r = m.sample(t + Duration::from_secs(20), 300);
        assert_eq!(r, 0.0);
        for i in 0..1000u64 {
            m.sample(
                t + Duration::from_secs(21) + Duration::from_micros(i),
                300 + i,
            );
        }
        assert!(m.0.lock().unwrap().len() <= 256);
    }
}
