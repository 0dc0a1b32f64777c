//! Blob exchange: the request-response messages nodes use to move blobs and records.
//!
//! A request asks one peer for a blob's size, for a byte range of a blob (answered with the
//! bao-verified encoding of that range, so the asker checks every 16 KiB against the blob id
//! alone), for every holdings or demand record the peer knows of a model (each still signed
//! by its own node, so the asker verifies them itself and trusts the answering peer with
//! nothing), or for the models it serves.
//!
//! Frames are `u32` little-endian length, then the body. A request body is JSON; a response
//! body is a `u32` header length, a JSON [`ResponseHeader`] and a raw payload. Every length is
//! checked against the limits here before anything is allocated.

use serde::{Deserialize, Serialize};

use crate::holdings::MAX_RECORD_BYTES;
use crate::ids::{BlobId, ModelId};
use crate::record::NodeKey;

/// The libp2p protocol name.
pub const EXCHANGE_PROTOCOL: &str = "/moeswarm/blob/1.0.0";
/// Largest request frame body.
pub const MAX_REQUEST_BYTES: usize = 4096;
/// Largest response header.
pub const MAX_RESPONSE_HEADER_BYTES: usize = 4096;
/// Largest byte range one request may ask for.
pub const MAX_RANGE_BYTES: u64 = 8 << 20;
/// Largest response payload: a full range with its proof, or a page of records.
pub const MAX_RESPONSE_PAYLOAD_BYTES: usize = MAX_RANGE_BYTES as usize + (1 << 20);
/// Largest response frame body.
pub const MAX_RESPONSE_BYTES: usize = 4 + MAX_RESPONSE_HEADER_BYTES + MAX_RESPONSE_PAYLOAD_BYTES;
/// Most records in one holdings or demand answer.
pub const MAX_RECORDS_PER_RESPONSE: usize = 512;
/// Most models in one answer to [`ExchangeRequest::Models`].
pub const MAX_MODELS_PER_RESPONSE: usize = 32;

/// What a peer is asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum ExchangeRequest {
    /// The length of a blob.
    Size {
        /// The blob.
        id: BlobId,
    },
    /// Bytes `start..end` of a blob, with their proof.
    Range {
        /// The blob.
        id: BlobId,
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
    },
    /// The holdings records of a model the peer knows, a page at a time in the order of their
    /// signers' keys.
    Holdings {
        /// The model.
        model: ModelId,
        /// Only records signed by keys after this one (the last of the page before).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<NodeKey>,
    },
    /// The demand records of a model the peer knows, paged as holdings records are.
    Demand {
        /// The model.
        model: ModelId,
        /// Only records signed by keys after this one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<NodeKey>,
    },
    /// The models whose manifests the peer serves.
    Models,
    /// The TCP port on which the peer also serves ranges in these frames, unencrypted (a
    /// blob's bytes need integrity, which their proof gives, not secrecy).
    BulkPort,
}

/// What a peer answers; the payload follows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseHeader {
    /// The blob's length; no payload.
    Size {
        /// The blob.
        id: BlobId,
        /// Its length in bytes.
        size: u64,
    },
    /// The payload is the verified encoding of the range.
    Range {
        /// The blob.
        id: BlobId,
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
    },
    /// The payload is `count` records, each a `u32` length and a signed record's wire form.
    Holdings {
        /// The model.
        model: ModelId,
        /// How many records.
        count: u32,
        /// Whether more follow: ask again after the last one's signer.
        #[serde(default, skip_serializing_if = "is_false")]
        more: bool,
    },
    /// The payload is `count` demand records, framed as holdings records are.
    Demand {
        /// The model.
        model: ModelId,
        /// How many records.
        count: u32,
        /// Whether more follow.
        #[serde(default, skip_serializing_if = "is_false")]
        more: bool,
    },
    /// The models whose manifests the peer serves (at most [`MAX_MODELS_PER_RESPONSE`]); no
    /// payload.
    Models {
        /// Their ids.
        models: Vec<ModelId>,
    },
    /// The TCP port of the peer's plain range service, at the addresses it listens on; no
    /// payload.
    BulkPort {
        /// The port.
        port: u16,
    },
    /// The peer does not hold it; no payload.
    NotFound,
    /// The peer will not answer; no payload.
    Refused {
        /// Why.
        reason: String,
    },
}

/// A response: header and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExchangeResponse {
    /// What it is.
    pub header: ResponseHeader,
    /// Its bytes.
    pub payload: Vec<u8>,
}

/// A frame that breaks the rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Longer than its limit.
    #[error("{what} of {len} bytes is over the limit of {max}")]
    Oversized {
        /// Which part.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not a message of this protocol.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// Which part.
        what: &'static str,
        /// What was wrong.
        reason: String,
    },
}

fn malformed(what: &'static str, reason: impl Into<String>) -> WireError {
    WireError::Malformed {
        what,
        reason: reason.into(),
    }
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), WireError> {
    if len > max {
        return Err(WireError::Oversized { what, len, max });
    }
    Ok(())
}

fn check_range(start: u64, end: u64) -> Result<(), WireError> {
    if start >= end {
        return Err(malformed("range", format!("{start}..{end} is empty")));
    }
    if end - start > MAX_RANGE_BYTES {
        return Err(WireError::Oversized {
            what: "range",
            len: (end - start) as usize,
            max: MAX_RANGE_BYTES as usize,
        });
    }
    Ok(())
}

impl ExchangeRequest {
    /// The frame body.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("requests always serialize")
    }

    /// Parses and checks a frame body.
    pub fn decode(body: &[u8]) -> Result<Self, WireError> {
        check_len("request", body.len(), MAX_REQUEST_BYTES)?;
        let req: Self =
            serde_json::from_slice(body).map_err(|e| malformed("request", e.to_string()))?;
        if let Self::Range { start, end, .. } = req {
            check_range(start, end)?;
        }
        Ok(req)
    }
}

impl ExchangeResponse {
    /// A response with no payload.
    pub fn bare(header: ResponseHeader) -> Self {
        Self {
            header,
            payload: Vec::new(),
        }
    }

    /// A holdings answer carrying `records` (wire forms), at most
    /// [`MAX_RECORDS_PER_RESPONSE`] of them.
    pub fn holdings(model: ModelId, records: &[Vec<u8>], more: bool) -> Self {
        let (count, payload) = pack_records(records);
        let more = more || records.len() > count as usize;
        Self {
            header: ResponseHeader::Holdings { model, count, more },
            payload,
        }
    }

    /// A demand answer carrying `records` (wire forms), at most
    /// [`MAX_RECORDS_PER_RESPONSE`] of them.
    pub fn demand(model: ModelId, records: &[Vec<u8>], more: bool) -> Self {
        let (count, payload) = pack_records(records);
        let more = more || records.len() > count as usize;
        Self {
            header: ResponseHeader::Demand { model, count, more },
            payload,
        }
    }

    /// Whether an answer of records says more follow.
    pub fn more(&self) -> bool {
        matches!(
            self.header,
            ResponseHeader::Holdings { more: true, .. } | ResponseHeader::Demand { more: true, .. }
        )
    }

    /// An answer naming `models` (the first [`MAX_MODELS_PER_RESPONSE`]).
    pub fn models(models: &[ModelId]) -> Self {
        Self::bare(ResponseHeader::Models {
            models: models[..models.len().min(MAX_MODELS_PER_RESPONSE)].to_vec(),
        })
    }

    /// The frame body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.encode_head();
        out.reserve_exact(self.payload.len());
        out.extend_from_slice(&self.payload);
        out
    }

    /// The frame body's start, up to its payload: the header's length and the header (a
    /// writer sends the payload after it, uncopied).
    pub fn encode_head(&self) -> Vec<u8> {
        let header = serde_json::to_vec(&self.header).expect("headers always serialize");
        let mut out = Vec::with_capacity(4 + header.len());
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        out
    }

    /// Parses and checks a frame body: header form, payload size and shape.
    pub fn decode(body: &[u8]) -> Result<Self, WireError> {
        check_len("response", body.len(), MAX_RESPONSE_BYTES)?;
        let len_bytes: [u8; 4] = body
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| malformed("response", "shorter than its header length"))?;
        let header_len = Self::header_len(len_bytes)?;
        let header_bytes = body
            .get(4..4 + header_len)
            .ok_or_else(|| malformed("response", "shorter than its header"))?;
        let payload = &body[4 + header_len..];
        let header = Self::check(header_bytes, payload)?;
        Ok(Self {
            header,
            payload: payload.to_vec(),
        })
    }

    /// The header length a frame body starts with, checked against its limit.
    pub fn header_len(len_bytes: [u8; 4]) -> Result<usize, WireError> {
        let header_len = u32::from_le_bytes(len_bytes) as usize;
        check_len("response header", header_len, MAX_RESPONSE_HEADER_BYTES)?;
        Ok(header_len)
    }

    /// A response from its header's bytes and its payload read apart (no copy of the payload),
    /// checked as [`ExchangeResponse::decode`] checks a whole body.
    pub fn from_parts(header_bytes: &[u8], payload: Vec<u8>) -> Result<Self, WireError> {
        check_len(
            "response",
            4 + header_bytes.len() + payload.len(),
            MAX_RESPONSE_BYTES,
        )?;
        let header = Self::check(header_bytes, &payload)?;
        Ok(Self { header, payload })
    }

    /// Parses a header and checks the payload's size and shape against it.
    fn check(header_bytes: &[u8], payload: &[u8]) -> Result<ResponseHeader, WireError> {
        check_len(
            "response header",
            header_bytes.len(),
            MAX_RESPONSE_HEADER_BYTES,
        )?;
        let header: ResponseHeader = serde_json::from_slice(header_bytes)
            .map_err(|e| malformed("response header", e.to_string()))?;
        check_len(
            "response payload",
            payload.len(),
            MAX_RESPONSE_PAYLOAD_BYTES,
        )?;
        match &header {
            ResponseHeader::Range { start, end, .. } => {
                check_range(*start, *end)?;
                if payload.is_empty() {
                    return Err(malformed("range answer", "no payload"));
                }
            }
            ResponseHeader::Holdings { count, .. } | ResponseHeader::Demand { count, .. } => {
                records(payload, *count)?;
            }
            ResponseHeader::Models { models } if models.len() > MAX_MODELS_PER_RESPONSE => {
                return Err(WireError::Oversized {
                    what: "model list",
                    len: models.len(),
                    max: MAX_MODELS_PER_RESPONSE,
                })
            }
            _ if !payload.is_empty() => {
                return Err(malformed("response", "payload on an answer that has none"))
            }
            _ => {}
        }
        Ok(header)
    }

    /// The records of a holdings or demand answer (wire forms, not yet verified).
    pub fn records(&self) -> Result<Vec<&[u8]>, WireError> {
        match self.header {
            ResponseHeader::Holdings { count, .. } | ResponseHeader::Demand { count, .. } => {
                records(&self.payload, count)
            }
            _ => Err(malformed("response", "not an answer of records")),
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The count and payload of an answer of records: each a `u32` length and its bytes.
fn pack_records(records: &[Vec<u8>]) -> (u32, Vec<u8>) {
    let records = &records[..records.len().min(MAX_RECORDS_PER_RESPONSE)];
    let mut payload = Vec::new();
    for r in records {
        payload.extend_from_slice(&(r.len() as u32).to_le_bytes());
        payload.extend_from_slice(r);
    }
    (records.len() as u32, payload)
}

fn records(mut payload: &[u8], count: u32) -> Result<Vec<&[u8]>, WireError> {
    check_len("record count", count as usize, MAX_RECORDS_PER_RESPONSE)?;
    let mut out = Vec::with_capacity(count as usize);
    for i in 0..count {
        let len = payload
            .get(..4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(|| malformed("records", format!("record {i} has no length")))?;
        check_len("record", len, MAX_RECORD_BYTES)?;
        let rec = payload
            .get(4..4 + len)
            .ok_or_else(|| malformed("records", format!("record {i} is truncated")))?;
        out.push(rec);
        payload = &payload[4 + len..];
    }
    if !payload.is_empty() {
        return Err(malformed("records", "bytes after the last record"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn id(n: u8) -> BlobId {
        BlobId::of(&[n])
    }

    #[test]
    fn requests_and_responses_round_trip() {
        for req in [
            ExchangeRequest::Size { id: id(1) },
            ExchangeRequest::Range {
                id: id(2),
                start: 5,
                end: 99,
            },
            ExchangeRequest::Holdings {
                model: ModelId(id(3)),
                after: None,
            },
            ExchangeRequest::Holdings {
                model: ModelId(id(3)),
                after: Some(NodeKey([7; 32])),
            },
            ExchangeRequest::Demand {
                model: ModelId(id(3)),
                after: None,
            },
            ExchangeRequest::Models,
            ExchangeRequest::BulkPort,
        ] {
            assert_eq!(ExchangeRequest::decode(&req.encode()).unwrap(), req);
        }
        let port = ExchangeResponse::bare(ResponseHeader::BulkPort { port: 4242 });
        assert_eq!(ExchangeResponse::decode(&port.encode()).unwrap(), port);
        let recs = vec![vec![1u8; 70], vec![2u8; 100]];
        let r = ExchangeResponse::holdings(ModelId(id(3)), &recs, false);
        let back = ExchangeResponse::decode(&r.encode()).unwrap();
        assert_eq!(back, r);
        assert!(!back.more());
        assert_eq!(back.records().unwrap(), vec![&recs[0][..], &recs[1][..]]);
        // A page cut at the limit says more follow.
        let lots = vec![vec![3u8; 8]; MAX_RECORDS_PER_RESPONSE + 1];
        let r = ExchangeResponse::holdings(ModelId(id(3)), &lots, false);
        let back = ExchangeResponse::decode(&r.encode()).unwrap();
        assert!(back.more());
        assert_eq!(back.records().unwrap().len(), MAX_RECORDS_PER_RESPONSE);
        let r = ExchangeResponse::demand(ModelId(id(3)), &recs, true);
        assert!(r.more());
        let back = ExchangeResponse::decode(&r.encode()).unwrap();
        assert_eq!(back.records().unwrap(), vec![&recs[0][..], &recs[1][..]]);
        let many: Vec<ModelId> = (0..100).map(|i| ModelId(id(i))).collect();
        let r = ExchangeResponse::models(&many);
        let back = ExchangeResponse::decode(&r.encode()).unwrap();
        assert_eq!(
            back.header,
            ResponseHeader::Models {
                models: many[..MAX_MODELS_PER_RESPONSE].to_vec()
            }
        );
        assert!(r.encode().len() <= 4 + MAX_RESPONSE_HEADER_BYTES);
    }

    #[test]
    fn a_response_read_in_parts_is_checked_as_a_whole_one_is() {
        let range = ExchangeResponse {
            header: ResponseHeader::Range {
                id: id(1),
                start: 0,
                end: 10,
            },
            payload: vec![7; 30],
        };
        let body = range.encode();
        let header_len = ExchangeResponse::header_len(body[..4].try_into().unwrap()).unwrap();
        let (header, payload) = body[4..].split_at(header_len);
        assert_eq!(
            ExchangeResponse::from_parts(header, payload.to_vec()).unwrap(),
            range
        );
        // The same rules: a range answer needs its payload, a bare one has none.
        assert!(ExchangeResponse::from_parts(header, Vec::new()).is_err());
        let bare = serde_json::to_vec(&ResponseHeader::NotFound).unwrap();
        assert!(ExchangeResponse::from_parts(&bare, vec![1]).is_err());
        assert!(matches!(
            ExchangeResponse::from_parts(&bare, vec![0; MAX_RESPONSE_PAYLOAD_BYTES + 1]),
            Err(WireError::Oversized { .. })
        ));
        assert!(matches!(
            ExchangeResponse::header_len(((MAX_RESPONSE_HEADER_BYTES + 1) as u32).to_le_bytes()),
            Err(WireError::Oversized { .. })
        ));
    }

    #[test]
    fn bad_frames_are_named_errors() {
        let big = ExchangeRequest::Range {
            id: id(1),
            start: 0,
            end: MAX_RANGE_BYTES + 1,
        };
        assert!(matches!(
            ExchangeRequest::decode(&big.encode()),
            Err(WireError::Oversized { what: "range", .. })
        ));
        assert!(matches!(
            ExchangeRequest::decode(&vec![b' '; MAX_REQUEST_BYTES + 1]),
            Err(WireError::Oversized { .. })
        ));
        assert!(ExchangeRequest::decode(br#"{"op":"delete"}"#).is_err());
        let mut frame = ExchangeResponse::bare(ResponseHeader::NotFound).encode();
        frame.push(0);
        assert!(ExchangeResponse::decode(&frame).is_err());
        let mut frame = (u32::MAX).to_le_bytes().to_vec();
        frame.extend_from_slice(b"{}");
        assert!(matches!(
            ExchangeResponse::decode(&frame),
            Err(WireError::Oversized { .. })
        ));
        let mut r = ExchangeResponse::holdings(ModelId(id(3)), &[vec![1u8; 70]], false);
        r.payload.truncate(40);
        assert!(ExchangeResponse::decode(&r.encode()).is_err());
    }

    proptest! {
        #[test]
        fn no_byte_string_panics_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = ExchangeRequest::decode(&bytes);
            let _ = ExchangeResponse::decode(&bytes);
        }

        #[test]
        fn truncating_a_holdings_answer_is_caught(n in 1usize..6, cut in 1usize..50) {
            let recs: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; 64 + i]).collect();
            let frame = ExchangeResponse::holdings(ModelId(id(9)), &recs, false).encode();
            let cut = cut.min(frame.len() - 1);
            prop_assert!(ExchangeResponse::decode(&frame[..frame.len() - cut]).is_err());
        }
    }
}
