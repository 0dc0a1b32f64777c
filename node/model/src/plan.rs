//! `plan`: whether a model fits, and how to run it, from the GGUF header alone.
//!
//! Two questions. On one coordinator with a GPU: keep the trunk, the KV cache and as many
//! layers' routed experts as fit in VRAM, the remaining experts in RAM, and say which
//! llama.cpp `--override-tensor` argument realises it. On a swarm: place every slab on `R`
//! devices within their RAM ([`moeswarm_market::placement`]).

use std::path::Path;

use crate::error::{bail, Context, Result};
use moeswarm_market::placement::{place, Device, Placement, SlabDemand};
use serde::{Deserialize, Serialize};

use crate::gguf::Gguf;
use crate::qwen35::LayerKind;
pub use crate::size::{gib, parse_size};
use crate::{expert_layers, is_unrun_block, layers_run, unrun_bytes};

/// Sizes read off a MoE GGUF's header.
#[derive(Debug, Clone, Serialize)]
pub struct ModelSizes {
    /// `general.architecture`.
    pub architecture: String,
    /// Bytes of every tensor but the routed experts.
    pub trunk_bytes: u64,
    /// `(layer, bytes of its routed experts)`, layer ascending.
    pub expert_layers: Vec<(u32, u64)>,
    /// Experts per layer.
    pub n_expert: u64,
    /// KV cache bytes per token of context (f16 K and V for every layer with attention K/V:
    /// in a hybrid model only its full-attention layers).
    pub kv_bytes_per_token: u64,
    /// Fixed per-sequence state of the linear-attention layers (f32 conv window and recurrent
    /// state), whatever the context length; 0 for a model without such layers.
    pub recurrent_state_bytes: u64,
    /// Bytes of trailing blocks that are not run (multi-token prediction), in neither the
    /// trunk nor the experts.
    pub unrun_bytes: u64,
}

impl ModelSizes {
    /// Reads the sizes from a header; refuses a model without routed experts.
    pub fn of(g: &Gguf) -> Result<Self> {
        let layers = expert_layers(g)?;
        let expert_layers: Vec<(u32, u64)> = layers.iter().map(|l| (l.layer, l.bytes())).collect();
        let n_run = layers_run(g)?;
        let unrun_bytes = unrun_bytes(g)?;
        let recurrent_state_bytes = if g.architecture() == Some(crate::qwen35::ARCH) {
            let q = crate::qwen35::Qwen35Shape::from_gguf(g)?;
            let linear = q.kinds.iter().filter(|k| **k == LayerKind::Linear).count() as u64;
            let conv = (q.conv_kernel as u64 - 1) * q.conv_channels() as u64;
            let state = q.ssm_v_heads as u64 * (q.ssm_head_dim as u64).pow(2);
            linear * (conv + state) * 4
        } else {
            0
        };
        let expert_total: u64 = expert_layers.iter().map(|x| x.1).sum();
        // llama.cpp's default cache type is f16: 2 bytes per element of K and of V.
        let kv_bytes_per_token = g
            .tensors
            .iter()
            .filter(|t| {
                t.name.starts_with("blk.")
                    && !is_unrun_block(&t.name, n_run)
                    && (t.name.ends_with(".attn_k.weight") || t.name.ends_with(".attn_v.weight"))
            })
            .map(|t| t.dims.get(1).copied().unwrap_or(0) * 2)
            .sum();
        Ok(Self {
            architecture: g.architecture().unwrap_or_default().to_string(),
            trunk_bytes: g.tensor_bytes() - expert_total - unrun_bytes,
            n_expert: layers[0].n_expert,
            expert_layers,
            kv_bytes_per_token,
            recurrent_state_bytes,
            unrun_bytes,
        })
    }

    /// Bytes of all routed experts.
    pub fn expert_bytes(&self) -> u64 {
        self.expert_layers.iter().map(|x| x.1).sum()
    }
}

/// A single-coordinator plan: trunk, KV and some expert layers in VRAM, the rest in RAM.
#[derive(Debug, Clone, Serialize)]
pub struct CoordinatorPlan {
    /// The model's sizes.
    pub sizes: ModelSizes,
    /// Context length planned for.
    pub ctx: u64,
    /// KV cache bytes at `ctx`.
    pub kv_bytes: u64,
    /// VRAM budget.
    pub vram_budget: u64,
    /// RAM budget.
    pub ram_budget: u64,
    /// Layers whose experts stay in VRAM.
    pub gpu_expert_layers: Vec<u32>,
    /// Layers whose experts go to RAM.
    pub cpu_expert_layers: Vec<u32>,
    /// trunk + KV + GPU experts.
    pub vram_used: u64,
    /// CPU experts.
    pub ram_used: u64,
    /// Everything fits.
    pub fits: bool,
    /// RAM still missing when it does not fit.
    pub ram_shortfall: u64,
    /// The llama.cpp argument placing `cpu_expert_layers` on the CPU (none when all fit in VRAM).
    pub override_tensor: Option<String>,
}

/// The `--override-tensor` value that puts these layers' routed experts on the CPU.
pub fn override_tensor(layers: &[u32]) -> Option<String> {
    if layers.is_empty() {
        return None;
    }
    let list: Vec<String> = layers.iter().map(u32::to_string).collect();
    Some(format!(
        "blk\\.({})\\.ffn_(gate_up|gate|up|down)_exps\\.weight=CPU",
        list.join("|")
    ))
}

/// Plans a coordinator with `vram` and `ram` bytes at context `ctx`. Lower layers' experts
/// take the VRAM first (all layers' experts are the same size in these models).
pub fn plan_coordinator(
    sizes: &ModelSizes,
    vram: u64,
    ram: u64,
    ctx: u64,
) -> Result<CoordinatorPlan> {
    let kv_bytes = sizes
        .kv_bytes_per_token
        .checked_mul(ctx)
        .context("context too large")?;
    let fixed = sizes.trunk_bytes + kv_bytes + sizes.recurrent_state_bytes;
    if fixed > vram {
        bail!(
            "VRAM budget {:.2} GiB is smaller than the trunk ({:.2} GiB) plus the KV cache at {ctx} tokens ({:.2} GiB) plus the recurrent state ({:.2} GiB)",
            gib(vram),
            gib(sizes.trunk_bytes),
            gib(kv_bytes),
            gib(sizes.recurrent_state_bytes)
        );
    }
    let mut vram_used = fixed;
    let mut gpu = Vec::new();
    let mut cpu = Vec::new();
    for &(layer, bytes) in &sizes.expert_layers {
        if cpu.is_empty() && vram_used + bytes <= vram {
            vram_used += bytes;
            gpu.push(layer);
        } else {
            cpu.push(layer);
        }
    }
    let ram_used: u64 = sizes
        .expert_layers
        .iter()
        .filter(|(l, _)| cpu.contains(l))
        .map(|x| x.1)
        .sum();
    Ok(CoordinatorPlan {
        sizes: sizes.clone(),
        ctx,
        kv_bytes,
        vram_budget: vram,
        ram_budget: ram,
        override_tensor: override_tensor(&cpu),
        gpu_expert_layers: gpu,
        cpu_expert_layers: cpu,
        vram_used,
        ram_used,
        fits: ram_used <= ram,
        ram_shortfall: ram_used.saturating_sub(ram),
    })
}

/// One device in `NODES.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Its name.
    pub name: String,
    /// RAM it gives to slabs, e.g. `"12GiB"`.
    pub ram: String,
    /// Whether it is a phone.
    #[serde(default)]
    pub phone: bool,
}

/// `NODES.toml`: `[[node]]` tables.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodesFile {
    /// The devices.
    pub node: Vec<NodeSpec>,
}

/// Reads `NODES.toml` into devices.
pub fn read_nodes(path: &Path) -> Result<Vec<Device>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file: NodesFile =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if file.node.is_empty() {
        bail!("{} lists no [[node]]", path.display());
    }
    file.node
        .into_iter()
        .map(|n| {
            Ok(Device {
                ram_bytes: parse_size(&n.ram).with_context(|| format!("node {:?}", n.name))?,
                name: n.name,
                phone: n.phone,
            })
        })
        .collect()
}

/// A swarm plan: the placement and what it means per device.
#[derive(Debug, Clone, Serialize)]
pub struct SwarmPlan {
    /// The model's sizes.
    pub sizes: ModelSizes,
    /// The devices.
    pub devices: Vec<Device>,
    /// Replicas per slab.
    pub replicas: u32,
    /// Slabs each device holds.
    pub slabs_per_device: Vec<usize>,
    /// The placement.
    pub placement: Placement,
}

/// Places every slab (size from the header; load uniform or from `loads[layer][expert]`).
pub fn plan_swarm(
    sizes: &ModelSizes,
    devices: Vec<Device>,
    replicas: u32,
    loads: Option<&[Vec<f64>]>,
) -> Result<SwarmPlan> {
    if replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    let mut slabs = Vec::new();
    for (i, &(layer, bytes)) in sizes.expert_layers.iter().enumerate() {
        for e in 0..sizes.n_expert {
            let load = match loads {
                None => 1.0,
                Some(l) => *l.get(i).and_then(|r| r.get(e as usize)).with_context(|| {
                    format!("routing stats have no entry for layer {layer} expert {e}")
                })?,
            };
            if !(load.is_finite() && load >= 0.0) {
                bail!("routing stats for layer {layer} expert {e} is {load}");
            }
            slabs.push(SlabDemand {
                layer,
                expert: e as u32,
                bytes: bytes / sizes.n_expert,
                load,
            });
        }
    }
    let placement = place(&slabs, &devices, replicas).map_err(|e| match e {
        moeswarm_market::placement::PlacementError::Shortfall { shortfall, .. } => {
            crate::error::Error::invalid(format!(
                "the swarm cannot hold {replicas} replicas of every slab: short of {:.2} GiB ({e})",
                gib(shortfall)
            ))
        }
        other => crate::error::Error::from(other),
    })?;
    let mut slabs_per_device = vec![0; devices.len()];
    for h in &placement.holders {
        for &d in h {
            slabs_per_device[d] += 1;
        }
    }
    Ok(SwarmPlan {
        sizes: sizes.clone(),
        devices,
        replicas,
        slabs_per_device,
        placement,
    })
}

/// Text for a coordinator plan.
pub fn render_coordinator(p: &CoordinatorPlan) -> String {
    let s = &p.sizes;
    let mut out = String::new();
    let per_layer = s.expert_layers.first().map(|x| x.1).unwrap_or(0);
    out += &format!(
        "model        {} ({} expert layers x {} experts)\n",
        s.architecture,
        s.expert_layers.len(),
        s.n_expert
    );
    out += &format!("trunk        {:>9.2} GiB\n", gib(s.trunk_bytes));
    out += &format!(
        "experts      {:>9.2} GiB ({:.3} GiB per layer)\n",
        gib(s.expert_bytes()),
        gib(per_layer)
    );
    out += &format!(
        "KV cache     {:>9.2} GiB at {} tokens (f16)\n",
        gib(p.kv_bytes),
        p.ctx
    );
    if s.recurrent_state_bytes > 0 {
        out += &format!(
            "linear state {:>9.2} MiB per sequence (f32, any context)\n",
            s.recurrent_state_bytes as f64 / (1u64 << 20) as f64
        );
    }
    if s.unrun_bytes > 0 {
        out += &format!(
            "not run      {:>9.2} GiB (multi-token-prediction blocks)\n",
            gib(s.unrun_bytes)
        );
    }
    out += &format!(
        "VRAM         {:>9.2} GiB used of {:.2} GiB: trunk + KV + state + experts of {} layers\n",
        gib(p.vram_used),
        gib(p.vram_budget),
        p.gpu_expert_layers.len()
    );
    out += &format!(
        "RAM          {:>9.2} GiB used of {:.2} GiB: experts of {} layers\n",
        gib(p.ram_used),
        gib(p.ram_budget),
        p.cpu_expert_layers.len()
    );
    if p.fits {
        out += "fits         yes\n";
    } else {
        out += &format!(
            "fits         NO: {:.2} GiB more RAM needed\n",
            gib(p.ram_shortfall)
        );
    }
    match &p.override_tensor {
        Some(ot) => out += &format!("llama.cpp    -ngl 999 --override-tensor \"{ot}\"\n"),
        None => out += "llama.cpp    -ngl 999 (everything fits in VRAM)\n",
    }
    out
}

/// Text for a swarm plan.
pub fn render_swarm(p: &SwarmPlan) -> String {
    let mut out = format!(
        "{} slabs x {} replicas = {:.2} GiB over {} devices\n",
        p.placement.holders.len(),
        p.replicas,
        gib(p.sizes.expert_bytes() * p.replicas as u64),
        p.devices.len()
    );
    let total_load: f64 = p.placement.load_per_device.iter().sum();
    for (i, d) in p.devices.iter().enumerate() {
        out += &format!(
            "  {:<20} {:>8.2} of {:>8.2} GiB  {:>6} slabs  {:>5.1}% of load{}\n",
            d.name,
            gib(p.placement.bytes_per_device[i]),
            gib(d.ram_bytes),
            p.slabs_per_device[i],
            100.0 * p.placement.load_per_device[i] / total_load.max(f64::MIN_POSITIVE),
            if d.phone { "  (phone)" } else { "" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_lists_exactly_the_cpu_layers() {
        assert_eq!(override_tensor(&[]), None);
        assert_eq!(
            override_tensor(&[3, 10]).unwrap(),
            r"blk\.(3|10)\.ffn_(gate_up|gate|up|down)_exps\.weight=CPU"
        );
    }
}
