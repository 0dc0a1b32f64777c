//! Signed records: what a node says about itself, signed with its ed25519 key.
//!
//! A record is a canonical JSON body and a signature over a domain tag (one per kind of
//! record, so a signature of one kind means nothing as another) and those bytes. Holdings
//! ([`crate::holdings`]) and demand ([`crate::demand`]) are the two kinds; each says who signed
//! it, its sequence number, its expiry and what a well-formed body looks like
//! ([`RecordBody`]), and [`Signed::verify`] checks all of it the same way for both.

use std::marker::PhantomData;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Largest signed record accepted, in bytes (fits Kademlia's default 16 KiB packets).
pub const MAX_RECORD_BYTES: usize = 12 * 1024;
/// Longest lifetime a record may claim, in seconds.
pub const MAX_TTL_SECS: u64 = 24 * 3600;

/// A node's public key: its name in the swarm (its libp2p PeerId is derived from it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeKey(#[serde(with = "hex32")] pub [u8; 32]);

mod hex32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::ids::BlobId(*b).to_hex())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse::<crate::ids::BlobId>()
            .map(|id| id.0)
            .map_err(serde::de::Error::custom)
    }
}

/// Why a record was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Over [`MAX_RECORD_BYTES`].
    #[error("record of {0} bytes is over the limit of {MAX_RECORD_BYTES}")]
    Oversized(usize),
    /// Not a record, or not its canonical form.
    #[error("record is malformed: {0}")]
    Malformed(String),
    /// The signature does not verify against the key in the record.
    #[error("record signature does not verify")]
    BadSignature,
    /// Signed by another node than the one it came from.
    #[error("record is signed by another node than the peer that sent it")]
    WrongSigner,
    /// A sequence number not above the last one seen from that node (a replay).
    #[error("record sequence {seq} is not newer than {last}: replayed or stale")]
    Stale {
        /// The record's sequence.
        seq: u64,
        /// The last sequence seen.
        last: u64,
    },
    /// Past its expiry, or claiming a lifetime over [`MAX_TTL_SECS`].
    #[error("record expiry {expires_at} is outside (now {now}, now + {MAX_TTL_SECS}]")]
    Expired {
        /// The record's expiry.
        expires_at: u64,
        /// The verifier's clock.
        now: u64,
    },
}

/// The body of a kind of signed record.
pub trait RecordBody: Serialize + DeserializeOwned {
    /// The tag the signature covers before the body.
    const DOMAIN: &'static [u8];
    /// The node that signed it.
    fn signer(&self) -> NodeKey;
    /// Grows with every new record of this kind from the signer.
    fn seq(&self) -> u64;
    /// Unix seconds after which the record is void.
    fn expires_at(&self) -> u64;
    /// Whether the body is well formed beyond what its type says (lengths, ranges, order).
    fn check_shape(&self) -> Result<(), RecordError>;

    /// The canonical body bytes.
    fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("record bodies always serialize")
    }

    /// Signs the body with the signer's key (which must be `self.signer()`).
    fn sign(&self, key: &SigningKey) -> Signed<Self>
    where
        Self: Sized,
    {
        debug_assert_eq!(key.verifying_key().to_bytes(), self.signer().0);
        let body = self.to_bytes();
        let signature = key.sign(&[Self::DOMAIN, &body].concat()).to_bytes();
        Signed::from_parts(body, signature)
    }
}

/// Implements [`RecordBody`] for a record type whose signer, sequence and expiry are fields
/// and whose shape check is its own `check_shape`.
macro_rules! record_body {
    ($t:ty, $domain:expr, $signer:ident) => {
        impl $crate::record::RecordBody for $t {
            const DOMAIN: &'static [u8] = $domain;

            fn signer(&self) -> $crate::record::NodeKey {
                self.$signer
            }

            fn seq(&self) -> u64 {
                self.seq
            }

            fn expires_at(&self) -> u64 {
                self.expires_at
            }

            fn check_shape(&self) -> Result<(), $crate::record::RecordError> {
                <$t>::check_shape(self)
            }
        }
    };
}
pub(crate) use record_body;

/// A record body and its signature, as it travels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signed<T> {
    /// Canonical body bytes.
    pub body: Vec<u8>,
    /// ed25519 signature over the kind's domain tag + `body`.
    pub signature: [u8; 64],
    kind: PhantomData<fn() -> T>,
}

impl<T: RecordBody> Signed<T> {
    /// A record from its body bytes and signature (not verified).
    pub fn from_parts(body: Vec<u8>, signature: [u8; 64]) -> Self {
        Self {
            body,
            signature,
            kind: PhantomData,
        }
    }

    /// The wire form: 64 signature bytes, then the body.
    pub fn to_wire(&self) -> Vec<u8> {
        [&self.signature[..], &self.body].concat()
    }

    /// Parses the wire form (no verification yet).
    pub fn from_wire(bytes: &[u8]) -> Result<Self, RecordError> {
        if bytes.len() > MAX_RECORD_BYTES {
            return Err(RecordError::Oversized(bytes.len()));
        }
        if bytes.len() < 64 {
            return Err(RecordError::Malformed(format!(
                "{} bytes is shorter than a signature",
                bytes.len()
            )));
        }
        Ok(Self::from_parts(
            bytes[64..].to_vec(),
            bytes[..64].try_into().expect("64 bytes"),
        ))
    }

    /// The signer the body claims, before anything is verified (to look up its last
    /// sequence number, or to check it against the sender).
    pub fn claimed_signer(&self) -> Result<NodeKey, RecordError> {
        self.parse().map(|b| b.signer())
    }

    fn parse(&self) -> Result<T, RecordError> {
        let size = self.body.len() + 64;
        if size > MAX_RECORD_BYTES {
            return Err(RecordError::Oversized(size));
        }
        serde_json::from_slice(&self.body).map_err(|e| RecordError::Malformed(e.to_string()))
    }

    /// Verifies the record: size, canonical form and shape, signature by the key it names,
    /// that key being `sender` (when the transport tells who sent it), a sequence above
    /// `last_seq`, and `now < expires_at <= now + MAX_TTL_SECS`.
    pub fn verify(
        &self,
        sender: Option<&NodeKey>,
        last_seq: Option<u64>,
        now: u64,
    ) -> Result<T, RecordError> {
        let b = self.parse()?;
        if b.to_bytes() != self.body {
            return Err(RecordError::Malformed("not in canonical form".into()));
        }
        b.check_shape()?;
        let signer = b.signer();
        let key = VerifyingKey::from_bytes(&signer.0).map_err(|_| RecordError::BadSignature)?;
        let sig = Signature::from_bytes(&self.signature);
        key.verify_strict(&[T::DOMAIN, &self.body].concat(), &sig)
            .map_err(|_| RecordError::BadSignature)?;
        if sender.is_some_and(|s| *s != signer) {
            return Err(RecordError::WrongSigner);
        }
        if let Some(last) = last_seq.filter(|&last| b.seq() <= last) {
            return Err(RecordError::Stale { seq: b.seq(), last });
        }
        let expires_at = b.expires_at();
        if expires_at <= now || expires_at > now.saturating_add(MAX_TTL_SECS) {
            return Err(RecordError::Expired { expires_at, now });
        }
        Ok(b)
    }
}
