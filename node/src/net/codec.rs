//! The blob exchange codec for libp2p request-response: length-prefixed frames whose bodies
//! the protocol crate parses. A length over the limit is refused before anything is read, so a
//! peer cannot make this node allocate more than one frame's limit.

use std::io;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::request_response::Codec;
use libp2p::StreamProtocol;
use moeswarm_protocol::exchange::{MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES};
use moeswarm_protocol::{ExchangeRequest, ExchangeResponse};

/// Frames of [`ExchangeRequest`] and [`ExchangeResponse`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ExchangeCodec;

async fn read_frame<T: AsyncRead + Unpin + Send>(io: &mut T, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes is over the limit of {max}"),
        ));
    }
    let mut body = vec![0u8; len];
    io.read_exact(&mut body).await?;
    Ok(body)
}

async fn write_frame<T: AsyncWrite + Unpin + Send>(io: &mut T, body: &[u8]) -> io::Result<()> {
    io.write_all(&(body.len() as u32).to_le_bytes()).await?;
    io.write_all(body).await?;
    io.close().await
}

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl Codec for ExchangeCodec {
    type Protocol = StreamProtocol;
    type Request = ExchangeRequest;
    type Response = ExchangeResponse;

    async fn read_request<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<ExchangeRequest> {
        ExchangeRequest::decode(&read_frame(io, MAX_REQUEST_BYTES).await?).map_err(invalid)
    }

    async fn read_response<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<ExchangeResponse> {
        ExchangeResponse::decode(&read_frame(io, MAX_RESPONSE_BYTES).await?).map_err(invalid)
    }

    async fn write_request<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: ExchangeRequest,
    ) -> io::Result<()> {
        write_frame(io, &req.encode()).await
    }

    async fn write_response<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: ExchangeResponse,
    ) -> io::Result<()> {
        write_frame(io, &res.encode()).await
    }
}
