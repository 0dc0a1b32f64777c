//! The `moeswarm` command.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use moeswarm_node::gguf::{GgmlType, Gguf};
use moeswarm_node::model::synth::{synth, Preset};
use moeswarm_node::run::{self, GenerateOptions, LocalModel, ModelSource};
use moeswarm_node::slice::{slice, SliceOptions};
use moeswarm_node::store::Store;
use moeswarm_node::text::SamplingConfig;
use moeswarm_node::verify::{verify, VerifyOptions};
use moeswarm_node::{inspect, localswarm, net, plan, router};

#[derive(Parser)]
#[command(
    name = "moeswarm",
    version,
    about = "Run one large Mixture-of-Experts model across a swarm of small devices"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a GGUF's architecture, hyper-parameters and tensors (header only).
    Inspect {
        /// The GGUF file.
        file: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Write a random-weight qwen3moe model.
    Synth {
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// Model shape: tiny, small or qwen3-30b-a3b-4l.
        #[arg(long, default_value = "tiny")]
        preset: String,
        /// Type of the routed experts: f32, f16, bf16, q8_0, q4_k, q5_k, q6_k.
        #[arg(long, default_value = "f32")]
        expert_type: String,
        /// Seed of the weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Slice a MoE GGUF into trunk + slabs + manifest in a store.
    Slice {
        /// The GGUF file.
        file: PathBuf,
        /// Store directory.
        #[arg(long)]
        store: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Plan how a model fits: on one coordinator (--vram, --ram) or on a swarm (--nodes).
    Plan {
        /// The GGUF file (only its header is read).
        file: PathBuf,
        /// GPU memory of the coordinator, e.g. 24GiB.
        #[arg(long, requires = "ram", conflicts_with = "nodes")]
        vram: Option<String>,
        /// System memory of the coordinator for experts, e.g. 64GiB.
        #[arg(long, requires = "vram")]
        ram: Option<String>,
        /// Context length the KV cache is sized for.
        #[arg(long, default_value_t = 32768)]
        ctx: u64,
        /// Devices of a swarm: a TOML file of [[node]] name, ram, phone.
        #[arg(long)]
        nodes: Option<PathBuf>,
        /// Replicas of every slab in a swarm.
        #[arg(long, default_value_t = 2)]
        replicas: u32,
        /// Routing statistics: JSON array [layer][expert] of expected load (default uniform).
        #[arg(long, requires = "nodes")]
        stats: Option<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Generate text from a prompt, streaming it, then print tokens/s.
    Generate {
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
        /// Print a JSON report instead of the text.
        #[arg(long)]
        json: bool,
    },
    /// Write the logits of every position as raw little-endian f32 [tokens][vocab].
    Logits {
        #[command(flatten)]
        model: ModelArgs,
        /// Token ids, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        tokens: Vec<u32>,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
    },
    /// Run a swarm node until Ctrl-C: serve the store's blobs and advertise its slabs.
    Node {
        /// Data dir: the store and the node's key.
        #[arg(long, env = "MOESWARM_STORE")]
        store: Option<PathBuf>,
        /// libp2p listen address (repeatable; default: all interfaces, TCP and QUIC, free ports).
        #[arg(long, env = "MOESWARM_LISTEN", value_delimiter = ',')]
        listen: Vec<String>,
        /// Address of a node to join through, ending in /p2p/<peer id> (repeatable; none: start
        /// a new swarm).
        #[arg(long, env = "MOESWARM_BOOTSTRAP", value_delimiter = ',')]
        bootstrap: Vec<String>,
        /// Serve blobs over HTTP on this address, e.g. 127.0.0.1:8080.
        #[arg(long, env = "MOESWARM_HTTP")]
        http: Option<std::net::SocketAddr>,
        /// Also be a relay for nodes that cannot accept connections: a libp2p relay server, and
        /// a data-plane relay (on --relay-listen).
        #[arg(long)]
        relay: bool,
        /// Lifetime of the signed holdings records, in seconds.
        #[arg(long, env = "MOESWARM_RECORD_TTL_SECS")]
        record_ttl_secs: Option<u64>,
        /// Bytes of blobs this node will hold, e.g. 64GiB (advertised as free capacity).
        #[arg(long, env = "MOESWARM_CAPACITY")]
        capacity: Option<String>,
        /// Serve dispatches for the held slabs on this UDP address (QUIC), e.g. 203.0.113.8:4433;
        /// it is advertised as is.
        #[arg(long, env = "MOESWARM_DISPATCH")]
        dispatch: Option<std::net::SocketAddr>,
        /// Serve dispatches through a relay instead (for nodes that cannot accept
        /// connections): PEERID@IP:PORT of the relay's data plane.
        #[arg(long, env = "MOESWARM_VIA_RELAY")]
        via_relay: Option<String>,
        /// With --relay: the UDP address of the data-plane relay.
        #[arg(long, env = "MOESWARM_RELAY_LISTEN")]
        relay_listen: Option<std::net::SocketAddr>,
        /// A TOML config file (flags and environment win over it).
        #[arg(long, env = "MOESWARM_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Fetch slabs of a model from a swarm into a store, verified.
    Fetch {
        /// A node of the swarm, ending in /p2p/<peer id> (repeatable).
        #[arg(long, required = true)]
        bootstrap: Vec<String>,
        /// The model id.
        #[arg(long)]
        model: String,
        /// Store directory (the node's data dir).
        #[arg(long)]
        store: PathBuf,
        /// Layers a..b (default all).
        #[arg(long)]
        layers: Option<String>,
        /// Experts, e.g. 0,5,8..16 (default all).
        #[arg(long)]
        experts: Option<String>,
        /// Fetch the trunk too.
        #[arg(long)]
        trunk: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Print how many replicas every slab of a model has in a swarm, and who holds them.
    Coverage {
        /// A node of the swarm, ending in /p2p/<peer id> (repeatable).
        #[arg(long, required = true)]
        bootstrap: Vec<String>,
        /// The model id.
        #[arg(long)]
        model: String,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Run a whole swarm on this machine (router, relay, workers on 127.0.0.1), generate through
    /// it, and check the result equals a single-process run bit for bit.
    Sim {
        /// Workers.
        #[arg(long, default_value_t = 3)]
        workers: usize,
        /// Workers reached only through the relay.
        #[arg(long, default_value_t = 1)]
        relayed: usize,
        /// A GGUF model (default: a synthesized one of --preset).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Synthetic model shape: tiny, small or qwen3-30b-a3b-4l (Q4_K experts).
        #[arg(long, default_value = "small")]
        preset: String,
        /// The prompt.
        #[arg(long, default_value = "The swarm")]
        prompt: String,
        /// Tokens to generate (greedy).
        #[arg(long, default_value_t = 16)]
        max_tokens: usize,
        /// Stop one worker after this many generated tokens.
        #[arg(long)]
        kill_worker_after: Option<usize>,
        /// Where the nodes' stores go (default: a temporary folder, removed afterwards).
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Activations on the wire: f32 (bit-identical), f16 or bf16 (half the bytes, rounded).
        #[arg(long, default_value = "f32")]
        wire: String,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Check the sliced model's MoE layers against the float64 oracle.
    Verify {
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
    },
}

/// Which model to run: a GGUF file, or a sliced model in a store.
#[derive(clap::Args)]
struct ModelArgs {
    /// A whole GGUF model.
    #[arg(long, conflicts_with_all = ["store", "model_id"])]
    model: Option<PathBuf>,
    /// A store holding a sliced model (with --model-id).
    #[arg(long, requires = "model_id")]
    store: Option<PathBuf>,
    /// The sliced model's id.
    #[arg(long, requires = "store")]
    model_id: Option<String>,
    /// Run with remote experts: join the swarm (with --bootstrap, --store, --model-id); the
    /// store gets the manifest and trunk if it lacks them.
    #[arg(long, requires_all = ["bootstrap", "store", "model_id"])]
    swarm: bool,
    /// A node of the swarm, ending in /p2p/<peer id> (repeatable; with --swarm).
    #[arg(long, requires = "swarm")]
    bootstrap: Vec<String>,
    /// Deadline of one dispatch to a worker, in milliseconds (with --swarm).
    #[arg(long, default_value_t = 10_000)]
    dispatch_deadline_ms: u64,
    /// Activations on the wire (with --swarm): f32 (bit-identical to a local run), f16 or bf16
    /// (half the bytes, rounded).
    #[arg(long, default_value = "f32")]
    wire: String,
}

fn parse_wire(s: &str) -> Result<moeswarm_protocol::WireType> {
    use moeswarm_protocol::WireType;
    match s {
        "f32" => Ok(WireType::F32),
        "f16" => Ok(WireType::F16),
        "bf16" => Ok(WireType::Bf16),
        other => anyhow::bail!("--wire {other:?}: want f32, f16 or bf16"),
    }
}

impl ModelArgs {
    /// The swarm to join, when `--swarm`.
    fn swarm(
        &self,
    ) -> Result<Option<(PathBuf, Vec<libp2p::Multiaddr>, moeswarm_protocol::ModelId)>> {
        if !self.swarm {
            return Ok(None);
        }
        let (Some(dir), Some(id)) = (&self.store, &self.model_id) else {
            anyhow::bail!("--swarm needs --store DIR and --model-id ID");
        };
        Ok(Some((
            dir.clone(),
            net::config::parse_addrs("bootstrap", &self.bootstrap)?,
            id.parse().with_context(|| format!("--model-id {id:?}"))?,
        )))
    }

    fn source(&self) -> Result<ModelSource> {
        match (&self.model, &self.store, &self.model_id) {
            (Some(m), None, None) => Ok(ModelSource::Gguf(m.clone())),
            (None, Some(dir), Some(id)) => Ok(ModelSource::Store {
                dir: dir.clone(),
                model: id.parse().with_context(|| format!("--model-id {id:?}"))?,
            }),
            _ => anyhow::bail!("give --model FILE, or --store DIR --model-id ID"),
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn net_runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn open_store(dir: &std::path::Path) -> Result<Store> {
    let (store, report) = Store::open(dir)?;
    for (id, why) in &report.dropped {
        eprintln!("store: dropped blob {id}: {why}");
    }
    if report.leftovers_removed > 0 {
        eprintln!(
            "store: removed {} unindexed leftover files",
            report.leftovers_removed
        );
    }
    Ok(store)
}

fn run(cli: Cli) -> Result<bool> {
    match cli.command {
        Command::Inspect { file, json } => {
            let g = Gguf::open(&file).with_context(|| format!("inspecting {}", file.display()))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&inspect::describe(&g))?);
            } else {
                print!("{}", inspect::render(&g));
            }
        }
        Command::Synth {
            out,
            preset,
            expert_type,
            seed,
        } => {
            let preset = Preset::named(&preset)?;
            let t = GgmlType::from_name(&expert_type)
                .with_context(|| format!("unknown tensor type {expert_type:?}"))?;
            synth(&out, &preset, t, seed)?;
            let g = Gguf::open(&out)?;
            println!(
                "wrote {} ({} bytes, {} tensors)",
                out.display(),
                g.file_size,
                g.tensors.len()
            );
        }
        Command::Slice { file, store, json } => {
            let store = open_store(&store)?;
            let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
            let (_, _, report) = slice(&file, &store, SliceOptions { progress })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else if report.already_sliced {
                println!(
                    "model {} is already in the store: nothing to do",
                    report.model_id
                );
            } else {
                println!(
                    "model {}\ntrunk {} ({} bytes)\n{} slabs ({} bytes)\n{:.2} s, {:.2} GB/s",
                    report.model_id,
                    report.trunk_id,
                    report.trunk_bytes,
                    report.slabs,
                    report.slab_bytes,
                    report.seconds,
                    report.gb_per_s
                );
            }
        }
        Command::Plan {
            file,
            vram,
            ram,
            ctx,
            nodes,
            replicas,
            stats,
            json,
        } => {
            let g = Gguf::open(&file).with_context(|| format!("reading {}", file.display()))?;
            let sizes = plan::ModelSizes::of(&g)?;
            match (vram, ram, nodes) {
                (Some(vram), Some(ram), None) => {
                    let p = plan::plan_coordinator(
                        &sizes,
                        plan::parse_size(&vram)?,
                        plan::parse_size(&ram)?,
                        ctx,
                    )?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&p)?);
                    } else {
                        print!("{}", plan::render_coordinator(&p));
                    }
                    return Ok(p.fits);
                }
                (None, None, Some(nodes)) => {
                    let devices = plan::read_nodes(&nodes)?;
                    let loads: Option<Vec<Vec<f64>>> = match stats {
                        None => None,
                        Some(f) => Some(
                            serde_json::from_slice(
                                &std::fs::read(&f)
                                    .with_context(|| format!("reading {}", f.display()))?,
                            )
                            .with_context(|| {
                                format!(
                                    "{} is not a JSON array [layer][expert] of numbers",
                                    f.display()
                                )
                            })?,
                        ),
                    };
                    let p = plan::plan_swarm(&sizes, devices, replicas, loads.as_deref())?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&p)?);
                    } else {
                        print!("{}", plan::render_swarm(&p));
                    }
                }
                _ => anyhow::bail!("give either --vram and --ram, or --nodes"),
            }
        }
        Command::Generate {
            model,
            prompt,
            max_tokens,
            seed,
            temperature,
            top_k,
            top_p,
            repeat_penalty,
            raw,
            json,
        } => {
            let opts = GenerateOptions {
                prompt,
                max_tokens,
                raw,
                sampling: SamplingConfig {
                    temperature,
                    top_k,
                    top_p,
                    repetition_penalty: repeat_penalty,
                    seed,
                },
            };
            let show = |piece: &str| {
                if !json {
                    print!("{piece}");
                    let _ = std::io::Write::flush(&mut std::io::stdout());
                }
            };
            let report = match model.swarm()? {
                Some((dir, bootstrap, id)) => {
                    let deadline = std::time::Duration::from_millis(model.dispatch_deadline_ms);
                    net_runtime()?.block_on(async {
                        let m = router::join_swarm_model(&dir, bootstrap, id, deadline).await?;
                        let r =
                            run::generate(&m.trunk, &m.experts, &m.tokenizer, &opts, show).await;
                        if !json {
                            eprintln!(
                                "\ndispatch: {}",
                                serde_json::to_string(&m.experts.stats.summary())?
                            );
                        }
                        m.shutdown().await;
                        r
                    })?
                }
                None => {
                    let m = LocalModel::load(&model.source()?)?;
                    runtime()?.block_on(run::generate(
                        &m.trunk,
                        &m.experts,
                        &m.tokenizer,
                        &opts,
                        show,
                    ))?
                }
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!();
                let t = &report.timing;
                eprintln!(
                    "prefill {} tokens at {:.1} tokens/s; decode {} tokens at {:.1} tokens/s (stop: {}); attention {:.0} ms, gating {:.0} ms, experts {:.0} ms",
                    report.prompt_tokens.len(), report.prefill_tokens_per_s, report.tokens.len(),
                    report.decode_tokens_per_s, report.stop, t.attention.as_secs_f64() * 1e3,
                    t.gating.as_secs_f64() * 1e3, t.experts.as_secs_f64() * 1e3
                );
            }
        }
        Command::Logits { model, tokens, out } => {
            let (logits, n_vocab) = match model.swarm()? {
                Some((dir, bootstrap, id)) => {
                    let deadline = std::time::Duration::from_millis(model.dispatch_deadline_ms);
                    net_runtime()?.block_on(async {
                        let mut m = router::join_swarm_model(&dir, bootstrap, id, deadline).await?;
                        m.experts = m.experts.with_wire(parse_wire(&model.wire)?);
                        let r = run::logits(&m.trunk, &m.experts, &tokens).await;
                        let n_vocab = m.trunk.hyper().n_vocab;
                        m.shutdown().await;
                        r.map(|l| (l, n_vocab))
                    })?
                }
                None => {
                    let m = LocalModel::load(&model.source()?)?;
                    let l = runtime()?.block_on(run::logits(&m.trunk, &m.experts, &tokens))?;
                    (l, m.trunk.hyper().n_vocab)
                }
            };
            let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(&out, bytes).with_context(|| format!("writing {}", out.display()))?;
            println!(
                "wrote {} ({} tokens x {} logits)",
                out.display(),
                tokens.len(),
                n_vocab
            );
        }
        Command::Node {
            store,
            listen,
            bootstrap,
            http,
            relay,
            record_ttl_secs,
            capacity,
            dispatch,
            via_relay,
            relay_listen,
            config,
        } => {
            let file = match config {
                Some(f) => net::config::ConfigFile::read(&f)?,
                None => net::config::ConfigFile::default(),
            };
            let cli = net::config::CommandLine {
                store,
                listen,
                bootstrap,
                http,
                relay_server: relay,
                record_ttl_secs,
                capacity,
                dispatch,
                via_relay,
                relay_listen,
            };
            let opts = net::config::resolve(cli, file)?;
            net_runtime()?.block_on(net::commands::run_node(opts, async {
                let _ = tokio::signal::ctrl_c().await;
            }))?;
        }
        Command::Fetch {
            bootstrap,
            model,
            store,
            layers,
            experts,
            trunk,
            json,
        } => {
            let model = model
                .parse()
                .with_context(|| format!("--model {model:?}"))?;
            let selection = net::Selection {
                layers: layers
                    .as_deref()
                    .map(net::commands::parse_layer_range)
                    .transpose()?,
                experts: experts
                    .as_deref()
                    .map(net::commands::parse_experts)
                    .transpose()?,
                trunk,
                only: None,
            };
            let bootstrap = net::config::parse_addrs("bootstrap", &bootstrap)?;
            let report = net_runtime()?
                .block_on(net::commands::fetch(&store, bootstrap, model, &selection))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!(
                    "fetched {} blobs ({} bytes), {} already stored; {} bad answers",
                    report.fetched,
                    report.bytes,
                    report.already,
                    report.rejected.values().sum::<u64>()
                );
            }
        }
        Command::Coverage {
            bootstrap,
            model,
            json,
        } => {
            let model = model
                .parse()
                .with_context(|| format!("--model {model:?}"))?;
            let bootstrap = net::config::parse_addrs("bootstrap", &bootstrap)?;
            let report = net_runtime()?.block_on(net::commands::coverage(bootstrap, model))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.render());
            }
        }
        Command::Sim {
            workers,
            relayed,
            model,
            preset,
            prompt,
            max_tokens,
            kill_worker_after,
            work_dir,
            wire,
            json,
        } => {
            let wire = parse_wire(&wire)?;
            let temp = work_dir.is_none();
            let dir = work_dir.unwrap_or_else(|| {
                std::env::temp_dir().join(format!("moeswarm-sim-{}", std::process::id()))
            });
            let mut opts = localswarm::SimOptions::new(dir.clone());
            opts.workers = workers;
            opts.relayed = relayed;
            opts.model = model;
            opts.preset = preset;
            opts.prompt = prompt;
            opts.max_tokens = max_tokens;
            opts.kill_worker_after = kill_worker_after;
            opts.wire = wire;
            let report = net_runtime()?.block_on(localswarm::run_local_swarm(&opts));
            if temp {
                let _ = std::fs::remove_dir_all(&dir);
            }
            let report = report?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", localswarm::render(&report));
            }
            return Ok(report.passed());
        }
        Command::Verify {
            file,
            store,
            layer,
            tokens,
            seed,
            json,
        } => {
            let store = open_store(&store)?;
            let report = verify(
                &file,
                &store,
                &VerifyOptions {
                    layer,
                    tokens,
                    seed,
                },
            )?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("model {}", report.model_id);
                for l in &report.layers {
                    println!(
                        "layer {:>3} [{}]  slabs-f64 vs monolithic-f64: max|d| {:.3e} rel {:.3e}   candle-f32 vs f64: max|d| {:.3e} cosine {:.8} (exact math: cosine {:.6}; {} tokens{})  {}",
                        l.layer, l.expert_types.join("/"), l.regroup.max_abs, l.regroup.max_rel,
                        l.candle.max_abs, l.candle.cosine, l.candle_vs_exact.cosine, l.tokens_compared,
                        if l.topk_near_ties.is_empty() { String::new() } else { format!(", {} near ties skipped", l.topk_near_ties.len()) },
                        if l.passed { "ok" } else { "FAILED" }
                    );
                }
                println!(
                    "{}",
                    if report.passed {
                        "verified"
                    } else {
                        "verification FAILED"
                    }
                );
            }
            return Ok(report.passed);
        }
    }
    Ok(true)
}

fn main() -> ExitCode {
    // Before any thread or any candle matmul: same kernels as llama.cpp on every x86 CPU.
    moeswarm_node::engine::quant::pin_kernels();
    match run(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
