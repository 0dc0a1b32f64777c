//! `plan` on the real target's shape: a GGUF with Qwen3.5-122B-A10B's tensor shapes and types
//! whose data region is a sparse file, checked against sizes computed here from first principles.

use moeswarm_testkit as common;

use std::process::Command;

use moeswarm_model::gguf::{header_bytes, GgmlType, Gguf, TensorLayout, Value};
use moeswarm_model::plan::{plan_coordinator, plan_swarm, read_nodes, ModelSizes};

const LAYERS: u64 = 48;
const EXPERTS: u64 = 256;
const EMBD: u64 = 3072;
const EXPERT_FF: u64 = 1024;
const VOCAB: u64 = 248_320;
const KV_WIDTH: u64 = 2 * 256; // 2 kv heads x head_dim 256
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

struct Target {
    tensors: Vec<TensorLayout>,
    trunk_bytes: u64,
    layer_expert_bytes: u64,
}

fn target() -> Target {
    use GgmlType::*;
    let mut tensors = Vec::new();
    let mut trunk = 0;
    let mut experts = 0;
    let mut add = |name: String, dims: Vec<u64>, dtype: GgmlType, expert: bool| {
        let b = bytes(dtype, dims.iter().product());
        if expert {
            experts += b;
        } else {
            trunk += b;
        }
        tensors.push(TensorLayout { name, dims, dtype });
    };
    add("token_embd.weight".into(), vec![EMBD, VOCAB], Q6_K, false);
    add("output_norm.weight".into(), vec![EMBD], F32, false);
    add("output.weight".into(), vec![EMBD, VOCAB], Q6_K, false);
    for l in 0..LAYERS {
        let b = |s: &str| format!("blk.{l}.{s}.weight");
        add(b("attn_norm"), vec![EMBD], F32, false);
        add(b("post_attention_norm"), vec![EMBD], F32, false);
        if l % FULL_ATTENTION_EVERY == FULL_ATTENTION_EVERY - 1 {
            add(b("attn_q"), vec![EMBD, 2 * 32 * 256], Q8_0, false);
            add(b("attn_k"), vec![EMBD, KV_WIDTH], Q8_0, false);
            add(b("attn_v"), vec![EMBD, KV_WIDTH], Q8_0, false);
            add(b("attn_output"), vec![32 * 256, EMBD], Q8_0, false);
            add(b("attn_q_norm"), vec![256], F32, false);
            add(b("attn_k_norm"), vec![256], F32, false);
        } else {
            add(b("attn_qkv"), vec![EMBD, 12288], Q8_0, false);
            add(b("attn_gate"), vec![EMBD, 8192], Q8_0, false);
            add(b("ssm_conv1d"), vec![4, 12288], F32, false);
            add(b("ssm_out"), vec![8192, EMBD], Q8_0, false);
        }
        add(b("ffn_gate_inp"), vec![EMBD, EXPERTS], F32, false);
        add(
            b("ffn_gate_exps"),
            vec![EMBD, EXPERT_FF, EXPERTS],
            Q4_K,
            true,
        );
        add(b("ffn_up_exps"), vec![EMBD, EXPERT_FF, EXPERTS], Q4_K, true);
        add(
            b("ffn_down_exps"),
            vec![EXPERT_FF, EMBD, EXPERTS],
            Q4_K,
            true,
        );
        add(b("ffn_gate_inp_shexp"), vec![EMBD], F32, false);
        add(b("ffn_gate_shexp"), vec![EMBD, EXPERT_FF], Q8_0, false);
        add(b("ffn_up_shexp"), vec![EMBD, EXPERT_FF], Q8_0, false);
        add(b("ffn_down_shexp"), vec![EXPERT_FF, EMBD], Q8_0, false);
    }
    Target {
        tensors,
        trunk_bytes: trunk,
        layer_expert_bytes: experts / LAYERS,
    }
}

/// Writes the target's header and extends the file to its full length without writing data.
fn write_sparse(path: &std::path::Path, t: &Target) {
    let a = "qwen35moe";
    let u = |v: u64| Value::U32(v as u32);
    let meta = vec![
        ("general.architecture".to_string(), Value::String(a.into())),
        (
            "general.name".to_string(),
            Value::String("Qwen3.5-122B-A10B shape".into()),
        ),
        (format!("{a}.block_count"), u(LAYERS)),
        (format!("{a}.context_length"), u(262_144)),
        (format!("{a}.embedding_length"), u(EMBD)),
        (format!("{a}.expert_feed_forward_length"), u(EXPERT_FF)),
        (format!("{a}.attention.head_count"), u(32)),
        (format!("{a}.attention.head_count_kv"), u(2)),
        (format!("{a}.attention.key_length"), u(256)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        (format!("{a}.expert_count"), u(EXPERTS)),
        (format!("{a}.expert_used_count"), u(8)),
        (
            format!("{a}.full_attention_interval"),
            u(FULL_ATTENTION_EVERY),
        ),
    ];
    let (header, infos, _) = header_bytes(&meta, &t.tensors).unwrap();
    let last = infos.last().unwrap();
    let end = header.len() as u64 + last.offset + bytes(last.dtype, last.dims.iter().product());
    std::fs::write(path, &header).unwrap();
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(end)
        .unwrap();
}

const GIB: u64 = 1 << 30;

#[test]
fn coordinator_plan_on_the_target_shape_adds_up() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("qwen35-122b.gguf");
    let t = target();
    write_sparse(&file, &t);
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

    let (vram, ram, ctx) = (24 * GIB, 64 * GIB, 32_768);
    let p = plan_coordinator(&sizes, vram, ram, ctx).unwrap();
    println!("{}", moeswarm_model::plan::render_coordinator(&p));
    let kv = ctx * full_layers * 2 * KV_WIDTH * 2;
    let gpu_layers = (vram - t.trunk_bytes - kv) / t.layer_expert_bytes;
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
        t.trunk_bytes + kv + gpu_layers * t.layer_expert_bytes
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
    write_sparse(&file, &t);
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
    write_sparse(&file, &target());
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
