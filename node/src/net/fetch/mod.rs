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
//!
//! `pass` holds one blob's transfer; `model` a model's share fetched at once (manifest,
//! coverage, sources, lanes). Serving ranges is `serve`'s and the lanes' server `bulk`'s.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::error::{bail, Context, Error, Result};
use indicatif::ProgressBar;
use libp2p::PeerId;
use moeswarm_protocol::{BlobId, ExchangeRequest, ModelId, ResponseHeader};

use super::bulk::BulkLanes;
use super::handle::NodeHandle;
use moeswarm_model::store::transfer::PartialBlob;
use moeswarm_model::store::{BlobKind, Store};

mod model;
mod pass;

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
