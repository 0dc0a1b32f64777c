//! qwen35moe files that differ from the reference models in the ways real files do (fused
//! gate/up experts, MTP blocks) give the same logits; broken ones are refused with an error
//! naming the tensor or key, before anything is stored.

use moeswarm_testkit as common;

use common::EditableGguf;
use moeswarm_engine::generate::{logits, LocalModel, ModelSource};
use moeswarm_model::gguf::{MappedGguf, Value};
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_model::{expert_layers, SlabView};
use std::path::Path;

const TOKENS: [u32; 8] = [5, 17, 200, 3, 99, 250, 0, 42];

async fn logits_of(source: ModelSource) -> Vec<f32> {
    let m = LocalModel::load(&source).unwrap();
    logits(&m.trunk, &m.experts, &TOKENS).await.unwrap()
}

fn load_error(path: &Path) -> String {
    match LocalModel::load(&ModelSource::Gguf(path.to_path_buf())) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => format!("{e:#}"),
    }
}

/// Slicing `path` fails with an error containing `needle`, and the store holds no model.
fn slice_refuses(path: &Path, needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let err = format!(
        "{:#}",
        slice(path, &store, SliceOptions::default()).unwrap_err()
    );
    assert!(err.contains(needle), "slice error {err:?} lacks {needle:?}");
    assert!(store.models().unwrap().is_empty());
}

#[tokio::test]
async fn fused_gate_up_experts_give_identical_slabs_and_logits() {
    let dir = tempfile::tempdir().unwrap();
    let split = common::data("qwen35moe/small-q4_k.gguf");
    let fused = dir.path().join("fused.gguf");
    let mut file = EditableGguf::open("qwen35moe/small-q4_k.gguf");
    file.fuse_gate_up();
    file.write(&fused);
    let g = MappedGguf::open(&fused).unwrap();
    assert!(g.header.tensor("blk.0.ffn_gate_up_exps.weight").is_some());
    assert!(g.header.tensor("blk.0.ffn_gate_exps.weight").is_none());

    // Whole-file runs: bit-identical logits.
    let want = logits_of(ModelSource::Gguf(split.clone())).await;
    assert_eq!(logits_of(ModelSource::Gguf(fused.clone())).await, want);

    // Sliced: every slab holds the same three matrices, and the sliced model's logits agree.
    let mut slabs = Vec::new();
    for (i, path) in [&split, &fused].into_iter().enumerate() {
        let store_dir = dir.path().join(format!("store{i}"));
        let (store, _) = Store::open(&store_dir).unwrap();
        let (model, manifest, _) = slice(path, &store, SliceOptions::default()).unwrap();
        let mut matrices = Vec::new();
        for (_, _, r) in manifest.all_slabs() {
            let bytes = store.read(&r.id).unwrap();
            let v = SlabView::parse(&bytes).unwrap();
            matrices.push(v.matrices.map(|m| (m.dims, m.dtype, m.data.to_vec())));
        }
        slabs.push(matrices);
        drop(store);
        let got = logits_of(ModelSource::Store {
            dir: store_dir,
            model,
        })
        .await;
        assert_eq!(got, want, "sliced model {i}");
    }
    assert_eq!(slabs[0].len(), 4 * 16);
    assert_eq!(slabs[0], slabs[1]);
}

#[tokio::test]
async fn an_mtp_block_is_not_part_of_the_forward_pass_but_is_sliced_with_its_experts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mtp.gguf");
    let mut file = EditableGguf::open("qwen35moe/tiny-f32.gguf");
    // A fifth block, a copy of the last (full attention), declared a multi-token-prediction
    // head, with the nextn tensors: three norms and eh_proj [2E, E] (attn_output's rows twice).
    let mut extra: Vec<_> = file
        .tensors
        .iter()
        .filter(|(t, _)| t.name.starts_with("blk.3."))
        .map(|(t, b)| {
            let mut t = t.clone();
            t.name = t.name.replacen("blk.3.", "blk.4.", 1);
            (t, b.clone())
        })
        .collect();
    let norm = extra
        .iter()
        .find(|(t, _)| t.name == "blk.4.attn_norm.weight")
        .cloned()
        .unwrap();
    for n in ["enorm", "hnorm", "shared_head_norm"] {
        let mut t = norm.clone();
        t.0.name = format!("blk.4.nextn.{n}.weight");
        extra.push(t);
    }
    let (out, bytes) = extra
        .iter()
        .find(|(t, _)| t.name == "blk.4.attn_output.weight")
        .cloned()
        .unwrap();
    let (cols, rows) = (out.dims[0] as usize, out.dims[1] as usize);
    assert_eq!(cols, rows, "tiny's attention output is square");
    let mut eh = out.clone();
    eh.name = "blk.4.nextn.eh_proj.weight".into();
    eh.dims = vec![2 * cols as u64, rows as u64];
    let eh_bytes: Vec<u8> = bytes
        .chunks_exact(cols * 4)
        .flat_map(|row| [row, row].concat())
        .collect();
    extra.push((eh, eh_bytes));
    file.tensors.extend(extra);
    file.set("qwen35moe.block_count", Value::U32(5));
    file.metadata
        .push(("qwen35moe.nextn_predict_layers".into(), Value::U32(1)));
    file.write(&path);

    let want = logits_of(ModelSource::Gguf(common::data("qwen35moe/tiny-f32.gguf"))).await;
    assert_eq!(logits_of(ModelSource::Gguf(path.clone())).await, want);

    let g = MappedGguf::open(&path).unwrap();
    assert_eq!(expert_layers(&g.header).unwrap().len(), 4);
    let store_dir = dir.path().join("store");
    let (store, _) = Store::open(&store_dir).unwrap();
    let (model, manifest, _) = slice(&path, &store, SliceOptions::default()).unwrap();
    assert_eq!(manifest.hyper.n_layer, 4);
    assert_eq!(manifest.mtp_layers, 1);
    assert_eq!(manifest.slabs.len(), 5, "the MTP block's experts are slabs");
    assert_eq!(manifest.slabs[4].len(), 8);
    let trunk = MappedGguf::open(&store.blob_path(&manifest.trunk.id)).unwrap();
    let names: Vec<&str> = trunk
        .header
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert!(names.contains(&"blk.4.nextn.eh_proj.weight"), "{names:?}");
    assert!(!names.contains(&"blk.4.ffn_gate_exps.weight"), "{names:?}");
    drop(store);
    let got = logits_of(ModelSource::Store {
        dir: store_dir,
        model,
    })
    .await;
    assert_eq!(got, want);
}

#[test]
fn the_manifest_records_each_layers_kind() {
    use moeswarm_protocol::LayerKind::{Full, Linear};
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    for name in ["tiny-f32", "small-q4_k"] {
        let path = common::data(&format!("qwen35moe/{name}.gguf"));
        let (_, manifest, _) = slice(&path, &store, SliceOptions::default()).unwrap();
        assert_eq!(manifest.architecture, "qwen35moe");
        assert_eq!(
            manifest.layer_kinds,
            [Linear, Linear, Linear, Full],
            "{name}"
        );
    }
}

#[test]
fn a_missing_linear_attention_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    for tensor in [
        "blk.1.ssm_beta.weight",
        "blk.0.ssm_conv1d.weight",
        "blk.3.attn_q_norm.weight",
    ] {
        let path = dir.path().join("broken.gguf");
        let mut file = EditableGguf::open("qwen35moe/tiny-f32.gguf");
        file.remove_tensor(tensor);
        file.write(&path);
        let err = load_error(&path);
        assert!(
            err.contains(tensor),
            "load error {err:?} does not name {tensor}"
        );
        slice_refuses(&path, tensor);
    }
}

#[test]
fn inconsistent_head_counts_are_named() {
    let dir = tempfile::tempdir().unwrap();
    for (key, value, needle) in [
        ("qwen35moe.ssm.time_step_rank", 3, "ssm.time_step_rank"),
        ("qwen35moe.ssm.inner_size", 48, "ssm.inner_size"),
        ("qwen35moe.attention.head_count", 3, "head_count"),
    ] {
        let path = dir.path().join("broken.gguf");
        let mut file = EditableGguf::open("qwen35moe/tiny-f32.gguf");
        file.set(key, Value::U32(value));
        file.write(&path);
        let err = load_error(&path);
        assert!(err.contains(needle), "{key} = {value}: load error {err:?}");
    }
}
