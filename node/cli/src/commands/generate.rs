//! `moeswarm generate`: text from a prompt, streamed, then tokens/s (locally or via a swarm).

use anyhow::Result;
use moeswarm_engine::generate::{generate, GenerateOptions};
use moeswarm_engine::speculative::{Speculation, SpeculationConfig};
use moeswarm_engine::text::SamplingConfig;
use moeswarm_node::router::{OpenModel, Place};

use super::model::ModelArgs;
use crate::output;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Use the prompt as is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// A Jinja chat template to use instead of the model's own.
    #[arg(long, conflicts_with = "raw")]
    chat_template: Option<std::path::PathBuf>,
    /// Draft tokens and check several a pass: mtp (the model's MTP block, the default where
    /// it has one), ngram (prompt lookup) or off (the default otherwise).
    #[arg(long)]
    speculative: Option<Speculation>,
    /// Tokens drafted a pass (default 3).
    #[arg(long)]
    draft: Option<usize>,
    /// Print a JSON report instead of the text.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<bool> {
    let mut opts = GenerateOptions {
        prompt: a.prompt,
        max_tokens: a.max_tokens,
        raw: a.raw,
        sampling: SamplingConfig {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            repetition_penalty: a.repeat_penalty,
            seed: a.seed,
        },
        speculation: SpeculationConfig::OFF,
        keep_logits: false,
    };
    opts.sampling.validate().map_err(anyhow::Error::msg)?;
    let place = a.model.place()?;
    let json = a.json;
    let template = a.chat_template.clone();
    let (report, dispatch) = super::block_on(matches!(place, Place::Swarm(_)), async {
        let mut m = OpenModel::open(&place).await?;
        super::model::use_chat_template(&mut m.tokenizer, template.as_deref())?;
        opts.speculation = SpeculationConfig::requested(a.speculative, a.draft, m.trunk.has_mtp())
            .map_err(anyhow::Error::msg)?;
        let mut shown = Ok(());
        let r = generate(&m.trunk, &m.experts, &m.tokenizer, &opts, |piece| {
            if !json && shown.is_ok() {
                shown = output::emit(piece);
            }
        })
        .await;
        let dispatch = m.dispatch_summary();
        m.close().await;
        shown?;
        anyhow::Ok((r?, dispatch))
    })??;
    if json {
        let mut v = serde_json::to_value(&report)?;
        if let Some(d) = dispatch {
            v["dispatch"] = serde_json::to_value(d)?;
        }
        output::json(&v)?;
        return Ok(true);
    }
    output::line("")?;
    if let Some(d) = dispatch {
        eprintln!("dispatch: {}", serde_json::to_string(&d)?);
    }
    let t = &report.timing;
    eprintln!(
        "prefill {} tokens at {:.1} tokens/s; decode {} tokens at {:.1} tokens/s (stop: {}); attention {:.0} ms, gating {:.0} ms, experts {:.0} ms",
        report.prompt_tokens.len(), report.prefill_tokens_per_s, report.tokens.len(),
        report.decode_tokens_per_s, report.stop, t.attention.as_secs_f64() * 1e3,
        t.gating.as_secs_f64() * 1e3, t.experts.as_secs_f64() * 1e3
    );
    let sp = &report.speculation;
    if sp.drafted > 0 || opts.speculation.mode != Speculation::Off {
        let emitted = report.tokens.len().max(1) as f64;
        eprintln!(
            "speculation {:?} (draft {}): {} passes, {:.2} tokens a pass; {} drafted, {} kept; {} expert round trips, {:.2} a token",
            opts.speculation.mode, opts.speculation.draft, sp.passes,
            report.tokens.len().saturating_sub(1) as f64 / sp.passes.max(1) as f64,
            sp.drafted, sp.accepted, sp.expert_rounds, sp.expert_rounds as f64 / emitted
        );
    }
    Ok(true)
}
