//! Frames on QUIC streams: dispatch frames (header + raw payload) and relay control messages,
//! each length checked against the protocol's limits before anything is allocated.

use crate::error::{bail, Context, Error, Result};
use bytes::Bytes;
use moeswarm_protocol::dispatch::{check_header_len, check_payload_len, frame_head, parse_header};
use moeswarm_protocol::relay::{RelayMessage, MAX_CONTROL_BYTES};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Writes one dispatch frame: the JSON of `header`, then `payload`.
pub async fn write_frame<H: Serialize>(
    send: &mut quinn::SendStream,
    header: &H,
    payload: Bytes,
) -> Result<()> {
    let head = encode_head(header, payload.len() as u64)?;
    write_encoded(send, head, vec![payload]).await
}

/// The head of a dispatch frame carrying `header` and a payload of `payload_len` bytes.
pub fn encode_head<H: Serialize>(header: &H, payload_len: u64) -> Result<Vec<u8>> {
    Ok(frame_head(&serde_json::to_vec(header)?, payload_len))
}

/// Writes a frame whose head [`encode_head`] made and whose payload is `payload`'s pieces in
/// order, in one write that hands quinn every piece as it is (no copy; a payload kept for a
/// second attempt is shared, not cloned).
pub async fn write_encoded(
    send: &mut quinn::SendStream,
    head: Vec<u8>,
    payload: Vec<Bytes>,
) -> Result<()> {
    let mut pieces = Vec::with_capacity(payload.len() + 1);
    pieces.push(Bytes::from(head));
    pieces.extend(payload);
    send.write_all_chunks(&mut pieces)
        .await
        .context("writing a frame")?;
    Ok(())
}

/// Reads one dispatch frame whose payload must be `expected(&header)` bytes. `Ok(None)` when
/// the stream ended cleanly before a frame began.
pub async fn read_frame<H: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
    expected: impl FnOnce(&H) -> Result<u64>,
) -> Result<Option<(H, Payload)>> {
    let Some((header, declared)) = read_head::<H>(recv).await? else {
        return Ok(None);
    };
    let want = expected(&header)?;
    let payload = read_payload(recv, declared, want).await?;
    Ok(Some((header, payload)))
}

/// Reads the head of a dispatch frame: its header and the payload length it declares, leaving
/// the payload unread (so a reader can decide whether to take it at all). `Ok(None)` when the
/// stream ended cleanly before a frame began.
pub async fn read_head<H: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
) -> Result<Option<(H, u64)>> {
    let mut len = [0u8; 4];
    match recv.read(&mut len[..1]).await.context("reading a frame")? {
        None => return Ok(None),
        Some(0) => bail!("empty read"),
        Some(_) => {}
    }
    recv.read_exact(&mut len[1..])
        .await
        .context("reading a frame head")?;
    let header_len = check_header_len(u32::from_le_bytes(len))?;
    let mut header = vec![0u8; header_len];
    recv.read_exact(&mut header)
        .await
        .context("reading a frame header")?;
    let header: H = parse_header(&header)?;
    let mut plen = [0u8; 8];
    recv.read_exact(&mut plen)
        .await
        .context("reading a payload length")?;
    Ok(Some((header, u64::from_le_bytes(plen))))
}

/// A frame's payload as it came off the stream: the received pieces, not copied together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    parts: Vec<Bytes>,
    len: usize,
}

impl Payload {
    /// The received pieces, in order.
    pub fn parts(&self) -> impl Iterator<Item = &[u8]> + Clone {
        self.parts.iter().map(|b| &b[..])
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes in one piece: borrowed when they came in one, else copied together.
    pub fn contiguous(&self) -> std::borrow::Cow<'_, [u8]> {
        match self.parts.as_slice() {
            [] => std::borrow::Cow::Borrowed(&[]),
            [one] => std::borrow::Cow::Borrowed(&one[..]),
            many => std::borrow::Cow::Owned(many.concat()),
        }
    }
}

impl From<Vec<u8>> for Payload {
    fn from(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self {
            parts: vec![Bytes::from(bytes)],
            len,
        }
    }
}

/// Reads the payload of a frame whose head declared `declared` bytes, which must be `want`:
/// the pieces quinn received, taken as they are (no copy).
pub async fn read_payload(
    recv: &mut quinn::RecvStream,
    declared: u64,
    want: u64,
) -> Result<Payload> {
    let plen = check_payload_len(declared, want)?;
    let mut payload = Payload::default();
    while payload.len < plen {
        let chunk = recv
            .read_chunk(plen - payload.len, true)
            .await
            .context("reading a payload")?
            .ok_or(Error::ReadExact(quinn::ReadExactError::FinishedEarly(
                payload.len,
            )))
            .context("reading a payload")?;
        payload.len += chunk.bytes.len();
        payload.parts.push(chunk.bytes);
    }
    Ok(payload)
}

/// Writes one relay control message.
pub async fn write_control(send: &mut quinn::SendStream, msg: &RelayMessage) -> Result<()> {
    let body = msg.encode();
    send.write_all(&(body.len() as u32).to_le_bytes()).await?;
    send.write_all(&body).await?;
    Ok(())
}

/// Reads one relay control message.
pub async fn read_control(recv: &mut quinn::RecvStream) -> Result<RelayMessage> {
    let mut len = [0u8; 4];
    recv.read_exact(&mut len)
        .await
        .context("reading a relay message")?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_CONTROL_BYTES {
        return Err(Error::TooLarge {
            len,
            limit: MAX_CONTROL_BYTES,
        });
    }
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body)
        .await
        .context("reading a relay message")?;
    Ok(RelayMessage::decode(&body)?)
}
