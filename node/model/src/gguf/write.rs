//! The GGUF v3 writer.

use std::io::{self, Write};

use super::read::tensor_bytes;
use super::{align_up, GgmlType, TensorInfo, Value, DEFAULT_ALIGNMENT, KEY_ALIGNMENT, MAGIC};

/// A tensor to be written: name, ggml-order shape and type. Offsets are assigned by the writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    /// The tensor's name.
    pub name: String,
    /// Shape in ggml order.
    pub dims: Vec<u64>,
    /// Element type.
    pub dtype: GgmlType,
}

impl From<&TensorInfo> for TensorLayout {
    fn from(t: &TensorInfo) -> Self {
        Self {
            name: t.name.clone(),
            dims: t.dims.clone(),
            dtype: t.dtype,
        }
    }
}

/// Writes a GGUF v3 file: the header at construction, then each tensor's bytes in order.
pub struct GgufWriter<W: Write> {
    out: W,
    infos: Vec<TensorInfo>,
    alignment: u64,
    next: usize,
    /// Bytes of the current tensor written so far.
    in_tensor: u64,
    written: u64,
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.push(*x as u8),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(*x as u8),
        Value::String(s) => put_str(buf, s),
        Value::Array { elem, items } => {
            buf.extend_from_slice(&elem.id().to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(buf, item);
            }
        }
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// The header bytes (padded to the alignment) and the tensor infos with their offsets.
pub fn header_bytes(
    metadata: &[(String, Value)],
    tensors: &[TensorLayout],
) -> io::Result<(Vec<u8>, Vec<TensorInfo>, u64)> {
    let alignment = match metadata.iter().find(|(k, _)| k == KEY_ALIGNMENT) {
        Some((_, Value::U32(a))) if a.is_power_of_two() => *a as u64,
        Some(_) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "general.alignment must be a power of two as u32",
            ))
        }
        None => DEFAULT_ALIGNMENT,
    };
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0u64;
    for t in tensors {
        let bytes = tensor_bytes(&t.dims, t.dtype).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "tensor {:?} shape {:?} does not fit {}",
                    t.name, t.dims, t.dtype
                ),
            )
        })?;
        infos.push(TensorInfo {
            name: t.name.clone(),
            dims: t.dims.clone(),
            dtype: t.dtype,
            offset,
        });
        offset = align_up(offset + bytes, alignment);
    }
    let mut buf = Vec::with_capacity(4096);
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&3u32.to_le_bytes());
    buf.extend_from_slice(&(infos.len() as u64).to_le_bytes());
    buf.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut buf, k);
        buf.extend_from_slice(&v.value_type().id().to_le_bytes());
        put_value(&mut buf, v);
    }
    for t in &infos {
        put_str(&mut buf, &t.name);
        buf.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            buf.extend_from_slice(&d.to_le_bytes());
        }
        buf.extend_from_slice(&t.dtype.id().to_le_bytes());
        buf.extend_from_slice(&t.offset.to_le_bytes());
    }
    if !infos.is_empty() {
        buf.resize(align_up(buf.len() as u64, alignment) as usize, 0);
    }
    Ok((buf, infos, alignment))
}

impl<W: Write> GgufWriter<W> {
    /// Writes the header for `metadata` and `tensors` to `out`.
    pub fn new(
        mut out: W,
        metadata: &[(String, Value)],
        tensors: &[TensorLayout],
    ) -> io::Result<Self> {
        let (header, infos, alignment) = header_bytes(metadata, tensors)?;
        out.write_all(&header)?;
        Ok(Self {
            out,
            infos,
            alignment,
            next: 0,
            in_tensor: 0,
            written: 0,
        })
    }

    /// Writes the next tensor's bytes (exactly its size) and the padding after it.
    pub fn write_tensor(&mut self, data: &[u8]) -> io::Result<()> {
        if self.in_tensor != 0 {
            return Err(invalid("a tensor is half-written".into()));
        }
        let declared = self.current()?.n_bytes();
        if data.len() as u64 != declared {
            return Err(invalid(format!(
                "tensor {:?}: {} bytes given, {declared} declared",
                self.current()?.name,
                data.len()
            )));
        }
        self.write_chunk(data)
    }

    /// Appends bytes to the current tensor; moves to the next one when it is complete.
    pub fn write_chunk(&mut self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let left = self.current()?.n_bytes() - self.in_tensor;
            let n = left.min(data.len() as u64) as usize;
            self.out.write_all(&data[..n])?;
            data = &data[n..];
            self.in_tensor += n as u64;
            self.written += n as u64;
            if self.in_tensor == self.current()?.n_bytes() {
                self.in_tensor = 0;
                self.next += 1;
                if self.next < self.infos.len() {
                    let padded = align_up(self.written, self.alignment);
                    self.out
                        .write_all(&vec![0u8; (padded - self.written) as usize])?;
                    self.written = padded;
                }
            }
        }
        Ok(())
    }

    fn current(&self) -> io::Result<&TensorInfo> {
        self.infos
            .get(self.next)
            .ok_or_else(|| invalid("more tensor bytes written than declared".into()))
    }

    /// Checks every declared tensor was written and returns the output.
    pub fn finish(mut self) -> io::Result<W> {
        if self.next != self.infos.len() {
            return Err(invalid(format!(
                "{} of {} tensors written",
                self.next,
                self.infos.len()
            )));
        }
        self.out.flush()?;
        Ok(self.out)
    }
}
