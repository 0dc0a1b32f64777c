//! `moeswarm sim --scale`: the market simulated at scale, as a user runs it.

use moeswarm_testkit as common;

fn moeswarm(args: &[&str]) -> (i32, String, String) {
    common::run_program(env!("CARGO_BIN_EXE_moeswarm"), args)
}

/// The default scenario over a model of 48 × 8 slabs, so the run takes a second.
fn small_scenario(dir: &std::path::Path) -> String {
    let default = include_str!("../../../sim/scenarios/qwen35-122b.toml");
    let path = dir.join("small.toml");
    std::fs::write(&path, default.replace("experts = 256", "experts = 8")).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn the_same_seed_prints_the_same_json_and_another_seed_another() {
    let dir = tempfile::tempdir().unwrap();
    let sc = small_scenario(dir.path());
    let args = |seed: &'static str| {
        let mut a = vec![
            "sim", "--scale", "30", "--hours", "0.5", "--seed", seed, "--json",
        ];
        a.extend(["--scenario", sc.as_str()]);
        moeswarm(&a)
    };
    let (code, a, err) = args("5");
    assert_eq!(code, 0, "{err}");
    let (_, b, _) = args("5");
    assert_eq!(a, b, "one seed, one history");
    let (_, c, _) = args("6");
    assert_ne!(a, c);
    let v: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert_eq!(v["nodes"], 30);
    assert_eq!(v["slabs"], 48 * 8);
    assert!(v["full_at_target_secs"].is_number(), "{a}");
    assert_eq!(v["violations"].as_array().unwrap().len(), 0);
    // And for people: the coverage table.
    let (code, text, _) = moeswarm(&["sim", "--scale", "30", "--hours", "0.2", "--scenario", &sc]);
    assert_eq!(code, 0);
    assert!(
        text.contains("full coverage at target") && text.contains("invariants: held"),
        "{text}"
    );
}

#[test]
fn routers_asked_for_serve_and_say_how_fast() {
    let dir = tempfile::tempdir().unwrap();
    let sc = small_scenario(dir.path());
    let path = dir.path().join("serving.toml");
    let text = std::fs::read_to_string(&sc).unwrap()
        + "\n[serving]\nrequests_per_min = 4.0\nstart_secs = 300\noutput_tokens = 8\n";
    std::fs::write(&path, text).unwrap();
    let args = [
        "sim",
        "--scale",
        "30",
        "--hours",
        "0.3",
        "--routers",
        "2",
        "--json",
        "--scenario",
    ];
    let mut a = args.to_vec();
    a.push(path.to_str().unwrap());
    let (code, out, err) = moeswarm(&a);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let s = &v["serving"];
    assert_eq!(s["routers"], 2, "--routers overrides the section's count");
    assert!(s["tokens"].as_u64().unwrap() > 0, "{out}");
    assert_eq!(s["tokens_per_sec"].as_array().unwrap().len(), 2);
    assert!(s["token_ms"]["p50"].as_f64().unwrap() > 0.0, "{out}");
    // Without routers, no serving in the report.
    let (_, out, _) = moeswarm(&[
        "sim",
        "--scale",
        "10",
        "--hours",
        "0.1",
        "--json",
        "--scenario",
        &sc,
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v.get("serving").is_none(), "{out}");
}

#[test]
fn a_scenario_with_a_misspelt_or_bad_value_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    let default = include_str!("../../../sim/scenarios/qwen35-122b.toml");
    std::fs::write(&path, default.replace("relay_mbps", "relay_mpbs")).unwrap();
    let (code, _, err) = moeswarm(&["sim", "--scale", "10", "--scenario", path.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(
        err.contains("relay_mpbs") && err.contains("bad.toml"),
        "{err}"
    );
    let (code, _, err) = moeswarm(&["sim", "--scale", "10", "--scenario", "/nonexistent.toml"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent.toml"), "{err}");
}
