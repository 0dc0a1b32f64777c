//! Speculative decoding: a drafter guesses the next few tokens, one forward pass over them
//! checks them all, and the agreeing prefix is kept, plus the model's own token after it.
//!
//! A pass over k + 1 rows costs about what a pass over one costs where the cost is per pass:
//! the trunk's weights are read once, and the experts of each layer are one request for all
//! rows (through a swarm, one round trip per layer for several tokens). Positions a rejected
//! draft ran are dropped exactly ([`Trunk::rollback`]); the tokens that come out are the
//! model's: greedy, the same tokens as without speculation; sampling, the same distribution
//! ([`Sampler::check_draft`]).
//!
//! Drafters ([`Drafter`]): [`MtpDrafter`], the model's multi-token-prediction block, chained
//! for more than one token; [`NgramDrafter`], prompt lookup (no model). This module does not
//! sample or stop: [`crate::generate`] does.

use std::future::Future;

use crate::error::{bail, Result};
use crate::executor::ExpertExecutor;
use crate::text::Sampler;
use crate::trunk::{ForwardTiming, KvCache, Trunk};

/// Which drafter a generation uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Speculation {
    /// One token a pass.
    Off,
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the last few.
    Ngram,
    /// The model's MTP block.
    Mtp,
}

impl std::str::FromStr for Speculation {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "ngram" => Ok(Self::Ngram),
            "mtp" => Ok(Self::Mtp),
            other => Err(format!("speculation {other:?}: want mtp, ngram or off")),
        }
    }
}

/// Drafted tokens checked per pass at most.
pub const MAX_DRAFT: usize = 16;

/// How a generation speculates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculationConfig {
    /// The drafter.
    pub mode: Speculation,
    /// Tokens drafted per pass (1..=[`MAX_DRAFT`]).
    pub draft: usize,
}

impl SpeculationConfig {
    /// No speculation.
    pub const OFF: Self = Self {
        mode: Speculation::Off,
        draft: 0,
    };

    /// The default for a model: its MTP block drafting 3 tokens where it has one, else none.
    pub fn default_for(trunk: &Trunk) -> Self {
        Self::requested(None, None, trunk.has_mtp()).unwrap_or(Self::OFF)
    }

    /// `mode` with `draft` tokens (its default, 3, when `None`), checked against `trunk`.
    pub fn new(mode: Speculation, draft: Option<usize>, trunk: &Trunk) -> Result<Self> {
        Self::requested(Some(mode), draft, trunk.has_mtp()).map_err(crate::Error::invalid)
    }

    /// What a request asks for, for a model that has an MTP block or not: neither mode nor
    /// draft given, the model's default (its MTP block drafting 3 tokens where it has one,
    /// else off); a draft without a mode, the MTP block's. The error in words.
    pub fn requested(
        mode: Option<Speculation>,
        draft: Option<usize>,
        has_mtp: bool,
    ) -> std::result::Result<Self, String> {
        let mode = match (mode, draft) {
            (None, None) if !has_mtp => return Ok(Self::OFF),
            (mode, _) => mode.unwrap_or(Speculation::Mtp),
        };
        let draft = match mode {
            Speculation::Off => 0,
            _ => draft.unwrap_or(3),
        };
        if mode != Speculation::Off && !(1..=MAX_DRAFT).contains(&draft) {
            return Err(format!("a draft of {draft} tokens: want 1 to {MAX_DRAFT}"));
        }
        if mode == Speculation::Mtp && !has_mtp {
            return Err("speculation mtp: this model has no MTP block (try ngram)".into());
        }
        Ok(Self { mode, draft })
    }

    /// The drafter of this mode (`None` when off).
    pub fn drafter(&self) -> Option<ModeDrafter> {
        match self.mode {
            Speculation::Off => None,
            Speculation::Ngram => Some(ModeDrafter::Ngram(NgramDrafter::default())),
            Speculation::Mtp => Some(ModeDrafter::Mtp(MtpDrafter)),
        }
    }
}

/// What a drafter is told before each pass.
pub struct DraftContext<'a, E> {
    /// The model.
    pub trunk: &'a Trunk,
    /// Its experts.
    pub exec: &'a E,
    /// The sequence's cache: its positions are the ones kept so far.
    pub cache: &'a mut KvCache,
    /// Every token so far, the model's next one (not yet run) last.
    pub history: &'a [u32],
    /// The residual streams of the positions kept since the last draft (the last rows of the
    /// cache), `[rows][n_embd]`.
    pub kept_hidden: &'a [f32],
    /// Where the time goes.
    pub timing: &'a mut ForwardTiming,
}

/// Guesses the tokens that follow.
pub trait Drafter {
    /// Up to `k` tokens to follow `ctx.history` (fewer, or none, when it has no guess).
    fn draft<E: ExpertExecutor>(
        &mut self,
        ctx: DraftContext<'_, E>,
        k: usize,
    ) -> impl Future<Output = Result<Vec<u32>>>;
}

/// Prompt lookup: finds the latest earlier place where the last `n` tokens (longest first,
/// down to one) occurred and proposes what followed them there.
pub struct NgramDrafter {
    /// The longest suffix matched.
    pub max_n: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        Self { max_n: 3 }
    }
}

impl NgramDrafter {
    /// The guess for `history`, at most `k` tokens.
    pub fn guess(&self, history: &[u32], k: usize) -> Vec<u32> {
        for n in (1..=self.max_n.min(history.len().saturating_sub(1))).rev() {
            let suffix = &history[history.len() - n..];
            // The latest start before the suffix itself.
            let found = (0..history.len() - n)
                .rev()
                .find(|&s| &history[s..s + n] == suffix);
            if let Some(s) = found {
                let from = s + n;
                let to = (from + k).min(history.len());
                if from < to {
                    return history[from..to].to_vec();
                }
            }
        }
        Vec::new()
    }
}

impl Drafter for NgramDrafter {
    async fn draft<E: ExpertExecutor>(
        &mut self,
        ctx: DraftContext<'_, E>,
        k: usize,
    ) -> Result<Vec<u32>> {
        Ok(self.guess(ctx.history, k))
    }
}

/// The model's MTP block: fed the kept positions (their residual streams and the tokens
/// after them) so its own cache follows the sequence, then run on its own output for each
/// further token, those chained rows dropped afterwards.
#[derive(Default)]
pub struct MtpDrafter;

impl Drafter for MtpDrafter {
    async fn draft<E: ExpertExecutor>(
        &mut self,
        ctx: DraftContext<'_, E>,
        k: usize,
    ) -> Result<Vec<u32>> {
        let DraftContext {
            trunk,
            exec,
            cache,
            history,
            kept_hidden,
            timing,
        } = ctx;
        let n_embd = trunk.hyper().n_embd as usize;
        let vocab = trunk.hyper().n_vocab as usize;
        let rows = kept_hidden.len() / n_embd;
        if k == 0 || rows == 0 {
            return Ok(Vec::new());
        }
        let start = cache.len() - rows;
        if cache.mtp_len() != start || history.len() != cache.len() + 1 {
            bail!(
                "the MTP block has {} positions, the sequence {start} before its {rows} new ones",
                cache.mtp_len()
            );
        }
        // Row i: the stream at position start + i and the token after it.
        let next = &history[start + 1..=start + rows];
        let mut out = trunk
            .mtp_forward(cache, kept_hidden, next, exec, timing)
            .await?;
        let kept = cache.mtp_len();
        let mut drafts = Vec::with_capacity(k);
        loop {
            let last = &out.logits[out.logits.len() - vocab..];
            drafts.push(argmax(last));
            if drafts.len() == k {
                break;
            }
            let h = out.hidden[out.hidden.len() - n_embd..].to_vec();
            out = trunk
                .mtp_forward(cache, &h, &drafts[drafts.len() - 1..], exec, timing)
                .await?;
        }
        trunk.mtp_truncate(cache, kept);
        Ok(drafts)
    }
}

/// The drafter a [`SpeculationConfig`] names.
pub enum ModeDrafter {
    /// Prompt lookup.
    Ngram(NgramDrafter),
    /// The MTP block.
    Mtp(MtpDrafter),
}

impl Drafter for ModeDrafter {
    async fn draft<E: ExpertExecutor>(
        &mut self,
        ctx: DraftContext<'_, E>,
        k: usize,
    ) -> Result<Vec<u32>> {
        match self {
            Self::Ngram(d) => d.draft(ctx, k).await,
            Self::Mtp(d) => d.draft(ctx, k).await,
        }
    }
}

/// What a pass's check of its drafts found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// Drafts kept, from the first.
    pub accepted: usize,
    /// The token after them: the first rejected draft's replacement, or one more from the
    /// last row when all were kept.
    pub next: u32,
}

/// Checks `drafts` in order against a pass's `logits` (`[1 + drafts][vocab]`, row i the
/// logits after the history and the first i drafts) with `sampler` ([`Sampler::check_draft`]),
/// `history` being everything before the first draft.
pub fn check_drafts(
    sampler: &mut Sampler,
    logits: &[f32],
    history: &[u32],
    drafts: &[u32],
) -> Checked {
    let vocab = logits.len() / (drafts.len() + 1);
    let row = |i: usize| &logits[i * vocab..(i + 1) * vocab];
    // The history with the drafts kept so far: copied only once a draft is kept.
    let mut seen: Option<Vec<u32>> = None;
    for (i, &d) in drafts.iter().enumerate() {
        match sampler.check_draft(row(i), seen.as_deref().unwrap_or(history), d) {
            Ok(()) => seen.get_or_insert_with(|| history.to_vec()).push(d),
            Err(next) => return Checked { accepted: i, next },
        }
    }
    Checked {
        accepted: drafts.len(),
        next: sampler.sample(row(drafts.len()), seen.as_deref().unwrap_or(history)),
    }
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
        .map_or(0, |(i, _)| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn prompt_lookup_proposes_what_followed_the_latest_match() {
        let d = NgramDrafter::default();
        // "1 2 3" occurred at 0 and 5; the latest is followed by 9 8.
        let h = [1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 1, 2, 3];
        assert_eq!(d.guess(&h, 2), vec![9, 8]);
        assert_eq!(d.guess(&h, 10), vec![9, 8, 7, 1, 2, 3]);
        assert_eq!(d.guess(&[5, 6, 7], 3), Vec::<u32>::new());
        // Falls back to shorter suffixes.
        assert_eq!(d.guess(&[4, 7, 1, 2, 7], 2), vec![1, 2]);
    }

    proptest! {
        #[test]
        fn a_lookup_guess_is_always_a_stretch_of_the_history(
            h in proptest::collection::vec(0u32..4, 0..40), k in 0usize..6,
        ) {
            let g = NgramDrafter::default().guess(&h, k);
            prop_assert!(g.len() <= k);
            prop_assert!(g.is_empty() || h.windows(g.len()).any(|w| w == g.as_slice()));
        }
    }
}
