//! Misbehaviour on purpose: nodes that lie to fetchers and workers that cheat routers, so that
//! the defences are tested against real peers. The options that switch them on exist only with
//! the `test-faults` feature: the tests' builds have it (and then `moeswarm node
//! --misbehave KIND[:RATE]` exists, for process-level tests); the `moeswarm` binary users build
//! has not, so its nodes are always honest.
#![cfg_attr(not(feature = "test-faults"), allow(dead_code))]

use std::time::Duration;

#[cfg(feature = "test-faults")]
static CLOCK_SKEW_SECS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// Sets how far off this process's clock reads, in seconds (tests of skewed clocks).
#[cfg(feature = "test-faults")]
pub fn set_clock_skew_secs(secs: i64) {
    CLOCK_SKEW_SECS.store(secs, std::sync::atomic::Ordering::Relaxed);
}

/// How far off this process's clock reads, in seconds: 0 without the `test-faults` feature.
#[inline]
pub fn clock_skew_secs() -> i64 {
    #[cfg(feature = "test-faults")]
    return CLOCK_SKEW_SECS.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(feature = "test-faults"))]
    0
}

/// How a node serves ranges. Anything but [`ServeFault::Honest`] exists to test fetchers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ServeFault {
    /// Serves the bytes it holds.
    #[default]
    Honest,
    /// Flips one byte in the last quarter of every range it sends.
    CorruptRanges,
    /// Sends only the first half of every range.
    TruncateRanges,
    /// Says every blob it holds is 1 TiB.
    HugeSizes,
    /// Flips a byte of every range it sends on its plain TCP lane (`net::bulk`), and serves
    /// honestly over libp2p: what a tamperer between two honest nodes would do.
    CorruptBulkLane,
}

impl ServeFault {
    /// The size a node serving as this says `real`-byte blobs have.
    #[cfg_attr(not(feature = "test-faults"), inline(always), allow(unused_mut))]
    pub fn claimed_size(self, real: u64) -> u64 {
        #[cfg(feature = "test-faults")]
        if self == ServeFault::HugeSizes {
            return 1 << 40;
        }
        real
    }

    /// How it serves on its plain TCP lane.
    pub fn on_bulk_lane(self) -> Self {
        match self {
            ServeFault::CorruptBulkLane => ServeFault::CorruptRanges,
            other => other,
        }
    }

    /// What it does to a range it is about to send.
    #[cfg_attr(not(feature = "test-faults"), allow(unused_variables))]
    pub fn tamper_range(self, payload: &mut Vec<u8>) {
        #[cfg(feature = "test-faults")]
        match self {
            ServeFault::Honest | ServeFault::HugeSizes | ServeFault::CorruptBulkLane => {}
            ServeFault::CorruptRanges => {
                let at = payload.len() * 3 / 4;
                if let Some(b) = payload.get_mut(at) {
                    *b ^= 0x5a;
                }
            }
            ServeFault::TruncateRanges => payload.truncate(payload.len() / 2),
        }
    }
}

/// How a worker answers. Anything but [`WorkerFault::Honest`] exists to test routers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WorkerFault {
    /// Answers what it is asked.
    #[default]
    Honest,
    /// Answers with another ticket.
    WrongTicket,
    /// Answers one row fewer for the first slab.
    WrongShape,
    /// Answers twice on the same stream.
    AnswerTwice,
    /// Answers only after this long.
    Stall(Duration),
    /// Computes this much slower (holding its place in the queue).
    SlowCompute(Duration),
    /// Adds 1e-3 to the first output value of the first slab in this many answers per
    /// thousand: a plausible, slightly wrong answer.
    WrongValues(u16),
    /// Answers NaN for the first output value in this many answers per thousand.
    Nan(u16),
    /// Every output value off by 1e-3 in every answer: wrong throughout, as wrong weights
    /// would be.
    WrongEverywhere,
    /// Answers right this many times (long enough to be proven), then one value off by 1e-3
    /// in every answer: a liar that waits.
    WrongAfter(u64),
    /// Accepts dispatch streams and never reads them.
    NeverRead,
    /// Sends the first half of its reply, then nothing more.
    Freeze,
}

impl WorkerFault {
    /// Whether answer number `n` (from 0) is one of the lies: spread evenly, `rate` in a
    /// thousand (so 200 lies in answers 4, 9, 14, …).
    pub fn lies_at(rate: u16, n: u64) -> bool {
        let r = rate.min(1000) as u64;
        (n + 1) * r / 1000 > n * r / 1000
    }

    /// Parses `KIND[:RATE]` as `--misbehave` takes it: `wrong-values`, `nan` (RATE a fraction,
    /// default 1), `wrong-everywhere`, `never-read`, `freeze`, `wrong-ticket`, `wrong-shape`, `answer-twice`,
    /// `stall:SECONDS`, `slow:SECONDS`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (kind, arg) = match s.split_once(':') {
            Some((k, a)) => (k, Some(a)),
            None => (s, None),
        };
        let fraction = || -> Result<u16, String> {
            match arg {
                None => Ok(1000),
                Some(a) => match a.parse::<f64>() {
                    Ok(f) if (0.0..=1.0).contains(&f) => Ok((f * 1000.0).round() as u16),
                    _ => Err(format!("rate {a:?} of {kind} is not a fraction in 0..=1")),
                },
            }
        };
        let secs = || -> Result<Duration, String> {
            arg.and_then(|a| a.parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| format!("{kind} needs a number of seconds, as {kind}:2"))
        };
        Ok(match kind {
            "honest" => Self::Honest,
            "wrong-values" => Self::WrongValues(fraction()?),
            "wrong-everywhere" => Self::WrongEverywhere,
            "nan" => Self::Nan(fraction()?),
            "never-read" => Self::NeverRead,
            "freeze" => Self::Freeze,
            "wrong-ticket" => Self::WrongTicket,
            "wrong-shape" => Self::WrongShape,
            "answer-twice" => Self::AnswerTwice,
            "stall" => Self::Stall(secs()?),
            "slow" => Self::SlowCompute(secs()?),
            _ => return Err(format!("unknown misbehaviour {kind:?}")),
        })
    }
}

/// What a lying worker does to an answer it is about to send: the serving code asks once,
/// and does it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyFault {
    /// Send it as it is.
    Send,
    /// Send it twice.
    SendTwice,
    /// Wait this long, then send it.
    StallThenSend(Duration),
    /// Send its first half, then nothing more.
    SendHalfThenFreeze,
}

/// The one place a worker's faults act on its serving. The worker calls each hook where it
/// applies; without the `test-faults` feature every hook is a no-op (the worker is honest,
/// whatever its options say), and with it a hook does what the [`WorkerFault`] says.
#[derive(Debug, Clone, Copy, Default)]
pub struct WorkerHooks {
    #[cfg(feature = "test-faults")]
    fault: WorkerFault,
}

impl WorkerHooks {
    /// The hooks of a worker that misbehaves as `fault` says (honest without `test-faults`).
    #[cfg_attr(not(feature = "test-faults"), allow(unused_variables))]
    pub fn new(fault: WorkerFault) -> Self {
        Self {
            #[cfg(feature = "test-faults")]
            fault,
        }
    }

    #[cfg(feature = "test-faults")]
    fn fault(&self) -> WorkerFault {
        self.fault
    }

    #[cfg(not(feature = "test-faults"))]
    #[inline(always)]
    fn fault(&self) -> WorkerFault {
        WorkerFault::Honest
    }

    /// Whether the worker answers as it should (always, without `test-faults`).
    pub fn honest(&self) -> bool {
        self.fault() == WorkerFault::Honest
    }

    /// Before a dispatch stream is read: a worker that never reads waits here for ever.
    pub async fn before_reading(&self) {
        if self.fault() == WorkerFault::NeverRead {
            std::future::pending::<()>().await;
        }
    }

    /// Time to spend computing on top of the work (holding the place in the queue).
    pub fn extra_compute(&self) -> Option<Duration> {
        match self.fault() {
            WorkerFault::SlowCompute(d) => Some(d),
            _ => None,
        }
    }

    /// Lies about the outputs of answer number `n`: plausible wrong values or NaN.
    pub fn tamper_outputs(&self, n: u64, out: &mut [Vec<f32>]) {
        if self.fault() == WorkerFault::WrongEverywhere {
            out.iter_mut().flatten().for_each(|v| *v += 1e-3);
            return;
        }
        match (self.fault(), out.iter_mut().flatten().next()) {
            (WorkerFault::WrongValues(rate), Some(v)) if WorkerFault::lies_at(rate, n) => {
                *v += 1e-3
            }
            (WorkerFault::Nan(rate), Some(v)) if WorkerFault::lies_at(rate, n) => *v = f32::NAN,
            (WorkerFault::WrongAfter(honest), Some(v)) if n >= honest => *v += 1e-3,
            _ => {}
        }
    }

    /// Lies about an answer's header and bytes (`row_bytes` a row's bytes on the wire), and
    /// says how to send it.
    pub fn tamper_reply(
        &self,
        header: &mut moeswarm_protocol::DispatchReply,
        bytes: &mut Vec<u8>,
        row_bytes: usize,
    ) -> ReplyFault {
        match self.fault() {
            WorkerFault::WrongTicket => header.ticket.seq = header.ticket.seq.wrapping_add(1),
            WorkerFault::WrongShape => {
                if header.slabs[0].rows > 1 {
                    header.slabs[0].rows -= 1;
                    bytes.truncate(bytes.len() - row_bytes);
                } else {
                    header.n_embd += 1;
                    bytes.extend(std::iter::repeat_n(
                        0u8,
                        4 * header.slabs.iter().map(|s| s.rows as usize).sum::<usize>(),
                    ));
                }
            }
            WorkerFault::AnswerTwice => return ReplyFault::SendTwice,
            WorkerFault::Stall(d) => return ReplyFault::StallThenSend(d),
            WorkerFault::Freeze => return ReplyFault::SendHalfThenFreeze,
            WorkerFault::SlowCompute(_)
            | WorkerFault::Honest
            | WorkerFault::WrongValues(_)
            | WorkerFault::Nan(_)
            | WorkerFault::WrongEverywhere
            | WorkerFault::WrongAfter(_)
            | WorkerFault::NeverRead => {}
        }
        ReplyFault::Send
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lies_come_at_the_rate_spread_evenly() {
        let at = |r| {
            (0..20)
                .filter(|&n| WorkerFault::lies_at(r, n))
                .collect::<Vec<_>>()
        };
        assert_eq!(at(200), vec![4, 9, 14, 19]);
        assert_eq!(at(1000), (0..20).collect::<Vec<_>>());
        assert!(at(0).is_empty());
    }

    #[test]
    fn misbehaviours_parse_as_the_option_spells_them() {
        assert_eq!(WorkerFault::parse("nan"), Ok(WorkerFault::Nan(1000)));
        assert_eq!(
            WorkerFault::parse("wrong-everywhere"),
            Ok(WorkerFault::WrongEverywhere)
        );
        assert_eq!(
            WorkerFault::parse("wrong-values:0.2"),
            Ok(WorkerFault::WrongValues(200))
        );
        assert_eq!(
            WorkerFault::parse("stall:1.5"),
            Ok(WorkerFault::Stall(Duration::from_millis(1500)))
        );
        assert!(WorkerFault::parse("nan:2").is_err());
        assert!(WorkerFault::parse("stall").is_err());
        assert!(WorkerFault::parse("lie").unwrap_err().contains("lie"));
    }
}
