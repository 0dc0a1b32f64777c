//! The manifest: the canonical, deterministic description of a sliced model.
//!
//! It names the architecture, the hyper-parameters, the trunk blob and every slab blob
//! `[layer][expert]`. There is exactly one serialization ([`Manifest::to_bytes`], compact JSON
//! with a fixed field order); [`Manifest::from_bytes`] refuses any other spelling of the same
//! content, so the model id, the blake3 of those bytes, names the model unambiguously.

use serde::{Deserialize, Serialize};

use crate::ids::{BlobId, ModelId};
use crate::limits::{MAX_EXPERTS, MAX_LAYERS, MAX_MANIFEST_BYTES, MAX_NAME_BYTES};

/// The manifest format this code writes and reads.
pub const FORMAT: u32 = 1;

/// A blob named by its id, with its length so fetchers and planners know the cost up front.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlobRef {
    /// blake3 of the blob's bytes.
    pub id: BlobId,
    /// The blob's length in bytes.
    pub bytes: u64,
}

/// The hyper-parameters a router needs to run the trunk and a worker needs to run a slab.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HyperParams {
    /// Transformer blocks.
    pub n_layer: u32,
    /// Hidden size.
    pub n_embd: u32,
    /// Query heads.
    pub n_head: u32,
    /// Key/value heads (GQA).
    pub n_head_kv: u32,
    /// Size of one attention head.
    pub head_dim: u32,
    /// Routed experts per MoE layer.
    pub n_expert: u32,
    /// Experts chosen per token (top-k).
    pub n_expert_used: u32,
    /// Inner size of one expert's FFN.
    pub expert_ff: u32,
    /// Vocabulary size.
    pub n_vocab: u32,
    /// Trained context length.
    pub context_length: u32,
    /// RoPE base frequency.
    pub rope_freq_base: f32,
    /// Epsilon of every RMS norm.
    pub rms_eps: f32,
}

/// What mixes tokens in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Gated DeltaNet: linear attention with a fixed-size recurrent state.
    Linear,
    /// Softmax attention over a KV cache.
    Full,
}

/// The canonical description of a sliced model. See the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: u32,
    /// GGUF `general.architecture`, e.g. `qwen3moe`.
    pub architecture: String,
    /// GGUF `general.name`.
    pub name: String,
    /// blake3 of the source GGUF's header bytes; every slab repeats it.
    pub source_header: BlobId,
    /// Model shape.
    pub hyper: HyperParams,
    /// Everything but the routed experts.
    pub trunk: BlobRef,
    /// `slabs[layer][expert]`; a layer without routed experts has an empty list.
    pub slabs: Vec<Vec<BlobRef>>,
    /// Each layer's token mixer. Empty (and then left out of the bytes) when every layer is
    /// full attention, as in `qwen3moe`; a hybrid model lists all `n_layer`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_kinds: Vec<LayerKind>,
    /// Multi-token-prediction blocks after the `n_layer` layers (`nextn_predict_layers`): the
    /// router runs them only to draft tokens. Their routed experts are slabs like any layer's,
    /// listed in `slabs` after the layers' (layer index `n_layer + i`). Left out of the bytes
    /// when 0, so a model without them keeps its id.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtp_layers: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Why a manifest was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ManifestError {
    /// More bytes than [`MAX_MANIFEST_BYTES`].
    #[error("manifest is {0} bytes, over the limit of {MAX_MANIFEST_BYTES}")]
    TooLarge(usize),
    /// Not JSON of the manifest's shape.
    #[error("manifest does not parse: {0}")]
    Malformed(String),
    /// The same content spelled differently from the canonical form.
    #[error("manifest is not in canonical form (re-serializing gives other bytes)")]
    NotCanonical,
    /// Parsed, but the content contradicts itself.
    #[error("manifest is invalid: {0}")]
    Invalid(String),
}

impl Manifest {
    /// The one serialization of this manifest.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a manifest always serializes")
    }

    /// The model id: blake3 of [`Manifest::to_bytes`].
    pub fn id(&self) -> ModelId {
        ModelId::of_manifest_bytes(&self.to_bytes())
    }

    /// Parses and validates manifest bytes; refuses anything but the canonical form.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ManifestError> {
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(ManifestError::TooLarge(bytes.len()));
        }
        let manifest: Manifest =
            serde_json::from_slice(bytes).map_err(|e| ManifestError::Malformed(e.to_string()))?;
        manifest.validate()?;
        if manifest.to_bytes() != bytes {
            return Err(ManifestError::NotCanonical);
        }
        Ok(manifest)
    }

    /// Checks that the content is consistent and within limits.
    pub fn validate(&self) -> Result<(), ManifestError> {
        let bad = |m: String| Err(ManifestError::Invalid(m));
        let h = &self.hyper;
        if self.format != FORMAT {
            return bad(format!("format {} (this node reads {FORMAT})", self.format));
        }
        if self.architecture.is_empty() || self.architecture.len() > MAX_NAME_BYTES {
            return bad(format!(
                "architecture name of {} bytes",
                self.architecture.len()
            ));
        }
        if self.name.len() > MAX_NAME_BYTES {
            return bad(format!("model name of {} bytes", self.name.len()));
        }
        if h.n_layer == 0 || h.n_layer > MAX_LAYERS {
            return bad(format!("n_layer {} (1..={MAX_LAYERS})", h.n_layer));
        }
        if h.n_expert == 0 || h.n_expert > MAX_EXPERTS {
            return bad(format!("n_expert {} (1..={MAX_EXPERTS})", h.n_expert));
        }
        if h.n_expert_used == 0 || h.n_expert_used > h.n_expert {
            return bad(format!(
                "n_expert_used {} with {} experts",
                h.n_expert_used, h.n_expert
            ));
        }
        if h.n_head == 0 || h.n_head_kv == 0 || !h.n_head.is_multiple_of(h.n_head_kv) {
            return bad(format!(
                "n_head {} is not a multiple of n_head_kv {}",
                h.n_head, h.n_head_kv
            ));
        }
        for (what, v) in [
            ("n_embd", h.n_embd),
            ("head_dim", h.head_dim),
            ("expert_ff", h.expert_ff),
            ("n_vocab", h.n_vocab),
        ] {
            if v == 0 {
                return bad(format!("{what} is 0"));
            }
        }
        for (what, v) in [("rope_freq_base", h.rope_freq_base), ("rms_eps", h.rms_eps)] {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("{what} is {v}"));
            }
        }
        if self.mtp_layers > MAX_LAYERS - h.n_layer {
            return bad(format!(
                "{} MTP blocks after {} layers (at most {MAX_LAYERS} in all)",
                self.mtp_layers, h.n_layer
            ));
        }
        if self.slabs.len() != self.slab_layers() as usize {
            return bad(format!(
                "{} slab layers for {} layers and {} MTP blocks",
                self.slabs.len(),
                h.n_layer,
                self.mtp_layers
            ));
        }
        for (layer, slabs) in self.slabs.iter().enumerate() {
            if !slabs.is_empty() && slabs.len() != h.n_expert as usize {
                return bad(format!(
                    "layer {layer} lists {} slabs, not {}",
                    slabs.len(),
                    h.n_expert
                ));
            }
        }
        if !self.layer_kinds.is_empty() && self.layer_kinds.len() != h.n_layer as usize {
            return bad(format!(
                "{} layer kinds for {} layers",
                self.layer_kinds.len(),
                h.n_layer
            ));
        }
        if self.slabs.iter().all(Vec::is_empty) {
            return bad("no layer has routed experts".into());
        }
        Ok(())
    }

    /// Layers with slabs: the `n_layer` layers, then the MTP blocks.
    pub fn slab_layers(&self) -> u32 {
        self.hyper.n_layer + self.mtp_layers
    }

    /// The slab layers of the MTP blocks: `n_layer..n_layer + mtp_layers`.
    pub fn mtp_slab_layers(&self) -> std::ops::Range<u32> {
        self.hyper.n_layer..self.slab_layers()
    }

    /// The slab of `expert` in `layer`, if the model has one there.
    pub fn slab(&self, layer: u32, expert: u32) -> Option<&BlobRef> {
        self.slabs.get(layer as usize)?.get(expert as usize)
    }

    /// Every slab with its (layer, expert).
    pub fn all_slabs(&self) -> impl Iterator<Item = (u32, u32, &BlobRef)> {
        self.slabs.iter().enumerate().flat_map(|(l, slabs)| {
            slabs
                .iter()
                .enumerate()
                .map(move |(e, r)| (l as u32, e as u32, r))
        })
    }

    /// The token mixer of `layer` (full attention where the manifest lists no kinds).
    pub fn layer_kind(&self, layer: u32) -> LayerKind {
        self.layer_kinds
            .get(layer as usize)
            .copied()
            .unwrap_or(LayerKind::Full)
    }

    /// Bytes of all routed experts together.
    pub fn expert_bytes(&self) -> u64 {
        self.all_slabs().map(|(_, _, r)| r.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;

    fn blob_ref() -> impl Strategy<Value = BlobRef> {
        (proptest::array::uniform32(any::<u8>()), any::<u64>()).prop_map(|(id, bytes)| BlobRef {
            id: BlobId(id),
            bytes,
        })
    }

    fn positive_f32() -> impl Strategy<Value = f32> {
        (1e-30f32..1e30f32).prop_filter("finite", |v| v.is_finite())
    }

    prop_compose! {
        fn manifest()(
            n_layer in 1u32..5,
            mtp_layers in 0u32..2,
            n_expert in 1u32..9,
            used_frac in 0.0f64..1.0,
            kv in 1u32..5,
            group in 1u32..5,
            dims in proptest::array::uniform5(1u32..100_000),
            rope in positive_f32(),
            eps in positive_f32(),
            name in "[ -~]{0,40}",
            arch in "[a-z0-9]{1,16}",
            source in proptest::array::uniform32(any::<u8>()),
            trunk in blob_ref(),
        )(
            slabs in proptest::collection::vec(
                proptest::collection::vec(blob_ref(), n_expert as usize),
                (n_layer + mtp_layers) as usize),
            linear in proptest::collection::vec(any::<bool>(), n_layer as usize),
            hybrid in any::<bool>(),
            n_layer in Just(n_layer), mtp_layers in Just(mtp_layers),
            n_expert in Just(n_expert), used_frac in Just(used_frac),
            kv in Just(kv), group in Just(group), dims in Just(dims), rope in Just(rope),
            eps in Just(eps), name in Just(name), arch in Just(arch), source in Just(source),
            trunk in Just(trunk),
        ) -> Manifest {
            let used = 1 + ((n_expert - 1) as f64 * used_frac) as u32;
            Manifest {
                format: FORMAT,
                architecture: arch,
                name,
                source_header: BlobId(source),
                hyper: HyperParams {
                    n_layer, n_embd: dims[0], n_head: kv * group, n_head_kv: kv,
                    head_dim: dims[1], n_expert, n_expert_used: used, expert_ff: dims[2],
                    n_vocab: dims[3], context_length: dims[4], rope_freq_base: rope,
                    rms_eps: eps,
                },
                trunk,
                slabs,
                layer_kinds: if hybrid {
                    linear
                        .iter()
                        .map(|&l| if l { LayerKind::Linear } else { LayerKind::Full })
                        .collect()
                } else {
                    Vec::new()
                },
                mtp_layers,
            }
        }
    }

    proptest! {
        #[test]
        fn canonical_round_trip(m in manifest()) {
            let bytes = m.to_bytes();
            let back = Manifest::from_bytes(&bytes).unwrap();
            prop_assert_eq!(&back, &m);
            prop_assert_eq!(back.to_bytes(), bytes);
            prop_assert_eq!(back.id(), m.id());
        }

        #[test]
        fn any_other_spelling_is_refused(m in manifest()) {
            let pretty = serde_json::to_vec_pretty(&m).unwrap();
            prop_assert_eq!(Manifest::from_bytes(&pretty), Err(ManifestError::NotCanonical));
            let mut spaced = m.to_bytes();
            spaced.push(b' ');
            prop_assert_eq!(Manifest::from_bytes(&spaced), Err(ManifestError::NotCanonical));
        }

        #[test]
        fn different_content_different_id(m in manifest(), bump in 1u64..1000) {
            let mut other = m.clone();
            other.trunk.bytes = other.trunk.bytes.wrapping_add(bump);
            prop_assert_ne!(other.id(), m.id());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Manifest::from_bytes(&bytes);
        }
    }

    #[test]
    fn inconsistent_manifests_are_refused() {
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let m = manifest().new_tree(&mut runner).unwrap().current();
        let mut wrong_layers = m.clone();
        wrong_layers.slabs.push(vec![]);
        let mut wrong_topk = m.clone();
        wrong_topk.hyper.n_expert_used = m.hyper.n_expert + 1;
        let mut nan = m.clone();
        nan.hyper.rms_eps = f32::NAN;
        let mut short_kinds = m.clone();
        short_kinds.layer_kinds = vec![LayerKind::Linear; m.hyper.n_layer as usize + 1];
        let mut mtp_without_slabs = m.clone();
        mtp_without_slabs.mtp_layers += 1;
        for bad in [
            wrong_layers,
            wrong_topk,
            nan,
            short_kinds,
            mtp_without_slabs,
        ] {
            assert!(matches!(bad.validate(), Err(ManifestError::Invalid(_))));
        }
        let huge = vec![b' '; MAX_MANIFEST_BYTES + 1];
        assert_eq!(
            Manifest::from_bytes(&huge),
            Err(ManifestError::TooLarge(MAX_MANIFEST_BYTES + 1))
        );
    }
}
