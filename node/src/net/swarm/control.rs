//! The swarm task's side of [`NodeHandle`](super::super::NodeHandle) commands: each one done
//! on the swarm and answered through its reply channel.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::error::{Context, Error, Result};
use libp2p::gossipsub;
use libp2p::kad::{Quorum, Record};
use moeswarm_market::coverage::CoverageMap;
use moeswarm_market::demand::DemandBook;
use moeswarm_protocol::ModelId;

use super::table::RecordTable;
use super::{reply_to, Pending, State, MAX_WAITING_PEERS, MAX_WAITING_PER_PEER};
use crate::net::handle::Command;
use crate::net::records::{demand_topic, model_key, now_secs, topic, RecordKind};
use crate::net::stats::RequestFailure;
use libp2p::PeerId;
use moeswarm_protocol::{ExchangeRequest, ExchangeResponse};
use tokio::sync::oneshot;

impl State {
    /// Follows `model`'s holdings and demand topics, with empty tables for its records.
    fn subscribe(
        &mut self,
        model: moeswarm_protocol::ModelId,
        n_layer: u32,
        n_expert: u32,
    ) -> Result<()> {
        let (t, d) = (topic(&model), demand_topic(&model));
        self.topics.insert(t.hash(), (RecordKind::Holdings, model));
        self.topics.insert(d.hash(), (RecordKind::Demand, model));
        self.holdings
            .entry(model)
            .or_insert_with(|| RecordTable::new(CoverageMap::new(model, n_layer, n_expert)));
        self.demand
            .entry(model)
            .or_insert_with(|| RecordTable::new(DemandBook::new(model, n_layer, n_expert)));
        let gossip = &mut self.swarm.behaviour_mut().gossipsub;
        gossip
            .subscribe(&t)
            .and_then(|_| gossip.subscribe(&d))
            .map(|_| ())
            .map_err(|e| Error::invalid(format!("subscribing to {model}: {e}")))
    }

    /// Does what a [`Command`] asks, and answers it.
    pub(super) fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Subscribe {
                model,
                n_layer,
                n_expert,
                reply,
            } => reply_to(reply, self.subscribe(model, n_layer, n_expert)),
            Command::Publish {
                model,
                kind,
                wire,
                reply,
            } => {
                let own = *self.swarm.local_peer_id();
                self.receive(kind, model, Some(own), &wire);
                reply_to(reply, self.spread(kind, model, wire));
            }
            Command::Learn {
                model,
                holdings,
                demand,
                reply,
            } => {
                for w in holdings {
                    self.receive(RecordKind::Holdings, model, None, &w);
                }
                for w in demand {
                    self.receive(RecordKind::Demand, model, None, &w);
                }
                reply_to(reply, ());
            }
            Command::PublishRaw {
                model,
                kind,
                bytes,
                reply,
            } => reply_to(reply, self.gossip(kind.topic(&model), bytes)),
            Command::Provide { model, reply } => {
                let r = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .start_providing(model_key(&model))
                    .map(|_| ())
                    .map_err(|e| Error::invalid(format!("providing {model}: {e}")));
                reply_to(reply, r);
            }
            Command::Request {
                peer,
                request,
                reply,
            } => {
                if peer == *self.swarm.local_peer_id() {
                    reply_to(reply, Err(RequestFailure::ToItself.into()));
                    return;
                }
                self.request(peer, request, reply);
            }
            cmd @ (Command::Providers { .. }
            | Command::DhtRecord { .. }
            | Command::FindPeer { .. }) => self.query(cmd),
            Command::Coverage { model, reply } => {
                self.expire_records(&model);
                reply_to(reply, self.live_coverage(&model));
            }
            // This node always counts itself live: its heartbeat is for the others.
            Command::Heartbeat { record, reply } => {
                let wire = record.to_wire();
                reply_to(reply, self.gossip(super::liveness::alive_topic(), wire));
            }
            Command::Demand { model, reply } => {
                let now = now_secs();
                let book = self.demand.get_mut(&model).map(|t| {
                    t.expire(now);
                    t.book().clone()
                });
                reply_to(reply, book);
            }
            Command::Dial { addr, reply } => {
                let r = self
                    .swarm
                    .dial(addr.clone())
                    .with_context(|| format!("dialing {addr}"));
                reply_to(reply, r);
            }
            Command::AddAddresses { peer, addrs } => {
                for a in addrs {
                    self.swarm.behaviour_mut().kad.add_address(&peer, a);
                }
            }
            Command::Penalize { peer } => self.strike(peer),
            Command::Credit { peer } => self.credit(peer),
            Command::ListenAddrs { reply } => {
                reply_to(reply, self.swarm.listeners().cloned().collect());
            }
            Command::Peers { reply } => {
                reply_to(reply, self.swarm.connected_peers().copied().collect());
            }
            Command::Stats { reply } => {
                let mut s = self.stats.clone();
                s.connected_peers = self.swarm.connected_peers().count();
                s.strangers_waiting = self.vetting.len();
                s.strangers_waiting_bytes = self.vetting.bytes();
                reply_to(reply, s);
            }
        }
    }

    /// Starts the DHT query a command asks for; [`State::query_progress`] answers it.
    fn query(&mut self, cmd: Command) {
        let kad = &mut self.swarm.behaviour_mut().kad;
        let (id, pending) = match cmd {
            Command::Providers { model, reply } => (
                kad.get_providers(model_key(&model)),
                Pending::Providers(reply, HashSet::new()),
            ),
            Command::DhtRecord { key, reply } => (kad.get_record(key), Pending::Record(reply)),
            Command::FindPeer { peer, reply } => {
                (kad.get_closest_peers(peer), Pending::Closest(peer, reply))
            }
            _ => return,
        };
        self.queries.insert(id, pending);
    }

    /// Sends `request` to `peer`, dialing it first if need be. request-response dials by
    /// itself only when no other dial to the peer is under way, and fails the request at
    /// once ("Failed to dial the requested peer") when one is (Kademlia's, say): so requests to
    /// a peer not connected wait here for whichever dial connects it.
    pub(super) fn request(
        &mut self,
        peer: PeerId,
        request: ExchangeRequest,
        reply: oneshot::Sender<Result<ExchangeResponse>>,
    ) {
        if self.swarm.is_connected(&peer) {
            self.send_now(peer, request, reply);
            return;
        }
        let first = !self.waiting.contains_key(&peer);
        if first && self.waiting.len() >= MAX_WAITING_PEERS {
            reply_to(
                reply,
                Err(RequestFailure::Overloaded(format!(
                    "not connected to {peer}, and {MAX_WAITING_PEERS} other peers are being dialed"
                ))
                .into()),
            );
            return;
        }
        let queue = self.waiting.entry(peer).or_default();
        queue.retain(|(_, r)| !r.is_closed());
        if queue.len() >= MAX_WAITING_PER_PEER {
            reply_to(
                reply,
                Err(RequestFailure::Overloaded(format!(
                    "{MAX_WAITING_PER_PEER} requests already wait for {peer} to connect"
                ))
                .into()),
            );
            return;
        }
        queue.push((request, reply));
        if first {
            use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
            let opts = DialOpts::peer_id(peer)
                .condition(PeerCondition::DisconnectedAndNotDialing)
                .build();
            match self.swarm.dial(opts) {
                Ok(()) | Err(libp2p::swarm::DialError::DialPeerConditionFalse(_)) => {}
                Err(e) => self.fail_waiting(peer, &e.to_string()),
            }
        }
    }

    /// Sends the requests that waited for `peer` to connect.
    pub(super) fn connected(&mut self, peer: PeerId) {
        for (request, reply) in self.waiting.remove(&peer).unwrap_or_default() {
            if !reply.is_closed() {
                self.send_now(peer, request, reply);
            }
        }
    }

    /// Sends `request` to the connected `peer`; its answer goes to `reply`.
    fn send_now(
        &mut self,
        peer: PeerId,
        request: ExchangeRequest,
        reply: oneshot::Sender<Result<ExchangeResponse>>,
    ) {
        let id = self
            .swarm
            .behaviour_mut()
            .exchange
            .send_request(&peer, request);
        self.requests.insert(id, reply);
    }

    /// Fails the requests waiting for `peer`, which could not be reached (`why`).
    pub(super) fn fail_waiting(&mut self, peer: PeerId, why: &str) {
        for (_, reply) in self.waiting.remove(&peer).unwrap_or_default() {
            let why = why.to_string();
            reply_to(reply, Err(RequestFailure::Unreachable { peer, why }.into()));
        }
    }

    pub(super) fn gossip(&mut self, topic: gossipsub::IdentTopic, bytes: Vec<u8>) -> Result<()> {
        match self
            .swarm
            .behaviour_mut()
            .gossipsub
            .publish(topic.clone(), bytes)
        {
            Ok(_)
            | Err(gossipsub::PublishError::NoPeersSubscribedToTopic)
            | Err(gossipsub::PublishError::Duplicate) => Ok(()),
            Err(e) => Err(Error::invalid(format!("publishing on {topic}: {e}"))),
        }
    }

    /// Gossips a record this node signed on its kind's topic and puts it in the DHT under
    /// its key, to expire with it. The DHT copy is stored locally at once; spreading it to the
    /// closest peers may fail on a small swarm, and gossip carries the record anyway.
    fn spread(&mut self, kind: RecordKind, model: ModelId, wire: Vec<u8>) -> Result<()> {
        let r = self.gossip(kind.topic(&model), wire.clone());
        if let Some((key, expires_at)) = kind.dht_key(&model, &wire) {
            let mut rec = Record::new(key, wire);
            let ttl = expires_at.saturating_sub(now_secs());
            rec.expires = Some(Instant::now() + Duration::from_secs(ttl));
            if let Err(e) = self.swarm.behaviour_mut().kad.put_record(rec, Quorum::One) {
                tracing::warn!("a record was not stored in the DHT: {e}");
            }
        }
        r
    }
}
