//! Many blobs stored at once: what slicing writes (a model's slabs, hundreds of them).
//!
//! Each blob is hashed and written to the store's temporary space as it comes, and its
//! writeback is started at once (on Linux) without waiting for it. Every [`BATCH_BLOBS`] blobs
//! or [`BATCH_BYTES`] bytes, and when the batch is committed, the files written since the last
//! time are synced, renamed into `blobs/`, the directory synced once and the index flushed
//! once. The guarantee is the single blob's: a blob is indexed only once its file is synced
//! and in place, so a crash leaves whole blobs or temporary files (cleared on open), never a
//! half-written indexed one. What a batch dropped before its commit wrote is removed.

use std::fs::{self, File};
use std::io::Write;
use std::path::PathBuf;

use super::{hash_bytes, BlobEntry, BlobKind, Store};
use crate::error::{Context, Result};
use moeswarm_protocol::BlobId;

/// Blobs written before they are synced and indexed together.
pub const BATCH_BLOBS: usize = 128;
/// Bytes written before they are synced and indexed together.
pub const BATCH_BYTES: u64 = 512 << 20;

/// Blobs being stored together. See the module docs.
pub struct BlobBatch<'a> {
    store: &'a Store,
    /// Written, not yet synced and indexed (a blob given twice is written once).
    pending: Vec<Pending>,
}

struct Pending {
    file: File,
    path: PathBuf,
    id: BlobId,
    size: u64,
    kind: BlobKind,
}

impl Store {
    /// A batch of blobs to store together (see [`BlobBatch`]).
    pub fn batch(&self) -> Result<BlobBatch<'_>> {
        self.writable("written to")?;
        Ok(BlobBatch {
            store: self,
            pending: Vec::new(),
        })
    }
}

impl BlobBatch<'_> {
    /// Stores `bytes` as a blob of `kind` (indexed by the time the batch is committed).
    pub fn put_bytes(&mut self, bytes: &[u8], kind: BlobKind) -> Result<BlobId> {
        self.put_hashed(bytes, hash_bytes(bytes), kind)
    }

    /// [`BlobBatch::put_bytes`] for bytes whose hash the caller has just computed as `id`
    /// (slicing hashes on another thread while this one writes).
    pub(crate) fn put_hashed(
        &mut self,
        bytes: &[u8],
        id: BlobId,
        kind: BlobKind,
    ) -> Result<BlobId> {
        if self.pending.iter().any(|p| p.id == id) || self.store.contains(&id)? {
            return Ok(id);
        }
        let path = self.store.temp_path("");
        let mut file =
            File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let written = file
            .write_all(bytes)
            .with_context(|| format!("writing {}", path.display()));
        if let Err(e) = written {
            drop(file);
            let _ = fs::remove_file(&path);
            return Err(e);
        }
        super::start_writeback(&file);
        self.pending.push(Pending {
            file,
            path,
            id,
            size: bytes.len() as u64,
            kind,
        });
        let pending_bytes: u64 = self.pending.iter().map(|p| p.size).sum();
        if self.pending.len() >= BATCH_BLOBS || pending_bytes >= BATCH_BYTES {
            self.install()?;
        }
        Ok(id)
    }

    /// Syncs, moves in and indexes every blob written so far.
    pub fn commit(mut self) -> Result<()> {
        self.install()
    }

    /// The blobs written since the last install: each file synced, all renamed into
    /// `blobs/`, the directory synced once, all indexed, the index flushed once.
    fn install(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        for p in &self.pending {
            p.file.sync_all()?;
        }
        let pending = std::mem::take(&mut self.pending);
        let mut moved = Vec::with_capacity(pending.len());
        let mut failed = None;
        for p in pending {
            let dest = self.store.blob_path(&p.id);
            if failed.is_none() {
                let renamed = fs::rename(&p.path, &dest)
                    .with_context(|| format!("moving blob into {}", dest.display()));
                match renamed {
                    Ok(()) => {
                        moved.push(p);
                        continue;
                    }
                    Err(e) => failed = Some(e),
                }
            }
            let _ = fs::remove_file(&p.path);
        }
        // The renames are made durable before any of them is indexed.
        File::open(self.store.root.join("blobs"))?.sync_all()?;
        for p in &moved {
            let entry = BlobEntry {
                size: p.size,
                kind: p.kind,
                model: None,
            };
            self.store.index.put_blob(&p.id, &entry)?;
        }
        self.store.index.flush()?;
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for BlobBatch<'_> {
    fn drop(&mut self) {
        for p in self.pending.drain(..) {
            let _ = fs::remove_file(&p.path);
        }
    }
}
