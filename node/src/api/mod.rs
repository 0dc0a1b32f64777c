//! The router's OpenAI-compatible HTTP API, over the continuous [`batcher`].
//!
//! - `GET /v1/models`: the one model served.
//! - `POST /v1/completions` and `POST /v1/chat/completions` (rendered by the model's own
//!   chat template, or ChatML for a vocabulary with its markers and no template; `tools` and
//!   `chat_template_kwargs` reach the template): `max_tokens`, `temperature`, `top_p`,
//!   `seed`, `stop`, `n` = 1, and `stream: true` as server-sent events in OpenAI's chunk
//!   format ending with `data: [DONE]`; `usage` counts (`prompt_tokens`: the rendered
//!   prompt's tokens).
//! - `POST /tokenize` and `POST /detokenize` in llama.cpp server's shapes.
//! - `GET /health`, and `GET /metrics` in Prometheus' text format.
//! - `GET /`: the dashboard ([`crate::dashboard`]), with the API's throughput.
//!
//! Errors are OpenAI's error JSON: 400 naming the bad parameter, 404 for an unknown model, 413
//! for a prompt longer than the context, 503 with `Retry-After` when the queue is full. A
//! client that goes away mid-stream frees its sequence at the next step. Bodies are read up to
//! [`MAX_BODY_BYTES`].

pub mod batcher;
mod chat;
mod metrics;
mod openai;
mod prepare;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;

use crate::error::Result;
use batcher::Batcher;
use moeswarm_engine::text::TextTokenizer;

pub use metrics::{ApiMetrics, LatencySummary};

/// Largest request body read.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// What the API serves.
#[derive(Clone)]
pub struct ApiState {
    /// The model's name in the API.
    pub model: String,
    /// Its tokenizer.
    pub tokenizer: Arc<TextTokenizer>,
    /// The running batch.
    pub batcher: Batcher,
    /// Counts for `/metrics`.
    pub metrics: Arc<ApiMetrics>,
    /// More lines for `/metrics` (the dispatch counts of a swarm router), if any.
    pub extra_metrics: Option<Arc<dyn Fn() -> String + Send + Sync>>,
    /// Where requests are made ready for the batch (off the runtime, one at a time).
    pub preparation: Arc<prepare::Preparation>,
}

/// The routes.
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/tokenize", post(chat::tokenize))
        .route("/detokenize", post(chat::detokenize))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics::metrics))
        .with_state(state)
}

/// A model served: the API's address, and what keeps it running.
pub struct Server {
    /// Where the API listens.
    pub addr: SocketAddr,
    /// The running batch.
    pub batcher: Batcher,
    task: tokio::task::JoinHandle<()>,
    node: Option<crate::node::RunningNode>,
}

impl Server {
    /// Serves `model` (named `name` in the API) on `addr` with continuous batching.
    pub async fn start(
        model: crate::router::OpenModel,
        name: String,
        opts: batcher::BatchOptions,
        addr: SocketAddr,
    ) -> Result<Self> {
        let (trunk, tokenizer, experts, node) = model.into_parts();
        Self::start_parts(trunk, tokenizer, experts, node, name, opts, addr).await
    }

    /// [`Server::start`] from a model's parts: its trunk, tokenizer and experts, and the
    /// router's node that must keep running for them, if any.
    pub async fn start_parts(
        trunk: moeswarm_engine::trunk::Trunk,
        tokenizer: TextTokenizer,
        experts: crate::router::Experts,
        node: Option<crate::node::RunningNode>,
        name: String,
        opts: batcher::BatchOptions,
        addr: SocketAddr,
    ) -> Result<Self> {
        let (trunk, tokenizer, experts) = (Arc::new(trunk), Arc::new(tokenizer), Arc::new(experts));
        let b = batcher::spawn(trunk, experts.clone(), tokenizer.clone(), opts);
        let (models, dispatch) = match experts.as_ref() {
            crate::router::Experts::Swarm(e) => {
                let experts = experts.clone();
                let summary = move || match experts.as_ref() {
                    crate::router::Experts::Swarm(e) => e.summary(),
                    crate::router::Experts::Local(_) => Default::default(),
                };
                let summary: crate::dashboard::DispatchView = Arc::new(summary);
                (vec![e.model()], Some(summary))
            }
            crate::router::Experts::Local(_) => (Vec::new(), None),
        };
        let extra = dispatch.clone().map(|d| {
            Arc::new(move || metrics::dispatch_lines(&d())) as Arc<dyn Fn() -> String + Send + Sync>
        });
        let state = ApiState {
            model: name.clone(),
            tokenizer,
            batcher: b.clone(),
            metrics: Arc::default(),
            extra_metrics: extra,
            preparation: Arc::default(),
        };
        let dashboard = crate::dashboard::Sources {
            node: node.as_ref().map(|n| (n.handle.clone(), n.store.clone())),
            models,
            serving: Some((name, b.stats.clone(), state.metrics.clone())),
            dispatch,
        };
        let routes = router(state).merge(crate::dashboard::routes(dashboard));
        let (addr, task) = crate::http::serve_routes(routes, addr).await?;
        Ok(Self {
            addr,
            batcher: b,
            task,
            node,
        })
    }

    /// Stops serving, and the router's node if any.
    pub async fn shutdown(self) {
        self.task.abort();
        let _ = self.task.await;
        if let Some(n) = self.node {
            n.shutdown().await;
        }
    }
}

/// Serves the API on `addr` (port 0 picks a free one); returns the bound address.
pub async fn serve(
    state: ApiState,
    addr: SocketAddr,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    crate::http::serve_routes(router(state), addr).await
}
