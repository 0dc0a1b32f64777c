//! Batching changes no result: several sequences stepped together, prompts and decode tokens
//! mixed in one step, give every sequence bit for bit the logits it gets alone.

use moeswarm_testkit as common;

use common::data;
use moeswarm_engine::generate::{LocalModel, ModelSource};
use moeswarm_engine::trunk::ForwardTiming;

/// Three sequences: alone (a prompt, then three decode tokens each), and together (their
/// prompts in one step, cut differently, then decode steps with all three at once).
async fn batched_equals_alone(model: &str) {
    let m = LocalModel::load(&ModelSource::Gguf(data(model))).unwrap();
    let (trunk, exec) = (&m.trunk, &m.experts);
    let prompts: [&[u32]; 3] = [&[5, 17, 200, 3, 99], &[42], &[7, 7, 7, 8, 9, 10, 11]];
    let decode: [[u32; 3]; 3] = [[1, 2, 3], [250, 0, 4], [9, 9, 9]];
    let mut t = ForwardTiming::default();

    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    for (p, d) in prompts.iter().zip(&decode) {
        let mut cache = trunk.new_cache();
        let mut steps = vec![trunk.forward(&mut cache, p, exec, &mut t).await.unwrap()];
        for &tok in d {
            steps.push(
                trunk
                    .forward(&mut cache, &[tok], exec, &mut t)
                    .await
                    .unwrap(),
            );
        }
        alone.push(steps);
    }

    let mut caches: Vec<_> = prompts.iter().map(|_| trunk.new_cache()).collect();
    let mut together: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
    // Step 1: sequence 0's whole prompt, sequence 1's prompt, the first 3 of sequence 2's.
    // Step 2: sequence 0's first decode token, the rest of sequence 2's prompt (sequence 1
    // sits out). Then decode steps of whatever is left, all at once.
    let [c0, c1, c2] = &mut caches[..] else {
        unreachable!()
    };
    let out = trunk
        .forward_batch(
            &mut [(c0, prompts[0]), (c1, prompts[1]), (c2, &prompts[2][..3])],
            exec,
            &mut t,
        )
        .await
        .unwrap();
    together[0].push(out[0].clone());
    together[1].push(out[1].clone());
    let mut p2 = out[2].clone();
    let out = trunk
        .forward_batch(
            &mut [(c0, &decode[0][..1]), (c2, &prompts[2][3..])],
            exec,
            &mut t,
        )
        .await
        .unwrap();
    together[0].push(out[0].clone());
    p2.extend_from_slice(&out[1]);
    together[2].push(p2);
    let out = trunk
        .forward_batch(
            &mut [
                (c0, &decode[0][1..2]),
                (c1, &decode[1][..1]),
                (c2, &decode[2][..1]),
            ],
            exec,
            &mut t,
        )
        .await
        .unwrap();
    for (i, o) in out.into_iter().enumerate() {
        together[i].push(o);
    }
    let out = trunk
        .forward_batch(
            &mut [
                (c0, &decode[0][2..]),
                (c1, &decode[1][1..]),
                (c2, &decode[2][1..]),
            ],
            exec,
            &mut t,
        )
        .await
        .unwrap();
    // Sequences 1 and 2 sent two tokens in this step: two rows of logits each.
    let vocab = trunk.hyper().n_vocab as usize;
    together[0].push(out[0].clone());
    for (i, o) in out.iter().enumerate().skip(1) {
        for row in o.chunks(vocab) {
            together[i].push(row.to_vec());
        }
    }
    let flat =
        |v: &Vec<Vec<f32>>| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
    for i in 0..3 {
        assert_eq!(
            flat(&together[i]),
            flat(&alone[i]),
            "sequence {i} of {model} differs when batched"
        );
    }
}

#[tokio::test]
async fn qwen3moe_sequences_batched_get_the_logits_they_get_alone() {
    batched_equals_alone("small-q4_k.gguf").await;
}

#[tokio::test]
async fn qwen35moe_sequences_batched_get_the_logits_they_get_alone() {
    batched_equals_alone("qwen35moe/small-q4_k.gguf").await;
}

use moeswarm_testkit::faulty::MissingSlab;

/// Two steps of `tokens` (one each) alone: the logits of each step until one fails.
async fn two_steps_alone(
    trunk: &moeswarm_engine::trunk::Trunk,
    exec: &MissingSlab<'_>,
    tokens: [u32; 2],
) -> Vec<Vec<f32>> {
    let mut t = ForwardTiming::default();
    let mut cache = trunk.new_cache();
    let mut out = Vec::new();
    for tok in tokens {
        match trunk.forward(&mut cache, &[tok], exec, &mut t).await {
            Ok(logits) => out.push(logits),
            Err(_) => break,
        }
    }
    out
}

#[tokio::test]
async fn a_sequence_whose_experts_fail_fails_alone_and_the_others_get_their_logits() {
    let m = LocalModel::load(&ModelSource::Gguf(data("small-q4_k.gguf"))).unwrap();
    let trunk = &m.trunk;
    let seqs: Vec<[u32; 2]> = (0..6).map(|i| [3 + 37 * i, 11 + 5 * i]).collect();
    let last = trunk.hyper().n_layer - 1;
    // The first expert of the last layer that some of these sequences need and some do not.
    let mut chosen = None;
    for expert in 0..trunk.hyper().n_expert {
        let exec = MissingSlab {
            inner: &m.experts,
            layer: last,
            expert,
        };
        let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
        for s in &seqs {
            alone.push(two_steps_alone(trunk, &exec, *s).await);
        }
        let failing = alone.iter().filter(|a| a.len() < 2).count();
        if failing > 0 && failing < seqs.len() {
            chosen = Some((exec, alone));
            break;
        }
    }
    let (exec, alone) = chosen.expect("an expert some sequences need and others do not");

    // Together: each gets what it gets alone, a failure or the same logits, and the ones
    // that did not fail go on together to their second token.
    let mut t = ForwardTiming::default();
    let mut caches: Vec<_> = seqs.iter().map(|_| trunk.new_cache()).collect();
    let mut going: Vec<usize> = (0..seqs.len()).collect();
    for step in 0..2 {
        let mut batch: Vec<_> = caches
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| going.contains(i))
            .map(|(i, c)| (c, &seqs[i][step..step + 1]))
            .collect();
        let (each, _) = trunk
            .forward_batch_each(&mut batch, &exec, &mut t)
            .await
            .unwrap();
        let mut next = Vec::new();
        for (&i, got) in going.iter().zip(each) {
            match (alone[i].get(step), got) {
                (Some(logits), Ok(got)) => {
                    assert!(got == *logits, "sequence {i} step {step}: other logits");
                    next.push(i);
                }
                (None, Err(e)) => assert!(e.to_string().contains("no holder"), "{e}"),
                (a, b) => panic!("sequence {i} step {step}: alone {a:?}, together {b:?}"),
            }
        }
        going = next;
    }
}
