//! Trust in workers' answers: how often the router re-computes a worker's answer to check it,
//! and what a failed check costs the worker.
//!
//! The engine gives the same bits on every CPU, so a check is exact: the router computes the
//! same rows itself (when it holds the slab) or asks a second replica, and compares bit for
//! bit. A worker starts on probation (every answer checked until it has passed
//! [`CheckPolicy::probation`] checks), then is checked at [`CheckPolicy::rate`]; one failed
//! check quarantines it for [`CheckPolicy::ban_ms`], doubled for each further failure, and
//! afterwards it is checked at [`CheckPolicy::suspect_rate`] for good (every answer by
//! default: the scale simulator found that at half, a liar back from quarantine got every other
//! lie through to users). A rate of 0 switches
//! checking off entirely (a benchmark's baseline). Time comes in as milliseconds on any clock
//! the caller keeps; randomness as a uniform `u64` draw.
//!
//! A checked dispatch of many experts is checked on a sample of them ([`sample`]): what that
//! catches is stated there, with [`sample::catch_chance`].

pub mod sample;

/// How the router checks answers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CheckPolicy {
    /// Fraction of a proven worker's dispatches re-computed (0 = no checks at all).
    pub rate: f64,
    /// Checks a worker must pass before it is checked at `rate`.
    pub probation: u64,
    /// Fraction checked while on probation.
    pub probation_rate: f64,
    /// Fraction checked of a worker that ever failed a check.
    pub suspect_rate: f64,
    /// How long the first quarantine lasts, in ms (doubled for each further failure).
    pub ban_ms: u64,
    /// Expert groups of a checked dispatch re-computed: a uniform sample of this many, drawn
    /// after it is sent ([`sample`]); a dispatch with no more is checked whole (0: always
    /// whole).
    pub groups: u32,
}

impl Default for CheckPolicy {
    fn default() -> Self {
        Self {
            rate: 0.03,
            probation: 16,
            probation_rate: 1.0,
            suspect_rate: 1.0,
            ban_ms: 10 * 60 * 1000,
            groups: 8,
        }
    }
}

impl CheckPolicy {
    /// Every answer checked, always (tests, and anyone who wants certainty over speed).
    pub fn always() -> Self {
        Self {
            rate: 1.0,
            ..Self::default()
        }
    }

    /// No checks at all.
    pub fn never() -> Self {
        Self {
            rate: 0.0,
            ..Self::default()
        }
    }
}

/// A worker's check record, as one router has seen it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckRecord {
    /// Checks passed.
    pub passed: u64,
    /// Checks failed.
    pub failed: u64,
    /// Quarantined until this time (ms), if ever.
    pub banned_until: Option<u64>,
}

impl CheckRecord {
    /// Whether the worker may not be sent anything at `now_ms`.
    pub fn quarantined(&self, now_ms: u64) -> bool {
        self.banned_until.is_some_and(|t| now_ms < t)
    }

    /// Whether it has passed probation and never failed.
    pub fn proven(&self, policy: &CheckPolicy) -> bool {
        self.failed == 0 && self.passed >= policy.probation
    }

    /// The fraction of its answers to check.
    pub fn check_rate(&self, policy: &CheckPolicy) -> f64 {
        let rate = policy.rate.clamp(0.0, 1.0);
        if rate == 0.0 {
            return 0.0;
        }
        let floor = if self.failed > 0 {
            policy.suspect_rate
        } else if self.passed < policy.probation {
            policy.probation_rate
        } else {
            0.0
        };
        rate.max(floor.clamp(0.0, 1.0))
    }

    /// A check passed.
    pub fn pass(&mut self) {
        self.passed = self.passed.saturating_add(1);
    }

    /// A check failed at `now_ms`: quarantined for the policy's ban, doubled per failure
    /// before (at most 2^16 times).
    pub fn fail(&mut self, policy: &CheckPolicy, now_ms: u64) {
        let doubling = self.failed.min(16) as u32;
        self.failed = self.failed.saturating_add(1);
        let ban = policy.ban_ms.saturating_mul(1u64 << doubling);
        self.banned_until = Some(now_ms.saturating_add(ban));
    }
}

/// Whether a uniform `draw` falls within `rate` (0 never, 1 always).
pub fn sampled(rate: f64, draw: u64) -> bool {
    if rate >= 1.0 {
        return true;
    }
    // The top 53 bits as a uniform fraction in [0, 1).
    ((draw >> 11) as f64 / (1u64 << 53) as f64) < rate
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn new_workers_are_checked_always_then_at_the_rate_liars_for_good() {
        let p = CheckPolicy::default();
        let mut r = CheckRecord::default();
        assert_eq!(r.check_rate(&p), 1.0);
        for _ in 0..p.probation {
            r.pass();
        }
        assert!(r.proven(&p));
        assert_eq!(r.check_rate(&p), p.rate);
        r.fail(&p, 1000);
        assert!(r.quarantined(1000));
        assert!(r.quarantined(1000 + p.ban_ms - 1));
        assert!(!r.quarantined(1000 + p.ban_ms));
        assert!(!r.proven(&p));
        assert_eq!(r.check_rate(&p), p.suspect_rate);
        r.fail(&p, 0);
        assert_eq!(
            r.banned_until,
            Some(2 * p.ban_ms),
            "the second ban is twice as long"
        );
        assert_eq!(r.check_rate(&CheckPolicy::never()), 0.0);
    }

    #[test]
    fn endless_failures_do_not_overflow() {
        let p = CheckPolicy::default();
        let mut r = CheckRecord::default();
        for _ in 0..100 {
            r.fail(&p, u64::MAX - 5);
        }
        assert!(r.quarantined(u64::MAX - 1));
    }

    proptest! {
        #[test]
        fn sampling_is_a_threshold_on_the_draw(rate in 0.0f64..1.0, a in any::<u64>(), b in any::<u64>()) {
            prop_assert!(sampled(1.0, a));
            prop_assert!(!sampled(0.0, a));
            // Monotone in the draw: a smaller draw is sampled whenever a larger one is.
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            if sampled(rate, hi) {
                prop_assert!(sampled(rate, lo));
            }
        }

        #[test]
        fn the_rate_never_falls_below_the_policy_rate(
            rate in 0.0f64..1.0, passed in 0u64..40, failed in 0u64..3,
        ) {
            let p = CheckPolicy { rate, ..CheckPolicy::default() };
            let r = CheckRecord { passed, failed, banned_until: None };
            let got = r.check_rate(&p);
            prop_assert!((0.0..=1.0).contains(&got));
            if rate > 0.0 {
                prop_assert!(got >= rate);
                if !r.proven(&p) {
                    prop_assert!(got >= p.suspect_rate.min(p.probation_rate));
                }
            } else {
                prop_assert_eq!(got, 0.0);
            }
        }
    }

    #[test]
    fn about_the_rate_of_draws_are_sampled() {
        // A fixed sequence of well-spread draws (splitmix64).
        let mut x = 0u64;
        let mut hits = 0;
        for _ in 0..10_000 {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            hits += sampled(0.03, z) as u32;
        }
        assert!((200..400).contains(&hits), "{hits}");
    }
}
