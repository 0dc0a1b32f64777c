//! Running a model in this process: load it (a GGUF, or a sliced model from the store),
//! compute logits, generate text.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::error::{bail, Result};
use moeswarm_protocol::{Manifest, ModelId};
use serde::Serialize;

use crate::executor::{ExpertExecutor, LocalExecutor};
use crate::speculative::{check_drafts, Checked, DraftContext, Drafter, SpeculationConfig};
use crate::text::{Sampler, SamplingConfig, TextTokenizer};
use crate::trunk::{ForwardTiming, KvCache, Trunk};
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::hyper_params;
use moeswarm_model::store::Store;

/// Where a model comes from.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A whole GGUF file.
    Gguf(PathBuf),
    /// A sliced model in a store.
    Store {
        /// The store directory.
        dir: PathBuf,
        /// The model.
        model: ModelId,
    },
}

/// A model loaded whole into this process.
pub struct LocalModel {
    /// The trunk.
    pub trunk: Trunk,
    /// All experts, in memory.
    pub experts: LocalExecutor,
    /// The tokenizer from the model's metadata.
    pub tokenizer: TextTokenizer,
}

impl LocalModel {
    /// Loads the model from `source`.
    pub fn load(source: &ModelSource) -> Result<Self> {
        match source {
            ModelSource::Gguf(path) => {
                let g = MappedGguf::open_resident(path)?;
                let hyper = hyper_params(&g.header)?;
                Ok(Self {
                    trunk: Trunk::from_gguf(&g, &hyper)?,
                    experts: LocalExecutor::from_gguf(&g)?,
                    tokenizer: TextTokenizer::from_gguf(&g.header)?,
                })
            }
            ModelSource::Store { dir, model } => {
                let (store, report) = Store::open_existing(dir)?;
                for (id, why) in &report.dropped {
                    tracing::warn!("store: dropped blob {id}: {why}");
                }
                let manifest = store.manifest(model)?;
                let (trunk, tokenizer) = trunk_from_store(&store, &manifest)?;
                Ok(Self {
                    trunk,
                    experts: LocalExecutor::from_store(&store, &manifest)?,
                    tokenizer,
                })
            }
        }
    }
}

/// The trunk and the tokenizer of `manifest`'s model, from the trunk blob in `store`.
pub fn trunk_from_store(store: &Store, manifest: &Manifest) -> Result<(Trunk, TextTokenizer)> {
    let file = MappedGguf::open_resident(&store.blob_path(&manifest.trunk.id))?;
    let trunk = Trunk::from_gguf(&file, &manifest.hyper)?;
    let want: Vec<_> = (0..manifest.hyper.n_layer)
        .map(|l| manifest.layer_kind(l))
        .collect();
    if trunk.layer_kinds() != want {
        bail!(
            "the manifest's layer kinds {want:?} are not the trunk's {:?}",
            trunk.layer_kinds()
        );
    }
    Ok((trunk, TextTokenizer::from_gguf(&file.header)?))
}

/// Logits of every position of `tokens` (one prefill batch), `[tokens][n_vocab]`.
pub async fn logits(trunk: &Trunk, exec: &impl ExpertExecutor, tokens: &[u32]) -> Result<Vec<f32>> {
    if tokens.is_empty() {
        bail!("no tokens given");
    }
    let mut cache = trunk.new_cache();
    trunk
        .forward(&mut cache, tokens, exec, &mut ForwardTiming::default())
        .await
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// The user's text.
    pub prompt: String,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingConfig,
    /// Use the prompt as is, without the chat template.
    pub raw: bool,
    /// Drafting several tokens a pass ([`SpeculationConfig::OFF`]: one a pass).
    pub speculation: SpeculationConfig,
    /// Keep the logits each emitted token was chosen from ([`GenerateReport::logits`]).
    pub keep_logits: bool,
}

/// What a generation did.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateReport {
    /// Prompt token ids.
    pub prompt_tokens: Vec<u32>,
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Generated text.
    pub text: String,
    /// Prompt tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Generated tokens per second (after the first).
    pub decode_tokens_per_s: f64,
    /// Where the time went.
    pub timing: ForwardTiming,
    /// Why it stopped: `eos`, `max_tokens` or `context`.
    pub stop: &'static str,
    /// Forward passes after the prompt's, drafted tokens they checked, and those kept.
    pub speculation: SpeculationStats,
    /// With [`GenerateOptions::keep_logits`]: the logits each generated token was chosen
    /// from, `[tokens][n_vocab]` (with drafts, the rows of the pass that checked them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logits: Vec<f32>,
}

/// What speculation did in a generation.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct SpeculationStats {
    /// Forward passes after the prompt's.
    pub passes: usize,
    /// Drafted tokens checked.
    pub drafted: usize,
    /// Drafted tokens kept.
    pub accepted: usize,
    /// Expert requests of the model's layers after the prompt's (one a layer a pass): the
    /// sequential round trips a swarm makes. The MTP block's are not counted: a router keeps
    /// its slabs and computes them itself.
    pub expert_rounds: u64,
}

/// Generates text, calling `on_text` with each new piece as soon as it is whole UTF-8; drafts
/// with the drafter `opts.speculation` names.
pub async fn generate(
    trunk: &Trunk,
    exec: &impl ExpertExecutor,
    tokenizer: &TextTokenizer,
    opts: &GenerateOptions,
    on_text: impl FnMut(&str),
) -> Result<GenerateReport> {
    let mut drafter = opts.speculation.drafter();
    let k = opts.speculation.draft;
    generate_drafted(trunk, exec, tokenizer, opts, drafter.as_mut(), k, on_text).await
}

/// [`generate`] with `drafter` guessing up to `k` tokens a pass (`None`: one token a pass);
/// `opts.speculation` is not read.
pub async fn generate_drafted<D: Drafter>(
    trunk: &Trunk,
    exec: &impl ExpertExecutor,
    tokenizer: &TextTokenizer,
    opts: &GenerateOptions,
    drafter: Option<&mut D>,
    k: usize,
    on_text: impl FnMut(&str),
) -> Result<GenerateReport> {
    let text = if opts.raw {
        opts.prompt.clone()
    } else {
        tokenizer.prompt(&opts.prompt)?
    };
    let prompt = tokenizer.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let mut cache = trunk.new_cache();
    let mut timing = ForwardTiming::default();
    let vocab = trunk.hyper().n_vocab as usize;

    let t0 = Instant::now();
    let (logits, hidden) = trunk
        .forward_batch_hidden(&mut [(&mut cache, &prompt[..])], exec, &mut timing)
        .await?;
    let prefill_s = t0.elapsed().as_secs_f64();
    // Each expert request is one round trip through a swarm: counted from here on.
    let counted = Counted {
        inner: exec,
        below: trunk.hyper().n_layer,
        calls: AtomicU64::new(0),
    };
    let mut d = Decoder {
        trunk,
        exec: &counted,
        cache: &mut cache,
        sampler: Sampler::new(opts.sampling.clone()),
        history: prompt.clone(),
        timing: &mut timing,
        stats: SpeculationStats::default(),
        logits: opts.keep_logits.then(Vec::new),
    };
    let last = &logits[0][logits[0].len() - vocab..];
    if let Some(kept) = &mut d.logits {
        kept.extend_from_slice(last);
    }
    let next = d.sampler.sample(last, &d.history);
    let mut out = Output::new(tokenizer, opts.max_tokens, on_text);
    let t1 = Instant::now();
    d.run(&mut out, next, hidden.of(0).to_vec(), drafter, k)
        .await?;
    let decode_s = t1.elapsed().as_secs_f64();
    let mut stats = d.stats;
    let mut kept_logits = d.logits.unwrap_or_default();
    stats.expert_rounds = counted.calls.load(Ordering::Relaxed);
    let (tokens, text, stop) = out.finish()?;
    kept_logits.truncate(tokens.len() * vocab);
    Ok(GenerateReport {
        prefill_tokens_per_s: prompt.len() as f64 / prefill_s,
        decode_tokens_per_s: if tokens.len() > 1 {
            (tokens.len() - 1) as f64 / decode_s
        } else {
            0.0
        },
        prompt_tokens: prompt,
        tokens,
        text,
        timing,
        stop,
        speculation: stats,
        logits: kept_logits,
    })
}

/// An executor that counts the requests it passes on for layers below `below`.
struct Counted<'a, E> {
    inner: &'a E,
    below: u32,
    calls: AtomicU64,
}

impl<E: ExpertExecutor> ExpertExecutor for Counted<'_, E> {
    fn compute(
        &self,
        req: crate::executor::ExpertRequest<'_>,
    ) -> impl std::future::Future<Output = Result<Vec<Vec<f32>>>> + Send {
        if req.layer < self.below {
            self.calls.fetch_add(1, Ordering::Relaxed);
        }
        self.inner.compute(req)
    }
}

/// The generated tokens and their text, shown as it becomes whole UTF-8, and why it stopped.
struct Output<'a, F> {
    tokenizer: &'a TextTokenizer,
    tokens: Vec<u32>,
    shown: usize,
    max: usize,
    on_text: F,
    stop: &'static str,
}

impl<'a, F: FnMut(&str)> Output<'a, F> {
    fn new(tokenizer: &'a TextTokenizer, max: usize, on_text: F) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            shown: 0,
            max,
            on_text,
            stop: "max_tokens",
        }
    }

    /// Room for this many more tokens.
    fn room(&self) -> usize {
        self.max - self.tokens.len()
    }

    /// Takes `t`; whether generation goes on after it.
    fn push(&mut self, t: u32) -> Result<bool> {
        if self.tokens.len() >= self.max {
            return Ok(false);
        }
        if self.tokenizer.is_stop(t) {
            self.stop = "eos";
            return Ok(false);
        }
        self.tokens.push(t);
        let decoded = self.tokenizer.decode(&self.tokens)?;
        if !decoded.ends_with('\u{FFFD}')
            && decoded.len() > self.shown
            && decoded.is_char_boundary(self.shown)
        {
            (self.on_text)(&decoded[self.shown..]);
            self.shown = decoded.len();
        }
        Ok(self.tokens.len() < self.max)
    }

    fn finish(mut self) -> Result<(Vec<u32>, String, &'static str)> {
        let text = self.tokenizer.decode(&self.tokens)?;
        if text.len() > self.shown {
            (self.on_text)(&text[self.shown.min(text.len())..]);
        }
        Ok((self.tokens, text, self.stop))
    }
}

/// One sequence's decoding after its prompt: a pass over the model's next token and the
/// drafted ones, the drafts checked in order, the cache rolled back past the first
/// rejected one.
struct Decoder<'a, E> {
    trunk: &'a Trunk,
    exec: &'a E,
    cache: &'a mut KvCache,
    sampler: Sampler,
    history: Vec<u32>,
    timing: &'a mut ForwardTiming,
    stats: SpeculationStats,
    /// The logits of every kept position, when asked for.
    logits: Option<Vec<f32>>,
}

impl<E: ExpertExecutor> Decoder<'_, E> {
    async fn run<F: FnMut(&str), D: Drafter>(
        &mut self,
        out: &mut Output<'_, F>,
        mut next: u32,
        mut kept_hidden: Vec<f32>,
        mut drafter: Option<&mut D>,
        k: usize,
    ) -> Result<()> {
        let ctx = self.trunk.hyper().context_length as usize;
        let n_embd = self.trunk.hyper().n_embd as usize;
        loop {
            if !out.push(next)? {
                return Ok(());
            }
            self.history.push(next);
            let base = self.cache.len();
            if base >= ctx {
                out.stop = "context";
                return Ok(());
            }
            let room = k.min(out.room()).min(ctx - base - 1);
            let drafts = match drafter.as_deref_mut() {
                Some(d) if room > 0 => {
                    let c = DraftContext {
                        trunk: self.trunk,
                        exec: self.exec,
                        cache: self.cache,
                        history: &self.history,
                        kept_hidden: &kept_hidden,
                        timing: self.timing,
                    };
                    d.draft(c, room).await?
                }
                _ => Vec::new(),
            };
            if !drafts.is_empty() {
                self.trunk.checkpoint(self.cache);
            }
            let mut rows = vec![next];
            rows.extend_from_slice(&drafts);
            let (logits, hidden) = self
                .trunk
                .forward_batch_hidden(&mut [(&mut *self.cache, &rows[..])], self.exec, self.timing)
                .await?;
            let (logits, hidden) = (&logits[0], hidden.of(0));
            let Checked {
                accepted,
                next: bonus,
            } = check_drafts(&mut self.sampler, logits, &self.history, &drafts);
            self.history.extend_from_slice(&drafts[..accepted]);
            if !drafts.is_empty() {
                self.trunk.rollback(self.cache, base + 1 + accepted)?;
            }
            self.stats.passes += 1;
            self.stats.drafted += drafts.len();
            self.stats.accepted += accepted;
            kept_hidden = hidden[..(1 + accepted) * n_embd].to_vec();
            if let Some(kept) = &mut self.logits {
                kept.extend_from_slice(&logits[..(1 + accepted) * logits.len() / rows.len()]);
            }
            for &d in &drafts[..accepted] {
                if !out.push(d)? {
                    return Ok(());
                }
            }
            next = bonus;
        }
    }
}
