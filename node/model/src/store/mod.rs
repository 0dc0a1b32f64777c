//! The content-addressed store: blob files named by their blake3 id, and a sled index.
//!
//! A blob is written to `tmp/`, hashed as it is written, synced, checked against the id it
//! was expected to have (when one was given), renamed into `blobs/` and only then indexed, so
//! an indexed blob is never half-written. [`Store::open`] checks every indexed blob (present,
//! right size, right hash), and never deletes a file whose bytes match its name: see `check`
//! for what it adopts, quarantines and reports.

mod batch;
mod check;
mod index;
mod lock;
pub mod transfer;

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::error::{bail, Context, Error, Result};
use moeswarm_protocol::{BlobId, Manifest, ModelId};

pub use batch::{BlobBatch, BATCH_BLOBS, BATCH_BYTES};
pub use check::{Check, OpenReport};
pub use index::{BlobEntry, BlobKind};
use index::{Index, OpenFailure};

/// A store directory.
pub struct Store {
    root: PathBuf,
    index: Index,
    /// Opened on read-only media (or a directory this user cannot write): read through a
    /// temporary index, and every write refused with [`Error::StoreReadOnly`].
    read_only: bool,
    /// This process's hold on the store (see `lock`); released after the index.
    _lock: lock::StoreLock,
    /// bao outboards of blobs recently served by ranges (see `transfer`).
    outboards: transfer::OutboardCache,
    /// What `check_blob` last found right: each blob file's length and modification time.
    verified: std::sync::Mutex<std::collections::HashMap<BlobId, (u64, std::time::SystemTime)>>,
    /// Blobs quarantined since the store opened (a node re-advertises when it changes).
    quarantines: std::sync::atomic::AtomicU64,
    /// Called after each blob quarantined.
    on_quarantine: std::sync::Mutex<Vec<QuarantineListener>>,
    /// Called once the store is gone. The last field: fields drop in order, so this runs
    /// after the index (and the lock on its files) is released.
    released: Released,
}

/// What [`Store::on_release`] calls, called when it drops.
#[derive(Default)]
struct Released(std::sync::Mutex<Vec<Box<dyn FnOnce() + Send>>>);

impl Drop for Released {
    fn drop(&mut self) {
        let listeners = match self.0.get_mut() {
            Ok(l) => std::mem::take(l),
            Err(p) => std::mem::take(p.into_inner()),
        };
        for l in listeners {
            l();
        }
    }
}

impl Drop for Store {
    /// The index is forced to disk when the last user lets go of the store.
    fn drop(&mut self) {
        if let Err(e) = self.index.flush() {
            tracing::warn!("flushing the store index at release: {e:#}");
        }
    }
}

/// What [`Store::on_quarantine`] calls.
type QuarantineListener = Box<dyn Fn() + Send + Sync>;

/// A file being written into the store; it hashes what passes through it.
pub struct BlobWriter {
    file: io::BufWriter<File>,
    path: PathBuf,
    hasher: blake3::Hasher,
    len: u64,
}

impl Write for BlobWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

/// The blake3 of a file's bytes (memory-mapped, hashed on all cores).
pub fn hash_file(path: &Path) -> io::Result<BlobId> {
    let mut h = blake3::Hasher::new();
    h.update_mmap_rayon(path)?;
    Ok(BlobId::from_hash(h.finalize()))
}

fn hash_bytes(bytes: &[u8]) -> BlobId {
    if bytes.len() >= 1 << 20 {
        let mut h = blake3::Hasher::new();
        h.update_rayon(bytes);
        BlobId::from_hash(h.finalize())
    } else {
        BlobId::of(bytes)
    }
}

impl Store {
    /// Opens (creating if needed) the store at `dir`, checking every blob fully.
    pub fn open(dir: &Path) -> Result<(Self, OpenReport)> {
        Self::open_with(dir, Check::Full)
    }

    /// Opens the store at `dir`, which must exist (what commands that only read a store use,
    /// so that a mistyped path is an error rather than a new, empty store).
    pub fn open_existing(dir: &Path) -> Result<(Self, OpenReport)> {
        if !dir.join("blobs").is_dir() {
            bail!(
                "no store at {}: give the directory a model was sliced or fetched into",
                dir.display()
            );
        }
        Self::open(dir)
    }

    /// Opens the store at `dir` with the given depth of checking.
    pub fn open_with(dir: &Path, check: Check) -> Result<(Self, OpenReport)> {
        fs::create_dir_all(dir)
            .with_context(|| format!("creating store directory {}", dir.display()))?;
        // Before anything in it is read, moved or emptied: another process may have it open.
        let held = lock::StoreLock::take(dir)?;
        let mut report = OpenReport {
            read_only: held.read_only(),
            ..Default::default()
        };
        let index = if report.read_only {
            if !dir.join("blobs").is_dir() {
                bail!(
                    "no store at {} (it is read-only, so none can be made)",
                    dir.display()
                );
            }
            // Nothing can be written there, sled's own files included: the blobs are indexed
            // afresh, in temporary space, from their files.
            Index::temporary()?
        } else {
            for sub in ["blobs", "tmp", "partial", "quarantine"] {
                fs::create_dir_all(dir.join(sub)).with_context(|| {
                    format!("creating store directory {}", dir.join(sub).display())
                })?;
            }
            Self::open_index(dir, &mut report)?
        };
        let store = Self {
            root: dir.to_path_buf(),
            index,
            read_only: held.read_only(),
            _lock: held,
            outboards: transfer::OutboardCache::default(),
            verified: Default::default(),
            quarantines: Default::default(),
            on_quarantine: Default::default(),
            released: Default::default(),
        };
        store.check(check, &mut report)?;
        Ok((store, report))
    }

    /// Opens the index of the store at `dir`; one whose files cannot be read is kept aside and
    /// started afresh (the blobs are adopted from their files), but a full disk or any other
    /// failure is an error that moves nothing.
    fn open_index(dir: &Path, report: &mut OpenReport) -> Result<Index> {
        let path = dir.join("index");
        let why = match Index::open(&path) {
            Ok(index) => match check::readable(&index) {
                Ok(()) => return Ok(index),
                Err(why) => why,
            },
            Err(e) => match e.root() {
                crate::error::Error::Index(ix) => match index::open_failure(ix) {
                    OpenFailure::Unreadable => format!("{e:#}"),
                    OpenFailure::DiskFull => {
                        return Err(Error::StoreFull {
                            dir: dir.to_path_buf(),
                            what: format!("opening its index: {ix}"),
                        })
                    }
                    OpenFailure::Other => return Err(e),
                },
                _ => return Err(e),
            },
        };
        report.index_rebuilt = Some(why);
        Self::fresh_index(dir)
    }

    /// Moves an index that cannot be read aside (kept, for a person to look at) and starts a
    /// fresh one; the blobs are then adopted from their files.
    fn fresh_index(dir: &Path) -> Result<Index> {
        let old = dir.join("index");
        if old.exists() {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let aside = dir.join(format!("index.unreadable-{secs}"));
            fs::rename(&old, &aside)
                .with_context(|| format!("moving the unreadable index to {}", aside.display()))?;
            tracing::warn!(
                "store: index {} unreadable, kept as {}; rebuilding it from the blobs",
                old.display(),
                aside.display()
            );
        }
        Index::open(&old)
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where blob `id` lives (whether or not it is there).
    pub fn blob_path(&self, id: &BlobId) -> PathBuf {
        self.root.join("blobs").join(id.to_hex())
    }

    /// The index entry of blob `id`.
    pub fn entry(&self, id: &BlobId) -> Result<Option<BlobEntry>> {
        self.index.blob(id)
    }

    /// Whether blob `id` is stored.
    pub fn contains(&self, id: &BlobId) -> Result<bool> {
        Ok(self.index.blob(id)?.is_some())
    }

    /// Reads blob `id` whole, checking its hash.
    pub fn read(&self, id: &BlobId) -> Result<Vec<u8>> {
        if !self.contains(id)? {
            bail!("blob {id} is not in the store {}", self.root.display());
        }
        let bytes = fs::read(self.blob_path(id)).with_context(|| format!("reading blob {id}"))?;
        let got = hash_bytes(&bytes);
        if got != *id {
            let why = format!("content hashes to {}", got.short());
            self.quarantine(id, &why)?;
            bail!("blob {id} is corrupt on disk ({why}): dropped from the store");
        }
        Ok(bytes)
    }

    /// Stores `bytes` as a blob of `kind`; a no-op when it is already stored.
    pub fn put_bytes(&self, bytes: &[u8], kind: BlobKind) -> Result<BlobId> {
        let id = hash_bytes(bytes);
        if self.contains(&id)? {
            return Ok(id);
        }
        let mut w = self.begin()?;
        w.file.write_all(bytes)?;
        w.len = bytes.len() as u64;
        self.commit(w, id, kind)
    }

    /// Stores `bytes` only if they hash to `expected`; otherwise nothing is written.
    pub fn put_verified(&self, expected: BlobId, bytes: &[u8], kind: BlobKind) -> Result<BlobId> {
        let id = hash_bytes(bytes);
        if id != expected {
            bail!("blob bytes hash to {id}, expected {expected}: refused");
        }
        self.put_bytes(bytes, kind)
    }

    /// Stores a blob produced by `fill`, hashing as it is written.
    pub fn put_stream(
        &self,
        kind: BlobKind,
        fill: impl FnOnce(&mut BlobWriter) -> Result<()>,
    ) -> Result<BlobId> {
        let mut w = self.begin()?;
        if let Err(e) = fill(&mut w) {
            let _ = fs::remove_file(&w.path);
            return Err(e);
        }
        let id = BlobId::from_hash(w.hasher.finalize());
        if self.contains(&id)? {
            drop(w.file);
            fs::remove_file(&w.path)?;
            return Ok(id);
        }
        self.commit(w, id, kind)
    }

    /// Where a partly received blob is kept between attempts (not cleared on open).
    pub(crate) fn partial_path(&self, id: &BlobId, ext: &str) -> PathBuf {
        self.root
            .join("partial")
            .join(format!("{}.{ext}", id.to_hex()))
    }

    /// A fresh, unique path in the store's temporary space (cleared when the store opens).
    pub(crate) fn temp_path(&self, prefix: &str) -> PathBuf {
        let mut salt = [0u8; 12];
        rand::fill(&mut salt);
        self.root
            .join("tmp")
            .join(format!("{prefix}{}.part", BlobId::of(&salt).short()))
    }

    /// Refuses `what` on a read-only store.
    fn writable(&self, what: &'static str) -> Result<()> {
        if self.read_only {
            return Err(Error::StoreReadOnly {
                dir: self.root.clone(),
                what,
            });
        }
        Ok(())
    }

    /// Whether the store was opened read-only (see [`OpenReport::read_only`]).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn begin(&self) -> Result<BlobWriter> {
        self.writable("written to")?;
        let path = self.temp_path("");
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(BlobWriter {
            file: io::BufWriter::with_capacity(1 << 20, file),
            path,
            hasher: blake3::Hasher::new(),
            len: 0,
        })
    }

    fn commit(&self, w: BlobWriter, id: BlobId, kind: BlobKind) -> Result<BlobId> {
        let BlobWriter {
            file, path, len, ..
        } = w;
        let file = file.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        self.install(&path, id, len, kind)
    }

    /// Takes a synced file whose bytes should be blob `id` into the store: hashes it again,
    /// and only if it matches moves it in and indexes it. On a mismatch it is deleted.
    pub fn adopt(&self, path: &Path, id: BlobId, size: u64, kind: BlobKind) -> Result<BlobId> {
        self.writable("given a blob")?;
        let got = hash_file(path)?;
        if got != id {
            let _ = fs::remove_file(path);
            bail!("received blob hashes to {got}, expected {id}: refused");
        }
        self.install_verified(path, id, size, kind)
    }

    /// Takes a synced file whose bytes are known to be blob `id` (checked against its hash
    /// tree by a finished transfer, or hashed by [`Store::adopt`]) into the store, without
    /// hashing it again.
    fn install_verified(
        &self,
        path: &Path,
        id: BlobId,
        size: u64,
        kind: BlobKind,
    ) -> Result<BlobId> {
        self.writable("given a blob")?;
        if fs::metadata(path)?.len() != size {
            let _ = fs::remove_file(path);
            bail!("received blob {id} is not {size} bytes long: refused");
        }
        if self.contains(&id)? {
            let _ = fs::remove_file(path);
            return Ok(id);
        }
        self.install(path, id, size, kind)
    }

    fn install(&self, path: &Path, id: BlobId, size: u64, kind: BlobKind) -> Result<BlobId> {
        let dest = self.blob_path(&id);
        fs::rename(path, &dest).with_context(|| format!("moving blob into {}", dest.display()))?;
        File::open(self.root.join("blobs"))?.sync_all()?;
        self.index.put_blob(
            &id,
            &BlobEntry {
                size,
                kind,
                model: None,
            },
        )?;
        Ok(id)
    }

    /// Stores `manifest` and indexes the model: manifest blob, model → manifest, source → model,
    /// and every one of its blobs tagged with the model. All blobs it names must be stored.
    pub fn add_model(&self, manifest: &Manifest) -> Result<ModelId> {
        manifest.validate()?;
        let bytes = manifest.to_bytes();
        let mut ids = vec![manifest.trunk.id];
        ids.extend(manifest.all_slabs().map(|(_, _, r)| r.id));
        for id in &ids {
            if !self.contains(id)? {
                bail!("model names blob {id}, which is not stored");
            }
        }
        let manifest_id = self.put_bytes(&bytes, BlobKind::Manifest)?;
        let model = ModelId(manifest_id);
        self.index
            .add_model(model, Some(manifest.source_header), &ids)?;
        self.index.flush()?;
        Ok(model)
    }

    /// Stores `manifest` for a node that holds only part of the model (a worker): the model is
    /// indexed and the blobs it names that are stored are tagged with it; the source mapping is
    /// left out, so slicing the full source later still fills in what is missing.
    pub fn add_partial_model(&self, manifest: &Manifest) -> Result<ModelId> {
        manifest.validate()?;
        let bytes = manifest.to_bytes();
        let mut ids = Vec::new();
        for id in
            std::iter::once(manifest.trunk.id).chain(manifest.all_slabs().map(|(_, _, r)| r.id))
        {
            if self.contains(&id)? {
                ids.push(id);
            }
        }
        let model = ModelId(self.put_bytes(&bytes, BlobKind::Manifest)?);
        self.index.add_model(model, None, &ids)?;
        self.index.flush()?;
        Ok(model)
    }

    /// The `(layer, expert)` slabs of `manifest` this store holds, ascending.
    pub fn held_slabs(&self, manifest: &Manifest) -> Result<Vec<(u32, u32)>> {
        let mut out = Vec::new();
        for (l, e, r) in manifest.all_slabs() {
            if self.contains(&r.id)? {
                out.push((l, e));
            }
        }
        Ok(out)
    }

    /// The manifest of `model`.
    pub fn manifest(&self, model: &ModelId) -> Result<Manifest> {
        if !self.index.has_model(model)? {
            bail!("model {model} is not in the store {}", self.root.display());
        }
        let bytes = self.read(&model.0)?;
        Ok(Manifest::from_bytes(&bytes)?)
    }

    /// Every model in the store.
    pub fn models(&self) -> Result<Vec<ModelId>> {
        self.index.models()
    }

    /// The model sliced from a source whose header hashes to `source_header`.
    pub fn model_for_source(&self, source_header: &BlobId) -> Result<Option<ModelId>> {
        self.index.model_for_source(source_header)
    }

    /// Whether every blob `manifest` names is stored.
    pub fn has_all_blobs(&self, manifest: &Manifest) -> Result<bool> {
        if !self.contains(&manifest.trunk.id)? {
            return Ok(false);
        }
        for (_, _, r) in manifest.all_slabs() {
            if !self.contains(&r.id)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Deletes blob `id`: out of the index first (so the index never names a missing file),
    /// then its file. A blob that is not stored is no error. Readers that mapped it keep their
    /// mapping.
    pub fn remove(&self, id: &BlobId) -> Result<()> {
        if !self.contains(id)? {
            return Ok(());
        }
        self.writable("have blobs removed")?;
        self.index.remove_blob(id)?;
        self.index.flush()?;
        let path = self.blob_path(id);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("deleting {}", path.display())),
        }
    }

    /// Every indexed blob and its entry.
    pub fn blobs(&self) -> Result<Vec<(BlobId, BlobEntry)>> {
        self.index.blobs()
    }

    /// Calls `listener` once the store has been released (its last user let go, its index
    /// forced to disk and closed): the directory may then be opened again.
    pub fn on_release(&self, listener: impl FnOnce() + Send + 'static) {
        let mut l = self.released.0.lock().unwrap_or_else(|p| p.into_inner());
        l.push(Box::new(listener));
    }

    /// Forces the index to disk.
    pub fn flush(&self) -> Result<()> {
        self.index.flush()
    }
}

/// Starts writing `file`'s dirty pages to disk without waiting (Linux), so that its sync at
/// the batch's end finds them mostly written.
pub(crate) fn start_writeback(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor; the call only schedules writeback of its pages.
        unsafe {
            libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}
