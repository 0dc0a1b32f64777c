//! The GGUF reader and writer against files written by llama.cpp's own `gguf` writer.

use moeswarm_testkit as common;

use common::{data, index, MODELS};
use moeswarm_model::gguf::{GgmlType, Gguf, GgufError, GgufWriter, MappedGguf, TensorLayout};
use moeswarm_model::hyper_params;
use proptest::prelude::*;

#[test]
fn reads_every_reference_model_with_the_shapes_index_json_lists() {
    let idx = index();
    for name in MODELS {
        let g = Gguf::open(&data(name)).unwrap();
        let want = &idx["models"][name];
        assert_eq!(g.architecture(), Some("qwen3moe"), "{name}");
        let h = hyper_params(&g).unwrap();
        for (key, got) in [
            ("n_layer", h.n_layer),
            ("n_embd", h.n_embd),
            ("n_head", h.n_head),
            ("n_head_kv", h.n_head_kv),
            ("head_dim", h.head_dim),
            ("n_expert", h.n_expert),
            ("n_expert_used", h.n_expert_used),
            ("expert_ff", h.expert_ff),
            ("n_vocab", h.n_vocab),
        ] {
            assert_eq!(want[key].as_u64(), Some(got as u64), "{name} {key}");
        }
        // 3 global tensors + 12 per layer; the data region is exactly filled.
        assert_eq!(g.tensors.len() as u64, 3 + 12 * h.n_layer as u64, "{name}");
        let expert = g.tensor("blk.0.ffn_gate_exps.weight").unwrap();
        assert_eq!(
            expert.dims,
            vec![h.n_embd as u64, h.expert_ff as u64, h.n_expert as u64]
        );
        let last = g
            .tensors
            .iter()
            .map(|t| g.tensor_range(t).end)
            .max()
            .unwrap();
        assert_eq!(last, g.file_size, "{name}");
    }
    let small = Gguf::open(&data("small-q4_k.gguf")).unwrap();
    assert_eq!(
        small.tensor("blk.0.ffn_up_exps.weight").unwrap().dtype,
        GgmlType::Q4_K
    );
    assert_eq!(
        small.tensor("blk.0.attn_q.weight").unwrap().dtype,
        GgmlType::Q8_0
    );
}

#[test]
fn rewriting_a_reference_file_gives_the_same_bytes() {
    for name in MODELS {
        let src = MappedGguf::open(&data(name)).unwrap();
        let layouts: Vec<TensorLayout> = src
            .header
            .tensors
            .iter()
            .map(|t| TensorLayout {
                name: t.name.clone(),
                dims: t.dims.clone(),
                dtype: t.dtype,
            })
            .collect();
        let mut w = GgufWriter::new(Vec::new(), &src.header.metadata, &layouts).unwrap();
        for t in &src.header.tensors {
            w.write_tensor(src.bytes_of(t)).unwrap();
        }
        let out = w.finish().unwrap();
        assert!(
            out == std::fs::read(data(name)).unwrap(),
            "{name} did not round-trip"
        );
    }
}

#[test]
fn version_2_files_read_the_same() {
    let (mut bytes, v3) = tiny();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let v2 = Gguf::from_bytes(&bytes).unwrap();
    assert_eq!(v2.version, 2);
    assert_eq!(
        (v2.metadata, v2.tensors, v2.data_offset),
        (v3.metadata, v3.tensors, v3.data_offset)
    );
}

fn tiny() -> (Vec<u8>, Gguf) {
    let bytes = std::fs::read(data("tiny-f32.gguf")).unwrap();
    let g = Gguf::from_bytes(&bytes).unwrap();
    (bytes, g)
}

#[test]
fn truncation_anywhere_in_the_header_or_data_is_an_error() {
    let (bytes, g) = tiny();
    for cut in 0..g.data_offset as usize {
        let err = Gguf::from_bytes(&bytes[..cut]).unwrap_err();
        assert!(
            matches!(
                err,
                GgufError::Truncated { .. } | GgufError::TooLarge { .. }
            ),
            "cut at {cut}: {err}"
        );
    }
    // Cut inside the tensor data: the last tensor then lies past the end.
    let err = Gguf::from_bytes(&bytes[..bytes.len() - 1]).unwrap_err();
    assert!(matches!(err, GgufError::OutOfRange { .. }), "{err}");
}

/// Byte position of the first tensor info's fields in tiny-f32.gguf.
fn first_tensor_info(bytes: &[u8], g: &Gguf) -> usize {
    let name = g.tensors[0].name.as_bytes();
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap();
    at + name.len()
}

#[test]
fn malformed_fields_get_errors_that_name_them() {
    let (bytes, g) = tiny();
    let edit = |at: usize, new: &[u8]| {
        let mut b = bytes.clone();
        b[at..at + new.len()].copy_from_slice(new);
        b
    };
    let msg = |b: &[u8]| Gguf::from_bytes(b).unwrap_err().to_string();

    assert!(msg(&edit(0, b"GGML")).contains("not a GGUF"));
    assert!(msg(&edit(4, &1u32.to_le_bytes())).contains("version 1"));
    assert!(msg(&edit(4, &9u32.to_le_bytes())).contains("version 9"));
    assert!(msg(&edit(8, &u64::MAX.to_le_bytes())).contains("tensor count"));
    assert!(msg(&edit(16, &(1u64 << 40).to_le_bytes())).contains("metadata count"));
    // First key's length.
    assert!(msg(&edit(24, &(1u64 << 50).to_le_bytes())).contains("length of metadata key"));
    // First value's type (after the 8-byte length and the key "general.architecture").
    let ty = 24 + 8 + "general.architecture".len();
    assert!(msg(&edit(ty, &77u32.to_le_bytes())).contains("unknown value type 77"));

    let t = first_tensor_info(&bytes, &g);
    assert!(msg(&edit(t, &9u32.to_le_bytes())).contains("9 dimensions"));
    assert!(msg(&edit(t + 4, &0u64.to_le_bytes())).contains("size 0"));
    assert!(msg(&edit(t + 4, &u64::MAX.to_le_bytes())).contains("whole number"));
    let ty = t + 4 + 16;
    let e = msg(&edit(ty, &31u32.to_le_bytes()));
    assert!(
        e.contains("unknown type id 31") && e.contains("token_embd.weight"),
        "{e}"
    );
    // An f32 tensor relabelled q4_k: 64 elements are not a whole 256-element block.
    assert!(msg(&edit(ty, &12u32.to_le_bytes())).contains("whole number"));
    let off = ty + 4;
    assert!(msg(&edit(off, &(1u64 << 40).to_le_bytes())).contains("past the end"));
    assert!(msg(&edit(off, &3u64.to_le_bytes())).contains("not aligned"));
    assert!(msg(&edit(off, &65792u64.to_le_bytes())).contains("overlap"));
}

#[test]
fn every_known_type_has_a_byte_size_even_without_a_kernel() {
    for t in GgmlType::all() {
        let row = t.row_bytes(t.block_size() * 4).unwrap();
        assert_eq!(row, 4 * t.block_bytes(), "{t}");
    }
    assert_eq!(GgmlType::from_id(16).unwrap().block_bytes(), 66); // IQ2_XXS
    assert_eq!(GgmlType::from_id(39).unwrap().block_bytes(), 17); // MXFP4
    assert_eq!(GgmlType::from_id(23).unwrap().block_bytes(), 136); // IQ4_XS
    assert_eq!(GgmlType::from_id(34).unwrap().block_bytes(), 54); // TQ1_0
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn corrupt_headers_never_panic(pos in 0usize..6300, byte in any::<u8>(), cut in 0usize..700_000) {
        let (mut bytes, _) = tiny();
        bytes[pos] = byte;
        bytes.truncate(cut);
        let _ = Gguf::from_bytes(&bytes);
    }
}
