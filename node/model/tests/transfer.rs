//! Verified blob transfer by byte ranges between two real stores: several sources, a lying
//! source, an interrupted transfer; only verified blobs enter the store.

use moeswarm_testkit as common;

use common::data;
use moeswarm_model::slice::{slice, SliceOptions};
use moeswarm_model::store::transfer::PartialBlob;
use moeswarm_model::store::{BlobKind, Store};
use moeswarm_protocol::BlobId;

/// A seeder store holding the sliced small model, and the largest blob in it (the trunk).
fn seeder() -> (tempfile::TempDir, Store, BlobId, u64) {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    let (_, manifest, _) =
        slice(&data("small-q4_k.gguf"), &store, SliceOptions::default()).unwrap();
    (dir, store, manifest.trunk.id, manifest.trunk.bytes)
}

fn fresh() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(dir.path()).unwrap();
    (dir, store)
}

#[test]
fn a_blob_assembled_from_ranges_of_two_sources_is_byte_identical() {
    let (_a, seed, id, size) = seeder();
    let (_b, other) = fresh();
    let (_c, me) = fresh();
    // A second honest source, filled by a whole-blob transfer.
    let mut p = PartialBlob::new(&other, id, size, BlobKind::Trunk).unwrap();
    let mut start = 0;
    while start < size {
        let end = (start + (1 << 20)).min(size);
        p.accept(start..end, &seed.encode_range(&id, start..end).unwrap())
            .unwrap();
        start = end;
    }
    p.finish(&other).unwrap();
    // Now half from each.
    let mid = size / 2 + 12_345;
    let mut p = PartialBlob::new(&me, id, size, BlobKind::Trunk).unwrap();
    p.accept(0..mid, &seed.encode_range(&id, 0..mid).unwrap())
        .unwrap();
    assert!(!p.missing().unwrap().is_empty());
    p.accept(mid..size, &other.encode_range(&id, mid..size).unwrap())
        .unwrap();
    assert_eq!(p.missing().unwrap(), vec![]);
    assert_eq!(p.finish(&me).unwrap(), id);
    assert_eq!(
        me.read(&id).unwrap(),
        std::fs::read(seed.blob_path(&id)).unwrap()
    );
}

#[test]
fn a_wrong_byte_is_caught_at_its_chunk_group_and_refetched_elsewhere() {
    let (_a, seed, id, size) = seeder();
    let (_b, me) = fresh();
    let range = 0..size.min(200_000);
    let good = seed.encode_range(&id, range.clone()).unwrap();
    let mut bad = good.clone();
    let flip = good.len() * 3 / 4;
    bad[flip] ^= 0x01;
    let mut p = PartialBlob::new(&me, id, size, BlobKind::Trunk).unwrap();
    let err = p.accept(range.clone(), &bad).unwrap_err();
    assert!(err.to_string().contains("failed verification"), "{err}");
    // What came before the bad group was kept; the bad group was not.
    let missing = p.missing().unwrap();
    assert!(
        missing[0].start > 0 && missing[0].start <= err.at.max(1),
        "{missing:?} vs {}",
        err.at
    );
    assert!(missing[0].start < range.end);
    assert!(!me.contains(&id).unwrap());
    // Finishing early stores nothing.
    let err = PartialBlob::new(&me, id, size, BlobKind::Trunk)
        .unwrap()
        .finish(&me)
        .unwrap_err();
    assert!(err.to_string().contains("incomplete"), "{err}");
    assert!(!me.contains(&id).unwrap());
    // The honest source fills the rest.
    for r in p.missing().unwrap() {
        for start in (r.start..r.end).step_by(1 << 20) {
            let end = (start + (1 << 20)).min(r.end);
            p.accept(start..end, &seed.encode_range(&id, start..end).unwrap())
                .unwrap();
        }
    }
    p.finish(&me).unwrap();
    assert_eq!(BlobId::of(&me.read(&id).unwrap()), id);
}

#[test]
fn an_interrupted_transfer_resumes_where_it_stopped() {
    let (_a, seed, id, size) = seeder();
    let (_b, me) = fresh();
    let range = 0..size.min(1 << 20);
    let encoded = seed.encode_range(&id, range.clone()).unwrap();
    let mut p = PartialBlob::new(&me, id, size, BlobKind::Trunk).unwrap();
    // The connection drops after 40% of the bytes.
    assert!(p
        .accept(range.clone(), &encoded[..encoded.len() * 2 / 5])
        .is_err());
    let missing = p.missing().unwrap();
    let kept = missing[0].start;
    assert!(kept > 0, "nothing kept from the partial stream");
    // Resume: ask only for what is missing.
    for r in missing {
        for start in (r.start..r.end).step_by(1 << 20) {
            let end = (start + (1 << 20)).min(r.end);
            p.accept(start..end, &seed.encode_range(&id, start..end).unwrap())
                .unwrap();
        }
    }
    p.finish(&me).unwrap();
    assert_eq!(me.read(&id).unwrap(), seed.read(&id).unwrap());
}

#[test]
fn bad_requests_and_corrupt_sources_are_refused() {
    let (dir, seed, id, size) = seeder();
    assert!(seed.encode_range(&id, 0..size + 1).is_err());
    assert!(seed.encode_range(&id, 5..5).is_err());
    assert!(seed.encode_range(&BlobId::of(b"nope"), 0..1).is_err());
    // A seeder whose own copy rotted does not serve it.
    let path = dir.path().join("blobs").join(id.to_hex());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let err = seed.encode_range(&id, 0..1000).unwrap_err();
    assert!(err.to_string().contains("corrupt on disk"), "{err}");
}

/// Sets this process's largest file size (`RLIMIT_FSIZE`), writes past it failing with EFBIG
/// rather than a signal. Each test runs in a process of its own (nextest).
fn file_size_limit(bytes: libc::rlim_t) {
    let lim = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain system calls on this process's own limits and signal disposition.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
}

#[test]
fn bytes_that_cannot_be_written_here_are_this_nodes_failure_not_the_senders() {
    let (_a, seed, id, size) = seeder();
    let (_b, me) = fresh();
    let mut p = PartialBlob::new(&me, id, size, BlobKind::Trunk).unwrap();
    // A short reply is the sender's doing.
    let encoded = seed.encode_range(&id, 0..size).unwrap();
    let short = p
        .accept(0..size, &encoded[..encoded.len() / 2])
        .unwrap_err();
    assert!(!short.local, "{short}");
    // Writing here fails (a disk that takes no more): the bytes were right.
    file_size_limit(4096);
    let refused = p.accept(0..size, &encoded).unwrap_err();
    file_size_limit(libc::RLIM_INFINITY);
    assert!(refused.local, "{refused}");
    assert!(refused.reason.contains("large"), "{refused}");
}
