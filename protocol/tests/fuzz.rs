//! Every parser of what peers send, fed arbitrary and mutated bytes (a bounded number of cases,
//! so it runs in CI): none panics, none takes over a second on one input, and what is refused
//! is refused with an error.

use std::time::{Duration, Instant};

use moeswarm_protocol::dispatch::{check_header_len, check_payload_len, parse_header};
use moeswarm_protocol::relay::RelayMessage;
use moeswarm_protocol::{
    DispatchReply, DispatchRequest, ExchangeRequest, ExchangeResponse, Manifest, SignedDemand,
    SignedHoldings,
};
use proptest::prelude::*;

/// Runs `f`, failing if it takes over a second.
fn quick<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{what} took {:?}",
        start.elapsed()
    );
    out
}

/// Arbitrary bytes, JSON-shaped ones (which get past the first checks more often), and
/// length-prefixed ones.
fn inputs() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..2048),
        "\\{\"[a-z_]{1,12}\":(\\[[0-9,]{0,40}\\]|\"[a-z0-9]{0,70}\"|[0-9]{1,20}|null|\\{\\}),?\\}"
            .prop_map(String::into_bytes),
        (
            proptest::collection::vec(any::<u8>(), 4..8),
            proptest::collection::vec(any::<u8>(), 0..512)
        )
            .prop_map(|(len, rest)| [len, rest].concat()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn manifests_records_and_messages_never_panic(bytes in inputs()) {
        quick("manifest", || Manifest::from_bytes(&bytes).err());
        quick("holdings", || {
            SignedHoldings::from_wire(&bytes).map(|s| s.verify(None, None, 0).err()).err()
        });
        quick("demand", || {
            SignedDemand::from_wire(&bytes).map(|s| s.verify(None, None, 0).err()).err()
        });
        quick("exchange request", || ExchangeRequest::decode(&bytes).err());
        quick("exchange response", || ExchangeResponse::decode(&bytes).err());
        quick("relay message", || RelayMessage::decode(&bytes).err());
    }

    #[test]
    fn dispatch_frames_never_panic(
        bytes in inputs(),
        header_len in any::<u32>(),
        payload_len in any::<u64>(),
        expected in any::<u64>(),
    ) {
        quick("header length", || check_header_len(header_len).err());
        quick("payload length", || check_payload_len(payload_len, expected).err());
        if let Ok(req) = quick("dispatch header", || parse_header::<DispatchRequest>(&bytes)) {
            let _ = quick("dispatch validation", || req.validate().map(|_| req.payload_len()));
        }
        if let Ok(reply) = quick("dispatch reply", || parse_header::<DispatchReply>(&bytes)) {
            let _ = quick("reply validation", || reply.validate());
        }
    }
}
