//! A link emulator in userspace: delay, jitter, loss and bandwidth between two namespaces.
//!
//! This kernel has no netem, so a link is a pair of TUN devices, one in each namespace, and two
//! threads per direction in this process: a reader takes each packet the sending side's kernel
//! routes into its TUN device, drops it with the link's loss probability or stamps its release
//! time (now + delay + a jitter drawn uniformly in ±jitter, and no earlier than the previous
//! packet's release plus this one's time on the wire at the link's rate), and a writer hands it
//! to the other namespace's kernel through the other TUN device at that time (sleeping, then
//! spinning the last 200 µs). Packets keep their order: jitter never reorders them (netem
//! would, when the jitter exceeds the gap between packets). What it cannot emulate: reordering,
//! duplication, corruption, a queue that overflows (the queue is unbounded up to
//! [`MAX_QUEUED`] packets, then it drops), and anything below IP (TUN devices carry IP
//! packets; the two ends are a point-to-point link with one address each).
//!
//! Loss and jitter come from a seeded generator: a run with the same seed and the same packets
//! drops the same ones.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use super::netns::Namespace;
use super::LabError;

/// Packets held in one direction at most; past it, arrivals are dropped (and counted).
pub const MAX_QUEUED: usize = 16_384;
/// Largest packet a TUN device hands over (its MTU is set to 1500).
const MAX_PACKET: usize = 65_536;
/// How long a thread waits for a packet before looking whether the link is stopping.
const POLL: Duration = Duration::from_millis(50);
/// A writer spins, instead of sleeping, for the last stretch before a release.
const SPIN: Duration = Duration::from_micros(200);

/// One direction of a link.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Deserialize, serde::Serialize)]
pub struct Shape {
    /// One-way delay.
    #[serde(default, with = "millis")]
    pub delay: Duration,
    /// Each packet's delay varies uniformly within ± this.
    #[serde(default, with = "millis")]
    pub jitter: Duration,
    /// Probability that a packet is lost, 0..1.
    #[serde(default)]
    pub loss: f64,
    /// Bytes a second on the wire; 0: unlimited.
    #[serde(default)]
    pub rate: u64,
}

mod millis {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1e3)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let ms = f64::deserialize(d)?;
        if !(0.0..=60_000.0).contains(&ms) {
            return Err(serde::de::Error::custom(format!(
                "{ms} ms is outside 0..=60000 ms"
            )));
        }
        Ok(Duration::from_secs_f64(ms / 1e3))
    }
}

impl Shape {
    /// Checks the numbers make sense.
    pub fn validate(&self) -> Result<(), LabError> {
        if !(0.0..=1.0).contains(&self.loss) {
            return Err(LabError::Scenario(format!(
                "loss {} is not a probability",
                self.loss
            )));
        }
        if self.jitter > self.delay {
            return Err(LabError::Scenario(format!(
                "jitter {:?} exceeds the delay {:?}",
                self.jitter, self.delay
            )));
        }
        Ok(())
    }
}

/// What one direction of a link did.
#[derive(Debug, Default)]
pub struct DirectionStats {
    /// Packets taken from the sending side.
    pub packets: AtomicU64,
    /// Of those, dropped as lost (or because the queue was full).
    pub dropped: AtomicU64,
    /// Bytes handed to the receiving side.
    pub bytes: AtomicU64,
}

/// A running emulated link; stopped (threads ended, devices gone with their namespaces or
/// closed) when dropped.
pub struct Link {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// `a → b` and `b → a`, as they are now (see [`Link::reshape`]).
    shapes: [Arc<Mutex<Shape>>; 2],
    /// `a → b` and `b → a`.
    pub stats: [Arc<DirectionStats>; 2],
}

/// One end of a link: a namespace, the TUN device's name there and its address.
pub struct End<'a> {
    /// The namespace.
    pub ns: &'a Namespace,
    /// The device's name (at most 15 bytes).
    pub device: String,
    /// Its IPv4 address; the other end's is its peer.
    pub addr: std::net::Ipv4Addr,
}

impl Link {
    /// Joins `a` and `b` by a point-to-point link shaped `ab` one way and `ba` the other.
    pub fn start(
        a: End<'_>,
        b: End<'_>,
        ab: Shape,
        ba: Shape,
        seed: u64,
    ) -> Result<Self, LabError> {
        ab.validate()?;
        ba.validate()?;
        let fa = Arc::new(tun_in(a.ns, &a.device)?);
        let fb = Arc::new(tun_in(b.ns, &b.device)?);
        for (end, peer) in [(&a, b.addr), (&b, a.addr)] {
            let (local, peer) = (end.addr.to_string(), peer.to_string());
            end.ns
                .ip(&["addr", "add", &local, "peer", &peer, "dev", &end.device])?;
            end.ns
                .ip(&["link", "set", &end.device, "mtu", "1500", "up"])?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stats = [Arc::default(), Arc::default()];
        let shapes = [Arc::new(Mutex::new(ab)), Arc::new(Mutex::new(ba))];
        let mut threads = Vec::new();
        for (i, (from, to, shape)) in [(&fa, &fb, &shapes[0]), (&fb, &fa, &shapes[1])]
            .into_iter()
            .enumerate()
        {
            let shape = shape.clone();
            let queue = Arc::new(Queue::default());
            let st: &Arc<DirectionStats> = &stats[i];
            let (from, q, s, st2) = (from.clone(), queue.clone(), stop.clone(), st.clone());
            let rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed.wrapping_add(i as u64));
            threads.push(std::thread::spawn(move || {
                read_side(&from, &q, shape, rng, &s, &st2)
            }));
            let (to, s, st2) = (to.clone(), stop.clone(), st.clone());
            threads.push(std::thread::spawn(move || {
                write_side(&to, &queue, &s, &st2)
            }));
        }
        Ok(Self {
            stop,
            threads,
            shapes,
            stats,
        })
    }

    /// Shapes the link `ab` one way and `ba` the other from the next packet on (packets
    /// already held keep their release times).
    pub fn reshape(&self, ab: Shape, ba: Shape) -> Result<(), LabError> {
        ab.validate()?;
        ba.validate()?;
        for (slot, shape) in self.shapes.iter().zip([ab, ba]) {
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = shape;
        }
        Ok(())
    }

    /// How it is shaped now: `a → b`, `b → a`.
    pub fn shapes(&self) -> [Shape; 2] {
        [0, 1].map(|i| *self.shapes[i].lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Packets waiting for their release time, in order.
#[derive(Default)]
struct Queue {
    packets: Mutex<VecDeque<(Instant, Vec<u8>)>>,
    ready: Condvar,
}

fn read_side(
    fd: &OwnedFd,
    q: &Queue,
    shape: Arc<Mutex<Shape>>,
    mut rng: rand_chacha::ChaCha8Rng,
    stop: &AtomicBool,
    stats: &DirectionStats,
) {
    let mut buf = vec![0u8; MAX_PACKET];
    let mut last_release = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let Some(n) = read_packet(fd, &mut buf) else {
            continue;
        };
        stats.packets.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let shape = *shape.lock().unwrap_or_else(|e| e.into_inner());
        if shape.loss > 0.0 && rng.random::<f64>() < shape.loss {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let mut delay = shape.delay;
        if !shape.jitter.is_zero() {
            let j = shape.jitter.as_secs_f64() * (2.0 * rng.random::<f64>() - 1.0);
            delay = Duration::from_secs_f64((delay.as_secs_f64() + j).max(0.0));
        }
        let wire = if shape.rate > 0 {
            Duration::from_secs_f64(n as f64 / shape.rate as f64)
        } else {
            Duration::ZERO
        };
        // In order, and one packet at a time on the wire.
        let release = (now + delay).max(last_release + wire);
        last_release = release;
        let mut held = q.packets.lock().unwrap_or_else(|e| e.into_inner());
        if held.len() >= MAX_QUEUED {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        held.push_back((release, buf[..n].to_vec()));
        q.ready.notify_one();
    }
}

fn write_side(fd: &OwnedFd, q: &Queue, stop: &AtomicBool, stats: &DirectionStats) {
    while !stop.load(Ordering::Relaxed) {
        let next = {
            let mut held = q.packets.lock().unwrap_or_else(|e| e.into_inner());
            if held.is_empty() {
                held = q
                    .ready
                    .wait_timeout(held, POLL)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
            held.front().map(|(t, _)| *t)
        };
        let Some(at) = next else {
            continue;
        };
        let now = Instant::now();
        if at > now + SPIN {
            std::thread::sleep((at - now - SPIN).min(POLL));
            continue;
        }
        while Instant::now() < at {
            std::hint::spin_loop();
        }
        let packet = q
            .packets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        if let Some((_, p)) = packet {
            // SAFETY: a valid TUN fd and a buffer of p.len() bytes.
            let wrote = unsafe { libc::write(fd.as_raw_fd(), p.as_ptr().cast(), p.len()) };
            if wrote > 0 {
                stats.bytes.fetch_add(wrote as u64, Ordering::Relaxed);
            }
        }
    }
}

/// One packet from `fd` into `buf`, or `None` after [`POLL`] without one.
fn read_packet(fd: &OwnedFd, buf: &mut [u8]) -> Option<usize> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut p, 1, POLL.as_millis() as i32) };
    if ready <= 0 {
        return None;
    }
    // SAFETY: a valid fd and a buffer of buf.len() bytes.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    (n > 0).then_some(n as usize)
}

/// Whether a TUN device can be made in `ns` (a short-lived one).
pub fn probe_tun(ns: &Namespace) -> Result<(), LabError> {
    tun_in(ns, "probe0").map(drop)
}

/// A TUN device named `device` made inside `ns` (IP packets, no extra header), its fd.
fn tun_in(ns: &Namespace, device: &str) -> Result<OwnedFd, LabError> {
    if device.is_empty() || device.len() > 15 {
        return Err(LabError::Scenario(format!(
            "device name {device:?} is not 1-15 bytes"
        )));
    }
    let name = device.to_string();
    ns.within(move || {
        // SAFETY: a NUL-terminated path.
        let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(LabError::Command(format!(
                "opening /dev/net/tun: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: fd was just opened and is owned here.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut req = IfReq {
            name: [0; 16],
            flags: IFF_TUN | IFF_NO_PI,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF with a valid ifreq.
        let rc = unsafe { libc::ioctl(owned.as_raw_fd(), TUNSETIFF, &mut req) };
        if rc < 0 {
            return Err(LabError::Command(format!(
                "making TUN device {name}: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(owned)
    })?
}

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}
