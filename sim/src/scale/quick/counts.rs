//! Slabs by their number of live holders, kept in step with the view: which slabs have a
//! given count, and the fewest and most any slab has, each in constant time.

/// The slabs of one model by how many live holders each has.
#[derive(Debug, Clone)]
pub struct Counts {
    /// Holders of each slab.
    count: Vec<u32>,
    /// The slabs with each count (any order).
    members: Vec<Vec<u32>>,
    /// Each slab's place in its `members` list.
    pos: Vec<u32>,
    /// The fewest and most holders of any slab.
    lo: usize,
    hi: usize,
}

impl Counts {
    /// `slabs` slabs, none held.
    pub fn new(slabs: usize) -> Self {
        Self {
            count: vec![0; slabs],
            members: vec![(0..slabs as u32).collect()],
            pos: (0..slabs as u32).collect(),
            lo: 0,
            hi: 0,
        }
    }

    /// How many slabs there are.
    pub fn slabs(&self) -> usize {
        self.count.len()
    }

    /// Live holders of slab `s`.
    pub fn of(&self, s: u32) -> usize {
        self.count[s as usize] as usize
    }

    /// The slabs with `c` live holders.
    pub fn with(&self, c: usize) -> &[u32] {
        self.members.get(c).map_or(&[], Vec::as_slice)
    }

    /// The fewest live holders of any slab.
    pub fn fewest(&self) -> usize {
        self.lo
    }

    /// The most live holders of any slab.
    pub fn most(&self) -> usize {
        self.hi
    }

    /// Slab `s` gained a holder.
    pub fn up(&mut self, s: u32) {
        let c = self.of(s);
        self.move_to(s, c, c + 1);
        if c + 1 > self.hi {
            self.hi = c + 1;
        }
        if c == self.lo && self.members[c].is_empty() {
            self.lo = c + 1;
        }
    }

    /// Slab `s` lost a holder.
    pub fn down(&mut self, s: u32) {
        let c = self.of(s);
        if c == 0 {
            return;
        }
        self.move_to(s, c, c - 1);
        if c - 1 < self.lo {
            self.lo = c - 1;
        }
        if c == self.hi && self.members[c].is_empty() {
            self.hi = c - 1;
        }
    }

    fn move_to(&mut self, s: u32, from: usize, to: usize) {
        let at = self.pos[s as usize] as usize;
        let list = &mut self.members[from];
        list.swap_remove(at);
        if let Some(&moved) = list.get(at) {
            self.pos[moved as usize] = at as u32;
        }
        if self.members.len() <= to {
            self.members.resize_with(to + 1, Vec::new);
        }
        self.pos[s as usize] = self.members[to].len() as u32;
        self.members[to].push(s);
        self.count[s as usize] = to as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_lists_and_bounds_follow_every_change(
            changes in proptest::collection::vec((0u32..6, any::<bool>()), 0..200),
        ) {
            let mut counts = Counts::new(6);
            let mut plain = [0usize; 6];
            for (s, up) in changes {
                if up {
                    counts.up(s);
                    plain[s as usize] += 1;
                } else {
                    counts.down(s);
                    plain[s as usize] = plain[s as usize].saturating_sub(1);
                }
                for c in 0..=plain.iter().max().copied().unwrap_or(0) + 1 {
                    let mut with: Vec<u32> = counts.with(c).to_vec();
                    with.sort();
                    let expected: Vec<u32> = (0..6).filter(|&s| plain[s as usize] == c).collect();
                    prop_assert_eq!(with, expected);
                }
                prop_assert_eq!(counts.fewest(), *plain.iter().min().unwrap());
                prop_assert_eq!(counts.most(), *plain.iter().max().unwrap());
                for s in 0..6 {
                    prop_assert_eq!(counts.of(s), plain[s as usize]);
                }
            }
        }
    }
}
