//! What arrives at the swarm task unasked, besides records (see [`super::receive`]): the peers
//! that connect and what they earn or lose (met, vetted, struck), blob exchange requests, DHT
//! puts, and the progress of the task's DHT queries.

use libp2p::kad::{self, GetProvidersOk, GetRecordOk, QueryResult};
use libp2p::request_response::ResponseChannel;
use libp2p::{Multiaddr, PeerId};
use moeswarm_protocol::{
    Demand, ExchangeRequest, ExchangeResponse, Holdings, NodeKey, RecordBody, RecordError,
};

use super::{reply_to, Pending, State, MAX_SERVING};
use crate::net::identity::peer_id_of;
use crate::net::records::{now_secs, parse_record_key, verify_record, RecordKind};
use crate::net::serve::answer;

/// Records the DHT store keeps at most (libp2p's `MemoryStore` default).
const MAX_DHT_RECORDS: usize = 1024;

/// Makes room in a full DHT store for a record under `key` (of a model this node follows when
/// `followed`): the record expiring soonest among those of models it does not follow gives
/// way, or, for a followed model's record, the one expiring soonest of all. False when there
/// is no room: records put first do not hold the store for their whole life, and a flood of
/// records of made-up models displaces only its own kind.
fn make_dht_room(
    store: &mut kad::store::MemoryStore,
    key: &kad::RecordKey,
    followed: bool,
    follows: &dyn Fn(&moeswarm_protocol::ModelId) -> bool,
) -> bool {
    use kad::store::RecordStore;
    if store.records().count() < MAX_DHT_RECORDS || store.get(key).is_some() {
        return true;
    }
    let soonest = |only_unfollowed: bool| {
        store
            .records()
            .filter(|r| {
                !only_unfollowed
                    || parse_record_key(&r.key).is_none_or(|(_, model, _)| !follows(&model))
            })
            .min_by_key(|r| r.expires)
            .map(|r| r.key.clone())
    };
    let victim = soonest(true).or_else(|| if followed { soonest(false) } else { None });
    match victim {
        Some(k) => {
            store.remove(&k);
            true
        }
        None => false,
    }
}

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

impl State {
    /// `key` has connected (its key proven in the handshake).
    pub(super) fn meet(&mut self, key: NodeKey) {
        // A full set forgets the peer of least standing: of those that never served a byte
        // that verified, the one met longest ago (a flood of throwaway connections pushes out
        // only its own kind).
        if self.met.len() >= 8192 && !self.met.contains_key(&key) {
            let least = self
                .met
                .iter()
                .min_by_key(|(_, m)| (m.useful, m.last))
                .map(|(k, _)| *k);
            if let Some(least) = least {
                self.met.remove(&least);
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
            self.receive(RecordKind::Holdings, model, None, &wire);
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
        let known = crate::net::identity::node_key_of(&peer)
            .and_then(|k| self.met.get(&k))
            .is_some_and(|m| m.useful > 0);
        if answered_here && !self.pages.allow(peer, known, std::time::Instant::now()) {
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
                let (recs, more) = self
                    .holdings
                    .get(model)
                    .map_or((Vec::new(), false), |t| t.page(*after, live));
                Some(ExchangeResponse::holdings(*model, &recs, more))
            }
            ExchangeRequest::Demand { model, after } => {
                let now = now_secs();
                let (recs, more) = self.demand.get_mut(model).map_or((Vec::new(), false), |t| {
                    t.expire(now);
                    t.page(*after, |_| true)
                });
                Some(ExchangeResponse::demand(*model, &recs, more))
            }
            ExchangeRequest::Models => Some(ExchangeResponse::models(
                &self
                    .store
                    .as_ref()
                    .and_then(|s| s.models().ok())
                    .unwrap_or_default(),
            )),
            ExchangeRequest::BulkPort => Some(ExchangeResponse::bare(match &self.bulk {
                Some(b) => ResponseHeader::BulkPort { port: b.port() },
                None => ResponseHeader::NotFound,
            })),
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
                let Some((kind, model, node)) = parse_record_key(&record.key) else {
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
                match checked {
                    Ok(_) => {
                        let followed = self.holdings.contains_key(&model);
                        let store = self.swarm.behaviour_mut().kad.store_mut();
                        if !make_dht_room(store, &record.key, followed, &|m| {
                            self.holdings.contains_key(m)
                        }) {
                            tracing::debug!("the DHT store is full of records kept before");
                            return;
                        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::records::holdings_key;
    use kad::store::RecordStore;
    use moeswarm_protocol::{BlobId, ModelId};

    fn record(model: ModelId, n: u16) -> kad::Record {
        let mut k = [0u8; 32];
        k[..2].copy_from_slice(&n.to_le_bytes());
        kad::Record::new(holdings_key(&model, &NodeKey(k)), vec![1])
    }

    #[test]
    fn a_full_dht_store_lets_records_of_unfollowed_models_give_way_to_a_followed_ones() {
        let (made_up, mine) = (
            ModelId(BlobId::of(b"made up")),
            ModelId(BlobId::of(b"mine")),
        );
        let follows = |m: &ModelId| *m == mine;
        let mut store = kad::store::MemoryStore::new(PeerId::random());
        for n in 0..MAX_DHT_RECORDS as u16 {
            store.put(record(made_up, n)).unwrap();
        }
        // Another unfollowed model's record takes the place of one of its own kind ...
        let other = record(ModelId(BlobId::of(b"another")), 0);
        assert!(make_dht_room(&mut store, &other.key, false, &follows));
        store.put(other).unwrap();
        // ... and one of a followed model gets in, in the place of an unfollowed one.
        let ours = record(mine, 1);
        assert!(make_dht_room(&mut store, &ours.key, true, &follows));
        store.put(ours.clone()).unwrap();
        assert!(store.get(&ours.key).is_some());
        assert_eq!(store.records().count(), MAX_DHT_RECORDS);
        // A store full of followed models' records keeps them against unfollowed newcomers.
        let mut store = kad::store::MemoryStore::new(PeerId::random());
        for n in 0..MAX_DHT_RECORDS as u16 {
            store.put(record(mine, n)).unwrap();
        }
        assert!(!make_dht_room(
            &mut store,
            &record(made_up, 9).key,
            false,
            &follows
        ));
        assert!(make_dht_room(
            &mut store,
            &record(mine, 5000).key,
            true,
            &follows
        ));
    }
}
