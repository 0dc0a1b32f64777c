//! One module per command: its `clap::Args` and its `run`, returning whether it passed.

use anyhow::Result;
use clap::Subcommand;

mod bench;
mod coverage;
mod fetch;
mod generate;
mod inspect;
mod lab;
mod logits;
mod model;
mod node;
mod plan;
mod scrub;
mod serve;
mod sim;
mod slice;
mod synth;
mod tokenize;
mod verify;

#[derive(Subcommand)]
pub enum Command {
    /// Print a GGUF's architecture, hyper-parameters and tensors (header only).
    Inspect(inspect::Args),
    /// Write a random-weight qwen3moe or qwen35moe model.
    Synth(synth::Args),
    /// Slice a MoE GGUF into trunk + slabs + manifest in a store.
    Slice(slice::Args),
    /// Plan how a model fits: on one coordinator (--vram, --ram) or on a swarm (--nodes).
    Plan(plan::Args),
    /// Generate text from a prompt, streaming it, then print tokens/s.
    Generate(generate::Args),
    /// Write the logits of every position as raw little-endian f32 [tokens][vocab].
    Logits(logits::Args),
    /// Run a swarm node until Ctrl-C: serve the store's blobs and advertise its slabs; with
    /// --capacity, choose, fetch and serve slabs by itself.
    Node(Box<node::Args>),
    /// Serve an OpenAI-compatible API over a model (local or --swarm), batching requests.
    Serve(serve::Args),
    /// Fetch slabs of a model from a swarm into a store, verified.
    Fetch(fetch::Args),
    /// Print how many replicas every slab of a model has in a swarm, and who holds them.
    Coverage(coverage::Args),
    /// Run a whole swarm on this machine (router, relay, workers on 127.0.0.1), generate through
    /// it, and check the result equals a single-process run bit for bit.
    Sim(sim::Args),
    /// The network lab's benchmark: a swarm of processes in network namespaces (NATs, delay,
    /// loss, bandwidth), a token's cost at each round trip beside the floor, a fetch through
    /// a limited uplink. Needs root.
    Lab(lab::Args),
    /// Check every blob of a store now: hash them, adopt good files the index lost, quarantine
    /// bad ones, list (or collect) blobs no model names.
    Scrub(scrub::Args),
    /// Check the sliced model's MoE layers against the float64 oracle.
    Verify(verify::Args),
    /// Measure prompt-processing and generation speed, the cold first run and peak memory.
    Bench(bench::Args),
    /// Show how the model's tokenizer cuts a text: token ids and their pieces.
    Tokenize(tokenize::Args),
}

impl Command {
    /// Runs the command: `Ok(false)` when it ran but its check failed (exit status 1).
    pub fn run(self) -> Result<bool> {
        match self {
            Command::Inspect(a) => inspect::run(a),
            Command::Synth(a) => synth::run(a),
            Command::Slice(a) => slice::run(a),
            Command::Plan(a) => plan::run(a),
            Command::Generate(a) => generate::run(a),
            Command::Logits(a) => logits::run(a),
            Command::Node(a) => node::run(*a),
            Command::Serve(a) => serve::run(a),
            Command::Fetch(a) => fetch::run(a),
            Command::Coverage(a) => coverage::run(a),
            Command::Sim(a) => sim::run(a),
            Command::Lab(a) => lab::run(a),
            Command::Verify(a) => verify::run(a),
            Command::Scrub(a) => scrub::run(a),
            Command::Bench(a) => bench::run(a),
            Command::Tokenize(a) => tokenize::run(a),
        }
    }
}

/// The swarm to join and the model to work on (`fetch`, `coverage`).
#[derive(clap::Args)]
struct JoinArgs {
    /// A node of the swarm, ending in /p2p/<peer id> (repeatable).
    #[arg(long, required = true)]
    bootstrap: Vec<libp2p::Multiaddr>,
    /// The model id.
    #[arg(long)]
    model: moeswarm_protocol::ModelId,
}

/// Runs `f` to completion on a fresh runtime ([`runtime`]). Without the network the whole run
/// happens on a worker of the kernels' thread pool, so every step's parallel parts start at
/// once on it (see `moeswarm_engine::kernels::on_pool`).
/// Waits until the process is asked to stop: Ctrl-C (SIGINT) or SIGTERM (what `kill`,
/// systemd and docker send), so either way the caller leaves cleanly.
async fn until_stopped() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    r = tokio::signal::ctrl_c() => {
                        if let Err(e) = r {
                            tracing::warn!("cannot wait for Ctrl-C ({e}): stopping");
                        }
                    }
                    _ = term.recv() => tracing::info!("SIGTERM: stopping"),
                }
                return;
            }
            Err(e) => tracing::warn!("cannot wait for SIGTERM ({e}): Ctrl-C only"),
        }
    }
    if let Err(e) = tokio::signal::ctrl_c().await {
        tracing::warn!("cannot wait for Ctrl-C ({e}): stopping");
    }
}

fn block_on<F: std::future::Future + Send>(network: bool, f: F) -> Result<F::Output>
where
    F::Output: Send,
{
    let rt = runtime(network)?;
    Ok(if network {
        rt.block_on(f)
    } else {
        moeswarm_engine::kernels::on_pool(|| rt.block_on(f))
    })
}

/// A runtime for one command: a single thread for local compute, two workers for the network.
fn runtime(network: bool) -> Result<tokio::runtime::Runtime> {
    let mut b = if network {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    Ok(b.enable_all().build()?)
}

/// Opens a store, logging what it dropped or cleaned up.
fn open_store(dir: &std::path::Path) -> Result<moeswarm_model::store::Store> {
    let (store, report) = moeswarm_model::store::Store::open(dir)?;
    for (id, why) in &report.dropped {
        tracing::warn!("store: dropped blob {id}: {why}");
    }
    if report.leftovers_removed > 0 {
        tracing::info!(
            "store: removed {} unindexed leftover files",
            report.leftovers_removed
        );
    }
    Ok(store)
}
