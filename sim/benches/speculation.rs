//! Speculative decoding through a local swarm: the trained qwen35moe (`sim/models/`) run by a
//! router and three workers on this machine (real QUIC, real dispatches), greedy, drafting off,
//! by prompt lookup and by the MTP block (whose slabs the router keeps). For each: decode
//! tokens/s through the swarm, tokens a pass, and the sequential expert round trips a token,
//! beside drafting off measured in the same run (the ratio is the point: on a real network
//! each round trip costs milliseconds, here microseconds: each line also says what the
//! measured time plus 20 ms a round trip would give). Every run's tokens are checked
//! against the local run's (bit for bit, as `moeswarm sim` does).
//!
//! `cargo bench -p moeswarm-sim --bench speculation`

use std::time::Duration;

use moeswarm_engine::speculative::Speculation;
use moeswarm_sim::local::{run_local_swarm, SimOptions};

/// A round trip on a home network, for the projection printed beside each measurement.
const RTT: Duration = Duration::from_millis(20);

/// Prompts continued, 64 tokens each.
const PROMPTS: [&str; 3] = [
    "The best thing about a good friend is",
    "In the beginning",
    "Never trust",
];

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!("trained qwen35moe through a local swarm (router + 3 workers), greedy, 64 tokens after each of {} prompts:", PROMPTS.len());
    let mut off_rounds = None;
    for (mode, k) in [
        (Speculation::Off, None),
        (Speculation::Ngram, Some(4)),
        (Speculation::Mtp, Some(1)),
        (Speculation::Mtp, Some(3)),
        (Speculation::Mtp, Some(4)),
    ] {
        let (mut tokens, mut passes, mut rounds, mut secs) = (0usize, 0usize, 0u64, 0.0f64);
        for prompt in PROMPTS {
            let dir = tempfile::tempdir()?;
            let mut o = SimOptions::new(dir.path().to_path_buf());
            o.model = Some(moeswarm_sim::trained_model());
            o.prompt = prompt.into();
            o.max_tokens = 64;
            o.deadline = Duration::from_secs(10);
            o.speculative = Some(mode);
            o.draft = k;
            let r = rt.block_on(run_local_swarm(&o))?;
            anyhow::ensure!(
                r.tokens_identical && r.logits_bit_identical,
                "{mode:?}: the swarm's tokens differ from the local run's"
            );
            let n = r.tokens.len();
            tokens += n;
            passes += r.speculation_stats.passes;
            rounds += r.speculation_stats.expert_rounds;
            secs += n.saturating_sub(1) as f64 / r.swarm_decode_tokens_per_s.max(1e-9);
        }
        let per_token = rounds as f64 / tokens as f64;
        let off = *off_rounds.get_or_insert(per_token);
        let decoded = (tokens - PROMPTS.len()) as f64;
        // What a token would take where each round trip costs RTT (a home network) on top of
        // what it took here.
        let projected = 1.0 / (secs / decoded + per_token * RTT.as_secs_f64());
        println!(
            "  {mode:?} k={}: {:.0} decode tokens/s, {:.2} tokens a pass, {:.2} expert round trips a token ({:.2}x fewer than off); at {} ms a round trip: {projected:.1} tokens/s",
            k.unwrap_or(0),
            decoded / secs,
            decoded / passes.max(1) as f64,
            per_token,
            off / per_token,
            RTT.as_millis()
        );
    }
    Ok(())
}
