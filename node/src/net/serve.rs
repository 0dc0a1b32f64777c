//! Answering blob exchange requests from the store.
//!
//! Size and range answers read the store (blocking file I/O and hashing), so the swarm hands
//! them to a blocking thread. A node can be told to lie ([`ServeFault`]) so that the fetchers'
//! defences are tested against a real peer.

use moeswarm_protocol::{ExchangeRequest, ExchangeResponse, ResponseHeader};

use moeswarm_model::store::Store;

pub use crate::faults::ServeFault;

/// The answer to a size or range request (holdings requests are the swarm's).
pub fn answer(store: &Store, req: &ExchangeRequest, fault: ServeFault) -> ExchangeResponse {
    let bare = ExchangeResponse::bare;
    match req {
        ExchangeRequest::Size { id } => match store.entry(id) {
            Ok(Some(e)) => bare(ResponseHeader::Size {
                id: *id,
                size: fault.claimed_size(e.size),
            }),
            Ok(None) => bare(ResponseHeader::NotFound),
            Err(e) => bare(ResponseHeader::Refused {
                reason: format!("{e:#}"),
            }),
        },
        ExchangeRequest::Range { id, start, end } => {
            match store.contains(id) {
                Ok(true) => {}
                Ok(false) => return bare(ResponseHeader::NotFound),
                Err(e) => {
                    return bare(ResponseHeader::Refused {
                        reason: format!("{e:#}"),
                    })
                }
            }
            match store.encode_range(id, *start..*end) {
                Ok(mut payload) => {
                    fault.tamper_range(&mut payload);
                    ExchangeResponse {
                        header: ResponseHeader::Range {
                            id: *id,
                            start: *start,
                            end: *end,
                        },
                        payload,
                    }
                }
                Err(e) => bare(ResponseHeader::Refused {
                    reason: format!("{e:#}"),
                }),
            }
        }
        ExchangeRequest::Holdings { .. }
        | ExchangeRequest::Demand { .. }
        | ExchangeRequest::Models
        | ExchangeRequest::BulkPort => bare(ResponseHeader::Refused {
            reason: "holdings are answered by the swarm".into(),
        }),
    }
}
