//! Synthetic models have llama.cpp's layout, are deterministic, and every expert type passes
//! the three-way check against the float64 oracle.

use moeswarm_testkit as common;

use common::data;
use moeswarm_engine::synth::{synth, Preset, SynthOptions};
use moeswarm_engine::verify::{verify, VerifyOptions, CANDLE_MIN_COSINE, REGROUP_MAX_REL};
use moeswarm_engine::ExpertWeights;
use moeswarm_model::gguf::{GgmlType, Gguf};
use moeswarm_model::slab::{build, SlabOrigin};
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_model::SlabMatrix;
use moeswarm_protocol::BlobId;

/// Keys in the order the file has them, or sorted (the qwen35moe reference writes them
/// sorted), with their value types.
fn keys(g: &Gguf, sorted: bool) -> Vec<(String, moeswarm_model::gguf::ValueType)> {
    let mut k: Vec<_> = g
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.value_type()))
        .collect();
    if sorted {
        k.sort_by(|a, b| a.0.cmp(&b.0));
    }
    k
}

/// `synth --arch arch --preset tiny` has the reference model's metadata keys and values (but
/// `skip`), tensor names, shapes, types and order.
fn assert_tiny_is_the_reference(arch: &str, reference: &str, sorted: bool, skip: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny.gguf");
    synth(
        &out,
        &Preset::named(arch, "tiny").unwrap(),
        SynthOptions::new(GgmlType::F32, 7),
    )
    .unwrap();
    let ours = Gguf::open(&out).unwrap();
    let theirs = Gguf::open(&data(reference)).unwrap();
    assert_eq!(keys(&ours, sorted), keys(&theirs, sorted));
    for (k, v) in &theirs.metadata {
        if k != "general.name" && !skip.contains(&k.as_str()) {
            assert_eq!(ours.get(k), Some(v), "{k}");
        }
    }
    let infos = |g: &Gguf| {
        g.tensors
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.dtype))
            .collect::<Vec<_>>()
    };
    assert_eq!(infos(&ours), infos(&theirs));
}

#[test]
fn tiny_preset_has_the_reference_models_names_shapes_and_metadata() {
    assert_tiny_is_the_reference("qwen3moe", "tiny-f32.gguf", false, &[]);
}

#[test]
fn the_same_arguments_give_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let p = Preset::named("qwen3moe", "tiny").unwrap();
    let [a, b, c] = ["a", "b", "c"].map(|n| dir.path().join(n));
    synth(&a, &p, SynthOptions::new(GgmlType::Q8_0, 1)).unwrap();
    synth(&b, &p, SynthOptions::new(GgmlType::Q8_0, 1)).unwrap();
    synth(&c, &p, SynthOptions::new(GgmlType::Q8_0, 2)).unwrap();
    let [a, b, c] = [a, b, c].map(|f| std::fs::read(f).unwrap());
    assert!(a == b);
    assert!(a != c);
}

#[test]
fn shapes_a_type_cannot_hold_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = synth(
        &dir.path().join("x"),
        &Preset::named("qwen3moe", "tiny").unwrap(),
        SynthOptions::new(GgmlType::Q4_K, 0),
    )
    .unwrap_err();
    assert!(err.to_string().contains("multiples of 256"), "{err}");
    assert!(Preset::named("qwen3moe", "huge")
        .unwrap_err()
        .to_string()
        .contains("unknown preset"));
    assert!(!dir.path().join("x").exists());
}

/// Synthesizes `preset` of `arch` with `t` experts, slices it and verifies every layer.
fn synth_slice_verify(
    arch: &str,
    preset: &str,
    t: GgmlType,
) -> (
    moeswarm_protocol::Manifest,
    moeswarm_engine::verify::VerifyReport,
) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    synth(
        &model,
        &Preset::named(arch, preset).unwrap(),
        SynthOptions::new(t, 3),
    )
    .unwrap();
    let (store, _) = Store::open(&dir.path().join("store")).unwrap();
    let (_, manifest, _) = slice(&model, &store, SliceOptions::default()).unwrap();
    let r = verify(
        &model,
        &store,
        &VerifyOptions {
            layer: None,
            tokens: 8,
            seed: 5,
        },
    )
    .unwrap();
    (manifest, r)
}

fn verify_type(preset: &str, t: GgmlType) {
    let (_, r) = synth_slice_verify("qwen3moe", preset, t);
    for l in &r.layers {
        assert!(
            l.regroup.max_rel <= REGROUP_MAX_REL,
            "{t} layer {}: {:?}",
            l.layer,
            l.regroup
        );
        assert!(
            l.candle.cosine >= CANDLE_MIN_COSINE,
            "{t} layer {}: {:?}",
            l.layer,
            l.candle
        );
        assert!(
            l.tokens_compared >= 6,
            "{t} layer {}: near ties {:?}",
            l.layer,
            l.topk_near_ties
        );
        assert_eq!(l.expert_types, [t.name(), t.name(), t.name()]);
    }
    assert!(r.passed);
}

#[test]
fn f32_experts_verify() {
    verify_type("tiny", GgmlType::F32);
}

#[test]
fn f16_experts_verify() {
    verify_type("tiny", GgmlType::F16);
}

#[test]
fn bf16_experts_verify() {
    verify_type("tiny", GgmlType::BF16);
}

#[test]
fn q8_0_experts_verify() {
    verify_type("tiny", GgmlType::Q8_0);
    // Rows of 256: the shape where candle's VNNI kernels would round Q8_0 activations as Q8_K.
    verify_type("small", GgmlType::Q8_0);
}

#[test]
fn q4_k_experts_verify() {
    verify_type("small", GgmlType::Q4_K);
}

#[test]
fn q5_k_experts_verify() {
    verify_type("small", GgmlType::Q5_K);
}

#[test]
fn q6_k_experts_verify() {
    verify_type("small", GgmlType::Q6_K);
}

#[test]
fn a_slab_of_a_type_without_a_kernel_is_refused_by_name() {
    let t = GgmlType::IQ4_XS;
    let (embd, ff) = (256u64, 256u64);
    let bytes = vec![0u8; t.row_bytes(embd).unwrap() as usize * ff as usize];
    let m = |dims| SlabMatrix {
        dims,
        dtype: t,
        data: &bytes,
    };
    let origin = SlabOrigin {
        architecture: "qwen3moe",
        model_name: "x",
        source_header: BlobId::of(b"x"),
        layer: 0,
        expert: 0,
    };
    let mut slab = Vec::new();
    build(
        &origin,
        &[m([embd, ff]), m([embd, ff]), m([ff, embd])],
        &mut slab,
    )
    .unwrap();
    let err = ExpertWeights::from_slab_bytes(&slab)
        .err()
        .expect("refused");
    assert!(
        format!("{err:#}").contains("iq4_xs has no kernel"),
        "{err:#}"
    );
}

#[test]
fn qwen35_tiny_preset_has_the_reference_models_names_shapes_and_metadata() {
    // feed_forward_length is only a fallback the reference sets to another number on purpose.
    assert_tiny_is_the_reference(
        "qwen35moe",
        "qwen35moe/tiny-f32.gguf",
        true,
        &["qwen35moe.feed_forward_length"],
    );
}

#[test]
fn qwen35_header_only_file_has_the_full_models_shape_without_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("full.gguf");
    let opts = SynthOptions {
        header_only: true,
        ..SynthOptions::new(GgmlType::Q4_K, 0)
    };
    synth(
        &out,
        &Preset::named("qwen35moe", "qwen35-122b-a10b").unwrap(),
        opts,
    )
    .unwrap();
    let g = Gguf::open(&out).unwrap();
    let h = moeswarm_model::hyper_params(&g).unwrap();
    assert_eq!(
        (h.n_layer, h.n_embd, h.n_expert, h.n_expert_used),
        (48, 3072, 256, 8)
    );
    assert_eq!(h.n_vocab, 248_320);
    let shape = moeswarm_model::qwen35::Qwen35Shape::from_gguf(&g).unwrap();
    let full: Vec<usize> = (0..48)
        .filter(|&l| shape.kinds[l] == moeswarm_model::qwen35::LayerKind::Full)
        .collect();
    assert_eq!(full, (0..12).map(|i| 4 * i + 3).collect::<Vec<_>>());
    // The data region is there in length (the file is sparse), so every tensor lies inside it.
    assert!(g.file_size >= g.data_offset + g.tensor_bytes());
    let on_disk = std::fs::metadata(&out).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert!(
        on_disk.blocks() * 512 < 1 << 30,
        "the data region was written"
    );
}

#[test]
fn qwen35_synthetic_models_slice_and_verify() {
    let (manifest, r) = synth_slice_verify("qwen35moe", "small", GgmlType::Q4_K);
    assert_eq!(manifest.layer_kinds.len(), 4);
    assert_eq!(r.layers.len(), 4);
    assert!(r.passed, "{r:?}");
}

#[test]
fn q4_0_experts_verify() {
    verify_type("small", GgmlType::Q4_0);
}
