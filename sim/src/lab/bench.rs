//! The lab's benchmark (`moeswarm lab --scenario FILE`): what a token costs through a swarm at
//! a real round trip, and how fast a slab fetch fills an uplink.
//!
//! The scenario's host named `hub` runs the seeder (with the data-plane relay) and the router
//! (`moeswarm serve --swarm`); every other host runs a worker holding the whole model (`fetch`,
//! then `node`: public hosts with `--dispatch 0.0.0.0:0`, hosts behind a NAT with
//! `--via-relay`). For each round trip asked, every link's one-way delay becomes a quarter of
//! it (router → worker crosses two links each way; the scenario's jitter is kept, but never
//! beyond the delay), and the router's decode time a token is measured through its API after a
//! warm-up request: a request for 1 token and one for N, at temperature 0, the difference over
//! N − 1 tokens (the median of three such pairs), with speculation off and (when the model has
//! an MTP block) on. The floor beside it is the model's MoE layers × the round trip + the same
//! measurement against a local `serve` of the same file: what a token costs when the network
//! adds only its round trips. Then the hub's uplink is limited to `fetch_rate` bytes a second and a fresh
//! store on the first public worker host fetches the model's slabs: their bytes over the time
//! the fetch took after joining, beside that rate.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::link::Shape;
use super::netns::Namespace;
use super::procs::{path_in, post_json, run, Proc};
use super::topology::{Host, Nat, Network, Scenario};
use super::LabError;

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The `moeswarm` binary to run in the namespaces.
    pub bin: PathBuf,
    /// The hosts and links (a host named `hub`, and at least one other).
    pub scenario: Scenario,
    /// The model (a GGUF file).
    pub model: PathBuf,
    /// Where the stores go.
    pub work_dir: PathBuf,
    /// Round trips to measure at, in milliseconds.
    pub rtts_ms: Vec<f64>,
    /// Tokens a measured request generates.
    pub tokens: usize,
    /// The hub's uplink during the fetch, in bytes a second (0: no fetch measured).
    pub fetch_rate: u64,
    /// The model fetched through it (default: `model`; a larger one makes the time to find
    /// the holders a smaller part of the whole).
    pub fetch_model: Option<PathBuf>,
    /// Loss and jitter draw from it.
    pub seed: u64,
}

/// Decode cost at one round trip.
#[derive(Debug, Clone, Serialize)]
pub struct AtRoundTrip {
    /// The round trip asked, router ↔ worker.
    pub rtt_ms: f64,
    /// MoE layers × the round trip + the local decode time a token.
    pub floor_ms_per_token: f64,
    /// Through the swarm, speculation off.
    pub ms_per_token: f64,
    /// `ms_per_token` over the floor (the target: ≤ 1.25 at 10 ms and above).
    pub over_floor: f64,
    /// Through the swarm with MTP drafts (when the model has an MTP block).
    pub speculative_ms_per_token: Option<f64>,
    /// `speculative_ms_per_token` over the same floor.
    pub speculative_over_floor: Option<f64>,
}

/// The slab fetch through a limited uplink.
#[derive(Debug, Clone, Serialize)]
pub struct FetchResult {
    /// The uplink's rate, bytes a second.
    pub uplink_bytes_per_s: u64,
    /// Verified bytes fetched.
    pub bytes: u64,
    /// Seconds it took after joining.
    pub seconds: f64,
    /// Bytes a second over the uplink's (the target: ≥ 0.8).
    pub of_uplink: f64,
}

/// What the benchmark measured.
#[derive(Debug, Clone, Serialize)]
pub struct LabReport {
    /// The model's MoE layers (a token's round trips without speculation).
    pub moe_layers: u32,
    /// Tokens a measured request generated.
    pub tokens: usize,
    /// A local `serve` of the same file: decode time a token, speculation off.
    pub local_ms_per_token: f64,
    /// The same with MTP drafts.
    pub local_speculative_ms_per_token: Option<f64>,
    /// At each round trip.
    pub rtts: Vec<AtRoundTrip>,
    /// The fetch, when measured.
    pub fetch: Option<FetchResult>,
}

/// Runs the benchmark of `opts`.
pub fn run_bench(opts: &BenchOptions) -> Result<LabReport, LabError> {
    let (bin, dir) = (opts.bin.as_path(), opts.work_dir.as_path());
    let model_file = opts.model.to_string_lossy().into_owned();
    let seed_store = path_in(dir, "seed");
    let sliced = run(
        bin,
        None,
        &["slice", &model_file, "--store", &seed_store, "--json"],
    )?;
    let sliced: serde_json::Value = parse(&sliced)?;
    let model_id = sliced["model_id"].as_str().unwrap_or_default().to_string();
    let info = run(bin, None, &["inspect", &model_file, "--json"])?;
    let info: serde_json::Value = parse(&info)?;
    let moe_layers = info["hyper_params"]["n_layer"].as_u64().unwrap_or(0) as u32;
    let has_mtp = info["metadata"].as_object().is_some_and(|m| {
        m.iter()
            .any(|(k, v)| k.ends_with(".nextn_predict_layers") && v.as_u64().unwrap_or(0) > 0)
    });

    // The local floor's other half: the same file served here, no network.
    let local = Proc::start(
        bin,
        None,
        &[
            "serve",
            "--model",
            &model_file,
            "--http",
            "127.0.0.1:0",
            "--name",
            "bench",
        ],
    )?;
    let local_addr = served_addr(&local)?;
    let local_ms = decode_ms(None, &local_addr, opts.tokens, "off")?;
    let local_spec = if has_mtp {
        Some(decode_ms(None, &local_addr, opts.tokens, "mtp")?)
    } else {
        None
    };
    drop(local);

    let fetch_model = match &opts.fetch_model {
        Some(f) => {
            let f = f.to_string_lossy().into_owned();
            let out = parse(&run(
                bin,
                None,
                &["slice", &f, "--store", &seed_store, "--json"],
            )?)?;
            out["model_id"].as_str().unwrap_or_default().to_string()
        }
        None => model_id.clone(),
    };
    let net = Network::build(&opts.scenario, opts.seed)?;
    let hub = net.host("hub").ok_or_else(|| {
        LabError::Scenario("no host named hub (the seeder's and router's)".into())
    })?;
    let seeder = Seeder::start(bin, hub, &seed_store)?;
    // Before any worker holds a slab, so that the seeder's uplink is the only source.
    let fetch = if opts.fetch_rate > 0 {
        Some(seeder.fetch_through(bin, &net, dir, &fetch_model, opts.fetch_rate)?)
    } else {
        None
    };
    let swarm = LabSwarm::start(bin, &net, dir, seeder, &model_id)?;
    let shapes: std::collections::HashMap<String, [Shape; 2]> = net
        .hosts
        .iter()
        .map(|h| (h.name.clone(), h.link.shapes()))
        .collect();
    let mut rtts = Vec::new();
    for &rtt in &opts.rtts_ms {
        for h in &net.hosts {
            let [mut up, mut down] = shapes[&h.name];
            for s in [&mut up, &mut down] {
                s.delay = Duration::from_secs_f64(rtt / 4.0 / 1e3);
                // No jitter beyond the delay (none at all at a round trip of 0).
                s.jitter = s.jitter.min(s.delay);
            }
            h.link.reshape(up, down)?;
        }
        let floor = moe_layers as f64 * rtt + local_ms;
        let ms = decode_ms(Some(&hub.ns), &swarm.api, opts.tokens, "off")?;
        let spec = match local_spec {
            Some(_) => Some(decode_ms(Some(&hub.ns), &swarm.api, opts.tokens, "mtp")?),
            None => None,
        };
        rtts.push(AtRoundTrip {
            rtt_ms: rtt,
            floor_ms_per_token: floor,
            ms_per_token: ms,
            over_floor: ms / floor,
            speculative_ms_per_token: spec,
            speculative_over_floor: spec.map(|s| s / floor),
        });
    }
    drop(swarm);
    Ok(LabReport {
        moe_layers,
        tokens: opts.tokens,
        local_ms_per_token: local_ms,
        local_speculative_ms_per_token: local_spec,
        rtts,
        fetch,
    })
}

fn parse(text: &str) -> Result<serde_json::Value, LabError> {
    serde_json::from_str(text).map_err(|e| LabError::Command(format!("not JSON ({e}): {text}")))
}

/// The `ip:port` a `serve` process said it serves on.
fn served_addr(p: &Proc) -> Result<String, LabError> {
    p.said("serving ")
        .and_then(|l| l.split("http://").nth(1))
        .and_then(|a| a.strip_suffix("/v1"))
        .map(str::to_string)
        .ok_or_else(|| LabError::Command(format!("no API address in {:?}", p.said)))
}

/// Decode milliseconds a token of the API at `addr` (from inside `ns`): a 1-token request and
/// an `n`-token one, the difference over the tokens after the first.
fn decode_ms(
    ns: Option<&Namespace>,
    addr: &str,
    n: usize,
    speculative: &str,
) -> Result<f64, LabError> {
    let ask = |max_tokens: usize| -> Result<(f64, u64), LabError> {
        let body = serde_json::json!({
            "model": "bench",
            "prompt": "The best thing about a good friend is",
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "speculative": speculative,
        });
        let t0 = Instant::now();
        let a = post_json(ns, addr, "/v1/completions", &body, Duration::from_secs(300))?;
        let took = t0.elapsed().as_secs_f64() * 1e3;
        Ok((took, a["usage"]["completion_tokens"].as_u64().unwrap_or(0)))
    };
    // A first request of the same length warms up: the paths and punches are made, and each
    // worker's first answers (every one of them checked on a second replica while it is new:
    // an extra round trip each) are behind it. What is measured runs at the default check
    // rate. One pair of requests is at the mercy of one slow answer (a check that falls in the
    // 1-token request makes the difference small), so the pair is taken three times and the
    // median difference kept.
    ask(n)?;
    let mut each = Vec::with_capacity(DECODE_ROUNDS);
    for _ in 0..DECODE_ROUNDS {
        let (one, _) = ask(1)?;
        let (all, made) = ask(n)?;
        if made < 2 {
            return Err(LabError::Probe(format!("only {made} tokens generated")));
        }
        each.push((all - one).max(0.0) / (made - 1) as f64);
    }
    each.sort_by(f64::total_cmp);
    Ok(each[each.len() / 2])
}

/// How many times [`decode_ms`] takes its pair of requests (odd: the median is one of them).
const DECODE_ROUNDS: usize = 3;

/// The seeder (with the data-plane relay) on the hub.
struct Seeder {
    _proc: Proc,
    addr: String,
    relay: String,
}

impl Seeder {
    fn start(bin: &Path, hub: &Host, store: &str) -> Result<Self, LabError> {
        let ip = hub.addr.to_string();
        let (listen, relay_listen) = (format!("/ip4/{ip}/tcp/0"), format!("{ip}:0"));
        let args = [
            "node",
            "--store",
            store,
            "--listen",
            &listen,
            "--relay",
            "--relay-listen",
            &relay_listen,
        ];
        let proc = Proc::start(bin, Some(&hub.ns), &args)?;
        let (Some(addr), Some(relay)) = (
            proc.said("listening on "),
            proc.said("data-plane relay on "),
        ) else {
            return Err(LabError::Command(format!(
                "the seeder said {:?}",
                proc.said
            )));
        };
        let (addr, relay) = (addr.to_string(), relay.to_string());
        Ok(Self {
            _proc: proc,
            addr,
            relay,
        })
    }

    /// A fresh store on the first public host other than the hub fetches the model's slabs
    /// from the seeder, the hub's uplink limited to `rate` bytes a second meanwhile.
    fn fetch_through(
        &self,
        bin: &Path,
        net: &Network,
        dir: &Path,
        model: &str,
        rate: u64,
    ) -> Result<FetchResult, LabError> {
        let hub = net.host("hub").expect("the seeder's");
        let host = net
            .hosts
            .iter()
            .find(|h| h.name != "hub" && h.nat == Nat::None)
            .ok_or_else(|| LabError::Scenario("no public host to fetch on".into()))?;
        let [mut up, down] = hub.link.shapes();
        let before = up;
        up.rate = rate;
        hub.link.reshape(up, down)?;
        let store = path_in(dir, "fetch-bench");
        let args = [
            "fetch",
            "--bootstrap",
            &self.addr,
            "--model",
            model,
            "--store",
            &store,
            "--json",
        ];
        let out = run(bin, Some(&host.ns), &args);
        hub.link.reshape(before, down)?;
        let out = parse(&out?)?;
        let bytes = out["bytes"].as_u64().unwrap_or(0);
        let seconds = out["seconds"].as_f64().unwrap_or(0.0);
        let of_uplink = if seconds > 0.0 {
            bytes as f64 / seconds / rate as f64
        } else {
            0.0
        };
        Ok(FetchResult {
            uplink_bytes_per_s: rate,
            bytes,
            seconds,
            of_uplink,
        })
    }
}

/// The swarm of the benchmark, running; its processes end when it is dropped (router, then
/// workers, then the seeder).
struct LabSwarm {
    api: String,
    _router: Proc,
    _workers: Vec<Proc>,
    _seeder: Seeder,
}

impl LabSwarm {
    fn start(
        bin: &Path,
        net: &Network,
        dir: &Path,
        seeder: Seeder,
        model: &str,
    ) -> Result<Self, LabError> {
        if net.hosts.len() < 2 {
            return Err(LabError::Scenario("no worker host beside the hub".into()));
        }
        let mut workers = Vec::new();
        for h in net.hosts.iter().filter(|h| h.name != "hub") {
            let store = path_in(dir, &h.name);
            let fetch = [
                "fetch",
                "--bootstrap",
                &seeder.addr,
                "--model",
                model,
                "--store",
                &store,
            ];
            run(bin, Some(&h.ns), &fetch)?;
            let listen = format!("/ip4/{}/tcp/0", h.addr);
            let mut args = vec![
                "node",
                "--store",
                &store,
                "--listen",
                &listen,
                "--bootstrap",
                &seeder.addr,
            ];
            if h.nat == Nat::None {
                args.extend(["--dispatch", "0.0.0.0:0"]);
            } else {
                args.extend(["--via-relay", &seeder.relay]);
            }
            workers.push(Proc::start(bin, Some(&h.ns), &args)?);
        }
        let hub = net.host("hub").expect("the seeder's");
        let router_store = path_in(dir, "router");
        let http = format!("{}:0", hub.addr);
        let args = [
            "serve",
            "--swarm",
            "--bootstrap",
            &seeder.addr,
            "--store",
            &router_store,
            "--model-id",
            model,
            "--http",
            &http,
            "--name",
            "bench",
        ];
        // The workers' records reach the seeder a moment after they start.
        let until = Instant::now() + Duration::from_secs(60);
        let router = loop {
            match Proc::start(bin, Some(&hub.ns), &args) {
                Ok(p) => break p,
                Err(e) if Instant::now() > until => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_secs(1)),
            }
        };
        Ok(Self {
            api: served_addr(&router)?,
            _router: router,
            _workers: workers,
            _seeder: seeder,
        })
    }
}
