//! `inspect`: what a GGUF holds, from its header alone.

use serde_json::json;

use crate::gguf::{Gguf, Value};
use crate::{expert_layers, hyper_params, unrun_bytes};

/// Arrays longer than this are summarized in the output.
const SHOWN_ITEMS: usize = 16;

fn summarize(v: &Value) -> serde_json::Value {
    match v {
        Value::Array { elem, items } if items.len() > SHOWN_ITEMS => json!({
            "type": format!("array of {elem:?}"),
            "len": items.len(),
            "first": items[..SHOWN_ITEMS].iter().map(Value::to_json).collect::<Vec<_>>(),
        }),
        other => other.to_json(),
    }
}

/// The JSON description `inspect --json` prints.
pub fn describe(g: &Gguf) -> serde_json::Value {
    let hyper = hyper_params(g).ok();
    let experts = expert_layers(g).ok();
    let expert_bytes: u64 = experts.iter().flatten().map(|l| l.bytes()).sum();
    let unrun_bytes = unrun_bytes(g).unwrap_or(0);
    let layer_kinds = (g.architecture() == Some(crate::qwen35::ARCH))
        .then(|| crate::qwen35::Qwen35Shape::from_gguf(g).ok())
        .flatten()
        .map(|q| q.kinds);
    json!({
        "version": g.version,
        "architecture": g.architecture(),
        "hyper_params": hyper,
        "file_bytes": g.file_size,
        "data_offset": g.data_offset,
        "alignment": g.alignment,
        "header_id": g.header_id.to_string(),
        "tensor_bytes": g.tensor_bytes(),
        "expert_layers": experts.as_ref().map(|l| l.len()),
        "expert_bytes": expert_bytes,
        "trunk_bytes": g.tensor_bytes() - expert_bytes - unrun_bytes,
        "unrun_block_bytes": unrun_bytes,
        "layer_kinds": layer_kinds,
        "metadata": g.metadata.iter().map(|(k, v)| (k.clone(), summarize(v))).collect::<serde_json::Map<_, _>>(),
        "tensors": g.tensors.iter().map(|t| json!({
            "name": t.name, "type": t.dtype.name(), "shape": t.dims, "bytes": t.n_bytes(), "offset": t.offset,
        })).collect::<Vec<_>>(),
    })
}

/// The text `inspect` prints.
pub fn render(g: &Gguf) -> String {
    use std::fmt::Write;
    let d = describe(g);
    let mut s = String::new();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let _ = writeln!(
        s,
        "GGUF v{}  architecture {}",
        g.version,
        g.architecture().unwrap_or("?")
    );
    let _ = writeln!(
        s,
        "{} tensors, {} bytes of data ({:.3} GiB): trunk {}, routed experts {}",
        g.tensors.len(),
        g.tensor_bytes(),
        gib(g.tensor_bytes()),
        d["trunk_bytes"],
        d["expert_bytes"]
    );
    if let Some(h) = d["hyper_params"].as_object() {
        let parts: Vec<String> = h.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(s, "hyper-parameters: {}", parts.join(" "));
    }
    if g.architecture() == Some(crate::qwen35::ARCH) {
        match crate::qwen35::Qwen35Shape::from_gguf(g) {
            Ok(q) => {
                let kinds: String = q
                    .kinds
                    .iter()
                    .map(|k| match k {
                        crate::qwen35::LayerKind::Linear => 'L',
                        crate::qwen35::LayerKind::Full => 'F',
                    })
                    .collect();
                let _ = writeln!(
                    s,
                    "layers: {kinds} (L Gated DeltaNet, F full attention); DeltaNet {} q/k and {} v heads of {}, conv {}; rotary {} dims; shared expert ff {}; {} MTP blocks not run ({} bytes)",
                    q.ssm_qk_heads, q.ssm_v_heads, q.ssm_head_dim, q.conv_kernel, q.rope_dims,
                    q.shared_ff, q.nextn_layers, d["unrun_block_bytes"]
                );
            }
            Err(e) => {
                let _ = writeln!(s, "layers: the qwen35moe shape does not read: {e}");
            }
        }
    }
    let _ = writeln!(s, "metadata:");
    for (k, v) in &g.metadata {
        let _ = writeln!(s, "  {k} = {v}");
    }
    let _ = writeln!(s, "tensors:");
    for t in &g.tensors {
        let _ = writeln!(
            s,
            "  {:<40} {:<8} {:<24} {:>12} bytes",
            t.name,
            t.dtype.name(),
            format!("{:?}", t.dims),
            t.n_bytes()
        );
    }
    s
}

/// [`describe`] of a model's files, with the parts a split model was read from.
pub fn describe_files(files: &crate::gguf::ModelFiles) -> serde_json::Value {
    let mut d = describe(&files.header);
    d["parts"] = files
        .parts
        .iter()
        .map(|p| json!({ "path": p.path.display().to_string(), "bytes": p.file_size }))
        .collect();
    d
}

/// [`render`] of a model's files, naming the parts of a split model first.
pub fn render_files(files: &crate::gguf::ModelFiles) -> String {
    let mut s = String::new();
    if files.is_split() {
        s += &format!("split into {} parts:\n", files.parts.len());
        for p in &files.parts {
            s += &format!("  {} ({} bytes)\n", p.path.display(), p.file_size);
        }
    }
    s + &render(&files.header)
}
