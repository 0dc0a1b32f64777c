//! Which of a checked dispatch's expert groups the router re-computes.
//!
//! A prefill dispatch carries a worker's whole share of a layer: dozens of experts, a few
//! rows each. Re-computing all of it makes the router do the worker's work again, and load
//! every one of those experts first. A check instead re-computes a uniform sample of
//! [`CheckPolicy::groups`](super::CheckPolicy) of the dispatch's groups (one expert's rows
//! each), whole, drawn by the router after the dispatch is sent and never told to the worker,
//! and compares them bit for bit. A dispatch with no more groups than that is checked whole,
//! as before (a decode dispatch of a few sequences has a handful). The group is the unit because
//! an expert is the unit of a check's cost: loading its weights and reading them once costs
//! about as much as a few rows more, so a sample of whole groups catches more for the same
//! cost than one of rows spread over as many experts.
//!
//! What a sample catches ([`catch_chance`]): a worker whose answer is wrong in `wrong` of its
//! `total` groups (in any row of them) is caught by a sample of `s` groups with probability
//! `1 − C(total − wrong, s) / C(total, s)`, at least `1 − (1 − wrong/total)^s`. A worker
//! wrong throughout (wrong weights, a wrong model, a broken kernel) is caught by every checked
//! dispatch; one wrong in a tenth of its groups, by at least 57 % of them at 8 groups; one
//! wrong in a single group of `total`, by `s / total` of them (and by every check of a
//! dispatch of `s` groups or fewer). Groups not sampled are used as answered, as the answers of dispatches not
//! checked at all are.
//!
//! Pure: the draw comes in as a `u64` and everything follows from it.

use std::collections::BTreeSet;

/// The groups a check re-computes, of a dispatch of `groups`: `budget` of them drawn
/// uniformly without replacement from `draw`, ascending; all of them when there are no more
/// than `budget` (or `budget` is 0).
pub fn sample_groups(groups: usize, budget: usize, draw: u64) -> Vec<usize> {
    if budget == 0 || groups <= budget {
        return (0..groups).collect();
    }
    floyd(groups, budget, draw).into_iter().collect()
}

/// `s` distinct indices of `0..n`, uniformly (Floyd's algorithm), ascending.
fn floyd(n: usize, s: usize, draw: u64) -> BTreeSet<usize> {
    let mut rng = SplitMix(draw);
    let mut set = BTreeSet::new();
    for j in n - s..n {
        let t = rng.below(j as u64 + 1) as usize;
        if !set.insert(t) {
            set.insert(j);
        }
    }
    set
}

/// The chance that a uniform sample of `sampled` of `total` groups holds at least one of the
/// `wrong` ones: `1 − C(total − wrong, sampled) / C(total, sampled)`.
pub fn catch_chance(total: u64, wrong: u64, sampled: u64) -> f64 {
    let wrong = wrong.min(total);
    let sampled = sampled.min(total);
    if wrong == 0 || sampled == 0 {
        return 0.0;
    }
    // The chance of missing: each sampled group in turn avoiding the wrong ones.
    let mut miss = 1.0f64;
    for i in 0..sampled {
        let left = (total - i) as f64;
        let right_left = total - wrong;
        if right_left <= i {
            return 1.0;
        }
        miss *= (right_left - i) as f64 / left;
    }
    1.0 - miss
}

/// splitmix64: a small, well-spread generator, enough to spread one draw over a sample.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (multiply-shift; its bias, under `n / 2^64`, is far below any
    /// sample's own spread).
    fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_sample_is_the_budget_of_distinct_groups_of_the_dispatch(
            groups in 0usize..300,
            budget in 0usize..40,
            draw in any::<u64>(),
        ) {
            let s = sample_groups(groups, budget, draw);
            let expected = if budget == 0 { groups } else { budget.min(groups) };
            prop_assert_eq!(s.len(), expected);
            prop_assert!(s.windows(2).all(|w| w[0] < w[1]), "ascending, distinct");
            prop_assert!(s.iter().all(|&g| g < groups));
            prop_assert_eq!(sample_groups(groups, budget, draw), s, "one draw, one sample");
        }

        #[test]
        fn the_catch_chance_is_a_probability_growing_with_wrong_groups_and_sample(
            total in 1u64..500, wrong in 0u64..500, sampled in 0u64..100,
        ) {
            let c = catch_chance(total, wrong, sampled);
            prop_assert!((0.0..=1.0).contains(&c));
            prop_assert!(catch_chance(total, wrong + 1, sampled) >= c);
            prop_assert!(catch_chance(total, wrong, sampled + 1) >= c - 1e-12);
            let w = wrong.min(total);
            if sampled >= total && w > 0 {
                prop_assert_eq!(c, 1.0, "the whole dispatch checked catches any wrong group");
            }
            if w > 0 && sampled > 0 {
                // The stated lower bound, 1 − (1 − wrong/total)^sampled.
                let bound = 1.0 - (1.0 - w as f64 / total as f64).powi(sampled.min(total) as i32);
                prop_assert!(c >= bound - 1e-9, "{c} < {bound}");
            }
        }
    }

    #[test]
    fn small_dispatches_are_checked_whole() {
        assert_eq!(sample_groups(3, 8, 7), vec![0, 1, 2]);
        assert_eq!(sample_groups(20, 0, 7).len(), 20, "budget 0: every group");
    }

    #[test]
    fn each_group_is_sampled_as_often_as_the_stated_chance() {
        // 85 groups (a worker's prefill share of one layer); one wrong, group 60.
        let draws = 20_000u64;
        let mut caught = 0u32;
        let mut rng = SplitMix(1);
        for _ in 0..draws {
            caught += sample_groups(85, 8, rng.next()).contains(&60) as u32;
        }
        let expected = catch_chance(85, 1, 8) * draws as f64; // 8/85 of them
        let got = caught as f64;
        // Binomial standard deviation ≈ 41; five of them either way.
        assert!((got - expected).abs() < 210.0, "{got} vs {expected}");
        assert!((catch_chance(85, 1, 8) - 8.0 / 85.0).abs() < 1e-12);
        // Wrong in 9 of 85: caught by 61 % of checks, over the stated 1 − 0.9^8 = 57 %.
        let tenth = catch_chance(85, 9, 8);
        assert!(
            (0.60..0.62).contains(&tenth),
            "9 of 85 wrong: caught {tenth}"
        );
        assert!(tenth > 1.0 - 0.9f64.powi(8));
    }
}
