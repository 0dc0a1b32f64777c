//! Record collection: the holdings and demand records of a model that peers hand over when
//! asked (paged, each page's keys increasing), and the DHT's for peers that did not answer;
//! every record verified here, the newest per signer kept. Coverage maps are built from them
//! in one place ([`gather_coverage`]).

use std::collections::{BTreeMap, HashSet};

use crate::error::Result;
use moeswarm_market::coverage::CoverageMap;
use moeswarm_protocol::{
    Demand, ExchangeRequest, Holdings, ModelId, NodeKey, RecordBody, ResponseHeader,
};

use super::handle::NodeHandle;
use super::records::{demand_key, holdings_key, verify_record};

/// See [`Fetcher::gather_coverage`].
pub async fn gather_coverage(
    node: &NodeHandle,
    model: ModelId,
    n_layer: u32,
    n_expert: u32,
) -> Result<CoverageMap> {
    let mut map = node
        .coverage(model)
        .await?
        .unwrap_or_else(|| CoverageMap::new(model, n_layer, n_expert));
    map.merge(
        collect_records(node, model).await?,
        super::records::now_secs(),
    );
    Ok(map)
}

/// The holdings records of `model` that the connected peers hand over when asked, and the DHT
/// records of peers that did not answer; each verified here, the newest per node kept.
pub async fn collect_records(node: &NodeHandle, model: ModelId) -> Result<Vec<Holdings>> {
    collect(
        node,
        model,
        |after| ExchangeRequest::Holdings { model, after },
        holdings_key,
        |h: &Holdings| h.model,
    )
    .await
}

/// The demand records of `model` that the connected peers hand over when asked (and those
/// in the DHT under the peers that did not answer); each verified here, the newest per router
/// kept.
pub async fn collect_demand(node: &NodeHandle, model: ModelId) -> Result<Vec<Demand>> {
    collect(
        node,
        model,
        |after| ExchangeRequest::Demand { model, after },
        demand_key,
        |d: &Demand| d.model,
    )
    .await
}

/// Pages one peer may answer for one request of records: enough for every node a model's
/// table keeps, and one more.
const MAX_PAGES: usize =
    super::swarm::MAX_NODES_PER_MODEL / moeswarm_protocol::exchange::MAX_RECORDS_PER_RESPONSE + 1;

/// What a peer answered to a request of records, page after page.
enum Pages {
    /// Every page it gave (at most [`MAX_PAGES`]).
    Records(Vec<Vec<u8>>),
    /// It did not answer.
    Silent,
    /// It answered something that is not an answer of records, or pages out of order.
    Malformed,
}

/// Asks `peer` for records with `ask`, following its pages (each after the last signer of
/// the page before, which must increase) up to [`MAX_PAGES`].
async fn all_pages<T: RecordBody>(
    node: &NodeHandle,
    peer: libp2p::PeerId,
    ask: impl Fn(Option<NodeKey>) -> ExchangeRequest,
) -> Pages {
    let mut out = Vec::new();
    let mut after: Option<NodeKey> = None;
    for page in 0..MAX_PAGES {
        let r = match node.request(peer, ask(after)).await {
            // A busy peer is as one that did not answer: not a liar.
            Ok(r) if matches!(r.header, ResponseHeader::Refused { .. }) && page == 0 => {
                return Pages::Silent
            }
            Ok(r) if matches!(r.header, ResponseHeader::Refused { .. }) => break,
            Ok(r) => r,
            Err(_) if page == 0 => return Pages::Silent,
            Err(_) => break,
        };
        let Ok(records) = r.records() else {
            return Pages::Malformed;
        };
        let last = records
            .last()
            .and_then(|w| moeswarm_protocol::Signed::<T>::from_wire(w).ok())
            .and_then(|s| s.claimed_signer().ok());
        out.extend(records.into_iter().map(<[u8]>::to_vec));
        match last {
            Some(k) if r.more() && after.is_none_or(|a| k > a) => after = Some(k),
            _ if r.more() && last.is_none() => return Pages::Malformed,
            _ => break,
        }
    }
    Pages::Records(out)
}

async fn collect<T: RecordBody>(
    node: &NodeHandle,
    model: ModelId,
    ask: impl Fn(Option<NodeKey>) -> ExchangeRequest + Clone,
    dht_key: fn(&ModelId, &NodeKey) -> libp2p::kad::RecordKey,
    model_of: fn(&T) -> ModelId,
) -> Result<Vec<T>> {
    let mut newest: BTreeMap<NodeKey, T> = BTreeMap::new();
    let mut keep = |r: T| {
        if newest
            .get(&r.signer())
            .is_none_or(|old| r.seq() > old.seq())
        {
            newest.insert(r.signer(), r);
        }
    };
    let peers = node.peers().await?;
    let asks = peers.iter().map(|&p| {
        let (node, ask) = (node.clone(), ask.clone());
        async move { (p, all_pages::<T>(&node, p, ask).await) }
    });
    let mut answered = HashSet::new();
    for (peer, r) in futures::future::join_all(asks).await {
        let records = match r {
            Pages::Records(r) => r,
            Pages::Silent => continue,
            Pages::Malformed => {
                node.penalize(peer).await;
                continue;
            }
        };
        answered.insert(peer);
        for wire in &records {
            match verify_record::<T>(wire, None, |_| None) {
                Ok(r) if model_of(&r) == model => keep(r),
                Err(e) if !super::records::sender_at_fault(&e) => {}
                _ => node.penalize(peer).await,
            }
        }
    }
    // Peers that did not answer may still have put their record in the DHT.
    for peer in peers.iter().filter(|p| !answered.contains(p)) {
        let Some(key) = super::identity::node_key_of(peer) else {
            continue;
        };
        if let Ok(Some(wire)) = node.dht_record(dht_key(&model, &key)).await {
            if let Ok(r) = verify_record::<T>(&wire, Some(*peer), |_| None) {
                keep(r);
            }
        }
    }
    Ok(newest.into_values().collect())
}

/// How long a peer may take to hand over its records when asked by [`learn_records`].
const LEARN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// Asks every connected peer for the holdings and demand records of `model` it knows and
/// hands them to the node, which verifies each as if it came by gossip: what a node that just
/// took up a model missed before it followed the model's topics.
pub async fn learn_records(node: &NodeHandle, model: ModelId) -> Result<()> {
    for peer in node.peers().await? {
        let holdings = tokio::time::timeout(
            LEARN_DEADLINE,
            all_pages::<Holdings>(node, peer, |after| ExchangeRequest::Holdings {
                model,
                after,
            }),
        );
        let holdings = match holdings.await {
            Ok(Pages::Records(r)) => r,
            _ => Vec::new(),
        };
        let demand = tokio::time::timeout(
            LEARN_DEADLINE,
            all_pages::<Demand>(node, peer, |after| ExchangeRequest::Demand { model, after }),
        );
        let demand = match demand.await {
            Ok(Pages::Records(r)) => r,
            _ => Vec::new(),
        };
        node.learn(model, holdings, demand).await?;
    }
    Ok(())
}
