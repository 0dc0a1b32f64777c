//! The content-addressed store: blob files named by their blake3 id, and a sled index.
//!
//! A blob is written to `tmp/`, hashed as it is written, synced, checked against the id it
//! was expected to have (when one was given), renamed into `blobs/` and only then indexed, so
//! an indexed blob is never half-written. [`Store::open`] checks every indexed blob (present,
//! right size, right hash), drops and reports the bad ones, and removes unindexed leftovers.

mod index;
pub mod transfer;

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::error::{bail, Context, Result};
use moeswarm_protocol::{BlobId, Manifest, ModelId};

use index::Index;
pub use index::{BlobEntry, BlobKind};

/// A store directory.
pub struct Store {
    root: PathBuf,
    index: Index,
    /// bao outboards of blobs recently served by ranges (see `transfer`).
    outboards: transfer::OutboardCache,
}

/// What [`Store::open`] found wrong and mended.
#[derive(Debug, Default, Clone)]
pub struct OpenReport {
    /// Indexed blobs that were missing or corrupt, with the reason; now dropped from the index.
    pub dropped: Vec<(BlobId, String)>,
    /// Files in `blobs/` or `tmp/` that no index entry named, and partial downloads untouched
    /// for a week; removed.
    pub leftovers_removed: usize,
    /// Indexed blobs that checked out.
    pub blobs_ok: usize,
}

/// How much [`Store::open`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Presence, size and blake3 of every blob.
    Full,
    /// Presence and size only (fast on very large stores).
    Sizes,
}

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

    /// Opens the store at `dir` with the given depth of checking.
    pub fn open_with(dir: &Path, check: Check) -> Result<(Self, OpenReport)> {
        for sub in ["blobs", "tmp", "partial"] {
            fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("creating store directory {}", dir.join(sub).display()))?;
        }
        let index = Index::open(&dir.join("index"))?;
        let store = Self {
            root: dir.to_path_buf(),
            index,
            outboards: transfer::OutboardCache::default(),
        };
        let report = store.check(check)?;
        Ok((store, report))
    }

    fn check(&self, check: Check) -> Result<OpenReport> {
        let mut report = OpenReport::default();
        for entry in fs::read_dir(self.root.join("tmp"))? {
            fs::remove_file(entry?.path())?;
            report.leftovers_removed += 1;
        }
        // Partial downloads are kept to resume, but not forever.
        let week = std::time::Duration::from_secs(7 * 24 * 3600);
        for entry in fs::read_dir(self.root.join("partial"))? {
            let entry = entry?;
            let stale = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > week);
            if stale {
                fs::remove_file(entry.path())?;
                report.leftovers_removed += 1;
            }
        }
        for (id, entry) in self.index.blobs()? {
            let path = self.blob_path(&id);
            let problem = match fs::metadata(&path) {
                Err(_) => Some("file is missing".to_string()),
                Ok(m) if m.len() != entry.size => Some(format!(
                    "file is {} bytes, index says {}",
                    m.len(),
                    entry.size
                )),
                Ok(_) if check == Check::Full => match hash_file(&path) {
                    Ok(h) if h == id => None,
                    Ok(h) => Some(format!("content hashes to {}", h.short())),
                    Err(e) => Some(format!("unreadable: {e}")),
                },
                Ok(_) => None,
            };
            match problem {
                Some(why) => {
                    if entry.kind == BlobKind::Manifest {
                        self.index.remove_model(&ModelId(id))?;
                    }
                    self.index.remove_blob(&id)?;
                    let _ = fs::remove_file(&path);
                    report.dropped.push((id, why));
                }
                None => report.blobs_ok += 1,
            }
        }
        for entry in fs::read_dir(self.root.join("blobs"))? {
            let path = entry?.path();
            let indexed = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<BlobId>().ok())
                .map(|id| self.index.blob(&id).ok().flatten().is_some())
                .unwrap_or(false);
            if !indexed {
                fs::remove_file(&path)?;
                report.leftovers_removed += 1;
            }
        }
        if !report.dropped.is_empty() || report.leftovers_removed > 0 {
            self.index.flush()?;
        }
        Ok(report)
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
            bail!("blob {id} is corrupt on disk (hashes to {got}); reopen the store to drop it");
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

    fn begin(&self) -> Result<BlobWriter> {
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
        let got = hash_file(path)?;
        if got != id || fs::metadata(path)?.len() != size {
            let _ = fs::remove_file(path);
            bail!("received blob hashes to {got}, expected {id}: refused");
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

    /// Forces the index to disk.
    pub fn flush(&self) -> Result<()> {
        self.index.flush()
    }
}
