//! A model's share fetched at once: its manifest, the coverage of who holds what, the sources
//! of each selected blob, and the peers' plain lanes (see the parent module).

use std::collections::{HashMap, HashSet};

use futures::StreamExt;
use indicatif::ProgressBar;
use libp2p::PeerId;
use moeswarm_market::coverage::CoverageMap;
use moeswarm_model::store::BlobKind;
use moeswarm_protocol::{BlobId, ExchangeRequest, Manifest, ModelId, ResponseHeader};

use super::{choose_sources, FetchReport, Fetcher, Selection, MAX_PARALLEL_BLOBS};
use crate::error::{bail, Context, Result};
use crate::net::bulk::lane_addr;
use crate::net::identity::peer_id_of;

impl Fetcher {
    /// Learns where `peers` serve ranges in plain TCP: each is asked its port over libp2p (at
    /// most [`crate::net::bulk::CONNECT_DEADLINE`]), and the lane is used at the IP of the peer's
    /// own signed record, never at an address it names.
    async fn open_lanes(&self, peers: HashMap<PeerId, Vec<libp2p::Multiaddr>>) {
        let asks = peers
            .into_iter()
            .filter(|(peer, _)| self.lanes.unknown(peer))
            .map(|(peer, addrs)| async move {
                let ask = self.node.request(peer, ExchangeRequest::BulkPort);
                let at = match tokio::time::timeout(crate::net::bulk::CONNECT_DEADLINE, ask).await {
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
        crate::net::collect::gather_coverage(&self.node, model, n_layer, n_expert).await
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
