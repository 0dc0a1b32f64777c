//! Relay control messages: a worker that can only dial out registers with a relay by signing
//! a challenge; a router asks the relay for a stream to a registered worker.
//!
//! Each message is one frame: `u32` LE length and a JSON body of at most
//! [`MAX_CONTROL_BYTES`]. After `Connected`, the stream carries dispatch frames untouched.

use serde::{Deserialize, Serialize};

/// ALPN of connections to a relay.
pub const RELAY_ALPN: &[u8] = b"moeswarm-relay/1";
/// Largest control message.
pub const MAX_CONTROL_BYTES: usize = 4096;
/// Domain tag of a registration signature.
pub const REGISTER_DOMAIN: &[u8] = b"moeswarm/relay-register/v1\0";

/// What travels on a relay's control streams.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum RelayMessage {
    /// Worker → relay: open a registration.
    Hello,
    /// Relay → worker: sign this.
    Challenge {
        /// 32 random bytes, hex.
        nonce: String,
    },
    /// Worker → relay: the signature over [`registration_bytes`], hex.
    Register {
        /// ed25519 signature, hex.
        signature: String,
    },
    /// Relay → worker: registered; streams for it will arrive on this connection.
    Registered,
    /// Router → relay: a stream to this worker, please.
    Connect {
        /// The worker's PeerId.
        target: String,
    },
    /// Relay → router, or relay → worker on a new stream: the stream is spliced; from now on
    /// it carries dispatch frames. To the worker it names the peer at the other end.
    Connected {
        /// The peer at the other end.
        peer: String,
    },
    /// Router → relay: help open a direct path to this registered worker (a hole punch). The
    /// relay tells the worker where the router's packets come from ([`RelayMessage::PunchTo`]),
    /// waits for it to send there, and answers where the worker's come from
    /// ([`RelayMessage::PunchAt`]).
    Punch {
        /// The worker's PeerId.
        target: String,
    },
    /// Relay → worker, on a new stream: the registered node `peer`, whose packets reach the
    /// relay from `addr`, will dial this worker directly; send to `addr` now so that the
    /// worker's NAT lets that dial in. Answered with [`RelayMessage::Punched`].
    PunchTo {
        /// The caller's PeerId.
        peer: String,
        /// The caller's address as the relay sees it (`ip:port`).
        addr: String,
    },
    /// Worker → relay: packets are on their way to the caller.
    Punched,
    /// Relay → router: the worker sent towards you; dial it at `addr`, its address as the
    /// relay sees it.
    PunchAt {
        /// `ip:port`.
        addr: String,
    },
    /// Any direction: refused, with the reason; the stream ends.
    Refused {
        /// Why.
        reason: String,
    },
}

/// The bytes a worker signs to register: domain, the nonce, and the relay's PeerId bytes
/// (so a signature for one relay means nothing to another).
pub fn registration_bytes(nonce: &[u8], relay_peer: &[u8]) -> Vec<u8> {
    [REGISTER_DOMAIN, nonce, relay_peer].concat()
}

/// Hex of bytes.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes of lowercase hex, or `None`.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 2 * MAX_CONTROL_BYTES {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

impl RelayMessage {
    /// The frame body.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("relay messages always serialize")
    }

    /// Parses a frame body.
    pub fn decode(body: &[u8]) -> Result<Self, RelayMessageError> {
        if body.len() > MAX_CONTROL_BYTES {
            return Err(RelayMessageError::TooLarge(body.len()));
        }
        serde_json::from_slice(body).map_err(|e| RelayMessageError::Malformed(e.to_string()))
    }
}

/// A relay control message that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RelayMessageError {
    /// Longer than [`MAX_CONTROL_BYTES`].
    #[error("relay message of {0} bytes is over the limit of {MAX_CONTROL_BYTES}")]
    TooLarge(usize),
    /// Not one of the messages.
    #[error("malformed relay message: {0}")]
    Malformed(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_round_trip() {
        for m in [
            RelayMessage::Hello,
            RelayMessage::Challenge {
                nonce: "00ff".into(),
            },
            RelayMessage::Connect {
                target: "12D3".into(),
            },
            RelayMessage::Punch {
                target: "12D3".into(),
            },
            RelayMessage::PunchTo {
                peer: "12D3".into(),
                addr: "10.0.0.1:4433".into(),
            },
            RelayMessage::Punched,
            RelayMessage::PunchAt {
                addr: "10.0.0.1:4433".into(),
            },
            RelayMessage::Refused {
                reason: "no".into(),
            },
        ] {
            assert_eq!(RelayMessage::decode(&m.encode()).unwrap(), m);
        }
        assert!(matches!(
            RelayMessage::decode(br#"{"msg":"teleport"}"#),
            Err(RelayMessageError::Malformed(_))
        ));
        assert_eq!(
            RelayMessage::decode(&vec![b' '; MAX_CONTROL_BYTES + 1]),
            Err(RelayMessageError::TooLarge(MAX_CONTROL_BYTES + 1))
        );
    }

    proptest! {
        #[test]
        fn hex_round_trips(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            prop_assert_eq!(from_hex(&to_hex(&b)), Some(b));
        }

        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..100), s in ".{0,20}") {
            let _ = RelayMessage::decode(&b);
            let _ = from_hex(&s);
        }
    }
}
