//! The store's sled index, behind a narrow type: blob entries, models, sources.
//!
//! Keys are one tag byte and a 32-byte id: `b` blob → [`BlobEntry`] (JSON), `m` model → empty,
//! `s` source header → model id.

use std::path::Path;

use crate::error::{Context, Result};
use moeswarm_protocol::{BlobId, ModelId};
use serde::{Deserialize, Serialize};

/// What a blob is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BlobKind {
    /// Everything but the routed experts.
    Trunk,
    /// One expert of one layer.
    Slab {
        /// Layer index.
        layer: u32,
        /// Expert index.
        expert: u32,
    },
    /// A model's manifest.
    Manifest,
    /// A blob adopted from its file whose bytes say none of the above.
    Unknown,
}

/// One indexed blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobEntry {
    /// Length in bytes.
    pub size: u64,
    /// What it is.
    #[serde(flatten)]
    pub kind: BlobKind,
    /// The model it was last indexed for.
    pub model: Option<ModelId>,
}

pub(super) struct Index {
    db: sled::Db,
}

fn key(tag: u8, id: &BlobId) -> [u8; 33] {
    let mut k = [0u8; 33];
    k[0] = tag;
    k[1..].copy_from_slice(&id.0);
    k
}

fn id_of(key: &[u8]) -> Option<BlobId> {
    Some(BlobId(key.get(1..33)?.try_into().ok()?))
}

/// Whether `e` is sled saying its files are locked by another handle (it reports that as an
/// ordinary I/O error, `Other`, naming the lock in its message).
pub(super) fn lock_held(e: &sled::Error) -> bool {
    match e {
        sled::Error::Io(io) => {
            io.kind() == std::io::ErrorKind::WouldBlock
                || io.to_string().contains("could not acquire lock")
        }
        _ => false,
    }
}

/// Why an index could not be opened, as far as what to do next is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpenFailure {
    /// Its files are not what sled wrote: kept aside, and rebuilt from the blobs.
    Unreadable,
    /// The disk is full: an error, and nothing is moved.
    DiskFull,
    /// Anything else (held by another process, not permitted, the disk failing): an error,
    /// and nothing is moved.
    Other,
}

/// What to make of `e`, an error opening or first reading an index.
pub(super) fn open_failure(e: &sled::Error) -> OpenFailure {
    use std::io::ErrorKind as K;
    match e {
        _ if lock_held(e) => OpenFailure::Other,
        sled::Error::Io(io) => match io.kind() {
            K::StorageFull | K::QuotaExceeded => OpenFailure::DiskFull,
            K::InvalidData | K::UnexpectedEof => OpenFailure::Unreadable,
            _ if io.raw_os_error() == Some(libc::ENOSPC) => OpenFailure::DiskFull,
            _ => OpenFailure::Other,
        },
        sled::Error::Corruption { .. } | sled::Error::Unsupported(_) => OpenFailure::Unreadable,
        sled::Error::ReportableBug(_) => OpenFailure::Unreadable,
        sled::Error::CollectionNotFound(_) => OpenFailure::Unreadable,
    }
}

impl Index {
    /// An index that lives only as long as the store is open (in temporary space, never in
    /// the store): what a read-only store is read through, built from its blob files.
    pub(super) fn temporary() -> Result<Self> {
        let db = sled::Config::new()
            .temporary(true)
            .open()
            .context("opening a temporary index for a read-only store")?;
        Ok(Self { db })
    }

    pub(super) fn open(path: &Path) -> Result<Self> {
        // sled releases its file lock from a background thread shortly after the last handle
        // of a closed store drops, so a store reopened at once (a restarted node) may find it
        // still held: try again for up to 2 s before reporting the error.
        let mut tries = 0;
        loop {
            match sled::open(path) {
                Ok(db) => return Ok(Self { db }),
                Err(e) if tries < 40 && lock_held(&e) => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("opening index {}", path.display()))
                }
            }
        }
    }

    pub(super) fn blob(&self, id: &BlobId) -> Result<Option<BlobEntry>> {
        match self.db.get(key(b'b', id))? {
            None => Ok(None),
            Some(v) => Ok(Some(
                serde_json::from_slice(&v).with_context(|| format!("index entry of {id}"))?,
            )),
        }
    }

    pub(super) fn blobs(&self) -> Result<Vec<(BlobId, BlobEntry)>> {
        let mut out = Vec::new();
        for kv in self.db.scan_prefix([b'b']) {
            let (k, v) = kv?;
            let id = id_of(&k).context("index key of the wrong length")?;
            out.push((
                id,
                serde_json::from_slice(&v).with_context(|| format!("index entry of {id}"))?,
            ));
        }
        Ok(out)
    }

    pub(super) fn put_blob(&self, id: &BlobId, entry: &BlobEntry) -> Result<()> {
        self.db.insert(key(b'b', id), serde_json::to_vec(entry)?)?;
        Ok(())
    }

    pub(super) fn remove_blob(&self, id: &BlobId) -> Result<()> {
        self.db.remove(key(b'b', id))?;
        Ok(())
    }

    /// One atomic batch: the model, its source (for a complete model), and every blob tagged
    /// with it.
    pub(super) fn add_model(
        &self,
        model: ModelId,
        source: Option<BlobId>,
        blobs: &[BlobId],
    ) -> Result<()> {
        let mut batch = sled::Batch::default();
        for id in blobs {
            if let Some(mut e) = self.blob(id)? {
                e.model = Some(model);
                batch.insert(&key(b'b', id)[..], serde_json::to_vec(&e)?);
            }
        }
        batch.insert(&key(b'm', &model.0)[..], &[][..]);
        if let Some(source) = source {
            batch.insert(&key(b's', &source)[..], &model.0 .0[..]);
        }
        self.db.apply_batch(batch)?;
        Ok(())
    }

    /// Forgets a model whose manifest is gone (its source mapping too).
    pub(super) fn remove_model(&self, model: &ModelId) -> Result<()> {
        self.db.remove(key(b'm', &model.0))?;
        for kv in self.db.scan_prefix([b's']) {
            let (k, v) = kv?;
            if v.as_ref() == model.0 .0.as_slice() {
                self.db.remove(k)?;
            }
        }
        Ok(())
    }

    pub(super) fn has_model(&self, model: &ModelId) -> Result<bool> {
        Ok(self.db.contains_key(key(b'm', &model.0))?)
    }

    pub(super) fn models(&self) -> Result<Vec<ModelId>> {
        let mut out = Vec::new();
        for kv in self.db.scan_prefix([b'm']) {
            let (k, _) = kv?;
            out.push(ModelId(id_of(&k).context("index key of the wrong length")?));
        }
        Ok(out)
    }

    pub(super) fn model_for_source(&self, source: &BlobId) -> Result<Option<ModelId>> {
        Ok(self
            .db
            .get(key(b's', source))?
            .and_then(|v| id_of(&[&[0u8][..], &v].concat()))
            .map(ModelId))
    }

    pub(super) fn flush(&self) -> Result<()> {
        self.db.flush()?;
        Ok(())
    }
}
