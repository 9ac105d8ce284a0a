//! Helpers shared by the GPU test files (each file uses a part of them).
#![allow(dead_code)]

use legend_cuda::Gpu;

/// The first GPU. The tests that call this are `#[ignore]`d (reported as skipped where
/// `cargo test` runs without a GPU); asked for with `--include-ignored`, a missing driver,
/// NVRTC or device fails them.
pub fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|e| panic!("this test needs a GPU: {e}"))
}

/// A fresh seed per run (printed, so a failure can be replayed with LEGEND_TEST_SEED).
pub fn seed(test: &str) -> u64 {
    let s = std::env::var("LEGEND_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("{test}: seed {s}");
    s
}

/// A small counter-based generator for test inputs.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(legend_model::rng::GOLDEN);
        legend_model::rng::mix(self.0)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}
