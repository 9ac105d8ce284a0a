//! Negative sampling from the partitions a bucket group may touch.
//!
//! Draws come from legend-model's counter-based [`rng`](legend_model::rng): stream keys name the
//! batch (its epoch, bucket and place in the bucket: a `BatchKey`), chunk and side, so draws depend neither on thread count nor on the order work
//! is done in.

use legend_dataset::PartitionScheme;
use legend_model::rng::{below, draw};

/// Samples entity ids from a set of partitions, a fraction proportionally to degree.
pub struct NegativeSampler {
    scheme: PartitionScheme,
    /// Per partition, prefix sums of degree (length rows + 1).
    degree_prefix: Vec<Vec<u64>>,
    degree_fraction: f64,
}

impl NegativeSampler {
    /// A sampler over `scheme` with entity `degrees`.
    pub fn new(scheme: PartitionScheme, degrees: &[u32], degree_fraction: f64) -> Self {
        let degree_prefix = (0..scheme.num_partitions)
            .map(|p| {
                let r = scheme.range(p);
                let mut prefix = Vec::with_capacity((r.end - r.start) as usize + 1);
                prefix.push(0u64);
                let mut acc = 0u64;
                for id in r {
                    acc += u64::from(degrees[id as usize]);
                    prefix.push(acc);
                }
                prefix
            })
            .collect();
        NegativeSampler {
            scheme,
            degree_prefix,
            degree_fraction,
        }
    }

    /// Fills `out` with draws from `partitions` using stream `key`: the first
    /// `round(degree_fraction · len)` by degree, the rest uniformly.
    pub fn sample(&self, partitions: &[u32], key: u64, out: &mut [u32]) {
        let by_degree = (self.degree_fraction * out.len() as f64).round() as usize;
        let rows: u64 = partitions.iter().map(|&p| self.rows(p)).sum();
        let weight: u64 = partitions
            .iter()
            .map(|&p| *self.degree_prefix[p as usize].last().unwrap())
            .sum();
        for (i, o) in out.iter_mut().enumerate() {
            let bits = draw(key, i as u64);
            *o = if i < by_degree && weight > 0 {
                self.by_degree(partitions, below(bits, weight))
            } else {
                self.uniform(partitions, below(bits, rows))
            };
        }
    }

    fn rows(&self, p: u32) -> u64 {
        (self.degree_prefix[p as usize].len() - 1) as u64
    }

    fn uniform(&self, partitions: &[u32], mut r: u64) -> u32 {
        for &p in partitions {
            let n = self.rows(p);
            if r < n {
                return (self.scheme.range(p).start + r) as u32;
            }
            r -= n;
        }
        unreachable!("r is below the total row count")
    }

    fn by_degree(&self, partitions: &[u32], mut w: u64) -> u32 {
        for &p in partitions {
            let prefix = &self.degree_prefix[p as usize];
            let total = *prefix.last().unwrap();
            if w < total {
                // The row whose degree interval [prefix[i], prefix[i+1]) holds w.
                let i = prefix.partition_point(|&x| x <= w) - 1;
                return (self.scheme.range(p).start + i as u64) as u32;
            }
            w -= total;
        }
        unreachable!("w is below the total degree")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use legend_model::rng::key;

    #[test]
    fn draws_stay_in_the_partitions_and_follow_degree() {
        let scheme = PartitionScheme::new(100, 4).unwrap();
        let mut degrees = vec![0u32; 100];
        degrees[30] = 9; // partition 1
        degrees[60] = 1; // partition 2
        let s = NegativeSampler::new(scheme, &degrees, 1.0);
        let mut out = vec![0u32; 10_000];
        s.sample(&[1, 2], key(7, &[1]), &mut out);
        let hits30 = out.iter().filter(|&&x| x == 30).count();
        assert!(out.iter().all(|&x| x == 30 || x == 60));
        assert!((8500..9500).contains(&hits30), "{hits30}");

        let s = NegativeSampler::new(scheme, &degrees, 0.0);
        s.sample(&[0, 3], key(7, &[2]), &mut out);
        assert!(out.iter().all(|&x| !(25..75).contains(&x)));
        let mut again = vec![0u32; 10_000];
        s.sample(&[0, 3], key(7, &[2]), &mut again);
        assert_eq!(out, again, "same key, same draws");
    }
}
