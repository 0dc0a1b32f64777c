//! Every ggml tensor type id, with its block size and block byte size.
//!
//! The table covers all ids llama.cpp has assigned, including the types no kernel here
//! computes (IQ*, TQ*, MXFP4), so any tensor's byte range is known from its header alone.

use std::fmt;

/// A ggml tensor type, by its id in GGUF files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, missing_docs)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// (type, id, elements per block, bytes per block).
const TABLE: [(GgmlType, u32, u64, u64); 32] = {
    use GgmlType::*;
    [
        (F32, 0, 1, 4),
        (F16, 1, 1, 2),
        (Q4_0, 2, 32, 18),
        (Q4_1, 3, 32, 20),
        (Q5_0, 6, 32, 22),
        (Q5_1, 7, 32, 24),
        (Q8_0, 8, 32, 34),
        (Q8_1, 9, 32, 36),
        (Q2_K, 10, 256, 84),
        (Q3_K, 11, 256, 110),
        (Q4_K, 12, 256, 144),
        (Q5_K, 13, 256, 176),
        (Q6_K, 14, 256, 210),
        (Q8_K, 15, 256, 292),
        (IQ2_XXS, 16, 256, 66),
        (IQ2_XS, 17, 256, 74),
        (IQ3_XXS, 18, 256, 98),
        (IQ1_S, 19, 256, 50),
        (IQ4_NL, 20, 32, 18),
        (IQ3_S, 21, 256, 110),
        (IQ2_S, 22, 256, 82),
        (IQ4_XS, 23, 256, 136),
        (I8, 24, 1, 1),
        (I16, 25, 1, 2),
        (I32, 26, 1, 4),
        (I64, 27, 1, 8),
        (F64, 28, 1, 8),
        (IQ1_M, 29, 256, 56),
        (BF16, 30, 1, 2),
        (TQ1_0, 34, 256, 54),
        (TQ2_0, 35, 256, 66),
        (MXFP4, 39, 32, 17),
    ]
};

impl GgmlType {
    /// The type with GGUF id `id`; `None` for ids never assigned or since removed.
    pub fn from_id(id: u32) -> Option<Self> {
        TABLE.iter().find(|r| r.1 == id).map(|r| r.0)
    }

    fn row(self) -> &'static (GgmlType, u32, u64, u64) {
        TABLE
            .iter()
            .find(|r| r.0 == self)
            .expect("every type is in the table")
    }

    /// The GGUF id.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// Elements per block.
    pub fn block_size(self) -> u64 {
        self.row().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        self.row().3
    }

    /// Bytes of a row of `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.block_bytes())
    }

    /// The name llama.cpp prints, e.g. `q4_K`, in lower case: `q4_k`.
    pub fn name(self) -> String {
        format!("{self:?}").to_lowercase()
    }

    /// Parses a name as [`GgmlType::name`] prints it (case-insensitive).
    pub fn from_name(name: &str) -> Option<Self> {
        TABLE
            .iter()
            .map(|r| r.0)
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Every known type.
    pub fn all() -> impl Iterator<Item = Self> {
        TABLE.iter().map(|r| r.0)
    }
}

/// A tensor type name that is not one of ggml's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown tensor type {0:?} (known: f32, f16, bf16, q4_0, q8_0, q4_k, q5_k, q6_k, ...)")]
pub struct UnknownGgmlType(pub String);

impl std::str::FromStr for GgmlType {
    type Err = UnknownGgmlType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::from_name(s).ok_or_else(|| UnknownGgmlType(s.to_string()))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_removed_ids_are_unknown() {
        for t in GgmlType::all() {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(&t.name()), Some(t));
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 40, 1000] {
            assert_eq!(GgmlType::from_id(removed), None);
        }
    }
}
