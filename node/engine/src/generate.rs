//! Running a model in this process: load it (a GGUF, or a sliced model from the store),
//! compute logits, generate text.

use std::path::PathBuf;
use std::time::Instant;

use crate::error::{bail, Result};
use moeswarm_protocol::{Manifest, ModelId};
use serde::Serialize;

use crate::executor::{ExpertExecutor, LocalExecutor};
use crate::text::{Sampler, SamplingConfig, TextTokenizer};
use crate::trunk::{ForwardTiming, Trunk};
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
}

/// Generates text, calling `on_text` with each new piece as soon as it is whole UTF-8.
pub async fn generate(
    trunk: &Trunk,
    exec: &impl ExpertExecutor,
    tokenizer: &TextTokenizer,
    opts: &GenerateOptions,
    mut on_text: impl FnMut(&str),
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
    let ctx = trunk.hyper().context_length as usize;
    let mut cache = trunk.new_cache();
    let mut timing = ForwardTiming::default();
    let mut sampler = Sampler::new(opts.sampling.clone());
    let mut history = prompt.clone();
    let vocab = trunk.hyper().n_vocab as usize;

    let t0 = Instant::now();
    let logits = trunk
        .forward(&mut cache, &prompt, exec, &mut timing)
        .await?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut next = sampler.sample(&logits[logits.len() - vocab..], &history);

    let mut out = Vec::new();
    let mut shown = 0usize;
    let mut stop = "max_tokens";
    let t1 = Instant::now();
    while out.len() < opts.max_tokens {
        if tokenizer.is_stop(next) {
            stop = "eos";
            break;
        }
        out.push(next);
        history.push(next);
        let decoded = tokenizer.decode(&out)?;
        if !decoded.ends_with('\u{FFFD}')
            && decoded.len() > shown
            && decoded.is_char_boundary(shown)
        {
            on_text(&decoded[shown..]);
            shown = decoded.len();
        }
        if out.len() == opts.max_tokens {
            break;
        }
        if cache.len() >= ctx {
            stop = "context";
            break;
        }
        let logits = trunk
            .forward(&mut cache, &[next], exec, &mut timing)
            .await?;
        next = sampler.sample(&logits, &history);
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let text = tokenizer.decode(&out)?;
    if text.len() > shown {
        on_text(&text[shown.min(text.len())..]);
    }
    Ok(GenerateReport {
        prefill_tokens_per_s: prompt.len() as f64 / prefill_s,
        decode_tokens_per_s: if out.len() > 1 {
            (out.len() - 1) as f64 / decode_s
        } else {
            0.0
        },
        prompt_tokens: prompt,
        tokens: out,
        text,
        timing,
        stop,
    })
}
