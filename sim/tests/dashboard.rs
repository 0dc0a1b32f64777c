//! The dashboard of a local swarm's router: its data endpoint read directly, and its page in a
//! real headless Chromium driven over WebDriver (chromedriver), checked against
//! `coverage`'s report (the same function `moeswarm coverage --json` prints) and against the
//! pixels of a screenshot.
//!
//! Needs `chromium` and `chromedriver` on the PATH (Debian's `chromium` and `chromium-driver`
//! packages; `.ci/run` installs them), or `MOESWARM_CHROMIUM` / `MOESWARM_CHROMEDRIVER`.

use moeswarm_testkit as common;

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::data;
use fantoccini::{Client, ClientBuilder};
use moeswarm_node::api::batcher::BatchOptions;
use moeswarm_node::api::Server;
use moeswarm_node::ops::{coverage, CoverageReport};
use moeswarm_node::RunningNode;
use moeswarm_protocol::ModelId;
use moeswarm_sim::local::{start_local_swarm, SimOptions};
use serde_json::{json, Value};

/// A local swarm (router + relay, 3 workers, one through the relay) served through the API.
struct Served {
    server: Server,
    workers: Vec<RunningNode>,
    bootstrap: libp2p::Multiaddr,
    model: ModelId,
    router: String,
    relay: String,
    _dir: tempfile::TempDir,
}

/// The dashboard's peers: the router and the three workers, the first worker through the
/// relay, each with what it holds and how the router reaches it.
fn peers_are_as_the_router_sees_them(s: &Served, d: &Value, want: &Value) {
    let peers = d["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 4, "{peers:#?}");
    let by_id = |id: &str| peers.iter().find(|p| p["id"] == id).unwrap();
    let me = by_id(&s.router);
    assert_eq!(me["is_self"], true);
    assert_eq!(me["relay"], Value::Null);
    for (i, w) in s.workers.iter().enumerate() {
        let p = by_id(&w.handle.peer_id.to_string());
        assert_eq!(p["is_self"], false);
        assert_eq!(p["connected"], true);
        let want_relay = if i == 0 {
            Value::from(s.relay.as_str())
        } else {
            Value::Null
        };
        assert_eq!(p["relay"], want_relay, "worker {i}");
        // How the router reaches it, and why: the sim's relayed worker is not hole punched.
        let path = p["path"].as_str().unwrap_or_default();
        let want_path = if i == 0 {
            "relay "
        } else {
            "direct 127.0.0.1:"
        };
        assert!(path.starts_with(want_path), "worker {i}: {path}");
        let held = want["nodes"][w.handle.peer_id.to_string()]["slabs"].clone();
        assert_eq!(p["slabs"], held);
        assert!(p["used_bytes"].as_u64().unwrap() > 0);
        assert_eq!(p["quarantined"], false);
    }
    let timed = peers
        .iter()
        .filter(|p| p["latency_p50_ms"].as_f64().is_some_and(|v| v > 0.0))
        .count();
    assert!(
        timed >= 1,
        "some worker was dispatched to and timed: {peers:#?}"
    );
}

async fn served() -> Served {
    let dir = tempfile::tempdir().unwrap();
    let mut o = SimOptions::new(dir.path().to_path_buf());
    o.model = Some(data("small-q4_k.gguf"));
    let swarm = start_local_swarm(&o).await.unwrap();
    let bootstrap = swarm.router.addrs().await.unwrap()[0].clone();
    let model = swarm.manifest.id();
    let router = swarm.router.handle.peer_id.to_string();
    let relay = swarm.router.relay.as_ref().unwrap().peer_id().to_string();
    let (server, workers) = swarm
        .serve(
            "small".into(),
            BatchOptions::default(),
            "127.0.0.1:0".parse().unwrap(),
        )
        .await
        .unwrap();
    Served {
        server,
        workers,
        bootstrap,
        model,
        router,
        relay,
        _dir: dir,
    }
}

impl Served {
    async fn shutdown(self) {
        self.server.shutdown().await;
        for w in self.workers {
            w.shutdown().await;
        }
    }

    /// Generates through the API; the tokens it says it made.
    async fn complete(&self, http: &reqwest::Client) -> u64 {
        let r = post_json(
            http,
            &format!("http://{}/v1/completions", self.server.addr),
            json!({"model": "small", "prompt": "The swarm", "max_tokens": 6, "temperature": 0}),
        )
        .await;
        r["usage"]["completion_tokens"].as_u64().unwrap()
    }

    /// `moeswarm coverage --json`'s report, as a fresh node joining through the router sees it.
    async fn coverage(&self) -> Value {
        let r: CoverageReport = coverage(vec![self.bootstrap.clone()], self.model)
            .await
            .unwrap();
        serde_json::to_value(r).unwrap()
    }

    /// The holders of `(layer, expert)` as `coverage --holders` gives them (first page).
    async fn holders(&self, layer: u32, expert: u32) -> Vec<String> {
        let p = moeswarm_node::ops::holders(
            vec![self.bootstrap.clone()],
            self.model,
            (layer, expert),
            0,
        )
        .await
        .unwrap();
        p.holders
    }
}

fn replicas(model: &Value) -> Vec<Vec<u64>> {
    model["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            l["replicas"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r.as_u64().unwrap())
                .collect()
        })
        .collect()
}

/// POSTs `body` as JSON to `url`; the JSON answer.
async fn post_json(http: &reqwest::Client, url: &str, body: Value) -> Value {
    http.post(url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_endpoint_gives_the_routers_coverage_peers_and_throughput() {
    let s = served().await;
    let http = http_client();
    let tokens = s.complete(&http).await;
    assert!(tokens > 0);
    let want = s.coverage().await;
    let base = format!("http://{}", s.server.addr);

    let r = http
        .get(format!("{base}/api/dashboard"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let d: Value = r.json().await.unwrap();
    assert_eq!(d["node"], s.router.as_str());
    assert!(d["updated_unix_ms"].as_u64().unwrap() > 1_700_000_000_000);

    // Coverage: the one model, exactly as `coverage --json` reports it.
    let models = d["models"].as_array().unwrap();
    assert_eq!(models.len(), 1);
    let m = &models[0];
    assert_eq!(m["model"], s.model.to_string());
    assert_eq!(replicas(m), replicas(&want));
    assert_eq!(m["target"], want["target"]);
    let n = replicas(&want).iter().map(|l| l.len()).sum::<usize>() as u64;
    assert_eq!(m["slabs"].as_u64(), Some(n));
    assert_eq!(m["covered"].as_u64(), Some(n));
    assert_eq!(m["at_target"].as_u64(), Some(n));
    assert_eq!(d["health"], format!("all {n} slabs covered ≥ 2×"));
    // Counts only: who holds a slab is asked for one slab at a time, and the pages say as many
    // holders as the counts, and the same ones `coverage --holders` names.
    assert!(m["layers"][0].get("holders").is_none(), "{m}");
    for (l, row) in replicas(&want).iter().enumerate() {
        for (e, &n) in row.iter().enumerate() {
            let p: Value = http
                .get(format!("{base}/api/holders/{}/{l}/{e}/0", s.model))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(p["total"].as_u64(), Some(n), "layer {l} expert {e}: {p}");
            if (l, e) == (0, 0) {
                let mut got: Vec<String> = p["holders"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_str().unwrap().to_string())
                    .collect();
                let mut exp = s.holders(0, 0).await;
                got.sort();
                exp.sort();
                assert_eq!(got, exp, "holders of layer 0 expert 0");
            }
        }
    }
    let r = http
        .get(format!("{base}/api/holders/{}/99/0/0", s.model))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    peers_are_as_the_router_sees_them(&s, &d, &want);

    // Throughput: the tokens generated, counted as `/metrics` counts them.
    let t = &d["throughput"];
    assert_eq!(t["model"], "small");
    assert_eq!(t["tokens_generated"].as_u64(), Some(tokens));
    assert_eq!(t["sequences_active"].as_u64(), Some(0));
    // One request, so one first token.
    assert_eq!(t["time_to_first_token"]["count"].as_u64(), Some(1));
    assert!(t["time_to_first_token"]["mean_s"].as_f64().unwrap() > 0.0);
    assert!(t["dispatches_sent"].as_u64().unwrap() > 0);
    assert!(t["tokens_per_second"].as_f64().unwrap() >= 0.0);
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(&format!("moeswarm_tokens_generated_total {tokens}\n")),
        "{metrics}"
    );

    // The page itself.
    let r = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/html; charset=utf-8");
    let page = r.text().await.unwrap();
    assert!(page.contains("<canvas id=\"heatmap\""));
    assert!(page.contains("api/dashboard"));
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "nothing from elsewhere"
    );
    s.shutdown().await;
}

/// A program from the environment or the PATH.
fn program(var: &str, names: &[&str]) -> String {
    if let Ok(p) = std::env::var(var) {
        return p;
    }
    for n in names {
        let found = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {n}"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        if let Some(p) = found.filter(|p| !p.is_empty()) {
            return p;
        }
    }
    panic!(
        "none of {names:?} is on the PATH: install Debian's chromium and chromium-driver \
         packages (.ci/run does), or set {var}"
    );
}

/// chromedriver on a free port of 127.0.0.1, ended when dropped.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    /// Ends chromedriver and the browser it started (its own process group), also when a
    /// test failed before closing the session.
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_driver() -> Driver {
    let exe = program("MOESWARM_CHROMEDRIVER", &["chromedriver"]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(exe)
        .process_group(0)
        .arg(format!("--port={port}"))
        .arg("--allowed-ips=127.0.0.1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting chromedriver");
    let d = Driver {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    let http = http_client();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = http.get(format!("{}/status", d.url)).send().await;
        if let Ok(r) = ready {
            let v: Value = r.json().await.unwrap_or_default();
            if v["value"]["ready"] == true {
                return d;
            }
        }
        assert!(Instant::now() < deadline, "chromedriver not ready in 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn browser(driver: &Driver, profile: &std::path::Path) -> Client {
    let chromium = program("MOESWARM_CHROMIUM", &["chromium", "chromium-browser"]);
    let caps = json!({
        "browserName": "chrome",
        "goog:chromeOptions": {
            "binary": chromium,
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", "--force-device-scale-factor=1",
                "--window-size=1280,1000", format!("--user-data-dir={}", profile.display()),
            ],
        },
        "goog:loggingPrefs": { "browser": "ALL" },
    });
    let Value::Object(caps) = caps else {
        unreachable!()
    };
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("a Chromium session")
}

/// Runs `script` in the page until it gives something `ok` accepts, or panics after `within`.
async fn wait_for(
    c: &Client,
    script: &str,
    within: Duration,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let v = c.execute(script, Vec::new()).await.unwrap();
        if ok(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "`{script}` still gives {v} after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The page's data once its replica counts are those of `coverage`'s report (asked again
/// while they differ: the router and a fresh node may see the last records a moment apart).
async fn page_matches_coverage(c: &Client, s: &Served, within: Duration) -> (Value, Value) {
    let deadline = Instant::now() + within;
    loop {
        let want = s.coverage().await;
        let seen = c
            .execute("return window.moeswarmDashboard.data", Vec::new())
            .await
            .unwrap();
        if seen["models"][0].is_object() && replicas(&seen["models"][0]) == replicas(&want) {
            return (seen, want);
        }
        assert!(
            Instant::now() < deadline,
            "the page shows {:?}, coverage says {:?}",
            seen["models"][0]["layers"],
            replicas(&want)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The colour the page promises for `replicas` against `target` (docs/user-guide.md).
fn colour(replicas: u64, target: u64) -> [u8; 3] {
    match replicas {
        0 => [0xd7, 0x19, 0x1c],
        r if r < target => [0xfd, 0xae, 0x61],
        r if r == target => [0xa6, 0xd9, 0x6a],
        _ => [0x1a, 0x96, 0x41],
    }
}

/// Takes a screenshot, saves it as `name` among the test's artifacts, and checks the centre
/// pixel of every heatmap cell has the colour of its replica count; returns the counts of
/// cells seen in each colour.
async fn check_heatmap_pixels(c: &Client, want: &[Vec<u64>], target: u64, name: &str) -> usize {
    let geo = c
        .execute(
            "const r = document.getElementById('heatmap').getBoundingClientRect();
             window.scrollTo(0, 0);
             return Object.assign({left: r.left, top: r.top, ratio: window.devicePixelRatio},
                                  window.moeswarmDashboard.geometry);",
            Vec::new(),
        )
        .await
        .unwrap();
    let png = c.screenshot().await.unwrap();
    let artifact = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&artifact, &png).unwrap();
    eprintln!("screenshot: {}", artifact.display());
    let decoder = png::Decoder::new(std::io::Cursor::new(png));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        other => panic!("screenshot in {other:?}"),
    };
    let f = |k: &str| geo[k].as_f64().unwrap();
    let (left, top, ratio) = (f("left"), f("top"), f("ratio"));
    let (cw, ch, gap) = (f("cw"), f("ch"), f("gap"));
    assert_eq!(geo["layers"].as_u64(), Some(want.len() as u64));
    let mut colours = std::collections::BTreeSet::new();
    for (l, row) in want.iter().enumerate() {
        assert_eq!(geo["experts"].as_u64(), Some(row.len() as u64));
        for (e, &r) in row.iter().enumerate() {
            let x = ((left + e as f64 * (cw + gap) + cw / 2.0) * ratio) as usize;
            let y = ((top + l as f64 * (ch + gap) + ch / 2.0) * ratio) as usize;
            assert!(
                x < info.width as usize && y < info.height as usize,
                "cell off screen"
            );
            let at = (y * info.width as usize + x) * channels;
            let got = [buf[at], buf[at + 1], buf[at + 2]];
            let exp = colour(r, target);
            let close = got.iter().zip(exp).all(|(a, b)| a.abs_diff(b) <= 6);
            assert!(
                close,
                "layer {l} expert {e} ({r} replicas): pixel {got:?}, want {exp:?} ({})",
                artifact.display()
            );
            colours.insert(exp);
        }
    }
    colours.len()
}

/// Severe entries of the browser's console log (chromedriver's log endpoint).
async fn console_errors(c: &Client, driver: &Driver) -> Vec<Value> {
    let session = c.session_id().await.unwrap().unwrap();
    let r = post_json(
        &http_client(),
        &format!("{}/session/{session}/se/log", driver.url),
        json!({"type": "browser"}),
    )
    .await;
    let entries = r["value"]
        .as_array()
        .unwrap_or_else(|| panic!("no browser log: {r}"));
    entries
        .iter()
        .filter(|e| e["level"] == "SEVERE")
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_in_chromium_shows_the_coverage_and_follows_workers_leaving_and_crashing() {
    let mut s = served().await;
    let http = http_client();
    let tokens = s.complete(&http).await;
    let driver = start_driver().await;
    let profile = tempfile::tempdir().unwrap();
    let c = browser(&driver, profile.path()).await;
    let url = format!("http://{}/", s.server.addr);
    c.goto(&url).await.unwrap();
    wait_for(
        &c,
        "return window.moeswarmDashboard.updates",
        Duration::from_secs(30),
        |v| v.as_u64().is_some_and(|n| n > 0),
    )
    .await;

    // The heatmap's data and its pixels are `coverage --json`'s replica counts.
    let (seen, want) = page_matches_coverage(&c, &s, Duration::from_secs(30)).await;
    let target = want["target"].as_u64().unwrap();
    check_heatmap_pixels(&c, &replicas(&want), target, "dashboard.png").await;
    let health = c
        .execute(
            "return document.getElementById('health').textContent",
            Vec::new(),
        )
        .await
        .unwrap();
    assert_eq!(health, seen["health"]);
    assert!(health.as_str().unwrap().starts_with("all "), "{health}");
    // One row per peer; the throughput shows the tokens generated.
    let rows = c
        .execute(
            "return document.querySelectorAll('#peer-rows tr[data-peer]').length",
            Vec::new(),
        )
        .await
        .unwrap();
    assert_eq!(rows.as_u64(), Some(1 + s.workers.len() as u64));
    let shown = c
        .execute(
            "return document.querySelector('[data-stat=\"tokens generated\"] b').textContent",
            Vec::new(),
        )
        .await
        .unwrap();
    assert_eq!(shown, tokens.to_string());
    // Clicking a cell lists its holders.
    let holders = c
        .execute(
            "const r = document.getElementById('heatmap').getBoundingClientRect();
             const g = window.moeswarmDashboard.geometry;
             document.getElementById('heatmap').dispatchEvent(new MouseEvent('click',
                 {clientX: r.left + g.cw / 2, clientY: r.top + g.ch / 2, bubbles: true}));
             return document.getElementById('holders').textContent",
            Vec::new(),
        )
        .await
        .unwrap();
    let want_holders = s.holders(0, 0).await;
    assert!(!want_holders.is_empty());
    for h in &want_holders {
        let shown = wait_for(
            &c,
            "return document.getElementById('holders').textContent",
            Duration::from_secs(10),
            |v| v.as_str().is_some_and(|t| !t.contains("asking")),
        )
        .await;
        assert!(shown.as_str().unwrap().contains(h.as_str()), "{shown}");
    }
    let _ = holders;

    // A worker leaves: within a few seconds the page counts its slabs no more.
    let w = s.workers.remove(1);
    let gone = w.handle.peer_id.to_string();
    let before: u64 = replicas(&want).iter().flatten().sum();
    let held = want["nodes"][&gone]["slabs"].as_u64().unwrap();
    assert!(held > 0);
    let t0 = Instant::now();
    w.shutdown().await;
    let script = "const d = window.moeswarmDashboard.data;
                  return d.models[0].layers.reduce((n, l) => n + l.replicas.reduce((a, b) => a + b, 0), 0)";
    wait_for(&c, script, Duration::from_secs(10), |v| {
        v.as_u64() == Some(before - held)
    })
    .await;
    eprintln!("the page followed the worker leaving in {:?}", t0.elapsed());
    let (seen, want) = page_matches_coverage(&c, &s, Duration::from_secs(30)).await;
    let peer = seen["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == gone.as_str());
    assert!(peer.is_none_or(|p| p["slabs"] == 0), "{peer:?}");
    // Now some slabs are at the target only: two colours on the map.
    let colours =
        check_heatmap_pixels(&c, &replicas(&want), target, "dashboard-after-leave.png").await;
    assert!(colours >= 2, "cells at and above the target");

    // Another crashes: its record lives on until it expires, but within a few seconds its
    // row says this node has lost it.
    let w = s.workers.remove(0);
    let crashed = w.handle.peer_id.to_string();
    w.crash().await;
    let link = format!(
        "const r = document.querySelector('#peer-rows tr[data-peer=\"{crashed}\"] td:nth-child(2)');
         return r ? r.textContent : null"
    );
    wait_for(&c, &link, Duration::from_secs(10), |v| v == "not connected").await;

    let errors = console_errors(&c, &driver).await;
    assert!(errors.is_empty(), "console errors: {errors:#?}");
    let page_errors = c
        .execute("return window.dashboardErrors", Vec::new())
        .await
        .unwrap();
    assert_eq!(page_errors, json!([]));
    c.close().await.unwrap();
    drop(driver);
    s.shutdown().await;
}
