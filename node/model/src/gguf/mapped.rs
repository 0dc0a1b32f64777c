//! A model's GGUF files memory-mapped (one file, or every part of a split model), with the
//! model's header: tensor bytes without reading them all.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use crate::error::{bail, Context, Result};

use super::{GgmlType, Gguf, ModelFiles, TensorInfo};

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

/// A mapped model: one GGUF file, or all the parts of a split one.
pub struct MappedGguf {
    /// The model's header (for a split model, the parts' headers as one: see [`ModelFiles`]).
    pub header: Gguf,
    files: ModelFiles,
    maps: Vec<Arc<memmap2::Mmap>>,
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
        let files = ModelFiles::open(path)?;
        let mut maps = Vec::with_capacity(files.parts.len());
        for part in &files.parts {
            let file = File::open(&part.path)
                .with_context(|| format!("opening {}", part.path.display()))?;
            let mut options = memmap2::MmapOptions::new();
            if populate {
                options.populate();
            }
            // SAFETY: read-only map; every blob made from it is hashed from the bytes copied.
            let map = unsafe { options.map(&file) }
                .with_context(|| format!("memory-mapping {}", part.path.display()))?;
            if map.len() as u64 != part.file_size {
                bail!("{} changed size while being read", part.path.display());
            }
            maps.push(Arc::new(map));
        }
        Ok(Self {
            header: files.header.clone(),
            files,
            maps,
        })
    }

    /// The files the model was read from, in order (one unless it is split).
    pub fn files(&self) -> &ModelFiles {
        &self.files
    }

    /// The mapped file that holds `data`, shared, and where `data` starts in it; `None` when
    /// `data` is not a slice of a mapped file. What computes on weights in place holds the
    /// map, so the bytes stay mapped (and counted once) after this value is gone.
    #[allow(clippy::type_complexity)]
    pub fn shared_map_of(
        &self,
        data: &[u8],
    ) -> Option<(Arc<dyn AsRef<[u8]> + Send + Sync>, usize)> {
        let start = data.as_ptr() as usize;
        self.maps.iter().find_map(|map| {
            let base = map.as_ptr() as usize;
            (start >= base && start + data.len() <= base + map.len()).then(|| {
                let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = map.clone();
                (owner, start - base)
            })
        })
    }

    /// The bytes of a tensor from the header.
    ///
    /// `t` must be one of [`Self::header`]'s tensors (each lies in one part, checked when the
    /// files were read); any other gives no bytes.
    pub fn bytes_of(&self, t: &TensorInfo) -> &[u8] {
        match self.files.locate(self.header.tensor_range(t)) {
            Some((i, r)) => &self.maps[i][r.start as usize..r.end as usize],
            None => &[],
        }
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
