//! Slicing: a MoE GGUF becomes one trunk, one slab per (layer, expert) and a manifest.
//!
//! The source is memory-mapped and each byte is read once: the trunk streams tensor by tensor
//! into the store, each slab is assembled from three byte ranges (no dequantization) and
//! hashed as it is stored. Works for files far larger than RAM.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use crate::error::{bail, Result};
use indicatif::ProgressBar;
use moeswarm_protocol::manifest::FORMAT;
use moeswarm_protocol::{BlobRef, Manifest, ModelId};
use serde::Serialize;

use crate::gguf::{GgufWriter, MappedGguf, TensorLayout};
use crate::slab::{self, SlabOrigin};
use crate::store::{BlobKind, Store};
use crate::{hyper_params, mtp_blocks, slab_layers};

/// What a slicing run did.
#[derive(Debug, Clone, Serialize)]
pub struct SliceReport {
    /// The model id (blake3 of the manifest).
    pub model_id: String,
    /// Trunk blob id.
    pub trunk_id: String,
    /// Trunk bytes.
    pub trunk_bytes: u64,
    /// Slabs in the manifest.
    pub slabs: usize,
    /// Bytes of all slabs.
    pub slab_bytes: u64,
    /// True when the store already held this model and nothing was done.
    pub already_sliced: bool,
    /// Wall time.
    pub seconds: f64,
    /// Source bytes per second read and written (0 when already sliced).
    pub gb_per_s: f64,
}

/// Options for [`slice`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SliceOptions {
    /// Show a progress bar on stderr (drawn only when it is a terminal).
    pub progress: bool,
}

fn bar(total: u64, show: bool) -> ProgressBar {
    if show {
        crate::progress::bytes_bar(total)
    } else {
        ProgressBar::hidden()
    }
}

/// Slices the GGUF at `path` into `store`. Slicing the same file again is a no-op.
pub fn slice(
    path: &Path,
    store: &Store,
    opts: SliceOptions,
) -> Result<(ModelId, Manifest, SliceReport)> {
    let before: std::collections::HashSet<_> =
        store.blobs()?.into_iter().map(|(id, _)| id).collect();
    let sliced = slice_into(path, store, opts);
    if sliced.is_err() {
        // A slice that fails leaves nothing behind: the blobs it wrote that no model names
        // are removed (a crash leaves them instead, and a re-run uses them).
        for id in store.orphans().unwrap_or_default() {
            if !before.contains(&id) {
                let _ = store.remove(&id);
            }
        }
    }
    sliced
}

fn slice_into(
    path: &Path,
    store: &Store,
    opts: SliceOptions,
) -> Result<(ModelId, Manifest, SliceReport)> {
    let start = Instant::now();
    let src = MappedGguf::open(path)?;
    let g = &src.header;
    let arch = g.architecture().unwrap_or_default();
    if !crate::hparams::KNOWN_ARCHITECTURES.contains(&arch) {
        bail!(
            "architecture {arch:?} is not one the engine runs ({}): not sliced",
            crate::hparams::KNOWN_ARCHITECTURES.join(", ")
        );
    }
    let layers = slab_layers(g)?;
    let hyper = hyper_params(g)?;
    let mtp_layers = mtp_blocks(g)?;
    // Every contradiction is found before anything is written.
    for l in &layers {
        if l.n_expert != u64::from(hyper.n_expert) {
            bail!(
                "metadata says {} experts per layer, but layer {}'s expert tensors hold {}",
                hyper.n_expert,
                l.layer,
                l.n_expert
            );
        }
    }
    let architecture = g.architecture().unwrap_or_default().to_string();
    let name = g
        .get("general.name")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    // A hybrid model's layer kinds, its mixer tensors checked before anything is stored.
    let layer_kinds = if architecture == crate::qwen35::ARCH {
        let shape = crate::qwen35::Qwen35Shape::from_gguf(g)?;
        shape.check_tensors(g)?;
        shape.kinds
    } else {
        Vec::new()
    };

    if let Some(model) = store.model_for_source(&g.header_id)? {
        let manifest = store.manifest(&model)?;
        if store.has_all_blobs(&manifest)? {
            let report = report(&model, &manifest, true, start, 0);
            return Ok((model, manifest, report));
        }
    }

    let pb = bar(g.tensor_bytes(), opts.progress);

    // Trunk: every tensor but the routed experts (the MTP blocks' other tensors included),
    // all metadata kept.
    let expert_names: std::collections::HashSet<&str> = layers
        .iter()
        .flat_map(|l| l.tensors().into_iter().map(|t| t.name.as_str()))
        .collect();
    let trunk_tensors: Vec<_> = g
        .tensors
        .iter()
        .filter(|t| !expert_names.contains(t.name.as_str()))
        .collect();
    let layouts: Vec<TensorLayout> = trunk_tensors.iter().map(|&t| t.into()).collect();
    pb.set_message("trunk");
    let trunk_id = store.put_stream(BlobKind::Trunk, |w| {
        let mut gw = GgufWriter::new(w, &g.metadata, &layouts)?;
        for t in &trunk_tensors {
            gw.write_tensor(src.bytes_of(t))?;
            pb.inc(t.n_bytes());
        }
        gw.finish()?.flush()?;
        Ok(())
    })?;
    let trunk_bytes = store.entry(&trunk_id)?.map(|e| e.size).unwrap_or(0);

    let origin = |layer, expert| SlabOrigin {
        architecture: &architecture,
        model_name: &name,
        source_header: g.header_id,
        layer,
        expert,
    };
    let slabs = put_slabs(
        &src,
        store,
        &layers,
        hyper.n_layer + mtp_layers,
        &origin,
        &pb,
    )?;
    pb.finish_and_clear();

    let manifest = Manifest {
        format: FORMAT,
        architecture,
        name,
        source_header: g.header_id,
        hyper,
        trunk: BlobRef {
            id: trunk_id,
            bytes: trunk_bytes,
        },
        slabs,
        layer_kinds,
        mtp_layers,
    };
    let model = store.add_model(&manifest)?;
    let report = report(&model, &manifest, false, start, g.tensor_bytes());
    Ok((model, manifest, report))
}

/// Builds and stores every expert's slab, layer by layer: the manifest's `[layer][expert]`.
/// One thread assembles and hashes the slabs while this one writes them, a few ahead.
fn put_slabs<'a>(
    src: &MappedGguf,
    store: &Store,
    layers: &[crate::hparams::ExpertTensors<'_>],
    n_layer: u32,
    origin: &(dyn Fn(u32, u32) -> SlabOrigin<'a> + Sync),
    pb: &ProgressBar,
) -> Result<Vec<Vec<BlobRef>>> {
    let mut slabs = vec![Vec::new(); n_layer as usize];
    for layer in layers {
        if slabs.get(layer.layer as usize).is_none() {
            bail!("expert layer index {} past block_count", layer.layer);
        }
    }
    let mut batch = store.batch()?;
    let (built_tx, built) = std::sync::mpsc::sync_channel::<Result<BuiltSlab>>(SLABS_AHEAD);
    let (free, free_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::scope(|s| -> Result<()> {
        s.spawn(move || {
            for layer in layers {
                for e in 0..layer.n_expert {
                    let mut buf = free_rx.try_recv().unwrap_or_default();
                    let matrices = layer.expert(src, e);
                    let made = slab::build(&origin(layer.layer, e as u32), &matrices, &mut buf)
                        .map(|()| BuiltSlab {
                            layer: layer.layer,
                            expert: e as u32,
                            id: moeswarm_protocol::BlobId::of(&buf),
                            bytes: buf,
                            source_bytes: layer.expert_bytes(),
                        });
                    // The writer stopped (it failed): nothing more to build.
                    if built_tx.send(made).is_err() {
                        return;
                    }
                }
            }
        });
        for made in built {
            let b = made?;
            pb.set_message(format!("layer {}", b.layer));
            let kind = BlobKind::Slab {
                layer: b.layer,
                expert: b.expert,
            };
            let id = batch.put_hashed(&b.bytes, b.id, kind)?;
            slabs[b.layer as usize].push(BlobRef {
                id,
                bytes: b.bytes.len() as u64,
            });
            pb.inc(b.source_bytes);
            let _ = free.send(b.bytes);
        }
        Ok(())
    })?;
    batch.commit()?;
    Ok(slabs)
}

/// Slabs assembled and hashed ahead of the one being written.
const SLABS_AHEAD: usize = 4;

/// One slab assembled and hashed, ready to write.
struct BuiltSlab {
    layer: u32,
    expert: u32,
    id: moeswarm_protocol::BlobId,
    bytes: Vec<u8>,
    source_bytes: u64,
}

fn report(model: &ModelId, m: &Manifest, already: bool, start: Instant, bytes: u64) -> SliceReport {
    let seconds = start.elapsed().as_secs_f64();
    SliceReport {
        model_id: model.to_string(),
        trunk_id: m.trunk.id.to_string(),
        trunk_bytes: m.trunk.bytes,
        slabs: m.all_slabs().count(),
        slab_bytes: m.expert_bytes(),
        already_sliced: already,
        seconds,
        gb_per_s: if already {
            0.0
        } else {
            bytes as f64 / seconds / 1e9
        },
    }
}
