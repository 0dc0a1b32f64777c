//! `moeswarm verify`: the sliced model's MoE layers against the float64 oracle.

use std::path::PathBuf;

use anyhow::Result;
use moeswarm_engine::verify::{verify, VerifyOptions};

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// The original GGUF file.
    file: PathBuf,
    /// Store directory it was sliced into.
    #[arg(long)]
    store: PathBuf,
    /// Only this layer (default: every MoE layer).
    #[arg(long)]
    layer: Option<u32>,
    /// Random input rows.
    #[arg(long, default_value_t = 16)]
    tokens: usize,
    /// Seed of the input rows.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<bool> {
    let store = super::open_store(&a.store)?;
    let opts = VerifyOptions {
        layer: a.layer,
        tokens: a.tokens,
        seed: a.seed,
    };
    let report = verify(&a.file, &store, &opts)?;
    if a.json {
        output::json(&report)?;
        return Ok(report.passed);
    }
    output::line(&format!("model {}", report.model_id))?;
    for l in &report.layers {
        let ties = if l.topk_near_ties.is_empty() {
            String::new()
        } else {
            format!(", {} near ties skipped", l.topk_near_ties.len())
        };
        output::line(&format!(
            "layer {:>3} [{}]  slabs-f64 vs monolithic-f64: max|d| {:.3e} rel {:.3e}   candle-f32 vs f64: max|d| {:.3e} cosine {:.8} (exact math: cosine {:.6}; {} tokens{ties})  {}",
            l.layer, l.expert_types.join("/"), l.regroup.max_abs, l.regroup.max_rel,
            l.candle.max_abs, l.candle.cosine, l.candle_vs_exact.cosine, l.tokens_compared,
            if l.passed { "ok" } else { "FAILED" }
        ))?;
    }
    output::line(if report.passed {
        "verified"
    } else {
        "verification FAILED"
    })?;
    Ok(report.passed)
}
