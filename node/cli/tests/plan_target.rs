//! `plan` on the real target's shape: `synth --header-only` writes a GGUF with
//! Qwen3.5-122B-A10B's tensor shapes whose data region is a sparse file; its sizes are checked
//! against sizes computed here from the published config and the block layouts.

use moeswarm_testkit as common;

use std::process::Command;

use moeswarm_model::gguf::{GgmlType, Gguf};
use moeswarm_model::plan::{plan_coordinator, plan_swarm, read_nodes, ModelSizes};

const LAYERS: u64 = 48;
const EXPERTS: u64 = 256;
const EMBD: u64 = 3072;
const EXPERT_FF: u64 = 1024;
const VOCAB: u64 = 248_320;
const KV_WIDTH: u64 = 2 * 256; // 2 kv heads x head_dim 256
const SHARED_FF: u64 = 1024;
const FULL_ATTENTION_EVERY: u64 = 4;

/// Bytes of `n` elements, from each format's block layout (not from the code under test).
fn bytes(t: GgmlType, n: u64) -> u64 {
    match t {
        GgmlType::F32 => n * 4,
        GgmlType::Q8_0 => n / 32 * 34,   // f16 scale + 32 int8
        GgmlType::Q4_K => n / 256 * 144, // 2 f16 + 12 scale bytes + 128 nibble bytes
        GgmlType::Q6_K => n / 256 * 210, // 128 low + 64 high + 16 scales + f16
        _ => unreachable!(),
    }
}

/// Sizes of the real model's shape, computed here from its published config and the tensor
/// types `synth` writes (Q4_K experts; Q6_K embedding and head; Q8_0 projections; f32 norms,
/// router, conv and decay vectors).
struct Target {
    trunk_bytes: u64,
    layer_expert_bytes: u64,
}

/// Gated DeltaNet sizes: head dim, q/k heads, v heads, conv window.
const SSM: (u64, u64, u64, u64) = (128, 16, 64, 4);

fn target() -> Target {
    use GgmlType::*;
    let (s, hk, hv, _) = SSM;
    let conv = (2 * hk + hv) * s; // 12288 conv channels: q, k and v heads
    let mut trunk = 0;
    let mut experts = 0;
    let mut add = |dims: &[u64], dtype: GgmlType, expert: bool| {
        let b = bytes(dtype, dims.iter().product());
        if expert {
            experts += b;
        } else {
            trunk += b;
        }
    };
    add(&[EMBD, VOCAB], Q6_K, false); // token_embd
    add(&[EMBD], F32, false); // output_norm
    add(&[EMBD, VOCAB], Q6_K, false); // output
    for l in 0..LAYERS {
        add(&[EMBD], F32, false); // attn_norm
        add(&[EMBD], F32, false); // post_attention_norm
        if l % FULL_ATTENTION_EVERY == FULL_ATTENTION_EVERY - 1 {
            add(&[EMBD, 2 * 32 * 256], Q8_0, false); // attn_q: query and gate
            add(&[EMBD, KV_WIDTH], Q8_0, false); // attn_k
            add(&[EMBD, KV_WIDTH], Q8_0, false); // attn_v
            add(&[32 * 256, EMBD], Q8_0, false); // attn_output
            add(&[256], F32, false); // attn_q_norm
            add(&[256], F32, false); // attn_k_norm
        } else {
            add(&[EMBD, conv], Q8_0, false); // attn_qkv
            add(&[EMBD, hv * s], Q8_0, false); // attn_gate
            add(&[SSM.3, conv], F32, false); // ssm_conv1d
            add(&[hv], F32, false); // ssm_dt.bias
            add(&[hv], F32, false); // ssm_a
            add(&[EMBD, hv], Q8_0, false); // ssm_beta
            add(&[EMBD, hv], Q8_0, false); // ssm_alpha
            add(&[s], F32, false); // ssm_norm
            add(&[hv * s, EMBD], Q8_0, false); // ssm_out
        }
        add(&[EMBD, EXPERTS], F32, false); // ffn_gate_inp
        add(&[EMBD, EXPERT_FF, EXPERTS], Q4_K, true);
        add(&[EMBD, EXPERT_FF, EXPERTS], Q4_K, true);
        add(&[EXPERT_FF, EMBD, EXPERTS], Q4_K, true);
        add(&[EMBD], F32, false); // ffn_gate_inp_shexp
        add(&[EMBD, SHARED_FF], Q8_0, false);
        add(&[EMBD, SHARED_FF], Q8_0, false);
        add(&[SHARED_FF, EMBD], Q8_0, false);
    }
    Target {
        trunk_bytes: trunk,
        layer_expert_bytes: experts / LAYERS,
    }
}

/// `moeswarm synth --arch qwen35moe --preset qwen35-122b-a10b --header-only`: the whole
/// model's header, its data region a hole.
fn write_sparse(path: &std::path::Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_moeswarm"))
        .args([
            "synth",
            "--arch",
            "qwen35moe",
            "--preset",
            "qwen35-122b-a10b",
        ])
        .args(["--expert-type", "q4_k", "--header-only", "--out"])
        .arg(path)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

const GIB: u64 = 1 << 30;

#[test]
fn coordinator_plan_on_the_target_shape_adds_up() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("qwen35-122b.gguf");
    let t = target();
    write_sparse(&file);
    let g = Gguf::open(&file).unwrap();
    assert!(
        g.file_size > 60 * GIB,
        "the file claims the whole model: {}",
        g.file_size
    );

    let sizes = ModelSizes::of(&g).unwrap();
    assert_eq!(sizes.trunk_bytes, t.trunk_bytes);
    assert_eq!(sizes.expert_layers.len() as u64, LAYERS);
    // 3 matrices x 3072 x 1024 x 256 experts of Q4_K: 1.266 GiB a layer, 60.75 GiB in all.
    assert_eq!(
        t.layer_expert_bytes,
        3 * EMBD * EXPERT_FF * EXPERTS / 256 * 144
    );
    assert!(sizes
        .expert_layers
        .iter()
        .all(|&(_, b)| b == t.layer_expert_bytes));
    let full_layers = LAYERS / FULL_ATTENTION_EVERY;
    assert_eq!(sizes.kv_bytes_per_token, full_layers * 2 * KV_WIDTH * 2);
    // Each linear layer keeps Kc-1 conv rows and one S x S state per v head, in f32.
    let (s, hk, hv, kc) = SSM;
    let per_linear = ((kc - 1) * (2 * hk + hv) * s + hv * s * s) * 4;
    assert_eq!(
        sizes.recurrent_state_bytes,
        (LAYERS - full_layers) * per_linear
    );

    let (vram, ram, ctx) = (24 * GIB, 64 * GIB, 32_768);
    let p = plan_coordinator(&sizes, vram, ram, ctx).unwrap();
    println!("{}", moeswarm_model::plan::render_coordinator(&p));
    let kv = ctx * full_layers * 2 * KV_WIDTH * 2;
    let state = sizes.recurrent_state_bytes;
    let gpu_layers = (vram - t.trunk_bytes - kv - state) / t.layer_expert_bytes;
    assert_eq!(p.kv_bytes, kv);
    assert_eq!(
        p.gpu_expert_layers,
        (0..gpu_layers as u32).collect::<Vec<_>>()
    );
    assert_eq!(
        p.cpu_expert_layers,
        (gpu_layers as u32..LAYERS as u32).collect::<Vec<_>>()
    );
    assert_eq!(
        p.vram_used,
        t.trunk_bytes + kv + state + gpu_layers * t.layer_expert_bytes
    );
    assert_eq!(p.ram_used, (LAYERS - gpu_layers) * t.layer_expert_bytes);
    assert!(p.vram_used <= vram && p.fits);
    let ot = p.override_tensor.unwrap();
    assert!(
        ot.starts_with(&format!("blk\\.({}|", gpu_layers))
            && ot.ends_with("|47)\\.ffn_(gate_up|gate|up|down)_exps\\.weight=CPU"),
        "{ot}"
    );

    // Too little RAM: does not fit, and says by how much.
    let p = plan_coordinator(&sizes, vram, 16 * GIB, ctx).unwrap();
    assert!(!p.fits);
    assert_eq!(
        p.ram_shortfall,
        (LAYERS - gpu_layers) * t.layer_expert_bytes - 16 * GIB
    );
    // VRAM smaller than the trunk: a clear error.
    let err = plan_coordinator(&sizes, GIB, ram, ctx).unwrap_err();
    assert!(err.to_string().contains("smaller than the trunk"), "{err}");
}

#[test]
fn swarm_plan_on_the_target_shape_places_every_replica_within_budget() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("qwen35-122b.gguf");
    let t = target();
    write_sparse(&file);
    let sizes = ModelSizes::of(&Gguf::open(&file).unwrap()).unwrap();
    let nodes = dir.path().join("nodes.toml");
    let mut toml = String::new();
    for i in 0..8 {
        toml += &format!("[[node]]\nname = \"laptop-{i}\"\nram = \"16GiB\"\n\n");
    }
    for i in 0..4 {
        toml += &format!("[[node]]\nname = \"phone-{i}\"\nram = \"6GiB\"\nphone = true\n\n");
    }
    std::fs::write(&nodes, toml).unwrap();
    let devices = read_nodes(&nodes).unwrap();
    let p = plan_swarm(&sizes, devices.clone(), 2, None).unwrap();
    println!("{}", moeswarm_model::plan::render_swarm(&p));
    let slab = t.layer_expert_bytes / EXPERTS;
    assert_eq!(p.placement.holders.len() as u64, LAYERS * EXPERTS);
    for h in &p.placement.holders {
        assert!(h.len() == 2 && h[0] != h[1]);
    }
    for (i, d) in devices.iter().enumerate() {
        assert!(p.placement.bytes_per_device[i] <= d.ram_bytes);
        assert_eq!(
            p.placement.bytes_per_device[i],
            p.slabs_per_device[i] as u64 * slab
        );
    }
    // Phones carry less load per device than laptops.
    assert!(p.placement.load_per_device[8] < p.placement.load_per_device[0]);

    // Three laptops cannot hold two replicas: the shortfall, in bytes, is exact.
    let small = devices[..3].to_vec();
    let err = plan_swarm(&sizes, small, 2, None).unwrap_err().to_string();
    let short = 2 * LAYERS * EXPERTS * slab - 3 * 16 * GIB;
    assert!(
        err.contains(&format!("short of {:.2} GiB", short as f64 / GIB as f64)),
        "{err}"
    );
}

#[test]
fn plan_command_prints_budgets_and_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("qwen35-122b.gguf");
    write_sparse(&file);
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_moeswarm"))
            .arg("plan")
            .arg(&file)
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code().unwrap(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, out, _) = run(&["--vram", "24GiB", "--ram", "64GiB"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("of 24.00 GiB")
            && out.contains("of 64.00 GiB")
            && out.contains("--override-tensor"),
        "{out}"
    );
    let (code, out, _) = run(&["--vram", "24GiB", "--ram", "64GiB", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["fits"], true);
    let (code, _, err) = run(&["--vram", "24GiB", "--ram", "8GiB"]);
    assert_eq!(code, 1, "{err}");
    let (code, _, err) = run(&["--vram", "lots", "--ram", "64GiB"]);
    assert_eq!(code, 2);
    assert!(err.contains("not a number"), "{err}");
    let (code, _, err) = run(&["--vram", "1GiB", "--ram", "64GiB"]);
    assert_eq!(code, 2);
    assert!(err.contains("smaller than the trunk"), "{err}");

    // Not a MoE model: the reference model with its expert tensors renamed.
    let bytes = common::dense_model_bytes();
    let dense = dir.path().join("dense.gguf");
    std::fs::write(&dense, bytes).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_moeswarm"))
        .args([
            "plan",
            dense.to_str().unwrap(),
            "--vram",
            "1GiB",
            "--ram",
            "1GiB",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a MoE model"));
}
