//! `moeswarm` processes inside the lab's namespaces (`ip netns exec`), and a plain HTTP/1.1
//! POST made from inside a namespace: what the lab's benchmark drives its swarm with. Every
//! process is killed when its handle is dropped (or when the thread that started it ends),
//! and every wait has a deadline.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::netns::Namespace;
use super::LabError;

/// How long a process may take to say it is ready.
const READY_DEADLINE: Duration = Duration::from_secs(120);

/// A `moeswarm` process that prints what it listens on and then `ready`; killed when dropped.
pub struct Proc {
    child: Child,
    /// The lines it printed before `ready`.
    pub said: Vec<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Starts `bin args…` in `ns` (or here), and waits for its `ready` line.
    pub fn start(bin: &Path, ns: Option<&Namespace>, args: &[&str]) -> Result<Self, LabError> {
        let mut child = command(bin, ns)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| LabError::Command(format!("starting {}: {e}", bin.display())))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut proc = Self {
            child,
            said: Vec::new(),
        };
        let until = Instant::now() + READY_DEADLINE;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).map_err(|_| {
                LabError::Command(format!(
                    "`moeswarm {}` did not say ready within {READY_DEADLINE:?} (it said {:?})",
                    args.join(" "),
                    proc.said
                ))
            })?;
            if line == "ready" {
                return Ok(proc);
            }
            proc.said.push(line);
        }
    }

    /// What follows `prefix` on the first line that starts with it.
    pub fn said(&self, prefix: &str) -> Option<&str> {
        self.said.iter().find_map(|l| l.strip_prefix(prefix))
    }
}

/// `bin` in `ns` (or here), killed if the thread that starts it ends first (this process
/// stopped by a signal included): nothing it starts outlives the lab.
fn command(bin: &Path, ns: Option<&Namespace>) -> Command {
    use std::os::unix::process::CommandExt;
    let mut c = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns.name()]).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    // SAFETY: prctl is async-signal-safe and touches only the child being made.
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    c
}

/// Runs `bin args…` in `ns` (or here) to its end: its stdout, or why it failed.
pub fn run(bin: &Path, ns: Option<&Namespace>, args: &[&str]) -> Result<String, LabError> {
    let out = command(bin, ns)
        .args(args)
        .output()
        .map_err(|e| LabError::Command(format!("running {}: {e}", bin.display())))?;
    if !out.status.success() {
        return Err(LabError::Command(format!(
            "`moeswarm {}`: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// POSTs `body` (JSON) to `http://addr/path` from inside `ns` (or here), on a connection
/// closed after it; the answer's body, or why there is none. At most `deadline`.
pub fn post_json(
    ns: Option<&Namespace>,
    addr: &str,
    path: &str,
    body: &serde_json::Value,
    deadline: Duration,
) -> Result<serde_json::Value, LabError> {
    let (addr, path, body) = (addr.to_string(), path.to_string(), body.to_string());
    let call = move || -> Result<serde_json::Value, String> {
        let sock_addr: std::net::SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
        let mut sock = std::net::TcpStream::connect_timeout(&sock_addr, deadline)
            .map_err(|e| format!("connecting to {addr}: {e}"))?;
        sock.set_read_timeout(Some(deadline))
            .map_err(|e| e.to_string())?;
        write!(
            sock,
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .map_err(|e| e.to_string())?;
        let mut answer = Vec::new();
        sock.take(64 << 20)
            .read_to_end(&mut answer)
            .map_err(|e| format!("reading the answer from {addr}: {e}"))?;
        let text = String::from_utf8_lossy(&answer);
        let (head, rest) = text.split_once("\r\n\r\n").ok_or("no HTTP answer")?;
        if !head.starts_with("HTTP/1.1 200") {
            return Err(format!("{}: {rest}", head.lines().next().unwrap_or("")));
        }
        serde_json::from_str(rest).map_err(|e| format!("the answer is not JSON: {e}"))
    };
    let answer = match ns {
        Some(ns) => ns.within(call)?,
        None => call(),
    };
    answer.map_err(LabError::Probe)
}

/// A work directory's path for `name`, as a string.
pub fn path_in(dir: &Path, name: &str) -> String {
    let p: PathBuf = dir.join(name);
    p.to_string_lossy().into_owned()
}
