//! Whom a node keeps in its bounded table of records when it is full: a newcomer takes the
//! place of the lowest-standing record only if it stands higher, so records made up by the
//! thousand neither lock out the nodes this one has met nor push each other out.

use std::cmp::Reverse;

/// What the node knows of a record's signer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// The node has had a connection with the signer (its key proven in the handshake).
    pub met: bool,
    /// Strikes against the signer (bad records or answers).
    pub strikes: u32,
    /// Blobs the signer served that verified (its usefulness, proven).
    pub useful: u32,
    /// When its first record was taken in (unix seconds).
    pub first_seen: u64,
}

impl Standing {
    /// Higher is kept: met before not met, fewer strikes first, then the more useful, then
    /// the longer known.
    fn rank(&self) -> (bool, Reverse<u32>, u32, Reverse<u64>) {
        (
            self.met,
            Reverse(self.strikes),
            self.useful,
            Reverse(self.first_seen),
        )
    }
}

/// Which of the `kept` records to drop to take in `newcomer` when the table is full: the
/// lowest-standing one (the newest among equals), if the newcomer stands above it; `None`
/// refuses the newcomer.
pub fn evict_for<K: Copy + Ord>(
    kept: impl IntoIterator<Item = (K, Standing)>,
    newcomer: Standing,
) -> Option<K> {
    let (key, lowest) = kept
        .into_iter()
        .min_by(|(ka, a), (kb, b)| a.rank().cmp(&b.rank()).then(kb.cmp(ka)))?;
    (newcomer.rank() > lowest.rank()).then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(met: bool, strikes: u32, first_seen: u64) -> Standing {
        Standing {
            met,
            strikes,
            useful: 0,
            first_seen,
        }
    }

    #[test]
    fn a_met_newcomer_takes_the_place_of_the_newest_stranger() {
        let kept = [
            (1, s(false, 0, 10)),
            (2, s(false, 0, 20)),
            (3, s(true, 0, 30)),
        ];
        assert_eq!(evict_for(kept, s(true, 0, 40)), Some(2));
        // A stranger newer than every stranger kept is refused: strangers cannot churn.
        assert_eq!(evict_for(kept, s(false, 0, 40)), None);
        // Strikes count against a record.
        let kept = [(1, s(true, 3, 10)), (2, s(true, 0, 20))];
        assert_eq!(evict_for(kept, s(true, 0, 30)), Some(1));
        // A node that served verified bytes outranks a newer and an older one that did not.
        let useful = Standing {
            useful: 2,
            ..s(true, 0, 25)
        };
        let kept = [(1, s(true, 0, 10)), (2, useful)];
        assert_eq!(evict_for(kept, s(true, 0, 30)), None);
        assert_eq!(
            evict_for(
                kept,
                Standing {
                    useful: 3,
                    ..s(true, 0, 30)
                }
            ),
            Some(1)
        );
    }

    proptest! {
        #[test]
        fn only_a_lower_standing_record_is_ever_dropped(
            kept in proptest::collection::vec((any::<bool>(), 0u32..3, 0u32..3, 0u64..100), 1..32),
            new in (any::<bool>(), 0u32..3, 0u32..3, 0u64..100),
        ) {
            let st = |(m, k, u, f)| Standing { useful: u, ..s(m, k, f) };
            let kept: Vec<(usize, Standing)> = kept
                .into_iter()
                .enumerate()
                .map(|(i, v)| (i, st(v)))
                .collect();
            let newcomer = st(new);
            match evict_for(kept.iter().copied(), newcomer) {
                Some(k) => {
                    prop_assert!(newcomer.rank() > kept[k].1.rank());
                    prop_assert!(kept.iter().all(|(_, o)| o.rank() >= kept[k].1.rank()));
                }
                None => prop_assert!(kept.iter().all(|(_, o)| o.rank() >= newcomer.rank())),
            }
        }
    }
}
