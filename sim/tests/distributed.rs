//! Live distributed decode on 127.0.0.1: a router and workers (one reached only through the
//! relay) generate text whose tokens equal a local run's and whose logits equal them bit for
//! bit, also when a worker dies mid-generation or misbehaves.

use moeswarm_testkit as common;

use std::time::Duration;

use common::{data, trained_model};
use moeswarm_engine::speculative::Speculation;
use moeswarm_node::dataplane::WorkerFault;
use moeswarm_sim::local::{run_local_swarm, SimOptions};

fn options(dir: &std::path::Path) -> SimOptions {
    let mut o = SimOptions::new(dir.to_path_buf());
    o.model = Some(data("small-q4_k.gguf"));
    o.max_tokens = 8;
    // Generous: a dispatch of this model takes milliseconds, but CI machines are busy, and a
    // missed deadline would show up as a retry in the first test.
    o.deadline = Duration::from_secs(10);
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_and_three_workers_one_relayed_match_the_local_run_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_local_swarm(&options(dir.path())).await.unwrap();
    assert!(r.tokens_identical, "{r:#?}");
    assert!(r.logits_bit_identical, "{r:#?}");
    assert_eq!(r.tokens.len(), 8);
    // Everything was computed by workers, the relayed one included.
    assert_eq!(r.dispatch.local, 0, "{r:#?}");
    assert!(r.dispatch.dropped.is_empty(), "{r:#?}");
    assert_eq!(r.workers.len(), 3);
    let relayed = r.workers.iter().find(|w| w.via_relay).unwrap();
    assert!(relayed.answered > 0, "{r:#?}");
    assert!(r.workers.iter().all(|w| w.answered > 0), "{r:#?}");
    // New workers are on probation: their answers were checked, and every check passed.
    assert!(r.dispatch.checked > 0, "{r:#?}");
    assert!(r.dispatch.quarantined.is_empty(), "{r:#?}");
    assert!(
        r.dispatch.worker_checks.values().all(|c| c[1] == 0),
        "{r:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafts_checked_through_the_swarm_give_the_models_tokens_in_fewer_passes() {
    // The trained qwen35moe: its MTP block's experts are slabs like the layers'; the router
    // keeps them (it alone drafts with them) and by default the sim drafts with it.
    let run = |speculative, draft| async move {
        let dir = tempfile::tempdir().unwrap();
        let mut o = options(dir.path());
        o.model = Some(trained_model());
        o.prompt = "The best thing about a good friend is".into();
        o.max_tokens = 24;
        o.speculative = speculative;
        o.draft = draft;
        run_local_swarm(&o).await.unwrap()
    };
    let plain = run(Some(Speculation::Off), None).await;
    let mtp = run(None, None).await;
    let ngram = run(Some(Speculation::Ngram), Some(4)).await;
    for r in [&plain, &mtp, &ngram] {
        assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
        assert_eq!(r.tokens, plain.tokens, "{:?}: {:?}", r.speculation, r.text);
        // Every token chosen from the same logits, bit for bit, drafts or not.
        assert_eq!(r.emitted_logits_digest, plain.emitted_logits_digest);
        // One round trip a layer a pass, none for the MTP block's layer (4).
        let s = r.speculation_stats;
        assert_eq!(s.expert_rounds, 4 * s.passes as u64, "{r:#?}");
        assert!(!r.dispatch.latency_ms.contains_key(&4), "{r:#?}");
    }
    assert_eq!(mtp.speculation, Speculation::Mtp);
    // Its drafts were computed by the router, nothing else was.
    assert!(mtp.dispatch.local > 0, "{mtp:#?}");
    assert_eq!(plain.dispatch.local + ngram.dispatch.local, 0);
    // A worker stopped mid-generation changes nothing either.
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.model = Some(trained_model());
    o.prompt = "The best thing about a good friend is".into();
    o.max_tokens = 24;
    o.kill_worker_after = Some(5);
    o.deadline = Duration::from_secs(3);
    let killed = run_local_swarm(&o).await.unwrap();
    assert!(killed.workers.iter().any(|w| w.killed), "{killed:#?}");
    assert!(
        killed.tokens_identical && killed.logits_bit_identical,
        "{killed:#?}"
    );
    assert_eq!(killed.tokens, plain.tokens);
    assert_eq!(killed.emitted_logits_digest, plain.emitted_logits_digest);
    let (p, m) = (plain.speculation_stats, mtp.speculation_stats);
    eprintln!(
        "plain {p:?}, mtp {m:?}, ngram {:?}",
        ngram.speculation_stats
    );
    assert!(m.passes < p.passes, "plain {p:?}, mtp {m:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_mid_generation_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    // Two workers holding every slab, a router holding none: each layer's groups go to both,
    // so the stopped worker is asked again after it stops, for certain.
    o.workers = 2;
    o.relayed = 0;
    o.router_experts = false;
    o.capacity = Some(1 << 30);
    o.kill_worker_after = Some(3);
    // Dialing the stopped worker waits for the deadline once.
    o.deadline = Duration::from_secs(3);
    let r = run_local_swarm(&o).await.unwrap();
    assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
    assert!(r.workers.iter().any(|w| w.killed));
    // It failed, and its groups went to the other worker.
    let failed = r.dispatch.dropped.get("failed").copied().unwrap_or(0);
    assert!(
        failed >= 1,
        "the stopped worker was never asked again: {r:#?}"
    );
    assert!(r.dispatch.retried >= 1, "{r:#?}");
    assert!(r.dispatch.local <= r.dispatch.refereed, "{r:#?}");
    // The first failure marks it down: nothing more is sent to it. What was already on its
    // way when it stopped fails too: its dispatch of a layer and the second opinion asked of
    // it on the other's, each with the one its check drew ahead.
    assert!(
        failed <= 4,
        "the stopped worker was tried {failed} times: {r:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tickets_wrong_shapes_and_double_answers_are_dropped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.workers = 4;
    o.faults = vec![
        WorkerFault::Honest,
        WorkerFault::WrongTicket,
        WorkerFault::WrongShape,
        WorkerFault::AnswerTwice,
    ];
    let r = run_local_swarm(&o).await.unwrap();
    assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
    let dropped = |k: &str| r.dispatch.dropped.get(k).copied().unwrap_or(0);
    assert!(dropped("mismatched") >= 2, "{r:#?}");
    assert!(dropped("duplicate") >= 1, "{r:#?}");
    // The double answerer's first answers were valid and used.
    assert!(r.workers[3].answered > 0, "{r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_precision_on_the_wire_halves_the_bytes_and_stays_close() {
    let dir = tempfile::tempdir().unwrap();
    let exact = run_local_swarm(&options(&dir.path().join("f32")))
        .await
        .unwrap();
    let mut o = options(&dir.path().join("f16"));
    o.wire = moeswarm_protocol::WireType::F16;
    let r = run_local_swarm(&o).await.unwrap();
    assert_eq!(exact.max_abs_logit_diff, 0.0);
    // Rounded activations: close to the local logits, not equal.
    assert!(r.max_abs_logit_diff > 0.0, "{r:#?}");
    // f16 keeps 11 bits: seen here about 1 % of the largest logit over 3 layers.
    assert!(r.max_abs_logit_diff < 0.03 * r.max_abs_logit, "{r:#?}");
    if r.tokens == exact.tokens {
        // The outputs halve. Rows out halve too; beside them travels the index of rows sent
        // once for several experts (4 bytes a row, and rounded rows may route, so repeat,
        // differently).
        assert_eq!(r.dispatch.bytes_in * 2, exact.dispatch.bytes_in);
        let (half, full) = (r.dispatch.bytes_out, exact.dispatch.bytes_out);
        assert!(3 * half < 2 * full, "{half} of {full} bytes out");
    }
    assert_eq!(r.passed(), r.tokens_identical);
}

/// qwen35moe: the router runs the DeltaNet and attention layers and the shared experts, the
/// workers the routed experts.
fn qwen35_options(dir: &std::path::Path) -> SimOptions {
    let mut o = options(dir);
    o.model = Some(data("qwen35moe/small-q4_k.gguf"));
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen35moe_model_matches_the_local_run_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_local_swarm(&qwen35_options(dir.path())).await.unwrap();
    assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
    assert_eq!(r.tokens.len(), 8);
    assert_eq!(r.dispatch.local, 0, "{r:#?}");
    assert!(r.workers.iter().all(|w| w.answered > 0), "{r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen35moe_model_survives_a_worker_stopped_mid_generation() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = qwen35_options(dir.path());
    o.kill_worker_after = Some(3);
    o.deadline = Duration::from_secs(3);
    let r = run_local_swarm(&o).await.unwrap();
    assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
    assert!(r.workers.iter().any(|w| w.killed));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lying_workers_are_caught_and_quarantined_and_the_output_does_not_change() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.workers = 4;
    o.faults = vec![
        WorkerFault::Honest,
        // One value off by 1e-3 in every answer; NaN in every answer; wrong one time in five.
        WorkerFault::WrongValues(1000),
        WorkerFault::Nan(1000),
        WorkerFault::WrongValues(200),
    ];
    let r = run_local_swarm(&o).await.unwrap();
    assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
    let failed = |i: usize| {
        r.dispatch
            .worker_checks
            .get(&r.workers[i].peer)
            .map_or(0, |c| c[1])
    };
    for liar in 1..4 {
        assert!(failed(liar) >= 1, "worker {liar} was not caught: {r:#?}");
        assert!(r.dispatch.quarantined.contains_key(&r.workers[liar].peer));
    }
    // No false accusation, and the honest worker kept its traffic.
    assert_eq!(failed(0), 0, "{r:#?}");
    assert!(!r.dispatch.quarantined.contains_key(&r.workers[0].peer));
    assert!(r.workers[0].answered > 0, "{r:#?}");
    // Once caught, a liar gets nothing more: each is caught within its first lies, so it
    // answered far fewer dispatches than the run has (3 layers × 8 steps plus the logits).
    assert!(r.workers[1].answered <= 3, "{r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompts_dispatches_are_checked_on_a_sample_and_a_worker_wrong_throughout_is_caught_at_once(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.workers = 3;
    o.relayed = 0;
    o.max_tokens = 4;
    // A prompt of some 90 tokens uses every expert of every layer: each worker's share of a
    // layer is more groups than the two a check re-computes here.
    o.checks = moeswarm_node::dataplane::CheckPolicy {
        groups: 2,
        ..Default::default()
    };
    o.prompt = "A swarm of small machines holds one large model between them, and each token \
                visits a few of them."
        .into();
    o.faults = vec![
        WorkerFault::Honest,
        WorkerFault::WrongEverywhere,
        WorkerFault::Honest,
    ];
    let r = run_local_swarm(&o).await.unwrap();
    assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
    let d = &r.dispatch;
    // The prompt's dispatches were checked on samples: far from all their rows re-computed.
    assert!(d.checked_rows * 3 / 2 < d.checked_of_rows, "{r:#?}");
    // The worker wrong in every row is caught by its first checked dispatch, the prompt's
    // first layer, and is sent nothing more; the honest ones are never accused.
    let failed = |i: usize| d.worker_checks.get(&r.workers[i].peer).map_or(0, |c| c[1]);
    assert_eq!(failed(1), 1, "{r:#?}");
    assert_eq!(r.workers[1].answered, 1, "{r:#?}");
    assert_eq!(failed(0) + failed(2), 0, "{r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_liar_that_answers_right_until_it_is_proven_is_still_caught() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.workers = 2;
    o.relayed = 0;
    o.max_tokens = 24;
    // Honest for its first 40 answers (probation is 16 checks), then wrong in every one.
    // Proven workers are checked at a sampled rate: here half their answers. The honest
    // worker is the slower one, so the router sends the liar nearly everything (which of two
    // equal workers a router prefers is up to their first round trips).
    o.faults = vec![
        WorkerFault::SlowCompute(Duration::from_millis(20)),
        WorkerFault::WrongAfter(40),
    ];
    o.checks = moeswarm_node::dataplane::CheckPolicy {
        rate: 0.5,
        ..Default::default()
    };
    let r = run_local_swarm(&o).await.unwrap();
    let liar = &r.workers[1].peer;
    let checks = r.dispatch.worker_checks[liar];
    // It passed its probation, then was caught and quarantined.
    assert!(checks[0] >= 16, "{r:#?}");
    assert!(checks[1] >= 1, "the liar was never caught: {r:#?}");
    assert!(r.dispatch.quarantined.contains_key(liar), "{r:#?}");
    // Caught within a few of its lies: at a check rate of one half, 12 unchecked lies in a
    // row happen once in 4096 runs.
    assert!(r.workers[1].answered <= 40 + 12, "{r:#?}");
    assert_eq!(r.dispatch.worker_checks[&r.workers[0].peer][1], 0, "{r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_without_the_slabs_catches_liars_through_other_replicas_and_its_own_fetch() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.workers = 3;
    o.relayed = 0;
    // Every worker holds every slab; the router keeps none, so it checks each answer against
    // another worker's, and settles their disputes by fetching the slab and computing it.
    o.router_experts = false;
    o.capacity = Some(1 << 30);
    o.faults = vec![
        WorkerFault::Honest,
        WorkerFault::WrongValues(1000),
        WorkerFault::Nan(1000),
    ];
    let r = run_local_swarm(&o).await.unwrap();
    assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
    assert!(
        r.workers.iter().all(|w| w.slabs == r.workers[0].slabs),
        "{r:#?}"
    );
    let failed = |i: usize| {
        r.dispatch
            .worker_checks
            .get(&r.workers[i].peer)
            .map_or(0, |c| c[1])
    };
    for liar in 1..3 {
        assert!(failed(liar) >= 1, "worker {liar} was not caught: {r:#?}");
        assert!(r.dispatch.quarantined.contains_key(&r.workers[liar].peer));
    }
    assert_eq!(failed(0), 0, "{r:#?}");
    assert!(!r.dispatch.quarantined.contains_key(&r.workers[0].peer));
    // Nothing was computed from the router's own experts but what it fetched to referee.
    assert!(r.dispatch.local <= r.dispatch.refereed, "{r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_answering_the_same_nan_agree_on_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    // Both workers hold every slab and answer NaN alike; the router holds none. Each one's
    // NaN is checked against the other's: the same bits, yet no agreement.
    o.workers = 2;
    o.relayed = 0;
    o.router_experts = false;
    o.capacity = Some(1 << 30);
    o.faults = vec![WorkerFault::Nan(1000), WorkerFault::Nan(1000)];
    match run_local_swarm(&o).await {
        Ok(r) => panic!("a generation from two liars: {r:#?}"),
        Err(e) => {
            let e = format!("{e:#}");
            assert!(e.contains("no replica answered"), "{e}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_reads_and_one_that_freezes_mid_reply_cost_one_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.workers = 4;
    o.max_tokens = 4;
    o.deadline = Duration::from_secs(1);
    o.faults = vec![
        WorkerFault::Honest,
        WorkerFault::Honest,
        WorkerFault::NeverRead,
        WorkerFault::Freeze,
    ];
    let started = std::time::Instant::now();
    let r = run_local_swarm(&o).await.unwrap();
    assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
    let failed = r.dispatch.dropped.get("failed").copied().unwrap_or(0);
    assert!(failed >= 2, "{r:#?}");
    // Each stuck worker is given up on at its deadline and then avoided: a handful of
    // deadlines in all, not one per step (the bound is loose; it only catches a hang).
    assert!(failed <= 8, "{r:#?}");
    assert!(started.elapsed() < Duration::from_secs(120));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_rewrites_requests_or_replies_is_caught_by_the_signature_alone() {
    use moeswarm_node::dataplane::CheckPolicy;
    use moeswarm_relay::Tamper;
    for tamper in [Tamper::RequestRows, Tamper::ReplyRows] {
        let dir = tempfile::tempdir().unwrap();
        let mut o = options(dir.path());
        o.max_tokens = 4;
        o.relay_tamper = tamper;
        // No answer checks: only the reply's signature over the request can catch this.
        o.checks = CheckPolicy::never();
        let r = run_local_swarm(&o).await.unwrap();
        assert!(
            r.tokens_identical && r.logits_bit_identical,
            "{tamper:?}: {r:#?}"
        );
        let bad = r
            .dispatch
            .dropped
            .get("bad_signature")
            .copied()
            .unwrap_or(0);
        assert!(bad >= 1, "{tamper:?}: {r:#?}");
        // The relay lied, not the worker: nobody is quarantined for it.
        assert!(r.dispatch.quarantined.is_empty(), "{tamper:?}: {r:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_flood_at_the_workers_and_the_relay_does_not_stop_a_generation() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(dir.path());
    o.max_tokens = 4;
    // Twenty half-open handshakes a second at each worker and at the relay, started before
    // the router first dials (one every 3 s used to stall an endpoint for minutes).
    o.handshake_flood = Some(Duration::from_millis(50));
    let started = std::time::Instant::now();
    let r = run_local_swarm(&o).await.unwrap();
    assert!(r.tokens_identical && r.logits_bit_identical, "{r:#?}");
    // The workers computed it all, within their deadlines (no drop, no local fallback).
    assert_eq!(r.dispatch.local, 0, "{r:#?}");
    assert!(r.dispatch.dropped.is_empty(), "{r:#?}");
    assert!(r.handshakes_turned_away > 20, "{r:#?}");
    assert!(started.elapsed() < Duration::from_secs(120));
}
