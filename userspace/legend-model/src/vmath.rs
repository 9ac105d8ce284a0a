//! Branch-free `exp` and `log1p` on the ranges the losses need, written so that loops over
//! slices vectorise (std's `exp`/`ln_1p` are scalar library calls, and the softmax and logistic
//! losses take one per negative score: 2·b·k per chunk).

/// Runs `f` compiled for AVX2 where the CPU has it (the default x86-64 target stops at SSE2).
/// The floats are the same either way: Rust never contracts `a * b + c` into an FMA and the
/// reductions here fix their order, so only the vector width changes. `f` must be inlined into
/// the AVX2 frame to gain: keep it a closure that calls `#[inline(always)]` code.
#[inline(always)]
pub(crate) fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU reported AVX2.
        return unsafe { avx2(f) };
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Below this, `exp(x)` is under `f32::MIN_POSITIVE` and the result is flushed to 0.
const EXP_LO: f32 = -87.33;
/// `ln 2` split so that `n · LN2_HI` is exact for the `|n| ≤ 126` used here (Cody–Waite).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// `exp(x)` for `x ≤ 0` (including `−∞`), relative error below 3e-7; `0` below −87.33.
///
/// `x = n ln2 + r` with `|r| ≤ ln2 / 2`, `exp(r)` by its degree-7 Taylor polynomial (the
/// truncation error `r⁸/8!` is under 6e-9), and `2ⁿ` built in the exponent bits.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    // Plain selects rather than `f32::max`/`min`, whose NaN rules keep loops scalar.
    let xc = if x < EXP_LO { EXP_LO } else { x };
    let xc = if xc > 0.0 { 0.0 } else { xc };
    // Round to nearest without a rounding instruction: adding 1.5·2²³ drops the fraction.
    // The low mantissa bits of `t` then hold `n` (offset by 2²²), which also gives the integer
    // `n` without a saturating float-to-int conversion that would block vectorisation.
    const MAGIC: f32 = 12_582_912.0;
    let t = xc * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let n_int = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if x < EXP_LO { 0.0 } else { p * scale }
}

/// `ln(1 + e)` for `0 ≤ e ≤ 1`, relative error below 3e-7, exact in the limit `e → 0`.
///
/// `ln(1 + e) = 2 atanh(s)` with `s = e / (2 + e) ≤ 1/3`; the odd series to `s¹⁵` leaves a
/// relative error under `(1/9)⁸`.
#[inline(always)]
pub(crate) fn ln_1p_unit(e: f32) -> f32 {
    let s = e / (2.0 + e);
    let s2 = s * s;
    let mut p = 1.0 / 15.0;
    p = p * s2 + 1.0 / 13.0;
    p = p * s2 + 1.0 / 11.0;
    p = p * s2 + 1.0 / 9.0;
    p = p * s2 + 1.0 / 7.0;
    p = p * s2 + 1.0 / 5.0;
    p = p * s2 + 1.0 / 3.0;
    p = p * s2 + 1.0;
    2.0 * s * p
}

/// Number of independent accumulators in the reductions: enough lanes for AVX, and a fixed
/// summation order that does not depend on the target.
const LANES: usize = 8;

/// The sum of `xs`, in `LANES` interleaved partial sums (vectorisable, and more accurate than
/// one running sum).
#[inline]
pub(crate) fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The maximum of `init` and `xs`.
#[inline]
pub(crate) fn max(init: f32, xs: &[f32]) -> f32 {
    let mut acc = [init; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder().iter().fold(init, |m, &x| m.max(x));
    for c in chunks {
        for l in 0..LANES {
            acc[l] = acc[l].max(c[l]);
        }
    }
    acc.iter().fold(tail, |m, &x| m.max(x))
}

/// `Σ_t term(a_t, b_t)` in interleaved partial sums (the tail's terms summed alone).
#[inline(always)]
fn pairwise_sum(a: &[f32], b: &[f32], term: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| term(x, y))
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += term(x[l], y[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ_t |a_t − b_t|` in interleaved partial sums.
#[inline]
pub(crate) fn l1_distance(a: &[f32], b: &[f32]) -> f32 {
    pairwise_sum(a, b, |x, y| (x - y).abs())
}

/// `Σ_t a_t b_t` in interleaved partial sums.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    pairwise_sum(a, b, |x, y| x * y)
}

/// `Σ_p |(a_re,p − b_re,p) + i (a_im,p − b_im,p)|` (RotatE's distance between two complex
/// rows given as their halves) in interleaved partial sums.
#[inline(always)]
pub(crate) fn modulus_distance(a: (&[f32], &[f32]), b: (&[f32], &[f32])) -> f32 {
    let modulus = |ar: f32, ai: f32, br: f32, bi: f32| {
        let (x, y) = (ar - br, ai - bi);
        (x * x + y * y).sqrt()
    };
    let mut acc = [0.0f32; LANES];
    let (ar, ai) = (a.0.chunks_exact(LANES), a.1.chunks_exact(LANES));
    let (br, bi) = (b.0.chunks_exact(LANES), b.1.chunks_exact(LANES));
    let tail: f32 = (ar.remainder().iter().zip(ai.remainder()))
        .zip(br.remainder().iter().zip(bi.remainder()))
        .map(|((&w, &x), (&y, &z))| modulus(w, x, y, z))
        .sum();
    for ((w, x), (y, z)) in ar.zip(ai).zip(br.zip(bi)) {
        for l in 0..LANES {
            acc[l] += modulus(w[l], x[l], y[l], z[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The gradients of `g · (−modulus_distance(q, n))`: with `u = g (q − n) / |q − n|` per
/// complex element (0 where `q = n`, the zero subgradient), `∂q −= u`, `∂n += u`.
#[inline(always)]
pub(crate) fn modulus_backward(
    g: f32,
    q: (&[f32], &[f32]),
    n: (&[f32], &[f32]),
    grad_q: (&mut [f32], &mut [f32]),
    grad_n: (&mut [f32], &mut [f32]),
) {
    let pairs = (q.0.iter().zip(q.1))
        .zip(n.0.iter().zip(n.1))
        .zip(grad_q.0.iter_mut().zip(grad_q.1.iter_mut()))
        .zip(grad_n.0.iter_mut().zip(grad_n.1.iter_mut()));
    for ((((&qr, &qi), (&nr, &ni)), (gqr, gqi)), (gnr, gni)) in pairs {
        let (x, y) = (qr - nr, qi - ni);
        let m = (x * x + y * y).sqrt();
        let w = if m > 0.0 { g / m } else { 0.0 };
        *gqr -= w * x;
        *gqi -= w * y;
        *gnr += w * x;
        *gni += w * y;
    }
}

/// `Σ_t x_t²` in interleaved partial sums.
#[inline]
pub(crate) fn squared_norm(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|x| x * x).sum();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l] * c[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_on_its_range() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            worst = worst.max((got - want).abs() / want);
            x -= 0.000_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn ln_1p_is_accurate_on_the_unit_interval() {
        let mut worst = 0.0f64;
        for i in 0..=100_000 {
            let e = i as f32 / 100_000.0;
            let want = (e as f64).ln_1p();
            let got = ln_1p_unit(e) as f64;
            let err = (got - want).abs() / want.max(f64::MIN_POSITIVE);
            worst = worst.max(if e == 0.0 { got.abs() } else { err });
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(ln_1p_unit(1e-30), 1e-30);
    }

    #[test]
    fn reductions_match_plain_loops() {
        let xs: Vec<f32> = (0..37).map(|i| ((i * 17) % 11) as f32 - 5.0).collect();
        let ys: Vec<f32> = (0..37).map(|i| ((i * 5) % 7) as f32 * 0.5).collect();
        assert_eq!(sum(&xs), xs.iter().sum::<f32>());
        assert_eq!(max(-100.0, &xs), 5.0);
        assert_eq!(max(9.0, &xs), 9.0);
        let l1: f32 = xs.iter().zip(&ys).map(|(a, b)| (a - b).abs()).sum();
        assert_eq!(l1_distance(&xs, &ys), l1);
        assert_eq!(squared_norm(&xs), xs.iter().map(|x| x * x).sum::<f32>());
        let dot_plain: f32 = xs.iter().zip(&ys).map(|(a, b)| a * b).sum();
        assert_eq!(dot(&xs, &ys), dot_plain);
    }
}
