//! What the query tests share.

/// Values on a grid of 0.5 in [-1, 1]: dot products and L1 sums are exact, so ties abound (and
/// equal rows, whose L2 distance is 0: a score of -0).
pub fn grid(n: usize, salt: u64) -> Vec<f32> {
    let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 5) as f32 * 0.5 - 1.0
        })
        .collect()
}
