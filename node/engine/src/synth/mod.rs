//! Synthetic random-weight `qwen3moe` and `qwen35moe` models with llama.cpp's exact tensor
//! names and metadata.
//!
//! Weights are N(0, 1/fan_in) so activations stay O(1), norms are near 1, and the router is
//! scaled up so top-k choices are clear rather than near ties. Every tensor has its own
//! ChaCha8 stream derived from the seed and its index, and quantization is candle's CPU
//! quantizer, so the same arguments always give the same bytes. The shapes written are the
//! presets' ([`presets`]).

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{bail, Context, Result};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

use crate::quant::candle_type;
use moeswarm_model::gguf::{header_bytes, GgmlType, GgufWriter, TensorLayout, Value, ValueType};

mod presets;
pub use presets::{HybridShape, Preset, ARCHITECTURES, EXPERT_TYPES, PRESETS, QWEN35_PRESETS};

/// llama.cpp's `general.file_type` for a model whose experts are `t`.
fn file_type(t: GgmlType) -> u32 {
    match t {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q8_0 => 7,
        GgmlType::Q4_K => 15,
        GgmlType::Q5_K => 17,
        GgmlType::Q6_K => 18,
        GgmlType::BF16 => 32,
        _ => 0,
    }
}

/// GPT-2's byte-to-unicode map: the token text of byte `b`.
pub fn byte_token(b: u8) -> char {
    let printable = |c: u8| (b'!'..=b'~').contains(&c) || (0xA1..=0xAC).contains(&c) || c >= 0xAE;
    if printable(b) {
        return b as char;
    }
    let rank = (0..b).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + rank).expect("valid scalar")
}

/// ChatML's control tokens, last in the vocabulary when there is room; `<|im_end|>` is EOS.
const CHATML: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

fn metadata(p: &Preset, expert_type: GgmlType, seed: u64) -> Vec<(String, Value)> {
    let a = p.architecture();
    let u = |v: u64| Value::U32(v as u32);
    let mut tokens: Vec<Value> = (0..=255u8)
        .map(|b| Value::String(byte_token(b).to_string()))
        .collect();
    // Vocabularies with room past the byte tokens end with ChatML's control tokens, as Qwen's do.
    let chatml = p.n_vocab >= 256 + CHATML.len() as u64;
    let n_extra = if chatml {
        p.n_vocab - 256 - CHATML.len() as u64
    } else {
        p.n_vocab - 256
    };
    tokens.extend((0..n_extra).map(|i| Value::String(format!("<|extra_{i}|>"))));
    let mut token_type = vec![Value::I32(1); tokens.len()];
    if chatml {
        tokens.extend(CHATML.iter().map(|t| Value::String(t.to_string())));
        token_type.extend(CHATML.iter().map(|_| Value::I32(3)));
    }
    let strings = |items: Vec<Value>| Value::Array {
        elem: ValueType::String,
        items,
    };
    let mut meta = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (
            "general.name".into(),
            Value::String(format!(
                "synthetic-{a}-{}-{}-seed{seed}",
                p.name,
                expert_type.name()
            )),
        ),
        (format!("{a}.block_count"), u(p.n_layer)),
        (format!("{a}.context_length"), u(4096)),
        (format!("{a}.embedding_length"), u(p.n_embd)),
        (
            format!("{a}.feed_forward_length"),
            u(p.expert_ff * p.n_expert_used),
        ),
        (format!("{a}.expert_feed_forward_length"), u(p.expert_ff)),
        (format!("{a}.attention.head_count"), u(p.n_head)),
        (format!("{a}.attention.head_count_kv"), u(p.n_head_kv)),
        (format!("{a}.attention.key_length"), u(p.head_dim)),
        (format!("{a}.attention.value_length"), u(p.head_dim)),
        (format!("{a}.rope.dimension_count"), u(p.head_dim)),
        (
            format!("{a}.rope.freq_base"),
            Value::F32(if p.hybrid.is_some() { 1e7 } else { 1e6 }),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        (format!("{a}.expert_count"), u(p.n_expert)),
        (format!("{a}.expert_used_count"), u(p.n_expert_used)),
        (
            "general.file_type".into(),
            Value::U32(file_type(expert_type)),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), strings(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array {
                elem: ValueType::I32,
                items: token_type,
            },
        ),
        (
            "tokenizer.ggml.merges".into(),
            strings(vec![Value::String("Ġ Ġ".into())]),
        ),
        ("tokenizer.ggml.bos_token_id".into(), u(0)),
        ("tokenizer.ggml.eos_token_id".into(), u(p.n_vocab - 1)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    if let Some(hy) = &p.hybrid {
        // M-RoPE sections over the rotary pairs, as Qwen3.5 writes them ([11, 11, 10, 0] for
        // 32 pairs); for text every section rotates by the position.
        let pairs = hy.rope_dims / 2;
        let s0 = pairs.div_ceil(3);
        let s1 = (pairs - s0).div_ceil(2);
        let sections = [s0, s1, pairs - s0 - s1, 0]
            .map(|v| Value::I32(v as i32))
            .to_vec();
        meta.retain(|(k, _)| !k.ends_with(".rope.dimension_count"));
        meta.extend([
            (format!("{a}.rope.dimension_count"), u(hy.rope_dims)),
            (
                format!("{a}.rope.dimension_sections"),
                Value::Array {
                    elem: ValueType::I32,
                    items: sections,
                },
            ),
            (format!("{a}.ssm.state_size"), u(hy.ssm_head_dim)),
            (format!("{a}.ssm.group_count"), u(hy.ssm_qk_heads)),
            (format!("{a}.ssm.time_step_rank"), u(hy.ssm_v_heads)),
            (
                format!("{a}.ssm.inner_size"),
                u(hy.ssm_v_heads * hy.ssm_head_dim),
            ),
            (format!("{a}.ssm.conv_kernel"), u(hy.conv_kernel)),
            (
                format!("{a}.full_attention_interval"),
                u(hy.full_attention_interval),
            ),
            (
                format!("{a}.expert_shared_feed_forward_length"),
                u(hy.shared_ff),
            ),
        ]);
    }
    meta
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy)]
enum Init {
    /// N(0, (gain / sqrt(fan_in))²), fan_in = dims[0].
    Normal(f32),
    /// 1 + N(0, 0.1²).
    Norm,
    /// −exp(N(0, 0.5²)): a DeltaNet decay rate, stored negative.
    Decay,
}

fn tensors(p: &Preset, expert_type: GgmlType) -> Vec<(TensorLayout, Init)> {
    let t = |name: String, dims: Vec<u64>, dtype: GgmlType, init: Init| {
        (TensorLayout { name, dims, dtype }, init)
    };
    let f32t = GgmlType::F32;
    let (e, q, kv) = (p.n_embd, p.n_head * p.head_dim, p.n_head_kv * p.head_dim);
    let mut out = vec![
        t(
            "token_embd.weight".into(),
            vec![e, p.n_vocab],
            p.embd_type,
            Init::Normal((e as f32).sqrt()),
        ),
        t("output_norm.weight".into(), vec![e], f32t, Init::Norm),
        t(
            "output.weight".into(),
            vec![e, p.n_vocab],
            p.embd_type,
            Init::Normal(1.0),
        ),
    ];
    for l in 0..p.n_layer {
        let b = |s: &str| format!("blk.{l}.{s}.weight");
        let at = p.attn_type;
        out.push(t(b("attn_norm"), vec![e], f32t, Init::Norm));
        match &p.hybrid {
            Some(hy) if !hy.is_full(l) => {
                let (c, v) = (hy.conv_channels(), hy.ssm_v_heads * hy.ssm_head_dim);
                let hv = hy.ssm_v_heads;
                out.extend([
                    t(b("attn_qkv"), vec![e, c], at, Init::Normal(1.0)),
                    t(b("attn_gate"), vec![e, v], at, Init::Normal(1.0)),
                    t(
                        b("ssm_conv1d"),
                        vec![hy.conv_kernel, c],
                        f32t,
                        Init::Normal(1.0),
                    ),
                    t(
                        format!("blk.{l}.ssm_dt.bias"),
                        vec![hv],
                        f32t,
                        Init::Normal(1.0),
                    ),
                    t(format!("blk.{l}.ssm_a"), vec![hv], f32t, Init::Decay),
                    t(b("ssm_beta"), vec![e, hv], at, Init::Normal(1.0)),
                    t(b("ssm_alpha"), vec![e, hv], at, Init::Normal(1.0)),
                    t(b("ssm_norm"), vec![hy.ssm_head_dim], f32t, Init::Norm),
                    t(b("ssm_out"), vec![v, e], at, Init::Normal(1.0)),
                ]);
            }
            hybrid => {
                // qwen35moe's query projection also carries the output gate.
                let q_rows = if hybrid.is_some() { 2 * q } else { q };
                out.extend([
                    t(b("attn_q"), vec![e, q_rows], at, Init::Normal(1.0)),
                    t(b("attn_k"), vec![e, kv], at, Init::Normal(1.0)),
                    t(b("attn_v"), vec![e, kv], at, Init::Normal(1.0)),
                    t(b("attn_output"), vec![q, e], at, Init::Normal(1.0)),
                    t(b("attn_q_norm"), vec![p.head_dim], f32t, Init::Norm),
                    t(b("attn_k_norm"), vec![p.head_dim], f32t, Init::Norm),
                ]);
            }
        }
        let ffn_norm = crate::trunk::qwen35moe::moe_norm_name(p.architecture());
        out.extend([
            t(b(ffn_norm), vec![e], f32t, Init::Norm),
            t(
                b("ffn_gate_inp"),
                vec![e, p.n_expert],
                f32t,
                Init::Normal(3.0),
            ),
            t(
                b("ffn_gate_exps"),
                vec![e, p.expert_ff, p.n_expert],
                expert_type,
                Init::Normal(1.0),
            ),
            t(
                b("ffn_up_exps"),
                vec![e, p.expert_ff, p.n_expert],
                expert_type,
                Init::Normal(1.0),
            ),
            t(
                b("ffn_down_exps"),
                vec![p.expert_ff, e, p.n_expert],
                expert_type,
                Init::Normal(1.0),
            ),
        ]);
        if let Some(hy) = &p.hybrid {
            let fs = hy.shared_ff;
            out.extend([
                t(b("ffn_gate_inp_shexp"), vec![e], f32t, Init::Normal(1.0)),
                t(b("ffn_gate_shexp"), vec![e, fs], at, Init::Normal(1.0)),
                t(b("ffn_up_shexp"), vec![e, fs], at, Init::Normal(1.0)),
                t(b("ffn_down_shexp"), vec![fs, e], at, Init::Normal(1.0)),
            ]);
        }
    }
    out
}

/// Draws and quantizes one tensor's bytes, a slice of rows at a time (bounded memory).
fn write_tensor<W: Write>(
    w: &mut GgufWriter<W>,
    layout: &TensorLayout,
    init: Init,
    seed: u64,
    index: u64,
) -> Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let ne0 = layout.dims[0];
    let rows: u64 = layout.dims[1..].iter().product();
    let scale = match init {
        Init::Normal(gain) => gain / (ne0 as f32).sqrt(),
        Init::Norm => 0.1,
        Init::Decay => 0.0,
    };
    let chunk_rows = (1u64 << 20).div_ceil(ne0).max(1);
    let ct = candle_type(layout.dtype)?;
    let mut done = 0;
    while done < rows {
        let n = chunk_rows.min(rows - done);
        let values: Vec<f32> = (0..n * ne0)
            .map(|_| {
                let z: f32 = StandardNormal.sample(&mut rng);
                match init {
                    Init::Normal(_) => z * scale,
                    Init::Norm => 1.0 + z * scale,
                    Init::Decay => -(0.5 * z).exp(),
                }
            })
            .collect();
        let t = Tensor::from_vec(values, (n as usize, ne0 as usize), &Device::Cpu)?;
        let q = QTensor::quantize(&t, ct)?;
        w.write_chunk(&q.data()?)?;
        done += n;
    }
    Ok(())
}

/// What to write besides the shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthOptions {
    /// Type of the routed experts.
    pub expert_type: GgmlType,
    /// Seed of the weights.
    pub seed: u64,
    /// Write only the header; the data region is a hole of the right length (a sparse file),
    /// for `inspect` and `plan` on shapes too large to draw.
    pub header_only: bool,
}

impl SynthOptions {
    /// A whole model with `expert_type` experts drawn from `seed`.
    pub fn new(expert_type: GgmlType, seed: u64) -> Self {
        Self {
            expert_type,
            seed,
            header_only: false,
        }
    }
}

/// Writes a synthetic model to `out` (atomically: a temporary file renamed into place).
pub fn synth(out: &Path, preset: &Preset, opts: SynthOptions) -> Result<()> {
    let SynthOptions {
        expert_type,
        seed,
        header_only,
    } = opts;
    if !EXPERT_TYPES.contains(&expert_type) {
        let names: Vec<String> = EXPERT_TYPES.iter().map(|t| t.name()).collect();
        bail!(
            "expert type {expert_type} is not offered (choose: {})",
            names.join(", ")
        );
    }
    let bs = expert_type.block_size();
    if !preset.n_embd.is_multiple_of(bs) || !preset.expert_ff.is_multiple_of(bs) {
        bail!(
            "expert type {expert_type} needs n_embd and expert_ff multiples of {bs}; preset {} has {} and {}",
            preset.name,
            preset.n_embd,
            preset.expert_ff
        );
    }
    let meta = metadata(preset, expert_type, seed);
    let specs = tensors(preset, expert_type);
    let layouts: Vec<TensorLayout> = specs.iter().map(|(l, _)| l.clone()).collect();
    let tmp = out.with_extension("gguf.part");
    let file = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let result = (|| -> Result<()> {
        if header_only {
            let (header, infos, alignment) = header_bytes(&meta, &layouts)?;
            let data: u64 = infos
                .last()
                .map(|t| t.offset + t.n_bytes())
                .unwrap_or(0)
                .next_multiple_of(alignment);
            let mut file = file;
            file.write_all(&header)?;
            file.set_len(header.len() as u64 + data)?;
            file.sync_all()?;
            return Ok(());
        }
        let mut w = GgufWriter::new(BufWriter::with_capacity(1 << 20, file), &meta, &layouts)?;
        for (i, (layout, init)) in specs.iter().enumerate() {
            write_tensor(&mut w, layout, *init, seed, i as u64)
                .with_context(|| format!("writing {}", layout.name))?;
        }
        let file = w.finish()?.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, out).with_context(|| format!("moving model into {}", out.display()))?;
    Ok(())
}
