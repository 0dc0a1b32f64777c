//! What a local swarm run found ([`SimReport`]) and how `moeswarm sim` prints it.

use serde::Serialize;

use moeswarm_engine::generate::SpeculationStats;
use moeswarm_engine::speculative::Speculation;
use moeswarm_node::dataplane::DispatchSummary;
use moeswarm_protocol::WireType;

/// One worker of the simulation.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerSummary {
    /// Its PeerId.
    pub peer: String,
    /// Slabs it holds.
    pub slabs: usize,
    /// Reached through the relay.
    pub via_relay: bool,
    /// Stopped mid-generation.
    pub killed: bool,
    /// Dispatches it answered with outputs.
    pub answered: u64,
}

impl SimReport {
    /// Whether the swarm did what a local run does: the same tokens, and with f32 activations
    /// the same logits bit for bit.
    pub fn passed(&self) -> bool {
        self.tokens_identical && (self.wire != WireType::F32 || self.logits_bit_identical)
    }
}

/// What the simulation found.
#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    /// The model id.
    pub model: String,
    /// Swarm and local runs generated the same tokens.
    pub tokens_identical: bool,
    /// Swarm and local logits are equal bit for bit: of the whole sequence run again, and
    /// the rows each token was chosen from as it was generated.
    pub logits_bit_identical: bool,
    /// Largest difference between swarm and local logits (0 when bit-identical).
    pub max_abs_logit_diff: f32,
    /// Largest local logit magnitude, the scale of that difference.
    pub max_abs_logit: f32,
    /// How activations travelled.
    pub wire: WireType,
    /// Generated token ids (swarm).
    pub tokens: Vec<u32>,
    /// Generated text (swarm).
    pub text: String,
    /// Decode tokens/s through the swarm.
    pub swarm_decode_tokens_per_s: f64,
    /// Decode tokens/s in one process.
    pub local_decode_tokens_per_s: f64,
    /// Prefill tokens/s through the swarm.
    pub swarm_prefill_tokens_per_s: f64,
    /// Prefill tokens/s in one process.
    pub local_prefill_tokens_per_s: f64,
    /// Slab bytes the workers fetched.
    pub fetched_bytes: u64,
    /// Handshakes the workers' endpoints and the relay asked to validate their address first
    /// or refused (there were too many pending at once).
    pub handshakes_turned_away: u64,
    /// The router's dispatches: counts, bytes, drops, per-layer latency percentiles.
    pub dispatch: DispatchSummary,
    /// The workers.
    pub workers: Vec<WorkerSummary>,
    /// The drafter the generations used.
    pub speculation: Speculation,
    /// The swarm generation's passes, drafts and kept drafts.
    pub speculation_stats: SpeculationStats,
    /// A digest of the logits each generated token was chosen from, as the swarm made them:
    /// the same with drafts as without when they change nothing.
    pub emitted_logits_digest: String,
}

/// The report in words.
pub fn render(r: &SimReport) -> String {
    let yes = |b: bool| if b { "yes" } else { "NO" };
    let mut s = format!(
        "model {}\ntext: {:?}\ntokens identical: {}\nlogits bit-identical: {} (max |diff| {:e}, activations as {:?})\n",
        r.model,
        r.text,
        yes(r.tokens_identical),
        yes(r.logits_bit_identical),
        r.max_abs_logit_diff,
        r.wire
    );
    s += &format!(
        "decode tokens/s: swarm {:.1}, local {:.1} (ratio {:.2}); prefill tokens/s: swarm {:.1}, local {:.1}\n",
        r.swarm_decode_tokens_per_s,
        r.local_decode_tokens_per_s,
        r.swarm_decode_tokens_per_s / r.local_decode_tokens_per_s.max(1e-9),
        r.swarm_prefill_tokens_per_s,
        r.local_prefill_tokens_per_s
    );
    let sp = &r.speculation_stats;
    s += &format!(
        "speculation {:?}: {} tokens in {} passes after the prompt's, {} of {} drafts kept, {} expert round trips ({:.2} a token)\n",
        r.speculation,
        r.tokens.len(),
        sp.passes,
        sp.accepted,
        sp.drafted,
        sp.expert_rounds,
        sp.expert_rounds as f64 / r.tokens.len().max(1) as f64
    );
    let d = &r.dispatch;
    s += &format!(
        "dispatches: {} sent, {} accepted, {} groups retried, {} computed by the router; dropped {:?}\n",
        d.sent, d.accepted, d.retried, d.local, d.dropped
    );
    s += &format!(
        "answers checked: {} dispatches ({} of their {} rows re-computed; {} groups without a second opinion); quarantined: {}\n",
        d.checked,
        d.checked_rows,
        d.checked_of_rows,
        d.unverified,
        if d.quarantined.is_empty() {
            "none".to_string()
        } else {
            d.quarantined.keys().cloned().collect::<Vec<_>>().join(", ")
        }
    );
    s += &format!(
        "bytes moved: {} fetched, {} activations out, {} outputs in\n",
        r.fetched_bytes, d.bytes_out, d.bytes_in
    );
    for (l, [p50, p90, p99]) in &d.latency_ms {
        s += &format!("layer {l:>3} dispatch ms: p50 {p50:.2} p90 {p90:.2} p99 {p99:.2}\n");
    }
    for w in &r.workers {
        let rtt = match d.worker_latency_ms.get(&w.peer) {
            Some([p50, _, p99]) => format!(", round trip p50 {p50:.2} ms p99 {p99:.2} ms"),
            None => String::new(),
        };
        s += &format!(
            "worker {} {}: {} slabs, answered {}{rtt}{}\n",
            w.peer,
            if w.via_relay {
                "(via relay)"
            } else {
                "(direct)"
            },
            w.slabs,
            w.answered,
            if w.killed { ", stopped mid-run" } else { "" }
        );
    }
    s
}
