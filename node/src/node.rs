//! The node's composition root: a whole node as `moeswarm node` runs it — identity, store,
//! swarm, HTTP, the data plane (worker, relay), advertising, and (with a capacity) taking part
//! in the market by itself.
//!
//! At start a node opens its store, loads (or creates) its key in the data dir, joins the
//! swarm, and for every model in its store follows the model's holdings and demand topics,
//! announces the manifest in the DHT and publishes a signed record of the slabs it holds
//! ([`crate::holdings`]). It publishes again before the record expires and whenever what it
//! holds changed. When it stops cleanly it publishes a last record that holds nothing, so
//! coverage drops at once (a crash is covered by the record's expiry). A one-shot command's
//! node advertises nothing. With [`NodeOptions::auto`] the node chooses, fetches and drops
//! slabs itself ([`crate::auto`]). This module wires the rooms together; what each does is in
//! its own module.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Context, Result};
use indicatif::ProgressBar;
use libp2p::Multiaddr;
use moeswarm_protocol::{ModelId, Reach};

use crate::auto::{AutoOptions, AutoStats, Participant};
use crate::dataplane::{HeldExperts, WorkerService};
use crate::faults::WorkerFault;
use crate::holdings::{guard_store, load_held, Advert, Advertiser};
use crate::net::identity::{node_key_of, NodeIdentity};
#[cfg(feature = "test-faults")]
use crate::net::ServeFault;
use crate::net::{FetchReport, Fetcher, NodeConfig, NodeHandle, Selection, SwarmNode};
use moeswarm_market::choice::NodeClass;
use moeswarm_model::store::Store;
use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_relay::{DataEndpoint, PeerId, RelayClient, RelayLimits, RelayServer};

/// How to run a node.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// The data dir: the store, and the node's key (`identity.key`).
    pub data_dir: PathBuf,
    /// libp2p listen addresses.
    pub listen: Vec<Multiaddr>,
    /// Nodes to join through.
    pub bootstrap: Vec<Multiaddr>,
    /// Where to serve HTTP (`/blob`, `/expert-shard`), if at all.
    pub http: Option<SocketAddr>,
    /// Act as a libp2p relay server.
    pub relay_server: bool,
    /// Lifetime of the holdings records this node signs.
    pub record_ttl: Duration,
    /// Bytes of slabs this node is willing to hold (its records say how much is left).
    pub capacity: u64,
    /// Publish holdings records (a one-shot command's node does not: it is gone soon).
    pub advertise: bool,
    /// A phone: slow, sleeps; in the market it takes cold slabs (as relayed nodes do).
    pub phone: bool,
    /// Take part in the market: choose, fetch and drop slabs under `capacity`.
    pub auto: Option<AutoOptions>,
    /// How ranges are served (tests only).
    #[cfg(feature = "test-faults")]
    pub serve_fault: ServeFault,
    /// The data plane: serving dispatches, relaying.
    pub data_plane: DataPlaneOptions,
}

/// How a node takes part in the data plane. The default takes no part.
#[derive(Debug, Clone, Default)]
pub struct DataPlaneOptions {
    /// Serve dispatches for the held slabs directly on this UDP address (advertised as is, or,
    /// when unspecified like `0.0.0.0:4433`, at this host's interface addresses).
    pub listen: Option<SocketAddr>,
    /// Serve dispatches through this relay (its PeerId and data-plane address) instead.
    pub via_relay: Option<(PeerId, SocketAddr)>,
    /// Run a data-plane relay on this UDP address.
    pub relay_server: Option<SocketAddr>,
    /// Dispatches computed or waiting at once before the worker answers busy (0: 8).
    pub queue: usize,
    /// How the worker answers (tests only).
    #[cfg(feature = "test-faults")]
    pub fault: WorkerFault,
    /// How the relay this node runs rewrites what it carries (tests only).
    #[cfg(feature = "test-faults")]
    pub relay_tamper: moeswarm_relay::Tamper,
}

impl DataPlaneOptions {
    /// How the worker answers: as told in tests, honestly otherwise.
    fn fault(&self) -> WorkerFault {
        #[cfg(feature = "test-faults")]
        return self.fault;
        #[cfg(not(feature = "test-faults"))]
        WorkerFault::Honest
    }
}

impl NodeOptions {
    /// A node in `data_dir` listening on a free TCP port of 127.0.0.1, joining through
    /// `bootstrap`.
    pub fn local(data_dir: PathBuf, bootstrap: Vec<Multiaddr>) -> Self {
        Self {
            data_dir,
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().expect("a valid multiaddr")],
            bootstrap,
            http: None,
            relay_server: false,
            record_ttl: Duration::from_secs(3600),
            capacity: u64::MAX,
            advertise: true,
            phone: false,
            auto: None,
            #[cfg(feature = "test-faults")]
            serve_fault: ServeFault::Honest,
            data_plane: DataPlaneOptions::default(),
        }
    }
}

/// A running node.
pub struct RunningNode {
    /// Drives the swarm.
    pub handle: NodeHandle,
    /// The node's store.
    pub store: Arc<Store>,
    /// Fetches into the store.
    pub fetcher: Fetcher,
    /// Where HTTP is served.
    pub http_addr: Option<SocketAddr>,
    advertiser: Advertiser,
    /// The worker, when the node serves dispatches.
    pub worker: Option<Arc<WorkerService>>,
    /// What the node's market rounds did, when it takes part by itself.
    pub market: Option<Arc<AutoStats>>,
    /// The data-plane relay, when the node runs one.
    pub relay: Option<RelayServer>,
    /// The node's data-plane endpoint (worker or router side).
    pub endpoint: Option<DataEndpoint>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningNode {
    /// Starts a node: opens the store (reporting blobs it dropped), joins, and advertises.
    pub async fn start(opts: NodeOptions) -> Result<Self> {
        let identity = NodeIdentity::load_or_create(&opts.data_dir)?;
        let store = open_store(&opts.data_dir).await?;
        let config = NodeConfig {
            listen: opts.listen.clone(),
            bootstrap: opts.bootstrap.clone(),
            relay_server: opts.relay_server,
            #[cfg(feature = "test-faults")]
            serve_fault: opts.serve_fault,
        };
        let keypair = identity.keypair.clone();
        let handle = SwarmNode::spawn(identity, Some(store.clone()), config).await?;
        let DataPlane {
            relay,
            addrs,
            reach,
            endpoint,
            worker,
        } = start_data_plane(&opts.data_plane, &keypair, &store).await?;
        let mut tasks = Vec::new();
        let mut http_addr = None;
        if let Some(addr) = opts.http {
            let routes = crate::http::router(store.clone()).merge(crate::dashboard::routes(
                crate::dashboard::Sources {
                    node: Some((handle.clone(), store.clone())),
                    ..Default::default()
                },
            ));
            let (bound, task) = crate::http::serve_routes(routes, addr).await?;
            http_addr = Some(bound);
            tasks.push(task);
        }
        let fetcher = Fetcher::new(handle.clone(), store.clone());
        let class = if opts.phone || matches!(reach, Reach::ViaRelay(_)) {
            NodeClass::Phone
        } else {
            NodeClass::Computer
        };
        let advertiser = Advertiser {
            handle: handle.clone(),
            store: store.clone(),
            worker: worker.clone(),
            ad: Advert {
                enabled: opts.advertise,
                ttl: opts.record_ttl,
                capacity: opts.capacity,
                addrs,
                reach,
            },
        };
        let mut node = Self {
            handle,
            store,
            fetcher,
            http_addr,
            advertiser,
            worker,
            market: None,
            relay,
            endpoint,
            tasks,
        };
        if !opts.bootstrap.is_empty() {
            let tried: Vec<String> = opts.bootstrap.iter().map(|a| a.to_string()).collect();
            node.handle
                .wait_for_peers(1, Duration::from_secs(10))
                .await
                .with_context(|| {
                    format!(
                        "no bootstrap node answered within 10 s (tried {}): is it running, and \
                         is the address (with its /p2p/ peer id) right and reachable from here?",
                        tried.join(", ")
                    )
                })?;
        }
        node.advertise().await?;
        node.tasks
            .push(tokio::spawn(guard_store(node.advertiser.clone())));
        if node.advertiser.ad.enabled {
            node.tasks
                .push(tokio::spawn(node.advertiser.clone().keep_beating()));
        }
        node.tasks.push(tokio::spawn(keep_learning(
            node.handle.clone(),
            node.store.clone(),
        )));
        if let Some(auto) = opts.auto {
            let stats = Arc::new(AutoStats::default());
            let participant = Participant {
                handle: node.handle.clone(),
                store: node.store.clone(),
                fetcher: node.fetcher.clone(),
                advertiser: node.advertiser.clone(),
                class,
                opts: auto,
                stats: stats.clone(),
            };
            node.tasks.push(tokio::spawn(participant.run()));
            node.market = Some(stats);
        }
        Ok(node)
    }

    /// Keeps the records fresh: publishes again every half lifetime, until the node stops.
    pub fn keep_advertising(&mut self) {
        self.tasks
            .push(tokio::spawn(self.advertiser.clone().keep_fresh()));
    }

    /// Publishes a fresh record for every model in the store.
    pub async fn advertise(&self) -> Result<()> {
        self.advertiser.advertise().await
    }

    /// Fetches the selected part of `model` and advertises what the node now holds.
    pub async fn fetch(
        &self,
        model: ModelId,
        selection: &Selection,
        progress: &ProgressBar,
    ) -> Result<FetchReport> {
        let report = self.fetcher.fetch_model(model, selection, progress).await;
        self.advertiser.reload_and_advertise().await?;
        report
    }

    /// Runs `task` until the node stops.
    pub(crate) fn add_task(&mut self, task: tokio::task::JoinHandle<()>) {
        self.tasks.push(task);
    }

    /// The addresses others join through.
    pub async fn addrs(&self) -> Result<Vec<Multiaddr>> {
        self.handle.listen_addrs().await
    }

    /// The data-plane endpoint, bound on first use (a router that is not a worker dials from
    /// it).
    pub fn data_endpoint(&mut self) -> Result<DataEndpoint> {
        if let Some(ep) = &self.endpoint {
            return Ok(ep.clone());
        }
        let ep = DataEndpoint::bind(
            &self.handle.identity.keypair,
            "0.0.0.0:0".parse().expect("an address"),
            &[DISPATCH_ALPN],
        )?;
        self.endpoint = Some(ep.clone());
        Ok(ep)
    }

    /// Stops cleanly: first says so (a record per model that holds nothing, so coverage drops
    /// at once), then stops everything the node runs and releases its store.
    pub async fn shutdown(self) {
        for t in &self.tasks {
            t.abort();
        }
        if self.advertiser.ad.enabled {
            match self.advertiser.withdraw().await {
                // Give gossip a moment to carry the last records out.
                Ok(n) if n > 0 => tokio::time::sleep(Duration::from_millis(300)).await,
                Ok(_) => {}
                Err(e) => tracing::warn!("withdrawing the holdings at shutdown: {e:#}"),
            }
        }
        self.stop().await
    }

    /// Stops without a word to the swarm, as a crash would (its records live on until they
    /// expire). For tests of the swarm's recovery.
    #[doc(hidden)]
    pub async fn crash(self) {
        self.stop().await
    }

    async fn stop(self) {
        let RunningNode {
            handle,
            store,
            fetcher,
            advertiser,
            worker,
            market,
            relay,
            endpoint,
            tasks,
            http_addr: _,
        } = self;
        if let Some(w) = &worker {
            w.shutdown();
        }
        if let Some(r) = relay {
            r.shutdown();
        }
        if let Some(ep) = &endpoint {
            ep.close();
        }
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        handle.shutdown().await;
        drop((worker, fetcher, advertiser, market, endpoint));
        // Blocking readers still at work hold the store: it is released (its index forced to
        // disk and closed) when the last of them lets go, waited for here for up to 2 s.
        let (released, gone) = tokio::sync::oneshot::channel();
        store.on_release(move || {
            let _ = released.send(());
        });
        drop(store);
        if tokio::time::timeout(Duration::from_secs(2), gone)
            .await
            .is_err()
        {
            tracing::warn!("the store is still in use 2 s after the node stopped");
        }
    }
}

/// Opens the store in `dir`, checking sizes only (every blob is hashed in the background once
/// the node runs), and says what it adopted, quarantined or dropped.
async fn open_store(dir: &std::path::Path) -> Result<Arc<Store>> {
    let dir = dir.to_path_buf();
    // Sizes only now; every blob is hashed in the background once the node runs.
    let (store, report) = tokio::task::spawn_blocking(move || {
        Store::open_with(&dir, moeswarm_model::store::Check::Sizes)
    })
    .await
    .context("opening the store")??;
    if !report.adopted.is_empty() || !report.quarantined.is_empty() {
        tracing::warn!(
            "store: adopted {} blobs the index did not name, quarantined {} files",
            report.adopted.len(),
            report.quarantined.len()
        );
    }
    if !report.dropped.is_empty() {
        tracing::warn!(
            "store: dropped {} missing or corrupt blobs from the index",
            report.dropped.len()
        );
    }
    Ok(Arc::new(store))
}

/// The node's data plane as started: its relay (if it runs one), the addresses and the reach
/// its records give, its endpoint and its worker (if it serves dispatches).
struct DataPlane {
    relay: Option<RelayServer>,
    addrs: Vec<String>,
    reach: Reach,
    endpoint: Option<DataEndpoint>,
    worker: Option<Arc<WorkerService>>,
}

/// Starts the data plane `dp` asks for: a relay server, and a worker on a direct endpoint or
/// registered with a relay, computing the slabs in `store`.
async fn start_data_plane(
    dp: &DataPlaneOptions,
    keypair: &moeswarm_relay::Keypair,
    store: &Arc<Store>,
) -> Result<DataPlane> {
    let relay = match dp.relay_server {
        #[cfg(feature = "test-faults")]
        Some(addr) => Some(RelayServer::spawn_tampering(
            keypair,
            addr,
            RelayLimits::default(),
            dp.relay_tamper,
        )?),
        #[cfg(not(feature = "test-faults"))]
        Some(addr) => Some(RelayServer::spawn(keypair, addr, RelayLimits::default())?),
        None => None,
    };
    let mut addrs = Vec::new();
    let mut reach = Reach::Direct;
    let mut endpoint = None;
    let mut worker = None;
    if dp.listen.is_some() || dp.via_relay.is_some() {
        let bind = dp
            .listen
            .unwrap_or_else(|| "0.0.0.0:0".parse().expect("an address"));
        let ep = DataEndpoint::bind(keypair, bind, &[DISPATCH_ALPN])?;
        let relay_client = match dp.via_relay {
            Some((peer, addr)) => {
                let c = RelayClient::register(&ep, addr, peer)
                    .await
                    .with_context(|| format!("registering with relay {peer} at {addr}"))?;
                addrs.push(format!("quic://{addr}"));
                reach = Reach::ViaRelay(
                    node_key_of(&peer).context("the relay's PeerId is not an ed25519 key")?,
                );
                Some(c)
            }
            None => {
                let local = ep.local_addr()?;
                addrs.extend(dialable(local).iter().map(|a| format!("quic://{a}")));
                None
            }
        };
        let held = load_held(store, HeldExperts::default()).await?;
        worker = Some(Arc::new(WorkerService::spawn(
            held,
            // A worker registered with a relay accepts direct connections too: a router that
            // punched through its NAT dials it on this endpoint.
            Some(ep.clone()),
            relay_client,
            keypair.clone(),
            if dp.queue == 0 { 8 } else { dp.queue },
            dp.fault(),
        )));
        endpoint = Some(ep);
    }
    Ok(DataPlane {
        relay,
        addrs,
        reach,
        endpoint,
        worker,
    })
}

/// How often a node asks its peers for the records of the models it holds.
const LEARN_EVERY: Duration = Duration::from_secs(30);

/// Asks the connected peers for the records of every model in the store, soon after the start
/// and then every [`LEARN_EVERY`]: what gossip carried before this node followed a model's
/// topics (or while it was away) is learned this way; records live an hour and are published
/// again only every half hour.
async fn keep_learning(handle: NodeHandle, store: Arc<Store>) {
    tokio::time::sleep(Duration::from_secs(2)).await;
    loop {
        for model in store.models().unwrap_or_default() {
            if let Err(e) = crate::net::learn_records(&handle, model).await {
                tracing::debug!("learning the records of {model}: {e:#}");
            }
        }
        tokio::time::sleep(LEARN_EVERY).await;
    }
}

/// The addresses a router can dial for a data plane bound to `local`: `local` itself, or, bound
/// to an unspecified address (`0.0.0.0:4433`, the natural choice on a LAN), the port on each of
/// this host's IPv4 interface addresses, those outside loopback first. Advertising `0.0.0.0`
/// would name no one.
fn dialable(local: std::net::SocketAddr) -> Vec<std::net::SocketAddr> {
    if !local.ip().is_unspecified() {
        return vec![local];
    }
    let mut ips = interface_ipv4s();
    ips.sort_by_key(|ip| ip.is_loopback());
    ips.into_iter()
        .map(|ip| std::net::SocketAddr::new(ip.into(), local.port()))
        .collect()
}

/// This host's IPv4 interface addresses.
fn interface_ipv4s() -> Vec<std::net::Ipv4Addr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below by freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut at = head;
    while !at.is_null() {
        // SAFETY: a node of the list getifaddrs made; ifa_addr may be null.
        let ifa = unsafe { &*at };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: a non-null sockaddr; its family says whether it is a sockaddr_in.
            let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
            if family == libc::AF_INET {
                // SAFETY: AF_INET addresses are sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !out.contains(&ip) {
                    out.push(ip);
                }
            }
        }
        at = ifa.ifa_next;
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}
