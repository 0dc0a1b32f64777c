//! `moeswarm sim`: a whole swarm on this machine (router, relay, workers on 127.0.0.1),
//! generating through it, checked bit for bit against a single-process run.

use std::path::PathBuf;

use anyhow::Result;
use moeswarm_engine::speculative::Speculation;
use moeswarm_engine::synth::Preset;
use moeswarm_model::ByteSize;
use moeswarm_node::api::batcher::BatchOptions;
use moeswarm_sim::local::{render, run_local_swarm, start_local_swarm, SimOptions};

use super::model::Wire;
use crate::output;

#[derive(clap::Args)]
pub struct Args {
    /// Workers.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Workers reached only through the relay.
    #[arg(long, default_value_t = 1)]
    relayed: usize,
    /// A GGUF model (default: the qwen35moe trained here, `sim/models/`, or with --arch or
    /// --preset a synthesized random-weight one).
    #[arg(long, conflicts_with_all = ["arch", "preset"])]
    model: Option<PathBuf>,
    /// Architecture of a synthetic model: qwen3moe (the default with --preset) or qwen35moe.
    #[arg(long)]
    arch: Option<String>,
    /// Synthetic model shape (Q4_K experts, Q8_0 where the shape is too narrow): tiny, small
    /// (the default with --arch), qwen3-30b-a3b-4l (qwen3moe) or qwen35-122b-a10b-4l
    /// (qwen35moe).
    #[arg(long)]
    preset: Option<String>,
    /// The prompt.
    #[arg(long, default_value = "The best thing about a good friend is")]
    prompt: String,
    /// Tokens to generate (greedy).
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Stop one worker after this many generated tokens.
    #[arg(long)]
    kill_worker_after: Option<usize>,
    /// Bytes each worker gives to slabs, e.g. 200MiB (default: enough for two worker
    /// replicas of every slab, plus one slab).
    #[arg(long)]
    capacity: Option<ByteSize>,
    /// Where the nodes' stores go (default: a temporary folder, removed afterwards).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Draft tokens and check several a pass: mtp (the model's MTP block, the default where
    /// it has one), ngram (prompt lookup) or off (the default otherwise).
    #[arg(long)]
    speculative: Option<Speculation>,
    /// Tokens drafted a pass (default 3).
    #[arg(long)]
    draft: Option<usize>,
    /// Activations on the wire: f32 (bit-identical), f16 or bf16 (half the bytes, rounded).
    #[arg(long, value_enum, default_value_t = Wire::F32)]
    wire: Wire,
    /// Fraction of a proven worker's answers the router re-computes to check them (new and
    /// once-caught workers are checked more; 0 switches checks off).
    #[arg(long, default_value_t = moeswarm_node::dataplane::CheckPolicy::default().rate)]
    check_rate: f64,
    /// Expert groups of a checked dispatch the router re-computes, a uniform sample (smaller
    /// dispatches are checked whole; 0 checks every group).
    #[arg(long, default_value_t = moeswarm_node::dataplane::CheckPolicy::default().groups)]
    check_groups: u32,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// Instead of a swarm of real nodes here, simulate this many nodes of the market
    /// (a deterministic discrete-event simulation over the market's own code).
    #[arg(long)]
    scale: Option<usize>,
    /// Simulated hours (with --scale).
    #[arg(long, default_value_t = 24.0, requires = "scale")]
    hours: f64,
    /// The seed: one seed, one history (with --scale).
    #[arg(long, default_value_t = 1, requires = "scale")]
    seed: u64,
    /// The scenario, a TOML file (with --scale; default: `sim/scenarios/qwen35-122b.toml`,
    /// Qwen3.5-122B-A10B over servers, desktops, laptops and phones).
    #[arg(long, requires = "scale")]
    scenario: Option<PathBuf>,
    /// Routers serving requests (with --scale): this many, with the scenario's `[serving]`
    /// section or its defaults.
    #[arg(long, requires = "scale")]
    routers: Option<usize>,
    /// Instead of checking, serve the swarm's model through the OpenAI-compatible API (on
    /// --http) until Ctrl-C.
    #[arg(long)]
    serve: bool,
    /// Where --serve serves the API.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: std::net::SocketAddr,
}

pub fn run(a: Args) -> Result<bool> {
    if let Some(n) = a.scale {
        return scale(n, &a);
    }
    let temp = a.work_dir.is_none();
    let dir = a.work_dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("moeswarm-sim-{}", std::process::id()))
    });
    let mut opts = SimOptions::new(dir.clone());
    opts.workers = a.workers;
    opts.relayed = a.relayed;
    if a.model.is_none() && a.arch.is_none() && a.preset.is_none() {
        let trained = moeswarm_sim::trained_model();
        if !trained.exists() {
            anyhow::bail!(
                "the trained model is not at {} (this binary was built from another checkout): \
                 give --model FILE, or --preset small for a random-weight one",
                trained.display()
            );
        }
        opts.model = Some(trained);
    } else {
        opts.model = a.model;
    }
    let arch = a.arch.as_deref().unwrap_or("qwen3moe");
    opts.preset = Preset::named(arch, a.preset.as_deref().unwrap_or("small"))?;
    opts.prompt = a.prompt;
    opts.max_tokens = a.max_tokens;
    opts.kill_worker_after = a.kill_worker_after;
    opts.wire = a.wire.into();
    opts.checks = super::model::check_policy(a.check_rate, a.check_groups)?;
    opts.capacity = a.capacity.map(|c| c.0);
    opts.speculative = a.speculative;
    opts.draft = a.draft;
    if a.serve {
        let r = super::runtime(true)?.block_on(serve(&opts, a.http));
        if temp {
            let _ = std::fs::remove_dir_all(&dir);
        }
        return r.map(|_| true);
    }
    let report = super::runtime(true)?.block_on(run_local_swarm(&opts));
    if temp {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!("could not remove {}: {e}", dir.display());
        }
    }
    let report = report?;
    if a.json {
        output::json(&report)?;
    } else {
        output::emit(&render(&report))?;
    }
    Ok(report.passed())
}

/// Starts the swarm and serves its model through the API until Ctrl-C.
async fn serve(opts: &SimOptions, http: std::net::SocketAddr) -> Result<()> {
    let swarm = start_local_swarm(opts).await?;
    let name = match &opts.model {
        Some(m) => m
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned()),
        None => format!("{}-{}", opts.preset.architecture(), opts.preset.name),
    };
    let (server, workers) = swarm
        .serve(name.clone(), BatchOptions::default(), http)
        .await?;
    output::emit(&format!(
        "serving {name} through {} workers on http://{}/v1\ndashboard on http://{}/\nready\n",
        workers.len(),
        server.addr,
        server.addr
    ))?;
    super::until_stopped().await;
    server.shutdown().await;
    for w in workers {
        w.shutdown().await;
    }
    Ok(())
}

/// `--scale N`: the discrete-event simulation of the market.
fn scale(nodes: usize, a: &Args) -> Result<bool> {
    use anyhow::Context;
    use moeswarm_sim::scale::scenario::Scenario;
    let scenario = match &a.scenario {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the scenario {}", path.display()))?;
            Scenario::parse(&text).with_context(|| format!("in {}", path.display()))?
        }
        None => Scenario::default_scenario(),
    };
    let mut scenario = scenario;
    if let Some(n) = a.routers {
        scenario
            .serving
            .get_or_insert_with(Default::default)
            .routers = n;
    }
    if !(a.hours.is_finite() && a.hours >= 0.0) {
        anyhow::bail!("--hours {} is not a number of hours", a.hours);
    }
    let started = std::time::Instant::now();
    let report = moeswarm_sim::scale::run(&scenario, nodes, a.hours, a.seed);
    tracing::info!("simulated in {:.1} s", started.elapsed().as_secs_f64());
    if a.json {
        output::json(&report)?;
    } else {
        output::emit(&report.render())?;
        output::emit(&format!(
            "wall time {:.1} s\n",
            started.elapsed().as_secs_f64()
        ))?;
    }
    Ok(report.violations.is_empty())
}
