//! A set of slabs as bits (bit `s % 64` of word `s / 64`): what a node holds, looked up in
//! constant time where a round walks thousands of slabs.

/// A set of slab indices.
#[derive(Debug, Clone, Default)]
pub struct SlabBits(Vec<u64>);

impl SlabBits {
    /// Adds slab `s`.
    pub fn insert(&mut self, s: u32) {
        let word = s as usize / 64;
        if self.0.len() <= word {
            self.0.resize(word + 1, 0);
        }
        self.0[word] |= 1 << (s % 64);
    }

    /// Takes slab `s` out.
    pub fn remove(&mut self, s: u32) {
        if let Some(w) = self.0.get_mut(s as usize / 64) {
            *w &= !(1 << (s % 64));
        }
    }

    /// Whether slab `s` is in.
    pub fn contains(&self, s: u32) -> bool {
        self.0
            .get(s as usize / 64)
            .is_some_and(|w| w >> (s % 64) & 1 == 1)
    }
}

impl FromIterator<u32> for SlabBits {
    fn from_iter<I: IntoIterator<Item = u32>>(slabs: I) -> Self {
        let mut bits = Self::default();
        for s in slabs {
            bits.insert(s);
        }
        bits
    }
}
