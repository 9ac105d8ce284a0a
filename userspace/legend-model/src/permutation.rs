//! A counter-based permutation of `0..n`, evaluated index by index: the order in which the
//! trainers visit a bucket's edges (batch `b` holds positions `b·B ..` of it). Each position is
//! a pure function of `(n, key, i)`, so a GPU thread computes its own edge's index with no shared
//! state, the CPU gathers a batch in parallel, and both train on the same order. The spec, for
//! ports (`kernels/batch.cu` mirrors it bit for bit):
//!
//! ```text
//! mix, G   = splitmix64's finaliser and golden increment (see rng.rs)
//! h        = the smallest h ≥ 1 with 2^(2h) ≥ n        (the domain: 2^(2h) < 4n for n ≥ 2)
//! mask     = 2^h − 1
//! k_r      = mix(key + (r + 1)·G)                      for the rounds r = 0 .. ROUNDS−1
//! round r  : x = L·2^h + R  ↦  R·2^h + (L ^ (mix(k_r ^ R) & mask))
//! σ(x)     = the ROUNDS rounds applied in order        (a Feistel network: a bijection of the domain)
//! perm(i)  = the first of σ(i), σ(σ(i)), … below n     (cycle walking; all arithmetic wrapping, u64)
//! ```
//!
//! Cycle walking keeps the bijection: from `i < n` the walk follows `i`'s cycle of `σ`, which
//! returns to `i`, so it ends, and two indices that reached the same value would have had the
//! same predecessor. With a domain below `4n` a walk takes fewer than 4 steps on average.

use crate::rng::{GOLDEN, mix};

/// Feistel rounds of a [`Permutation`]. Four make a pseudo-random permutation from random
/// round functions; two more cost nothing next to a batch and keep small domains well mixed.
pub const PERMUTATION_ROUNDS: usize = 6;

/// A bijection of `0..n` chosen by a 64-bit key (see the module docs for the spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; PERMUTATION_ROUNDS],
}

impl Permutation {
    /// The permutation of `0..n` keyed by `key`.
    pub fn new(n: u64, key: u64) -> Permutation {
        // Bits needed for the values 0..n, rounded up to an even count of at least 2.
        let bits = u64::BITS - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let keys =
            std::array::from_fn(|r| mix(key.wrapping_add((r as u64 + 1).wrapping_mul(GOLDEN))));
        Permutation { n, half_bits, keys }
    }

    /// The number of indices, `n`.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// Whether `n` is 0.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// `h`: the bits of each Feistel half.
    pub fn half_bits(&self) -> u32 {
        self.half_bits
    }

    /// The round keys `k_r`.
    pub fn round_keys(&self) -> &[u64; PERMUTATION_ROUNDS] {
        &self.keys
    }

    /// The image of position `i` (below `n`).
    ///
    /// # Panics
    /// If `i >= n`.
    #[inline]
    pub fn at(&self, i: u64) -> u64 {
        assert!(i < self.n, "position {i} of a permutation of {}", self.n);
        let mut x = i;
        loop {
            x = self.feistel(x);
            if x < self.n {
                return x;
            }
        }
    }

    #[inline]
    fn feistel(&self, x: u64) -> u64 {
        let h = self.half_bits;
        let mask = u64::MAX >> (64 - h);
        let (mut l, mut r) = (x >> h, x & mask);
        for &k in &self.keys {
            (l, r) = (r, l ^ (mix(k ^ r) & mask));
        }
        (l << h) | r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn is_bijection(n: u64, key: u64) -> bool {
        let p = Permutation::new(n, key);
        let mut seen = vec![false; n as usize];
        (0..n).all(|i| {
            let j = p.at(i);
            j < n && !std::mem::replace(&mut seen[j as usize], true)
        })
    }

    #[test]
    fn small_sizes_and_powers_of_two_are_bijections() {
        let mut sizes: Vec<u64> = (0..=70).collect();
        for b in 2..=17 {
            sizes.extend([(1 << b) - 1, 1 << b, (1 << b) + 1]);
        }
        for n in sizes {
            for key in [0, 1, u64::MAX, 0x1234_5678_9abc_def0] {
                assert!(is_bijection(n, key), "n = {n}, key = {key:#x}");
            }
        }
    }

    #[test]
    fn domain_is_the_smallest_even_power_of_two() {
        for (n, h) in [
            (0, 1),
            (1, 1),
            (4, 1),
            (5, 2),
            (16, 2),
            (17, 3),
            (1 << 20, 10),
            ((1 << 20) + 1, 11),
            (u64::MAX, 32),
        ] {
            assert_eq!(Permutation::new(n, 7).half_bits(), h, "n = {n}");
        }
        // The largest domain still maps below n.
        let p = Permutation::new(u64::MAX, 3);
        for i in [0, 1, u64::MAX - 1, 1 << 63] {
            assert!(p.at(i) < u64::MAX);
        }
    }

    #[test]
    fn orders_look_shuffled_and_depend_on_the_key() {
        let n = 100_000u64;
        let (a, b) = (Permutation::new(n, 1), Permutation::new(n, 2));
        let fixed = (0..n).filter(|&i| a.at(i) == i).count();
        let same = (0..n).filter(|&i| a.at(i) == b.at(i)).count();
        // A uniform permutation has one fixed point on average (and agrees with another in one).
        assert!(fixed < 10 && same < 10, "fixed {fixed}, same {same}");
        // The first batch of a tenth of the positions spreads over the whole range: its mean
        // is n/2 within a few standard errors (n / sqrt(12 · n/10) ≈ 290).
        let batch = n / 10;
        let mean = (0..batch).map(|i| a.at(i) as f64).sum::<f64>() / batch as f64;
        assert!((mean - n as f64 / 2.0).abs() < 1500.0, "mean {mean}");
        // Neighbouring positions land far apart.
        let close = (1..n)
            .filter(|&i| a.at(i).abs_diff(a.at(i - 1)) < 10)
            .count();
        assert!(close < 100, "{close} neighbours within 10");
    }

    #[test]
    #[should_panic(expected = "position 5 of a permutation of 5")]
    fn positions_past_the_end_are_refused() {
        Permutation::new(5, 0).at(5);
    }

    proptest! {
        #[test]
        fn every_size_and_key_gives_a_bijection(n in 0u64..3000, key in any::<u64>()) {
            prop_assert!(is_bijection(n, key));
        }

        #[test]
        fn near_powers_of_two_give_bijections(b in 1u32..15, delta in -2i64..=2, key in any::<u64>()) {
            let n = ((1i64 << b) + delta).max(0) as u64;
            prop_assert!(is_bijection(n, key));
        }
    }
}
