//! The number format of node rows at rest (`storage.dtype`): `f32`, `bf16` or `f16`.
//!
//! Computation stays f32; the narrowing happens once, where a value is made: the AdaGrad step
//! rounds every element it updates to the format (stochastically, keyed by a counter — seed,
//! row, element, step — not a running stream, so results do not depend on the thread count and
//! a resume is bit-exact), and initialisation rounds to the nearest. Every value the engine
//! holds is then exactly representable in the format, so every later narrowing (the store,
//! checkpoints, transfers) is exact and widening gives back the same f32.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::rng::BatchKey;

/// The format of node embeddings at rest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 32-bit IEEE floats (no rounding).
    #[default]
    F32,
    /// bfloat16: f32's range, 8 significant bits.
    Bf16,
    /// IEEE half: 11 significant bits, magnitudes up to 65504 (beyond is an error, never inf).
    F16,
}

/// A value that does not fit the format (f16 beyond ±65504, or not finite).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OutOfRange {
    /// The element's index in its row.
    pub element: usize,
    /// The f32 value.
    pub value: f32,
}

impl Dtype {
    /// Every format, in the order of its store code.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Whether values need rounding to be representable (everything but f32).
    pub fn is_narrow(self) -> bool {
        self != Dtype::F32
    }

    /// `x` rounded to the nearest representable value (ties to even): initial rows.
    pub fn round_nearest(self, x: f32) -> f32 {
        match self {
            Dtype::F32 => x,
            Dtype::Bf16 => bf16::from_f32(x).to_f32(),
            Dtype::F16 => f16::from_f32(x).to_f32(),
        }
    }

    /// `x` rounded to one of its two representable neighbours, up (away from zero) with
    /// probability equal to its distance from the lower one over their gap, drawn from the
    /// 32 uniform bits `random`: the expected value is `x`, so small steps are not lost.
    ///
    /// The CUDA twin is `legend_round_stochastic` in `kernels/common.cuh`.
    #[inline]
    pub fn round_stochastic(self, x: f32, random: u32) -> f32 {
        match self {
            Dtype::F32 => x,
            // bf16 keeps f32's top 16 bits: adding 16 random bits below them carries into the
            // kept part with exactly that probability (the magnitude is sign-separate).
            Dtype::Bf16 => keep_top_bits(x, 16, random),
            Dtype::F16 => {
                let magnitude = x.abs();
                if magnitude >= F16_MIN_NORMAL || !magnitude.is_finite() {
                    // Normal halves are f32's grid with 13 fewer significand bits.
                    keep_top_bits(x, 13, random)
                } else {
                    // Subnormal halves are the multiples of 2^-24: scaling by a power of two
                    // is exact, and so is the fraction.
                    let scaled = magnitude * F16_SUBNORMAL_SCALE;
                    let floor = scaled.floor();
                    let up = ((random >> 8) as f32) * (1.0 / (1u32 << 24) as f32) < scaled - floor;
                    let rounded = (floor + f32::from(u8::from(up))) / F16_SUBNORMAL_SCALE;
                    rounded.copysign(x)
                }
            }
        }
    }

    /// Whether the rounded value `x` is representable (f16: finite and at most 65504).
    #[inline]
    pub fn fits(self, x: f32) -> bool {
        match self {
            Dtype::F32 | Dtype::Bf16 => x.is_finite(),
            Dtype::F16 => x.abs() <= f16::MAX.to_f32(),
        }
    }

    /// Rounds a row stochastically in place, element `i` with the bits of `draw(stream, i)`;
    /// an element that does not fit is an error naming it (the caller stops the run).
    pub fn round_row(self, row: &mut [f32], stream: u64) -> Result<(), OutOfRange> {
        if !self.is_narrow() {
            return Ok(());
        }
        for (i, x) in row.iter_mut().enumerate() {
            let rounded =
                self.round_stochastic(*x, (crate::rng::draw(stream, i as u64) >> 32) as u32);
            if !self.fits(rounded) {
                return Err(OutOfRange {
                    element: i,
                    value: *x,
                });
            }
            *x = rounded;
        }
        Ok(())
    }

    /// Writes `values` (each representable: the caller's rows were rounded) in this format,
    /// little-endian, into `out` (`values.len() × bytes()` long).
    pub fn narrow(self, values: &[f32], out: &mut [u8]) {
        assert_eq!(
            out.len(),
            values.len() * self.bytes(),
            "narrow: lengths differ"
        );
        match self {
            Dtype::F32 => out.copy_from_slice(bytemuck::cast_slice(values)),
            Dtype::Bf16 => {
                for (o, &v) in out.chunks_exact_mut(2).zip(values) {
                    o.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                }
            }
            Dtype::F16 => {
                for (o, &v) in out.chunks_exact_mut(2).zip(values) {
                    o.copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
        }
    }

    /// Reads `values` back from `bytes` in this format (exact).
    pub fn widen(self, bytes: &[u8], values: &mut [f32]) {
        assert_eq!(
            bytes.len(),
            values.len() * self.bytes(),
            "widen: lengths differ"
        );
        match self {
            Dtype::F32 => bytemuck::cast_slice_mut(values).copy_from_slice(bytes),
            Dtype::Bf16 => {
                for (v, b) in values.iter_mut().zip(bytes.chunks_exact(2)) {
                    *v = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Dtype::F16 => {
                for (v, b) in values.iter_mut().zip(bytes.chunks_exact(2)) {
                    *v = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }
}

/// The stochastic rounding of one training step's updated node rows: row `r`'s element `i` is
/// rounded with the bits of `draw(batch.rounding(r), i)` — a stream named by the batch's key
/// and the global row, so the result depends neither on the thread count nor on which engine,
/// worker or slot holds the row, and a resume repeats it exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRounding {
    /// The node rows' format.
    pub dtype: Dtype,
    /// The step's batch.
    pub batch: BatchKey,
}

impl StepRounding {
    /// Rounds the updated node row `row` (global id) in place.
    pub fn round(&self, row: u64, values: &mut [f32]) -> Result<(), OutOfRange> {
        if !self.dtype.is_narrow() {
            return Ok(());
        }
        self.dtype.round_row(values, self.batch.rounding(row))
    }
}

/// The smallest normal f16, 2^-14.
const F16_MIN_NORMAL: f32 = 6.103_515_6e-5;
/// 2^24: f16 subnormals are the integers times its inverse.
const F16_SUBNORMAL_SCALE: f32 = 16_777_216.0;

/// `x` with its low `drop` bits cleared after adding that many of `random`'s bits: a stochastic
/// rounding of its magnitude to a grid with `drop` fewer significand bits.
#[inline]
fn keep_top_bits(x: f32, drop: u32, random: u32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let mask = (1u32 << drop) - 1;
    let bits = x.to_bits().wrapping_add(random >> (32 - drop)) & !mask;
    f32::from_bits(bits)
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = crate::UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| crate::UnknownName::new("dtype", s, "one of f32, bf16, f16"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn neighbours(d: Dtype, x: f32) -> (f32, f32) {
        // The representable values around x, by walking the nearest one's bits.
        let near = d.round_nearest(x);
        let step = |v: f32, up: bool| match d {
            Dtype::Bf16 => {
                let b = bf16::from_f32(v).to_bits();
                let b = if (v >= 0.0) == up { b + 1 } else { b - 1 };
                bf16::from_bits(b).to_f32()
            }
            _ => {
                let b = f16::from_f32(v).to_bits();
                let b = if (v >= 0.0) == up { b + 1 } else { b - 1 };
                f16::from_bits(b).to_f32()
            }
        };
        if near == x {
            (x, x)
        } else if near < x {
            (near, step(near, true))
        } else {
            (step(near, false), near)
        }
    }

    proptest! {
        #[test]
        fn stochastic_rounding_lands_on_a_neighbour(x in -1000.0f32..1000.0, r in any::<u32>()) {
            for d in [Dtype::Bf16, Dtype::F16] {
                let got = d.round_stochastic(x, r);
                let (lo, hi) = neighbours(d, x);
                prop_assert!(got == lo || got == hi, "{d}: {x} -> {got}, not {lo} or {hi}");
                prop_assert_eq!(d.round_nearest(got), got);
            }
        }

        #[test]
        fn narrowing_a_rounded_value_is_exact(x in -60000.0f32..60000.0, r in any::<u32>()) {
            for d in Dtype::ALL {
                let v = [d.round_stochastic(x, r)];
                let mut bytes = vec![0u8; d.bytes()];
                d.narrow(&v, &mut bytes);
                let mut back = [0.0f32];
                d.widen(&bytes, &mut back);
                prop_assert_eq!(back[0].to_bits(), v[0].to_bits());
            }
        }
    }

    #[test]
    fn the_expected_value_is_kept() {
        // 0.1 + 1e-4 is between two bf16 values; the mean of many roundings is near it, while
        // rounding to nearest would always give the same neighbour and lose the 1e-4.
        for (d, x) in [
            (Dtype::Bf16, 0.1001f32),
            (Dtype::F16, 0.1001),
            (Dtype::F16, 3.0e-6),
        ] {
            let stream = crate::rng::key(7, &[1]);
            let n = 200_000;
            let mean: f64 = (0..n)
                .map(|i| {
                    f64::from(d.round_stochastic(x, (crate::rng::draw(stream, i) >> 32) as u32))
                })
                .sum::<f64>()
                / n as f64;
            let (lo, hi) = neighbours(d, x);
            let tolerance = 4.0 * f64::from(hi - lo) / (n as f64).sqrt();
            assert!(
                (mean - f64::from(x)).abs() < tolerance,
                "{d} {x}: mean {mean}"
            );
        }
    }

    #[test]
    fn an_f16_overflow_names_the_element() {
        let mut row = [1.0f32, 70000.0, 2.0];
        let err = Dtype::F16.round_row(&mut row, 3).unwrap_err();
        assert_eq!((err.element, err.value), (1, 70000.0));
        assert!(Dtype::Bf16.round_row(&mut row, 3).is_ok());
    }

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(d.name().parse::<Dtype>(), Ok(d));
        }
        assert!(
            "fp16"
                .parse::<Dtype>()
                .unwrap_err()
                .to_string()
                .contains("one of f32, bf16, f16")
        );
    }
}
