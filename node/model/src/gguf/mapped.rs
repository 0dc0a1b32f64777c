//! A GGUF file memory-mapped, with its parsed header: tensor bytes without reading them all.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use crate::error::{bail, Context, Result};

use super::{GgmlType, Gguf, TensorInfo};

/// A tensor's shape, type and bytes, borrowed from a mapped file.
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    /// Shape in ggml order.
    pub dims: &'a [u64],
    /// Element type.
    pub dtype: GgmlType,
    /// The bytes.
    pub data: &'a [u8],
}

/// A mapped GGUF file.
pub struct MappedGguf {
    /// The parsed header.
    pub header: Gguf,
    map: Arc<memmap2::Mmap>,
}

impl MappedGguf {
    /// Parses the header of `path` and maps the file read-only; pages are read when touched.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, false)
    }

    /// [`open`](Self::open), and every page read in and mapped now (`MAP_POPULATE` on Linux,
    /// as llama.cpp maps its models), so the first computation on the weights does not wait
    /// on page faults or the disk. For files that are computed on; loading then takes as long
    /// as reading the file (nothing when it is in the page cache).
    pub fn open_resident(path: &Path) -> Result<Self> {
        Self::open_with(path, true)
    }

    fn open_with(path: &Path, populate: bool) -> Result<Self> {
        let header = Gguf::open(path).with_context(|| format!("reading {}", path.display()))?;
        let file = File::open(path)?;
        let mut options = memmap2::MmapOptions::new();
        if populate {
            options.populate();
        }
        // SAFETY: read-only map; every blob made from it is hashed from the bytes copied.
        let map = unsafe { options.map(&file) }
            .with_context(|| format!("memory-mapping {}", path.display()))?;
        if map.len() as u64 != header.file_size {
            bail!("{} changed size while being read", path.display());
        }
        Ok(Self {
            header,
            map: Arc::new(map),
        })
    }

    /// The whole mapped file, shared: what computes on weights in place holds this, so the
    /// bytes stay mapped (and counted once) after this value is gone.
    pub fn shared_map(&self) -> Arc<dyn AsRef<[u8]> + Send + Sync> {
        self.map.clone()
    }

    /// Where `data` starts in the mapped file, if it is a slice of it.
    pub fn offset_in_map(&self, data: &[u8]) -> Option<usize> {
        let base = self.map.as_ptr() as usize;
        let start = data.as_ptr() as usize;
        (start >= base && start + data.len() <= base + self.map.len()).then(|| start - base)
    }

    /// The bytes of a tensor from the header.
    pub fn bytes_of(&self, t: &TensorInfo) -> &[u8] {
        let r = self.header.tensor_range(t);
        &self.map[r.start as usize..r.end as usize]
    }

    /// The tensor named `name`, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<RawTensor<'_>> {
        let t = self
            .header
            .tensor(name)
            .with_context(|| format!("tensor {name} is not in the file"))?;
        Ok(RawTensor {
            dims: &t.dims,
            dtype: t.dtype,
            data: self.bytes_of(t),
        })
    }
}
