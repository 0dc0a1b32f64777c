//! Expert FFN time per call at batch 1 and 16 for Q4_K, Q6_K and Q8_0 on Qwen3-30B-A3B's expert
//! shape (2048 → 768 → 2048), with GB/s of weight bytes read, beside a streaming read of
//! the same weight bytes measured in the same run.
//!
//! `cargo bench -p moeswarm-engine --bench expert_ffn` (`RAYON_NUM_THREADS` sets the threads).

use std::hint::black_box;
use std::time::Instant;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use moeswarm_engine::ExpertWeights;
use moeswarm_model::gguf::GgmlType;
use moeswarm_model::slab::{build, SlabOrigin};
use moeswarm_model::SlabMatrix;
use moeswarm_protocol::BlobId;
use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

const EMBD: u64 = 2048;
const FF: u64 = 768;
const EXPERTS: usize = 48;

fn quantized(rows: u64, cols: u64, t: GgmlType, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<u8> {
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| StandardNormal.sample(rng))
        .map(|z: f32| z / (cols as f32).sqrt())
        .collect();
    let x = Tensor::from_vec(v, (rows as usize, cols as usize), &Device::Cpu).unwrap();
    QTensor::quantize(&x, moeswarm_engine::quant::candle_dtype(t).unwrap())
        .unwrap()
        .data()
        .unwrap()
        .into_owned()
}

fn per_call(reps: usize, mut f: impl FnMut(usize)) -> f64 {
    f(0);
    let t = Instant::now();
    for i in 0..reps {
        f(i);
    }
    t.elapsed().as_secs_f64() / reps as f64
}

fn main() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    println!(
        "{:<6} {:>5} {:>10} {:>12} {:>10} {:>12} {:>12}",
        "type", "batch", "mode", "ms/call", "GB/s", "read ms", "ffn/read"
    );
    for t in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
        let mut experts = Vec::new();
        let mut raw = Vec::new();
        for e in 0..EXPERTS {
            let (g, u, d) = (
                quantized(FF, EMBD, t, &mut rng),
                quantized(FF, EMBD, t, &mut rng),
                quantized(EMBD, FF, t, &mut rng),
            );
            fn m(dims: [u64; 2], dtype: GgmlType, data: &[u8]) -> SlabMatrix<'_> {
                SlabMatrix { dims, dtype, data }
            }
            let origin = SlabOrigin {
                architecture: "qwen3moe",
                model_name: "bench",
                source_header: BlobId::of(b"bench"),
                layer: 0,
                expert: e as u32,
            };
            let mut slab = Vec::new();
            build(
                &origin,
                &[
                    m([EMBD, FF], t, &g),
                    m([EMBD, FF], t, &u),
                    m([FF, EMBD], t, &d),
                ],
                &mut slab,
            )
            .unwrap();
            experts.push(ExpertWeights::from_slab_bytes(&slab).unwrap());
            raw.push([g, u, d].concat());
        }
        let weight_bytes = raw[0].len() as f64;
        // The floor: one streaming read of the expert's bytes (a matmul only reads them).
        let read = per_call(200, |i| {
            let s = raw[i % EXPERTS]
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .fold(0u64, u64::wrapping_add);
            black_box(s);
        });
        for batch in [1usize, 16] {
            let x: Vec<f32> = (0..batch * EMBD as usize)
                .map(|_| StandardNormal.sample(&mut rng))
                .collect();
            for (mode, cycle) in [("hot", 1usize), ("cycle48", EXPERTS)] {
                // Warm every expert once (candle repacks some types on first use).
                for e in &experts[..cycle] {
                    black_box(e.forward_rows(&x).unwrap());
                }
                let s = per_call(200, |i| {
                    black_box(experts[i % cycle].forward_rows(&x).unwrap());
                });
                println!(
                    "{:<6} {:>5} {:>10} {:>12.3} {:>10.2} {:>12.3} {:>12.2}",
                    t.name(),
                    batch,
                    mode,
                    s * 1e3,
                    weight_bytes / s / 1e9,
                    read * 1e3,
                    s / read
                );
            }
        }
    }
}
