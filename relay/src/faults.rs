//! The relay's test faults: a relay that rewrites what it carries, so tests can show that
//! routers catch it by the signatures alone. [`RelayHooks`] is the one place they act on the
//! relay's serving; without the `test-faults` feature every hook is a no-op.

/// A relay that rewrites what it carries (acted on with the `test-faults` feature only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Tamper {
    /// Carries bytes as they are.
    #[default]
    None,
    /// Flips a bit of the first row of every request a router sends.
    RequestRows,
    /// Flips a bit of the first output of every reply a worker sends.
    ReplyRows,
}

/// Which way a spliced stream's bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// From the caller (a router) to the target (a worker).
    Request,
    /// Back from the target.
    Reply,
}

/// Where the relay's faults act: on the bytes of each direction of a spliced stream.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RelayHooks {
    #[cfg(feature = "test-faults")]
    tamper: Tamper,
}

impl RelayHooks {
    /// The hooks of a relay that tampers as `tamper` says (honest without `test-faults`).
    #[cfg(feature = "test-faults")]
    pub(crate) fn new(tamper: Tamper) -> Self {
        Self { tamper }
    }

    /// What rewrites the bytes going `way` on one stream, if anything does.
    #[cfg(feature = "test-faults")]
    pub(crate) fn rewriter(&self, way: Direction) -> Option<PayloadFlip> {
        let flips = matches!(
            (self.tamper, way),
            (Tamper::RequestRows, Direction::Request) | (Tamper::ReplyRows, Direction::Reply)
        );
        flips.then(PayloadFlip::default)
    }

    /// Nothing rewrites anything: an honest relay.
    #[cfg(not(feature = "test-faults"))]
    #[inline(always)]
    pub(crate) fn rewriter(&self, _way: Direction) -> Option<PayloadFlip> {
        None
    }
}

/// Finds the first payload byte of the frame at the start of a stream and flips its low bit.
#[derive(Default)]
pub(crate) struct PayloadFlip {
    seen: u64,
    head: Vec<u8>,
    done: bool,
}

impl PayloadFlip {
    /// Rewrites the next `chunk` of the stream.
    pub(crate) fn apply(&mut self, chunk: &mut [u8]) {
        if self.done {
            return;
        }
        let start = self.seen;
        self.seen += chunk.len() as u64;
        if self.head.len() < 4 {
            let need = 4 - self.head.len();
            self.head.extend(chunk.iter().take(need));
        }
        if self.head.len() < 4 {
            return;
        }
        let header = u32::from_le_bytes(self.head[..4].try_into().unwrap_or_default()) as u64;
        let at = 4 + header + 8;
        if (start..self.seen).contains(&at) {
            chunk[(at - start) as usize] ^= 1;
            self.done = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flip_lands_on_the_first_payload_byte_however_the_stream_is_cut() {
        // A frame: 4-byte header length, a 3-byte header, 8 bytes of prefix, then payload.
        let mut frame = vec![3, 0, 0, 0, 9, 9, 9];
        frame.extend([0u8; 8]);
        frame.extend([0x10u8; 6]);
        let at = 4 + 3 + 8;
        for cut in 1..frame.len() {
            let mut bytes = frame.clone();
            let mut flip = PayloadFlip::default();
            for chunk in bytes.chunks_mut(cut) {
                flip.apply(chunk);
            }
            let changed: Vec<usize> = (0..frame.len())
                .filter(|i| bytes[*i] != frame[*i])
                .collect();
            assert_eq!(changed, vec![at], "cut {cut}");
            assert_eq!(bytes[at], 0x11);
        }
    }
}
