//! `moeswarm node`, `fetch` and `coverage` as separate processes on 127.0.0.1.

use moeswarm_testkit as common;

use std::time::Duration;

use common::{corpus_word_share, data};

mod nodes;
use nodes::{node, sliced_tiny, NodeProcess};

/// Runs the `moeswarm` binary: exit code, stdout, stderr.
fn moeswarm(args: &[&str]) -> (i32, String, String) {
    common::run_program(env!("CARGO_BIN_EXE_moeswarm"), args)
}

/// `moeswarm coverage --json` of `model` through `seeder`: exit code, stdout, stderr.
fn coverage_json(seeder: &NodeProcess, model: &str) -> (i32, String, String) {
    moeswarm(&[
        "coverage",
        "--bootstrap",
        &seeder.addr,
        "--model",
        model,
        "--json",
    ])
}

#[test]
fn a_node_process_serves_fetch_and_coverage_processes() {
    let dir = tempfile::tempdir().unwrap();
    let (s, model) = sliced_tiny(dir.path());
    let s = s.as_str();

    let seeder = node(s, &["--http", "127.0.0.1:0"]);
    // The node serves its blobs over HTTP too: the manifest is the blob named by the model id.
    let answer = nodes::http_get(seeder.http.as_deref().unwrap(), &format!("/blob/{model}"));
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains(&format!("etag: \"{model}\"")),
        "{text}"
    );
    let body = &answer[text.find("\r\n\r\n").unwrap() + 4..];
    assert_eq!(moeswarm_protocol::BlobId::of(body).to_hex(), model);
    assert!(seeder.addr.starts_with("/ip4/127.0.0.1/tcp/") && seeder.addr.ends_with(&seeder.peer));

    // A worker store gets layer 0's experts 0..3 through `fetch`.
    let worker_store = dir.path().join("worker");
    let w = worker_store.to_str().unwrap();
    let (code, out, err) = moeswarm(&[
        "fetch",
        "--bootstrap",
        &seeder.addr,
        "--model",
        &model,
        "--store",
        w,
        "--layers",
        "0..1",
        "--experts",
        "0..3",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["fetched"], 3, "{report}");

    // The worker runs as a node and joins; coverage sees both.
    let worker = node(w, &["--bootstrap", &seeder.addr]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (code, out, err) = coverage_json(&seeder, &model);
        if code == 0 {
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            let layer0 = &v["layers"][0]["replicas"];
            if v["nodes"].as_object().unwrap().len() == 2 {
                assert_eq!(v["nodes"][&worker.peer]["slabs"], 3);
                assert_eq!(layer0[0], 2);
                assert_eq!(layer0[3], 1);
                assert_eq!(v["layers"][1]["replicas"][0], 1);
                // Counts only; holders one slab at a time.
                assert!(v["layers"][0].get("holders").is_none(), "{out}");
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "coverage never showed both nodes: {out}{err}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // The text form numbers the nodes and counts each layer's replicas.
    let (code, text, err) = moeswarm(&["coverage", "--bootstrap", &seeder.addr, "--model", &model]);
    assert_eq!(code, 0, "{err}");
    assert!(
        text.contains("layer   0: replicas min 1 max 2; 0 experts with none"),
        "{text}"
    );
    // Who holds one slab, asked for by itself.
    let cov = ["coverage", "--bootstrap", &seeder.addr, "--model", &model];
    let (code, out, err) = moeswarm(&[&cov[..], &["--holders", "0:0", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let page: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(page["total"], 2, "{page}");
    let mut holders: Vec<&str> = page["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap())
        .collect();
    holders.sort();
    let mut both = vec![seeder.peer.as_str(), worker.peer.as_str()];
    both.sort();
    assert_eq!(holders, both);
    let (code, text, err) = moeswarm(&[&cov[..], &["--holders", "0:3"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(
        text.starts_with("layer 0 expert 3 of ") && text.contains("1 holders"),
        "{text}"
    );
    assert!(text.contains(&seeder.peer), "{text}");
    let (code, _, err) = moeswarm(&[&cov[..], &["--holders", "0-3"]].concat());
    assert_eq!(code, 2);
    assert!(err.contains("LAYER:EXPERT"), "{err}");
    let (code, _, err) = moeswarm(&[&cov[..], &["--holders", "7:0"]].concat());
    assert_eq!(code, 2);
    assert!(err.contains("no expert 0 in layer 7"), "{err}");

    // Bad input gets a named error.
    let (code, _, err) = moeswarm(&[
        "coverage",
        "--bootstrap",
        "/ip4/127.0.0.1/tcp/1",
        "--model",
        &model,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("/p2p/"), "{err}");
    let (code, _, err) = moeswarm(&[
        "fetch",
        "--bootstrap",
        &seeder.addr,
        "--model",
        "zz",
        "--store",
        w,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--model"), "{err}");
}

#[test]
fn generate_and_logits_with_swarm_experts_equal_the_local_run() {
    let dir = tempfile::tempdir().unwrap();
    let file = data("tiny-q8_0.gguf");
    let f = file.to_str().unwrap();
    let (s, model) = sliced_tiny(dir.path());
    let s = s.as_str();
    // The seeder serves its slabs on the data plane and runs the relay.
    let seeder = node(
        s,
        &[
            "--dispatch",
            "127.0.0.1:0",
            "--relay",
            "--relay-listen",
            "127.0.0.1:0",
        ],
    );
    let router_store = dir.path().join("router");
    let r = router_store.to_str().unwrap();
    let args = ["--prompt", "hello", "--max-tokens", "6", "--json"];
    let swarm = [
        "--swarm",
        "--bootstrap",
        &seeder.addr,
        "--store",
        r,
        "--model-id",
        &model,
    ];
    let (code, out, err) = moeswarm(&[&["generate"][..], &swarm, &args].concat());
    assert_eq!(code, 0, "{err}");
    let remote: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (code, out, err) = moeswarm(&[&["generate", "--model", f][..], &args].concat());
    assert_eq!(code, 0, "{err}");
    let local: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(remote["tokens"], local["tokens"]);
    assert_eq!(remote["tokens"].as_array().unwrap().len(), 6);

    // f16 on the wire: the same work in half the bytes (the rows are rounded, so the tokens
    // may differ; the number of outputs does not, with the same number of tokens).
    let (code, out, err) =
        moeswarm(&[&["generate"][..], &swarm, &args, &["--wire", "f16"]].concat());
    assert_eq!(code, 0, "{err}");
    let half: serde_json::Value = serde_json::from_str(&out).unwrap();
    let bytes = |v: &serde_json::Value, way: &str| v["dispatch"][way].as_u64().unwrap();
    assert_eq!(half["tokens"].as_array().unwrap().len(), 6);
    assert_eq!(remote["dispatch"]["retried"], 0);
    assert_eq!(half["dispatch"]["retried"], 0);
    assert!(bytes(&remote, "bytes_in") > 0);
    assert_eq!(
        2 * bytes(&half, "bytes_in"),
        bytes(&remote, "bytes_in"),
        "{half} vs {remote}"
    );
    // Rows out halve too; beside them travels the index of rows sent once for several experts
    // (4 bytes a row, and rounded rows may route, so repeat, differently).
    assert!(
        3 * bytes(&half, "bytes_out") < 2 * bytes(&remote, "bytes_out"),
        "{half} vs {remote}"
    );
    // A wire type that does not exist is refused before anything runs, naming the choices.
    let (code, _, err) =
        moeswarm(&[&["generate"][..], &swarm, &args, &["--wire", "garbage"]].concat());
    assert_eq!(code, 2);
    assert!(
        err.contains("garbage") && err.contains("f32, f16, bf16"),
        "{err}"
    );

    let (a, b) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
    let toks = ["--tokens", "5,17,200,3"];
    let (code, _, err) = moeswarm(
        &[
            &["logits"][..],
            &swarm,
            &toks,
            &["--out", a.to_str().unwrap()],
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = moeswarm(
        &[
            &["logits", "--model", f][..],
            &toks,
            &["--out", b.to_str().unwrap()],
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
}

/// `moeswarm sim ARGS --work-dir (a temporary folder) --json`, which must exit 0: its report.
fn sim_json(args: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let work = ["--work-dir", dir.path().to_str().unwrap(), "--json"];
    let (code, out, err) = moeswarm(&[&["sim"], args, &work].concat());
    assert_eq!(code, 0, "{out}{err}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn sim_reports_identical_output_and_exits_zero() {
    let tiny = data("tiny-f32.gguf");
    let r = sim_json(&["--model", tiny.to_str().unwrap(), "--max-tokens", "4"]);
    assert_eq!(r["tokens_identical"], true);
    assert_eq!(r["logits_bit_identical"], true);
    assert_eq!(r["workers"].as_array().unwrap().len(), 3);
    let (code, _, err) = moeswarm(&["sim", "--workers", "1"]);
    assert_eq!(code, 2);
    assert!(err.contains("at least 2 workers"), "{err}");
}

#[test]
fn sim_runs_the_trained_model_by_default_and_it_writes_words() {
    let r = sim_json(&["--max-tokens", "12"]);
    assert_eq!(r["tokens_identical"], true);
    // Words of the corpus, not token noise.
    let text = r["text"].as_str().unwrap();
    let (n_words, share) = corpus_word_share(text);
    assert!(n_words >= 3, "{text:?}");
    assert!(share >= 0.8, "{text:?}");
}

#[test]
fn a_worker_process_behind_the_relay_answers_a_router_process() {
    let dir = tempfile::tempdir().unwrap();
    let file = data("tiny-q8_0.gguf");
    let f = file.to_str().unwrap();
    let (s, model) = sliced_tiny(dir.path());
    let s = s.as_str();
    // The seeder relays but serves no dispatches itself.
    let seeder = node(s, &["--relay", "--relay-listen", "127.0.0.1:0"]);
    let relay = seeder.relay.clone().expect("the relay's address");
    // A worker that only dials out takes every slab and is reached through the relay.
    let w = dir.path().join("worker");
    let w = w.to_str().unwrap();
    let (code, _, err) = moeswarm(&[
        "fetch",
        "--bootstrap",
        &seeder.addr,
        "--model",
        &model,
        "--store",
        w,
    ]);
    assert_eq!(code, 0, "{err}");
    let _worker = node(w, &["--bootstrap", &seeder.addr, "--via-relay", &relay]);
    let r = dir.path().join("router");
    let r = r.to_str().unwrap();
    let args = ["--prompt", "relayed", "--max-tokens", "5", "--json"];
    let swarm = [
        "--swarm",
        "--bootstrap",
        &seeder.addr,
        "--store",
        r,
        "--model-id",
        &model,
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let remote = loop {
        let (code, out, err) = moeswarm(&[&["generate"][..], &swarm, &args].concat());
        if code == 0 {
            break serde_json::from_str::<serde_json::Value>(&out).unwrap();
        }
        // The worker's record may not have reached the seeder yet.
        assert!(std::time::Instant::now() < deadline, "{err}");
        std::thread::sleep(Duration::from_millis(300));
    };
    let (code, out, err) = moeswarm(&[&["generate", "--model", f][..], &args].concat());
    assert_eq!(code, 0, "{err}");
    let local: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(remote["tokens"], local["tokens"]);
}

#[test]
fn a_node_given_a_capacity_chooses_and_fetches_slabs_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let (s, model) = sliced_tiny(dir.path());
    let seeder = node(&s, &[]);
    let w = dir.path().join("auto");
    let auto = node(
        w.to_str().unwrap(),
        &[
            "--bootstrap",
            &seeder.addr,
            "--capacity",
            "60KiB",
            "--market-round-secs",
            "1",
            "--dispatch",
            "127.0.0.1:0",
        ],
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (code, out, err) = coverage_json(&seeder, &model);
        if code == 0 {
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            let me = &v["nodes"][&auto.peer];
            if me["slabs"].as_u64().unwrap_or(0) > 0 {
                // Some of the model, as much as 60 KiB holds, and the room left said.
                let (slabs, used, free) = (
                    me["slabs"].as_u64().unwrap(),
                    me["used_bytes"].as_u64().unwrap(),
                    me["free_bytes"].as_u64().unwrap(),
                );
                assert!(slabs < 16, "{out}");
                assert!(used <= 60 * 1024 && used + free == 60 * 1024, "{out}");
                assert_eq!(v["target"], 2);
                assert_eq!(v["layers"][0]["demand"].as_array().unwrap().len(), 8);
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the node never took slabs: {out}{err}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn a_lying_worker_process_is_caught_by_a_router_process_and_the_tokens_do_not_change() {
    let dir = tempfile::tempdir().unwrap();
    let file = data("tiny-q8_0.gguf");
    let f = file.to_str().unwrap();
    let (s, model) = sliced_tiny(dir.path());
    // The seeder serves every slab honestly; a second worker holds them all too, and lies in
    // every answer (one value off by 1e-3). The router holds no expert, so each check of the
    // liar's answers is referred to the honest worker, and the other way round.
    let seeder = node(&s, &["--dispatch", "127.0.0.1:0"]);
    let w = dir.path().join("liar");
    let w = w.to_str().unwrap();
    let (code, _, err) = moeswarm(&[
        "fetch",
        "--bootstrap",
        &seeder.addr,
        "--model",
        &model,
        "--store",
        w,
    ]);
    assert_eq!(code, 0, "{err}");
    let liar = node(
        w,
        &[
            "--bootstrap",
            &seeder.addr,
            "--dispatch",
            "127.0.0.1:0",
            "--misbehave",
            "wrong-values",
        ],
    );
    let r = dir.path().join("router");
    let r = r.to_str().unwrap();
    let args = ["--prompt", "a liar among us", "--max-tokens", "6", "--json"];
    let swarm = [
        "--swarm",
        "--bootstrap",
        &seeder.addr,
        "--store",
        r,
        "--model-id",
        &model,
    ];
    let (code, out, err) = moeswarm(&[&["generate", "--model", f][..], &args].concat());
    assert_eq!(code, 0, "{err}");
    let local: serde_json::Value = serde_json::from_str(&out).unwrap();
    // Until the liar's record reaches the seeder the router sees one worker only: run again
    // until the liar was given work. Every run's tokens are the local run's.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let caught = loop {
        let (code, out, err) = moeswarm(&[&["generate"][..], &swarm, &args].concat());
        assert_eq!(code, 0, "{err}");
        let remote: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(remote["tokens"], local["tokens"], "{remote}");
        let d = &remote["dispatch"];
        // The honest worker is never accused.
        assert!(d["quarantined"].get(&seeder.peer).is_none(), "{d}");
        assert_eq!(d["worker_checks"][&seeder.peer][1], 0, "{d}");
        if d["worker_checks"].get(&liar.peer).is_some() {
            break d.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the liar got no work: {d}"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(
        caught["worker_checks"][&liar.peer][1].as_u64().unwrap() >= 1,
        "{caught}"
    );
    assert!(caught["quarantined"].get(&liar.peer).is_some(), "{caught}");
    // With two replicas and no slab of its own, the router settled the dispute itself, from
    // a slab it fetched.
    assert!(caught["refereed"].as_u64().unwrap() >= 1, "{caught}");
    // A misbehaviour the worker does not know is refused when the node starts.
    let (code, _, err) = moeswarm(&["node", "--store", w, "--misbehave", "gossip"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("gossip"), "{err}");
}

#[test]
fn a_second_process_on_a_running_nodes_store_is_refused_and_the_node_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let (s, model) = sliced_tiny(dir.path());
    let running = node(&s, &[]);
    let holder = format!("pid {}", running.child.id());
    for args in [
        vec!["scrub", "--store", &s],
        vec![
            "generate",
            "--store",
            &s,
            "--model-id",
            &model,
            "--prompt",
            "x",
        ],
    ] {
        let (code, _, err) = moeswarm(&args);
        assert_ne!(code, 0, "{args:?}");
        assert!(
            err.contains("in use by another process") && err.contains(&holder),
            "{args:?}: {err}"
        );
    }
    let names: Vec<String> = std::fs::read_dir(&s)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with("index.unreadable")),
        "{names:?}"
    );
    // The running node still serves its blobs.
    let w = dir.path().join("w");
    let (code, _, err) = moeswarm(&[
        "fetch",
        "--bootstrap",
        &running.addr,
        "--model",
        &model,
        "--store",
        w.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_slabs_only_holder_is_checked_against_the_routers_own_fetch_never_passed_unchecked() {
    let dir = tempfile::tempdir().unwrap();
    let file = data("tiny-q8_0.gguf");
    let f = file.to_str().unwrap();
    let (s, model) = sliced_tiny(dir.path());
    let args = ["--prompt", "only one holder", "--max-tokens", "6", "--json"];
    let (code, out, err) = moeswarm(&[&["generate", "--model", f][..], &args].concat());
    assert_eq!(code, 0, "{err}");
    let local: serde_json::Value = serde_json::from_str(&out).unwrap();
    for (fault, name) in [(None, "honest"), (Some("wrong-values"), "liar")] {
        // The seeder is the only worker and holds every slab; the router holds none, so no
        // other replica can give an opinion: the router fetches what it checks.
        let mut extra = vec!["--dispatch", "127.0.0.1:0"];
        if let Some(f) = fault {
            extra.extend(["--misbehave", f]);
        }
        let seeder = node(&s, &extra);
        let r = dir.path().join(format!("router-{name}"));
        let swarm = [
            "--swarm",
            "--bootstrap",
            &seeder.addr,
            "--store",
            r.to_str().unwrap(),
            "--model-id",
            &model,
        ];
        let (code, out, err) = moeswarm(&[&["generate"][..], &swarm, &args].concat());
        if fault.is_none() {
            assert_eq!(code, 0, "{err}");
            let remote: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(remote["tokens"], local["tokens"], "{remote}");
            let d = &remote["dispatch"];
            assert!(
                d["worker_checks"][&seeder.peer][0].as_u64().unwrap() >= 1,
                "{d}"
            );
            assert_eq!(d["worker_checks"][&seeder.peer][1], 0, "{d}");
            // Every check compared something: none was waved through unverified.
            assert_eq!(d["unverified"], 0, "{d}");
            assert!(d["refereed"].as_u64().unwrap() >= 1, "{d}");
        } else {
            // Caught at its first check and quarantined; with no other holder, the
            // generation stops with an error rather than use a word it said.
            assert_eq!(code, 2, "{out}\n{err}");
            assert!(err.contains("answered layer 0 wrong: quarantined"), "{err}");
            assert!(err.contains("no replica answered"), "{err}");
            assert!(out.is_empty(), "{out}");
        }
    }
}
