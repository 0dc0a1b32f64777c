//! The GGUF header reader.

use std::fs::File;
use std::io::{BufReader, Read};
use std::ops::Range;
use std::path::Path;

use moeswarm_protocol::BlobId;

use super::{align_up, GgmlType, Value, ValueType, DEFAULT_ALIGNMENT, KEY_ALIGNMENT, MAGIC};

/// Most tensors a header may declare.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata entries a header may declare.
pub const MAX_METADATA: u64 = 1 << 20;
/// Most items in one metadata array.
pub const MAX_ARRAY_ITEMS: u64 = 1 << 24;
/// Longest string (key, value or tensor name), in bytes.
pub const MAX_STRING_BYTES: u64 = 1 << 24;
/// Deepest nesting of metadata arrays.
pub const MAX_ARRAY_DEPTH: u32 = 4;
/// Most dimensions of a tensor.
pub const MAX_DIMS: u32 = 4;

/// Why a GGUF file was refused. Each variant says what was wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be read.
    #[error("reading GGUF: {0}")]
    Io(#[from] std::io::Error),
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file (magic {0:#010x}, want 0x46554747 \"GGUF\")")]
    BadMagic(u32),
    /// A version this reader does not know.
    #[error("GGUF version {0} is not supported (versions 2 and 3 are)")]
    UnsupportedVersion(u32),
    /// The file ends inside the header.
    #[error("GGUF truncated: file ends at byte {at} while reading {what}")]
    Truncated {
        /// What was being read.
        what: String,
        /// Byte offset where the file ended.
        at: u64,
    },
    /// A count or length is larger than the file or a hard limit allows.
    #[error("GGUF {what} is {value}, over the limit of {limit}")]
    TooLarge {
        /// What was counted.
        what: String,
        /// The value found.
        value: u64,
        /// The most allowed here.
        limit: u64,
    },
    /// Any other malformed field.
    #[error("GGUF malformed: {0}")]
    Malformed(String),
    /// A tensor type id nobody assigned.
    #[error("GGUF tensor {tensor:?} has unknown type id {id}")]
    UnknownTensorType {
        /// The tensor's name.
        tensor: String,
        /// The type id found.
        id: u32,
    },
    /// A tensor whose data lies outside the file.
    #[error("GGUF tensor {tensor:?} data [{start}, {end}) lies past the end of the file ({file_size} bytes)")]
    OutOfRange {
        /// The tensor's name.
        tensor: String,
        /// Absolute start of its data.
        start: u64,
        /// Absolute end of its data.
        end: u64,
        /// The file's length.
        file_size: u64,
    },
}

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name, e.g. `blk.0.ffn_gate_exps.weight`.
    pub name: String,
    /// Shape in ggml order (`dims[0]` innermost).
    pub dims: Vec<u64>,
    /// Element type.
    pub dtype: GgmlType,
    /// Offset of the data from the start of the data region.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of data (validated not to overflow when read from a file).
    pub fn n_bytes(&self) -> u64 {
        tensor_bytes(&self.dims, self.dtype).unwrap_or(u64::MAX)
    }
}

/// Bytes of a tensor of this shape and type; `None` on overflow or a partial block.
pub fn tensor_bytes(dims: &[u64], dtype: GgmlType) -> Option<u64> {
    let row = dtype.row_bytes(*dims.first()?)?;
    dims[1..].iter().try_fold(row, |acc, &d| acc.checked_mul(d))
}

/// A parsed GGUF header.
#[derive(Debug, Clone)]
pub struct Gguf {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of tensor data.
    pub alignment: u64,
    /// Absolute offset of the data region.
    pub data_offset: u64,
    /// Length of the whole file.
    pub file_size: u64,
    /// blake3 of the header bytes `[0, data_offset)`.
    pub header_id: BlobId,
}

/// Checks that every tensor's data is aligned, inside the file and overlaps no other's.
fn check_placement(
    tensors: &[TensorInfo],
    alignment: u64,
    data_offset: u64,
    file_size: u64,
) -> Result<(), GgufError> {
    let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if t.offset % alignment != 0 {
            return Err(GgufError::Malformed(format!(
                "tensor {:?} offset {} is not aligned to {alignment}",
                t.name, t.offset
            )));
        }
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes()));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_size => spans.push((start, end, i)),
            _ => {
                return Err(GgufError::OutOfRange {
                    tensor: t.name.clone(),
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    file_size,
                })
            }
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(GgufError::Malformed(format!(
                "tensors {:?} and {:?} overlap",
                tensors[w[0].2].name, tensors[w[1].2].name
            )));
        }
    }
    Ok(())
}

struct HeaderReader<R> {
    inner: R,
    pos: u64,
    file_size: u64,
    hasher: blake3::Hasher,
}

impl<R: Read> HeaderReader<R> {
    /// The `n_kv` metadata pairs, in file order; a key given twice is an error.
    fn metadata(&mut self, n_kv: u64) -> Result<Vec<(String, Value)>, GgufError> {
        let h = self;
        let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv as usize);
        let mut keys = std::collections::HashSet::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = h.string(&|| format!("metadata key #{i}"))?;
            let what = || format!("metadata {key:?}");
            let ty_id = h.u32(&|| format!("type of {}", what()))?;
            let ty = ValueType::from_id(ty_id).ok_or_else(|| {
                GgufError::Malformed(format!("{} has unknown value type {ty_id}", what()))
            })?;
            let value = h.value(ty, 0, &what)?;
            if !keys.insert(key.clone()) {
                return Err(GgufError::Malformed(format!(
                    "duplicate metadata key {key:?}"
                )));
            }
            metadata.push((key, value));
        }
        Ok(metadata)
    }

    /// The `n_tensors` tensor infos, in file order: shapes that fit their type, known types,
    /// no name twice.
    fn tensor_infos(&mut self, n_tensors: u64) -> Result<Vec<TensorInfo>, GgufError> {
        let h = self;
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = std::collections::HashSet::new();
        for i in 0..n_tensors {
            let name = h.string(&|| format!("name of tensor #{i}"))?;
            let what = |field: &str| format!("{field} of tensor {name:?}");
            let n_dims = h.u32(&|| what("dimension count"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::Malformed(format!(
                    "tensor {name:?} has {n_dims} dimensions (1..={MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                let v = h.u64(&|| what(&format!("dimension {d}")))?;
                if v == 0 {
                    return Err(GgufError::Malformed(format!(
                        "tensor {name:?} has dimension {d} of size 0"
                    )));
                }
                dims.push(v);
            }
            let type_id = h.u32(&|| what("type"))?;
            let dtype = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
                tensor: name.clone(),
                id: type_id,
            })?;
            let offset = h.u64(&|| what("offset"))?;
            if tensor_bytes(&dims, dtype).is_none() {
                return Err(GgufError::Malformed(format!(
                    "tensor {name:?} shape {dims:?} is not a whole number of {dtype} blocks \
                 ({} elements each) or overflows",
                    dtype.block_size()
                )));
            }
            if !names.insert(name.clone()) {
                return Err(GgufError::Malformed(format!("duplicate tensor {name:?}")));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                dtype,
                offset,
            });
        }
        Ok(tensors)
    }

    fn bytes(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<Vec<u8>, GgufError> {
        let mut buf = vec![0u8; n as usize];
        self.inner.read_exact(&mut buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                GgufError::Truncated {
                    what: what(),
                    at: self.file_size.min(self.pos + n),
                }
            } else {
                GgufError::Io(e)
            }
        })?;
        self.hasher.update(&buf);
        self.pos += n;
        Ok(buf)
    }

    fn remaining(&self) -> u64 {
        self.file_size.saturating_sub(self.pos)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let v = self.bytes(N as u64, what)?;
        Ok(v.try_into().expect("read exactly N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that is bounded both by a hard limit and by the bytes left in the file.
    fn count(
        &mut self,
        min_bytes_each: u64,
        limit: u64,
        what: &dyn Fn() -> String,
    ) -> Result<u64, GgufError> {
        let n = self.u64(what)?;
        if (n as i64) < 0 {
            return Err(GgufError::Malformed(format!(
                "{} is negative ({})",
                what(),
                n as i64
            )));
        }
        let fits = self.remaining() / min_bytes_each.max(1);
        let limit = limit.min(fits);
        if n > limit {
            return Err(GgufError::TooLarge {
                what: what(),
                value: n,
                limit,
            });
        }
        Ok(n)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.count(1, MAX_STRING_BYTES, &|| format!("length of {}", what()))?;
        let bytes = self.bytes(len, what)?;
        String::from_utf8(bytes)
            .map_err(|_| GgufError::Malformed(format!("{} is not UTF-8", what())))
    }

    fn value(
        &mut self,
        ty: ValueType,
        depth: u32,
        what: &dyn Fn() -> String,
    ) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(GgufError::Malformed(format!("{} is bool byte {b}", what()))),
            },
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Malformed(format!(
                        "{} nests arrays deeper than {MAX_ARRAY_DEPTH}",
                        what()
                    )));
                }
                let elem_id = self.u32(&|| format!("element type of {}", what()))?;
                let elem = ValueType::from_id(elem_id).ok_or_else(|| {
                    GgufError::Malformed(format!("{} has unknown element type {elem_id}", what()))
                })?;
                let n = self.count(elem.min_bytes(), MAX_ARRAY_ITEMS, &|| {
                    format!("item count of {}", what())
                })?;
                let mut items = Vec::with_capacity(n as usize);
                for i in 0..n {
                    items.push(self.value(elem, depth + 1, &|| format!("{}[{i}]", what()))?);
                }
                Value::Array { elem, items }
            }
        })
    }
}

impl Gguf {
    /// Opens and parses the header of the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = File::open(path)?;
        let size = file.metadata()?.len();
        Self::read(BufReader::with_capacity(1 << 16, file), size)
    }

    /// Parses a header held in memory (a whole small file, e.g. a slab).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, GgufError> {
        Self::read(bytes, bytes.len() as u64)
    }

    /// Parses the header from `r`, which yields a file of `file_size` bytes from its start.
    pub fn read(r: impl Read, file_size: u64) -> Result<Self, GgufError> {
        let mut h = HeaderReader {
            inner: r,
            pos: 0,
            file_size,
            hasher: blake3::Hasher::new(),
        };
        let magic = h.u32(&|| "magic".into())?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = h.u32(&|| "version".into())?;
        if !(version == 2 || version == 3) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        // The smallest tensor info: name length, one byte of name, n_dims, one dim, type, offset.
        let n_tensors = h.count(33, MAX_TENSORS, &|| "tensor count".into())?;
        let n_kv = h.count(13, MAX_METADATA, &|| "metadata count".into())?;

        let metadata = h.metadata(n_kv)?;
        let tensors = h.tensor_infos(n_tensors)?;

        let alignment = match metadata.iter().find(|(k, _)| k == KEY_ALIGNMENT) {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) if a.is_power_of_two() => *a as u64,
            Some((_, v)) => {
                return Err(GgufError::Malformed(format!(
                    "{KEY_ALIGNMENT} is {v}, want a power of two as u32"
                )))
            }
        };
        let header_end = h.pos;
        let data_offset = align_up(header_end, alignment);
        // The padding belongs to the header: hash it too, so the id covers [0, data_offset).
        if n_tensors > 0 {
            h.bytes(data_offset - header_end, &|| {
                "padding before tensor data".into()
            })?;
        }
        let data_offset = if n_tensors > 0 {
            data_offset
        } else {
            header_end
        };
        let header_id = BlobId::from_hash(h.hasher.finalize());

        check_placement(&tensors, alignment, data_offset, file_size)?;

        Ok(Self {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            file_size,
            header_id,
        })
    }

    /// The metadata value under `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The absolute byte range of a tensor's data in the file.
    pub fn tensor_range(&self, t: &TensorInfo) -> Range<u64> {
        let start = self.data_offset + t.offset;
        start..start + t.n_bytes()
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }

    /// The total bytes of all tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::n_bytes).sum()
    }
}
