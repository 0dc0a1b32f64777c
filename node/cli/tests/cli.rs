//! The `moeswarm` command end to end, as a user runs it.

use common::{data, read_f32};
use moeswarm_testkit as common;

/// Runs the `moeswarm` binary: exit code, stdout, stderr.
fn moeswarm(args: &[&str]) -> (i32, String, String) {
    common::run_program(env!("CARGO_BIN_EXE_moeswarm"), args)
}

#[test]
fn inspect_prints_the_header() {
    let file = data("small-q4_k.gguf");
    let (code, out, _) = moeswarm(&["inspect", file.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["architecture"], "qwen3moe");
    assert_eq!(v["hyper_params"]["n_expert"], 16);
    let gate = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "blk.2.ffn_gate_exps.weight")
        .unwrap();
    assert_eq!(gate["type"], "q4_k");
    assert_eq!(gate["shape"], serde_json::json!([256, 256, 16]));
    assert_eq!(gate["bytes"], 256 * 256 * 16 / 256 * 144);
    let (code, text, _) = moeswarm(&["inspect", file.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(text.contains("blk.0.ffn_down_exps.weight") && text.contains("q4_k"));
}

#[test]
fn synth_slice_verify() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    let store = dir.path().join("store");
    let (m, s) = (model.to_str().unwrap(), store.to_str().unwrap());
    let (code, _, err) = moeswarm(&[
        "synth",
        "--out",
        m,
        "--preset",
        "tiny",
        "--expert-type",
        "q8_0",
        "--seed",
        "4",
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = moeswarm(&["slice", m, "--store", s, "--json"]);
    assert_eq!(code, 0, "{err}");
    let sliced: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(sliced["slabs"], 16);
    assert_eq!(sliced["already_sliced"], false);
    let (_, out, _) = moeswarm(&["slice", m, "--store", s, "--json"]);
    let again: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(again["already_sliced"], true);
    assert_eq!(again["model_id"], sliced["model_id"]);
    let (code, out, err) = moeswarm(&["verify", m, "--store", s, "--tokens", "4", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["passed"], true);
    assert_eq!(v["layers"].as_array().unwrap().len(), 2);
}

#[test]
fn bad_input_is_a_clear_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(
        &junk,
        b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff",
    )
    .unwrap();
    let (code, _, err) = moeswarm(&["inspect", junk.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(
        err.contains("tensor count") && !err.contains("panicked"),
        "{err}"
    );
    let store = dir.path().join("store");
    let (code, _, err) = moeswarm(&[
        "slice",
        junk.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("junk.gguf"), "{err}");
    let (code, _, err) = moeswarm(&[
        "synth",
        "--out",
        junk.to_str().unwrap(),
        "--expert-type",
        "q9_z",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("q9_z"), "{err}");
    let (code, _, err) = moeswarm(&[
        "verify",
        data("tiny-f32.gguf").to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("has not been sliced"), "{err}");
}

#[test]
fn logits_and_generate_commands() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("l.bin");
    let toks: Vec<String> = common::reference_tokens("")
        .iter()
        .map(u32::to_string)
        .collect();
    let bin = env!("CARGO_BIN_EXE_moeswarm");
    let o = std::process::Command::new(bin)
        .args([
            "logits",
            "--model",
            data("tiny-f32.gguf").to_str().unwrap(),
            "--tokens",
            &toks.join(","),
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Vec<f32> = std::fs::read(&out)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want = read_f32("tiny-f32.logits.bin");
    assert_eq!(got.len(), want.len());
    assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-4));

    let o = std::process::Command::new(bin)
        .args([
            "generate",
            "--model",
            data("tiny-f32.gguf").to_str().unwrap(),
            "--prompt",
            "hi",
            "--max-tokens",
            "5",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["prompt_tokens"], serde_json::json!([104, 105]));
    assert!(v["tokens"].as_array().unwrap().len() <= 5);
    let o = std::process::Command::new(bin)
        .args([
            "generate",
            "--model",
            data("tiny-f32.gguf").to_str().unwrap(),
            "--prompt",
            "hi",
            "--max-tokens",
            "3",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("tokens/s"));
}

#[test]
fn a_closed_pipe_ends_the_command_quietly() {
    // The reader is gone before the first byte is written (`moeswarm inspect big.gguf | head`).
    let file = data("small-q4_k.gguf");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_moeswarm"))
        .args(["inspect", file.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn qwen35moe_inspect_slice_logits_and_generate() {
    let file = data("qwen35moe/tiny-f32.gguf");
    let f = file.to_str().unwrap();
    let (code, out, _) = moeswarm(&["inspect", f, "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["architecture"], "qwen35moe");
    assert_eq!(
        v["layer_kinds"],
        serde_json::json!(["linear", "linear", "linear", "full"])
    );
    // Routed experts: 3 matrices of 64 x 32 f32 per expert, 8 experts, 4 layers; the shared
    // expert stays in the trunk.
    assert_eq!(v["expert_bytes"], 3 * 64 * 32 * 4 * 8 * 4);
    let (code, text, _) = moeswarm(&["inspect", f]);
    assert_eq!(code, 0);
    assert!(text.contains("layers: LLLF"), "{text}");

    // Through a store: slice, then logits of the sliced model equal llama.cpp's.
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let s = store.to_str().unwrap();
    let (code, out, err) = moeswarm(&["slice", f, "--store", s, "--json"]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let model = report["model_id"].as_str().unwrap();
    let toks: Vec<String> = common::reference_tokens("qwen35moe")
        .iter()
        .map(u32::to_string)
        .collect();
    let out_file = dir.path().join("l.bin");
    let (code, _, err) = moeswarm(&[
        "logits",
        "--store",
        s,
        "--model-id",
        model,
        "--tokens",
        &toks.join(","),
        "--out",
        out_file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let got: Vec<f32> = std::fs::read(&out_file)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want = read_f32("qwen35moe/tiny-f32.logits.bin");
    assert_eq!(got.len(), want.len());
    let max = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max <= 1e-4, "max |Δ| {max}");

    let (code, out, err) = moeswarm(&[
        "generate",
        "--model",
        f,
        "--prompt",
        "hi",
        "--max-tokens",
        "4",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(!v["tokens"].as_array().unwrap().is_empty());
}

#[test]
fn bench_reports_speeds_memory_and_the_cold_run() {
    let file = data("small-q4_k.gguf");
    let (code, out, err) = moeswarm(&[
        "bench",
        file.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "4",
        "-r",
        "2",
        "--threads",
        "1",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in [
        "pp_tps",
        "tg_tps",
        "pp_sd",
        "tg_sd",
        "cold_first_generation_s",
    ] {
        assert!(v[key].as_f64().unwrap() >= 0.0, "{key}: {v}");
    }
    assert!(v["pp_tps"].as_f64().unwrap() > 0.0 && v["tg_tps"].as_f64().unwrap() > 0.0);
    let weights = std::fs::metadata(&file).unwrap().len();
    let w = v["weights_bytes"].as_u64().unwrap();
    assert!(
        w > weights / 2 && w <= weights,
        "{w} of a {weights}-byte file"
    );
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > w);
    let (code, _, err) = moeswarm(&["bench", file.to_str().unwrap(), "-r", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("at least 1"), "{err}");
}

#[test]
fn bench_says_which_kernels_ran_and_runs_the_one_asked_for() {
    use moeswarm_engine::kernels::Path;
    let file = data("small-q4_k.gguf");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            file.to_str().unwrap(),
            "-p",
            "4",
            "-n",
            "2",
            "-r",
            "1",
        ];
        args.extend_from_slice(extra);
        args.push("--json");
        let (code, out, err) = moeswarm(&args);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let best = Path::available_paths().pop().unwrap();
    let v = run(&[]);
    assert_eq!(v["kernels"], best.name(), "{v}");
    let flags: Vec<&str> = v["cpu_flags"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f.as_str())
        .collect();
    for f in best.flags() {
        assert!(flags.contains(f), "{f} missing from {flags:?}");
    }
    assert_eq!(run(&["--kernels", "baseline"])["kernels"], "baseline");
    let (code, _, err) = moeswarm(&["bench", file.to_str().unwrap(), "--kernels", "sse9"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("avx512") && err.contains("baseline"), "{err}");
    if let Some(p) = Path::ALL.into_iter().find(|p| !p.available()) {
        let (code, _, err) = moeswarm(&["bench", file.to_str().unwrap(), "--kernels", p.name()]);
        assert_ne!(code, 0, "{err}");
        assert!(err.contains(p.missing().unwrap()), "{err}");
    }
}

#[test]
fn serve_answers_openai_requests_until_stopped() {
    use std::io::{BufRead, BufReader, Read, Write};
    let file = data("small-q4_k.gguf");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_moeswarm"))
        .args([
            "serve",
            "--model",
            file.to_str().unwrap(),
            "--http",
            "127.0.0.1:0",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first
        .strip_prefix("serving small-q4_k on http://")
        .and_then(|r| r.strip_suffix("/v1"))
        .unwrap_or_else(|| panic!("{first}"))
        .to_string();
    let ask = |req: String| {
        let mut sock = std::net::TcpStream::connect(&addr).unwrap();
        sock.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        sock.read_to_string(&mut out).unwrap();
        out
    };
    let models = ask("GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".into());
    assert!(
        models.starts_with("HTTP/1.1 200") && models.contains("\"small-q4_k\""),
        "{models}"
    );
    let body = r#"{"model":"small-q4_k","prompt":"The swarm","max_tokens":4,"temperature":0}"#;
    let done = ask(format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    ));
    assert!(
        done.starts_with("HTTP/1.1 200") && done.contains("\"text_completion\""),
        "{done}"
    );
    let _ = child.kill();
    let _ = child.wait();
}
