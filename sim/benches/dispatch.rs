//! Data-plane benchmarks, each beside a reference measured in the same run.
//!
//! `cargo bench -p moeswarm-sim --bench dispatch` (env `MOESWARM_BENCH_PRESET`, default
//! `qwen3-30b-a3b-4l`, Q4_K experts; `MOESWARM_BENCH_DECODE=0` skips part 2).
//!
//! 1. Where a dispatch's round trip goes, at batch 1 and 16: one layer's rows for 8 experts
//!    sent to a worker on 127.0.0.1 through the router's remote executor, split into its parts
//!    by the data plane's timeline marks (median of each part), beside a raw quinn round trip
//!    of the same bytes; the overhead is the round trip minus the worker's compute. A second
//!    reference, the raw echo answering only after the same compute on the kernels' pool,
//!    shows what waking threads around a compute costs a round trip with no protocol at all.
//!    The three take turns round by round, so a busy moment of the machine falls on all.
//! 2. Decode tokens/s through a local swarm (router, relay, 3 workers, one relayed) beside the
//!    same model in one process.

use moeswarm_testkit as common;

#[path = "dispatch/timeline.rs"]
mod timeline;

use moeswarm_engine::executor::{ExpertExecutor, ExpertRequest};
use moeswarm_engine::expert::{forward_each, ExpertWeights};
use moeswarm_engine::layer::read_slab;
use moeswarm_engine::moe::{DispatchPlan, ExpertRows};
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_node::dataplane::timeline::Mark;
use moeswarm_node::dataplane::{
    HeldExperts, RemoteExecutor, ReplicaTable, WorkerFault, WorkerService,
};
use moeswarm_node::net::NodeIdentity;
use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_protocol::holdings::LayerBits;
use moeswarm_protocol::{Holdings, Reach};
use moeswarm_relay::DataEndpoint;
use moeswarm_sim::local::{render, run_local_swarm, SimOptions};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use timeline::{offsets, Collector, Offsets, Point, CHAIN};

const ROUNDS: usize = 300;
const WARM_UP: usize = 20;

fn median(v: Vec<f64>) -> f64 {
    pct(&v, 0.5)
}

/// The `q` quantile of `v` (0 when empty).
fn pct(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 * q) as usize).min(v.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0.0)
}

fn identity() -> NodeIdentity {
    let mut seed = [0u8; 32];
    rand::fill(&mut seed);
    NodeIdentity::from_seed(seed).unwrap()
}

/// What a raw echo does between reading a request and writing it back.
#[derive(Clone)]
enum Echo {
    /// Nothing: the bytes go straight back.
    Plain,
    /// The worker's compute of the same rows (`x` through each expert, the experts in
    /// parallel on the kernels' pool, handed there as the worker hands it), then the bytes.
    AfterCompute(Arc<Vec<ExpertWeights>>, Arc<Vec<f32>>),
}

/// A bare quinn echo on 127.0.0.1: a server answering each stream as its [`Echo`] says, and a
/// client connected to it.
struct RawEcho {
    conn: quinn::Connection,
    payload: Vec<u8>,
    /// Bytes of each answer.
    back: usize,
    /// The echo's compute times, in milliseconds (after-compute echoes only).
    computed: Arc<std::sync::Mutex<Vec<f64>>>,
    server: tokio::task::JoinHandle<()>,
    _endpoints: [DataEndpoint; 2],
}

impl RawEcho {
    /// An echo sent `out` bytes that answers `back` bytes as `echo` says.
    async fn start(out: usize, back: usize, echo: Echo) -> anyhow::Result<Self> {
        let (a, b) = (identity(), identity());
        let server = DataEndpoint::bind(&a.keypair, "127.0.0.1:0".parse()?, &[DISPATCH_ALPN])?;
        let client = DataEndpoint::bind(&b.keypair, "127.0.0.1:0".parse()?, &[DISPATCH_ALPN])?;
        let s = server.clone();
        let computed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let times = computed.clone();
        let answer = Arc::new(vec![7u8; back]);
        let server_task = tokio::spawn(async move {
            while let Some((conn, _, _)) = s.accept().await {
                let (echo, times, answer) = (echo.clone(), times.clone(), answer.clone());
                tokio::spawn(async move {
                    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                        let _ = recv.read_to_end(1 << 24).await;
                        if let Echo::AfterCompute(w, x) = &echo {
                            let took = compute_on_pool(w.clone(), x.clone()).await;
                            times.lock().unwrap().push(took);
                        }
                        let _ = send.write_all(&answer).await;
                        let _ = send.finish();
                    }
                });
            }
        });
        let conn = client
            .connect(server.local_addr()?, a.peer_id, DISPATCH_ALPN)
            .await?;
        Ok(Self {
            conn,
            payload: vec![7u8; out],
            back,
            computed,
            server: server_task,
            _endpoints: [server, client],
        })
    }

    /// One round trip on a fresh stream, in milliseconds.
    async fn round(&self) -> anyhow::Result<f64> {
        let t = Instant::now();
        let (mut send, mut recv) = self.conn.open_bi().await?;
        send.write_all(&self.payload).await?;
        send.finish()?;
        let answer = recv.read_to_end(1 << 24).await?;
        assert_eq!(answer.len(), self.back);
        Ok(t.elapsed().as_secs_f64() * 1e3)
    }

    /// The compute times of the rounds after the warm-up.
    fn computed(&self) -> Vec<f64> {
        let all = self.computed.lock().unwrap();
        all.iter().skip(WARM_UP).copied().collect()
    }
}

impl Drop for RawEcho {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// `x` through each of `w` on the kernels' pool, handed there from the runtime as the worker
/// hands a dispatch: how long the compute took there, in milliseconds.
async fn compute_on_pool(w: Arc<Vec<ExpertWeights>>, x: Arc<Vec<f32>>) -> f64 {
    let (done, took) = futures::channel::oneshot::channel();
    moeswarm_engine::kernels::spawn_on_pool(
        move || {
            let t = Instant::now();
            let jobs: Vec<(&ExpertWeights, &[f32])> = w.iter().map(|e| (e, &x[..])).collect();
            forward_each(&jobs).expect("the bench's experts compute");
            t.elapsed().as_secs_f64() * 1e3
        },
        move |took| {
            let _ = done.send(took);
        },
    );
    match took.await {
        Ok(Ok(ms)) => ms,
        _ => panic!("the echo's compute failed"),
    }
}

/// A worker on 127.0.0.1 holding layer 0's first `k` experts, and an executor sending to it.
struct Bench {
    exec: RemoteExecutor,
    local: Arc<Vec<ExpertWeights>>,
    worker: WorkerService,
    n_embd: usize,
    experts: Vec<u32>,
}

async fn set_up(model: &std::path::Path, work: &std::path::Path) -> anyhow::Result<Bench> {
    let (store, _) = Store::open(&work.join("store"))?;
    let (_, manifest, _) = slice(model, &store, SliceOptions::default())?;
    let n_embd = manifest.hyper.n_embd as usize;
    let k = manifest.hyper.n_expert_used.max(1);
    let experts: Vec<u32> = (0..k).collect();
    let mut held = HeldExperts::default();
    HeldExperts::load_some(
        &store,
        &manifest,
        experts.iter().map(|&e| (0, e)),
        &mut held,
    )?;
    let local: Vec<ExpertWeights> = experts
        .iter()
        .map(|&e| ExpertWeights::from_slab_bytes(&read_slab(&store, &manifest, 0, e)?))
        .collect::<moeswarm_engine::Result<_>>()?;
    let (w, r) = (identity(), identity());
    let wep = DataEndpoint::bind(&w.keypair, "127.0.0.1:0".parse()?, &[DISPATCH_ALPN])?;
    let worker = WorkerService::spawn(
        held,
        Some(wep.clone()),
        None,
        w.keypair.clone(),
        8,
        WorkerFault::Honest,
    );
    let mut layers =
        vec![LayerBits::empty(manifest.hyper.n_expert); manifest.hyper.n_layer as usize];
    for &e in &experts {
        layers[0].set(e);
    }
    let record = Holdings {
        model: manifest.id(),
        node: w.key,
        n_expert: manifest.hyper.n_expert,
        layers,
        used_bytes: 0,
        free_bytes: 0,
        addrs: vec![format!("quic://{}", wep.local_addr()?)],
        reach: Reach::Direct,
        seq: 1,
        expires_at: u64::MAX,
    };
    let table = ReplicaTable::from_records(&manifest, [&record], None);
    let rep = DataEndpoint::bind(&r.keypair, "127.0.0.1:0".parse()?, &[DISPATCH_ALPN])?;
    let exec = RemoteExecutor::new(manifest.clone(), rep, table, None, Duration::from_secs(10));
    Ok(Bench {
        exec,
        local: Arc::new(local),
        worker,
        n_embd,
        experts,
    })
}

/// Part 1 at `batch` rows an expert: the round trip split into its parts, beside raw quinn.
async fn round_trip_parts(b: &Bench, marks: &Collector, batch: usize) -> anyhow::Result<()> {
    let n_embd = b.n_embd;
    let x: Vec<f32> = (0..batch * n_embd)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let plan = DispatchPlan {
        groups: b
            .experts
            .iter()
            .map(|&e| ExpertRows {
                expert: e,
                tokens: (0..batch as u32).collect(),
            })
            .collect(),
    };
    let req = ExpertRequest {
        step: 0,
        layer: 0,
        x: &x,
        n_embd,
        plan: &plan,
    };
    let mine: Vec<Vec<f32>> = b
        .local
        .iter()
        .map(|w| w.forward_rows(&x))
        .collect::<moeswarm_engine::Result<_>>()?;
    // The references run in turn with the dispatches, round by round, so that whatever else
    // this machine does falls on all three alike.
    // The same bytes each way as a dispatch: what its request carried (a row routed to several
    // of the worker's experts travels once), and every expert's outputs back.
    let sent_before = b.exec.stats.bytes_out.load(Ordering::Relaxed);
    b.exec.compute(req).await?;
    let out_bytes = (b.exec.stats.bytes_out.load(Ordering::Relaxed) - sent_before) as usize;
    let back_bytes = b.experts.len() * batch * n_embd * 4;
    let bytes = (out_bytes, back_bytes);
    let raw = RawEcho::start(out_bytes, back_bytes, Echo::Plain).await?;
    let echo = RawEcho::start(
        out_bytes,
        back_bytes,
        Echo::AfterCompute(b.local.clone(), Arc::new(x.clone())),
    )
    .await?;
    let (mut rounds, mut raw_rtts, mut echo_rtts) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..ROUNDS + WARM_UP {
        marks.take_dispatch();
        let t = Instant::now();
        let out = b.exec.compute(req).await?;
        let returned = Instant::now();
        assert_eq!(out, mine, "remote outputs equal local ones");
        let taken = marks
            .take_dispatch()
            .context("no timeline marks were taken")?;
        let (r, e) = (raw.round().await?, echo.round().await?);
        if i >= WARM_UP {
            rounds.push(offsets(t, &taken, returned));
            raw_rtts.push(r);
            echo_rtts.push(e);
        }
    }
    report(batch, b.experts.len(), bytes, &rounds, &raw_rtts);
    let (echo50, echo_compute50) = (pct(&echo_rtts, 0.5), pct(&echo.computed(), 0.5));
    println!(
        "  raw quinn echo after the same compute on the pool: p50 {echo50:.3} ms, compute {echo_compute50:.3}, overhead {:.3} ({:.2}x raw quinn)",
        echo50 - echo_compute50,
        (echo50 - echo_compute50) / pct(&raw_rtts, 0.5)
    );
    Ok(())
}

/// Prints the parts' medians and the round trip beside raw quinn's.
fn report(batch: usize, k: usize, bytes: (usize, usize), rounds: &[Offsets], raw: &[f64]) {
    let total: Vec<f64> = rounds
        .iter()
        .filter_map(|o| o.at(Point::Returned))
        .collect();
    let compute_part = CHAIN
        .iter()
        .position(|p| p.to == Point::At(Mark::ComputeEnded))
        .expect("compute is a part");
    let (out, back) = bytes;
    println!("\ndispatch at batch {batch}: layer 0, {k} experts x {batch} rows (the same rows for each), {out} bytes out and {back} back, median of {ROUNDS}");
    println!("  {:>9}  part", "ms");
    // Each round's parts once, then each part's lengths across the rounds.
    let per_round: Vec<Vec<Option<f64>>> = rounds.iter().map(Offsets::parts).collect();
    let parts: Vec<Vec<f64>> = (0..CHAIN.len())
        .map(|i| per_round.iter().filter_map(|p| p[i]).collect())
        .collect();
    for (p, v) in CHAIN.iter().zip(&parts) {
        println!("  {:>9.3}  {}", median(v.clone()), p.what);
    }
    for (m, what) in [
        (Mark::RequestWritten, "router's write of the request done"),
        (Mark::ReplyWritten, "worker's write of the reply done"),
    ] {
        let v: Vec<f64> = rounds.iter().filter_map(|o| o.at(Point::At(m))).collect();
        println!("  (at {:>6.3}  {what})", median(v));
    }
    let compute = median(parts[compute_part].clone());
    let (p50, p90, p99) = (pct(&total, 0.5), pct(&total, 0.9), pct(&total, 0.99));
    let raw50 = pct(raw, 0.5);
    println!(
        "  round trip p50 {p50:.3} ms, p90 {p90:.3}, p99 {p99:.3} (p99/p50 {:.2})",
        p99 / p50
    );
    println!(
        "  worker compute {compute:.3} ms; dispatch overhead (round trip - compute) {:.3} ms",
        p50 - compute
    );
    println!(
        "  raw quinn round trip, same bytes: p50 {raw50:.3} ms, p99 {:.3}",
        pct(raw, 0.99)
    );
    println!(
        "  ratio overhead / raw quinn: {:.2}",
        (p50 - compute) / raw50
    );
}

fn main() -> anyhow::Result<()> {
    let model = common::bench::bench_model()?;
    let work = tempfile::tempdir_in(model.parent().expect("in bench-data"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let marks = Collector::install()?;
    rt.block_on(async {
        let b = set_up(&model, work.path()).await?;
        for batch in [1, 16] {
            round_trip_parts(&b, &marks, batch).await?;
        }
        b.worker.shutdown();
        anyhow::Ok(())
    })?;
    if std::env::var("MOESWARM_BENCH_DECODE").as_deref() != Ok("0") {
        let mut o = SimOptions::new(work.path().join("sim"));
        o.model = Some(model.clone());
        o.max_tokens = 32;
        o.deadline = Duration::from_secs(30);
        o.warmup = true;
        let r = rt.block_on(run_local_swarm(&o))?;
        println!(
            "\ndecode through a local swarm (3 workers, 1 relayed), {} tokens:",
            r.tokens.len()
        );
        print!("{}", render(&r));
        println!(
            "ratio swarm / local decode tokens/s: {:.2}",
            r.swarm_decode_tokens_per_s / r.local_decode_tokens_per_s
        );
    }
    Ok(())
}
