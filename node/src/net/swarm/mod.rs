//! The libp2p swarm and its event loop.
//!
//! One tokio task owns the [`Swarm`]; everything else talks to it through [`NodeHandle`]
//! commands with deadlines (`handle`). Requests for blob bytes are answered on blocking threads
//! (file reads and hashing) and their answers come back to the task through a channel.

use std::collections::{HashMap, HashSet};

use crate::net::records::RecordKind;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{bail, Context, Error, Result};
use futures::StreamExt;
use libp2p::kad::StoreInserts;
use libp2p::request_response::{self as rr, OutboundRequestId, ProtocolSupport, ResponseChannel};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{
    autonat, dcutr, gossipsub, identify, kad, ping, relay, Multiaddr, PeerId, StreamProtocol, Swarm,
};
use moeswarm_market::coverage::CoverageMap;
use moeswarm_market::demand::DemandBook;
use moeswarm_protocol::exchange::EXCHANGE_PROTOCOL;
use moeswarm_protocol::holdings::MAX_RECORD_BYTES;
use moeswarm_protocol::{ExchangeResponse, ModelId, NodeKey};
use tokio::sync::{mpsc, oneshot};

use crate::net::bulk::{lane_addr, BulkServer};
use crate::net::codec::ExchangeCodec;
use crate::net::handle::{Command, NodeHandle, REQUEST_DEADLINE};
use crate::net::identity::NodeIdentity;
use crate::net::serve::ServeFault;
use crate::net::stats::NodeStats;
use moeswarm_model::store::Store;

mod bans;
mod budget;
mod control;
mod inbound;
mod liveness;
mod receive;
mod rejoin;
mod table;
mod vetting;

/// libp2p's TCP listeners set SO_REUSEPORT, so a second node on a port already in use would
/// start, and share the port's connections with the first: a TCP port given explicitly is
/// bound once here without it, which fails if anyone holds the port.
fn refuse_taken_tcp_port(addr: &libp2p::Multiaddr) -> Result<()> {
    use libp2p::multiaddr::Protocol;
    let mut ip = None;
    for p in addr.iter() {
        match p {
            Protocol::Ip4(a) => ip = Some(std::net::IpAddr::V4(a)),
            Protocol::Ip6(a) => ip = Some(std::net::IpAddr::V6(a)),
            Protocol::Tcp(port) if port != 0 => {
                if let Some(ip) = ip {
                    if let Err(e) = std::net::TcpListener::bind((ip, port)) {
                        bail!("cannot listen on {addr}: {e} (is another node running there?)");
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Kademlia's protocol name: this swarm's own DHT, not the public IPFS one.
pub const KAD_PROTOCOL: &str = "/moeswarm/kad/1.0.0";
/// Identify's protocol version string.
pub const IDENTIFY_VERSION: &str = "/moeswarm/1.0.0";
/// Exchange requests answered at once per node (each holds at most one range in memory).
pub const MAX_SERVING: usize = 16;
/// Peers that requests may wait to be connected to at once.
pub const MAX_WAITING_PEERS: usize = 1024;
/// Requests that may wait for one peer to connect.
pub const MAX_WAITING_PER_PEER: usize = 64;
/// Most nodes whose records are kept per model (each record is at most 12 KiB).
pub const MAX_NODES_PER_MODEL: usize = 4096;

#[derive(NetworkBehaviour)]
struct Behaviour {
    kad: kad::Behaviour<kad::store::MemoryStore>,
    identify: identify::Behaviour,
    ping: ping::Behaviour,
    gossipsub: gossipsub::Behaviour,
    exchange: rr::Behaviour<ExchangeCodec>,
    autonat: autonat::Behaviour,
    relay_client: relay::client::Behaviour,
    relay_server: Toggle<relay::Behaviour>,
    dcutr: dcutr::Behaviour,
}

/// How to start a node.
#[derive(Debug, Clone, Default)]
pub struct NodeConfig {
    /// Addresses to listen on, e.g. `/ip4/127.0.0.1/tcp/0` or `/ip4/127.0.0.1/udp/0/quic-v1`.
    pub listen: Vec<Multiaddr>,
    /// Addresses of nodes to join through, each ending in `/p2p/<peer id>`.
    pub bootstrap: Vec<Multiaddr>,
    /// Also act as a libp2p relay server for other nodes.
    pub relay_server: bool,
    /// How ranges are served (anything but honest is for tests).
    #[cfg(feature = "test-faults")]
    pub serve_fault: ServeFault,
}

/// Starts libp2p nodes.
pub struct SwarmNode;

fn build(id: &NodeIdentity, relay_server: bool) -> Result<Swarm<Behaviour>> {
    let gossip_config = gossipsub::ConfigBuilder::default()
        .heartbeat_interval(Duration::from_millis(500))
        .validation_mode(gossipsub::ValidationMode::Strict)
        .max_transmit_size(MAX_RECORD_BYTES + 1024)
        .mesh_n(4)
        .mesh_n_low(2)
        .mesh_n_high(8)
        .mesh_outbound_min(1)
        .validate_messages()
        .build()
        .map_err(|e| Error::invalid(format!("gossipsub config: {e}")))?;
    let swarm = libp2p::SwarmBuilder::with_existing_identity(id.keypair.clone())
        .with_tokio()
        .with_tcp(
            libp2p::tcp::Config::default().nodelay(true),
            libp2p::noise::Config::new,
            libp2p::yamux::Config::default,
        )
        .map_err(|e| Error::invalid(format!("TCP transport: {e}")))?
        .with_quic()
        .with_relay_client(libp2p::noise::Config::new, libp2p::yamux::Config::default)
        .map_err(|e| Error::invalid(format!("relay client transport: {e}")))?
        .with_behaviour(|key, relay_client| {
            let peer = key.public().to_peer_id();
            let mut kad_config = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
            kad_config.set_query_timeout(Duration::from_secs(20));
            // Records are checked (signature, signer, expiry) before they are stored.
            kad_config.set_record_filtering(StoreInserts::FilterBoth);
            let mut kad =
                kad::Behaviour::with_config(peer, kad::store::MemoryStore::new(peer), kad_config);
            // Automatic mode stays a client on networks with no confirmed external address.
            kad.set_mode(Some(kad::Mode::Server));
            let gossipsub = gossipsub::Behaviour::new(
                gossipsub::MessageAuthenticity::Signed(key.clone()),
                gossip_config,
            )
            .map_err(|e| e.to_string())?;
            let exchange = rr::Behaviour::with_codec(
                ExchangeCodec,
                [(
                    StreamProtocol::new(EXCHANGE_PROTOCOL),
                    ProtocolSupport::Full,
                )],
                rr::Config::default()
                    .with_request_timeout(REQUEST_DEADLINE)
                    .with_max_concurrent_streams(64),
            );
            Ok(Behaviour {
                kad,
                identify: identify::Behaviour::new(identify::Config::new(
                    IDENTIFY_VERSION.into(),
                    key.public(),
                )),
                ping: ping::Behaviour::new(ping::Config::new()),
                gossipsub,
                exchange,
                autonat: autonat::Behaviour::new(peer, autonat::Config::default()),
                relay_client,
                relay_server: relay_server
                    .then(|| relay::Behaviour::new(peer, relay::Config::default()))
                    .into(),
                dcutr: dcutr::Behaviour::new(peer),
            })
        })
        .map_err(|e| Error::invalid(format!("building behaviours: {e}")))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(120)))
        .build();
    Ok(swarm)
}

enum Pending {
    Providers(oneshot::Sender<Vec<PeerId>>, HashSet<PeerId>),
    Closest(PeerId, oneshot::Sender<Vec<Multiaddr>>),
    Record(oneshot::Sender<Option<Vec<u8>>>),
}

struct State {
    swarm: Swarm<Behaviour>,
    store: Option<Arc<Store>>,
    fault: ServeFault,
    /// The plain range lane (when the node has a store and an IP to listen on); stops with
    /// the swarm's task.
    bulk: Option<BulkServer>,
    /// Holdings records of each model followed: the coverage.
    holdings: HashMap<ModelId, table::RecordTable<CoverageMap>>,
    /// Demand records of each model followed.
    demand: HashMap<ModelId, table::RecordTable<DemandBook>>,
    /// The record topics followed: which kind of record of which model each carries.
    topics: HashMap<gossipsub::TopicHash, (RecordKind, ModelId)>,
    requests: HashMap<OutboundRequestId, oneshot::Sender<Result<ExchangeResponse>>>,
    queries: HashMap<kad::QueryId, Pending>,
    serving: usize,
    served_tx: mpsc::Sender<(ResponseChannel<ExchangeResponse>, ExchangeResponse)>,
    stats: NodeStats,
    bans: bans::Bans,
    /// Pages of records each peer may still ask for.
    pages: budget::PageBudget,
    /// Nodes this one has had a connection with (their keys proven), most recent 8192.
    met: HashMap<NodeKey, Met>,
    /// Strangers waiting for a dial to prove them before they get a place in a full table.
    vetting: vetting::Vetting,
    rng: rand::rngs::StdRng,
    /// Requests waiting for their peer to connect (see `State::request`).
    waiting: HashMap<PeerId, Vec<(moeswarm_protocol::ExchangeRequest, ReplySender)>>,
    /// How joined the node is, for those waiting on it.
    status: tokio::sync::watch::Sender<crate::net::stats::SwarmStatus>,
    /// Heartbeats heard: who counts as live.
    liveness: liveness::Liveness,
    /// This node's record key.
    own_key: NodeKey,
    /// The bootstrap nodes, dialed again whenever every connection is lost.
    bootstrap: Vec<Multiaddr>,
    /// When to look for the swarm again, once every connection is lost.
    rejoin: rejoin::Rejoin,
}

/// What a node knows of a peer it has had a connection with.
#[derive(Debug, Clone, Copy)]
struct Met {
    /// When it last connected.
    last: std::time::Instant,
    /// Blobs whose bytes it served that verified here.
    useful: u32,
}

impl Met {
    fn now() -> Self {
        Self {
            last: std::time::Instant::now(),
            useful: 0,
        }
    }
}

/// Where the answer to one exchange request goes.
type ReplySender = oneshot::Sender<Result<ExchangeResponse>>;

/// What an exchange request that failed met, as its callers tell it apart.
fn request_failure(peer: PeerId, error: rr::OutboundFailure) -> crate::net::stats::RequestFailure {
    use crate::net::stats::RequestFailure;
    match error {
        rr::OutboundFailure::DialFailure => RequestFailure::Unreachable {
            peer,
            why: "the dial failed".into(),
        },
        rr::OutboundFailure::Timeout => RequestFailure::Timeout { peer },
        rr::OutboundFailure::UnsupportedProtocols => RequestFailure::Unsupported { peer },
        other => RequestFailure::BrokeOff {
            peer,
            why: other.to_string(),
        },
    }
}

/// Hands `value` to whoever asked; an asker that gave up (its deadline passed) no longer
/// listens, which is no failure of the node.
fn reply_to<T>(reply: oneshot::Sender<T>, value: T) {
    if reply.send(value).is_err() {
        tracing::trace!("an asker left before its answer");
    }
}

impl State {
    /// Tells those waiting how joined the node is, when that changed.
    fn publish_status(&mut self) {
        let now = crate::net::stats::SwarmStatus {
            connected_peers: self.swarm.connected_peers().count(),
            dht_bootstraps: self.stats.dht_bootstraps,
            records_taken: self.stats.records_applied,
        };
        self.status.send_if_modified(|s| {
            let changed = *s != now;
            *s = now;
            changed
        });
    }

    /// A node with no connection left dials its bootstrap nodes and the peers its DHT table
    /// remembers (see [`rejoin`]).
    fn stay_joined(&mut self) {
        let connected = self.swarm.connected_peers().count();
        if !self.rejoin.due(connected, std::time::Instant::now()) {
            return;
        }
        for addr in self.bootstrap.clone() {
            if let Err(e) = self.swarm.dial(addr.clone()) {
                tracing::debug!("dialing {addr} again: {e}");
            }
        }
        if let Err(e) = self.swarm.behaviour_mut().kad.bootstrap() {
            tracing::debug!("no DHT bootstrap to find the swarm again: {e}");
        }
    }

    fn event(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => {
                for addr in info.listen_addrs {
                    self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message {
                message,
                message_id,
                propagation_source,
            })) => {
                // Only what verifies is forwarded; a peer that forwards what does not is struck.
                let verdict = if let Some((kind, model)) = self.topics.get(&message.topic).copied()
                {
                    self.receive(kind, model, message.source, &message.data)
                } else if message.topic == liveness::alive_topic().hash() {
                    self.receive_heartbeat(message.source, &message.data)
                } else {
                    gossipsub::MessageAcceptance::Ignore
                };
                let reject = verdict == gossipsub::MessageAcceptance::Reject;
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .report_message_validation_result(&message_id, &propagation_source, verdict);
                if reject {
                    self.strike(propagation_source);
                }
            }
            SwarmEvent::ConnectionEstablished { peer_id, .. } => {
                if self.bans.is_banned(&peer_id, std::time::Instant::now()) {
                    let _ = self.swarm.disconnect_peer_id(peer_id);
                    self.fail_waiting(peer_id, &format!("{peer_id} is banned here"));
                } else {
                    if let Some(key) = crate::net::identity::node_key_of(&peer_id) {
                        self.meet(key);
                        self.liveness.touch(key, std::time::Instant::now());
                    }
                    self.connected(peer_id);
                    self.vetted(peer_id);
                }
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                tracing::debug!("dialing {peer_id:?} failed: {error}");
                if let Some(p) = peer_id {
                    if !self.swarm.is_connected(&p) {
                        self.fail_waiting(p, &format!("dialing {p} failed: {error}"));
                        self.vetting.dial_failed(p, std::time::Instant::now());
                        self.vet();
                    }
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                cause,
                num_established,
                ..
            } => {
                if let Some(cause) = cause {
                    tracing::debug!("connection to {peer_id} closed: {cause}");
                }
                // Its window starts now: a crash is noticed once it passes without a heartbeat.
                if num_established == 0 {
                    if let Some(key) = crate::net::identity::node_key_of(&peer_id) {
                        self.liveness.touch(key, std::time::Instant::now());
                    }
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Exchange(ev)) => match ev {
                rr::Event::Message {
                    peer,
                    message:
                        rr::Message::Request {
                            request, channel, ..
                        },
                    ..
                } => self.inbound(peer, request, channel),
                rr::Event::Message {
                    message:
                        rr::Message::Response {
                            request_id,
                            response,
                        },
                    ..
                } => {
                    if let Some(reply) = self.requests.remove(&request_id) {
                        reply_to(reply, Ok(response));
                    }
                }
                rr::Event::OutboundFailure {
                    request_id,
                    error,
                    peer,
                    ..
                } => {
                    if let Some(reply) = self.requests.remove(&request_id) {
                        reply_to(reply, Err(request_failure(peer, error).into()));
                    }
                }
                _ => {}
            },
            SwarmEvent::Behaviour(BehaviourEvent::Kad(ev)) => self.kad_event(ev),
            _ => {}
        }
    }
}

impl SwarmNode {
    /// Starts a node serving `store` (if any): listens, dials the bootstrap nodes, and runs
    /// until every handle is dropped.
    pub async fn spawn(
        id: NodeIdentity,
        store: Option<Arc<Store>>,
        config: NodeConfig,
    ) -> Result<NodeHandle> {
        let mut swarm = build(&id, config.relay_server)?;
        for addr in &config.listen {
            refuse_taken_tcp_port(addr)?;
            swarm
                .listen_on(addr.clone())
                .with_context(|| format!("listening on {addr}"))?;
        }
        for addr in &config.bootstrap {
            let peer = addr
                .iter()
                .find_map(|p| match p {
                    libp2p::multiaddr::Protocol::P2p(peer) => Some(peer),
                    _ => None,
                })
                .with_context(|| {
                    format!("bootstrap address {addr} does not end in /p2p/<peer id>")
                })?;
            swarm.behaviour_mut().kad.add_address(&peer, addr.clone());
            swarm
                .dial(addr.clone())
                .with_context(|| format!("dialing {addr}"))?;
        }
        if !config.bootstrap.is_empty() {
            if let Err(e) = swarm.behaviour_mut().kad.bootstrap() {
                tracing::warn!("no DHT bootstrap: {e}");
            }
        }
        let (served_tx, mut served_rx) = mpsc::channel(MAX_SERVING);
        #[cfg(feature = "test-faults")]
        let fault = config.serve_fault;
        #[cfg(not(feature = "test-faults"))]
        let fault = ServeFault::Honest;
        // The plain range lane listens at the IP of the first direct listen address.
        let bulk = match (&store, lane_addr(&config.listen, 0)) {
            (Some(store), Some(addr)) => Some(BulkServer::bind(addr, store.clone(), fault).await?),
            _ => None,
        };
        let mut state = State {
            swarm,
            store,
            fault,
            bulk,
            holdings: HashMap::new(),
            demand: HashMap::new(),
            topics: HashMap::new(),
            requests: HashMap::new(),
            queries: HashMap::new(),
            serving: 0,
            served_tx,
            stats: NodeStats::default(),
            bans: bans::Bans::default(),
            pages: budget::PageBudget::new(std::time::Instant::now()),
            waiting: HashMap::new(),
            // Its own record always has a place in its tables.
            met: HashMap::from([(id.key, Met::now())]),
            vetting: vetting::Vetting::default(),
            rng: rand::SeedableRng::from_os_rng(),
            status: tokio::sync::watch::Sender::new(Default::default()),
            liveness: liveness::Liveness::new(std::time::Instant::now()),
            own_key: id.key,
            bootstrap: config.bootstrap.clone(),
            rejoin: rejoin::Rejoin::new(std::time::Instant::now()),
        };
        let alive = liveness::alive_topic();
        if let Err(e) = state.swarm.behaviour_mut().gossipsub.subscribe(&alive) {
            tracing::warn!("subscribing to heartbeats: {e}");
        }
        // Wait until listening on every address, so the caller can hand them out.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut listening = 0;
        while listening < config.listen.len() {
            let ev = tokio::time::timeout_at(deadline, state.swarm.select_next_some())
                .await
                .context("not listening within 10 s")?;
            if matches!(ev, SwarmEvent::NewListenAddr { .. }) {
                listening += 1;
            }
            state.event(ev);
        }
        let (tx, mut rx) = mpsc::channel::<Command>(256);
        let status = state.status.subscribe();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    ev = state.swarm.select_next_some() => state.event(ev),
                    _ = tick.tick() => {
                        state.vet();
                        state.stay_joined();
                    }
                    Some((channel, res)) = served_rx.recv() => {
                        state.serving = state.serving.saturating_sub(1);
                        state.respond(channel, res);
                    }
                    cmd = rx.recv() => match cmd {
                        Some(c) => state.command(c),
                        None => break,
                    },
                }
                state.publish_status();
            }
        });
        Ok(NodeHandle::new(tx, id, task, status))
    }
}
