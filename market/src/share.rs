//! Fair shares of a bounded resource (a worker's compute slots and buffered bytes, a relayed
//! worker's streams) among the peers using it at once.

/// What each of `holders` peers (counting the one asking) may hold of `total`: an equal part,
/// at least one; a peer alone gets three quarters (rounded down, at least one), so that a peer
/// that comes later finds room at once instead of waiting for the first to give some back.
pub fn fair_share(total: u64, holders: usize) -> u64 {
    let part = if holders <= 1 {
        total - total.div_ceil(4)
    } else {
        total / holders as u64
    };
    part.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn alone_three_quarters_else_equal_parts() {
        assert_eq!(fair_share(8, 1), 6);
        assert_eq!(fair_share(8, 2), 4);
        assert_eq!(fair_share(8, 3), 2);
        assert_eq!(fair_share(1, 1), 1);
        assert_eq!(fair_share(2, 1), 1);
        assert_eq!(fair_share(3, 5), 1);
    }

    proptest! {
        #[test]
        fn shares_leave_room_and_never_exceed_the_total(total in 1u64..1_000_000, n in 1usize..64) {
            let s = fair_share(total, n);
            prop_assert!(s >= 1);
            prop_assert!(s <= total);
            // A peer alone leaves room for a second, wherever there is more than one unit.
            if n == 1 && total >= 2 {
                prop_assert!(s < total);
            }
            // Equal parts add up to no more than the total (where each gets at least one).
            if total >= n as u64 {
                prop_assert!(s * n as u64 <= total || n == 1);
            }
        }
    }
}
