//! GGUF, llama.cpp's model format: a header (metadata and tensor infos) and aligned tensor data.
//!
//! [`Gguf::read`] parses the header only, never tensor data, and bounds every length by the
//! bytes that remain in the file, so a malformed or hostile file is an error, not a panic or an
//! unbounded allocation. [`GgufWriter`] writes GGUF v3 whose metadata round-trips exactly.
//! Shapes are kept in ggml order: `dims[0]` is the innermost (contiguous) dimension.
//! A model split into parts (llama.cpp's gguf-split) is read as one by [`ModelFiles`] (headers)
//! and [`MappedGguf`] (data).

mod mapped;
mod read;
pub mod split;
mod types;
mod value;
mod write;

pub use mapped::{MappedGguf, RawTensor};
pub use read::{Gguf, GgufError, TensorInfo};
pub use split::{ModelFiles, SplitError};
pub use types::{GgmlType, UnknownGgmlType};
pub use value::{Value, ValueType};
pub use write::{header_bytes, GgufWriter, TensorLayout};

/// `GGUF` read as a little-endian u32.
pub const MAGIC: u32 = 0x4655_4747;
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the alignment.
pub const KEY_ALIGNMENT: &str = "general.alignment";

/// Rounds `x` up to a multiple of `align` (a power of two).
pub fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}
