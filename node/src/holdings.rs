//! What this node holds and says it holds: the one owner of its holdings records.
//!
//! [`Advertiser`] publishes a signed record per model in the store (what it holds, used and
//! free bytes, where it listens, how it is reached), withdraws them (a record that holds
//! nothing) when the node stops, and after the store changed loads the new slabs into the
//! worker and publishes again ([`Advertiser::reload_and_advertise`]: the plain node after a
//! fetch, the market participant after its round). [`guard_store`] re-advertises whenever a
//! bad blob is dropped. It does not choose what to hold (that is [`crate::auto`] and the
//! market) and does not move records over the network (that is [`crate::net`]).

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Context, Result};
use moeswarm_protocol::holdings::LayerBits;
use moeswarm_protocol::{Holdings, Manifest, Reach, RecordBody, SignedHoldings};

use crate::dataplane::{HeldExperts, WorkerService};
use crate::net::identity::NodeIdentity;
pub(crate) use crate::net::records::fresh_seq;
use crate::net::records::now_secs;
use crate::net::NodeHandle;
use moeswarm_model::store::Store;

/// What goes into this node's records besides what it holds.
#[derive(Debug, Clone)]
pub(crate) struct Advert {
    /// Publish at all.
    pub(crate) enabled: bool,
    pub(crate) ttl: Duration,
    pub(crate) capacity: u64,
    pub(crate) addrs: Vec<String>,
    pub(crate) reach: Reach,
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
    let held = store.held_slabs(manifest)?;
    Ok(signed_holdings(
        manifest,
        id,
        &held,
        (held_bytes(store)?, free_bytes),
        ttl,
        Vec::new(),
        Reach::Direct,
    ))
}

/// The signed record saying `id` holds `held` of `manifest`'s model, with `(used, free)` bytes
/// of capacity.
fn signed_holdings(
    manifest: &Manifest,
    id: &NodeIdentity,
    held: &[(u32, u32)],
    (used_bytes, free_bytes): (u64, u64),
    ttl: Duration,
    addrs: Vec<String>,
    reach: Reach,
) -> SignedHoldings {
    let h = &manifest.hyper;
    let mut layers = vec![LayerBits::empty(h.n_expert); manifest.slab_layers() as usize];
    for &(l, e) in held {
        if let Some(bits) = layers.get_mut(l as usize) {
            bits.set(e);
        }
    }
    let record = Holdings {
        model: manifest.id(),
        node: id.key,
        n_expert: h.n_expert,
        layers,
        used_bytes,
        free_bytes,
        addrs,
        reach,
        seq: fresh_seq(),
        expires_at: now_secs() + ttl.as_secs().max(1),
    };
    record.sign(&id.signing)
}

/// Bytes of all blobs in `store`.
pub(crate) fn held_bytes(store: &Store) -> Result<u64> {
    Ok(store.blobs()?.iter().map(|(_, e)| e.size).sum())
}

/// Every held slab of every model in `store`, loaded to compute; those in `held` already are
/// kept as they are, and those no longer stored are let go.
pub(crate) async fn load_held(store: &Arc<Store>, mut held: HeldExperts) -> Result<HeldExperts> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || {
        held.retain_stored(&store)?;
        for m in store.models()? {
            HeldExperts::load(&store, &store.manifest(&m)?, &mut held)?;
        }
        Ok(held)
    })
    .await
    .context("loading experts")?
}

async fn publish_holdings(
    handle: &NodeHandle,
    store: &Arc<Store>,
    ad: &Advert,
    withdrawn: bool,
) -> Result<usize> {
    if !ad.enabled {
        return Ok(0);
    }
    let used = if withdrawn { 0 } else { held_bytes(store)? };
    let free = ad.capacity.saturating_sub(used);
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
    let models = store.models()?;
    for &model in &models {
        let manifest = store.manifest(&model)?;
        let h = &manifest.hyper;
        let held = if withdrawn {
            Vec::new()
        } else {
            handle
                .subscribe(model, manifest.slab_layers(), h.n_expert)
                .await?;
            handle.provide(model).await?;
            store.held_slabs(&manifest)?
        };
        let record = signed_holdings(
            &manifest,
            &handle.identity,
            &held,
            (used, free),
            ad.ttl,
            addrs.clone(),
            ad.reach,
        );
        handle.publish(model, record).await?;
    }
    Ok(models.len())
}

/// The node's holdings records: published, refreshed, withdrawn, and published again when
/// what the store holds changed.
#[derive(Clone)]
pub(crate) struct Advertiser {
    pub(crate) handle: NodeHandle,
    pub(crate) store: Arc<Store>,
    /// The worker that computes the held slabs, if the node serves dispatches.
    pub(crate) worker: Option<Arc<WorkerService>>,
    pub(crate) ad: Advert,
}

impl Advertiser {
    /// Publishes a fresh record of what the store holds, for every model in it.
    pub(crate) async fn advertise(&self) -> Result<()> {
        publish_holdings(&self.handle, &self.store, &self.ad, false)
            .await
            .map(|_| ())
    }

    /// Publishes, for every model in the store, a record that holds nothing; how many.
    pub(crate) async fn withdraw(&self) -> Result<usize> {
        publish_holdings(&self.handle, &self.store, &self.ad, true).await
    }

    /// After the store changed: the worker loads the new slabs (the rest are shared) and lets
    /// go of those gone, then a fresh record says what is held now.
    pub(crate) async fn reload_and_advertise(&self) -> Result<()> {
        if let Some(w) = &self.worker {
            w.set_experts(load_held(&self.store, w.experts()).await?);
        }
        self.advertise().await
    }

    /// Bytes of all blobs held.
    pub(crate) fn held_bytes(&self) -> Result<u64> {
        held_bytes(&self.store)
    }

    /// Says the node is up every heartbeat period, until the task is stopped: others count
    /// its holdings only while they hear it.
    pub(crate) async fn keep_beating(self) {
        let period = Duration::from_secs(moeswarm_protocol::heartbeat::HEARTBEAT_PERIOD_SECS);
        // The first once the gossip mesh has had a moment to form.
        tokio::time::sleep(Duration::from_secs(1)).await;
        loop {
            if let Err(e) = self.handle.heartbeat().await {
                tracing::debug!("heartbeat: {e:#}");
            }
            // A node that found the swarm again (after a sleep, say) says so at once, before
            // its peers' windows for it pass; again once the gossip mesh has it.
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = self.handle.rejoined() => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
    }

    /// Publishes again every half lifetime of a record, until the task is stopped.
    pub(crate) async fn keep_fresh(self) {
        let period = (self.ad.ttl / 2).max(Duration::from_secs(1));
        loop {
            tokio::time::sleep(period).await;
            if let Err(e) = self.advertise().await {
                tracing::warn!("re-advertising failed: {e:#}");
            }
        }
    }
}

/// Hashes every blob once (the open checked sizes only), then, whenever a blob is found bad
/// and dropped (by this check, or by a reader: HTTP, the exchange, a worker), advertises
/// again at once, so no record claims a slab the node no longer holds.
pub(crate) async fn guard_store(advertiser: Advertiser) {
    // A permit is kept when nobody waits, so no quarantine is missed.
    let dropped = Arc::new(tokio::sync::Notify::new());
    let d = dropped.clone();
    advertiser.store.on_quarantine(move || d.notify_one());
    let s = advertiser.store.clone();
    match tokio::task::spawn_blocking(move || s.verify_all()).await {
        Ok(Ok(bad)) => {
            for (id, why) in bad {
                tracing::warn!("store: dropped blob {id}: {why}");
            }
        }
        Ok(Err(e)) => tracing::warn!("store: checking the blobs failed: {e:#}"),
        Err(e) => tracing::warn!("store: checking the blobs failed: {e}"),
    }
    loop {
        dropped.notified().await;
        if let Err(e) = advertiser.advertise().await {
            tracing::warn!("advertising after a blob was dropped: {e:#}");
        }
    }
}
