//! A whole node as `moeswarm node` runs it: identity, store, swarm, HTTP, and advertising.
//!
//! At start a node opens its store, loads (or creates) its key in the data dir, joins the
//! swarm, and for every model in its store follows the model's holdings topic, announces the
//! manifest in the DHT and publishes a signed record of the slabs it holds. It publishes again
//! before the record expires and whenever it fetched something.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Context, Result};
use indicatif::ProgressBar;
use libp2p::Multiaddr;
use moeswarm_protocol::holdings::LayerBits;
use moeswarm_protocol::{Holdings, Manifest, ModelId, Reach, SignedHoldings};

use super::fetch::{FetchReport, Fetcher, Selection};
use super::handle::NodeHandle;
use super::identity::{node_key_of, NodeIdentity};
use super::records::now_secs;
#[cfg(feature = "test-faults")]
use super::serve::ServeFault;
use super::swarm::{NodeConfig, SwarmNode};
use crate::dataplane::{HeldExperts, WorkerService};
use crate::faults::WorkerFault;
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
    /// How ranges are served (tests only).
    #[cfg(feature = "test-faults")]
    pub serve_fault: ServeFault,
    /// The data plane: serving dispatches, relaying.
    pub data_plane: DataPlaneOptions,
}

/// How a node takes part in the data plane. The default takes no part.
#[derive(Debug, Clone, Default)]
pub struct DataPlaneOptions {
    /// Serve dispatches for the held slabs directly on this UDP address (an address others
    /// can reach: it is advertised as is).
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
    ad: Advert,
    /// The worker, when the node serves dispatches.
    pub worker: Option<WorkerService>,
    /// The data-plane relay, when the node runs one.
    pub relay: Option<RelayServer>,
    /// The node's data-plane endpoint (worker or router side).
    pub endpoint: Option<DataEndpoint>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// What goes into this node's records besides what it holds.
#[derive(Debug, Clone)]
struct Advert {
    ttl: Duration,
    capacity: u64,
    addrs: Vec<String>,
    reach: Reach,
}

/// A sequence number that grows across restarts: microseconds since the epoch.
fn fresh_seq() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
}

/// The signed record of what `store` holds of `manifest`'s model; `free_bytes` says how much
/// more the node would take.
pub fn holdings_record(
    store: &Store,
    manifest: &Manifest,
    id: &NodeIdentity,
    ttl: Duration,
    free_bytes: u64,
) -> Result<SignedHoldings> {
    holdings_record_reached(
        store,
        manifest,
        id,
        ttl,
        free_bytes,
        Vec::new(),
        Reach::Direct,
    )
}

/// [`holdings_record`] with the node's data-plane addresses and how it is reached.
pub fn holdings_record_reached(
    store: &Store,
    manifest: &Manifest,
    id: &NodeIdentity,
    ttl: Duration,
    free_bytes: u64,
    addrs: Vec<String>,
    reach: Reach,
) -> Result<SignedHoldings> {
    let h = &manifest.hyper;
    let mut layers = vec![LayerBits::empty(h.n_expert); h.n_layer as usize];
    for (l, e) in store.held_slabs(manifest)? {
        layers[l as usize].set(e);
    }
    let record = Holdings {
        model: manifest.id(),
        node: id.key,
        n_expert: h.n_expert,
        layers,
        free_bytes,
        addrs,
        reach,
        seq: fresh_seq(),
        expires_at: now_secs() + ttl.as_secs().max(1),
    };
    Ok(record.sign(&id.signing))
}

impl RunningNode {
    /// Starts a node: opens the store (reporting blobs it dropped), joins, and advertises.
    pub async fn start(opts: NodeOptions) -> Result<Self> {
        let identity = NodeIdentity::load_or_create(&opts.data_dir)?;
        let dir = opts.data_dir.clone();
        let (store, report) = tokio::task::spawn_blocking(move || Store::open(&dir))
            .await
            .context("opening the store")??;
        if !report.dropped.is_empty() {
            tracing::warn!(
                "store: dropped {} missing or corrupt blobs from the index",
                report.dropped.len()
            );
        }
        let store = Arc::new(store);
        let config = NodeConfig {
            listen: opts.listen.clone(),
            bootstrap: opts.bootstrap.clone(),
            relay_server: opts.relay_server,
            #[cfg(feature = "test-faults")]
            serve_fault: opts.serve_fault,
        };
        let keypair = identity.keypair.clone();
        let handle = SwarmNode::spawn(identity, Some(store.clone()), config).await?;
        let dp = &opts.data_plane;
        let relay = match dp.relay_server {
            Some(addr) => Some(RelayServer::spawn(&keypair, addr, RelayLimits::default())?),
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
            let ep = DataEndpoint::bind(&keypair, bind, &[DISPATCH_ALPN])?;
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
                    addrs.push(format!("quic://{}", ep.local_addr()?));
                    None
                }
            };
            let held = load_held(&store, HeldExperts::default()).await?;
            worker = Some(WorkerService::spawn(
                held,
                dp.listen.is_some().then(|| ep.clone()),
                relay_client,
                keypair.clone(),
                if dp.queue == 0 { 8 } else { dp.queue },
                dp.fault(),
            ));
            endpoint = Some(ep);
        }
        let mut tasks = Vec::new();
        let mut http_addr = None;
        if let Some(addr) = opts.http {
            let (bound, task) = crate::http::serve(store.clone(), addr).await?;
            http_addr = Some(bound);
            tasks.push(task);
        }
        let fetcher = Fetcher::new(handle.clone(), store.clone());
        let node = Self {
            handle,
            store,
            fetcher,
            http_addr,
            ad: Advert {
                ttl: opts.record_ttl,
                capacity: opts.capacity,
                addrs,
                reach,
            },
            worker,
            relay,
            endpoint,
            tasks,
        };
        if !opts.bootstrap.is_empty() {
            node.handle
                .wait_for_peers(1, Duration::from_secs(10))
                .await
                .context("joining through the bootstrap nodes")?;
        }
        node.advertise().await?;
        Ok(node)
    }

    /// Keeps the records fresh: publishes again every half lifetime, until the node stops.
    pub fn keep_advertising(&mut self) {
        let (handle, store, ad) = (self.handle.clone(), self.store.clone(), self.ad.clone());
        self.tasks.push(tokio::spawn(async move {
            let period = (ad.ttl / 2).max(Duration::from_secs(1));
            loop {
                tokio::time::sleep(period).await;
                if let Err(e) = advertise(&handle, &store, &ad).await {
                    tracing::warn!("re-advertising failed: {e:#}");
                }
            }
        }));
    }

    /// Publishes a fresh record for every model in the store.
    pub async fn advertise(&self) -> Result<()> {
        advertise(&self.handle, &self.store, &self.ad).await
    }

    /// Fetches the selected part of `model` and advertises what the node now holds.
    pub async fn fetch(
        &self,
        model: ModelId,
        selection: &Selection,
        progress: &ProgressBar,
    ) -> Result<FetchReport> {
        let report = self.fetcher.fetch_model(model, selection, progress).await;
        if let Some(w) = &self.worker {
            // Only the newly fetched slabs are loaded; the rest are shared.
            w.set_experts(load_held(&self.store, w.experts()).await?);
        }
        self.advertise().await?;
        report
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

    /// Stops everything the node runs and releases its store.
    pub async fn shutdown(self) {
        if let Some(w) = &self.worker {
            w.shutdown();
        }
        if let Some(r) = self.relay {
            r.shutdown();
        }
        if let Some(ep) = &self.endpoint {
            ep.close();
        }
        drop(self.worker);
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
        self.handle.shutdown().await;
        drop(self.fetcher);
        // Let blocking readers finish with the store before it is released.
        let store = self.store;
        for _ in 0..100 {
            if Arc::strong_count(&store) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Err(e) = store.flush() {
            tracing::warn!("flushing the store index at shutdown: {e:#}");
        }
    }
}

/// Bytes of all blobs in `store`.
fn held_bytes(store: &Store) -> Result<u64> {
    Ok(store.blobs()?.iter().map(|(_, e)| e.size).sum())
}

/// Every held slab of every model in `store`, loaded to compute; those in `held` already are
/// kept as they are.
async fn load_held(store: &Arc<Store>, mut held: HeldExperts) -> Result<HeldExperts> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || {
        for m in store.models()? {
            HeldExperts::load(&store, &store.manifest(&m)?, &mut held)?;
        }
        Ok(held)
    })
    .await
    .context("loading experts")?
}

async fn advertise(handle: &NodeHandle, store: &Arc<Store>, ad: &Advert) -> Result<()> {
    let free = ad.capacity.saturating_sub(held_bytes(store)?);
    // The data plane first, then where the node listens on libp2p (so a fetcher that has not
    // met it can dial it), as many as a record takes.
    let mut addrs = ad.addrs.clone();
    for a in handle.listen_addrs().await? {
        let a = a.to_string();
        if addrs.len() < moeswarm_protocol::holdings::MAX_ADDRS
            && a.len() <= moeswarm_protocol::holdings::MAX_ADDR_BYTES
            && !a.contains("/0.0.0.0/")
        {
            addrs.push(a);
        }
    }
    for model in store.models()? {
        let manifest = store.manifest(&model)?;
        let h = &manifest.hyper;
        handle.subscribe(model, h.n_layer, h.n_expert).await?;
        handle.provide(model).await?;
        let record = holdings_record_reached(
            store,
            &manifest,
            &handle.identity,
            ad.ttl,
            free,
            addrs.clone(),
            ad.reach,
        )?;
        handle.publish(model, record).await?;
    }
    Ok(())
}
