//! Network namespaces this process made, and the `ip` commands that shape them.
//!
//! Every namespace is named `msl-<pid>-<name>`: [`sweep_leftovers`] removes those whose process
//! is gone (a run that was killed), and a [`Namespace`] deletes itself when dropped, so nothing
//! outlives the run that made it. Nothing here touches the machine's own namespace beyond
//! creating and deleting these.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::Command;

use crate::lab::LabError;

/// The prefix of every namespace a lab makes.
pub const PREFIX: &str = "msl-";

/// Why the lab cannot run here, if it cannot: it needs root and `ip`.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the network lab needs root (network namespaces, TUN devices)".into());
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => {}
        _ => return Some("the network lab needs `ip` (Debian's iproute2)".into()),
    }
    match Command::new("nft").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => return Some("the network lab needs `nft` (Debian's nftables)".into()),
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("the network lab needs /dev/net/tun".into());
    }
    // Root is not always enough (a container without CAP_SYS_ADMIN or CAP_NET_ADMIN): try.
    let tried = Namespace::create("probe").and_then(|ns| {
        super::link::probe_tun(&ns)?;
        Ok(())
    });
    tried
        .err()
        .map(|e| format!("the network lab cannot build here: {e}"))
}

/// Runs `ip args…` (in the machine's namespace), failing with its stderr.
pub fn ip(args: &[&str]) -> Result<(), LabError> {
    run("ip", args)
}

/// Runs `program args…`, failing with what it printed.
pub fn run(program: &str, args: &[&str]) -> Result<(), LabError> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| LabError::Command(format!("{program} {}: {e}", args.join(" "))))?;
    if !out.status.success() {
        return Err(LabError::Command(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Deletes this process's own lab namespaces (with every device and process-less socket in
/// them): what a process that is being stopped (Ctrl-C) does instead of unwinding.
pub fn remove_mine() {
    let mine = format!("{PREFIX}{}-", std::process::id());
    for name in lab_namespaces() {
        if name.starts_with(&mine) {
            let _ = ip(&["netns", "delete", &name]);
        }
    }
}

/// The lab namespaces that exist now, by name.
pub fn lab_namespaces() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(PREFIX))
        .map(str::to_string)
        .collect()
}

/// Deletes the lab namespaces whose process is no longer alive.
pub fn sweep_leftovers() {
    for name in lab_namespaces() {
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or_default();
        let alive = !pid.is_empty() && std::path::Path::new(&format!("/proc/{pid}")).exists();
        if !alive {
            let _ = ip(&["netns", "delete", &name]);
        }
    }
}

/// A network namespace of this process's lab, deleted (with every device in it) when dropped.
#[derive(Debug)]
pub struct Namespace {
    name: String,
}

impl Namespace {
    /// Makes `msl-<pid>-<n>-<short>` (`n` counts this process's namespaces) with its
    /// loopback up and IPv6 off (the lab's links carry IPv4; the kernel's own IPv6 chatter
    /// would only add packets to them).
    pub fn create(short: &str) -> Result<Self, LabError> {
        static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{PREFIX}{}-{n}-{short}", std::process::id());
        // `ip netns add` from processes started together can trip over each other while the
        // first of them sets up /run/netns: tried again a few times.
        let mut tries = 0;
        while let Err(e) = ip(&["netns", "add", &name]) {
            tries += 1;
            if tries == 5 {
                return Err(e);
            }
            let _ = ip(&["netns", "delete", &name]);
            std::thread::sleep(std::time::Duration::from_millis(50 * tries));
        }
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        // Best effort: a kernel without IPv6 has nothing to turn off.
        let _ = ns.exec(
            "sh",
            &[
                "-c",
                "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; \
                 echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6",
            ],
        );
        Ok(ns)
    }

    /// Its full name (for `ip netns exec`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip args…` inside it.
    pub fn ip(&self, args: &[&str]) -> Result<(), LabError> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Runs `program args…` inside it.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<(), LabError> {
        let mut all = vec!["netns", "exec", &self.name, program];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Runs `f` on a thread that has entered this namespace: sockets and devices it makes
    /// belong here (and keep belonging here after it returns).
    pub fn within<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, LabError> {
        let path = format!("/var/run/netns/{}", self.name);
        let file = File::open(&path).map_err(|e| LabError::Command(format!("{path}: {e}")))?;
        std::thread::spawn(move || {
            // SAFETY: a valid namespace fd; setns changes only this thread's namespace.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                return Err(LabError::Command(format!(
                    "entering the namespace: {}",
                    std::io::Error::last_os_error()
                )));
            }
            Ok(f())
        })
        .join()
        .map_err(|_| LabError::Command("a thread in the namespace panicked".into()))?
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = ip(&["netns", "delete", &self.name]);
    }
}
