//! The HTTP server's own accept loop, so that no client, or crowd of clients, holds the node's
//! HTTP: a deadline on each request's headers (which also ends a kept-alive connection idle
//! that long between requests), a bound on connections in all and per client address, and, when a bound is reached,
//! room made by closing an idle connection (one that is not serving a request: half-open, or
//! kept alive between requests) rather than by turning the newcomer away.
//!
//! Which one is closed is [`choose_eviction`]'s pure choice: at the per-address bound, the
//! address's own connection idle longest; at the total bound, the connection idle longest of
//! the address that holds the most. A client pinging over many kept-alive connections thus
//! loses its own idle ones first, and a connection serving a request is never cut.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};

/// The bounds of one HTTP server.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one IP address.
    pub per_client: usize,
    /// Time a client has to send a request's headers (the first, and each next one on a
    /// kept-alive connection).
    pub header_timeout: Duration,
    /// Longest life of one connection (a download of the largest blob at a crawl ends).
    pub connection_deadline: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            per_client: 32,
            header_timeout: Duration::from_secs(10),
            connection_deadline: Duration::from_secs(30 * 60),
        }
    }
}

/// What the server did about its limits.
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Idle connections (half-open, or kept alive between requests) closed to make room.
    pub evicted: AtomicU64,
    /// Connections turned away (every one that could have made room was serving a request).
    pub refused: AtomicU64,
}

/// What one connection is doing, shared by its task and the accept loop.
#[derive(Debug)]
struct Activity {
    /// Requests being served (hyper's HTTP/1 serves one at a time; the body counts until it
    /// has been written whole).
    busy: AtomicUsize,
    /// When it last finished serving (or opened), in ms since the server started.
    idle_since_ms: AtomicU64,
}

/// One open connection as [`choose_eviction`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionView {
    /// The connection's key.
    pub key: u64,
    /// The client's address.
    pub ip: IpAddr,
    /// Whether it is serving a request.
    pub busy: bool,
    /// Since when it has been idle (ms since the server started).
    pub idle_since_ms: u64,
}

/// What to do with a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// There is room.
    Room,
    /// Close this connection first.
    Evict(u64),
    /// Turn it away: every connection that could make room is serving a request.
    Refuse,
}

/// What to do with a newcomer from `ip`, given the connections `open`.
pub fn choose_eviction(open: &[ConnectionView], ip: IpAddr, limits: &HttpLimits) -> Admission {
    let mine = open.iter().filter(|c| c.ip == ip).count();
    let scope = if mine >= limits.per_client.max(1) {
        Some(ip)
    } else if open.len() >= limits.max_connections.max(1) {
        None
    } else {
        return Admission::Room;
    };
    let mut held: HashMap<IpAddr, usize> = HashMap::new();
    for c in open {
        *held.entry(c.ip).or_default() += 1;
    }
    // The biggest holder's longest-idle connection; among equals, the one idle longest.
    open.iter()
        .filter(|c| !c.busy && scope.is_none_or(|s| c.ip == s))
        .max_by_key(|c| (held[&c.ip], std::cmp::Reverse((c.idle_since_ms, c.key))))
        .map_or(Admission::Refuse, |c| Admission::Evict(c.key))
}

struct Open {
    ip: IpAddr,
    activity: Arc<Activity>,
    task: tokio::task::AbortHandle,
}

#[derive(Default)]
struct Table {
    next: u64,
    open: HashMap<u64, Open>,
}

impl Table {
    /// Makes room for one more connection from `ip` (see [`choose_eviction`]); false if it
    /// is to be turned away.
    fn make_room(&mut self, ip: IpAddr, limits: &HttpLimits, stats: &HttpStats) -> bool {
        let views: Vec<ConnectionView> = self
            .open
            .iter()
            .map(|(&key, o)| ConnectionView {
                key,
                ip: o.ip,
                busy: o.activity.busy.load(Ordering::Acquire) > 0,
                idle_since_ms: o.activity.idle_since_ms.load(Ordering::Acquire),
            })
            .collect();
        match choose_eviction(&views, ip, limits) {
            Admission::Room => true,
            Admission::Evict(key) => {
                if let Some(o) = self.open.remove(&key) {
                    o.task.abort();
                    stats.evicted.fetch_add(1, Ordering::Relaxed);
                }
                true
            }
            Admission::Refuse => false,
        }
    }
}

/// Milliseconds since `start`.
fn ms_since(start: Instant) -> u64 {
    start.elapsed().as_millis() as u64
}

/// Counts a request as served until its response body has been written (or dropped).
struct Serving {
    activity: Arc<Activity>,
    start: Instant,
}

impl Serving {
    fn begin(activity: Arc<Activity>, start: Instant) -> Self {
        activity.busy.fetch_add(1, Ordering::AcqRel);
        Self { activity, start }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.activity
            .idle_since_ms
            .store(ms_since(self.start), Ordering::Release);
        self.activity.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that holds its request's [`Serving`] until it is done.
struct Tracked<B> {
    inner: B,
    _serving: Serving,
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Serves one connection until it ends or its deadline passes.
async fn connection(
    tcp: tokio::net::TcpStream,
    routes: Router,
    limits: HttpLimits,
    activity: Arc<Activity>,
    start: Instant,
) {
    let served = activity.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let serving = Serving::begin(served.clone(), start);
        let mut r = routes.clone();
        async move {
            let resp = tower_service::Service::call(&mut r, req).await;
            let resp = resp.unwrap_or_else(|never| match never {});
            Ok::<_, Infallible>(resp.map(|inner| Tracked {
                inner,
                _serving: serving,
            }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(TokioIo::new(tcp), service);
    let _ = tokio::time::timeout(limits.connection_deadline, conn).await;
}

/// Serves `routes` on `listener` within `limits` until the task is aborted.
pub async fn serve(
    listener: tokio::net::TcpListener,
    routes: Router,
    limits: HttpLimits,
    stats: Arc<HttpStats>,
) {
    let table = Arc::new(Mutex::new(Table::default()));
    let start = Instant::now();
    loop {
        let (tcp, peer): (tokio::net::TcpStream, SocketAddr) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors, or the like: wait rather than spin.
                tracing::debug!("HTTP accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let ip = peer.ip();
        let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
        if !t.make_room(ip, &limits, &stats) {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let id = t.next;
        t.next += 1;
        let activity = Arc::new(Activity {
            busy: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(ms_since(start)),
        });
        let done = table.clone();
        let conn = connection(tcp, routes.clone(), limits, activity.clone(), start);
        let task = tokio::spawn(async move {
            conn.await;
            done.lock()
                .unwrap_or_else(|p| p.into_inner())
                .open
                .remove(&id);
        });
        t.open.insert(
            id,
            Open {
                ip,
                activity,
                task: task.abort_handle(),
            },
        );
    }
}

#[cfg(test)]
mod tests;
