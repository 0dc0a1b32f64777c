//! Drafters for tests and benchmarks that bound speculative decoding's mechanism.

use moeswarm_engine::executor::ExpertExecutor;
use moeswarm_engine::speculative::{DraftContext, Drafter};

/// A drafter that knows the text: it proposes the next tokens of `text` (a prompt and its
/// greedy continuation made without drafts: always right), or, `wrong`, those tokens shifted
/// by one in the vocabulary (always wrong).
pub struct KnowingDrafter {
    /// The prompt and the greedy continuation.
    pub text: Vec<u32>,
    /// Propose wrong tokens.
    pub wrong: bool,
}

impl Drafter for KnowingDrafter {
    async fn draft<E: ExpertExecutor>(
        &mut self,
        ctx: DraftContext<'_, E>,
        k: usize,
    ) -> moeswarm_engine::Result<Vec<u32>> {
        let at = ctx.history.len();
        let end = (at + k).min(self.text.len());
        Ok(self.text[at.min(end)..end]
            .iter()
            .map(|&t| if self.wrong { (t + 1) % 2000 } else { t })
            .collect())
    }
}
