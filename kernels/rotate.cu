// RotatE on the GPU (legend-model's Decoder::RotatE), the unfused path: the queries of both
// sides of an edge and their backward (one warp an edge, as kernels/train_queries.cu's), and the
// three products of the modulus distance S_ij = -Σ_p |q_ip - n_jp| between complex rows
// (real parts in the first half of a row, imaginary parts in the second), on CUDA cores.
//
// A relation's row holds its phases θ in the first half (the second half is unused: it gets
// no gradient). Side 1 (destinations replaced) queries with q1 = s·e^(iθ) against d; side 0
// with q0 = d·e^(-iθ) against s (|s e^(iθ) - d| = |s - d e^(-iθ)|), or with reciprocal
// relations q0 = d·e^(iθ⁻¹), θ⁻¹ the inverse row's phases.
//
// Gradients, with G = ∂L/∂S from legend_loss and φ(z) = z / |z| (0 at z = 0, the CPU's
// subgradient): dQ_i = -Σ_j G_ij φ(q_i - n_j) and dN_j = Σ_i G_ij φ(q_i - n_j), pair by
// pair. As in kernels/distance.cu both are one body, out(a, p) = -Σ_kk A(a, kk) φ(X(a, p) -
// B(kk, p)) over the operands of the gemm kernels: for dQ A = G, X = Q, B = N; for dN A = Gᵀ,
// X = N, B = Q. A pair's modulus has no product form, so there is no tensor-core version.

// Tiles of the modulus products: 32 rows by 32 negatives for the scores, 32 rows by 16
// complex pairs for the gradients, reduction slices of 32; 256 threads a block.
#define LEGEND_MOD_ROWS 32
#define LEGEND_MOD_COLS 32
#define LEGEND_MOD_PAIRS 16
#define LEGEND_MOD_SLICE 32

// The rotation of (re, im) by the angle of (cos, sin).
__device__ __forceinline__ float2 legend_rotate(float re, float im, float c, float s) {
    return make_float2(re * c - im * s, re * s + im * c);
}

// The rotations of pair p of an edge: (c1, s1) = e^(iθ) for side 1; for side 0 e^(-iθ), or
// with reciprocal relations e^(iθ⁻¹) (θ⁻¹ from the inverse row w0).
__device__ __forceinline__ void legend_rotate_phases(const float* w, const float* w0, bool recip,
                                                     u32 p, float& c1, float& s1, float& c0,
                                                     float& s0) {
    sincosf(w[p], &s1, &c1);
    if (recip) {
        sincosf(w0[p], &s0, &c0);
    } else {
        c0 = c1;
        s0 = -s1;
    }
}

// |a - b| of two complex numbers, and a - b.
__device__ __forceinline__ float legend_modulus(float2 a, float2 b, float2& diff) {
    diff = make_float2(a.x - b.x, a.y - b.y);
    return sqrtf(diff.x * diff.x + diff.y * diff.y);
}

// The queries of edge r of chunk z0 / 2, both sides, by one warp, with their positive scores
// -Σ_p |q_p - truth_p| (legend_query_edge's work for RotatE).
extern "C" __global__ void legend_rotate_queries(LegendJobs jobs, const float* __restrict__ emb,
                                                 const float* __restrict__ rel,
                                                 float* __restrict__ query,
                                                 float* __restrict__ pos) {
    u32 z0 = 2 * blockIdx.y;
    u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (r >= jobs.rows[z0]) return;
    const u32* e = jobs.edges + 3ull * (jobs.row0[z0] + r);
    u32 d = jobs.dim, h = d / 2;
    const float* S = emb + (u64)e[0] * d;
    const float* D = emb + (u64)e[2] * d;
    const float* w = rel + (u64)e[1] * d;
    bool recip = jobs.inverse != 0u;
    const float* w0 = recip ? rel + (u64)(jobs.inverse + e[1]) * d : w;
    u64 row0 = (u64)z0 * jobs.max_rows + r, row1 = row0 + jobs.max_rows;
    float *q0 = query + row0 * d, *q1 = query + row1 * d;
    float dist[2] = {0.0f, 0.0f};
    for (u32 p = lane; p < h; p += 32) {
        float2 s = make_float2(S[p], S[p + h]), t = make_float2(D[p], D[p + h]), diff;
        float c1, s1, c0, s0;
        legend_rotate_phases(w, w0, recip, p, c1, s1, c0, s0);
        float2 a = legend_rotate(t.x, t.y, c0, s0), b = legend_rotate(s.x, s.y, c1, s1);
        dist[0] += legend_modulus(a, s, diff);
        dist[1] += legend_modulus(b, t, diff);
        q0[p] = a.x;
        q0[p + h] = a.y;
        q1[p] = b.x;
        q1[p + h] = b.y;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int k = 0; k < 2; ++k) dist[k] += __shfl_xor_sync(0xffffffffu, dist[k], o);
    if (lane == 0) {
        pos[row0] = -dist[0];
        pos[row1] = -dist[1];
    }
}

// Backward of one RotatE edge by one warp (legend_edge_backward's work): the queries are
// recomputed as legend_rotate_queries formed them; each side's ∂L/∂q is dq less gp · φ(q -
// truth) (the positive's part, whose opposite the truth gets), the anchor gets the
// rotation's transpose of it and the phase θ gets Im(conj(q) ∂L/∂q) (with side 0's sign
// through e^(-iθ); reciprocal: the inverse row's phase instead).
__device__ void legend_rotate_edge_backward(const LegendJobs& jobs, float* emb,
                                            const float* __restrict__ rel,
                                            const float* __restrict__ grad_query,
                                            const float* __restrict__ grad_pos,
                                            float* __restrict__ emb_grad, u32* emb_flags,
                                            const LegendDirect& direct,
                                            float* __restrict__ rel_grad, u32* rel_flags, u32 z0,
                                            u32 z1, u32 r, u32 lane, u32* new_rows, u32* n_rows,
                                            u32* new_rels, u32* n_rels) {
    const u32* e = jobs.edges + 3ull * (jobs.row0[z0] + r);
    u32 src = e[0], relation = e[1], dst = e[2];
    u32 d = jobs.dim, h = d / 2;
    u64 row0 = (u64)z0 * jobs.max_rows + r, row1 = (u64)z1 * jobs.max_rows + r;
    // Read before any update: a row updated in place is used by this edge alone, and each
    // lane reads the elements it then writes.
    const float* S = emb + (u64)src * d;
    const float* D = emb + (u64)dst * d;
    const float* w = rel + (u64)relation * d;
    bool recip = jobs.inverse != 0u;
    u32 inverse = jobs.inverse + relation;
    const float* w0 = recip ? rel + (u64)inverse * d : w;
    const float *dq0 = grad_query + row0 * d, *dq1 = grad_query + row1 * d;
    float gp0 = grad_pos[row0], gp1 = grad_pos[row1];
    LegendRowSink gs = legend_node_sink(emb, emb_grad, direct, src, d);
    LegendRowSink gd = legend_node_sink(emb, emb_grad, direct, dst, d);
    float* gw = rel_grad + (u64)relation * d;
    float* gw0 = rel_grad + (u64)inverse * d;
    for (u32 p = lane; p < h; p += 32) {
        float2 s = make_float2(S[p], S[p + h]), t = make_float2(D[p], D[p + h]);
        LegendVec<1> ss_re = legend_sink_states<1>(gs, p), ss_im = legend_sink_states<1>(gs, p + h);
        LegendVec<1> sd_re = legend_sink_states<1>(gd, p), sd_im = legend_sink_states<1>(gd, p + h);
        float c1, s1, c0, s0;
        legend_rotate_phases(w, w0, recip, p, c1, s1, c0, s0);
        float2 q0 = legend_rotate(t.x, t.y, c0, s0), q1 = legend_rotate(s.x, s.y, c1, s1);
        float2 x0, x1;
        float m0 = legend_modulus(q0, s, x0), m1 = legend_modulus(q1, t, x1);
        // The positives' parts: u = gp · φ(q - truth).
        float u0 = m0 > 0.0f ? gp0 / m0 : 0.0f, u1 = m1 > 0.0f ? gp1 / m1 : 0.0f;
        float2 g0 = make_float2(dq0[p] - u0 * x0.x, dq0[p + h] - u0 * x0.y);
        float2 g1 = make_float2(dq1[p] - u1 * x1.x, dq1[p + h] - u1 * x1.y);
        // The rotations' transposes (rotations by the opposite angle) back to the anchors.
        float2 back0 = legend_rotate(g0.x, g0.y, c0, -s0), back1 = legend_rotate(g1.x, g1.y, c1, -s1);
        LegendVec<1> gsre{{u0 * x0.x + back1.x}}, gsim{{u0 * x0.y + back1.y}};
        LegendVec<1> gdre{{u1 * x1.x + back0.x}}, gdim{{u1 * x1.y + back0.y}};
        // ∂q/∂θ = i·q for a rotation by +θ: ∂L/∂θ = g_im q_re - g_re q_im.
        float theta1 = g1.y * q1.x - g1.x * q1.y;
        float theta0 = g0.y * q0.x - g0.x * q0.y;
        LegendVec<1> sre{{s.x}}, sim{{s.y}}, dre{{t.x}}, dim_{{t.y}};
        legend_sink_add<1>(gs, p, gsre, sre, ss_re);
        legend_sink_add<1>(gs, p + h, gsim, sim, ss_im);
        legend_sink_add<1>(gd, p, gdre, dre, sd_re);
        legend_sink_add<1>(gd, p + h, gdim, dim_, sd_im);
        if (recip) {
            atomicAdd(gw + p, theta1);
            atomicAdd(gw0 + p, theta0);
        } else {
            // Side 0 rotates by -θ.
            atomicAdd(gw + p, theta1 - theta0);
        }
    }
    // The direct rows' ends (the row-wise step, 16-bit rounding) as the other decoders'.
    const LegendRowSink* const ends[2] = {&gs, &gd};
    const u32 end_ids[2] = {src, dst};
    legend_finish_direct_rows<true, 2>(ends, end_ids, direct.rounding, d, lane);
    __syncwarp();
    if (lane == 0)
        legend_list_edge_rows(direct, emb_flags, src, gs.direct, dst, gd.direct, rel_flags, true,
                              relation, recip, inverse, new_rows, n_rows, new_rels, n_rels);
}

// legend_rows_backward for RotatE (same arguments; `pos` is not needed: the positives'
// distances are recomputed pair by pair).
LEGEND_ROWS_BACKWARD_KERNEL(legend_rotate_rows_backward, 1,
                            legend_rotate_edge_backward(jobs, emb, rel, grad_query, grad_pos,
                                                        emb_grad, emb_flags, direct, rel_grad,
                                                        rel_flags, z0, z1, r, lane, new_rows,
                                                        n_rows, new_rels, n_rels))

// S = -Σ_p |Q_ip - N_jp| for the operands of legend_gemm_nt (Q: m_rows of m, N: n rows,
// both k-contiguous with k = dim floats, pairs (p, p + dim/2)). A block computes a 32 x 32
// tile, a thread four negatives of one row, over slices of 16 pairs staged in shared memory.
extern "C" __global__ void __launch_bounds__(256) legend_modulus_scores(LegendGemm g) {
    __shared__ float qs[LEGEND_MOD_ROWS][2 * LEGEND_MOD_PAIRS + 1];
    __shared__ float ns[LEGEND_MOD_COLS][2 * LEGEND_MOD_PAIRS + 1];
    int z = blockIdx.z;
    int m = g.m_rows ? (int)g.m_rows[z] : g.m;
    int ntiles = (g.n + LEGEND_MOD_COLS - 1) / LEGEND_MOD_COLS;
    int m0 = (blockIdx.x / ntiles) * LEGEND_MOD_ROWS;
    int n0 = (blockIdx.x % ntiles) * LEGEND_MOD_COLS;
    if (m0 >= m) return;
    const float* A = g.a + (long long)z * g.a_batch;
    const float* B = g.b + (long long)z * g.b_batch;
    int h = g.k / 2;
    int row = threadIdx.x / 8, col = threadIdx.x % 8;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int p0 = 0; p0 < h; p0 += LEGEND_MOD_PAIRS) {
        // Stage the slice: re parts at [.][c], im parts at [.][16 + c].
        for (int e = threadIdx.x; e < LEGEND_MOD_ROWS * 2 * LEGEND_MOD_PAIRS; e += 256) {
            int rr = e / (2 * LEGEND_MOD_PAIRS), c = e % (2 * LEGEND_MOD_PAIRS);
            int p = p0 + c % LEGEND_MOD_PAIRS, at = p + (c >= LEGEND_MOD_PAIRS ? h : 0);
            bool in = p < h;
            qs[rr][c] = in && m0 + rr < m ? A[(long long)(m0 + rr) * g.a_ld + at] : 0.0f;
            ns[rr][c] = in && n0 + rr < g.n ? B[(long long)(n0 + rr) * g.b_ld + at] : 0.0f;
        }
        __syncthreads();
        int pairs = min(LEGEND_MOD_PAIRS, h - p0);
        for (int c = 0; c < pairs; ++c) {
            float2 q = make_float2(qs[row][c], qs[row][LEGEND_MOD_PAIRS + c]), diff;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                int nj = col + 8 * j;
                acc[j] += legend_modulus(
                    q, make_float2(ns[nj][c], ns[nj][LEGEND_MOD_PAIRS + c]), diff);
            }
        }
        __syncthreads();
    }
    if (m0 + row >= m) return;
    float* C = g.c + (long long)z * g.c_batch + (long long)(m0 + row) * g.c_ld;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int nj = n0 + col + 8 * j;
        if (nj < g.n) C[nj] = -acc[j];
    }
}

// out(a, p) = -Σ_kk A(a, kk) φ(X(a, p) - B(kk, p)) for complex pairs p (see the top of the
// file): A is G, k-contiguous for dQ (A_KC) and not for dN; B and X are rows of dim floats
// (X in C's layout). A block takes 32 rows by 16 pairs (a thread one row, two pairs), the
// reduction in slices of 32 staged in shared memory; split over K with atomic adds as the
// gemm kernels are (k_split, atomic).
template <bool A_KC>
__device__ __forceinline__ void legend_modulus_grad_body(const LegendGemm& g,
                                                         const float* __restrict__ X) {
    __shared__ float as[LEGEND_MOD_ROWS][LEGEND_MOD_SLICE + 1];
    __shared__ float bs[LEGEND_MOD_SLICE][2 * LEGEND_MOD_PAIRS + 1];
    int z = blockIdx.z;
    int m = g.m_rows ? (int)g.m_rows[z] : g.m;
    int kdim = g.k_rows ? (int)g.k_rows[z] : g.k;
    int h = g.n / 2;
    int ptiles = (h + LEGEND_MOD_PAIRS - 1) / LEGEND_MOD_PAIRS;
    int m0 = (blockIdx.x / ptiles) * LEGEND_MOD_ROWS;
    int p0 = (blockIdx.x % ptiles) * LEGEND_MOD_PAIRS;
    if (m0 >= m) return;
    int kbeg = g.k_split ? blockIdx.y * g.k_split : 0;
    int kend = g.k_split ? min(kdim, kbeg + g.k_split) : kdim;
    if (g.atomic && kbeg >= kend) return;
    const float* A = g.a + (long long)z * g.a_batch;
    const float* B = g.b + (long long)z * g.b_batch;
    const float* Xz = X + (long long)z * g.c_batch;
    float* C = g.c + (long long)z * g.c_batch;
    int row = threadIdx.x / 8, pair = 2 * (threadIdx.x % 8);
    bool live = m0 + row < m;
    float2 x[2], acc[2];
#pragma unroll
    for (int v = 0; v < 2; ++v) {
        int p = p0 + pair + v;
        bool in = live && p < h;
        const float* xr = Xz + (long long)(m0 + row) * g.c_ld;
        x[v] = in ? make_float2(xr[p], xr[p + h]) : make_float2(0.0f, 0.0f);
        acc[v] = make_float2(0.0f, 0.0f);
    }
    for (int k0 = kbeg; k0 < kend; k0 += LEGEND_MOD_SLICE) {
        for (int e = threadIdx.x; e < LEGEND_MOD_ROWS * LEGEND_MOD_SLICE; e += 256) {
            int rr = e / LEGEND_MOD_SLICE, kk = e % LEGEND_MOD_SLICE;
            int ga = m0 + rr, gk = k0 + kk;
            bool ok = ga < m && gk < kend;
            as[rr][kk] = ok ? (A_KC ? A[(long long)ga * g.a_ld + gk] : A[(long long)gk * g.a_ld + ga])
                            : 0.0f;
        }
        for (int e = threadIdx.x; e < LEGEND_MOD_SLICE * 2 * LEGEND_MOD_PAIRS; e += 256) {
            int kk = e / (2 * LEGEND_MOD_PAIRS), c = e % (2 * LEGEND_MOD_PAIRS);
            int p = p0 + c % LEGEND_MOD_PAIRS, at = p + (c >= LEGEND_MOD_PAIRS ? h : 0);
            bool ok = k0 + kk < kend && p < h;
            bs[kk][c] = ok ? B[(long long)(k0 + kk) * g.b_ld + at] : 0.0f;
        }
        __syncthreads();
        int slice = min(LEGEND_MOD_SLICE, kend - k0);
        for (int kk = 0; kk < slice; ++kk) {
            float a = as[row][kk];
            // A zero weight (a padding entry, a filtered negative) adds nothing.
            if (a == 0.0f) continue;
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                int c = pair + v;
                float2 diff;
                float mod = legend_modulus(x[v], make_float2(bs[kk][c], bs[kk][LEGEND_MOD_PAIRS + c]),
                                           diff);
                float wgt = mod > 0.0f ? a / mod : 0.0f;
                acc[v].x = fmaf(wgt, diff.x, acc[v].x);
                acc[v].y = fmaf(wgt, diff.y, acc[v].y);
            }
        }
        __syncthreads();
    }
    if (!live) return;
    float* out = C + (long long)(m0 + row) * g.c_ld;
#pragma unroll
    for (int v = 0; v < 2; ++v) {
        int p = p0 + pair + v;
        if (p >= h) continue;
        if (g.atomic) {
            atomicAdd(out + p, -acc[v].x);
            atomicAdd(out + p + h, -acc[v].y);
        } else {
            out[p] = -acc[v].x;
            out[p + h] = -acc[v].y;
        }
    }
}

// dQ from G (legend_gemm_nn's operands: G, N), with X = Q in dQ's layout.
extern "C" __global__ void __launch_bounds__(256) legend_modulus_grad_query(
    LegendGemm g, const float* __restrict__ x) {
    legend_modulus_grad_body<true>(g, x);
}

// dN from G (legend_gemm_tn's operands: Gᵀ, Q, split over the rows with atomic adds), with
// X = N in dN's layout.
extern "C" __global__ void __launch_bounds__(256) legend_modulus_grad_negatives(
    LegendGemm g, const float* __restrict__ x) {
    legend_modulus_grad_body<false>(g, x);
}
