//! Content ids: every blob (trunk, slab, manifest) is named by the blake3 hash of its bytes.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The blake3 hash of a blob's bytes: its name everywhere in the swarm.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobId(pub [u8; 32]);

/// A model's id: the [`BlobId`] of its canonical manifest bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ModelId(pub BlobId);

/// A string that is not 64 lowercase or uppercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a blob id (want 64 hex digits): {0:?}")]
pub struct IdParseError(pub String);

impl BlobId {
    /// The id of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// The id a finished blake3 hasher stands for.
    pub fn from_hash(hash: blake3::Hash) -> Self {
        Self(*hash.as_bytes())
    }

    /// Lowercase hex, 64 characters.
    pub fn to_hex(&self) -> String {
        blake3::Hash::from(self.0).to_hex().to_string()
    }

    /// The first 12 hex digits, for people reading logs.
    pub fn short(&self) -> String {
        self.to_hex()[..12].to_string()
    }
}

impl ModelId {
    /// The id of a manifest's canonical bytes.
    pub fn of_manifest_bytes(bytes: &[u8]) -> Self {
        Self(BlobId::of(bytes))
    }
}

impl FromStr for BlobId {
    type Err = IdParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 64 {
            return Err(IdParseError(s.chars().take(80).collect()));
        }
        blake3::Hash::from_hex(s)
            .map(|h| Self(*h.as_bytes()))
            .map_err(|_| IdParseError(s.to_string()))
    }
}

impl FromStr for ModelId {
    type Err = IdParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BlobId::from_str(s).map(Self)
    }
}

impl fmt::Display for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlobId({})", self.short())
    }
}

impl fmt::Display for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelId({})", self.0.short())
    }
}

impl Serialize for BlobId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for BlobId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn id_is_plain_blake3() {
        // Known blake3 digest of the empty input.
        assert_eq!(
            BlobId::of(b"").to_hex(),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
    }

    #[test]
    fn bad_hex_is_refused() {
        assert!("abc".parse::<BlobId>().is_err());
        assert!("zz".repeat(32).parse::<BlobId>().is_err());
    }

    proptest! {
        #[test]
        fn hex_round_trip(bytes in proptest::array::uniform32(any::<u8>())) {
            let id = BlobId(bytes);
            prop_assert_eq!(id.to_hex().parse::<BlobId>().unwrap(), id);
            let json = serde_json::to_string(&id).unwrap();
            prop_assert_eq!(serde_json::from_str::<BlobId>(&json).unwrap(), id);
        }
    }
}
