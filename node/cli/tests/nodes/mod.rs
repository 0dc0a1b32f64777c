//! `moeswarm node` processes for the tests that run swarms of them.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A `moeswarm node` child, killed when dropped.
pub struct NodeProcess {
    pub child: Child,
    pub addr: String,
    pub peer: String,
    pub http: Option<String>,
    pub relay: Option<String>,
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn node(store: &str, extra: &[&str]) -> NodeProcess {
    node_in(None, "127.0.0.1", store, extra)
}

/// A `moeswarm node` listening on `ip`, inside the network namespace `ns` when given.
pub fn node_in(ns: Option<&str>, ip: &str, store: &str, extra: &[&str]) -> NodeProcess {
    let bin = env!("CARGO_BIN_EXE_moeswarm");
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, bin]);
            c
        }
        None => Command::new(bin),
    };
    let listen = format!("/ip4/{ip}/tcp/0");
    let mut child = cmd
        .args(["node", "--store", store, "--listen", &listen])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut proc = NodeProcess {
        child,
        addr: String::new(),
        peer: String::new(),
        http: None,
        relay: None,
    };
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the node said it was ready in time");
        if let Some(a) = line.strip_prefix("listening on ") {
            proc.addr = a.to_string();
        }
        if let Some(p) = line.strip_prefix("peer id ") {
            proc.peer = p.to_string();
        }
        if let Some(h) = line.strip_prefix("http on http://") {
            proc.http = Some(h.to_string());
        }
        if let Some(r) = line.strip_prefix("data-plane relay on ") {
            proc.relay = Some(r.to_string());
        }
        if line == "ready" {
            return proc;
        }
    }
}

/// `GET path` from the HTTP server at `addr`, on a connection closed after it: the raw
/// answer (status line, headers, body).
pub fn http_get(addr: &str, path: &str) -> Vec<u8> {
    use std::io::{Read, Write};
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    write!(
        sock,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = Vec::new();
    sock.read_to_end(&mut answer).unwrap();
    answer
}

/// Slices the tiny Q8_0 model into `dir/seed` by the `slice` command: the store and model id.
pub fn sliced_tiny(dir: &std::path::Path) -> (String, String) {
    let store = dir.join("seed").to_str().unwrap().to_string();
    let file = moeswarm_testkit::data("tiny-q8_0.gguf");
    let (code, out, err) = moeswarm_testkit::run_program(
        env!("CARGO_BIN_EXE_moeswarm"),
        &["slice", file.to_str().unwrap(), "--store", &store, "--json"],
    );
    assert_eq!(code, 0, "{err}");
    let model = serde_json::from_str::<serde_json::Value>(&out).unwrap()["model_id"]
        .as_str()
        .unwrap()
        .to_string();
    (store, model)
}
