//! Verified transfer of blobs by byte ranges (bao-tree verified streaming).
//!
//! A blob's id is the plain blake3 of its bytes, which is also the root of its bao tree, so
//! any byte range can be sent with the hashes that prove it against the id alone. The sender
//! ([`Store::encode_range`]) checks its own bytes before sending; the receiver
//! ([`PartialBlob::accept`]) checks every 16 KiB chunk group as it arrives, keeps the groups
//! before a bad one, and reports where it went wrong, so that range can be fetched from
//! another peer. A blob enters the store only when every byte is verified
//! ([`PartialBlob::finish`]). A blob not finished is kept in the store's `partial/` folder (its
//! bytes and the hash tree verified so far, saved every 64 MiB of progress and when it is
//! dropped), so a fetch interrupted by a failure, or by the process ending, resumes where it
//! stopped; what a resumed partial claims is checked again against its hashes before it
//! counts. This module moves bytes between a store and a buffer; the network around it is the
//! node's.

use std::fs::{self, File};
use std::ops::Range;
use std::path::PathBuf;

use crate::error::{bail, Context, Result};
use bao_tree::io::outboard::PreOrderOutboard;
use bao_tree::io::round_up_to_chunks;
use bao_tree::io::sync::{decode_ranges, encode_ranges_validated, valid_ranges, CreateOutboard};
use bao_tree::{BaoTree, BlockSize, ByteRanges, ChunkRanges};
use moeswarm_protocol::BlobId;

use super::{BlobKind, Store};

/// Chunk groups of 16 KiB: the unit of verification.
pub const BLOCK_SIZE: BlockSize = BlockSize::from_chunk_log(4);
pub use moeswarm_protocol::exchange::MAX_RANGE_BYTES;

/// Most outboards kept (each is 0.4% of its blob: a few hundred KiB for the largest trunks).
const MAX_CACHED_OUTBOARDS: usize = 4096;

/// The bao outboards of blobs served recently, so a blob asked for in many ranges is hashed
/// once, not once per range. Encoding still checks every chunk it sends against the outboard,
/// so a blob corrupted on disk after it was cached is still refused.
#[derive(Default)]
pub(crate) struct OutboardCache {
    map: std::sync::Mutex<std::collections::HashMap<BlobId, std::sync::Arc<Vec<u8>>>>,
}

impl OutboardCache {
    fn get(&self, id: &BlobId) -> Option<std::sync::Arc<Vec<u8>>> {
        self.map.lock().ok()?.get(id).cloned()
    }

    fn put(&self, id: BlobId, data: std::sync::Arc<Vec<u8>>) {
        if let Ok(mut m) = self.map.lock() {
            if m.len() >= MAX_CACHED_OUTBOARDS {
                m.clear();
            }
            m.insert(id, data);
        }
    }
}

fn chunk_ranges(range: &Range<u64>) -> ChunkRanges {
    round_up_to_chunks(&ByteRanges::from(range.clone()))
}

impl Store {
    /// The verified encoding of bytes `range` of blob `id`: the data of the chunk groups the
    /// range touches, interleaved with the hashes that prove them against `id`.
    pub fn encode_range(&self, id: &BlobId, range: Range<u64>) -> Result<Vec<u8>> {
        let entry = self
            .entry(id)?
            .with_context(|| format!("blob {id} is not in the store"))?;
        if range.start >= range.end || range.end > entry.size {
            bail!(
                "range {range:?} is not inside blob {id} of {} bytes",
                entry.size
            );
        }
        if range.end - range.start > MAX_RANGE_BYTES {
            bail!(
                "range of {} bytes is over the limit of {MAX_RANGE_BYTES}",
                range.end - range.start
            );
        }
        // The file may have gone bad since the outboard was made: a changed file is hashed
        // again (and dropped if it no longer matches) before any of it is served.
        self.check_blob(id)?;
        let path = self.blob_path(id);
        let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let data = match self.outboards.get(id) {
            Some(d) => d,
            None => {
                let outboard = PreOrderOutboard::<Vec<u8>>::create(&file, BLOCK_SIZE)?;
                if BlobId::from_hash(outboard.root) != *id {
                    self.quarantine(id, "its bao root is not its id")?;
                    bail!("blob {id} is corrupt on disk: refusing to serve it");
                }
                let d = std::sync::Arc::new(outboard.data);
                self.outboards.put(*id, d.clone());
                d
            }
        };
        let outboard = PreOrderOutboard {
            root: blake3::Hash::from(id.0),
            tree: BaoTree::new(entry.size, BLOCK_SIZE),
            data: data.as_slice(),
        };
        let mut out = Vec::new();
        encode_ranges_validated(&file, &outboard, &chunk_ranges(&range), &mut out).map_err(
            |e| {
                crate::error::Error::invalid(format!(
                    "blob {id} is corrupt on disk, not served: {e}"
                ))
            },
        )?;
        Ok(out)
    }
}

/// Progress between two saves of a partial blob's hash tree.
const SAVE_EVERY_BYTES: u64 = 64 << 20;

/// A blob being received; only verified chunk groups are kept.
pub struct PartialBlob {
    id: BlobId,
    size: u64,
    kind: BlobKind,
    path: PathBuf,
    tree_path: PathBuf,
    file: File,
    outboard: PreOrderOutboard<Vec<u8>>,
    unsaved: u64,
    finished: bool,
}

/// Where a received range failed verification.
#[derive(Debug, thiserror::Error)]
#[error("range {range:?} of blob {id} failed verification at byte {at}: {reason}")]
pub struct TransferError {
    /// The blob.
    pub id: BlobId,
    /// The range asked for.
    pub range: Range<u64>,
    /// First byte that is not verified (everything before it in the range was kept).
    pub at: u64,
    /// What the decoder saw.
    pub reason: String,
    /// The bytes could not be written here (a full disk, a read-only store): this node's
    /// failure, not the sender's.
    pub local: bool,
}

impl PartialBlob {
    /// Starts receiving blob `id` of `size` bytes into `store`'s partial space, resuming what an
    /// earlier attempt of the same blob and size left there.
    pub fn new(store: &Store, id: BlobId, size: u64, kind: BlobKind) -> Result<Self> {
        if size == 0 {
            bail!("blob {id}: a blob of 0 bytes cannot be fetched by ranges");
        }
        let path = store.partial_path(&id, "part");
        let tree_path = store.partial_path(&id, "tree");
        let tree = BaoTree::new(size, BLOCK_SIZE);
        let resumed = match (fs::metadata(&path), fs::read(&tree_path)) {
            (Ok(m), Ok(data)) if m.len() == size && data.len() as u64 == tree.outboard_size() => {
                Some(data)
            }
            _ => None,
        };
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(resumed.is_none())
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        file.set_len(size)?;
        let data = resumed.unwrap_or_else(|| vec![0u8; tree.outboard_size() as usize]);
        let outboard = PreOrderOutboard {
            root: blake3::Hash::from(id.0),
            tree,
            data,
        };
        Ok(Self {
            id,
            size,
            kind,
            path,
            tree_path,
            file,
            outboard,
            unsaved: 0,
            finished: false,
        })
    }

    /// Saves the hash tree verified so far (temporary file, then rename).
    fn save_tree(&mut self) -> Result<()> {
        let tmp = self.tree_path.with_extension("tree.new");
        fs::write(&tmp, &self.outboard.data)?;
        self.file.sync_data()?;
        fs::rename(&tmp, &self.tree_path)?;
        self.unsaved = 0;
        Ok(())
    }

    /// The blob being received.
    pub fn id(&self) -> BlobId {
        self.id
    }

    /// The blob's length.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Verifies and keeps the encoded bytes of `range` (as [`Store::encode_range`] made them).
    pub fn accept(&mut self, range: Range<u64>, encoded: &[u8]) -> Result<(), TransferError> {
        let id = self.id;
        let fail = |at: u64, reason: String| TransferError {
            id,
            range: range.clone(),
            at,
            reason,
            local: false,
        };
        if range.start >= range.end || range.end > self.size {
            return Err(fail(
                range.start,
                format!("not inside the blob's {} bytes", self.size),
            ));
        }
        let ranges = chunk_ranges(&range);
        let result = decode_ranges(encoded, &ranges, &mut self.file, &mut self.outboard);
        super::start_writeback(&self.file);
        self.unsaved += range.end - range.start;
        if self.unsaved >= SAVE_EVERY_BYTES {
            let _ = self.save_tree();
        }
        result.map_err(|e| {
            use bao_tree::io::DecodeError as D;
            let at = match &e {
                D::LeafHashMismatch(c) | D::LeafNotFound(c) => {
                    c.to_bytes().clamp(range.start, range.end)
                }
                _ => range.start,
            };
            // The encoded bytes are in memory: reading them fails only by running out (a
            // short reply). Any other I/O error is writing them here.
            let local = matches!(&e, D::Io(io) if io.kind() != std::io::ErrorKind::UnexpectedEof);
            TransferError {
                local,
                ..fail(at, e.to_string())
            }
        })
    }

    /// Byte ranges not yet verified, ascending.
    pub fn missing(&self) -> Result<Vec<Range<u64>>> {
        let mut gaps = Vec::new();
        let mut next = 0u64;
        for r in valid_ranges(&self.outboard, &self.file, &ChunkRanges::all()) {
            let r = r?;
            let (start, end) = (
                r.start.to_bytes().min(self.size),
                r.end.to_bytes().min(self.size),
            );
            if start > next {
                gaps.push(next..start);
            }
            next = next.max(end);
        }
        if next < self.size {
            gaps.push(next..self.size);
        }
        Ok(gaps)
    }

    /// Moves the blob into the store once every byte is verified; otherwise nothing is stored.
    pub fn finish(mut self, store: &Store) -> Result<BlobId> {
        let missing = self.missing()?;
        if !missing.is_empty() {
            bail!(
                "blob {} is incomplete: {} ranges missing, first {:?}",
                self.id,
                missing.len(),
                missing[0]
            );
        }
        self.file.sync_all()?;
        self.finished = true;
        let _ = fs::remove_file(&self.tree_path);
        // `missing` just checked every byte of the file against the id's hash tree: it is not
        // hashed a third time.
        store.install_verified(&self.path, self.id, self.size, self.kind)
    }
}

impl Drop for PartialBlob {
    fn drop(&mut self) {
        if !self.finished {
            // Keep what verified for the next attempt, in this process or the next.
            let _ = self.save_tree();
        }
    }
}
