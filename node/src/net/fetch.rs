//! Fetching blobs from peers: ranges from several sources at once, verified as they arrive.
//!
//! A blob is cut into 1 MiB pieces handed out round-robin to the peers that hold it. Each
//! answer is checked against the blob id chunk group by chunk group ([`PartialBlob`]); a peer
//! whose bytes fail is counted against ([`NodeHandle::penalize`]) and dropped for that blob,
//! and the piece goes to another peer from the first unverified byte. A peer that times out or
//! disconnects is retried, then dropped. When no source is left the verified part is kept in
//! the [`Fetcher`], so the next attempt (from other peers) asks only for what is missing.
//! Only a blob whose every byte verified enters the store. Where a peer offers a plain TCP
//! lane (`bulk`), its ranges are asked there first: the same checks, but what fails there is
//! asked again over libp2p instead of being held against the peer.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::error::{bail, Context, Error, Result};
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use indicatif::ProgressBar;
use libp2p::PeerId;
use moeswarm_market::coverage::CoverageMap;
use moeswarm_protocol::{
    BlobId, ExchangeRequest, ExchangeResponse, Manifest, ModelId, ResponseHeader,
};

use super::bulk::{lane_addr, BulkLanes};
use super::handle::NodeHandle;
use super::identity::peer_id_of;
use super::stats::RequestFailure;
use moeswarm_model::store::transfer::PartialBlob;
use moeswarm_model::store::{BlobKind, Store};

/// Bytes asked of one peer in one request.
pub const PIECE_BYTES: u64 = 1 << 20;
/// Requests in flight for one blob.
pub const MAX_IN_FLIGHT: usize = 4;
/// Slabs fetched at once.
pub const MAX_PARALLEL_BLOBS: usize = 4;
/// Failed requests (not lies) after which a peer is dropped for a blob.
pub const MAX_PEER_FAILURES: u32 = 3;
/// Holders a blob is asked of at most: records claiming a slab cost nothing to make, so a
/// fetch tries the holders it can reach first and gives up on the rest.
pub const MAX_SOURCES_PER_BLOB: usize = 8;

/// The holders to ask for a blob, best first and at most [`MAX_SOURCES_PER_BLOB`]: peers
/// connected now, then those whose record says where they listen, then the rest (which only a
/// DHT lookup can find); `spread` rotates each group so that blobs start at different holders.
pub fn choose_sources(
    holders: &[PeerId],
    connected: &HashSet<PeerId>,
    dialable: &HashSet<PeerId>,
    spread: usize,
) -> Vec<PeerId> {
    let rank = |p: &PeerId| {
        if connected.contains(p) {
            0
        } else if dialable.contains(p) {
            1
        } else {
            2
        }
    };
    let mut out = Vec::new();
    for r in 0..3 {
        let mut group: Vec<PeerId> = holders.iter().filter(|p| rank(p) == r).copied().collect();
        if !group.is_empty() {
            let k = spread % group.len();
            group.rotate_left(k);
        }
        out.extend(group);
        if out.len() >= MAX_SOURCES_PER_BLOB {
            break;
        }
    }
    out.truncate(MAX_SOURCES_PER_BLOB);
    out
}

/// What one blob fetch did.
#[derive(Debug, Clone, Default)]
pub struct BlobFetch {
    /// The blob was already stored.
    pub already: bool,
    /// Verified bytes received (resumed fetches count only what they added).
    pub bytes: u64,
    /// Answers that failed verification or were malformed, by peer.
    pub rejected: BTreeMap<PeerId, u64>,
    /// Verified bytes received, by peer.
    pub served: BTreeMap<PeerId, u64>,
    /// Of the verified bytes, those that came over peers' plain TCP lanes.
    pub lane_bytes: u64,
}

/// What fetching part of a model did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct FetchReport {
    /// The model.
    pub model: Option<ModelId>,
    /// Blobs fetched now.
    pub fetched: usize,
    /// Blobs that were already stored.
    pub already: usize,
    /// Verified bytes received.
    pub bytes: u64,
    /// Of those, the bytes that came over peers' plain TCP lanes (the rest over libp2p).
    pub lane_bytes: u64,
    /// Bad answers, by peer.
    pub rejected: BTreeMap<String, u64>,
    /// Seconds the fetch took (after joining: finding the model and its holders, and the
    /// transfers).
    pub seconds: f64,
}

impl FetchReport {
    fn add(&mut self, f: &BlobFetch) {
        if f.already {
            self.already += 1;
        } else {
            self.fetched += 1;
        }
        self.bytes += f.bytes;
        self.lane_bytes += f.lane_bytes;
        for (p, n) in &f.rejected {
            *self.rejected.entry(p.to_string()).or_default() += n;
        }
    }
}

/// Which slabs of a model to fetch.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Layers (all when `None`).
    pub layers: Option<Range<u32>>,
    /// Experts (all when `None`).
    pub experts: Option<Vec<u32>>,
    /// The trunk too.
    pub trunk: bool,
    /// Only these `(layer, expert)` slabs (all that the other fields allow when `None`).
    pub only: Option<std::collections::BTreeSet<(u32, u32)>>,
}

impl Selection {
    /// Whether slab `(layer, expert)` is selected.
    pub fn wants(&self, layer: u32, expert: u32) -> bool {
        self.layers.as_ref().is_none_or(|r| r.contains(&layer))
            && self.experts.as_ref().is_none_or(|x| x.contains(&expert))
            && self
                .only
                .as_ref()
                .is_none_or(|s| s.contains(&(layer, expert)))
    }
}

/// Fetches blobs into a store through a node, keeping partial blobs between attempts.
#[derive(Clone)]
pub struct Fetcher {
    node: NodeHandle,
    store: Arc<Store>,
    partials: Arc<Mutex<HashMap<BlobId, PartialBlob>>>,
    lanes: Arc<BulkLanes>,
}

fn range_reply_ok(header: &ResponseHeader, id: &BlobId, range: &Range<u64>) -> bool {
    matches!(header, ResponseHeader::Range { id: i, start, end }
        if i == id && *start == range.start && *end == range.end)
}

impl Fetcher {
    /// A fetcher into `store` over `node`.
    pub fn new(node: NodeHandle, store: Arc<Store>) -> Self {
        Self {
            node,
            store,
            partials: Arc::default(),
            lanes: Arc::default(),
        }
    }

    /// The size of blob `id`, as the first source to answer says, if it is within `limit`
    /// (checked before anything is allocated for it; a wrong size then only fails
    /// verification).
    async fn size_from(&self, id: &BlobId, sources: &[PeerId], limit: u64) -> Result<u64> {
        let mut why = Vec::new();
        // A peer that joined a moment ago may not be reachable yet: a few rounds, backing off.
        let rounds = sources.iter().cycle().take(sources.len() * 3).enumerate();
        for (i, &peer) in rounds {
            if i > 0 && i % sources.len() == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(
                    250 * (i / sources.len()) as u64,
                ))
                .await;
            }
            match self
                .node
                .request(peer, ExchangeRequest::Size { id: *id })
                .await
            {
                Ok(r) => match r.header {
                    ResponseHeader::Size { id: got, size } if got == *id && size > limit => why
                        .push(format!(
                            "{peer}: says {size} bytes, over the limit of {limit} for this blob"
                        )),
                    ResponseHeader::Size { id: got, size } if got == *id && size > 0 => {
                        return Ok(size)
                    }
                    ResponseHeader::NotFound => why.push(format!("{peer}: not held")),
                    other => why.push(format!("{peer}: {other:?}")),
                },
                Err(e) => why.push(format!("{e:#}")),
            }
        }
        bail!(
            "no source answered the size of blob {id}: {}",
            why.join("; ")
        )
    }

    /// Fetches blob `id` (of `kind`) from `sources`, verified, into the store.
    pub async fn fetch_blob(
        &self,
        id: BlobId,
        kind: BlobKind,
        sources: &[PeerId],
        progress: &ProgressBar,
    ) -> Result<BlobFetch> {
        self.fetch_blob_sized(id, kind, None, sources, progress)
            .await
    }

    /// [`Fetcher::fetch_blob`] of a blob whose size is known (from a verified manifest), which
    /// saves asking for it. A wrong size only makes verification fail.
    pub async fn fetch_blob_sized(
        &self,
        id: BlobId,
        kind: BlobKind,
        size: Option<u64>,
        sources: &[PeerId],
        progress: &ProgressBar,
    ) -> Result<BlobFetch> {
        if self.store.contains(&id)? {
            return Ok(BlobFetch {
                already: true,
                ..BlobFetch::default()
            });
        }
        if sources.is_empty() {
            bail!("blob {id}: no peer holds it");
        }
        let taken = self
            .partials
            .lock()
            .map_err(|_| Error::invalid("poisoned"))?
            .remove(&id);
        let mut partial = match taken {
            Some(p) => p,
            None => {
                let limit = match kind {
                    BlobKind::Manifest => moeswarm_protocol::limits::MAX_MANIFEST_BYTES as u64,
                    _ => moeswarm_protocol::limits::MAX_BLOB_BYTES,
                };
                let size = match size {
                    Some(s) if s > limit => {
                        bail!("blob {id} is said to be {s} bytes, over the limit of {limit}")
                    }
                    Some(s) if s > 0 => s,
                    _ => self.size_from(&id, sources, limit).await?,
                };
                PartialBlob::new(&self.store, id, size, kind)?
            }
        };
        let result = self.fill(&mut partial, sources, progress).await;
        match result {
            Ok(report) => {
                let store = self.store.clone();
                tokio::task::spawn_blocking(move || partial.finish(&store))
                    .await
                    .context("finishing a blob")??;
                // The whole blob verified: each peer that served part of it was useful.
                for peer in report.served.keys() {
                    self.node.credit(*peer).await;
                }
                Ok(report)
            }
            Err(e) => {
                // Keep what verified, for the next attempt.
                if let Ok(mut p) = self.partials.lock() {
                    p.insert(id, partial);
                }
                Err(e)
            }
        }
    }

    async fn fill(
        &self,
        partial: &mut PartialBlob,
        sources: &[PeerId],
        progress: &ProgressBar,
    ) -> Result<BlobFetch> {
        let id = partial.id();
        let mut queue: VecDeque<Range<u64>> = VecDeque::new();
        for gap in partial.missing()? {
            let mut s = gap.start;
            while s < gap.end {
                let e = (s + PIECE_BYTES).min(gap.end);
                queue.push_back(s..e);
                s = e;
            }
        }
        let mut report = BlobFetch::default();
        let mut usable: Vec<PeerId> = sources.to_vec();
        let mut failures: HashMap<PeerId, u32> = HashMap::new();
        let mut next = 0usize;
        let mut in_flight = FuturesUnordered::new();
        let mut last_error = String::new();
        loop {
            while in_flight.len() < MAX_IN_FLIGHT && !usable.is_empty() {
                let Some(range) = queue.pop_front() else {
                    break;
                };
                let peer = usable[next % usable.len()];
                next += 1;
                let (node, lanes) = (self.node.clone(), self.lanes.clone());
                let lane = self.lanes.at(&peer);
                in_flight.push(async move {
                    let req = ExchangeRequest::Range {
                        id,
                        start: range.start,
                        end: range.end,
                    };
                    let answer = match lane {
                        Some(addr) => lanes.range(addr, &req).await,
                        None => node.request(peer, req).await,
                    };
                    (peer, range, lane.is_some(), answer)
                });
            }
            let Some((peer, range, by_lane, answer)) = in_flight.next().await else {
                break;
            };
            if by_lane {
                let taken = (range, answer);
                self.take_from_lane(partial, peer, taken, &mut queue, &mut report, progress)?;
                continue;
            }
            let lie = match answer {
                Ok(r) if range_reply_ok(&r.header, &id, &range) => {
                    match partial.accept(range.clone(), &r.payload) {
                        Ok(()) => {
                            report.bytes += range.end - range.start;
                            *report.served.entry(peer).or_default() += range.end - range.start;
                            progress.inc(range.end - range.start);
                            continue;
                        }
                        // Not the sender's doing: the bytes could not be written here.
                        Err(e) if e.local => {
                            bail!(
                                "blob {id}: writing what {peer} sent failed here ({}); verified \
                                 bytes are kept for the next attempt",
                                e.reason
                            );
                        }
                        Err(e) => {
                            last_error = e.to_string();
                            let at = e.at.clamp(range.start, range.end - 1);
                            report.bytes += at - range.start;
                            progress.inc(at - range.start);
                            queue.push_front(at..range.end);
                            true
                        }
                    }
                }
                Ok(r) => {
                    queue.push_front(range);
                    match r.header {
                        ResponseHeader::NotFound => {
                            usable.retain(|p| *p != peer);
                            last_error = format!("{peer} does not hold {id}");
                            false
                        }
                        ResponseHeader::Refused { reason } => {
                            last_error = format!("{peer} refused: {reason}");
                            let n = failures.entry(peer).or_default();
                            *n += 1;
                            if *n >= MAX_PEER_FAILURES {
                                usable.retain(|p| *p != peer);
                            }
                            false
                        }
                        other => {
                            last_error = format!("{peer} answered {other:?} to a range request");
                            true
                        }
                    }
                }
                Err(e) => {
                    queue.push_front(range);
                    last_error = format!("{e:#}");
                    let n = failures.entry(peer).or_default();
                    // One that is no moeswarm node will not become one: given up at once.
                    match e.root() {
                        Error::Request(f) if matches!(**f, RequestFailure::Unsupported { .. }) => {
                            *n = MAX_PEER_FAILURES
                        }
                        _ => *n += 1,
                    }
                    if *n >= MAX_PEER_FAILURES {
                        usable.retain(|p| *p != peer);
                    } else {
                        // A transient failure (a dial under way, a busy peer): back off a little.
                        tokio::time::sleep(std::time::Duration::from_millis(100 << *n)).await;
                    }
                    false
                }
            };
            if lie {
                *report.rejected.entry(peer).or_default() += 1;
                self.node.penalize(peer).await;
                usable.retain(|p| *p != peer);
            }
        }
        if !queue.is_empty() {
            bail!(
                "blob {id}: no usable source left with {} bytes missing (verified bytes are kept \
                 for the next attempt); last error: {last_error}",
                queue.iter().map(|r| r.end - r.start).sum::<u64>()
            );
        }
        Ok(report)
    }

    /// Keeps what verified of an answer that came over `peer`'s plain lane. Whatever failed
    /// there turns the lane off for the peer and puts the rest of the range back in `queue`
    /// (asked over libp2p next); nobody is counted against for it. Fails only when the bytes
    /// could not be written here.
    fn take_from_lane(
        &self,
        partial: &mut PartialBlob,
        peer: PeerId,
        (range, answer): (Range<u64>, Result<ExchangeResponse>),
        queue: &mut VecDeque<Range<u64>>,
        report: &mut BlobFetch,
        progress: &ProgressBar,
    ) -> Result<()> {
        let id = partial.id();
        let kept = match answer {
            Ok(r) if range_reply_ok(&r.header, &id, &range) => {
                match partial.accept(range.clone(), &r.payload) {
                    Ok(()) => range.end,
                    Err(e) if e.local => bail!(
                        "blob {id}: writing what {peer} sent failed here ({}); verified bytes \
                         are kept for the next attempt",
                        e.reason
                    ),
                    Err(e) => {
                        tracing::debug!("{peer}'s plain lane: {e}");
                        e.at.clamp(range.start, range.end)
                    }
                }
            }
            Ok(r) => {
                tracing::debug!("{peer}'s plain lane answered {:?}", r.header);
                range.start
            }
            Err(e) => {
                tracing::debug!("{peer}'s plain lane: {e:#}");
                range.start
            }
        };
        let n = kept - range.start;
        report.bytes += n;
        report.lane_bytes += n;
        *report.served.entry(peer).or_default() += n;
        progress.inc(n);
        if kept < range.end {
            self.lanes.turn_off(peer);
            queue.push_front(kept..range.end);
        }
        Ok(())
    }

    /// Learns where `peers` serve ranges in plain TCP: each is asked its port over libp2p (at
    /// most [`super::bulk::CONNECT_DEADLINE`]), and the lane is used at the IP of the peer's
    /// own signed record, never at an address it names.
    async fn open_lanes(&self, peers: HashMap<PeerId, Vec<libp2p::Multiaddr>>) {
        let asks = peers
            .into_iter()
            .filter(|(peer, _)| self.lanes.unknown(peer))
            .map(|(peer, addrs)| async move {
                let ask = self.node.request(peer, ExchangeRequest::BulkPort);
                let at = match tokio::time::timeout(super::bulk::CONNECT_DEADLINE, ask).await {
                    Ok(Ok(r)) => match r.header {
                        ResponseHeader::BulkPort { port } if port != 0 => lane_addr(&addrs, port),
                        _ => None,
                    },
                    _ => None,
                };
                self.lanes.learn(peer, at);
            });
        futures::future::join_all(asks).await;
    }

    /// Every holdings record of `model` the connected peers know (each verified here), plus
    /// the DHT records of the peers that did not answer, as a coverage map.
    pub async fn gather_coverage(
        &self,
        model: ModelId,
        n_layer: u32,
        n_expert: u32,
    ) -> Result<CoverageMap> {
        super::collect::gather_coverage(&self.node, model, n_layer, n_expert).await
    }

    /// The manifest of `model`: from the store, or fetched from its providers and peers.
    pub async fn manifest(&self, model: ModelId) -> Result<Manifest> {
        if self.store.contains(&model.0)? {
            return Ok(Manifest::from_bytes(&self.store.read(&model.0)?)?);
        }
        let mut sources = self.node.providers(model).await.unwrap_or_default();
        for p in self.node.peers().await? {
            if !sources.contains(&p) {
                sources.push(p);
            }
        }
        self.fetch_blob(
            model.0,
            BlobKind::Manifest,
            &sources,
            &ProgressBar::hidden(),
        )
        .await
        .with_context(|| format!("fetching the manifest of {model}"))?;
        let manifest = Manifest::from_bytes(&self.store.read(&model.0)?)?;
        if manifest.id() != model {
            bail!(
                "the manifest fetched for {model} describes {}",
                manifest.id()
            );
        }
        Ok(manifest)
    }

    /// Fetches the selected slabs (and the trunk if asked) of `model` from the peers that hold
    /// them, and indexes the model in the store.
    pub async fn fetch_model(
        &self,
        model: ModelId,
        selection: &Selection,
        progress: &ProgressBar,
    ) -> Result<FetchReport> {
        let manifest = self.manifest(model).await?;
        let h = &manifest.hyper;
        let coverage = self
            .gather_coverage(model, manifest.slab_layers(), h.n_expert)
            .await?;
        // Where each holder listens, from its signed record: dialable without a DHT lookup.
        let mut dialable = HashMap::new();
        for rec in coverage.nodes() {
            if let Some(peer) = peer_id_of(&rec.node).filter(|p| *p != self.node.peer_id) {
                let addrs: Vec<libp2p::Multiaddr> =
                    rec.addrs.iter().filter_map(|a| a.parse().ok()).collect();
                if !addrs.is_empty() {
                    self.node.add_addresses(peer, addrs.clone()).await;
                    dialable.insert(peer, addrs);
                }
            }
        }
        let dialable_peers: HashSet<PeerId> = dialable.keys().copied().collect();
        let connected: HashSet<PeerId> = self.node.peers().await?.into_iter().collect();
        let mut jobs: Vec<(BlobId, BlobKind, u64, Vec<PeerId>)> = Vec::new();
        if selection.trunk {
            let mut sources = self.node.providers(model).await.unwrap_or_default();
            sources.extend(coverage.nodes().filter_map(|n| peer_id_of(&n.node)));
            let mut once = HashSet::new();
            sources.retain(|p| *p != self.node.peer_id && once.insert(*p));
            jobs.push((
                manifest.trunk.id,
                BlobKind::Trunk,
                manifest.trunk.bytes,
                choose_sources(&sources, &connected, &dialable_peers, 0),
            ));
        }
        let mut seen = HashSet::new();
        for (layer, expert, r) in manifest.all_slabs() {
            // Two experts with the same bytes are one blob: fetched once.
            if !selection.wants(layer, expert) || self.store.contains(&r.id)? || !seen.insert(r.id)
            {
                continue;
            }
            let holders: Vec<PeerId> = coverage
                .holders(layer, expert)
                .iter()
                .filter_map(peer_id_of)
                .filter(|p| *p != self.node.peer_id)
                .collect();
            // Spread the load: each slab starts at another holder.
            let spread = layer as usize * 31 + expert as usize;
            let sources = choose_sources(&holders, &connected, &dialable_peers, spread);
            jobs.push((r.id, BlobKind::Slab { layer, expert }, r.bytes, sources));
        }
        let sourced: HashSet<PeerId> = jobs.iter().flat_map(|j| j.3.iter().copied()).collect();
        dialable.retain(|p, _| sourced.contains(p));
        self.open_lanes(dialable).await;
        progress.set_length(jobs.iter().map(|j| j.2).sum());
        let mut report = FetchReport {
            model: Some(model),
            ..FetchReport::default()
        };
        let mut errors = Vec::new();
        let mut running =
            futures::stream::iter(jobs.into_iter().map(|(id, kind, size, sources)| {
                let me = self.clone();
                let progress = progress.clone();
                async move {
                    let r = me
                        .fetch_blob_sized(id, kind, Some(size), &sources, &progress)
                        .await;
                    (id, r)
                }
            }))
            .buffer_unordered(MAX_PARALLEL_BLOBS);
        while let Some((id, r)) = running.next().await {
            match r {
                Ok(f) => report.add(&f),
                Err(e) => errors.push(format!("{id}: {e:#}")),
            }
        }
        let store = self.store.clone();
        let m = manifest.clone();
        tokio::task::spawn_blocking(move || store.add_partial_model(&m))
            .await
            .context("indexing the model")??;
        if !errors.is_empty() {
            bail!(
                "{} of the selected blobs of {model} could not be fetched: {}",
                errors.len(),
                errors.join("; ")
            );
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_the_reachable_first_and_few() {
        let peers: Vec<PeerId> = (0..40).map(|_| PeerId::random()).collect();
        let connected: HashSet<PeerId> = peers[30..32].iter().copied().collect();
        let dialable: HashSet<PeerId> = peers[20..25].iter().copied().collect();
        let got = choose_sources(&peers, &connected, &dialable, 7);
        assert_eq!(got.len(), MAX_SOURCES_PER_BLOB);
        assert!(got[..2].iter().all(|p| connected.contains(p)));
        assert!(got[2..7].iter().all(|p| dialable.contains(p)));
        assert!(!connected.contains(&got[7]) && !dialable.contains(&got[7]));
        // Each once; a short list is kept whole.
        let once: HashSet<_> = got.iter().collect();
        assert_eq!(once.len(), got.len());
        assert_eq!(
            choose_sources(&peers[..3], &connected, &dialable, 1).len(),
            3
        );
        // Spreading rotates within a group.
        let a = choose_sources(&peers[20..25], &HashSet::new(), &dialable, 0);
        let b = choose_sources(&peers[20..25], &HashSet::new(), &dialable, 1);
        assert_eq!(a[1], b[0]);
    }
}
