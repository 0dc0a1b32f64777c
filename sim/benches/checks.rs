//! The cost of checking workers' answers: decode tokens/s through one local swarm with checks
//! off, at the default rate, and on every answer, in the same run.
//!
//! `cargo bench -p moeswarm-sim --bench checks` (env `MOESWARM_BENCH_PRESET`, default
//! `qwen3-30b-a3b-4l`, Q4_K experts; `MOESWARM_BENCH_ROUTER_EXPERTS=0`: the router holds no
//! expert, so each check is a second dispatch to another worker instead of its own compute;
//! `MOESWARM_BENCH_TOKENS`, default 32).
//!
//! One swarm (router, relay, 3 workers, one relayed) serves every policy in turn. Under each
//! policy the router first generates once unmeasured, so the workers have passed their
//! probation (the default policy checks a new worker's first 16 answers) and every expert is
//! loaded; then it generates again, measured. The policies are run in three rounds, interleaved,
//! and each's better figure is kept: these machines are noisy.

use moeswarm_testkit as common;

use std::time::Duration;

use moeswarm_engine::generate::{self, GenerateOptions};
use moeswarm_engine::text::SamplingConfig;
use moeswarm_node::dataplane::CheckPolicy;
use moeswarm_sim::local::{start_local_swarm, SimOptions};

fn main() -> anyhow::Result<()> {
    let model = common::bench::bench_model()?;
    let work = tempfile::tempdir_in(model.parent().expect("in bench-data"))?;
    let tokens: usize = match std::env::var("MOESWARM_BENCH_TOKENS") {
        Ok(t) => t.parse()?,
        Err(_) => 32,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut o = SimOptions::new(work.path().join("sim"));
    o.model = Some(model.clone());
    o.deadline = Duration::from_secs(30);
    o.router_experts = std::env::var("MOESWARM_BENCH_ROUTER_EXPERTS").as_deref() != Ok("0");
    rt.block_on(async {
        let mut swarm = start_local_swarm(&o).await?;
        let gen = GenerateOptions {
            prompt: "The cost of trust".into(),
            max_tokens: tokens,
            raw: false,
            speculation: moeswarm_engine::speculative::SpeculationConfig::OFF,
            keep_logits: false,
            sampling: SamplingConfig {
                temperature: 0.0,
                ..SamplingConfig::default()
            },
        };
        let policies = [
            ("off", CheckPolicy::never()),
            ("default", CheckPolicy::default()),
            ("every answer", CheckPolicy::always()),
        ];
        let mut best = [0.0f64; 3];
        let mut checked = [0u64; 3];
        let mut reference: Option<Vec<u32>> = None;
        for round in 0..3 {
            for (k, (name, policy)) in policies.iter().enumerate() {
                swarm.remote.set_checks(*policy);
                generate::generate(&swarm.trunk, &swarm.remote, &swarm.tokenizer, &gen, |_| {})
                    .await?;
                swarm.remote.stats.reset();
                let r = generate::generate(
                    &swarm.trunk,
                    &swarm.remote,
                    &swarm.tokenizer,
                    &gen,
                    |_| {},
                )
                .await?;
                let d = swarm.remote.stats.summary();
                println!(
                    "round {round}, checks {name}: {:.2} decode tokens/s, {} of {} dispatches checked",
                    r.decode_tokens_per_s, d.checked, d.accepted
                );
                anyhow::ensure!(d.quarantined.is_empty(), "an honest worker was accused: {d:?}");
                match &reference {
                    None => reference = Some(r.tokens.clone()),
                    Some(t) => anyhow::ensure!(*t == r.tokens, "checks changed the tokens"),
                }
                best[k] = best[k].max(r.decode_tokens_per_s);
                checked[k] = d.checked;
            }
        }
        println!(
            "\nchecks (router {} the experts), decode tokens/s, {tokens} tokens, best of 3:",
            if o.router_experts { "holds" } else { "holds none of" }
        );
        for (k, (name, _)) in policies.iter().enumerate() {
            println!(
                "  {name:>12}: {:7.2}  ratio to off {:.2}  ({} dispatches checked)",
                best[k],
                best[k] / best[0],
                checked[k]
            );
        }
        swarm.shutdown().await;
        anyhow::Ok(())
    })
}
