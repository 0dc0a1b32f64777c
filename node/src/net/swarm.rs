//! The libp2p swarm and its event loop.
//!
//! One tokio task owns the [`Swarm`]; everything else talks to it through [`NodeHandle`]
//! commands with deadlines (`handle`). Requests for blob bytes are answered on blocking threads
//! (file reads and hashing) and their answers come back to the task through a channel.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use futures::StreamExt;
use libp2p::kad::{GetProvidersOk, GetRecordOk, QueryResult, Quorum, Record, StoreInserts};
use libp2p::request_response::{self as rr, OutboundRequestId, ProtocolSupport, ResponseChannel};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{
    autonat, dcutr, gossipsub, identify, kad, ping, relay, Multiaddr, PeerId, StreamProtocol, Swarm,
};
use moeswarm_market::coverage::CoverageMap;
use moeswarm_protocol::exchange::EXCHANGE_PROTOCOL;
use moeswarm_protocol::holdings::MAX_RECORD_BYTES;
use moeswarm_protocol::{
    ExchangeRequest, ExchangeResponse, Holdings, ModelId, NodeKey, RecordError,
};
use tokio::sync::{mpsc, oneshot};

use super::codec::ExchangeCodec;
use super::handle::{Command, NodeHandle, REQUEST_DEADLINE};
use super::identity::{peer_id_of, NodeIdentity};
use super::records::{
    holdings_key, model_key, now_secs, parse_holdings_key, refusal_reason, topic, verify_record,
};
use super::serve::{answer, ServeFault};
use super::stats::NodeStats;
use moeswarm_model::store::Store;

/// Kademlia's protocol name: this swarm's own DHT, not the public IPFS one.
pub const KAD_PROTOCOL: &str = "/moeswarm/kad/1.0.0";
/// Identify's protocol version string.
pub const IDENTIFY_VERSION: &str = "/moeswarm/1.0.0";
/// Exchange requests answered at once per node (each holds at most one range in memory).
pub const MAX_SERVING: usize = 16;
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
        .build()
        .map_err(|e| anyhow!("gossipsub config: {e}"))?;
    let swarm = libp2p::SwarmBuilder::with_existing_identity(id.keypair.clone())
        .with_tokio()
        .with_tcp(
            libp2p::tcp::Config::default().nodelay(true),
            libp2p::noise::Config::new,
            libp2p::yamux::Config::default,
        )?
        .with_quic()
        .with_relay_client(libp2p::noise::Config::new, libp2p::yamux::Config::default)?
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
        .map_err(|e| anyhow!("building behaviours: {e}"))?
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
    coverage: HashMap<ModelId, CoverageMap>,
    /// The wire form of the record each coverage entry came from, to hand on to askers.
    records: HashMap<ModelId, BTreeMap<NodeKey, Vec<u8>>>,
    by_topic: HashMap<gossipsub::TopicHash, ModelId>,
    requests: HashMap<OutboundRequestId, oneshot::Sender<Result<ExchangeResponse>>>,
    queries: HashMap<kad::QueryId, Pending>,
    serving: usize,
    served_tx: mpsc::Sender<(ResponseChannel<ExchangeResponse>, ExchangeResponse)>,
    stats: NodeStats,
}

impl State {
    fn refuse(&mut self, e: &RecordError) {
        *self
            .stats
            .records_refused
            .entry(refusal_reason(e).into())
            .or_default() += 1;
    }

    /// Verifies a record as coming from `source` and applies it.
    fn receive(&mut self, model: ModelId, source: Option<PeerId>, wire: &[u8]) {
        let Some(map) = self.coverage.get(&model) else {
            return;
        };
        match verify_record(wire, source, |k| map.last_seq(k)) {
            Ok(h) => {
                let node = h.node;
                let known = self.records.get(&model).map_or(0, BTreeMap::len);
                if known >= MAX_NODES_PER_MODEL && map.last_seq(&node).is_none() {
                    *self
                        .stats
                        .records_refused
                        .entry("too_many_nodes".into())
                        .or_default() += 1;
                    return;
                }
                if let Some(map) = self.coverage.get_mut(&model) {
                    if map.apply(h, now_secs()).is_ok() {
                        self.stats.records_applied += 1;
                        self.records
                            .entry(model)
                            .or_default()
                            .insert(node, wire.to_vec());
                    }
                }
            }
            Err(e) => self.refuse(&e),
        }
    }

    /// The verified records of `model` still valid now.
    fn live_records(&mut self, model: &ModelId) -> Vec<Vec<u8>> {
        let now = now_secs();
        let Some(map) = self.coverage.get_mut(model) else {
            return Vec::new();
        };
        map.expire(now);
        let live: HashSet<NodeKey> = map.nodes().map(|h| h.node).collect();
        let recs = self.records.entry(*model).or_default();
        recs.retain(|k, _| live.contains(k));
        recs.values().cloned().collect()
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Subscribe {
                model,
                n_layer,
                n_expert,
                reply,
            } => {
                let t = topic(&model);
                self.by_topic.insert(t.hash(), model);
                self.coverage
                    .entry(model)
                    .or_insert_with(|| CoverageMap::new(model, n_layer, n_expert));
                let r = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .subscribe(&t)
                    .map(|_| ())
                    .map_err(|e| anyhow!("subscribing to {model}: {e}"));
                let _ = reply.send(r);
            }
            Command::Publish {
                model,
                record,
                reply,
            } => {
                let wire = record.to_wire();
                let own = *self.swarm.local_peer_id();
                self.receive(model, Some(own), &wire);
                let r = self.gossip(model, wire.clone());
                if let Ok(h) = serde_json::from_slice::<Holdings>(&record.body) {
                    let mut rec = Record::new(holdings_key(&model, &h.node), wire);
                    rec.expires = Some(
                        Instant::now()
                            + Duration::from_secs(h.expires_at.saturating_sub(now_secs())),
                    );
                    // Stored locally at once; spreading to the closest peers may fail on a small
                    // swarm, and gossip carries the record anyway.
                    let _ = self.swarm.behaviour_mut().kad.put_record(rec, Quorum::One);
                }
                let _ = reply.send(r);
            }
            Command::PublishRaw {
                model,
                bytes,
                reply,
            } => {
                let _ = reply.send(self.gossip(model, bytes));
            }
            Command::Provide { model, reply } => {
                let r = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .start_providing(model_key(&model))
                    .map(|_| ())
                    .map_err(|e| anyhow!("providing {model}: {e}"));
                let _ = reply.send(r);
            }
            Command::Request {
                peer,
                request,
                reply,
            } => {
                if peer == *self.swarm.local_peer_id() {
                    let _ = reply.send(Err(anyhow!("a node does not ask itself")));
                    return;
                }
                let id = self
                    .swarm
                    .behaviour_mut()
                    .exchange
                    .send_request(&peer, request);
                self.requests.insert(id, reply);
            }
            Command::Providers { model, reply } => {
                let id = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .get_providers(model_key(&model));
                self.queries
                    .insert(id, Pending::Providers(reply, HashSet::new()));
            }
            Command::DhtRecord { key, reply } => {
                let id = self.swarm.behaviour_mut().kad.get_record(key);
                self.queries.insert(id, Pending::Record(reply));
            }
            Command::FindPeer { peer, reply } => {
                let id = self.swarm.behaviour_mut().kad.get_closest_peers(peer);
                self.queries.insert(id, Pending::Closest(peer, reply));
            }
            Command::Coverage { model, reply } => {
                self.live_records(&model);
                let _ = reply.send(self.coverage.get(&model).cloned());
            }
            Command::Dial { addr, reply } => {
                let r = self
                    .swarm
                    .dial(addr.clone())
                    .with_context(|| format!("dialing {addr}"));
                let _ = reply.send(r);
            }
            Command::AddAddresses { peer, addrs } => {
                for a in addrs {
                    self.swarm.behaviour_mut().kad.add_address(&peer, a);
                }
            }
            Command::Penalize { peer } => {
                *self.stats.penalties.entry(peer.to_string()).or_default() += 1;
            }
            Command::ListenAddrs { reply } => {
                let _ = reply.send(self.swarm.listeners().cloned().collect());
            }
            Command::Peers { reply } => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Stats { reply } => {
                let mut s = self.stats.clone();
                s.connected_peers = self.swarm.connected_peers().count();
                let _ = reply.send(s);
            }
        }
    }

    fn gossip(&mut self, model: ModelId, bytes: Vec<u8>) -> Result<()> {
        match self
            .swarm
            .behaviour_mut()
            .gossipsub
            .publish(topic(&model), bytes)
        {
            Ok(_)
            | Err(gossipsub::PublishError::NoPeersSubscribedToTopic)
            | Err(gossipsub::PublishError::Duplicate) => Ok(()),
            Err(e) => Err(anyhow!("publishing holdings of {model}: {e}")),
        }
    }

    fn inbound(&mut self, request: ExchangeRequest, channel: ResponseChannel<ExchangeResponse>) {
        use moeswarm_protocol::ResponseHeader;
        self.stats.requests_served += 1;
        if let ExchangeRequest::Holdings { model } = request {
            let recs = self.live_records(&model);
            let res = ExchangeResponse::holdings(model, &recs);
            let _ = self
                .swarm
                .behaviour_mut()
                .exchange
                .send_response(channel, res);
            return;
        }
        let Some(store) = self.store.clone() else {
            let res = ExchangeResponse::bare(ResponseHeader::NotFound);
            let _ = self
                .swarm
                .behaviour_mut()
                .exchange
                .send_response(channel, res);
            return;
        };
        if self.serving >= MAX_SERVING {
            self.stats.requests_shed += 1;
            let res = ExchangeResponse::bare(ResponseHeader::Refused {
                reason: format!("busy: {MAX_SERVING} requests in progress"),
            });
            let _ = self
                .swarm
                .behaviour_mut()
                .exchange
                .send_response(channel, res);
            return;
        }
        self.serving += 1;
        let (tx, fault) = (self.served_tx.clone(), self.fault);
        tokio::task::spawn_blocking(move || {
            let res = answer(&store, &request, fault);
            let _ = tx.blocking_send((channel, res));
        });
    }

    fn kad_event(&mut self, ev: kad::Event) {
        match ev {
            kad::Event::InboundRequest {
                request:
                    kad::InboundRequest::PutRecord {
                        record: Some(record),
                        ..
                    },
            } => {
                let Some((_, node)) = parse_holdings_key(&record.key) else {
                    return self.refuse(&RecordError::Malformed("unknown DHT key".into()));
                };
                let store = self.swarm.behaviour_mut().kad.store_mut();
                let last = kad::store::RecordStore::get(store, &record.key)
                    .and_then(|old| verify_record(&old.value, None, |_| None).ok())
                    .map(|h| h.seq);
                match verify_record(&record.value, peer_id_of(&node), |_| last) {
                    Ok(_) => {
                        let _ = kad::store::RecordStore::put(store, record);
                    }
                    Err(e) => self.refuse(&e),
                }
            }
            kad::Event::InboundRequest {
                request:
                    kad::InboundRequest::AddProvider {
                        record: Some(record),
                    },
            } => {
                let store = self.swarm.behaviour_mut().kad.store_mut();
                let _ = kad::store::RecordStore::add_provider(store, record);
            }
            kad::Event::OutboundQueryProgressed {
                result: QueryResult::Bootstrap(_),
                step,
                ..
            } => {
                // Done, or given up: either way the routing table holds what it found.
                if step.last {
                    self.stats.dht_bootstraps += 1;
                }
            }
            kad::Event::OutboundQueryProgressed {
                id, result, step, ..
            } => self.query_progress(id, result, step.last),
            _ => {}
        }
    }

    fn query_progress(&mut self, id: kad::QueryId, result: QueryResult, last: bool) {
        let Some(pending) = self.queries.remove(&id) else {
            return;
        };
        // Take in this step's findings; a query that has its answer ends here.
        let pending = match (pending, result) {
            (
                Pending::Providers(reply, mut found),
                QueryResult::GetProviders(Ok(GetProvidersOk::FoundProviders { providers, .. })),
            ) => {
                found.extend(providers);
                Pending::Providers(reply, found)
            }
            (Pending::Closest(peer, reply), QueryResult::GetClosestPeers(r)) => {
                let peers = match r {
                    Ok(ok) => ok.peers,
                    Err(kad::GetClosestPeersError::Timeout { peers, .. }) => peers,
                };
                let addrs: Vec<Multiaddr> = peers
                    .into_iter()
                    .filter(|p| p.peer_id == peer)
                    .flat_map(|p| p.addrs)
                    .collect();
                if !addrs.is_empty() {
                    for a in &addrs {
                        self.swarm.behaviour_mut().kad.add_address(&peer, a.clone());
                    }
                    let _ = reply.send(addrs);
                    return;
                }
                Pending::Closest(peer, reply)
            }
            (Pending::Record(reply), QueryResult::GetRecord(Ok(GetRecordOk::FoundRecord(r)))) => {
                let _ = reply.send(Some(r.record.value));
                return;
            }
            (pending, _) => pending,
        };
        if !last {
            self.queries.insert(id, pending);
            return;
        }
        // The query is over: answer with what was found.
        match pending {
            Pending::Providers(reply, found) => {
                let _ = reply.send(found.into_iter().collect());
            }
            Pending::Closest(_, reply) => {
                let _ = reply.send(Vec::new());
            }
            Pending::Record(reply) => {
                let _ = reply.send(None);
            }
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
                ..
            })) => {
                if let Some(model) = self.by_topic.get(&message.topic).copied() {
                    self.receive(model, message.source, &message.data);
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Exchange(ev)) => match ev {
                rr::Event::Message {
                    message:
                        rr::Message::Request {
                            request, channel, ..
                        },
                    ..
                } => self.inbound(request, channel),
                rr::Event::Message {
                    message:
                        rr::Message::Response {
                            request_id,
                            response,
                        },
                    ..
                } => {
                    if let Some(reply) = self.requests.remove(&request_id) {
                        let _ = reply.send(Ok(response));
                    }
                }
                rr::Event::OutboundFailure {
                    request_id,
                    error,
                    peer,
                    ..
                } => {
                    if let Some(reply) = self.requests.remove(&request_id) {
                        let _ = reply.send(Err(anyhow!("request to {peer} failed: {error}")));
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
            let _ = swarm.behaviour_mut().kad.bootstrap();
        }
        let (served_tx, mut served_rx) = mpsc::channel(MAX_SERVING);
        let mut state = State {
            swarm,
            store,
            #[cfg(feature = "test-faults")]
            fault: config.serve_fault,
            #[cfg(not(feature = "test-faults"))]
            fault: ServeFault::Honest,
            coverage: HashMap::new(),
            records: HashMap::new(),
            by_topic: HashMap::new(),
            requests: HashMap::new(),
            queries: HashMap::new(),
            serving: 0,
            served_tx,
            stats: NodeStats::default(),
        };
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
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    ev = state.swarm.select_next_some() => state.event(ev),
                    Some((channel, res)) = served_rx.recv() => {
                        state.serving = state.serving.saturating_sub(1);
                        let _ = state.swarm.behaviour_mut().exchange.send_response(channel, res);
                    }
                    cmd = rx.recv() => match cmd {
                        Some(c) => state.command(c),
                        None => break,
                    },
                }
            }
        });
        Ok(NodeHandle::new(tx, id, task))
    }
}
