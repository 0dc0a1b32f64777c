//! Blobs stored in a batch (what slicing does with a model's slabs) are indexed only once
//! their files are synced and in place, every `BATCH_BLOBS` of them and at the commit; a batch
//! dropped before its commit leaves no file and no index entry; the same bytes twice are one
//! blob.

use moeswarm_model::store::{BlobKind, Store, BATCH_BLOBS};
use moeswarm_protocol::BlobId;

fn blob(i: usize) -> Vec<u8> {
    format!("blob number {i} ").repeat(i % 7 + 1).into_bytes()
}

fn kind(i: usize) -> BlobKind {
    BlobKind::Slab {
        layer: (i / 64) as u32,
        expert: (i % 64) as u32,
    }
}

fn files(dir: &std::path::Path, sub: &str) -> usize {
    std::fs::read_dir(dir.join(sub)).map_or(0, |d| d.count())
}

#[test]
fn a_batch_indexes_whole_blobs_every_so_many_and_at_its_commit() {
    let dir = tempfile::tempdir().unwrap();
    let n = BATCH_BLOBS + 5;
    {
        let (store, _) = Store::open(dir.path()).unwrap();
        let mut batch = store.batch().unwrap();
        let mut ids = Vec::new();
        for i in 0..n {
            let id = batch.put_bytes(&blob(i), kind(i)).unwrap();
            assert_eq!(id, BlobId::of(&blob(i)));
            ids.push(id);
        }
        // The first BATCH_BLOBS are in: indexed, in place, nothing of theirs left in tmp/.
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(store.contains(id).unwrap(), i < BATCH_BLOBS, "blob {i}");
        }
        assert_eq!(files(dir.path(), "blobs"), BATCH_BLOBS);
        assert_eq!(files(dir.path(), "tmp"), n - BATCH_BLOBS);
        // The same bytes again are the blob already given, written once.
        assert_eq!(batch.put_bytes(&blob(n - 1), kind(0)).unwrap(), ids[n - 1]);
        batch.commit().unwrap();
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(store.read(id).unwrap(), blob(i));
            assert_eq!(store.entry(id).unwrap().unwrap().kind, kind(i));
        }
        assert_eq!(files(dir.path(), "blobs"), n);
        assert_eq!(files(dir.path(), "tmp"), 0);
    }
    // Reopened, every blob checks out and nothing was adopted: the index had them all.
    let (_store, report) = Store::open(dir.path()).unwrap();
    assert_eq!(report.blobs_ok, n, "{report:?}");
    assert!(
        report.adopted.is_empty() && report.dropped.is_empty(),
        "{report:?}"
    );
}

#[test]
fn a_batch_dropped_before_its_commit_leaves_nothing_of_what_it_had_not_installed() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let kept = store.put_bytes(b"stored before", BlobKind::Trunk).unwrap();
    let mut batch = store.batch().unwrap();
    let ids: Vec<BlobId> = (0..3)
        .map(|i| batch.put_bytes(&blob(i), kind(i)).unwrap())
        .collect();
    drop(batch);
    for id in &ids {
        assert!(!store.contains(id).unwrap());
    }
    assert!(store.contains(&kept).unwrap());
    assert_eq!(files(dir.path(), "tmp"), 0);
    assert_eq!(files(dir.path(), "blobs"), 1);
}
