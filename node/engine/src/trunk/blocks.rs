//! Building blocks every trunk architecture loads and runs its layers with.

use crate::error::{bail, Context, Result};
use moeswarm_model::gguf::MappedGguf;

use crate::ops::{dot, softmax_in_place};
use crate::projection::Projection;
use crate::quant::dequantize;

/// Refuses a tensor whose shape is not what the hyper-parameters imply (no panic later).
pub fn expect_dims(g: &MappedGguf, name: &str, want: &[u64]) -> Result<()> {
    let t = g.tensor(name)?;
    if t.dims != want {
        bail!(
            "{name} has shape {:?}, the model's hyper-parameters want {want:?}",
            t.dims
        );
    }
    Ok(())
}

/// A norm's weights, dequantized to f32.
pub fn norm_weights(g: &MappedGguf, name: &str) -> Result<Vec<f32>> {
    let t = g.tensor(name)?;
    dequantize(t.data, t.dtype, t.dims)
}

/// A projection, kept quantized.
pub fn matmul(g: &MappedGguf, name: &str) -> Result<Projection> {
    let t = g.tensor(name)?;
    Projection::in_file(g, t.data, t.dtype, t.dims).with_context(|| name.to_string())
}

/// `m · x` for rows `x` of width `n_in`.
pub fn project(m: &Projection, x: &[f32], n_in: usize) -> Result<Vec<f32>> {
    if m.n_in() != n_in {
        bail!(
            "a projection of input width {} given rows of {n_in}",
            m.n_in()
        );
    }
    m.apply(x)
}

/// Grouped-query causal softmax attention of rows `q` (`[n_tok][n_head·d]`, at positions
/// `pos0..`) over the cached keys and values of every position up to each row's own
/// (`[pos][n_kv·d]`), scaled by `1/sqrt(d)`: `[n_tok][n_head·d]`.
pub fn causal_attention(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    pos0: usize,
    n_head: usize,
    n_kv: usize,
    d: usize,
) -> Vec<f32> {
    let (q_w, kv_w) = (n_head * d, n_kv * d);
    let group = n_head / n_kv;
    let n_tok = q.len() / q_w;
    let scale = 1.0 / (d as f32).sqrt();
    let mut attn = vec![0f32; n_tok * q_w];
    let mut scores = Vec::with_capacity(pos0 + n_tok);
    for t in 0..n_tok {
        let p = pos0 + t;
        for head in 0..n_head {
            let kvh = head / group;
            let qv = &q[t * q_w + head * d..t * q_w + (head + 1) * d];
            scores.clear();
            scores.extend(
                (0..=p).map(|j| dot(qv, &kc[j * kv_w + kvh * d..j * kv_w + (kvh + 1) * d]) * scale),
            );
            softmax_in_place(&mut scores);
            let out = &mut attn[t * q_w + head * d..t * q_w + (head + 1) * d];
            for (j, &sc) in scores.iter().enumerate() {
                let vr = &vc[j * kv_w + kvh * d..j * kv_w + (kvh + 1) * d];
                for (o, &vv) in out.iter_mut().zip(vr) {
                    *o += sc * vv;
                }
            }
        }
    }
    attn
}
