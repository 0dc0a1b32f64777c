//! A speculative pass's positions dropped exactly: after a checkpoint, running rows and
//! rolling back to a prefix of them leaves the same bits as running only that prefix, in the
//! attention caches and in the Gated DeltaNet's conv window and recurrent state.

use moeswarm_testkit as common;

use common::{data, trained_model};
use moeswarm_engine::trunk::{ForwardTiming, Trunk};
use moeswarm_engine::LocalExecutor;
use moeswarm_model::gguf::MappedGguf;
use moeswarm_model::hyper_params;

fn load(path: &std::path::Path) -> (Trunk, LocalExecutor) {
    let g = MappedGguf::open(path).unwrap();
    let h = hyper_params(&g.header).unwrap();
    (
        Trunk::from_gguf(&g, &h).unwrap(),
        LocalExecutor::from_gguf(&g).unwrap(),
    )
}

async fn rolled_back_equals_never_run(path: &std::path::Path) {
    let (trunk, exec) = load(path);
    let t = &mut ForwardTiming::default();
    let prompt = [11u32, 42, 7, 300, 5, 91];
    let drafted = [17u32, 23, 99, 4];
    for keep in 0..=drafted.len() {
        // Speculate four tokens, keep `keep` of them, then run the next token.
        let mut cache = trunk.new_cache();
        trunk.forward(&mut cache, &prompt, &exec, t).await.unwrap();
        trunk.checkpoint(&mut cache);
        trunk.forward(&mut cache, &drafted, &exec, t).await.unwrap();
        trunk.rollback(&mut cache, prompt.len() + keep).unwrap();
        assert_eq!(cache.len(), prompt.len() + keep);
        let got = trunk.forward(&mut cache, &[8], &exec, t).await.unwrap();
        // The same without the speculation.
        let mut plain = trunk.new_cache();
        let mut tokens = prompt.to_vec();
        tokens.extend_from_slice(&drafted[..keep]);
        trunk.forward(&mut plain, &tokens, &exec, t).await.unwrap();
        let want = trunk.forward(&mut plain, &[8], &exec, t).await.unwrap();
        assert!(got == want, "{}: keeping {keep} of 4", path.display());
    }
}

#[tokio::test]
async fn rolling_back_a_speculative_pass_leaves_the_deltanet_and_attention_state_bit_exact() {
    rolled_back_equals_never_run(&trained_model()).await;
    rolled_back_equals_never_run(&data("qwen35moe/small-q4_k.gguf")).await;
}

#[tokio::test]
async fn rolling_back_a_qwen3moe_pass_cuts_its_kv_cache_exactly() {
    rolled_back_equals_never_run(&data("small-q4_k.gguf")).await;
}

#[tokio::test]
async fn a_rollback_outside_the_checkpointed_range_is_refused() {
    let (trunk, exec) = load(&trained_model());
    let t = &mut ForwardTiming::default();
    let mut cache = trunk.new_cache();
    trunk
        .forward(&mut cache, &[1, 2, 3], &exec, t)
        .await
        .unwrap();
    assert!(trunk.rollback(&mut cache, 2).is_err(), "no checkpoint");
    trunk.checkpoint(&mut cache);
    trunk.forward(&mut cache, &[4, 5], &exec, t).await.unwrap();
    let e = trunk.rollback(&mut cache, 2).unwrap_err().to_string();
    assert!(e.contains("checkpoint is at 3"), "{e}");
}
