//! One sequence's failure is its own: in a running batch, a sequence whose experts cannot be
//! had (a lost slab) is told so, and every other one gets exactly the tokens it gets alone.

use moeswarm_testkit as common;

use std::sync::Arc;

use common::data;
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::speculative::SpeculationConfig;
use moeswarm_engine::text::SamplingConfig;
use moeswarm_engine::LocalExecutor;
use moeswarm_node::api::batcher::{self, BatchOptions, Event, Request};
use moeswarm_testkit::faulty::MissingSlab;
use tokio::sync::mpsc;

/// A lost slab over `experts` (the batcher's executor is `'static`).
fn missing_slab(
    experts: &'static LocalExecutor,
    layer: u32,
    expert: u32,
) -> Arc<MissingSlab<'static>> {
    Arc::new(MissingSlab {
        inner: experts,
        layer,
        expert,
    })
}

/// What each prompt gets from a batcher over `exec` (all submitted at once): its text, or
/// the failure it was told.
async fn outcomes(
    prompts: &[Vec<u32>],
    exec: Arc<MissingSlab<'static>>,
    max_sequences: usize,
) -> Vec<Result<String, String>> {
    let m = LocalModel::load(&ModelSource::Gguf(data("small-q4_k.gguf"))).unwrap();
    let opts = BatchOptions {
        max_sequences,
        ..BatchOptions::default()
    };
    let b = batcher::spawn(Arc::new(m.trunk), exec, Arc::new(m.tokenizer), opts);
    let mut rxs = Vec::new();
    for p in prompts {
        let (tx, rx) = mpsc::unbounded_channel();
        b.submit(Request {
            prompt: p.clone(),
            max_tokens: 6,
            sampling: SamplingConfig {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                repetition_penalty: 1.0,
                seed: 0,
            },
            stop: Vec::new(),
            speculation: SpeculationConfig::OFF,
            events: tx,
        })
        .unwrap();
        rxs.push(rx);
    }
    let mut out = Vec::new();
    for mut rx in rxs {
        let mut text = String::new();
        let outcome = loop {
            match rx.recv().await {
                Some(Event::Text(t)) => text += &t,
                Some(Event::Started) => {}
                Some(Event::Done { .. }) => break Ok(text),
                Some(Event::Failed(why)) => break Err(why),
                None => break Err("ended without an answer".into()),
            }
        };
        out.push(outcome);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_whose_slab_is_lost_fails_alone_and_the_batch_goes_on() {
    let m = LocalModel::load(&ModelSource::Gguf(data("small-q4_k.gguf"))).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6u32).map(|i| vec![5 + 41 * i, 9 + 3 * i]).collect();
    let layer = m.trunk.hyper().n_layer - 1;
    // Kept for the test's life: the executors handed to batchers borrow them.
    let experts: &'static LocalExecutor = Box::leak(Box::new(m.experts.clone()));
    for expert in 0..m.trunk.hyper().n_expert {
        let exec = || missing_slab(experts, layer, expert);
        // Alone: one sequence at a time.
        let mut alone = Vec::new();
        for p in &prompts {
            alone.extend(outcomes(std::slice::from_ref(p), exec(), 1).await);
        }
        let failing = alone.iter().filter(|o| o.is_err()).count();
        if failing == 0 || failing == prompts.len() {
            continue;
        }
        // Together: each gets what it got alone, the failures with the slab named.
        let together = outcomes(&prompts, exec(), 16).await;
        for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
            match (a, t) {
                (Ok(a), Ok(t)) => assert_eq!(a, t, "sequence {i}"),
                (Err(_), Err(why)) => assert!(why.contains("no holder of slab"), "{why}"),
                _ => panic!("sequence {i}: alone {a:?}, together {t:?}"),
            }
        }
        return;
    }
    panic!("no expert of the last layer is needed by some of the prompts and not others");
}
