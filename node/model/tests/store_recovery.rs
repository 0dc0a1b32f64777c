//! A store never deletes a blob whose bytes match its name: a lost or corrupt index is
//! rebuilt from the blob files, a corrupt file is kept aside and never served, and a crash
//! between moving a blob in and flushing the index loses nothing.

use moeswarm_testkit as common;

use common::data;
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::{BlobKind, Store};
use moeswarm_protocol::{BlobId, Manifest, ModelId};

/// A store at `dir` holding the tiny model: its id and manifest, the store closed.
fn sliced(dir: &std::path::Path) -> (ModelId, Manifest) {
    let (store, _) = Store::open(dir).unwrap();
    let (model, manifest, _) =
        slice(&data("tiny-f32.gguf"), &store, SliceOptions::default()).unwrap();
    (model, manifest)
}

fn blob_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir.join("blobs")).unwrap().count()
}

/// The store at `dir` holds `model` whole, every blob reading back as its name.
fn holds_whole(dir: &std::path::Path, model: ModelId, manifest: &Manifest) {
    let (store, report) = Store::open(dir).unwrap();
    assert!(report.dropped.is_empty(), "{report:?}");
    assert_eq!(store.models().unwrap(), vec![model]);
    assert!(store.has_all_blobs(manifest).unwrap());
    assert_eq!(store.manifest(&model).unwrap(), *manifest);
    for (_, _, r) in manifest.all_slabs() {
        assert_eq!(BlobId::of(&store.read(&r.id).unwrap()), r.id);
    }
    // The slicer finds it sliced: the source mapping came back too.
    let (_, _, r) = slice(&data("tiny-f32.gguf"), &store, SliceOptions::default()).unwrap();
    assert!(r.already_sliced);
}

#[test]
fn a_deleted_index_is_rebuilt_from_the_blobs_and_none_is_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let (model, manifest) = sliced(dir.path());
    let files = blob_files(dir.path());
    std::fs::remove_dir_all(dir.path().join("index")).unwrap();
    let (store, report) = Store::open(dir.path()).unwrap();
    assert_eq!(report.adopted.len(), files, "{report:?}");
    assert_eq!(report.models_reindexed, vec![model]);
    assert!(report.quarantined.is_empty());
    // Kinds are read from the bytes.
    let slab = manifest.slab(1, 2).unwrap().id;
    assert_eq!(
        store.entry(&slab).unwrap().unwrap().kind,
        BlobKind::Slab {
            layer: 1,
            expert: 2
        }
    );
    assert_eq!(
        store.entry(&manifest.trunk.id).unwrap().unwrap().kind,
        BlobKind::Trunk
    );
    drop(store);
    assert_eq!(blob_files(dir.path()), files);
    holds_whole(dir.path(), model, &manifest);
}

#[test]
fn a_corrupt_index_is_kept_aside_and_rebuilt_from_the_blobs() {
    let dir = tempfile::tempdir().unwrap();
    let (model, manifest) = sliced(dir.path());
    let files = blob_files(dir.path());
    // Every file of the index overwritten with garbage.
    for entry in walk(&dir.path().join("index")) {
        let len = std::fs::metadata(&entry).unwrap().len() as usize;
        std::fs::write(&entry, vec![0xA5u8; len.max(64)]).unwrap();
    }
    let (store, report) = Store::open(dir.path()).unwrap();
    assert_eq!(report.adopted.len(), files, "{report:?}");
    assert!(report.dropped.is_empty(), "{report:?}");
    drop(store);
    assert_eq!(blob_files(dir.path()), files);
    holds_whole(dir.path(), model, &manifest);
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_blob_moved_in_but_never_indexed_is_adopted_not_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let id = store
        .put_bytes(b"finished before the crash", BlobKind::Unknown)
        .unwrap();
    // As if the process died after the rename, before the index reached the disk: the file
    // is there, the index does not name it.
    store.flush().unwrap();
    drop(store);
    let path = dir.path().join("blobs").join(id.to_hex());
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_dir_all(dir.path().join("index")).unwrap();
    let other = BlobId::of(b"another");
    std::fs::write(dir.path().join("blobs").join(other.to_hex()), b"another").unwrap();
    let (store, report) = Store::open(dir.path()).unwrap();
    let mut adopted = report.adopted.clone();
    adopted.sort();
    let mut want = vec![id, other];
    want.sort();
    assert_eq!(adopted, want);
    assert_eq!(store.read(&id).unwrap(), bytes);
    // Nothing names them: they are orphans, listed for `scrub` to collect.
    let mut orphans = store.orphans().unwrap();
    orphans.sort();
    assert_eq!(orphans, want);
}

#[test]
fn a_file_that_does_not_match_its_name_is_quarantined_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let (model, manifest) = sliced(dir.path());
    let liar = BlobId::of(b"what the name says");
    std::fs::write(
        dir.path().join("blobs").join(liar.to_hex()),
        b"something else",
    )
    .unwrap();
    let (store, report) = Store::open(dir.path()).unwrap();
    assert_eq!(report.quarantined.len(), 1, "{report:?}");
    assert!(report.quarantined[0].1.contains("hashes to"), "{report:?}");
    assert!(!store.contains(&liar).unwrap());
    assert!(dir.path().join("quarantine").join(liar.to_hex()).exists());

    // A blob that goes bad while the store is open: the reader gets an error, never the
    // bytes, and the blob leaves the index (its file kept aside).
    let victim = manifest.slab(0, 1).unwrap().id;
    let path = store.blob_path(&victim);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[10] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let err = store.read(&victim).unwrap_err();
    assert!(format!("{err:#}").contains("corrupt"), "{err:#}");
    assert!(!store.contains(&victim).unwrap());
    assert!(dir.path().join("quarantine").join(victim.to_hex()).exists());
    assert!(!store.has_all_blobs(&manifest).unwrap());
    assert_eq!(store.models().unwrap(), vec![model]);
}

#[test]
fn verify_all_finds_what_a_sizes_only_open_leaves_unhashed() {
    let dir = tempfile::tempdir().unwrap();
    let (_, manifest) = sliced(dir.path());
    let victim = manifest.slab(1, 0).unwrap().id;
    let path = dir.path().join("blobs").join(victim.to_hex());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[20] ^= 4;
    std::fs::write(&path, &bytes).unwrap();
    let (store, report) =
        Store::open_with(dir.path(), moeswarm_model::store::Check::Sizes).unwrap();
    assert!(
        report.dropped.is_empty(),
        "same size: a sizes-only open cannot tell"
    );
    let bad = store.verify_all().unwrap();
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0].0, victim);
    assert!(!store.contains(&victim).unwrap());
}

/// The tiny model rewritten with `key` set to `value` in its metadata, at `path`.
fn rewritten(path: &std::path::Path, key: &str, value: moeswarm_model::gguf::Value) {
    use moeswarm_model::gguf::{GgufWriter, MappedGguf, TensorLayout};
    let src = MappedGguf::open(&data("tiny-f32.gguf")).unwrap();
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
    let mut meta = src.header.metadata.clone();
    for (k, v) in meta.iter_mut() {
        if k == key {
            *v = value.clone();
        }
    }
    let mut w = GgufWriter::new(Vec::new(), &meta, &layouts).unwrap();
    for t in &src.header.tensors {
        w.write_tensor(src.bytes_of(t)).unwrap();
    }
    std::fs::write(path, w.finish().unwrap()).unwrap();
}

#[test]
fn a_slice_that_fails_leaves_no_blob_behind_and_keeps_what_was_there() {
    let dir = tempfile::tempdir().unwrap();
    let (model, manifest) = sliced(dir.path());
    let files = blob_files(dir.path());
    // An expert count that contradicts the expert tensors' shape.
    let bad = dir.path().join("bad.gguf");
    rewritten(
        &bad,
        "qwen3moe.expert_count",
        moeswarm_model::gguf::Value::U32(4),
    );
    let (store, _) = Store::open(dir.path()).unwrap();
    let err = slice(&bad, &store, SliceOptions::default()).unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("4 experts per layer") && text.contains("hold 8"),
        "{text}"
    );
    assert!(store.orphans().unwrap().is_empty());
    drop(store);
    assert_eq!(blob_files(dir.path()), files);
    holds_whole(dir.path(), model, &manifest);
}

#[test]
fn a_store_open_elsewhere_is_refused_by_name_and_nothing_in_it_is_moved() {
    let dir = tempfile::tempdir().unwrap();
    let (model, manifest) = sliced(dir.path());
    let (running, _) = Store::open(dir.path()).unwrap();
    // Something the running store is writing.
    let writing = dir.path().join("tmp").join("in-flight");
    std::fs::write(&writing, b"half a blob").unwrap();
    let err = Store::open(dir.path())
        .err()
        .expect("a second open is refused");
    assert!(
        matches!(err.root(), moeswarm_model::Error::StoreInUse { .. }),
        "{err:#}"
    );
    let text = format!("{err:#}");
    assert!(
        text.contains("in use by another process")
            && text.contains(&format!("pid {}", std::process::id())),
        "{text}"
    );
    // The live index stays where it is, and so does what it was writing.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with("index.unreadable")),
        "{names:?}"
    );
    assert!(writing.exists());
    assert!(running.has_all_blobs(&manifest).unwrap());
    drop(running);
    // Closed, it opens again at once, whole.
    holds_whole(dir.path(), model, &manifest);
}
