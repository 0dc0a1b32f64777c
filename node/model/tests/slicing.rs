//! Slicing the reference models: byte-exact slabs and trunk, a crash-safe, self-checking store.

use moeswarm_testkit as common;

use common::{data, MODELS};
use moeswarm_model::gguf::{Gguf, MappedGguf};
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::{BlobKind, Store};
use moeswarm_model::{expert_layers, SlabView};
use moeswarm_protocol::slab::ExpertMatrix;
use moeswarm_protocol::{BlobId, Manifest};

fn blob_files(store: &Store) -> usize {
    std::fs::read_dir(store.root().join("blobs"))
        .unwrap()
        .count()
}

#[test]
fn slabs_and_trunk_are_byte_copies_that_reassemble_the_source() {
    for name in MODELS {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = Store::open(dir.path()).unwrap();
        let (model, manifest, report) =
            slice(&data(name), &store, SliceOptions::default()).unwrap();
        assert!(!report.already_sliced);
        let src = MappedGguf::open(&data(name)).unwrap();
        let h = &manifest.hyper;
        assert_eq!(manifest.id(), model);
        assert_eq!(
            Manifest::from_bytes(&store.read(&model.0).unwrap()).unwrap(),
            manifest
        );
        assert_eq!(report.slabs, (h.n_layer * h.n_expert) as usize, "{name}");

        // Every slab's three tensors are the source's byte range of that expert, and the
        // experts' slabs concatenated are the source tensor.
        for layer in expert_layers(&src.header).unwrap() {
            for (m, matrix) in ExpertMatrix::ALL.iter().enumerate() {
                let source = src.bytes_of(layer.matrices[m].tensor);
                let per = layer.matrix_bytes(m) as usize;
                let mut joined = Vec::with_capacity(source.len());
                for e in 0..h.n_expert {
                    let r = manifest.slab(layer.layer, e).unwrap();
                    let bytes = store.read(&r.id).unwrap();
                    assert_eq!(bytes.len() as u64, r.bytes);
                    assert_eq!(BlobId::of(&bytes), r.id);
                    let v = SlabView::parse(&bytes).unwrap();
                    assert_eq!((v.layer, v.expert), (layer.layer, e));
                    assert_eq!(v.source_header, src.header.header_id);
                    let d = v.matrices[m].data;
                    assert_eq!(
                        d,
                        &source[e as usize * per..(e as usize + 1) * per],
                        "{name} {matrix:?}"
                    );
                    joined.extend_from_slice(d);
                    let entry = store.entry(&r.id).unwrap().unwrap();
                    assert_eq!(
                        entry.kind,
                        BlobKind::Slab {
                            layer: layer.layer,
                            expert: e
                        }
                    );
                    assert_eq!(entry.model, Some(model));
                }
                assert!(
                    joined == source,
                    "{name}: slabs do not reassemble {matrix:?}"
                );
            }
        }

        // The trunk holds every other tensor byte for byte, and all the metadata.
        let trunk_bytes = store.read(&manifest.trunk.id).unwrap();
        let trunk = Gguf::from_bytes(&trunk_bytes).unwrap();
        assert_eq!(trunk.metadata, src.header.metadata);
        let experts = src
            .header
            .tensors
            .iter()
            .filter(|t| t.name.contains("_exps."))
            .count();
        assert_eq!(trunk.tensors.len() + experts, src.header.tensors.len());
        for t in &trunk.tensors {
            let orig = src.header.tensor(&t.name).unwrap();
            assert_eq!((&t.dims, t.dtype), (&orig.dims, orig.dtype));
            let r = trunk.tensor_range(t);
            assert!(
                trunk_bytes[r.start as usize..r.end as usize] == *src.bytes_of(orig),
                "{}",
                t.name
            );
        }
    }
}

#[test]
fn slicing_twice_is_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let (m1, _, _) = slice(&data("tiny-q8_0.gguf"), &store, SliceOptions::default()).unwrap();
    let files = blob_files(&store);
    let (m2, _, again) = slice(&data("tiny-q8_0.gguf"), &store, SliceOptions::default()).unwrap();
    assert_eq!(m1, m2);
    assert!(again.already_sliced);
    assert_eq!(blob_files(&store), files);
    drop(store);
    // Reopened: still there, nothing dropped.
    let (store, report) = Store::open(dir.path()).unwrap();
    assert!(report.dropped.is_empty());
    assert_eq!(report.blobs_ok, files);
    assert_eq!(store.models().unwrap(), vec![m1]);
}

#[test]
fn a_corrupt_or_missing_blob_is_reported_dropped_and_restored_by_slicing_again() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let (model, manifest, _) =
        slice(&data("tiny-f32.gguf"), &store, SliceOptions::default()).unwrap();
    let bad = manifest.slab(1, 3).unwrap().id;
    let gone = manifest.slab(0, 0).unwrap().id;
    let path = store.blob_path(&bad);
    drop(store);
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 5] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    std::fs::remove_file(dir.path().join("blobs").join(gone.to_hex())).unwrap();
    // A half-written blob left by a crash, and an unindexed file whose bytes match its name.
    std::fs::write(dir.path().join("tmp").join("crash.part"), b"partial").unwrap();
    std::fs::write(
        dir.path().join("blobs").join(BlobId::of(b"x").to_hex()),
        b"x",
    )
    .unwrap();

    let (store, report) = Store::open(dir.path()).unwrap();
    let mut dropped: Vec<BlobId> = report.dropped.iter().map(|d| d.0).collect();
    dropped.sort();
    let mut want = vec![bad, gone];
    want.sort();
    assert_eq!(dropped, want);
    assert!(report
        .dropped
        .iter()
        .any(|(_, why)| why.contains("hashes to")));
    assert!(report
        .dropped
        .iter()
        .any(|(_, why)| why.contains("missing")));
    assert_eq!(report.leftovers_removed, 1);
    // The unindexed file is a good blob: adopted, not deleted. The corrupt one is kept aside.
    assert_eq!(report.adopted, vec![BlobId::of(b"x")]);
    assert_eq!(store.read(&BlobId::of(b"x")).unwrap(), b"x");
    assert!(dir.path().join("quarantine").join(bad.to_hex()).exists());
    assert!(!store.contains(&bad).unwrap());
    assert!(!store.has_all_blobs(&manifest).unwrap());

    let (again, _, r) = slice(&data("tiny-f32.gguf"), &store, SliceOptions::default()).unwrap();
    assert_eq!(again, model);
    assert!(!r.already_sliced);
    assert!(store.has_all_blobs(&manifest).unwrap());
    assert_eq!(BlobId::of(&store.read(&bad).unwrap()), bad);
}

#[test]
fn unverified_bytes_never_enter_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let err = store
        .put_verified(
            BlobId::of(b"expected"),
            b"something else",
            BlobKind::Manifest,
        )
        .unwrap_err();
    assert!(err.to_string().contains("expected"), "{err}");
    assert_eq!(blob_files(&store), 0);
    assert_eq!(
        std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
        0
    );
    let id = store
        .put_verified(BlobId::of(b"ok"), b"ok", BlobKind::Manifest)
        .unwrap();
    assert_eq!(store.read(&id).unwrap(), b"ok");
}

#[test]
fn a_dense_model_is_refused_clearly() {
    let bytes = common::dense_model_bytes();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dense.gguf");
    std::fs::write(&file, &bytes).unwrap();
    let (store, _) = Store::open(&dir.path().join("store")).unwrap();
    let err = slice(&file, &store, SliceOptions::default()).unwrap_err();
    assert!(format!("{err:#}").contains("not a MoE model"), "{err:#}");
    assert_eq!(blob_files(&store), 0);
}
