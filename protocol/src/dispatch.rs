//! Dispatch messages of the data plane: the router sends a worker one layer's rows for some
//! slabs; the worker answers their unweighted expert outputs.
//!
//! Every dispatch carries a [`DispatchTicket`] (model, router epoch, step, layer, a sequence
//! number) and lists its slabs with their row counts. A reply is accepted only if it answers
//! its request exactly ([`DispatchReply::check_answers`]): same ticket, same slabs in the same
//! order, same row counts, same width. Workers never see gating weights or other experts.
//!
//! A message is a frame: `u32` LE header length, the JSON header, `u64` LE payload length, then
//! the payload: the rows of each slab in order (a request whose rows repeat carries each
//! distinct row once, with an index: [`crate::rows`]), each row `n_embd` little-endian values
//! of the message's [`WireType`] (`f32` unless the router asks for `f16` or `bf16`, which halves the
//! bytes but rounds the activations, so the result is no longer bit-identical to a local run).
//! Lengths are checked against the limits here before anything is allocated.

use serde::{Deserialize, Serialize};

use crate::ids::{BlobId, ModelId};

/// ALPN of direct data-plane connections.
pub const DISPATCH_ALPN: &[u8] = b"moeswarm-dispatch/1";
/// Largest frame header.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// Largest frame payload (a layer's rows for the slabs of one worker).
pub const MAX_PAYLOAD_BYTES: u64 = 64 << 20;
/// Most slabs in one dispatch.
pub const MAX_SLABS_PER_DISPATCH: usize = 4096;
/// Widest row accepted.
pub const MAX_EMBD: u32 = 1 << 16;
/// Domain tag of a worker's signature over a reply sent through a relay (v2: the signature
/// covers the digest of the request answered as well as the reply).
pub const REPLY_SIGNING_DOMAIN: &[u8] = b"moeswarm/dispatch-reply/v2\0";
/// Domain tag of a request's digest.
pub const REQUEST_DIGEST_DOMAIN: &[u8] = b"moeswarm/dispatch-request/v1\0";

/// The blake3 digest of one dispatch request, header and rows: what a relayed reply's
/// signature says it answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestDigest(pub [u8; 32]);

pub use crate::rows::RowLayout;
pub use crate::wire::{f32_to_le, le_to_f32, WireType};

/// What a dispatch answers to: unique per router run and call.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchTicket {
    /// The model.
    pub model: ModelId,
    /// Random per router run, so tickets of two runs never collide.
    pub epoch: u64,
    /// The router's forward pass (prefill or decode step) count.
    pub step: u64,
    /// The layer.
    pub layer: u32,
    /// Unique per dispatch within the epoch.
    pub seq: u64,
}

/// One slab of a dispatch and how many rows it computes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlabRows {
    /// The slab's blob id.
    pub slab: BlobId,
    /// Its expert index in the layer.
    pub expert: u32,
    /// Rows it computes.
    pub rows: u32,
}

/// The header of a dispatch; the payload carries the rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchRequest {
    /// The ticket.
    pub ticket: DispatchTicket,
    /// Row width.
    pub n_embd: u32,
    /// The slabs, in payload order.
    pub slabs: Vec<SlabRows>,
    /// How rows travel, both ways.
    #[serde(default, skip_serializing_if = "is_f32")]
    pub wire: WireType,
    /// When rows repeat across the slabs: how many distinct rows the payload carries, after
    /// its index ([`RowLayout::Distinct`]); absent, every slab's rows in order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distinct_rows: Option<u32>,
}

fn is_f32(w: &WireType) -> bool {
    *w == WireType::F32
}

/// How a worker answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case", deny_unknown_fields)]
pub enum ReplyStatus {
    /// The payload holds the outputs.
    Ok,
    /// Its queue is full: ask elsewhere.
    Busy,
    /// It will not compute this (names why).
    Refused {
        /// Why.
        reason: String,
    },
}

/// The header of a reply; the payload carries the outputs, in the request's slab order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchReply {
    /// The ticket answered.
    pub ticket: DispatchTicket,
    /// The outcome.
    pub status: ReplyStatus,
    /// Row width.
    pub n_embd: u32,
    /// The slabs answered, in payload order.
    pub slabs: Vec<SlabRows>,
    /// How the outputs travel (the request's).
    #[serde(default, skip_serializing_if = "is_f32")]
    pub wire: WireType,
    /// For replies through a relay: the worker's ed25519 signature over
    /// [`REPLY_SIGNING_DOMAIN`], the [`RequestDigest`] of the request answered, the header
    /// without this field, and the payload's blake3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

/// A message that breaks the rules, or a reply that does not answer its request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DispatchError {
    /// Over a limit.
    #[error("{what} of {len} is over the limit of {max}")]
    Oversized {
        /// Which part.
        what: &'static str,
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Not a message of this protocol.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// Which part.
        what: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A well-formed reply that is not the answer to the request it came back on.
    #[error("reply does not answer its dispatch: {0}")]
    Mismatch(String),
}

fn malformed(what: &'static str, reason: impl Into<String>) -> DispatchError {
    DispatchError::Malformed {
        what,
        reason: reason.into(),
    }
}

/// Bytes of the payload for `slabs` rows of `n_embd` values of `wire`, laid out as `layout`.
pub fn payload_len(slabs: &[SlabRows], n_embd: u32, wire: WireType, layout: RowLayout) -> u64 {
    layout.payload_len(slab_rows(slabs), n_embd, wire)
}

/// Rows of all `slabs`.
fn slab_rows(slabs: &[SlabRows]) -> u64 {
    slabs.iter().map(|s| s.rows as u64).sum()
}

fn check_slabs(
    slabs: &[SlabRows],
    n_embd: u32,
    wire: WireType,
    layout: RowLayout,
) -> Result<(), DispatchError> {
    if slabs.len() > MAX_SLABS_PER_DISPATCH {
        return Err(DispatchError::Oversized {
            what: "slab count",
            len: slabs.len() as u64,
            max: MAX_SLABS_PER_DISPATCH as u64,
        });
    }
    if n_embd == 0 || n_embd > MAX_EMBD {
        return Err(malformed("dispatch", format!("row width {n_embd}")));
    }
    if slabs.iter().any(|s| s.rows == 0) {
        return Err(malformed("dispatch", "a slab with no rows"));
    }
    if let RowLayout::Distinct(d) = layout {
        if d == 0 || d as u64 > slab_rows(slabs) {
            return Err(malformed(
                "dispatch",
                format!("{d} distinct rows for {} rows", slab_rows(slabs)),
            ));
        }
    }
    // The rows once taken out of the payload are held to the payload's limit as well: an
    // index of small entries must not stand for more rows than a payload may carry.
    let len = payload_len(slabs, n_embd, wire, layout).max(payload_len(
        slabs,
        n_embd,
        wire,
        RowLayout::EachSlab,
    ));
    if len > MAX_PAYLOAD_BYTES {
        return Err(DispatchError::Oversized {
            what: "payload",
            len,
            max: MAX_PAYLOAD_BYTES,
        });
    }
    Ok(())
}

impl DispatchRequest {
    /// Checks limits: slab count, width, rows, payload size.
    pub fn validate(&self) -> Result<(), DispatchError> {
        if self.slabs.is_empty() {
            return Err(malformed("dispatch", "no slabs"));
        }
        check_slabs(&self.slabs, self.n_embd, self.wire, self.layout())
    }

    /// How its payload lays out the rows.
    pub fn layout(&self) -> RowLayout {
        RowLayout::of(self.distinct_rows)
    }

    /// Bytes its payload must have.
    pub fn payload_len(&self) -> u64 {
        payload_len(&self.slabs, self.n_embd, self.wire, self.layout())
    }

    /// Bytes of every slab's rows once taken out of the payload (its outputs' bytes too).
    pub fn rows_len(&self) -> u64 {
        payload_len(&self.slabs, self.n_embd, self.wire, RowLayout::EachSlab)
    }

    /// Each slab's rows from its payload (the pieces it arrived in, its length checked).
    pub fn unpack<'a>(
        &self,
        parts: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<Vec<Vec<f32>>, DispatchError> {
        crate::rows::unpack(self.layout(), &self.slabs, self.n_embd, self.wire, parts)
    }

    /// The digest of this request with `payload`: blake3 over [`REQUEST_DIGEST_DOMAIN`], the
    /// header's JSON and the payload's blake3. The router computes it over what it sent, the
    /// worker over what it received; a relay that rewrites any of it makes them differ.
    pub fn digest(&self, payload: &[u8]) -> RequestDigest {
        self.digest_with(*blake3::hash(payload).as_bytes())
    }

    /// The digest of the header alone (the payload's hash taken as zeros): what a busy or
    /// refused reply, decided before the payload is read, is signed over.
    pub fn digest_of_header(&self) -> RequestDigest {
        self.digest_with([0; 32])
    }

    fn digest_with(&self, payload_hash: [u8; 32]) -> RequestDigest {
        let header = serde_json::to_vec(self).expect("requests always serialize");
        let mut h = blake3::Hasher::new();
        h.update(REQUEST_DIGEST_DOMAIN);
        h.update(&(header.len() as u64).to_le_bytes());
        h.update(&header);
        h.update(&payload_hash);
        RequestDigest(*h.finalize().as_bytes())
    }
}

impl DispatchReply {
    /// An answer of `status` to `req` carrying no payload (busy or refused).
    pub fn without_outputs(req: &DispatchRequest, status: ReplyStatus) -> Self {
        Self {
            ticket: req.ticket.clone(),
            status,
            n_embd: req.n_embd,
            slabs: Vec::new(),
            wire: req.wire,
            signature: None,
        }
    }

    /// Bytes its payload must have.
    pub fn payload_len(&self) -> u64 {
        payload_len(&self.slabs, self.n_embd, self.wire, RowLayout::EachSlab)
    }

    /// Checks limits.
    pub fn validate(&self) -> Result<(), DispatchError> {
        check_slabs(&self.slabs, self.n_embd, self.wire, RowLayout::EachSlab)
    }

    /// Whether this reply answers `req` exactly (status aside).
    pub fn check_answers(&self, req: &DispatchRequest) -> Result<(), DispatchError> {
        if self.ticket != req.ticket {
            return Err(DispatchError::Mismatch(format!(
                "ticket {:?} is not the one sent ({:?})",
                self.ticket, req.ticket
            )));
        }
        if self.status != ReplyStatus::Ok {
            return Ok(());
        }
        if self.n_embd != req.n_embd || self.slabs != req.slabs || self.wire != req.wire {
            return Err(DispatchError::Mismatch(format!(
                "answers {} slabs of width {}, sent {} of width {}",
                self.slabs.len(),
                self.n_embd,
                req.slabs.len(),
                req.n_embd
            )));
        }
        Ok(())
    }

    /// The bytes a relayed reply's signature covers: the domain, the digest of the request it
    /// answers, the header without its signature, and the payload's blake3.
    pub fn signed_bytes(&self, payload: &[u8], request: &RequestDigest) -> Vec<u8> {
        let mut unsigned = self.clone();
        unsigned.signature = None;
        let header = serde_json::to_vec(&unsigned).expect("replies always serialize");
        [
            REPLY_SIGNING_DOMAIN,
            &request.0,
            &header,
            blake3::hash(payload).as_bytes(),
        ]
        .concat()
    }
}

/// The head of a frame: header bytes and the payload length that follows.
pub fn frame_head(header: &[u8], payload_len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + header.len());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(&payload_len.to_le_bytes());
    out
}

/// Checks a frame's header length before it is read.
pub fn check_header_len(len: u32) -> Result<usize, DispatchError> {
    if len as usize > MAX_HEADER_BYTES {
        return Err(DispatchError::Oversized {
            what: "header",
            len: len as u64,
            max: MAX_HEADER_BYTES as u64,
        });
    }
    Ok(len as usize)
}

/// Checks a frame's payload length against the length its header implies.
pub fn check_payload_len(len: u64, expected: u64) -> Result<usize, DispatchError> {
    if len > MAX_PAYLOAD_BYTES {
        return Err(DispatchError::Oversized {
            what: "payload",
            len,
            max: MAX_PAYLOAD_BYTES,
        });
    }
    if len != expected {
        return Err(malformed(
            "frame",
            format!("payload of {len} bytes where the header says {expected}"),
        ));
    }
    Ok(len as usize)
}

/// Parses a JSON header of type `T`.
pub fn parse_header<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, DispatchError> {
    serde_json::from_slice(bytes).map_err(|e| malformed("header", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req() -> DispatchRequest {
        DispatchRequest {
            ticket: DispatchTicket {
                model: ModelId(BlobId::of(b"m")),
                epoch: 7,
                step: 3,
                layer: 1,
                seq: 42,
            },
            n_embd: 64,
            slabs: vec![
                SlabRows {
                    slab: BlobId::of(b"a"),
                    expert: 2,
                    rows: 3,
                },
                SlabRows {
                    slab: BlobId::of(b"b"),
                    expert: 5,
                    rows: 1,
                },
            ],
            wire: WireType::F32,
            distinct_rows: None,
        }
    }

    fn ok_reply(r: &DispatchRequest) -> DispatchReply {
        DispatchReply {
            ticket: r.ticket.clone(),
            status: ReplyStatus::Ok,
            n_embd: r.n_embd,
            slabs: r.slabs.clone(),
            wire: r.wire,
            signature: None,
        }
    }

    #[test]
    fn only_the_exact_answer_is_accepted() {
        let r = req();
        assert_eq!(r.payload_len(), 4 * 64 * 4);
        assert!(ok_reply(&r).check_answers(&r).is_ok());
        let mut other = ok_reply(&r);
        other.ticket.seq += 1;
        assert!(matches!(
            other.check_answers(&r),
            Err(DispatchError::Mismatch(_))
        ));
        let mut other = ok_reply(&r);
        other.ticket.step += 1;
        assert!(other.check_answers(&r).is_err());
        let mut other = ok_reply(&r);
        other.slabs[1].rows = 2;
        assert!(other.check_answers(&r).is_err());
        let mut other = ok_reply(&r);
        other.slabs.swap(0, 1);
        assert!(other.check_answers(&r).is_err());
        let mut other = ok_reply(&r);
        other.n_embd = 32;
        assert!(other.check_answers(&r).is_err());
        let busy = DispatchReply::without_outputs(&r, ReplyStatus::Busy);
        assert!(busy.check_answers(&r).is_ok());
        let mut other = ok_reply(&r);
        other.wire = WireType::F16;
        assert!(other.check_answers(&r).is_err());
        let mut half = r.clone();
        half.wire = WireType::Bf16;
        assert_eq!(half.payload_len() * 2, r.payload_len());
        // An f32 dispatch's header is spelled as before the wire type existed.
        let json = serde_json::to_string(&r).unwrap();
        assert!(!json.contains("wire"), "{json}");
    }

    #[test]
    fn a_request_names_between_one_distinct_row_and_as_many_as_it_sends() {
        let mut r = req();
        r.distinct_rows = Some(1);
        assert!(r.validate().is_ok());
        // One u32 of index a slab row, then the one distinct row.
        assert_eq!(r.payload_len(), 4 * 4 + 64 * 4);
        assert_eq!(r.rows_len(), 4 * 64 * 4);
        for bad in [0, 5] {
            r.distinct_rows = Some(bad);
            assert!(
                matches!(r.validate(), Err(DispatchError::Malformed { .. })),
                "{bad} distinct rows"
            );
        }
        // A small index standing for more rows than a payload may carry is refused too.
        r.distinct_rows = Some(1);
        r.n_embd = MAX_EMBD;
        r.slabs[0].rows = (MAX_PAYLOAD_BYTES / (MAX_EMBD as u64 * 4)) as u32;
        assert!(r.payload_len() < MAX_PAYLOAD_BYTES);
        assert!(matches!(
            r.validate(),
            Err(DispatchError::Oversized {
                what: "payload",
                ..
            })
        ));
    }

    #[test]
    fn limits_are_named() {
        let mut r = req();
        r.slabs[0].rows = u32::MAX;
        assert!(matches!(
            r.validate(),
            Err(DispatchError::Oversized {
                what: "payload",
                ..
            })
        ));
        let mut r = req();
        r.n_embd = 0;
        assert!(r.validate().is_err());
        let mut r = req();
        r.slabs.clear();
        assert!(r.validate().is_err());
        assert!(check_header_len(MAX_HEADER_BYTES as u32 + 1).is_err());
        assert!(check_payload_len(10, 12).is_err());
        assert!(check_payload_len(MAX_PAYLOAD_BYTES + 4, MAX_PAYLOAD_BYTES + 4).is_err());
        assert!(parse_header::<DispatchRequest>(br#"{"ticket":1}"#).is_err());
    }

    #[test]
    fn the_signed_bytes_cover_the_request_the_header_and_the_payload() {
        let r = req();
        let d = r.digest(b"rows");
        let a = ok_reply(&r);
        let mut signed = a.clone();
        signed.signature = Some("ab".into());
        assert_eq!(a.signed_bytes(b"xy", &d), signed.signed_bytes(b"xy", &d));
        assert_ne!(a.signed_bytes(b"xy", &d), a.signed_bytes(b"xz", &d));
        let mut b = a.clone();
        b.ticket.layer = 9;
        assert_ne!(a.signed_bytes(b"xy", &d), b.signed_bytes(b"xy", &d));
        // Another request, or the same header with other rows, is another digest.
        assert_ne!(d, r.digest(b"rowz"));
        let mut r2 = r.clone();
        r2.slabs[0].expert += 1;
        assert_ne!(d, r2.digest(b"rows"));
        assert_ne!(
            a.signed_bytes(b"xy", &d),
            a.signed_bytes(b"xy", &r2.digest(b"rows"))
        );
    }

    proptest! {
        #[test]
        fn floats_round_trip_bit_exactly(v in proptest::collection::vec(any::<u32>(), 0..64)) {
            let f: Vec<f32> = v.iter().map(|b| f32::from_bits(*b)).collect();
            let back = le_to_f32(&f32_to_le(&f));
            prop_assert_eq!(back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), v);
        }

        #[test]
        fn garbage_headers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_header::<DispatchRequest>(&bytes);
            let _ = parse_header::<DispatchReply>(&bytes);
        }
    }
}
