//! The relay's registry: who is registered, and what each may use.
//!
//! Bounded: at most [`RelayLimits::max_registrations`] entries, and
//! [`RelayLimits::registrations_per_ip`] from one address; a new registration beyond the
//! first bound evicts the one idle longest of the address holding the most (its connection is
//! closed), so keys one host makes up evict each other first. A worker's relayed streams are
//! shared among callers (no caller holds more than its fair share of them), and every
//! registrant's forwarded bytes and the streams it opens draw on [`TokenBucket`]s that refill
//! at a steady rate, so one key, or a few, cannot hold a worker's streams or the relay's
//! bandwidth for long.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p_identity::PeerId;

use crate::relay::RelayLimits;

/// Tokens (bytes, or streams opened) that refill at `rate` per second up to `burst`; taking
/// more than is there is allowed, and says how long to wait before going on.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    level: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(rate: u64, burst: u64, now: Instant) -> Self {
        Self {
            rate: rate.max(1) as f64,
            burst: burst as f64,
            level: burst as f64,
            at: now,
        }
    }

    /// Takes `n` bytes at `now`; how long the taker should pause so that it stays within the
    /// rate.
    pub fn take(&mut self, n: u64, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now.max(self.at);
        self.level = (self.level + elapsed * self.rate).min(self.burst) - n as f64;
        if self.level >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.level / self.rate)
        }
    }

    /// Takes `n` at `now` if that many are there (and nothing otherwise).
    pub fn try_take(&mut self, n: u64, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now.max(self.at);
        self.level = (self.level + elapsed * self.rate).min(self.burst);
        let ok = self.level >= n as f64;
        if ok {
            self.level -= n as f64;
        }
        ok
    }
}

/// One registration.
pub struct Registration {
    /// The registrant's connection, on which streams to it are opened.
    pub conn: quinn::Connection,
    /// The address it registered from.
    ip: IpAddr,
    /// Streams spliced to it now, by caller.
    callers: HashMap<PeerId, usize>,
    /// Bytes it forwarded, as a caller or as a target.
    pub bytes: Arc<Mutex<TokenBucket>>,
    /// Streams it opened as a caller.
    opens: TokenBucket,
    last_used: Instant,
}

/// The registry, shared by the relay's tasks.
#[derive(Clone, Default)]
pub struct Registry {
    inner: Arc<Mutex<HashMap<PeerId, Registration>>>,
}

/// A spliced stream's hold on its target's stream slots; given back on drop.
pub struct StreamSlot {
    registry: Registry,
    target: PeerId,
    caller: PeerId,
}

/// Why a stream was not spliced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoSlot {
    /// The target holds its stream limit.
    TargetFull,
    /// This caller holds its share of the target's streams.
    CallerShare,
    /// The target is not registered.
    Unregistered,
    /// This caller opens streams faster than its budget allows.
    TooFast,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PeerId, Registration>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `peer` on `conn`, or says why not: its address holds
    /// `registrations_per_ip` already. When the registry is full, the entry idle longest among
    /// those of the address holding the most is evicted, so that keys made up by one host
    /// evict each other before anyone else.
    pub fn register(
        &self,
        peer: PeerId,
        conn: quinn::Connection,
        limits: &RelayLimits,
    ) -> Result<(), String> {
        let now = Instant::now();
        let ip = conn.remote_address().ip();
        let mut r = self.lock();
        if !r.contains_key(&peer) {
            let mut per_ip: HashMap<IpAddr, usize> = HashMap::new();
            for x in r.values() {
                *per_ip.entry(x.ip).or_default() += 1;
            }
            if per_ip.get(&ip).copied().unwrap_or(0) >= limits.registrations_per_ip.max(1) {
                return Err(format!(
                    "{ip} holds {} registrations already, the most one address may",
                    limits.registrations_per_ip
                ));
            }
            if r.len() >= limits.max_registrations.max(1) {
                let densest = per_ip
                    .iter()
                    .max_by_key(|(a, n)| (**n, **a))
                    .map(|(a, _)| *a);
                let idlest = r
                    .iter()
                    .filter(|(_, x)| Some(x.ip) == densest)
                    .min_by_key(|(_, x)| x.last_used)
                    .map(|(p, _)| *p);
                if let Some(gone) = idlest.and_then(|p| r.remove(&p)) {
                    gone.conn.close(3u32.into(), b"evicted");
                }
            }
        }
        r.insert(
            peer,
            Registration {
                conn,
                ip,
                callers: HashMap::new(),
                bytes: Arc::new(Mutex::new(TokenBucket::new(
                    limits.bytes_per_second,
                    limits.byte_burst,
                    now,
                ))),
                opens: TokenBucket::new(limits.streams_per_second, limits.stream_burst, now),
                last_used: now,
            },
        );
        Ok(())
    }

    /// Forgets `peer` if it is registered on the connection `stable_id`.
    pub fn remove_if_on(&self, peer: &PeerId, stable_id: usize) {
        let mut r = self.lock();
        if r.get(peer).is_some_and(|x| x.conn.stable_id() == stable_id) {
            r.remove(peer);
        }
    }

    /// Whether `peer` is registered.
    pub fn contains(&self, peer: &PeerId) -> bool {
        self.lock().contains_key(peer)
    }

    /// How many are registered.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The byte bucket of `peer`, if registered.
    pub fn bucket(&self, peer: &PeerId) -> Option<Arc<Mutex<TokenBucket>>> {
        self.lock().get(peer).map(|x| x.bytes.clone())
    }

    /// A stream slot on `target` for `caller`, with the target's connection. A caller may hold
    /// at most its fair share of a target's streams (`streams_per_worker` divided among the
    /// callers, counting itself; three quarters when alone, so the next caller finds room).
    pub fn slot(
        &self,
        caller: PeerId,
        target: PeerId,
        limits: &RelayLimits,
    ) -> Result<(StreamSlot, quinn::Connection), NoSlot> {
        let now = Instant::now();
        let mut r = self.lock();
        let me = r.get_mut(&caller).ok_or(NoSlot::Unregistered)?;
        if !me.opens.try_take(1, now) {
            return Err(NoSlot::TooFast);
        }
        let reg = r.get_mut(&target).ok_or(NoSlot::Unregistered)?;
        let held: usize = reg.callers.values().sum();
        if held >= limits.streams_per_worker {
            return Err(NoSlot::TargetFull);
        }
        let mine = reg.callers.get(&caller).copied().unwrap_or(0);
        let callers = reg.callers.len() + usize::from(mine == 0);
        let share = moeswarm_market::share::fair_share(limits.streams_per_worker as u64, callers);
        if mine as u64 >= share {
            return Err(NoSlot::CallerShare);
        }
        *reg.callers.entry(caller).or_default() += 1;
        reg.last_used = Instant::now();
        let conn = reg.conn.clone();
        if let Some(c) = r.get_mut(&caller) {
            c.last_used = Instant::now();
        }
        Ok((
            StreamSlot {
                registry: self.clone(),
                target,
                caller,
            },
            conn,
        ))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut r = self.registry.lock();
        if let Some(reg) = r.get_mut(&self.target) {
            if let Some(n) = reg.callers.get_mut(&self.caller) {
                *n -= 1;
                if *n == 0 {
                    reg.callers.remove(&self.caller);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_lets_a_burst_through_then_paces_to_its_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, 500, t0);
        assert_eq!(b.take(500, t0), Duration::ZERO);
        // Empty: 250 more bytes must wait a quarter second.
        let wait = b.take(250, t0);
        assert!((wait.as_secs_f64() - 0.25).abs() < 1e-9, "{wait:?}");
        // A second later it has refilled 1000, capped at the burst of 500 (less the debt).
        assert_eq!(b.take(100, t0 + Duration::from_secs(2)), Duration::ZERO);
    }

    #[test]
    fn trying_to_take_more_than_is_there_takes_nothing() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10, 3, t0);
        assert!((0..3).all(|_| b.try_take(1, t0)));
        // Empty: refused, and refusals run up no debt.
        assert!((0..100).all(|_| !b.try_take(1, t0)));
        assert!(b.try_take(1, t0 + Duration::from_millis(100)));
    }
}
