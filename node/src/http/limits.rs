//! The HTTP server's own accept loop, so that no client, or crowd of clients, holds the node's
//! HTTP: a deadline on each request's headers, a bound on connections in all and per client
//! address, and, when a bound is reached, room made by closing the oldest connection that has
//! not yet sent a request (a half-open one) rather than by turning the newcomer away.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
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
            per_client: 64,
            header_timeout: Duration::from_secs(10),
            connection_deadline: Duration::from_secs(30 * 60),
        }
    }
}

/// What the server did about its limits.
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Half-open connections closed to make room.
    pub evicted: AtomicU64,
    /// Connections turned away (every one open was serving a request).
    pub refused: AtomicU64,
}

struct Open {
    ip: IpAddr,
    since: Instant,
    /// Whether a request's headers came in on it.
    requested: Arc<AtomicBool>,
    task: tokio::task::AbortHandle,
}

#[derive(Default)]
struct Table {
    next: u64,
    open: HashMap<u64, Open>,
}

impl Table {
    /// Makes room for one more connection from `ip`, closing the oldest half-open connection
    /// (of `ip` when it is at its bound, of anyone when the server is); false if there is
    /// none to close.
    fn make_room(&mut self, ip: IpAddr, limits: &HttpLimits, stats: &HttpStats) -> bool {
        let mine = self.open.values().filter(|o| o.ip == ip).count();
        let scope: Option<IpAddr> = if mine >= limits.per_client.max(1) {
            Some(ip)
        } else if self.open.len() >= limits.max_connections.max(1) {
            None
        } else {
            return true;
        };
        let oldest = self
            .open
            .iter()
            .filter(|(_, o)| scope.is_none_or(|s| o.ip == s))
            .filter(|(_, o)| !o.requested.load(Ordering::Relaxed))
            .min_by_key(|(_, o)| o.since)
            .map(|(k, _)| *k);
        match oldest.and_then(|k| self.open.remove(&k)) {
            Some(o) => {
                o.task.abort();
                stats.evicted.fetch_add(1, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }
}

/// Serves `routes` on `listener` within `limits` until the task is aborted.
pub async fn serve(
    listener: tokio::net::TcpListener,
    routes: Router,
    limits: HttpLimits,
    stats: Arc<HttpStats>,
) {
    let table = Arc::new(Mutex::new(Table::default()));
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
        let requested = Arc::new(AtomicBool::new(false));
        let flag = requested.clone();
        let routes = routes.clone();
        let done = table.clone();
        let task = tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                flag.store(true, Ordering::Relaxed);
                let mut r = routes.clone();
                async move {
                    let resp = tower_service::Service::call(&mut r, req).await;
                    Ok::<_, Infallible>(resp.unwrap_or_else(|never| match never {}))
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(tcp), service);
            let _ = tokio::time::timeout(limits.connection_deadline, conn).await;
            done.lock()
                .unwrap_or_else(|p| p.into_inner())
                .open
                .remove(&id);
        });
        t.open.insert(
            id,
            Open {
                ip,
                since: Instant::now(),
                requested,
                task: task.abort_handle(),
            },
        );
    }
}
