//! Writing and reading slabs: one expert of one layer as a mini-GGUF (see `moeswarm_protocol::slab`).

use crate::error::{bail, Context, Result};
use moeswarm_protocol::slab::{self, ExpertMatrix};
use moeswarm_protocol::BlobId;

use crate::gguf::{self, GgmlType, Gguf, TensorLayout, Value};

/// One matrix of a slab: its ggml-order 2-D shape, type and bytes.
#[derive(Debug, Clone, Copy)]
pub struct SlabMatrix<'a> {
    /// `[ne0, ne1]`: gate/up `[n_embd, expert_ff]`, down `[expert_ff, n_embd]`.
    pub dims: [u64; 2],
    /// Element type.
    pub dtype: GgmlType,
    /// The raw bytes, as in the source GGUF.
    pub data: &'a [u8],
}

/// A parsed slab, borrowing its bytes.
#[derive(Debug, Clone)]
pub struct SlabView<'a> {
    /// Layer index.
    pub layer: u32,
    /// Expert index.
    pub expert: u32,
    /// blake3 of the source GGUF's header.
    pub source_header: BlobId,
    /// `[gate, up, down]`.
    pub matrices: [SlabMatrix<'a>; 3],
}

/// Who a slab belongs to, written into its metadata.
#[derive(Debug, Clone)]
pub struct SlabOrigin<'a> {
    /// Source `general.architecture`.
    pub architecture: &'a str,
    /// Source `general.name`.
    pub model_name: &'a str,
    /// blake3 of the source header.
    pub source_header: BlobId,
    /// Layer index.
    pub layer: u32,
    /// Expert index.
    pub expert: u32,
}

/// Writes a slab: header then the three matrices' bytes, into `out` (cleared first).
pub fn build(
    origin: &SlabOrigin<'_>,
    matrices: &[SlabMatrix<'_>; 3],
    out: &mut Vec<u8>,
) -> Result<()> {
    let metadata = vec![
        (
            "general.architecture".to_string(),
            Value::String(origin.architecture.into()),
        ),
        (slab::KEY_VERSION.to_string(), Value::U32(slab::VERSION)),
        (
            slab::KEY_MODEL_NAME.to_string(),
            Value::String(origin.model_name.into()),
        ),
        (
            slab::KEY_SOURCE.to_string(),
            Value::String(origin.source_header.to_hex()),
        ),
        (slab::KEY_LAYER.to_string(), Value::U32(origin.layer)),
        (slab::KEY_EXPERT.to_string(), Value::U32(origin.expert)),
    ];
    let layouts: Vec<TensorLayout> = ExpertMatrix::ALL
        .iter()
        .zip(matrices)
        .map(|(m, mat)| TensorLayout {
            name: m.slab_tensor_name().to_string(),
            dims: mat.dims.to_vec(),
            dtype: mat.dtype,
        })
        .collect();
    out.clear();
    let mut w = gguf::GgufWriter::new(&mut *out, &metadata, &layouts)?;
    for mat in matrices {
        w.write_tensor(mat.data)?;
    }
    w.finish()?;
    Ok(())
}

fn meta_u32(g: &Gguf, key: &str) -> Result<u32> {
    match g.get(key) {
        Some(Value::U32(v)) => Ok(*v),
        Some(v) => bail!("slab metadata {key:?} is {v}, want u32"),
        None => bail!("slab metadata {key:?} is missing"),
    }
}

impl<'a> SlabView<'a> {
    /// Parses slab bytes; refuses anything that is not a well-formed slab.
    pub fn parse(bytes: &'a [u8]) -> Result<Self> {
        let g = Gguf::from_bytes(bytes).context("slab is not a valid GGUF")?;
        let version = meta_u32(&g, slab::KEY_VERSION)?;
        if version != slab::VERSION {
            bail!(
                "slab format version {version}, this node reads {}",
                slab::VERSION
            );
        }
        let source = g
            .get(slab::KEY_SOURCE)
            .and_then(Value::as_str)
            .context("slab metadata source header is missing")?;
        let source_header: BlobId = source.parse().context("slab source header")?;
        let mut matrices = Vec::with_capacity(3);
        for m in ExpertMatrix::ALL {
            let name = m.slab_tensor_name();
            let t = g
                .tensor(name)
                .with_context(|| format!("slab has no tensor {name}"))?;
            if t.dims.len() != 2 {
                bail!("slab tensor {name} has shape {:?}, want 2-D", t.dims);
            }
            let r = g.tensor_range(t);
            matrices.push(SlabMatrix {
                dims: [t.dims[0], t.dims[1]],
                dtype: t.dtype,
                data: &bytes[r.start as usize..r.end as usize],
            });
        }
        let matrices: [SlabMatrix<'a>; 3] = matrices.try_into().expect("three matrices");
        let [gate, up, down] = &matrices;
        if up.dims != gate.dims || down.dims != [gate.dims[1], gate.dims[0]] {
            bail!(
                "slab matrix shapes disagree: gate {:?}, up {:?}, down {:?}",
                gate.dims,
                up.dims,
                down.dims
            );
        }
        Ok(Self {
            layer: meta_u32(&g, slab::KEY_LAYER)?,
            expert: meta_u32(&g, slab::KEY_EXPERT)?,
            source_header,
            matrices,
        })
    }

    /// Hidden size.
    pub fn n_embd(&self) -> usize {
        self.matrices[0].dims[0] as usize
    }

    /// Expert inner size.
    pub fn n_ff(&self) -> usize {
        self.matrices[0].dims[1] as usize
    }
}
