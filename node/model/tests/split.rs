//! Split models (llama.cpp's gguf-split layout, parts written by gguf-py: `data/split/`) are
//! read as one: the same model id as the file they were split from, every part checked.

use std::path::{Path, PathBuf};

use moeswarm_model::gguf::{MappedGguf, ModelFiles, SplitError};
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::Store;
use moeswarm_model::Error;
use moeswarm_testkit::data;

fn part(name: &str, no: u64, count: u64) -> PathBuf {
    data("split").join(format!("{name}-{no:05}-of-{count:05}.gguf"))
}

fn sliced(
    path: &Path,
) -> moeswarm_model::Result<(moeswarm_protocol::ModelId, Store, tempfile::TempDir)> {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let (model, _, _) = slice(path, &store, SliceOptions::default())?;
    Ok((model, store, dir))
}

fn split_error(e: &Error) -> &SplitError {
    match e.root() {
        Error::Split(s) => s,
        other => panic!("not a split error: {other}"),
    }
}

/// Copies parts of `name` (`(file part, as part)`) into a fresh folder; the path of its first.
fn assemble(name: &str, count: u64, parts: &[(PathBuf, u64)]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    for (src, no) in parts {
        std::fs::copy(
            src,
            dir.path()
                .join(format!("{name}-{no:05}-of-{count:05}.gguf")),
        )
        .unwrap();
    }
    let first = dir.path().join(format!("{name}-00001-of-{count:05}.gguf"));
    (dir, first)
}

#[test]
fn a_split_model_slices_to_the_model_id_of_the_file_it_was_split_from() {
    let (merged, merged_store, _d) = sliced(&data("tiny-f32.gguf")).unwrap();
    let merged_manifest = merged_store.manifest(&merged).unwrap();
    for path in [
        part("tiny-f32-by-count", 1, 3),
        part("tiny-f32-by-count", 2, 3), // any part names the model
        part("tiny-f32-by-count", 3, 3),
        part("tiny-f32-by-size", 1, 2),
    ] {
        let (model, store, _d) = sliced(&path).unwrap();
        assert_eq!(model, merged, "{}", path.display());
        // The same blobs, byte for byte: trunk (no split.* key in it) and every slab.
        let manifest = store.manifest(&model).unwrap();
        assert_eq!(manifest, merged_manifest);
        let trunk = store.read(&manifest.trunk.id).unwrap();
        assert_eq!(trunk, merged_store.read(&manifest.trunk.id).unwrap());
        assert!(!trunk.windows(6).any(|w| w == b"split."));
    }
}

#[test]
fn the_parts_read_as_the_one_file_header_and_bytes() {
    let one = MappedGguf::open(&data("tiny-f32.gguf")).unwrap();
    let split = MappedGguf::open(&part("tiny-f32-by-count", 1, 3)).unwrap();
    assert_eq!(split.files().parts.len(), 3);
    assert_eq!(split.header.metadata, one.header.metadata);
    assert_eq!(split.header.header_id, one.header.header_id);
    assert_eq!(split.header.tensors.len(), one.header.tensors.len());
    for (a, b) in one.header.tensors.iter().zip(&split.header.tensors) {
        assert_eq!((&a.name, &a.dims, a.dtype), (&b.name, &b.dims, b.dtype));
        assert_eq!(one.bytes_of(a), split.bytes_of(b), "{}", a.name);
    }
    // A single file's own layout is kept.
    assert_eq!(one.files().parts.len(), 1);
    let raw = moeswarm_model::gguf::Gguf::open(&data("tiny-f32.gguf")).unwrap();
    assert_eq!(one.header.data_offset, raw.data_offset);
}

#[test]
fn a_missing_part_is_named_and_nothing_is_stored() {
    let (_d, first) = assemble(
        "m",
        3,
        &[
            (part("tiny-f32-by-count", 1, 3), 1),
            (part("tiny-f32-by-count", 3, 3), 3),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let e = slice(&first, &store, SliceOptions::default()).unwrap_err();
    match split_error(&e) {
        SplitError::MissingPart { path, no, count } => {
            assert_eq!((*no, *count), (2, 3));
            assert!(
                path.ends_with("m-00002-of-00003.gguf"),
                "{}",
                path.display()
            );
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("part 2 of 3 is missing"), "{e}");
    assert!(store.blobs().unwrap().is_empty());
    assert!(store.models().unwrap().is_empty());
}

#[test]
fn a_part_given_twice_is_refused() {
    let (_d, first) = assemble(
        "m",
        3,
        &[
            (part("tiny-f32-by-count", 1, 3), 1),
            (part("tiny-f32-by-count", 2, 3), 2),
            (part("tiny-f32-by-count", 2, 3), 3),
        ],
    );
    let e = ModelFiles::open(&first).unwrap_err();
    match &e {
        SplitError::ForeignPart { path, no, why } => {
            assert_eq!(*no, 3);
            assert!(path.ends_with("m-00003-of-00003.gguf"));
            assert!(why.contains("part 2 of 3"), "{why}");
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("copy of another part"), "{e}");
}

#[test]
fn a_part_of_another_model_is_refused() {
    let (_d, first) = assemble(
        "m",
        3,
        &[
            (part("tiny-f32-by-count", 1, 3), 1),
            (part("other-by-count", 2, 3), 2),
            (part("tiny-f32-by-count", 3, 3), 3),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let e = slice(&first, &store, SliceOptions::default()).unwrap_err();
    match split_error(&e) {
        SplitError::ForeignPart { path, no, why } => {
            assert_eq!(*no, 2);
            assert!(path.ends_with("m-00002-of-00003.gguf"));
            assert!(why.contains("tensors"), "{why}");
        }
        other => panic!("{other}"),
    }
    assert!(store.blobs().unwrap().is_empty());
    // Parts of two different splittings of the same model do not mix either.
    let (_d, first) = assemble(
        "m",
        2,
        &[
            (part("tiny-f32-by-size", 1, 2), 1),
            (part("tiny-f32-by-count", 2, 3), 2),
        ],
    );
    assert!(matches!(
        ModelFiles::open(&first),
        Err(SplitError::ForeignPart { no: 2, .. })
    ));
}

#[test]
fn a_part_whose_name_hides_its_siblings_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let lone = dir.path().join("model.gguf");
    std::fs::copy(part("tiny-f32-by-count", 1, 3), &lone).unwrap();
    let e = ModelFiles::open(&lone).unwrap_err();
    assert!(
        matches!(
            e,
            SplitError::Naming {
                no: 1,
                count: 3,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("-00001-of-00003.gguf"), "{e}");
}
