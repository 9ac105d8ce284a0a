// TransE on CUDA cores: the chunk score matrices S = -||q_i - n_j||_p (p = 1, 2) and their
// gradients, on the operands that the products of kernels/gemm.cu take (LegendGemm), plus
// the per-row parts that legend_queries and legend_rows_backward (kernels/train_queries.cu, train_backward.cu) call for
// the TransE decoders.
//
// Distances are summed elementwise, Σ|q - n| or Σ(q - n)², never through the expansion
// |q|² - 2 q·n + |n|²: the expansion loses the digits of near pairs to cancellation (the CPU
// engine recomputes those pairs), and on CUDA cores the direct sum costs two instructions per
// element pair against the expansion's one.
//
// Gradients, with G = ∂L/∂S from legend_loss:
//   dQ_i = -Σ_j W_ij φ(q_i - n_j),  dN_j = Σ_i W_ij φ(q_i - n_j),
// where L1 has φ = sign (sign(0) = 0) and W = G, and L2 has φ = identity and
// W_ij = G_ij / ||q_i - n_j|| (0 at distance 0): the zero subgradients of legend-model's
// Comparator::backward. Both are one kernel body, out(m, n) = -Σ_kk A(m, kk) φ(X(m, n) -
// B(kk, n)): for dQ (m = i, kk = j, n = embedding column) A = W, X = Q, B = N; for dN
// (m = j, kk = i) A = Wᵀ, X = N, B = Q, since φ(n - q) = -φ(q - n).
//
// Tiling: 256 threads as 16 x 16, each with 8 output rows (two groups of 4, 64 apart) and 8
// (scores) or 4 (gradients) columns, so the output tiles are 128 x 128 and 128 x 64. Slices
// of 8 along the reduction are staged in shared memory as [kk][row], double-buffered through
// registers, and read back as 16-byte vectors. One block a multiprocessor (the gradients take
// about 230 registers, the scores 170, no spills): on an H100, capping them at 128 for two
// blocks made the L2 gradients 20-30% slower, more than it saved elsewhere (Documentation/gpu.md).

#define LEGEND_DIST_BK 8
#define LEGEND_DIST_BM 128
#define LEGEND_DIST_SN 128
#define LEGEND_DIST_GN 64
// Row stride of a staged [kk][row] slice: 4 words of padding make the transposing stores of
// a warp (8 kk by 4 rows) hit 32 different banks.
#define LEGEND_DIST_ROW(rows) ((rows) + 4)
#define LEGEND_DIST_SLICE(rows) (LEGEND_DIST_BK * LEGEND_DIST_ROW(rows))

// Row (or column) `i` of a thread's micro tile: two groups of 4, 64 apart, so that the 16
// threads of a half-warp read 64 consecutive floats of a staged row.
__device__ __forceinline__ int legend_dist_at(int t, int i) {
    return (i & 4) * 16 + t * 4 + (i & 3);
}

// One element pair's term of the distance: |x| or x².
template <bool L2>
__device__ __forceinline__ float legend_dist_term(float x, float acc) {
    return L2 ? fmaf(x, x, acc) : acc + fabsf(x);
}

// φ(x - b): x - b for L2, sign(x - b) for L1 (compared directly: with subnormals, x - b is
// zero exactly when x == b, and has the sign of the comparison otherwise).
template <bool L2>
__device__ __forceinline__ float legend_dist_phi(float x, float b) {
    return L2 ? x - b : (x > b ? 1.0f : 0.0f) - (x < b ? 1.0f : 0.0f);
}

// The TransE part of legend_query_edge, V elements a lane: q0 = D - w against the true
// source S (side 0; with reciprocal relations, `recip`, q0 = D + w0, the destination-side
// operator of (D, r⁻¹)) and q1 = S + w against D (side 1), written out, and each side's
// distance to its truth into dist (this lane's part of Σ|x| or Σx²). With norms (TransE L2
// on the fused path), also this lane's parts of the queries' largest magnitudes and of
// their squared norms as the fused kernels round them: to FP16's digits, since their FP16
// scale follows from the largest magnitude of the job, which is not known yet.
template <int V>
__device__ __forceinline__ void legend_transe_queries(bool l2, u32 d, const float* S,
                                                      const float* D, const float* w,
                                                      const float* w0, bool recip, float* q0,
                                                      float* q1, u32 lane, float (&dist)[2],
                                                      float (&sq)[2], float (&largest)[2],
                                                      bool norms) {
    for (u32 k = V * lane; k < d; k += 32 * V) {
        LegendVec<V> s = legend_ld<V>(S + k), t = legend_ld<V>(D + k), r = legend_ld<V>(w + k);
        LegendVec<V> r0 = recip ? legend_ld<V>(w0 + k) : r;
        LegendVec<V> a, b;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            a.v[v] = recip ? t.v[v] + r0.v[v] : t.v[v] - r.v[v];
            b.v[v] = s.v[v] + r.v[v];
            float x0 = a.v[v] - s.v[v], x1 = b.v[v] - t.v[v];
            dist[0] = l2 ? legend_dist_term<true>(x0, dist[0]) : legend_dist_term<false>(x0, dist[0]);
            dist[1] = l2 ? legend_dist_term<true>(x1, dist[1]) : legend_dist_term<false>(x1, dist[1]);
            if (norms) {
                float ra = legend_fp16_digits(a.v[v]), rb = legend_fp16_digits(b.v[v]);
                sq[0] = fmaf(ra, ra, sq[0]);
                sq[1] = fmaf(rb, rb, sq[1]);
                largest[0] = fmaxf(largest[0], fabsf(a.v[v]));
                largest[1] = fmaxf(largest[1], fabsf(b.v[v]));
            }
        }
        legend_st<V>(q0 + k, a);
        legend_st<V>(q1 + k, b);
    }
}

// The TransE part of legend_rows_backward (one warp, one edge, both sides, V elements a
// lane). The queries are recomputed as legend_transe_queries formed them (bit for bit):
// q0 = D - w (reciprocal: D + w0) against the true source S, q1 = S + w against D. The
// negatives' part of ∂L/∂q is dq - wq · q (wq: what the fused kernels left out, 0
// elsewhere), and c is the positive's weight: gp for L1, gp / ||q - truth|| for L2 (0 at
// distance 0). With u = c · φ(q - truth), ∂L/∂q is that part less u and the truth gets +u;
// the anchor gets ∂L/∂q and the relation ±∂L/∂q (reciprocal: w gets side 1's, the inverse
// row w0 side 0's). Every row also gets the regulariser's gradient of its occurrence. X:
// whether either may be on (false compiles the plain step, whose registers they would crowd).
template <int V, bool X>
__device__ __forceinline__ void legend_transe_edge_backward(
    LegendPenalty pen, bool recip, bool l2, u32 d, u32 lane, const float* S, const float* D,
    const float* w, const float* w0, const float* dq0, const float* dq1, float2 wq, float c0,
    float c1, const LegendRowSink& gs, const LegendRowSink& gd, const LegendRowSink& gw,
    const LegendRowSink& gw0) {
    recip = X && recip;
    bool penalised = X && pen.kind != LEGEND_PENALTY_NONE;
    for (u32 k = V * lane; k < d; k += 32 * V) {
        LegendVec<V> s = legend_ld<V>(S + k), t = legend_ld<V>(D + k), r = legend_ld<V>(w + k);
        LegendVec<V> r0 = recip ? legend_ld<V>(w0 + k) : r;
        LegendVec<V> a0 = legend_ld<V>(dq0 + k), a1 = legend_ld<V>(dq1 + k);
        LegendVec<V> ss = legend_sink_states<V>(gs, k), sd = legend_sink_states<V>(gd, k);
        LegendVec<V> ps, pd, pw, pw0;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            float q0 = recip ? t.v[v] + r0.v[v] : t.v[v] - r.v[v], q1 = s.v[v] + r.v[v];
            float u0 = c0 * (l2 ? q0 - s.v[v] : legend_dist_phi<false>(q0, s.v[v]));
            float u1 = c1 * (l2 ? q1 - t.v[v] : legend_dist_phi<false>(q1, t.v[v]));
            float g0 = fmaf(-wq.x, q0, a0.v[v]) - u0, g1 = fmaf(-wq.y, q1, a1.v[v]) - u1;
            ps.v[v] = u0 + g1;
            pd.v[v] = g0 + u1;
            pw.v[v] = recip ? g1 : g1 - g0;
            pw0.v[v] = g0;
            if (penalised) {
                ps.v[v] += legend_penalty_grad(pen, s.v[v]);
                pd.v[v] += legend_penalty_grad(pen, t.v[v]);
                pw.v[v] += legend_penalty_grad(pen, r.v[v]);
                pw0.v[v] += legend_penalty_grad(pen, r0.v[v]);
            }
        }
        legend_sink_add<V>(gs, k, ps, s, ss);
        legend_sink_add<V>(gd, k, pd, t, sd);
        legend_sink_add<V>(gw, k, pw, LegendVec<V>{}, LegendVec<V>{});
        if (recip) legend_sink_add<V>(gw0, k, pw0, LegendVec<V>{}, LegendVec<V>{});
    }
}

// Loads one BK-slice (k0 .. k0 + BK, below kend) of ROWS rows (r0 .., below rlim) of an
// operand into registers, zeros outside: element (r, kk) at P[r * ld + kk] when k-contiguous
// (KC), else at P[kk * ld + r]. Consecutive threads read consecutive addresses either way.
template <int ROWS, bool KC>
__device__ __forceinline__ void legend_dist_load(const float* P, long long ld, int r0, int rlim,
                                                 int k0, int kend, float* v) {
#pragma unroll
    for (int u = 0; u < ROWS * LEGEND_DIST_BK / 256; ++u) {
        int e = threadIdx.x + u * 256;
        int r = KC ? e / LEGEND_DIST_BK : e % ROWS;
        int kk = KC ? e % LEGEND_DIST_BK : e / ROWS;
        int gr = r0 + r, gk = k0 + kk;
        bool ok = gr < rlim && gk < kend;
        v[u] = ok ? (KC ? P[(long long)gr * ld + gk] : P[(long long)gk * ld + gr]) : 0.0f;
    }
}

// Stores what legend_dist_load<ROWS, KC> loaded into a [kk][row] slice.
template <int ROWS, bool KC>
__device__ __forceinline__ void legend_dist_store(float* s, const float* v) {
#pragma unroll
    for (int u = 0; u < ROWS * LEGEND_DIST_BK / 256; ++u) {
        int e = threadIdx.x + u * 256;
        int r = KC ? e / LEGEND_DIST_BK : e % ROWS;
        int kk = KC ? e % LEGEND_DIST_BK : e / ROWS;
        s[kk * LEGEND_DIST_ROW(ROWS) + r] = v[u];
    }
}

// Four consecutive floats of a staged slice (16-byte aligned: the row strides are multiples
// of 4 floats).
__device__ __forceinline__ float4 legend_dist_vec(const float* s, int at) {
    return *reinterpret_cast<const float4*>(s + at);
}

// S = -dist(Q_i, N_j) for the operands of legend_gemm_nt (both k-contiguous); L2 also
// writes the inverse distances (0 at distance 0) into `inv_dist` (C's layout), which the
// gradient kernels multiply G with.
template <bool L2>
__device__ __forceinline__ void legend_dist_scores_body(const LegendGemm& g, float* inv_dist,
                                                        float* as, float* bs) {
    int z = blockIdx.z;
    int m = g.m_rows ? (int)g.m_rows[z] : g.m;
    int ntiles = (g.n + LEGEND_DIST_SN - 1) / LEGEND_DIST_SN;
    int m0 = (blockIdx.x / ntiles) * LEGEND_DIST_BM;
    int n0 = (blockIdx.x % ntiles) * LEGEND_DIST_SN;
    if (m0 >= m) return;
    const float* A = g.a + (long long)z * g.a_batch;
    const float* B = g.b + (long long)z * g.b_batch;
    int tm = threadIdx.x >> 4, tn = threadIdx.x & 15;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    const int SA = LEGEND_DIST_SLICE(LEGEND_DIST_BM), SB = LEGEND_DIST_SLICE(LEGEND_DIST_SN);
    float va[4], vb[4];
    legend_dist_load<LEGEND_DIST_BM, true>(A, g.a_ld, m0, m, 0, g.k, va);
    legend_dist_load<LEGEND_DIST_SN, true>(B, g.b_ld, n0, g.n, 0, g.k, vb);
    legend_dist_store<LEGEND_DIST_BM, true>(as, va);
    legend_dist_store<LEGEND_DIST_SN, true>(bs, vb);
    __syncthreads();
    for (int k0 = 0, it = 0; k0 < g.k; k0 += LEGEND_DIST_BK, ++it) {
        bool more = k0 + LEGEND_DIST_BK < g.k;
        // The next slice's loads are in flight while this one is computed.
        if (more) {
            int next = k0 + LEGEND_DIST_BK;
            legend_dist_load<LEGEND_DIST_BM, true>(A, g.a_ld, m0, m, next, g.k, va);
            legend_dist_load<LEGEND_DIST_SN, true>(B, g.b_ld, n0, g.n, next, g.k, vb);
        }
        const float* sa = as + (it & 1) * SA;
        const float* sb = bs + (it & 1) * SB;
#pragma unroll
        for (int kk = 0; kk < LEGEND_DIST_BK; ++kk) {
            const float* ra = sa + kk * LEGEND_DIST_ROW(LEGEND_DIST_BM);
            const float* rb = sb + kk * LEGEND_DIST_ROW(LEGEND_DIST_SN);
            float4 a0 = legend_dist_vec(ra, tm * 4), a1 = legend_dist_vec(ra, 64 + tm * 4);
            float4 b0 = legend_dist_vec(rb, tn * 4), b1 = legend_dist_vec(rb, 64 + tn * 4);
            float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    acc[i][j] = legend_dist_term<L2>(a[i] - b[j], acc[i][j]);
        }
        // The other buffer was last read before the previous barrier.
        if (more) {
            legend_dist_store<LEGEND_DIST_BM, true>(as + ((it + 1) & 1) * SA, va);
            legend_dist_store<LEGEND_DIST_SN, true>(bs + ((it + 1) & 1) * SB, vb);
        }
        __syncthreads();
    }
    float* C = g.c + (long long)z * g.c_batch;
    float* Dz = inv_dist + (long long)z * g.c_batch;
    bool vec = (reinterpret_cast<unsigned long long>(C) & 15) == 0 && (g.c_ld & 3) == 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int row = m0 + legend_dist_at(tm, i);
        if (row >= m) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int col = n0 + legend_dist_at(tn, 4 * h);
            float v[4], r[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                v[c] = L2 ? sqrtf(acc[i][4 * h + c]) : acc[i][4 * h + c];
                r[c] = v[c] > 0.0f ? 1.0f / v[c] : 0.0f;
            }
            long long at = (long long)row * g.c_ld + col;
            if (vec && col + 3 < g.n) {
                *reinterpret_cast<float4*>(C + at) = make_float4(-v[0], -v[1], -v[2], -v[3]);
                if (L2) *reinterpret_cast<float4*>(Dz + at) = make_float4(r[0], r[1], r[2], r[3]);
            } else {
                for (int c = 0; c < 4 && col + c < g.n; ++c) {
                    C[at + c] = -v[c];
                    if (L2) Dz[at + c] = r[c];
                }
            }
        }
    }
}

// Loads the gradient kernels' slice k0 .. of G (and of the inverse distances for L2) and of B.
template <bool A_KC, bool L2>
__device__ __forceinline__ void legend_dist_grad_load(const LegendGemm& g, const float* A,
                                                      const float* D, const float* B, int m0,
                                                      int m, int n0, int k0, int kend,
                                                      float* ga, float* da, float* vb) {
    legend_dist_load<LEGEND_DIST_BM, A_KC>(A, g.a_ld, m0, m, k0, kend, ga);
    if (L2) legend_dist_load<LEGEND_DIST_BM, A_KC>(D, g.a_ld, m0, m, k0, kend, da);
    legend_dist_load<LEGEND_DIST_GN, false>(B, g.b_ld, n0, g.n, k0, kend, vb);
}

// Stores a loaded slice, forming W = G, or G times the inverse distance for L2.
template <bool A_KC, bool L2>
__device__ __forceinline__ void legend_dist_grad_store(float* as, float* bs, float* ga,
                                                       const float* da, const float* vb) {
    if (L2) {
#pragma unroll
        for (int u = 0; u < 4; ++u) ga[u] *= da[u];
    }
    legend_dist_store<LEGEND_DIST_BM, A_KC>(as, ga);
    legend_dist_store<LEGEND_DIST_GN, false>(bs, vb);
}

// out(m, n) = -Σ_kk A(m, kk) φ(X(m, n) - B(kk, n)) (see the top of the file). A is G (with
// the inverse distances in the same layout for L2), k-contiguous for dQ and not for dN; B is
// n-contiguous; X has C's layout. Split over K with atomic adds as in legend_gemm.
template <bool A_KC, bool L2>
__device__ __forceinline__ void legend_dist_grad_body(const LegendGemm& g, const float* X,
                                                      const float* inv_dist, float* as,
                                                      float* bs) {
    int z = blockIdx.z;
    int m = g.m_rows ? (int)g.m_rows[z] : g.m;
    int kdim = g.k_rows ? (int)g.k_rows[z] : g.k;
    int ntiles = (g.n + LEGEND_DIST_GN - 1) / LEGEND_DIST_GN;
    int m0 = (blockIdx.x / ntiles) * LEGEND_DIST_BM;
    int n0 = (blockIdx.x % ntiles) * LEGEND_DIST_GN;
    if (m0 >= m) return;
    int kbeg = g.k_split ? blockIdx.y * g.k_split : 0;
    int kend = g.k_split ? min(kdim, kbeg + g.k_split) : kdim;
    if (g.atomic && kbeg >= kend) return;
    const float* A = g.a + (long long)z * g.a_batch;
    const float* Dz = inv_dist + (long long)z * g.a_batch;
    const float* B = g.b + (long long)z * g.b_batch;
    float* C = g.c + (long long)z * g.c_batch;
    const float* Xz = X + (long long)z * g.c_batch;
    int tm = threadIdx.x >> 4, tn = threadIdx.x & 15;
    float x[8][4], acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int row = m0 + legend_dist_at(tm, i);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int col = n0 + tn * 4 + j;
            x[i][j] = row < m && col < g.n ? Xz[(long long)row * g.c_ld + col] : 0.0f;
            acc[i][j] = 0.0f;
        }
    }
    const int SA = LEGEND_DIST_SLICE(LEGEND_DIST_BM), SB = LEGEND_DIST_SLICE(LEGEND_DIST_GN);
    float ga[4], da[4], vb[2];
    legend_dist_grad_load<A_KC, L2>(g, A, Dz, B, m0, m, n0, kbeg, kend, ga, da, vb);
    legend_dist_grad_store<A_KC, L2>(as, bs, ga, da, vb);
    __syncthreads();
    for (int k0 = kbeg, it = 0; k0 < kend; k0 += LEGEND_DIST_BK, ++it) {
        bool more = k0 + LEGEND_DIST_BK < kend;
        if (more)
            legend_dist_grad_load<A_KC, L2>(g, A, Dz, B, m0, m, n0, k0 + LEGEND_DIST_BK, kend,
                                            ga, da, vb);
        const float* sa = as + (it & 1) * SA;
        const float* sb = bs + (it & 1) * SB;
#pragma unroll
        for (int kk = 0; kk < LEGEND_DIST_BK; ++kk) {
            const float* ra = sa + kk * LEGEND_DIST_ROW(LEGEND_DIST_BM);
            float4 a0 = legend_dist_vec(ra, tm * 4), a1 = legend_dist_vec(ra, 64 + tm * 4);
            float4 b0 = legend_dist_vec(sb + kk * LEGEND_DIST_ROW(LEGEND_DIST_GN), tn * 4);
            float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float b[4] = {b0.x, b0.y, b0.z, b0.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    acc[i][j] = fmaf(a[i], legend_dist_phi<L2>(x[i][j], b[j]), acc[i][j]);
        }
        if (more)
            legend_dist_grad_store<A_KC, L2>(as + ((it + 1) & 1) * SA, bs + ((it + 1) & 1) * SB,
                                             ga, da, vb);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int row = m0 + legend_dist_at(tm, i);
        if (row >= m) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int col = n0 + tn * 4 + j;
            if (col >= g.n) continue;
            float* out = &C[(long long)row * g.c_ld + col];
            if (g.atomic)
                atomicAdd(out, -acc[i][j]);
            else
                *out = -acc[i][j];
        }
    }
}

// S = -||Q_i - N_j||_p: the operands of legend_gemm_nt; `l2` picks p = 2 (and the inverse
// distances written into `inv_dist`, C's layout), else p = 1 (`inv_dist` unused).
extern "C" __global__ void __launch_bounds__(256, 1) legend_dist_scores(
    LegendGemm g, int l2, float* __restrict__ inv_dist) {
    __shared__ __align__(16) float as[2 * LEGEND_DIST_SLICE(LEGEND_DIST_BM)];
    __shared__ __align__(16) float bs[2 * LEGEND_DIST_SLICE(LEGEND_DIST_SN)];
    if (l2)
        legend_dist_scores_body<true>(g, inv_dist, as, bs);
    else
        legend_dist_scores_body<false>(g, inv_dist, as, bs);
}

// dQ from G (legend_gemm_nn's operands: G, N), with X = Q in dQ's layout and, for L2, the
// inverse distances in G's layout.
extern "C" __global__ void __launch_bounds__(256, 1) legend_dist_grad_query(
    LegendGemm g, int l2, const float* __restrict__ x, const float* __restrict__ inv_dist) {
    __shared__ __align__(16) float as[2 * LEGEND_DIST_SLICE(LEGEND_DIST_BM)];
    __shared__ __align__(16) float bs[2 * LEGEND_DIST_SLICE(LEGEND_DIST_GN)];
    if (l2)
        legend_dist_grad_body<true, true>(g, x, inv_dist, as, bs);
    else
        legend_dist_grad_body<true, false>(g, x, inv_dist, as, bs);
}

// dN from G (legend_gemm_tn's operands: Gᵀ, Q, split over the rows with atomic adds), with
// X = N in dN's layout and, for L2, the inverse distances in G's layout.
extern "C" __global__ void __launch_bounds__(256, 1) legend_dist_grad_negatives(
    LegendGemm g, int l2, const float* __restrict__ x, const float* __restrict__ inv_dist) {
    __shared__ __align__(16) float as[2 * LEGEND_DIST_SLICE(LEGEND_DIST_BM)];
    __shared__ __align__(16) float bs[2 * LEGEND_DIST_SLICE(LEGEND_DIST_GN)];
    if (l2)
        legend_dist_grad_body<false, true>(g, x, inv_dist, as, bs);
    else
        legend_dist_grad_body<false, false>(g, x, inv_dist, as, bs);
}
