//! The node's HTTP face (axum): blobs and expert slabs by plain GET, for browsers, `curl` and
//! fetchers that do not speak libp2p.
//!
//! - `GET /blob/{id}`: the blob, `ETag` = its blake3 id, `Accept-Ranges: bytes`.
//! - `GET /expert-shard/{model}/{layer}/{expert}`: the slab the model's manifest names there.
//!
//! Every connection is bounded (see [`limits`]): headers within 10 s (and a kept-alive
//! connection's next ones within 10 s of its last answer), at most 256 connections and 32 per
//! client address, an idle one (half-open, or kept alive between requests) closed to make room.
//!
//! A single `Range: bytes=a-b` (or `a-`, or `-n`) gets `206 Partial Content`; a range outside
//! the blob `416`; `If-None-Match` with the id `304`. Bodies are streamed from the file, so
//! memory stays bounded whatever the blob's size. Before serving, the store checks the file
//! still holds the blob (`Store::check_blob`: hashed again if it changed since it last hashed
//! right); a blob gone bad is dropped and answered `500`, never sent.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;

use crate::error::{Context, Result};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use moeswarm_protocol::{BlobId, ModelId};
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use moeswarm_model::store::Store;

pub mod limits;
pub use limits::{HttpLimits, HttpStats};

/// The routes, over `store`.
pub fn router(store: Arc<Store>) -> Router {
    Router::new()
        .route("/blob/{id}", get(blob))
        .route("/expert-shard/{model}/{layer}/{expert}", get(expert_shard))
        .with_state(store)
}

/// Serves `store` on `addr` (port 0 picks a free one); returns the bound address.
pub async fn serve(
    store: Arc<Store>,
    addr: SocketAddr,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_routes(router(store), addr).await
}

/// Serves `routes` on `addr` (port 0 picks a free one) in a task; returns the bound address.
pub(crate) async fn serve_routes(
    routes: Router,
    addr: SocketAddr,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding HTTP on {addr}"))?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(limits::serve(
        listener,
        routes,
        HttpLimits::default(),
        Arc::default(),
    ));
    Ok((local, task))
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, msg.into()).into_response()
}

async fn blob(
    State(store): State<Arc<Store>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    match id.parse::<BlobId>() {
        Ok(id) => send_blob(&store, id, &headers).await,
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

async fn expert_shard(
    State(store): State<Arc<Store>>,
    Path((model, layer, expert)): Path<(String, u32, u32)>,
    headers: HeaderMap,
) -> Response {
    let model: ModelId = match model.parse() {
        Ok(m) => m,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let manifest = match store.manifest(&model) {
        Ok(m) => m,
        Err(e) => return error(StatusCode::NOT_FOUND, format!("{e:#}")),
    };
    match manifest.slab(layer, expert) {
        Some(r) => send_blob(&store, r.id, &headers).await,
        None => error(
            StatusCode::NOT_FOUND,
            format!("model {model} has no expert {expert} in layer {layer}"),
        ),
    }
}

/// A `Range` header that names no byte of the blob (answered with 416).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsatisfiable;

/// The byte range a `Range` header asks for: `Ok(None)` for the whole blob (no header, or a
/// form this server does not do, which HTTP lets it ignore), `Err` when unsatisfiable.
pub fn requested_range(
    value: Option<&str>,
    size: u64,
) -> Result<Option<Range<u64>>, Unsatisfiable> {
    let Some(spec) = value.and_then(|v| v.trim().strip_prefix("bytes=")) else {
        return Ok(None);
    };
    if spec.contains(',') {
        return Ok(None);
    }
    let (a, b) = spec.split_once('-').ok_or(Unsatisfiable)?;
    let (a, b) = (a.trim(), b.trim());
    let range = match (a.is_empty(), b.is_empty()) {
        (false, _) => {
            let start: u64 = a.parse().map_err(|_| Unsatisfiable)?;
            let end = if b.is_empty() {
                size
            } else {
                b.parse::<u64>()
                    .map_err(|_| Unsatisfiable)?
                    .saturating_add(1)
                    .min(size)
            };
            start..end
        }
        (true, false) => {
            let n: u64 = b.parse().map_err(|_| Unsatisfiable)?;
            size.saturating_sub(n)..size
        }
        (true, true) => return Err(Unsatisfiable),
    };
    if range.start >= range.end || range.start >= size {
        return Err(Unsatisfiable);
    }
    Ok(Some(range))
}

async fn send_blob(store: &Arc<Store>, id: BlobId, headers: &HeaderMap) -> Response {
    let size = match store.entry(&id) {
        Ok(Some(e)) => e.size,
        Ok(None) => return error(StatusCode::NOT_FOUND, format!("blob {id} is not here")),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
    };
    // Only bytes that still match the id are served: a file changed since it was last hashed
    // is hashed again, and one gone bad is dropped from the store and answered with an error.
    let s = store.clone();
    match tokio::task::spawn_blocking(move || s.check_blob(&id)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
    let etag = format!("\"{id}\"");
    let if_none = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok());
    if if_none.is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*")) {
        return (StatusCode::NOT_MODIFIED, [(header::ETAG, etag)]).into_response();
    }
    let range = match requested_range(
        headers.get(header::RANGE).and_then(|v| v.to_str().ok()),
        size,
    ) {
        Ok(r) => r,
        Err(Unsatisfiable) => {
            return (
                StatusCode::RANGE_NOT_SATISFIABLE,
                [(header::CONTENT_RANGE, format!("bytes */{size}"))],
            )
                .into_response()
        }
    };
    let (status, span) = match &range {
        Some(r) => (StatusCode::PARTIAL_CONTENT, r.clone()),
        None => (StatusCode::OK, 0..size),
    };
    let mut file = match tokio::fs::File::open(store.blob_path(&id)).await {
        Ok(f) => f,
        Err(e) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("opening blob {id}: {e}"),
            )
        }
    };
    if let Err(e) = file.seek(std::io::SeekFrom::Start(span.start)).await {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("seeking blob {id}: {e}"),
        );
    }
    let body = Body::from_stream(tokio_util::io::ReaderStream::with_capacity(
        file.take(span.end - span.start),
        1 << 16,
    ));
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    let value = |s: String| HeaderValue::from_str(&s).expect("ascii header");
    h.insert(header::ETAG, value(etag));
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(
        header::CONTENT_LENGTH,
        value((span.end - span.start).to_string()),
    );
    if range.is_some() {
        h.insert(
            header::CONTENT_RANGE,
            value(format!("bytes {}-{}/{size}", span.start, span.end - 1)),
        );
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::{requested_range, Unsatisfiable};

    #[test]
    fn range_headers() {
        assert_eq!(requested_range(None, 100), Ok(None));
        assert_eq!(requested_range(Some("bytes=0-9"), 100), Ok(Some(0..10)));
        assert_eq!(requested_range(Some("bytes=90-"), 100), Ok(Some(90..100)));
        assert_eq!(requested_range(Some("bytes=-5"), 100), Ok(Some(95..100)));
        assert_eq!(
            requested_range(Some("bytes=50-500"), 100),
            Ok(Some(50..100))
        );
        assert_eq!(requested_range(Some("bytes=100-"), 100), Err(Unsatisfiable));
        assert_eq!(requested_range(Some("bytes=9-3"), 100), Err(Unsatisfiable));
        assert_eq!(requested_range(Some("bytes=x-3"), 100), Err(Unsatisfiable));
        assert_eq!(requested_range(Some("bytes=0-1,5-6"), 100), Ok(None));
        assert_eq!(requested_range(Some("items=0-1"), 100), Ok(None));
    }
}
