//! What arrives at the swarm task unasked: holdings and demand records (gossip and DHT puts),
//! blob exchange requests, and the progress of its DHT queries.

use std::collections::{BTreeMap, HashSet};

use libp2p::kad::{self, GetProvidersOk, GetRecordOk, QueryResult};
use libp2p::request_response::ResponseChannel;
use libp2p::{Multiaddr, PeerId};
use moeswarm_protocol::{
    Demand, ExchangeRequest, ExchangeResponse, Holdings, ModelId, NodeKey, RecordBody, RecordError,
};

use super::{reply_to, Pending, State, MAX_NODES_PER_MODEL, MAX_SERVING};
use crate::net::identity::peer_id_of;
use crate::net::records::{now_secs, parse_record_key, verify_record, RecordKind};
use crate::net::serve::answer;
use crate::net::stats::RecordRefusal;
use libp2p::gossipsub::MessageAcceptance;
use moeswarm_protocol::exchange::MAX_RECORDS_PER_RESPONSE;

/// Checks a record put in the DHT: signed by the node its key names, newer than the one held.
fn check_put<T: RecordBody>(
    old: Option<&[u8]>,
    value: &[u8],
    signer: Option<PeerId>,
) -> Result<(), RecordError> {
    let last = old
        .and_then(|o| verify_record::<T>(o, None, |_| None).ok())
        .map(|b| b.seq());
    verify_record::<T>(value, signer, |_| last).map(|_| ())
}

/// One page of `records` (by signer): those signed after `after`, at most
/// [`MAX_RECORDS_PER_RESPONSE`] of them, and whether more follow.
fn page(
    records: Option<&BTreeMap<NodeKey, Vec<u8>>>,
    after: Option<NodeKey>,
    counts: impl Fn(&NodeKey) -> bool,
) -> (Vec<Vec<u8>>, bool) {
    use std::ops::Bound;
    let Some(records) = records else {
        return (Vec::new(), false);
    };
    let from = after.map_or(Bound::Unbounded, Bound::Excluded);
    let mut it = records
        .range((from, Bound::Unbounded))
        .filter(|(k, _)| counts(k));
    let out: Vec<Vec<u8>> = it
        .by_ref()
        .take(MAX_RECORDS_PER_RESPONSE)
        .map(|(_, w)| w.clone())
        .collect();
    (out, it.next().is_some())
}

/// What gossip does with a record that failed verification: one that is merely not newer than
/// what is known is dropped quietly (it may have crossed a fresher one); anything else counts
/// against the peer that forwarded it.
pub(super) fn verdict_of(e: &RecordError) -> MessageAcceptance {
    match e {
        RecordError::Stale { .. } => MessageAcceptance::Ignore,
        _ => MessageAcceptance::Reject,
    }
}

impl State {
    pub(super) fn refuse(&mut self, e: &RecordError) {
        *self
            .stats
            .records_refused
            .entry(RecordRefusal::from(e))
            .or_default() += 1;
    }

    /// Makes room in `model`'s full table for a record of `newcomer`, dropping the record of
    /// the lowest standing ([`moeswarm_market::table`]) if the newcomer stands above it.
    fn make_room(&mut self, model: ModelId, newcomer: &NodeKey) -> bool {
        use moeswarm_market::table::{evict_for, Standing};
        // A stranger, newest of all, never stands above a record kept: refused without a scan
        // of the table (a flood of made-up records costs one lookup each).
        if !self.met.contains_key(newcomer) {
            return false;
        }
        let seen = self.first_seen.get(&model);
        let at = std::time::Instant::now();
        let standing = |k: &NodeKey, first_seen: u64| Standing {
            met: self.met.contains_key(k),
            useful: self.met.get(k).map_or(0, |m| m.useful),
            // Strikes against the signer as a peer (its bad records and answers), banned
            // lowest of all.
            strikes: peer_id_of(k).map_or(0, |p| self.bans.strikes(&p, at)),
            first_seen,
        };
        let Some(kept) = self.records.get(&model) else {
            return false;
        };
        let now = now_secs();
        let victim = evict_for(
            kept.keys().map(|k| {
                let first = seen.and_then(|s| s.get(k)).copied().unwrap_or(0);
                (*k, standing(k, first))
            }),
            standing(newcomer, now),
        );
        let Some(victim) = victim else {
            return false;
        };
        if let Some(r) = self.records.get_mut(&model) {
            r.remove(&victim);
        }
        if let Some(m) = self.coverage.get_mut(&model) {
            m.remove(&victim);
        }
        if let Some(s) = self.first_seen.get_mut(&model) {
            s.remove(&victim);
        }
        *self
            .stats
            .records_refused
            .entry(RecordRefusal::EvictedForABetterStanding)
            .or_default() += 1;
        true
    }

    /// `key` has connected (its key proven in the handshake).
    pub(super) fn meet(&mut self, key: NodeKey) {
        if self.met.len() >= 8192 && !self.met.contains_key(&key) {
            if let Some(oldest) = self.met.iter().min_by_key(|(_, m)| m.last).map(|(k, _)| *k) {
                self.met.remove(&oldest);
            }
        }
        let at = std::time::Instant::now();
        self.met
            .entry(key)
            .and_modify(|m| m.last = at)
            .or_insert(super::Met {
                last: at,
                useful: 0,
            });
    }

    /// A blob `peer` served verified here.
    pub(super) fn credit(&mut self, peer: PeerId) {
        if let Some(m) = crate::net::identity::node_key_of(&peer).and_then(|k| self.met.get_mut(&k))
        {
            m.useful = m.useful.saturating_add(1);
        }
    }

    /// A stranger's record `h` (as `wire`) that found the table full: it waits for a dial to
    /// the addresses it gives ([`super::vetting`]); what to count it as.
    fn wait_for_a_dial(&mut self, model: ModelId, h: &Holdings, wire: &[u8]) -> RecordRefusal {
        use super::vetting::Offer;
        let Some(peer) = peer_id_of(&h.node) else {
            return RecordRefusal::TooManyNodes;
        };
        let addrs = h
            .addrs
            .iter()
            .filter(|a| a.starts_with('/'))
            .filter_map(|a| a.parse::<Multiaddr>().ok())
            .collect();
        let now = std::time::Instant::now();
        match self
            .vetting
            .offer(peer, model, wire.to_vec(), addrs, now, &mut self.rng)
        {
            Offer::Queued => {
                self.vet();
                RecordRefusal::WaitingForADial
            }
            Offer::Refused => RecordRefusal::TooManyNodes,
        }
    }

    /// Starts the dials of strangers waiting for one (and fails those past their deadline).
    pub(super) fn vet(&mut self) {
        use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
        let now = std::time::Instant::now();
        for (peer, addrs) in self.vetting.next_dials(now, &mut self.rng) {
            if self.swarm.is_connected(&peer) {
                self.vetted(peer);
                continue;
            }
            let opts = DialOpts::peer_id(peer)
                .addresses(addrs)
                .condition(PeerCondition::DisconnectedAndNotDialing)
                .build();
            if let Err(e) = self.swarm.dial(opts) {
                tracing::debug!("vetting {peer}: {e}");
                self.vetting.dial_failed(peer, now);
            }
        }
    }

    /// `peer` connected: records of its that waited for a dial are taken in now, as a met
    /// node's, and a connection made only to prove its key is closed.
    pub(super) fn vetted(&mut self, peer: PeerId) {
        let dialed = self.vetting.is_dialing(&peer);
        let records = self.vetting.connected(&peer);
        if records.is_empty() {
            return;
        }
        self.stats.strangers_vetted += 1;
        for (model, wire) in records {
            self.receive(model, None, &wire);
        }
        if dialed && !self.waiting.contains_key(&peer) {
            let _ = self.swarm.disconnect_peer_id(peer);
        }
        self.vet();
    }

    /// A bad answer or record from `peer`: counted, and a strike towards a ban (closing its
    /// connections).
    pub(super) fn strike(&mut self, peer: PeerId) {
        *self.stats.penalties.entry(peer.to_string()).or_default() += 1;
        if self.bans.strike(peer, std::time::Instant::now()) {
            tracing::warn!("peer {peer} banned for repeated bad records or answers");
            *self.stats.banned.entry(peer.to_string()).or_default() += 1;
            let _ = self.swarm.disconnect_peer_id(peer);
        }
    }

    /// Verifies a record as coming from `source` and applies it; whether gossip should pass
    /// it on (accept), drop it (ignore: stale, or over the table's bound) or hold it against
    /// whoever sent it (reject: it does not verify).
    pub(super) fn receive(
        &mut self,
        model: ModelId,
        source: Option<PeerId>,
        wire: &[u8],
    ) -> MessageAcceptance {
        let Some(map) = self.coverage.get(&model) else {
            return MessageAcceptance::Ignore;
        };
        match verify_record::<Holdings>(wire, source, |k| map.last_seq(k)) {
            Ok(h) => {
                let node = h.node;
                let known = self.records.get(&model).map_or(0, BTreeMap::len);
                if known >= MAX_NODES_PER_MODEL
                    && map.last_seq(&node).is_none()
                    && !self.make_room(model, &node)
                {
                    let why = if self.met.contains_key(&node) {
                        RecordRefusal::TooManyNodes
                    } else {
                        self.wait_for_a_dial(model, &h, wire)
                    };
                    *self.stats.records_refused.entry(why).or_default() += 1;
                    return MessageAcceptance::Ignore;
                }
                if let Some(map) = self.coverage.get_mut(&model) {
                    if map.apply(h, now_secs()).is_ok() {
                        self.stats.records_applied += 1;
                        self.liveness.noticed(node, std::time::Instant::now());
                        self.records
                            .entry(model)
                            .or_default()
                            .insert(node, wire.to_vec());
                        let seen = self.first_seen.entry(model).or_default();
                        if seen.len() > 2 * MAX_NODES_PER_MODEL {
                            let kept = self.records.get(&model);
                            seen.retain(|k, _| kept.is_some_and(|r| r.contains_key(k)));
                        }
                        seen.entry(node).or_insert_with(now_secs);
                        return MessageAcceptance::Accept;
                    }
                }
                MessageAcceptance::Ignore
            }
            Err(e) => {
                self.refuse(&e);
                verdict_of(&e)
            }
        }
    }

    /// Verifies a demand record as coming from `source` and applies it; what gossip should do
    /// with it, as for [`State::receive`].
    pub(super) fn receive_demand(
        &mut self,
        model: ModelId,
        source: Option<PeerId>,
        wire: &[u8],
    ) -> MessageAcceptance {
        let Some(book) = self.demand.get_mut(&model) else {
            return MessageAcceptance::Ignore;
        };
        let (refused, verdict) = match verify_record::<Demand>(wire, source, |k| book.last_seq(k)) {
            Ok(d) => {
                let router = d.router;
                match book.apply(d, now_secs()) {
                    Ok(()) => {
                        self.stats.demand_applied += 1;
                        let live: HashSet<NodeKey> = book.records().map(|d| d.router).collect();
                        let recs = self.demand_records.entry(model).or_default();
                        recs.retain(|k, _| live.contains(k));
                        recs.insert(router, wire.to_vec());
                        return MessageAcceptance::Accept;
                    }
                    Err(r) => (RecordRefusal::from(r), MessageAcceptance::Ignore),
                }
            }
            Err(e) => (RecordRefusal::from(&e), verdict_of(&e)),
        };
        *self.stats.demand_refused.entry(refused).or_default() += 1;
        verdict
    }

    /// The verified demand records of `model` still valid now.
    pub(super) fn live_demand(&mut self, model: &ModelId) -> Vec<Vec<u8>> {
        let Some(book) = self.demand.get_mut(model) else {
            return Vec::new();
        };
        book.expire(now_secs());
        let live: HashSet<NodeKey> = book.records().map(|d| d.router).collect();
        let recs = self.demand_records.entry(*model).or_default();
        recs.retain(|k, _| live.contains(k));
        recs.values().cloned().collect()
    }

    /// Lets go of `model`'s records that have expired (kept while valid; only live holders'
    /// are handed out).
    pub(super) fn expire_records(&mut self, model: &ModelId) {
        let Some(map) = self.coverage.get_mut(model) else {
            return;
        };
        map.expire(now_secs());
        let kept: HashSet<NodeKey> = map.nodes().map(|h| h.node).collect();
        let recs = self.records.entry(*model).or_default();
        recs.retain(|k, _| kept.contains(k));
    }

    pub(super) fn inbound(
        &mut self,
        peer: PeerId,
        request: ExchangeRequest,
        channel: ResponseChannel<ExchangeResponse>,
    ) {
        use moeswarm_protocol::ResponseHeader;
        self.stats.requests_served += 1;
        let answered_here = matches!(
            request,
            ExchangeRequest::Holdings { .. }
                | ExchangeRequest::Demand { .. }
                | ExchangeRequest::Models
        );
        // Those are answered on this task: within the peer's budget of pages only.
        if answered_here && !self.pages.allow(peer, std::time::Instant::now()) {
            self.stats.requests_shed += 1;
            let res = ExchangeResponse::bare(ResponseHeader::Refused {
                reason: "busy: too many pages of records asked for; ask again later".into(),
            });
            self.respond(channel, res);
            return;
        }
        let own = match &request {
            ExchangeRequest::Holdings { model, after } => {
                self.expire_records(model);
                let at = std::time::Instant::now();
                let live = |k: &NodeKey| self.holder_is_live(k, at);
                let (recs, more) = page(self.records.get(model), *after, live);
                Some(ExchangeResponse::holdings(*model, &recs, more))
            }
            ExchangeRequest::Demand { model, after } => {
                self.live_demand(model);
                let (recs, more) = page(self.demand_records.get(model), *after, |_| true);
                Some(ExchangeResponse::demand(*model, &recs, more))
            }
            ExchangeRequest::Models => Some(ExchangeResponse::models(
                &self
                    .store
                    .as_ref()
                    .and_then(|s| s.models().ok())
                    .unwrap_or_default(),
            )),
            _ => None,
        };
        if let Some(res) = own {
            self.respond(channel, res);
            return;
        }
        let Some(store) = self.store.clone() else {
            let res = ExchangeResponse::bare(ResponseHeader::NotFound);
            self.respond(channel, res);
            return;
        };
        if self.serving >= MAX_SERVING {
            self.stats.requests_shed += 1;
            let res = ExchangeResponse::bare(ResponseHeader::Refused {
                reason: format!("busy: {MAX_SERVING} requests in progress"),
            });
            self.respond(channel, res);
            return;
        }
        self.serving += 1;
        let (tx, fault) = (self.served_tx.clone(), self.fault);
        tokio::task::spawn_blocking(move || {
            let res = answer(&store, &request, fault);
            if tx.blocking_send((channel, res)).is_err() {
                tracing::debug!("the swarm stopped before a blob answer was ready");
            }
        });
    }

    pub(super) fn kad_event(&mut self, ev: kad::Event) {
        match ev {
            kad::Event::InboundRequest {
                request:
                    kad::InboundRequest::PutRecord {
                        record: Some(record),
                        ..
                    },
            } => {
                let Some((kind, _, node)) = parse_record_key(&record.key) else {
                    return self.refuse(&RecordError::Malformed("unknown DHT key".into()));
                };
                let store = self.swarm.behaviour_mut().kad.store_mut();
                let old = kad::store::RecordStore::get(store, &record.key).map(|r| r.value.clone());
                let (signer, value) = (peer_id_of(&node), &record.value);
                let old = old.as_deref();
                let checked = match kind {
                    RecordKind::Holdings => check_put::<Holdings>(old, value, signer),
                    RecordKind::Demand => check_put::<Demand>(old, value, signer),
                };
                let store = self.swarm.behaviour_mut().kad.store_mut();
                match checked {
                    Ok(_) => {
                        if let Err(e) = kad::store::RecordStore::put(store, record) {
                            tracing::debug!("a verified DHT record was not stored: {e}");
                        }
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
                if let Err(e) = kad::store::RecordStore::add_provider(store, record) {
                    tracing::debug!("a provider record was not stored: {e}");
                }
            }
            // A bootstrap done, or given up: either way the routing table holds what it found.
            kad::Event::OutboundQueryProgressed {
                result: QueryResult::Bootstrap(_),
                step,
                ..
            } if step.last => self.stats.dht_bootstraps += 1,
            kad::Event::OutboundQueryProgressed {
                result: QueryResult::Bootstrap(_),
                ..
            } => {}
            kad::Event::OutboundQueryProgressed {
                id, result, step, ..
            } => self.query_progress(id, result, step.last),
            _ => {}
        }
    }

    pub(super) fn query_progress(&mut self, id: kad::QueryId, result: QueryResult, last: bool) {
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
                    reply_to(reply, addrs);
                    return;
                }
                Pending::Closest(peer, reply)
            }
            (Pending::Record(reply), QueryResult::GetRecord(Ok(GetRecordOk::FoundRecord(r)))) => {
                reply_to(reply, Some(r.record.value));
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
                reply_to(reply, found.into_iter().collect());
            }
            Pending::Closest(_, reply) => {
                reply_to(reply, Vec::new());
            }
            Pending::Record(reply) => {
                reply_to(reply, None);
            }
        }
    }

    /// Sends an exchange answer; a requester that went away no longer waits for it.
    pub(super) fn respond(
        &mut self,
        channel: ResponseChannel<ExchangeResponse>,
        res: ExchangeResponse,
    ) {
        if self
            .swarm
            .behaviour_mut()
            .exchange
            .send_response(channel, res)
            .is_err()
        {
            tracing::debug!("an exchange requester left before its answer");
        }
    }
}
