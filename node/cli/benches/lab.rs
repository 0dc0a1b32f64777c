//! `cargo bench -p moeswarm --bench lab`: the network lab's benchmark (as `moeswarm lab
//! --scenario sim/scenarios/home.toml`, with this build's binary): decode milliseconds a token
//! through a swarm of processes in network namespaces at 0, 2, 10 and 30 ms round trips, each
//! beside the floor (MoE layers × round trip + the local decode time, measured in the same
//! run), with MTP drafts and without; then a fetch of a 39 MB model (the `small` preset)
//! through a 10 MB/s uplink beside that rate. Needs root, `ip`, `nft` and TUN: elsewhere it says why and measures nothing.

use moeswarm_sim::lab::bench::{run_bench, BenchOptions};
use moeswarm_sim::lab::topology::Scenario;

fn main() {
    if let Some(why) = moeswarm_sim::lab::skip_reason() {
        eprintln!("lab benchmark skipped: {why}");
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join("sim/scenarios/home.toml")).unwrap();
    let work = tempfile::tempdir().unwrap();
    // A 39 MB model to fetch (the trained one is 8.5 MB): the time to find its holders is a
    // small part of the whole.
    let fetched = work.path().join("fetched.gguf");
    let (bin, out) = (env!("CARGO_BIN_EXE_moeswarm"), fetched.to_str().unwrap());
    let synth = std::process::Command::new(bin)
        .args(["synth", "--out", out, "--preset", "small"])
        .output()
        .unwrap();
    assert!(synth.status.success(), "{synth:?}");
    let opts = BenchOptions {
        bin: env!("CARGO_BIN_EXE_moeswarm").into(),
        scenario: Scenario::parse(&text).unwrap(),
        model: moeswarm_sim::trained_model(),
        work_dir: work.path().to_path_buf(),
        rtts_ms: vec![0.0, 2.0, 10.0, 30.0],
        tokens: 48,
        fetch_rate: 10_000_000,
        fetch_model: Some(fetched),
        seed: 1,
    };
    let r = run_bench(&opts).unwrap();
    println!(
        "local decode {:.2} ms a token ({} with MTP drafts); {} MoE layers",
        r.local_ms_per_token,
        r.local_speculative_ms_per_token
            .map_or("-".into(), |s| format!("{s:.2} ms")),
        r.moe_layers
    );
    for x in &r.rtts {
        println!(
            "rtt {:>4.1} ms: floor {:>6.1} ms/token, swarm {:>6.1} ({:.2}x the floor), with MTP {}",
            x.rtt_ms,
            x.floor_ms_per_token,
            x.ms_per_token,
            x.over_floor,
            x.speculative_ms_per_token.map_or("-".into(), |s| format!(
                "{s:.1} ({:.2}x)",
                x.speculative_over_floor.unwrap_or(0.0)
            )),
        );
    }
    if let Some(f) = &r.fetch {
        println!(
            "fetch: {} bytes in {:.2} s through a {:.0} MB/s uplink: {:.2}x its rate",
            f.bytes,
            f.seconds,
            f.uplink_bytes_per_s as f64 / 1e6,
            f.of_uplink
        );
    }
}
