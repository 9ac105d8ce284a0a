//! Counter-based random numbers, the one definition every Legend component draws from.
//!
//! A draw is a pure function of a seed and counters (no generator state to share), so training
//! results depend neither on the thread count nor on the order work runs in, and a GPU thread
//! draws the same number as the CPU. The spec, for ports (all arithmetic wrapping, `u64`):
//!
//! ```text
//! mix(z)        = z ^= z >> 30; z *= 0xbf58476d1ce4e5b9; z ^= z >> 27; z *= 0x94d049bb133111eb;
//!                 z ^ (z >> 31)                                  (splitmix64's finaliser)
//! G             = 0x9e3779b97f4a7c15                             (its golden-ratio increment)
//! key(s, [p..]) = fold(mix(s + G), |k, p| mix(k ^ (p + G)))      (a stream named by counters)
//! draw(k, i)    = mix(k + (i + 1)·G)                             (the i-th draw of stream k)
//! below(b, n)   = (b · n) >> 64                                  (uniform in 0..n, 128-bit product)
//! ```
//!
//! The CUDA twins are `legend_mix`, `legend_draw`, `legend_below` and `legend_key2` in
//! `kernels/common.cuh`; `kernels/testdata/rng_vectors.txt` pins both sides to the same numbers
//! (this crate's tests and legend-cuda's GPU tests read it).
//!
//! Training names its streams by what is trained, never by when: a bucket's edge order by
//! (seed, epoch, bucket) ([`bucket_order_key`]), and every draw of a batch — its negatives, the
//! stochastic rounding of the rows it updates — by its [`BatchKey`]: (seed, epoch, bucket, batch
//! within the bucket). So a bucket trains the same way whichever buckets ran before it, on
//! whichever worker, and an epoch can stop and resume at any batch.

/// splitmix64's golden-ratio increment `G`.
pub const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's finaliser: a bijective 64-bit mix.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of the stream named by `seed` and the counters `parts` (an epoch, a batch, a
/// chunk, a side...).
pub fn key(seed: u64, parts: &[u64]) -> u64 {
    parts.iter().fold(mix(seed.wrapping_add(GOLDEN)), |k, &p| {
        mix(k ^ p.wrapping_add(GOLDEN))
    })
}

/// The first counter of a bucket's edge-order stream.
pub const ORDER_TAG: u64 = 1;
/// The first counter of a batch's negative streams (under its [`BatchKey`]).
pub const NEGATIVES_TAG: u64 = 2;
/// The first counter of a batch's rounding streams (under its [`BatchKey`]).
pub const ROUNDING_TAG: u64 = 3;
/// The first counter of a batch's key.
pub const BATCH_TAG: u64 = 4;

/// The key of the order bucket `bucket` (its row-major index in the N×N grid) trains its edges
/// in during epoch `epoch` (legend-model's [`crate::Permutation`] over its edges).
pub fn bucket_order_key(seed: u64, epoch: u32, bucket: u64) -> u64 {
    key(seed, &[ORDER_TAG, u64::from(epoch), bucket])
}

/// The key every random stream of one training batch derives from: batch `batch` (from 0, in
/// the bucket's edge order) of bucket `bucket` (row-major index in the N×N grid) in epoch
/// `epoch`. Nothing about the epoch's division of work enters it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchKey(pub u64);

impl BatchKey {
    /// The key of batch `batch` of bucket `bucket` in epoch `epoch` of a run seeded `seed`.
    pub fn new(seed: u64, epoch: u32, bucket: u64, batch: u64) -> BatchKey {
        BatchKey(key(seed, &[BATCH_TAG, u64::from(epoch), bucket, batch]))
    }

    /// The stream of the negatives of chunk `chunk`, side `side` (0: candidates that replace
    /// the sources, 1: the destinations).
    pub fn negatives(self, chunk: u64, side: u64) -> u64 {
        key(self.0, &[NEGATIVES_TAG, chunk, side])
    }

    /// The stream that rounds node row `row` (global id) after this batch's step (the GPU's
    /// `legend_round_key`: `legend_key2(key, ROUNDING_TAG, row)`).
    pub fn rounding(self, row: u64) -> u64 {
        key(self.0, &[ROUNDING_TAG, row])
    }
}

/// The `i`-th 64-bit draw of stream `key`.
#[inline]
pub fn draw(key: u64, i: u64) -> u64 {
    mix(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// A uniform integer below `n` from 64 random bits (multiply-shift; the bias is below 2⁻³²
/// for `n` below 2³²).
#[inline]
pub fn below(bits: u64, n: u64) -> u64 {
    ((u128::from(bits) * u128::from(n)) >> 64) as u64
}

/// A uniform number in [0, 1) from the top 53 of 64 random bits.
#[inline]
pub fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A sequential stream for work that runs in order (the graph generator's blocks): the draws
/// of stream `key`, one after another.
#[derive(Clone, Debug)]
pub struct Stream {
    key: u64,
    next: u64,
}

impl Stream {
    /// The stream of draws `draw(key, 0), draw(key, 1), ...`.
    pub fn new(key: u64) -> Stream {
        Stream { key, next: 0 }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn bits(&mut self) -> u64 {
        let b = draw(self.key, self.next);
        self.next += 1;
        b
    }

    /// The next uniform number in [0, 1).
    #[inline]
    pub fn unit(&mut self) -> f64 {
        unit(self.bits())
    }

    /// The next uniform integer below `n`.
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        below(self.bits(), n)
    }
}

/// The shared test vectors, `[a, b, c, mix(a), draw(a, b), below(a, c), key(a, [b, c])]` per
/// line of `kernels/testdata/rng_vectors.txt`, for the tests of ports (the CUDA twin's).
pub fn test_vectors() -> Vec<[u64; 7]> {
    hex_lines(include_str!("../../../kernels/testdata/rng_vectors.txt"))
}

/// The shared batch-key vectors, `[seed, epoch, bucket, batch, key, negatives(0, 0),
/// negatives(3, 1), rounding(0), rounding(41_652_229)]` per line of
/// `kernels/testdata/batch_key_vectors.txt`: what training's streams are named by (the GPU
/// derives the rounding streams from the key, [`BatchKey::rounding`]).
pub fn batch_key_vectors() -> Vec<[u64; 9]> {
    hex_lines(include_str!(
        "../../../kernels/testdata/batch_key_vectors.txt"
    ))
}

/// The rows of hex numbers of a vectors file (`#` comments, `|` separators skipped).
fn hex_lines<const N: usize>(text: &str) -> Vec<[u64; N]> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let v: Vec<u64> = l
                .split_whitespace()
                .filter(|w| *w != "|")
                .map(|w| u64::from_str_radix(w, 16).expect("hex numbers"))
                .collect();
            v.try_into()
                .unwrap_or_else(|v: Vec<u64>| panic!("{N} numbers a line, not {}", v.len()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_functions_compute_the_shared_vectors() {
        let v = test_vectors();
        assert!(v.len() >= 5);
        for [a, b, c, m, d, w, k] in v {
            assert_eq!(mix(a), m, "mix({a:#x})");
            assert_eq!(draw(a, b), d, "draw({a:#x}, {b:#x})");
            assert_eq!(below(a, c), w, "below({a:#x}, {c:#x})");
            assert_eq!(key(a, &[b, c]), k, "key({a:#x}, [{b:#x}, {c:#x}])");
        }
    }

    #[test]
    fn batch_keys_compute_the_shared_vectors() {
        let v = batch_key_vectors();
        assert!(v.len() >= 4);
        for [seed, epoch, bucket, batch, k, n0, n1, r0, r1] in v {
            let b = BatchKey::new(seed, epoch as u32, bucket, batch);
            assert_eq!(
                b.0, k,
                "BatchKey::new({seed:#x}, {epoch}, {bucket}, {batch})"
            );
            assert_eq!([b.negatives(0, 0), b.negatives(3, 1)], [n0, n1]);
            assert_eq!([b.rounding(0), b.rounding(41_652_229)], [r0, r1]);
            // The GPU's rounding stream is key(batch key, [ROUNDING_TAG, row]): a key2 vector.
            assert_eq!(key(k, &[ROUNDING_TAG, 41_652_229]), r1);
        }
    }

    #[test]
    fn a_batch_key_names_its_bucket_and_position_alone() {
        let k = |epoch, bucket, batch| BatchKey::new(7, epoch, bucket, batch);
        let keys = [k(1, 0, 0), k(1, 0, 1), k(1, 1, 0), k(2, 0, 0)];
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b, "each counter enters the key");
            }
        }
        assert_ne!(BatchKey::new(8, 1, 0, 0), k(1, 0, 0), "the seed enters");
        assert_ne!(k(1, 0, 0).negatives(0, 0), k(1, 0, 0).negatives(0, 1));
    }

    #[test]
    fn streams_and_keys_follow_the_spec() {
        let k = key(7, &[2, 1, 3]);
        let folded = [2u64, 1, 3]
            .iter()
            .fold(mix(7 + GOLDEN), |k, &p| mix(k ^ (p + GOLDEN)));
        assert_eq!(k, folded);
        let mut s = Stream::new(k);
        assert_eq!([s.bits(), s.bits()], [draw(k, 0), draw(k, 1)]);
        assert!((0..1000).all(|_| (0.0..1.0).contains(&s.unit()) && s.below(10) < 10));
        assert_eq!(unit(u64::MAX), 1.0 - f64::EPSILON / 2.0);
    }
}
