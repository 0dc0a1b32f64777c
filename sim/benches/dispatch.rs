//! Data-plane benchmarks, each beside a reference measured in the same run.
//!
//! `cargo bench -p moeswarm-node --bench dispatch` (env `MOESWARM_BENCH_PRESET`, default
//! `qwen3-30b-a3b-4l`, Q4_K experts; `MOESWARM_BENCH_DECODE=0` skips part 2).
//!
//! 1. Per-layer dispatch overhead at batch 1: one decode token's layer (8 experts, one row
//!    each) sent to a worker on 127.0.0.1 through the router's remote executor, minus the
//!    worker's compute of the same experts, beside a raw quinn round trip of the same bytes.
//! 2. Decode tokens/s through a local swarm (router, relay, 3 workers, one relayed) beside the
//!    same model in one process.

use moeswarm_testkit as common;

use std::time::{Duration, Instant};

use moeswarm_engine::executor::{ExpertExecutor, ExpertRequest};
use moeswarm_engine::expert::ExpertWeights;
use moeswarm_engine::layer::read_slab;
use moeswarm_engine::moe::{DispatchPlan, ExpertRows};
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_node::dataplane::{
    HeldExperts, RemoteExecutor, ReplicaTable, WorkerFault, WorkerService,
};
use moeswarm_node::net::NodeIdentity;
use moeswarm_protocol::dispatch::DISPATCH_ALPN;
use moeswarm_protocol::holdings::LayerBits;
use moeswarm_protocol::{Holdings, Reach};
use moeswarm_relay::DataEndpoint;
use moeswarm_sim::local::{render, run_local_swarm, SimOptions};

const ROUNDS: usize = 300;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn identity() -> NodeIdentity {
    let mut seed = [0u8; 32];
    rand::fill(&mut seed);
    NodeIdentity::from_seed(seed).unwrap()
}

async fn raw_quinn_rtt(bytes: usize) -> anyhow::Result<f64> {
    let (a, b) = (identity(), identity());
    let server = DataEndpoint::bind(&a.keypair, "127.0.0.1:0".parse()?, &[DISPATCH_ALPN])?;
    let client = DataEndpoint::bind(&b.keypair, "127.0.0.1:0".parse()?, &[DISPATCH_ALPN])?;
    let s = server.clone();
    let echo = tokio::spawn(async move {
        while let Some((conn, _, _)) = s.accept().await {
            tokio::spawn(async move {
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let data = recv.read_to_end(1 << 24).await.unwrap_or_default();
                    let _ = send.write_all(&data).await;
                    let _ = send.finish();
                }
            });
        }
    });
    let conn = client
        .connect(server.local_addr()?, a.peer_id, DISPATCH_ALPN)
        .await?;
    let payload = vec![7u8; bytes];
    let mut times = Vec::new();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&payload).await?;
        send.finish()?;
        let back = recv.read_to_end(1 << 24).await?;
        assert_eq!(back.len(), bytes);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    echo.abort();
    Ok(median(times))
}

async fn dispatch_overhead(model: &std::path::Path, work: &std::path::Path) -> anyhow::Result<()> {
    let dir = work.join("store");
    let (store, _) = Store::open(&dir)?;
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

    let x: Vec<f32> = (0..n_embd)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let plan = DispatchPlan {
        groups: experts
            .iter()
            .map(|&e| ExpertRows {
                expert: e,
                tokens: vec![0],
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
    // The two are measured apart: candle's thread pool spins after each use, and interleaving
    // would charge that to whichever comes next.
    let mine: Vec<Vec<f32>> = local
        .iter()
        .map(|w| w.forward_rows(&x))
        .collect::<moeswarm_engine::Result<_>>()?;
    let mut remote = Vec::new();
    for i in 0..ROUNDS + 20 {
        let t = Instant::now();
        let out = exec.compute(req).await?;
        if i >= 20 {
            remote.push(t.elapsed().as_secs_f64() * 1e3);
        }
        assert_eq!(out, mine, "remote outputs equal local ones");
    }
    let mut compute = Vec::new();
    for i in 0..ROUNDS + 20 {
        let t = Instant::now();
        for w in &local {
            std::hint::black_box(w.forward_rows(&x)?);
        }
        if i >= 20 {
            compute.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let bytes = k as usize * n_embd * 4;
    let raw = raw_quinn_rtt(bytes).await?;
    let (rt, ct) = (median(remote), median(compute));
    println!("dispatch at batch 1: layer 0, {k} experts x 1 row, {bytes} bytes each way");
    println!("  remote executor round trip  {rt:.3} ms (median of {ROUNDS})");
    println!("  worker compute (same experts, in process) {ct:.3} ms");
    println!("  dispatch overhead           {:.3} ms", rt - ct);
    println!("  raw quinn round trip        {raw:.3} ms (same bytes, same loopback)");
    println!("  ratio overhead / raw quinn: {:.2}", (rt - ct) / raw);
    worker.shutdown();
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let model = common::bench::bench_model()?;
    let work = tempfile::tempdir_in(model.parent().expect("in bench-data"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(dispatch_overhead(&model, work.path()))?;
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
