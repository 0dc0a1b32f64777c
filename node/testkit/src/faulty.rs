//! Expert executors that fail on purpose, over the model's real experts.

use moeswarm_engine::{ExpertExecutor, ExpertRequest, LocalExecutor};

/// The model's own experts, but expert `expert` of layer `layer` has no holder: any request
/// naming it fails (as a swarm's does when a slab is lost), saying so.
pub struct MissingSlab<'a> {
    /// The experts that answer the rest.
    pub inner: &'a LocalExecutor,
    /// The lost slab's layer.
    pub layer: u32,
    /// The lost slab's expert.
    pub expert: u32,
}

impl ExpertExecutor for MissingSlab<'_> {
    fn compute(
        &self,
        req: ExpertRequest<'_>,
    ) -> impl std::future::Future<Output = moeswarm_engine::Result<Vec<Vec<f32>>>> + Send {
        let missing =
            req.layer == self.layer && req.plan.groups.iter().any(|g| g.expert == self.expert);
        let why = format!("no holder of slab ({}, {})", self.layer, self.expert);
        async move {
            if missing {
                return Err(moeswarm_engine::Error::Executor(why.into()));
            }
            self.inner.compute(req).await
        }
    }
}
