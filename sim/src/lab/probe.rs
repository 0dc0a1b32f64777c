//! Measuring a lab's links with its own UDP echo: round trips and losses between namespaces.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::netns::Namespace;
use super::LabError;

/// An echo server inside a namespace: sends every datagram back, or (a reflector) the
/// address it came from, as text; stops when dropped.
pub struct Echo {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Echo {
    /// Starts one in `ns` on `ip` (a free port).
    pub fn start(ns: &Namespace, ip: Ipv4Addr) -> Result<Self, LabError> {
        Self::serve(ns, ip, false)
    }

    /// Starts a reflector in `ns` on `ip`: what a NAT made of the sender's address.
    pub fn reflector(ns: &Namespace, ip: Ipv4Addr) -> Result<Self, LabError> {
        Self::serve(ns, ip, true)
    }

    fn serve(ns: &Namespace, ip: Ipv4Addr, reflect: bool) -> Result<Self, LabError> {
        let sock = ns.within(move || UdpSocket::bind((ip, 0)))?;
        let sock = sock.map_err(|e| LabError::Probe(format!("binding the echo: {e}")))?;
        let addr = sock
            .local_addr()
            .map_err(|e| LabError::Probe(e.to_string()))?;
        let _ = sock.set_read_timeout(Some(Duration::from_millis(50)));
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !s.load(Ordering::Relaxed) {
                if let Ok((n, from)) = sock.recv_from(&mut buf) {
                    let seen = from.to_string();
                    let answer = if reflect { seen.as_bytes() } else { &buf[..n] };
                    let _ = sock.send_to(answer, from);
                }
            }
        });
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What `count` probes found.
#[derive(Debug, Clone)]
pub struct RoundTrips {
    /// Each answered probe's round trip, in the order sent.
    pub times: Vec<Duration>,
    /// Probes sent.
    pub sent: usize,
}

impl RoundTrips {
    /// The median round trip.
    pub fn median(&self) -> Option<Duration> {
        let mut t = self.times.clone();
        t.sort();
        t.get(t.len() / 2).copied()
    }

    /// Share of probes without an answer.
    pub fn lost(&self) -> f64 {
        1.0 - self.times.len() as f64 / self.sent.max(1) as f64
    }
}

/// The address each of `reflectors` saw one UDP socket of `ns` (bound to `ip`) send from.
pub fn seen_from(
    ns: &Namespace,
    ip: Ipv4Addr,
    reflectors: &[SocketAddr],
) -> Result<Vec<SocketAddr>, LabError> {
    let to = reflectors.to_vec();
    ns.within(move || {
        let sock = UdpSocket::bind((ip, 0)).map_err(|e| LabError::Probe(e.to_string()))?;
        let _ = sock.set_read_timeout(Some(Duration::from_secs(2)));
        let mut buf = [0u8; 64];
        to.iter()
            .map(|r| {
                sock.send_to(b"?", r)
                    .map_err(|e| LabError::Probe(format!("sending to {r}: {e}")))?;
                let n = sock
                    .recv(&mut buf)
                    .map_err(|e| LabError::Probe(format!("no answer from {r}: {e}")))?;
                std::str::from_utf8(&buf[..n])
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| LabError::Probe(format!("{r} answered garbage")))
            })
            .collect()
    })?
}

/// Sends `count` probes from `ns` (from `ip`) to `echo` one after another, each waiting up
/// to `wait` for its answer.
pub fn round_trips(
    ns: &Namespace,
    ip: Ipv4Addr,
    echo: SocketAddr,
    count: usize,
    wait: Duration,
) -> Result<RoundTrips, LabError> {
    ns.within(move || {
        let sock = UdpSocket::bind((ip, 0)).map_err(|e| LabError::Probe(e.to_string()))?;
        let mut times = Vec::with_capacity(count);
        let mut buf = [0u8; 64];
        for i in 0..count as u64 {
            let sent = Instant::now();
            sock.send_to(&i.to_le_bytes(), echo)
                .map_err(|e| LabError::Probe(format!("sending to {echo}: {e}")))?;
            let end = sent + wait;
            // Answers to earlier probes that came late are skipped.
            loop {
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let _ = sock.set_read_timeout(Some(left));
                match sock.recv(&mut buf) {
                    Ok(8) if buf[..8] == i.to_le_bytes() => {
                        times.push(sent.elapsed());
                        break;
                    }
                    Ok(_) => continue,
                    Err(_) => break,
                }
            }
        }
        Ok(RoundTrips { times, sent: count })
    })?
}
