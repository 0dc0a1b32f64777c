//! What a store finds when it opens, and how it mends it without losing what is good.
//!
//! The rule: a file whose bytes hash to its name is never deleted. A blob file the index does
//! not name (the index was lost or corrupt, or the process died between moving the file in
//! and flushing the index) is hashed and adopted; its kind is read from its bytes, and the
//! models whose manifests are among the adopted are indexed again. A file that does not
//! match its name, or an indexed blob whose file went bad, is moved to `quarantine/` (never
//! served, kept for a person to look at) and dropped from the index. Only `tmp/` (writes
//! never finished) is emptied, and partial downloads untouched for a week.

use std::fs;
use std::path::Path;

use std::sync::atomic::Ordering;

use crate::error::{bail, Result};
use crate::slab::SlabView;
use moeswarm_protocol::{BlobId, Manifest, ModelId};

use super::index::{BlobEntry, BlobKind};
use super::{hash_file, Store};

/// What [`Store::open`] found wrong and mended.
#[derive(Debug, Default, Clone)]
pub struct OpenReport {
    /// Indexed blobs that were missing or corrupt, with the reason; now dropped from the index
    /// (a corrupt file is moved to `quarantine/`).
    pub dropped: Vec<(BlobId, String)>,
    /// Blob files the index did not name whose bytes match their names: now indexed.
    pub adopted: Vec<BlobId>,
    /// Models indexed again from adopted manifests.
    pub models_reindexed: Vec<ModelId>,
    /// Files moved to `quarantine/` because they did not match their names, with the reason.
    pub quarantined: Vec<(String, String)>,
    /// Unfinished writes in `tmp/` and partial downloads untouched for a week: removed.
    pub leftovers_removed: usize,
    /// Indexed blobs that checked out.
    pub blobs_ok: usize,
    /// Why the index was started afresh (it could not be read), if it was; the old one is
    /// kept beside it.
    pub index_rebuilt: Option<String>,
    /// The store is read-only (read-only media, or not this user's to write): its blobs were
    /// indexed afresh in temporary space, and nothing in it was moved, removed or written.
    pub read_only: bool,
}

/// How much [`Store::open`] checks of the blobs it has indexed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Presence, size and blake3 of every blob.
    Full,
    /// Presence and size only (fast on very large stores; [`Store::verify_all`] hashes them
    /// later).
    Sizes,
}

/// What a blob is, read from its bytes.
fn kind_of(path: &Path, size: u64) -> BlobKind {
    let Ok(file) = fs::File::open(path) else {
        return BlobKind::Unknown;
    };
    if size == 0 {
        return BlobKind::Unknown;
    }
    // SAFETY: the store's blob files are only ever replaced by rename, never written in place.
    let Ok(map) = (unsafe { memmap2::Mmap::map(&file) }) else {
        return BlobKind::Unknown;
    };
    if map.first() == Some(&b'{') && Manifest::from_bytes(&map).is_ok() {
        return BlobKind::Manifest;
    }
    if let Ok(v) = SlabView::parse(&map) {
        return BlobKind::Slab {
            layer: v.layer,
            expert: v.expert,
        };
    }
    if crate::gguf::Gguf::from_bytes(&map).is_ok() {
        return BlobKind::Trunk;
    }
    BlobKind::Unknown
}

impl Store {
    /// Moves `file` (in `blobs/`) to `quarantine/`, where nothing reads it.
    /// On a read-only store the file stays where it is (only the temporary index forgets it).
    pub(super) fn quarantine_file(&self, file: &Path) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let name = file.file_name().map(|n| n.to_owned()).unwrap_or_default();
        let dest = self.root.join("quarantine").join(name);
        fs::rename(file, &dest)?;
        Ok(())
    }

    /// Drops blob `id` from the index and moves its file to `quarantine/`: what every reader
    /// does with a blob whose bytes no longer match its name.
    pub fn quarantine(&self, id: &BlobId, why: &str) -> Result<()> {
        let r = self.quarantine_inner(id, why);
        // Whoever listens hears of it once the index no longer names the blob.
        if let Ok(listeners) = self.on_quarantine.lock() {
            for l in listeners.iter() {
                l();
            }
        }
        r
    }

    /// Calls `listener` after every blob quarantined from now on (a node re-advertises what
    /// it holds).
    pub fn on_quarantine(&self, listener: impl Fn() + Send + Sync + 'static) {
        if let Ok(mut l) = self.on_quarantine.lock() {
            l.push(Box::new(listener));
        }
    }

    fn quarantine_inner(&self, id: &BlobId, why: &str) -> Result<()> {
        tracing::warn!("store: blob {id} quarantined: {why}");
        self.quarantines.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut v) = self.verified.lock() {
            v.remove(id);
        }
        if let Some(entry) = self.index.blob(id)? {
            if entry.kind == BlobKind::Manifest {
                self.index.remove_model(&ModelId(*id))?;
            }
        }
        self.index.remove_blob(id)?;
        self.index.flush()?;
        let path = self.blob_path(id);
        if path.exists() {
            self.quarantine_file(&path)?;
        }
        Ok(())
    }

    pub(super) fn check(&self, check: Check, report: &mut OpenReport) -> Result<()> {
        if !self.read_only {
            self.remove_leftovers(report)?;
        }
        for (id, entry) in self.index.blobs()? {
            match self.problem(&id, &entry, check) {
                Some(why) => {
                    self.drop_entry(&id, &entry)?;
                    report.dropped.push((id, why));
                }
                None => {
                    if check == Check::Full {
                        self.hashed_right(&id);
                    }
                    report.blobs_ok += 1;
                }
            }
        }
        self.adopt_unindexed(report)?;
        self.index.flush()?;
        Ok(())
    }

    /// Empties `tmp/` (writes never finished) and removes partial downloads untouched for a
    /// week.
    fn remove_leftovers(&self, report: &mut OpenReport) -> Result<()> {
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
        Ok(())
    }

    /// What is wrong with indexed blob `id`, if anything.
    fn problem(&self, id: &BlobId, entry: &BlobEntry, check: Check) -> Option<String> {
        let path = self.blob_path(id);
        match fs::metadata(&path) {
            Err(_) => Some("file is missing".to_string()),
            Ok(m) if m.len() != entry.size => Some(format!(
                "file is {} bytes, index says {}",
                m.len(),
                entry.size
            )),
            Ok(_) if check == Check::Full => match hash_file(&path) {
                Ok(h) if h == *id => None,
                Ok(h) => Some(format!("content hashes to {}", h.short())),
                Err(e) => Some(format!("unreadable: {e}")),
            },
            Ok(_) => None,
        }
    }

    /// Drops `id` from the index; its file, if there is one, goes to quarantine.
    fn drop_entry(&self, id: &BlobId, entry: &BlobEntry) -> Result<()> {
        if entry.kind == BlobKind::Manifest {
            self.index.remove_model(&ModelId(*id))?;
        }
        self.index.remove_blob(id)?;
        let path = self.blob_path(id);
        if path.exists() {
            self.quarantine_file(&path)?;
        }
        Ok(())
    }

    /// Hashes every file in `blobs/` the index does not name: adopted if it matches its name,
    /// quarantined if not; then indexes the models of the adopted manifests.
    fn adopt_unindexed(&self, report: &mut OpenReport) -> Result<()> {
        let mut manifests = Vec::new();
        for entry in fs::read_dir(self.root.join("blobs"))? {
            let path = entry?.path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            let id = match name.parse::<BlobId>() {
                Ok(id) => id,
                Err(_) => {
                    self.quarantine_file(&path)?;
                    report
                        .quarantined
                        .push((name, "not named by a blob id".into()));
                    continue;
                }
            };
            if self.index.blob(&id)?.is_some() {
                continue;
            }
            let size = fs::metadata(&path)?.len();
            match hash_file(&path) {
                Ok(h) if h == id => {
                    let kind = kind_of(&path, size);
                    self.index.put_blob(
                        &id,
                        &BlobEntry {
                            size,
                            kind,
                            model: None,
                        },
                    )?;
                    if kind == BlobKind::Manifest {
                        manifests.push(id);
                    }
                    report.adopted.push(id);
                }
                Ok(h) => {
                    self.quarantine_file(&path)?;
                    report
                        .quarantined
                        .push((name, format!("content hashes to {}", h.short())));
                }
                Err(e) => {
                    self.quarantine_file(&path)?;
                    report.quarantined.push((name, format!("unreadable: {e}")));
                }
            }
        }
        for id in manifests {
            let model = ModelId(id);
            if self.index.has_model(&model)? {
                continue;
            }
            let Ok(manifest) = self.read(&id).and_then(|b| Ok(Manifest::from_bytes(&b)?)) else {
                continue;
            };
            let named = std::iter::once(manifest.trunk.id)
                .chain(manifest.all_slabs().map(|(_, _, r)| r.id))
                .collect::<Vec<_>>();
            let mut held = Vec::new();
            for b in &named {
                if self.index.blob(b)?.is_some() {
                    held.push(*b);
                }
            }
            let source = (held.len() == named.len()).then_some(manifest.source_header);
            self.index.add_model(model, source, &held)?;
            report.models_reindexed.push(model);
        }
        Ok(())
    }

    /// Blobs quarantined since the store opened: a count that changes when the store holds
    /// less than it did.
    pub fn quarantines(&self) -> u64 {
        self.quarantines.load(Ordering::Relaxed)
    }

    /// Checks that blob `id`'s file still holds its bytes before they are served: hashed
    /// again unless its length and modification time are those it last hashed right with.
    /// A blob that does not match is quarantined, and the answer is an error.
    pub fn check_blob(&self, id: &BlobId) -> Result<()> {
        let Some(entry) = self.index.blob(id)? else {
            bail!("blob {id} is not in the store");
        };
        let path = self.blob_path(id);
        let meta = match fs::metadata(&path) {
            Ok(m) => m,
            Err(e) => {
                let why = format!("file is unreadable: {e}");
                self.quarantine(id, &why)?;
                bail!("blob {id} {why}: dropped from the store");
            }
        };
        let stamp = (meta.len(), meta.modified()?);
        let known = self.verified.lock().ok().and_then(|v| v.get(id).copied());
        if known == Some(stamp) {
            return Ok(());
        }
        if let Some(why) = self.problem(id, &entry, Check::Full) {
            self.quarantine(id, &why)?;
            bail!("blob {id} is corrupt on disk ({why}): dropped from the store");
        }
        if let Ok(mut v) = self.verified.lock() {
            v.insert(*id, stamp);
        }
        Ok(())
    }

    /// Notes that blob `id`'s file, as it is now, hashed right.
    fn hashed_right(&self, id: &BlobId) {
        let stamp = fs::metadata(self.blob_path(id)).and_then(|m| Ok((m.len(), m.modified()?)));
        if let (Ok(stamp), Ok(mut v)) = (stamp, self.verified.lock()) {
            v.insert(*id, stamp);
        }
    }

    /// Hashes every indexed blob (the full check [`Check::Sizes`] leaves out), quarantining
    /// those that do not match; what `scrub` and a node's background check run.
    pub fn verify_all(&self) -> Result<Vec<(BlobId, String)>> {
        let mut bad = Vec::new();
        for (id, entry) in self.index.blobs()? {
            match self.problem(&id, &entry, Check::Full) {
                Some(why) => {
                    self.quarantine(&id, &why)?;
                    bad.push((id, why));
                }
                None => self.hashed_right(&id),
            }
        }
        Ok(bad)
    }

    /// Indexed blobs no indexed model names (left by work that failed or was cut short).
    pub fn orphans(&self) -> Result<Vec<BlobId>> {
        let mut named = std::collections::HashSet::new();
        for model in self.index.models()? {
            named.insert(model.0);
            if let Ok(m) = self.manifest(&model) {
                named.insert(m.trunk.id);
                named.extend(m.all_slabs().map(|(_, _, r)| r.id));
            }
        }
        Ok(self
            .index
            .blobs()?
            .into_iter()
            .map(|(id, _)| id)
            .filter(|id| !named.contains(id))
            .collect())
    }
}

/// Whether the index at `dir` can be read through; why not if it cannot.
pub(super) fn readable(index: &super::index::Index) -> std::result::Result<(), String> {
    index.blobs().map_err(|e| format!("{e:#}"))?;
    index.models().map_err(|e| format!("{e:#}"))?;
    Ok(())
}
