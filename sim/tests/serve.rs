//! The OpenAI-compatible API through a local swarm: 16 streams at once, each with exactly the
//! tokens a single-process run gives it, batched into one dispatch per worker per layer per
//! step.

use moeswarm_testkit as common;

use std::time::Duration;

use async_openai::config::OpenAIConfig;
use async_openai::types::{ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs};
use async_openai::Client;
use common::data;
use futures::StreamExt;
use moeswarm_engine::generate::{generate, GenerateOptions};
use moeswarm_engine::text::SamplingConfig;
use moeswarm_node::api::batcher::BatchOptions;
use moeswarm_sim::local::{start_local_swarm, SimOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_streams_through_a_swarm_get_the_local_tokens_in_one_dispatch_per_worker_and_layer()
{
    let dir = tempfile::tempdir().unwrap();
    let mut o = SimOptions::new(dir.path().to_path_buf());
    o.model = Some(data("small-q4_k.gguf"));
    o.deadline = Duration::from_secs(10);
    let mut swarm = start_local_swarm(&o).await.unwrap();
    // The model has no chat template of its own: it is served with Qwen3's.
    let template = std::fs::read_to_string(data("templates/Qwen-Qwen3-0.6B.jinja")).unwrap();
    swarm.tokenizer.set_chat_template(&template).unwrap();
    let n_layer = swarm.manifest.hyper.n_layer as f64;
    let n_workers = swarm.workers.len() as f64;
    // The references: each prompt alone, greedy, in one process.
    let prompts: Vec<String> = (0..16).map(|i| format!("Tale {i}: the")).collect();
    let mut wants = Vec::new();
    for p in &prompts {
        let gen = GenerateOptions {
            prompt: swarm.tokenizer.chat([("user", p.as_str())]).unwrap(),
            max_tokens: 10,
            raw: true,
            speculation: moeswarm_engine::speculative::SpeculationConfig::OFF,
            keep_logits: false,
            sampling: SamplingConfig {
                temperature: 0.0,
                ..SamplingConfig::default()
            },
        };
        let r = generate(&swarm.trunk, &swarm.local, &swarm.tokenizer, &gen, |_| {})
            .await
            .unwrap();
        wants.push(r.text);
    }
    let before = swarm.remote.stats.summary().sent;
    let (server, workers) = swarm
        .serve(
            "small".into(),
            BatchOptions::default(),
            "127.0.0.1:0".parse().unwrap(),
        )
        .await
        .unwrap();
    let client = Client::with_config(
        OpenAIConfig::new()
            .with_api_base(format!("http://{}/v1", server.addr))
            .with_api_key("none"),
    );
    let got = futures::future::join_all(prompts.iter().map(|p| chat_stream(&client, p))).await;
    for (i, (g, w)) in got.iter().zip(&wants).enumerate() {
        assert_eq!(g, w, "stream {i} through the swarm");
    }
    let b = &server.batcher.stats;
    let steps = b.steps.load(std::sync::atomic::Ordering::Relaxed) as f64;
    let seqs = b.step_sequences.load(std::sync::atomic::Ordering::Relaxed) as f64;
    assert!(seqs / steps > 1.5, "mean batch {}", seqs / steps);
    let body = reqwest_get(server.addr, "/metrics").await;
    let sent: f64 = body
        .lines()
        .find_map(|l| l.strip_prefix("moeswarm_dispatches_sent_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the dispatch count in /metrics");
    let per_step = (sent - before as f64) / steps;
    assert!(
        per_step <= n_workers * n_layer,
        "{per_step} dispatches a step: more than one per worker per layer"
    );
    // Round trips per layer and per worker: every layer and every worker that answered has
    // its median, and nobody else does.
    let quantile = |metric: &str, label: &str| -> Vec<(String, f64)> {
        body.lines()
            .filter_map(|l| {
                l.strip_prefix(metric)?
                    .strip_prefix(&format!("{{{label}=\""))
            })
            .filter_map(|l| {
                let (key, rest) = l.split_once('"')?;
                let v = rest.strip_prefix(",quantile=\"0.5\"} ")?;
                Some((key.to_string(), v.trim().parse().ok()?))
            })
            .collect()
    };
    let layers = quantile("moeswarm_dispatch_latency_ms", "layer");
    assert_eq!(layers.len(), n_layer as usize, "{layers:?}");
    let answered: std::collections::BTreeSet<String> = workers
        .iter()
        .filter(|w| {
            w.worker
                .as_ref()
                .is_some_and(|s| s.stats.answered.load(std::sync::atomic::Ordering::Relaxed) > 0)
        })
        .map(|w| w.handle.peer_id.to_string())
        .collect();
    let timed = quantile("moeswarm_worker_dispatch_latency_ms", "worker");
    let timed_ids: std::collections::BTreeSet<String> =
        timed.iter().map(|(k, _)| k.clone()).collect();
    assert!(!answered.is_empty());
    assert_eq!(
        timed_ids, answered,
        "workers timed vs workers that answered"
    );
    assert!(
        timed.iter().chain(&layers).all(|(_, ms)| *ms > 0.0),
        "{timed:?}"
    );
    // Honest workers on probation: checked, never failed, nobody quarantined.
    let checks = |result: &str| -> f64 {
        body.lines()
            .filter(|l| l.starts_with("moeswarm_worker_checks_total{"))
            .filter(|l| l.contains(&format!("result=\"{result}\"")))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    assert!(checks("passed") > 0.0, "no checks in /metrics");
    assert_eq!(checks("failed"), 0.0);
    assert!(body.contains("moeswarm_workers_quarantined 0\n"));
    server.shutdown().await;
    for w in workers {
        w.shutdown().await;
    }
}

/// One greedy chat completion of 10 tokens for `prompt`, streamed: its text.
async fn chat_stream(client: &Client<OpenAIConfig>, prompt: &str) -> String {
    let req = CreateChatCompletionRequestArgs::default()
        .model("small")
        .messages([ChatCompletionRequestUserMessageArgs::default()
            .content(prompt)
            .build()
            .unwrap()
            .into()])
        .max_tokens(10u32)
        .temperature(0.0)
        .build()
        .unwrap();
    let mut st = client.chat().create_stream(req).await.unwrap();
    let mut text = String::new();
    while let Some(chunk) = st.next().await {
        text += chunk.unwrap().choices[0]
            .delta
            .content
            .as_deref()
            .unwrap_or("");
    }
    text
}

async fn reqwest_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    sock.read_to_string(&mut out).await.unwrap();
    out
}
