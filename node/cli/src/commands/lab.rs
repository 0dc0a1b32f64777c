//! `moeswarm lab`: the network lab's benchmark. Builds a scenario's hosts from network
//! namespaces (NATs, links with delay, jitter, loss and bandwidth), runs a swarm of `moeswarm`
//! processes in them, and measures what a token costs at each round trip beside the floor, and
//! a slab fetch through a limited uplink (`docs/lab.md`). Needs root, `ip`, `nft` and TUN.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use moeswarm_sim::lab::bench::{run_bench, BenchOptions, LabReport};
use moeswarm_sim::lab::topology::Scenario;

use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// The scenario: hosts (one named `hub` runs the seeder, the relay and the router; the
    /// others run workers), their NATs and links (`sim/scenarios/home.toml`).
    #[arg(long)]
    scenario: PathBuf,
    /// The model (default: the qwen35moe trained here, `sim/models/`).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Round trips router ↔ worker to measure at, in milliseconds (every link's one-way
    /// delay becomes a quarter of it).
    #[arg(long, value_delimiter = ',', default_value = "0,2,10,30")]
    rtt_ms: Vec<f64>,
    /// Tokens a measured request generates.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// The hub's uplink while a fresh store fetches the model, in MB/s (0: no fetch).
    #[arg(long, default_value_t = 10.0)]
    fetch_mb_s: f64,
    /// The model fetched through that uplink (default: --model).
    #[arg(long)]
    fetch_model: Option<PathBuf>,
    /// Loss and jitter draw from it.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<bool> {
    if let Some(why) = moeswarm_sim::lab::skip_reason() {
        bail!("{why}");
    }
    let text = std::fs::read_to_string(&a.scenario)
        .with_context(|| format!("reading {}", a.scenario.display()))?;
    let scenario = Scenario::parse(&text).with_context(|| a.scenario.display().to_string())?;
    let model = a.model.unwrap_or_else(moeswarm_sim::trained_model);
    if a.tokens < 2 {
        bail!("--tokens must be at least 2 (the decode time is taken after the first token)");
    }
    if a.rtt_ms.iter().any(|r| !(0.0..=10_000.0).contains(r)) {
        bail!("--rtt-ms values must lie in 0..=10000");
    }
    let work = tempfile::tempdir().context("a work directory")?;
    let opts = BenchOptions {
        bin: std::env::current_exe().context("this binary's path")?,
        scenario,
        model,
        work_dir: work.path().to_path_buf(),
        rtts_ms: a.rtt_ms,
        tokens: a.tokens,
        fetch_rate: (a.fetch_mb_s * 1e6) as u64,
        fetch_model: a.fetch_model,
        seed: a.seed,
    };
    // Ctrl-C or SIGTERM: the processes in the namespaces get the signal too (one process
    // group), and this process deletes its namespaces before it goes (the next run would
    // sweep them otherwise).
    let bench = std::thread::spawn(move || run_bench(&opts));
    let stopped = super::runtime(false)?.block_on(async {
        let wait = tokio::task::spawn_blocking(move || bench.join());
        tokio::select! {
            r = wait => Some(r),
            _ = super::until_stopped() => None,
        }
    });
    let Some(Ok(Ok(report))) = stopped else {
        moeswarm_sim::lab::netns::remove_mine();
        match stopped {
            None => bail!("stopped: the lab's namespaces are removed"),
            _ => bail!("the lab's benchmark panicked"),
        }
    };
    let report = report?;
    if a.json {
        output::json(&report)?;
    } else {
        print(&report)?;
    }
    Ok(true)
}

fn print(r: &LabReport) -> Result<()> {
    output::line(&format!(
        "{} MoE layers; local decode {:.1} ms a token{}",
        r.moe_layers,
        r.local_ms_per_token,
        r.local_speculative_ms_per_token
            .map(|s| format!(" ({s:.1} ms with MTP drafts)"))
            .unwrap_or_default()
    ))?;
    output::line("rtt ms   floor ms/token   swarm ms/token   × floor   with MTP   × floor")?;
    for x in &r.rtts {
        let spec = |v: Option<f64>, w: usize, p: usize| {
            v.map_or("-".to_string(), |v| format!("{v:>w$.p$}"))
        };
        output::line(&format!(
            "{:>6.1}   {:>14.1}   {:>14.1}   {:>7.2}   {:>8}   {:>7}",
            x.rtt_ms,
            x.floor_ms_per_token,
            x.ms_per_token,
            x.over_floor,
            spec(x.speculative_ms_per_token, 8, 1),
            spec(x.speculative_over_floor, 7, 2),
        ))?;
    }
    if let Some(f) = &r.fetch {
        output::line(&format!(
            "fetch: {} bytes in {:.2} s through a {:.1} MB/s uplink: {:.2} of it",
            f.bytes,
            f.seconds,
            f.uplink_bytes_per_s as f64 / 1e6,
            f.of_uplink
        ))?;
    }
    Ok(())
}
