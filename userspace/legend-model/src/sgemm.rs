//! The matrix product behind the chunk scores and their gradients (the CPU engine's hot loop),
//! public so that `chunk_bench` can time each of a chunk's products against the machine's peak.

/// `C (m×n) = op(A)·op(B) + beta·C` on row-major slices, where `op(A)` is m×k (stored k×m when
/// `a_t`) and `op(B)` is k×n (stored n×k when `b_t`). Single-threaded.
///
/// # Panics
/// If a slice's length does not match its shape.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    a_t: bool,
    b: &[f32],
    b_t: bool,
    beta: f32,
    c: &mut [f32],
) {
    assert!(
        a.len() == m * k && b.len() == k * n && c.len() == m * n,
        "gemm shapes"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for x in c.iter_mut() {
            *x *= beta;
        }
        return;
    }
    let (rsa, csa) = if a_t { (1, m) } else { (k, 1) };
    let (rsb, csb) = if b_t { (1, k) } else { (n, 1) };
    // SAFETY: the asserts above make every index the strides can form lie inside `a`, `b` and
    // `c` (A: (m−1)·rsa + (k−1)·csa < m·k, likewise B and C); `c` is borrowed mutably, so it
    // aliases neither `a` nor `b`; and gemm reads `c` only when asked to (`beta ≠ 0`).
    // gemm's own naming: dst = alpha·dst + beta·lhs·rhs, dst read only when `read_dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            beta != 0.0,
            a.as_ptr(),
            csa as isize,
            rsa as isize,
            b.as_ptr(),
            csb as isize,
            rsb as isize,
            beta,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
