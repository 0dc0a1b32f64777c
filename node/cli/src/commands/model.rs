//! Which model `generate` and `logits` run, and where its experts are computed: the
//! arguments they share, turned into one [`Place`].

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use libp2p::Multiaddr;
use moeswarm_engine::generate::ModelSource;
use moeswarm_node::dataplane::CheckPolicy;
use moeswarm_node::router::{Place, SwarmPlace};
use moeswarm_protocol::{ModelId, WireType};

/// How activations travel between router and workers.
#[derive(Debug, Clone, Copy, Default, clap::ValueEnum)]
pub enum Wire {
    /// 4 bytes a value: bit-identical to a local run.
    #[default]
    F32,
    /// Half precision: half the bytes, rounded.
    F16,
    /// bfloat16: half the bytes, rounded.
    Bf16,
}

impl From<Wire> for WireType {
    fn from(w: Wire) -> Self {
        match w {
            Wire::F32 => WireType::F32,
            Wire::F16 => WireType::F16,
            Wire::Bf16 => WireType::Bf16,
        }
    }
}

/// Which model to run: a GGUF file, or a sliced model in a store, locally or through a swarm.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// A whole GGUF model.
    #[arg(long, conflicts_with_all = ["store", "model_id"])]
    model: Option<PathBuf>,
    /// A store holding a sliced model (with --model-id).
    #[arg(long, requires = "model_id")]
    store: Option<PathBuf>,
    /// The sliced model's id.
    #[arg(long, requires = "store")]
    model_id: Option<ModelId>,
    /// Run with remote experts: join the swarm (with --bootstrap, --store, --model-id); the
    /// store gets the manifest and trunk if it lacks them.
    #[arg(long, requires_all = ["bootstrap", "store", "model_id"])]
    swarm: bool,
    /// A node of the swarm, ending in /p2p/<peer id> (repeatable; with --swarm).
    #[arg(long, requires = "swarm")]
    bootstrap: Vec<Multiaddr>,
    /// Deadline of one dispatch to a worker, in milliseconds (with --swarm).
    #[arg(long, default_value_t = 10_000)]
    dispatch_deadline_ms: u64,
    /// Activations on the wire (with --swarm): f32 (bit-identical to a local run), f16 or bf16
    /// (half the bytes, rounded).
    #[arg(long, value_enum, default_value_t = Wire::F32)]
    wire: Wire,
    /// Fraction of a proven worker's answers the router re-computes to check them (with
    /// --swarm; new and once-caught workers are checked more, 0 switches checks off).
    #[arg(long, default_value_t = CheckPolicy::default().rate)]
    check_rate: f64,
    /// Expert groups of a checked dispatch the router re-computes, a uniform sample (with
    /// --swarm; smaller dispatches are checked whole; 0 checks every group).
    #[arg(long, default_value_t = CheckPolicy::default().groups)]
    check_groups: u32,
    /// Reach workers that registered with a relay only through it: no hole punching for a
    /// direct path (with --swarm).
    #[arg(long)]
    no_hole_punch: bool,
}

impl ModelArgs {
    /// Where the model and its experts are.
    pub fn place(&self) -> Result<Place> {
        match (&self.model, &self.store, self.model_id, self.swarm) {
            (None, Some(dir), Some(model), true) => Ok(Place::Swarm(SwarmPlace {
                checks: check_policy(self.check_rate, self.check_groups)?,
                store_dir: dir.clone(),
                bootstrap: self.bootstrap.clone(),
                model,
                deadline: Duration::from_millis(self.dispatch_deadline_ms),
                wire: self.wire.into(),
                hole_punch: !self.no_hole_punch,
            })),
            (Some(m), None, None, false) => Ok(Place::Local(ModelSource::Gguf(m.clone()))),
            (None, Some(dir), Some(model), false) => Ok(Place::Local(ModelSource::Store {
                dir: dir.clone(),
                model,
            })),
            _ => bail!("give --model FILE, or --store DIR --model-id ID (with --swarm: a swarm)"),
        }
    }
}

/// The check policy for `--check-rate` and `--check-groups`.
pub fn check_policy(rate: f64, groups: u32) -> Result<CheckPolicy> {
    if !(0.0..=1.0).contains(&rate) {
        bail!("--check-rate {rate} is not a fraction in 0..=1");
    }
    Ok(CheckPolicy {
        rate,
        groups,
        ..CheckPolicy::default()
    })
}

/// Puts the chat template in `file` (`--chat-template`), if any, in place of the model's.
pub fn use_chat_template(
    tokenizer: &mut moeswarm_engine::text::TextTokenizer,
    file: Option<&std::path::Path>,
) -> Result<()> {
    if let Some(f) = file {
        let source = std::fs::read_to_string(f)
            .map_err(|e| anyhow::anyhow!("reading the chat template {}: {e}", f.display()))?;
        tokenizer
            .set_chat_template(&source)
            .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
    }
    Ok(())
}
