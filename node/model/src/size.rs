//! Sizes people write: `64GiB`, `512MiB`, `1.5TB`, `4096`.

use std::fmt;
use std::str::FromStr;

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes as GiB, for people.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

/// A size that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// The number part is not a number.
    #[error("size {input:?}: {number:?} is not a number (write e.g. 64GiB)")]
    NotANumber { input: String, number: String },
    /// The unit is none of the known ones.
    #[error("size {input:?}: unknown unit {unit:?} (use KiB, MiB, GiB, TiB, KB, MB, GB, TB)")]
    UnknownUnit { input: String, unit: String },
    /// Negative, or more bytes than a u64 holds.
    #[error("size {0:?} is out of range")]
    OutOfRange(String),
}

/// Parses a size such as `64GiB`, `512MiB`, `1.5TB`, `4096` (bytes). Binary (KiB, MiB, GiB,
/// TiB) and decimal (KB, MB, GB, TB) units; case-insensitive; a bare number is bytes.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| SizeError::NotANumber {
        input: s.to_string(),
        number: num.to_string(),
    })?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(SizeError::UnknownUnit {
                input: s.to_string(),
                unit: other.to_string(),
            })
        }
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(SizeError::OutOfRange(s.to_string()));
    }
    Ok(bytes.round() as u64)
}

/// A number of bytes, read from and shown as a size people write (for flags and config files).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = SizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}B", self.0)
    }
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(b) => Ok(ByteSize(b)),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_in_binary_and_decimal_units() {
        assert_eq!(parse_size("64GiB").unwrap(), 64 << 30);
        assert_eq!(parse_size("1.5 gib").unwrap(), 3 << 29);
        assert_eq!(parse_size("2TB").unwrap(), 2_000_000_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!("8GiB".parse::<ByteSize>().unwrap(), ByteSize(8 << 30));
    }

    #[test]
    fn a_bad_size_names_what_is_wrong() {
        let e = parse_size("12 furlongs").unwrap_err().to_string();
        assert!(e.contains("furlongs"), "{e}");
        assert!(matches!(parse_size("x"), Err(SizeError::NotANumber { .. })));
        assert!(parse_size("-3GiB").is_err());
    }
}
