//! The router as referee: where no one else can give an opinion on a worker's answer (the
//! worker is the slab's only holder) or two workers disagree, the router fetches the slab
//! itself (from any holder, verified by its hash, into its own store) and computes the
//! answer. Fetches draw on a budget that renews over time ([`RefereeBudget`]): a swarm of
//! liars cannot make a router fetch the whole model, and a long-running router is never left
//! without a way to check.

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use moeswarm_engine::executor::ExpertRequest;
use moeswarm_model::store::BlobKind;
use moeswarm_relay::registry::TokenBucket;
use moeswarm_relay::PeerId;

use super::RemoteExecutor;

/// Slabs a router may fetch at once to referee (the budget's most).
pub const REFEREE_BURST: u32 = 32;
/// The time in which one more fetch is earned, up to [`REFEREE_BURST`].
pub const REFEREE_RENEWAL: Duration = Duration::from_secs(60);
/// The longest a router spends fetching a slab to referee (or the dispatch deadline, if
/// longer).
const REFEREE_FETCH_DEADLINE: Duration = Duration::from_secs(30);

/// How many referee fetches a router may start: [`REFEREE_BURST`] at first, one more every
/// [`REFEREE_RENEWAL`] up to that many. A token bucket counted in seconds of renewal: one
/// token a second, a fetch costs a renewal's worth.
#[derive(Debug)]
pub struct RefereeBudget(TokenBucket);

impl RefereeBudget {
    /// A full budget at `now`.
    pub fn new(now: Instant) -> Self {
        let per_fetch = REFEREE_RENEWAL.as_secs();
        Self(TokenBucket::new(1, REFEREE_BURST as u64 * per_fetch, now))
    }

    /// Takes one fetch at `now`, if one is left.
    pub fn take(&mut self, now: Instant) -> bool {
        self.0.try_take(REFEREE_RENEWAL.as_secs(), now)
    }
}

/// What a router referees with.
pub(super) struct Referee {
    pub(super) fetcher: crate::net::fetch::Fetcher,
    pub(super) budget: Mutex<RefereeBudget>,
}

impl RemoteExecutor {
    /// The router's own output of group `i`, from the slab fetched now if it does not hold it
    /// (`None` without a referee, with the budget spent, or when the fetch fails).
    pub(super) async fn referee(&self, req: &ExpertRequest<'_>, i: usize) -> Option<Vec<f32>> {
        let referee = self.referee.as_ref()?;
        let g = &req.plan.groups[i];
        let slab = self.manifest.slab(req.layer, g.expert)?;
        if self.local_weights(req.layer, g.expert).is_err() {
            let granted = referee
                .budget
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(Instant::now());
            if !granted {
                tracing::debug!(
                    "no referee fetch left for expert {} of layer {}",
                    g.expert,
                    req.layer
                );
                return None;
            }
            let sources: Vec<PeerId> = {
                let table = self.table.read().unwrap_or_else(|e| e.into_inner());
                table
                    .replicas(req.layer, g.expert)
                    .iter()
                    .map(|r| r.peer)
                    .collect()
            };
            let kind = BlobKind::Slab {
                layer: req.layer,
                expert: g.expert,
            };
            let hidden = indicatif::ProgressBar::hidden();
            let fetch = referee.fetcher.fetch_blob_sized(
                slab.id,
                kind,
                Some(slab.bytes),
                &sources,
                &hidden,
            );
            let deadline = self.retry.deadline.max(REFEREE_FETCH_DEADLINE);
            match tokio::time::timeout(deadline, fetch).await {
                Ok(Ok(_)) => {
                    self.stats.refereed.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        "fetched expert {} of layer {} to check its holders",
                        g.expert,
                        req.layer
                    );
                }
                Ok(Err(e)) => {
                    tracing::warn!("fetching a slab to check its holders: {e:#}");
                    return None;
                }
                Err(_) => {
                    tracing::warn!("fetching a slab to check its holders: out of time");
                    return None;
                }
            }
        }
        self.local_opinion(req, i).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_allows_a_burst_then_one_fetch_per_renewal_and_never_more_than_the_burst() {
        let t0 = Instant::now();
        let mut b = RefereeBudget::new(t0);
        for _ in 0..REFEREE_BURST {
            assert!(b.take(t0));
        }
        assert!(!b.take(t0), "the burst is spent");
        assert!(!b.take(t0 + REFEREE_RENEWAL / 2));
        assert!(b.take(t0 + REFEREE_RENEWAL), "one earned in a renewal");
        assert!(!b.take(t0 + REFEREE_RENEWAL));
        // A long quiet time earns the burst back, no more.
        let later = t0 + REFEREE_RENEWAL * 1000;
        for _ in 0..REFEREE_BURST {
            assert!(b.take(later));
        }
        assert!(!b.take(later));
    }
}
