//! A swarm on one machine, as `moeswarm sim` runs it: real nodes on 127.0.0.1 generating text
//! through the swarm, checked against a single-process run of the same model.
//!
//! The router (also the bootstrap node and the data-plane relay) slices the model; N workers
//! join one by one, empty, each with a capacity, and take part in the market: each chooses and
//! fetches its slabs by itself and serves them, until every slab has two worker replicas; the
//! first `relayed` workers are reached only through the relay. The router generates through the
//! workers, then alone; the report says whether the tokens are identical and the logits
//! bit-identical, with speeds, dispatch latencies and bytes moved. A worker can be stopped
//! mid-generation, and workers can be told to misbehave, to show that neither changes the
//! output.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use moeswarm_node::error::{Context, Error, Result};

use moeswarm_engine::executor::{ExpertExecutor, ExpertRequest, LocalExecutor};
use moeswarm_engine::generate::{self, trunk_from_store, GenerateOptions};
use moeswarm_engine::ops::same_bits;
use moeswarm_engine::speculative::{Speculation, SpeculationConfig};
use moeswarm_engine::synth::{synth, Preset, SynthOptions};
use moeswarm_engine::text::SamplingConfig;
use moeswarm_engine::text::TextTokenizer;
use moeswarm_engine::trunk::Trunk;
use moeswarm_model::gguf::GgmlType;
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_node::api::batcher::BatchOptions;
use moeswarm_node::api::Server;
use moeswarm_node::auto::AutoOptions;
#[cfg(feature = "test-faults")]
use moeswarm_node::dataplane::WorkerFault;
use moeswarm_node::dataplane::{CheckPolicy, RemoteExecutor};
use moeswarm_node::router::Experts;
use moeswarm_node::router::{remote_executor, replica_table, RouterUpkeep};
use moeswarm_node::{DataPlaneOptions, NodeOptions, RunningNode};
use moeswarm_protocol::Manifest;
use moeswarm_protocol::WireType;

mod report;
pub use report::{render, SimReport, WorkerSummary};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// A GGUF model; when `None`, `preset` is synthesized (Q4_K experts).
    pub model: Option<PathBuf>,
    /// Synthetic model shape when no model is given.
    pub preset: Preset,
    /// Workers (at least 2).
    pub workers: usize,
    /// How many of them are reached only through the relay (at least 1 when workers > 2).
    pub relayed: usize,
    /// The prompt.
    pub prompt: String,
    /// Tokens to generate (greedy).
    pub max_tokens: usize,
    /// Stop one directly reached worker after this many generated tokens.
    pub kill_worker_after: Option<usize>,
    /// How each worker answers (missing entries: honest).
    #[cfg(feature = "test-faults")]
    pub faults: Vec<WorkerFault>,
    /// How the relay rewrites what it carries.
    #[cfg(feature = "test-faults")]
    pub relay_tamper: moeswarm_relay::Tamper,
    /// Flood the workers' endpoints and the relay with handshakes, one each this often,
    /// from before the router first dials them until the run ends.
    #[cfg(feature = "test-faults")]
    pub handshake_flood: Option<Duration>,
    /// Deadline of one dispatch.
    pub deadline: Duration,
    /// How activations travel (f32 keeps the run bit-identical).
    pub wire: WireType,
    /// How the router checks the workers' answers.
    pub checks: CheckPolicy,
    /// Generate once through each path before measuring, so both have loaded (and candle has
    /// repacked) every expert they touch: speeds then compare warm runs.
    pub warmup: bool,
    /// Whether the router keeps the experts it sliced for its own checks (false: it drops them
    /// once the local run has loaded them, so it checks answers against other replicas, and
    /// settles disputes by fetching the slab back).
    pub router_experts: bool,
    /// Bytes each worker gives to slabs; `None`: enough for every slab to get two worker
    /// replicas, plus one slab of slack.
    pub capacity: Option<u64>,
    /// Where the stores go.
    pub work_dir: PathBuf,
    /// The drafter (`None` with no `draft`: the model's default, its MTP block drafting 3
    /// tokens where it has one, else none); see [`SpeculationConfig::requested`].
    pub speculative: Option<Speculation>,
    /// Tokens drafted a pass (`None`: 3).
    pub draft: Option<usize>,
}

impl SimOptions {
    /// Defaults: 3 workers, one relayed, the small preset, 16 tokens.
    pub fn new(work_dir: PathBuf) -> Self {
        Self {
            model: None,
            preset: Preset::named("qwen3moe", "small").expect("a built-in preset"),
            workers: 3,
            relayed: 1,
            prompt: "The swarm".into(),
            max_tokens: 16,
            kill_worker_after: None,
            #[cfg(feature = "test-faults")]
            faults: Vec::new(),
            #[cfg(feature = "test-faults")]
            relay_tamper: moeswarm_relay::Tamper::None,
            #[cfg(feature = "test-faults")]
            handshake_flood: None,
            deadline: Duration::from_secs(5),
            warmup: false,
            wire: WireType::F32,
            checks: CheckPolicy::default(),
            router_experts: true,
            capacity: None,
            work_dir,
            speculative: None,
            draft: None,
        }
    }
}

/// Stops a worker before the dispatch of a given layer call: deterministic, unlike a timer.
struct KillSwitch<'a> {
    inner: &'a RemoteExecutor,
    calls: AtomicU64,
    at: u64,
    victim: tokio::sync::Mutex<Option<RunningNode>>,
}

impl ExpertExecutor for KillSwitch<'_> {
    async fn compute(&self, req: ExpertRequest<'_>) -> moeswarm_engine::Result<Vec<Vec<f32>>> {
        if self.calls.fetch_add(1, Ordering::Relaxed) == self.at {
            if let Some(v) = self.victim.lock().await.take() {
                v.shutdown().await;
            }
        }
        self.inner.compute(req).await
    }
}

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().expect("an address")
}

/// Each worker's capacity: two worker replicas of every slab spread over `workers`, one slab
/// of slack, and the manifest.
pub fn default_capacity(manifest: &Manifest, workers: usize) -> u64 {
    let slabs: u64 = manifest.all_slabs().map(|(_, _, r)| r.bytes).sum();
    let largest = manifest
        .all_slabs()
        .map(|(_, _, r)| r.bytes)
        .max()
        .unwrap_or(0);
    (2 * slabs).div_ceil(workers.max(1) as u64) + largest + manifest.to_bytes().len() as u64
}

/// A running local swarm: the router's node and model, and the workers.
pub struct LocalSwarm {
    /// The router (also bootstrap and relay).
    pub router: RunningNode,
    /// The workers, and whether each is reached through the relay.
    pub workers: Vec<(RunningNode, bool)>,
    /// The model.
    pub manifest: Manifest,
    /// The router's trunk.
    pub trunk: Trunk,
    /// The model's tokenizer.
    pub tokenizer: TextTokenizer,
    /// Every expert in the router's process, for the local run.
    pub local: LocalExecutor,
    /// The workers' experts, through the router's remote executor.
    pub remote: RemoteExecutor,
    /// Slab bytes the workers fetched.
    pub fetched_bytes: u64,
}

impl LocalSwarm {
    /// Stops every node.
    pub async fn shutdown(self) {
        for (w, _) in self.workers {
            w.shutdown().await;
        }
        self.router.shutdown().await;
    }

    /// Serves the swarm's model through the OpenAI-compatible API on `addr` (named `name`),
    /// batching requests; returns the server and the workers to keep running.
    pub async fn serve(
        self,
        name: String,
        opts: BatchOptions,
        addr: SocketAddr,
    ) -> Result<(Server, Vec<RunningNode>)> {
        let server = Server::start_parts(
            self.trunk,
            self.tokenizer,
            Experts::Swarm(Box::new(self.remote)),
            Some(self.router),
            name,
            opts,
            addr,
        )
        .await?;
        Ok((server, self.workers.into_iter().map(|(w, _)| w).collect()))
    }
}

/// Runs the simulation. See the module docs.
pub async fn run_local_swarm(opts: &SimOptions) -> Result<SimReport> {
    let swarm = start_local_swarm(opts).await?;
    #[cfg(feature = "test-faults")]
    let _flood = match opts.handshake_flood {
        Some(every) => Some(flood(&swarm, every).await?),
        None => None,
    };
    check(opts, swarm).await
}

/// Starts flooding the swarm's workers and relay with handshakes, and lets it run a while.
#[cfg(feature = "test-faults")]
async fn flood(
    swarm: &LocalSwarm,
    every: Duration,
) -> Result<moeswarm_relay::flood::HandshakeFlood> {
    use moeswarm_protocol::dispatch::DISPATCH_ALPN;
    use moeswarm_protocol::relay::RELAY_ALPN;
    let mut targets = Vec::new();
    for (w, relayed) in &swarm.workers {
        if let (Some(ep), false) = (&w.endpoint, relayed) {
            targets.push((ep.local_addr()?, DISPATCH_ALPN.to_vec()));
        }
    }
    if let Some(relay) = &swarm.router.relay {
        targets.push((relay.local_addr()?, RELAY_ALPN.to_vec()));
    }
    let f = moeswarm_relay::flood::HandshakeFlood::start(&targets, every).await?;
    // Long enough for a queue of half-open handshakes to build up before the first dispatch.
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(f)
}

/// The model file to run: the one given, or a synthetic one of the preset (written into the
/// work directory once).
async fn model_file(opts: &SimOptions) -> Result<std::path::PathBuf> {
    Ok(match &opts.model {
        Some(m) => m.clone(),
        None => {
            // Q4_K experts where the shape allows (its blocks are 256 wide), Q8_0 otherwise.
            let preset = opts.preset;
            let fits = |t: GgmlType| {
                preset.n_embd.is_multiple_of(t.block_size())
                    && preset.expert_ff.is_multiple_of(t.block_size())
            };
            let ty = if fits(GgmlType::Q4_K) {
                GgmlType::Q4_K
            } else {
                GgmlType::Q8_0
            };
            let p = opts.work_dir.join(format!(
                "{}-{}-{}.gguf",
                preset.architecture(),
                preset.name,
                ty.name()
            ));
            if !p.exists() {
                let p2 = p.clone();
                tokio::task::spawn_blocking(move || synth(&p2, &preset, SynthOptions::new(ty, 0)))
                    .await
                    .context("synthesizing")??;
            }
            p
        }
    })
}

/// Starts `opts.workers` market nodes joining at `boot`, one by one, each once the previous
/// has settled its slabs; the first `opts.relayed` reach the router through the relay.
async fn start_workers(
    opts: &SimOptions,
    manifest: &moeswarm_protocol::Manifest,
    boot: &libp2p::Multiaddr,
    relay_at: (libp2p::PeerId, std::net::SocketAddr),
) -> Result<Vec<(RunningNode, bool)>> {
    let model = manifest.id();
    let capacity = opts
        .capacity
        .unwrap_or_else(|| default_capacity(manifest, opts.workers));
    let mut workers = Vec::new();
    for i in 0..opts.workers {
        let dir = opts.work_dir.join(format!("worker{i}"));
        let mut o = NodeOptions::local(dir, vec![boot.clone()]);
        o.capacity = capacity;
        o.auto = Some(AutoOptions {
            models: vec![model],
            round: Duration::from_millis(500),
            ..AutoOptions::default()
        });
        o.data_plane = DataPlaneOptions {
            listen: (i >= opts.relayed).then(localhost),
            via_relay: (i < opts.relayed).then_some(relay_at),
            #[cfg(feature = "test-faults")]
            fault: opts.faults.get(i).copied().unwrap_or_default(),
            ..DataPlaneOptions::default()
        };
        let w = RunningNode::start(o).await?;
        let market = w
            .market
            .clone()
            .context("a worker takes part in the market")?;
        let within = settle_time(manifest, opts.workers);
        if !market.settled(within).await {
            return Err(Error::invalid(format!(
                "worker {i} did not settle its slabs within {within:?}: {:?}",
                market.summary()
            )));
        }
        workers.push((w, i < opts.relayed));
    }
    Ok(workers)
}

/// How long a worker may take to settle its slabs: a minute, or a quarter of a second for each
/// slab of its share (two worker replicas of every slab, spread over `workers`) where that is
/// more — the market takes a few slabs a round, so a model of a thousand slabs takes minutes.
fn settle_time(manifest: &moeswarm_protocol::Manifest, workers: usize) -> Duration {
    let slabs = manifest.all_slabs().count() as u64;
    let share = 2 * slabs / workers.max(1) as u64;
    Duration::from_secs(60).max(Duration::from_millis(250 * share))
}

/// Waits up to a minute until `router` sees two worker replicas of every slab; its table.
async fn two_replicas_seen(
    router: &RunningNode,
    manifest: &moeswarm_protocol::Manifest,
) -> Result<moeswarm_node::dataplane::ReplicaTable> {
    let h = &manifest.hyper;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen = router.handle.records_taken();
        let table = replica_table(router, manifest).await?;
        let covered = (0..manifest.slab_layers())
            .all(|l| (0..h.n_expert).all(|e| table.replicas(l, e).len() >= 2));
        if covered {
            return Ok(table);
        }
        if Instant::now() > deadline {
            return Err(Error::invalid(
                "the workers' holdings did not reach the router within 60 s",
            ));
        }
        // Asked again once a new record arrives (by gossip), or after a second (the workers'
        // answers to the gather may be what was missing).
        router
            .handle
            .records_taken_after(seen, Duration::from_secs(1))
            .await;
    }
}

/// Starts the swarm: slices the model into the router's store, starts the router, and the
/// workers one by one until every slab has two worker replicas.
pub async fn start_local_swarm(opts: &SimOptions) -> Result<LocalSwarm> {
    if opts.workers < 2 {
        return Err(Error::invalid(
            "a local swarm needs at least 2 workers (every slab gets 2 replicas)",
        ));
    }
    std::fs::create_dir_all(&opts.work_dir)
        .with_context(|| format!("creating {}", opts.work_dir.display()))?;
    let model_file = model_file(opts).await?;
    // The router slices the model into its store.
    let router_dir = opts.work_dir.join("router");
    let manifest = {
        let (dir, file) = (router_dir.clone(), model_file.clone());
        tokio::task::spawn_blocking(move || -> Result<_> {
            let (store, _) = Store::open(&dir)?;
            let (_, manifest, _) = slice(&file, &store, SliceOptions::default())?;
            store.flush()?;
            Ok(manifest)
        })
        .await
        .context("slicing")??
    };
    let mut ropts = NodeOptions::local(router_dir, Vec::new());
    ropts.data_plane.relay_server = Some(localhost());
    #[cfg(feature = "test-faults")]
    {
        ropts.data_plane.relay_tamper = opts.relay_tamper;
    }
    let mut router = RunningNode::start(ropts).await?;
    let boot = router.addrs().await?[0].clone();
    let relay = router.relay.as_ref().context("the router runs the relay")?;
    let relay_at = (relay.peer_id(), relay.local_addr()?);

    // Workers join one by one, empty, and choose their slabs.
    let workers = start_workers(opts, &manifest, &boot, relay_at).await?;
    let fetched_bytes = workers
        .iter()
        .filter_map(|(w, _)| w.market.as_ref())
        .map(|m| m.summary().fetched_bytes)
        .sum();

    let table = two_replicas_seen(&router, &manifest).await?;

    // The router's own model: trunk, tokenizer, and (for the local run) every expert.
    let (trunk, tokenizer) = trunk_from_store(&router.store, &manifest)?;
    let local = LocalExecutor::from_store(&router.store, &manifest)?;
    if !opts.router_experts {
        // The router keeps the MTP block's slabs: it alone drafts with them.
        let keep: std::collections::HashSet<_> = manifest
            .all_slabs()
            .filter(|(l, _, _)| manifest.mtp_slab_layers().contains(l))
            .map(|(_, _, s)| s.id)
            .collect();
        for (_, _, slab) in manifest.all_slabs() {
            if !keep.contains(&slab.id) {
                router.store.remove(&slab.id)?;
            }
        }
        router.advertise().await?;
    }
    let remote = remote_executor(
        &mut router,
        &manifest,
        table,
        opts.deadline,
        opts.wire,
        &RouterUpkeep::default(),
    )?
    .with_checks(opts.checks)
    // On 127.0.0.1 a punch always gets through: the relayed workers here stand for workers
    // behind NATs no punch opens, so that the relay's path is what runs (the network lab
    // shows punching through real NATs).
    .with_hole_punching(false);
    Ok(LocalSwarm {
        router,
        workers,
        manifest,
        trunk,
        tokenizer,
        local,
        remote,
        fetched_bytes,
    })
}

/// What each worker held and answered (the one stopped mid-run, `killed`, last), and how
/// many handshakes the workers and the relay turned away.
fn worker_summaries(
    router: &RunningNode,
    workers: &[(RunningNode, bool)],
    manifest: &moeswarm_protocol::Manifest,
    killed: Option<(String, usize)>,
) -> Result<(Vec<WorkerSummary>, u64)> {
    let mut summaries: Vec<WorkerSummary> = workers
        .iter()
        .map(|(w, relayed)| {
            Ok(WorkerSummary {
                peer: w.handle.peer_id.to_string(),
                slabs: w.store.held_slabs(manifest)?.len(),
                via_relay: *relayed,
                killed: false,
                answered: w
                    .worker
                    .as_ref()
                    .map_or(0, |s| s.stats.answered.load(Ordering::Relaxed)),
            })
        })
        .collect::<Result<_>>()?;
    if let Some((peer, slabs)) = killed {
        summaries.push(WorkerSummary {
            peer,
            slabs,
            via_relay: false,
            killed: true,
            answered: 0,
        });
    }
    let turned_away = |a: &moeswarm_relay::endpoint::AcceptStats| {
        a.retried.load(Ordering::Relaxed) + a.refused.load(Ordering::Relaxed)
    };
    let handshakes_turned_away = workers
        .iter()
        .filter_map(|(w, _)| w.endpoint.as_ref())
        .map(|ep| turned_away(ep.accept_stats()))
        .chain(router.relay.iter().map(|r| turned_away(r.accept_stats())))
        .sum();
    Ok((summaries, handshakes_turned_away))
}

/// Generates through the swarm and alone, compares, reports, and stops the swarm.
async fn check(opts: &SimOptions, swarm: LocalSwarm) -> Result<SimReport> {
    let LocalSwarm {
        router,
        mut workers,
        manifest,
        trunk,
        tokenizer,
        local,
        remote,
        fetched_bytes,
    } = swarm;
    let model = manifest.id();
    let speculation = SpeculationConfig::requested(opts.speculative, opts.draft, trunk.has_mtp())
        .map_err(Error::invalid)?;
    let gen = GenerateOptions {
        prompt: opts.prompt.clone(),
        max_tokens: opts.max_tokens,
        raw: false,
        speculation,
        // Compared between the swarm and the local run, and digested for the report.
        keep_logits: true,
        sampling: SamplingConfig {
            temperature: 0.0,
            ..SamplingConfig::default()
        },
    };
    if opts.warmup {
        generate::generate(&trunk, &remote, &tokenizer, &gen, |_| {}).await?;
        generate::generate(&trunk, &local, &tokenizer, &gen, |_| {}).await?;
        remote.stats.reset();
    }
    let mut killed = None;
    let victim = match opts.kill_worker_after {
        Some(n) => {
            let k = workers
                .iter()
                .rposition(|(_, relayed)| !relayed)
                .context("no directly reached worker to stop")?;
            let (w, _) = workers.remove(k);
            killed = Some((
                w.handle.peer_id.to_string(),
                w.store.held_slabs(&manifest)?.len(),
            ));
            Some((n, w))
        }
        None => None,
    };
    let n_moe = manifest.slabs.iter().filter(|s| !s.is_empty()).count() as u64;
    let switch = KillSwitch {
        inner: &remote,
        calls: AtomicU64::new(0),
        at: victim
            .as_ref()
            .map_or(u64::MAX, |(n, _)| (1 + *n as u64) * n_moe),
        victim: tokio::sync::Mutex::new(victim.map(|(_, w)| w)),
    };
    let swarm = generate::generate(&trunk, &switch, &tokenizer, &gen, |_| {}).await?;
    if let Some(v) = switch.victim.lock().await.take() {
        v.shutdown().await;
    }
    let solo = generate::generate(&trunk, &local, &tokenizer, &gen, |_| {}).await?;
    let mut all = swarm.prompt_tokens.clone();
    all.extend(&swarm.tokens);
    let swarm_logits = generate::logits(&trunk, &remote, &all).await?;
    let local_logits = generate::logits(&trunk, &local, &all).await?;
    // The whole sequence run again, and the rows each token was chosen from as it was made.
    let bit_identical =
        same_bits(&swarm_logits, &local_logits) && same_bits(&swarm.logits, &solo.logits);
    let emitted: Vec<u8> = swarm.logits.iter().flat_map(|v| v.to_le_bytes()).collect();

    let max_abs_logit_diff = swarm_logits
        .iter()
        .zip(&local_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let (summaries, handshakes_turned_away) =
        worker_summaries(&router, &workers, &manifest, killed)?;
    let report = SimReport {
        model: model.to_string(),
        handshakes_turned_away,
        tokens_identical: swarm.tokens == solo.tokens,
        logits_bit_identical: bit_identical,
        max_abs_logit_diff,
        max_abs_logit: local_logits.iter().fold(0.0f32, |m, v| m.max(v.abs())),
        wire: opts.wire,
        tokens: swarm.tokens.clone(),
        text: swarm.text.clone(),
        swarm_decode_tokens_per_s: swarm.decode_tokens_per_s,
        local_decode_tokens_per_s: solo.decode_tokens_per_s,
        swarm_prefill_tokens_per_s: swarm.prefill_tokens_per_s,
        local_prefill_tokens_per_s: solo.prefill_tokens_per_s,
        fetched_bytes,
        dispatch: remote.summary(),
        workers: summaries,
        speculation: speculation.mode,
        speculation_stats: swarm.speculation,
        emitted_logits_digest: moeswarm_protocol::BlobId::of(&emitted).to_string(),
    };
    for (w, _) in workers {
        w.shutdown().await;
    }
    router.shutdown().await;
    Ok(report)
}
