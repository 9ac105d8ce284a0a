// Fused chunk products for the dot-comparator decoders (d <= 128): the score matrix of a
// chunk never leaves the chip. It is the attention pattern with the queries as queries and
// the negatives as both keys and values, so it is computed the way attention is:
//
// - legend_fused_rows_dN: a block owns 128 rows of a job and walks over the job's negatives
//   in tiles of 64: S = Q·Nᵀ (TF32 mma), the loss turns S into G in registers (softmax with
//   a running maximum and sum, rescaling the accumulator; logistic and ranking elementwise),
//   dQ += G·N. It ends with dQ, ∂L/∂pos, the loss and each row's statistics.
// - legend_fused_negatives_dN: a block owns 128 negatives of a job and walks over the job's
//   rows (a range of them when the rows are split): S again, G from the rows' statistics,
//   dN += Gᵀ·Q.
//
// The block's own operand sits in shared memory for the whole walk, the walked one comes
// through shared memory in two cp.async stages of 64 rows. One warp owns two 16-row tiles,
// so each B fragment it loads feeds two products (with one tile a warp, and its A fragments
// in registers, the kernels waited on shared-memory loads: 2.02 ms for both at the benchmark
// batch against 1.80 ms now, see Documentation/gpu.md). G goes from
// the accumulator of S straight into the A fragment of the next product, without a shuffle:
// in a k8 step the accumulator lane (g, t) holds columns 2t and 2t + 1, so the step takes
// its k slots t and t + 4 as columns 2t and 2t + 1, and the B fragment reads the matching
// rows. Both operands in shared memory are already rounded to TF32: the negatives by
// legend_gather_negatives, the queries by the rows kernel (query_tf32).

#define LEGEND_FUSED_WARPS 4
#define LEGEND_FUSED_TILE (16 * LEGEND_FUSED_WARPS)

struct LegendFused {
    const float* query;   // group x max_rows x dim
    float* query_tf32;    // the same, rounded to TF32 (written by the rows kernel)
    const float* negs;    // group x k x dim, rounded to TF32
    const float* pos;     // group x max_rows
    float* grad_pos;      // group x max_rows
    float* grad_query;    // group x max_rows x dim: sum over j of G_ij n_j
    float* grad_negs;     // group x k x dim: sum over i of G_ij q_i
    float2* stats;        // group x max_rows: softmax (max, 1 / sum), else (pos, 0)
    const u32* rows;      // rows of each job of the group
    double* loss_sum;
    u32 max_rows;
    u32 k;
    u32 dim;
    int loss;
    float margin;
    // Rows are 16-byte aligned (dim % 4 == 0): 16-byte copies into shared memory.
    int vec;
    // Rows per blockIdx.y range in the negatives kernel (a multiple of the tile).
    u32 row_split;
    // Whether the negatives kernel adds into grad_negs (row ranges > 1) or stores.
    int atomic;
};

__device__ __forceinline__ void legend_mma_tf32(float* c, u32 a0, u32 a1, u32 a2, u32 a3,
                                                u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Queues the copy of rows [r0, r0 + TILE) of a rows x dim matrix into a [TILE][SROW] tile,
// columns padded with zeros to 8·DK and rows at or past `rlim` zero.
template <int DK>
__device__ __forceinline__ void legend_fused_tile(const float* P, u32 dim, u32 r0, u32 rlim,
                                                  float* S, bool vec) {
    constexpr int SROW = 8 * DK + 4;
    if (vec) {
        constexpr int PER_ROW = 2 * DK;
        for (int e = threadIdx.x; e < LEGEND_FUSED_TILE * PER_ROW; e += 32 * LEGEND_FUSED_WARPS) {
            int i = e / PER_ROW, c = (e % PER_ROW) * 4;
            u32 r = r0 + i;
            int bytes = r < rlim ? 4 * min(max((int)dim - c, 0), 4) : 0;
            const float* src = bytes ? P + (u64)r * dim + c : P;
            legend_cp16(&S[i * SROW + c], src, bytes);
        }
    } else {
        constexpr int PER_ROW = 8 * DK;
        for (int e = threadIdx.x; e < LEGEND_FUSED_TILE * PER_ROW; e += 32 * LEGEND_FUSED_WARPS) {
            int i = e / PER_ROW, c = e % PER_ROW;
            u32 r = r0 + i;
            bool ok = r < rlim && (u32)c < dim;
            legend_cp4(&S[i * SROW + c], ok ? P + (u64)r * dim + c : P, ok);
        }
    }
}

// G of one score: softmax probability from the row's (max, 1 / sum), the logistic loss's
// weighted sigmoid, or the ranking hinge's indicator (st.x is the positive score then).
__device__ __forceinline__ float legend_fused_grad(int loss, float s, float2 st, float w,
                                                   float margin) {
    if (loss == LEGEND_LOSS_SOFTMAX) return __expf(s - st.x) * st.y;
    if (loss == LEGEND_LOSS_LOGISTIC) return w / (1.0f + __expf(-s));
    return margin - st.x + s > 0.0f ? 1.0f : 0.0f;
}

// Sums v over the four lanes of a quad (the lanes holding one row of an accumulator).
__device__ __forceinline__ float legend_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float legend_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// The A operand of a block (its rows, or its negatives) staged once in shared memory: BR
// rows of 8·DK columns, zero past `dim` and at rows from `rlim`; each warp takes 16·MT of
// them, so that every B fragment it loads feeds MT products.
#define LEGEND_FUSED_MT 2
#define LEGEND_FUSED_BLOCK_ROWS (16 * LEGEND_FUSED_MT * LEGEND_FUSED_WARPS)

// The A fragments of k8 step kk for the warp's MT row tiles, from a [rows][SROW] tile.
template <int SROW>
__device__ __forceinline__ void legend_fused_afrag(const float* sa, int row0, int kk, int g,
                                                   int t, u32 (&a)[LEGEND_FUSED_MT][4]) {
#pragma unroll
    for (int m = 0; m < LEGEND_FUSED_MT; ++m) {
        const float* p = sa + (row0 + 16 * m + g) * SROW + 8 * kk + t;
        a[m][0] = __float_as_uint(p[0]);
        a[m][1] = __float_as_uint(p[8 * SROW]);
        a[m][2] = __float_as_uint(p[4]);
        a[m][3] = __float_as_uint(p[8 * SROW + 4]);
    }
}

// s[m][j] = A(tile m) · B(rows 8j..8j+7 of the walked tile)ᵀ over the padded width.
template <int DK>
__device__ __forceinline__ void legend_fused_scores(const float* sa, int row0, const float* sb,
                                                    int g, int t,
                                                    float (&s)[LEGEND_FUSED_MT][8][4]) {
    constexpr int SROW = 8 * DK + 4;
#pragma unroll
    for (int m = 0; m < LEGEND_FUSED_MT; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) s[m][j][q] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
        u32 a[LEGEND_FUSED_MT][4];
        legend_fused_afrag<SROW>(sa, row0, kk, g, t, a);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float* b = sb + (8 * j + g) * SROW + 8 * kk + t;
            u32 b0 = __float_as_uint(b[0]), b1 = __float_as_uint(b[4]);
#pragma unroll
            for (int m = 0; m < LEGEND_FUSED_MT; ++m)
                legend_mma_tf32(s[m][j], a[m][0], a[m][1], a[m][2], a[m][3], b0, b1);
        }
    }
}

// acc[m] += G(tile m, as left in s) · (the walked tile), k8 step j taking columns 8j + 2t
// and 8j + 2t + 1 as its slots t and t + 4.
template <int DK>
__device__ __forceinline__ void legend_fused_accumulate(const float (&s)[LEGEND_FUSED_MT][8][4],
                                                        const float* sb, int g, int t,
                                                        float (&acc)[LEGEND_FUSED_MT][DK][4]) {
    constexpr int SROW = 8 * DK + 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        u32 ga[LEGEND_FUSED_MT][4];
#pragma unroll
        for (int m = 0; m < LEGEND_FUSED_MT; ++m) {
            ga[m][0] = legend_tf32(s[m][j][0]);
            ga[m][1] = legend_tf32(s[m][j][2]);
            ga[m][2] = legend_tf32(s[m][j][1]);
            ga[m][3] = legend_tf32(s[m][j][3]);
        }
        const float* b = sb + (8 * j + 2 * t) * SROW + g;
#pragma unroll
        for (int n = 0; n < DK; ++n) {
            u32 b0 = __float_as_uint(b[8 * n]), b1 = __float_as_uint(b[SROW + 8 * n]);
#pragma unroll
            for (int m = 0; m < LEGEND_FUSED_MT; ++m)
                legend_mma_tf32(acc[m][n], ga[m][0], ga[m][1], ga[m][2], ga[m][3], b0, b1);
        }
    }
}

template <int DK>
__device__ __forceinline__ void legend_fused_rows_body(const LegendFused& f) {
    extern __shared__ float legend_fused_smem[];
    constexpr int SROW = 8 * DK + 4;
    constexpr int T = LEGEND_FUSED_TILE;
    constexpr int MT = LEGEND_FUSED_MT;
    constexpr int BR = LEGEND_FUSED_BLOCK_ROWS;
    __shared__ float block_loss[LEGEND_FUSED_WARPS];
    u32 z = blockIdx.y;
    u32 nrows = f.rows[z];
    u32 r_block = blockIdx.x * BR;
    if (r_block >= nrows) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u64 base = (u64)z * f.max_rows;
    u32 dim = f.dim, k = f.k;
    float* sa = legend_fused_smem;
    float* sb0 = legend_fused_smem + BR * SROW;

    // The block's queries, rounded once into shared memory; the rounded copy in device memory
    // is what the negatives kernel reads.
    for (int e = threadIdx.x; e < BR * 8 * DK; e += 32 * LEGEND_FUSED_WARPS) {
        int i = e / (8 * DK), c = e % (8 * DK);
        u32 r = r_block + i;
        bool ok = r < nrows && (u32)c < dim;
        u64 at = (base + r) * dim + c;
        float v = __uint_as_float(legend_tf32(ok ? f.query[at] : 0.0f));
        sa[i * SROW + c] = v;
        if (ok) f.query_tf32[at] = v;
    }
    int row0 = warp * 16 * MT;
    // Per row tile m: rows a = r_block + row0 + 16m + g and b = a + 8.
    u32 ra[MT];
    bool va[MT], vb[MT];
    float pa[MT], pb[MT], ma[MT], mb[MT], la[MT], lb[MT], activa[MT], activb[MT];
    float w = 1.0f / (float)k;
    float acc[MT][DK][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        ra[m] = r_block + row0 + 16 * m + g;
        va[m] = ra[m] < nrows;
        vb[m] = ra[m] + 8 < nrows;
        pa[m] = va[m] ? f.pos[base + ra[m]] : 0.0f;
        pb[m] = vb[m] ? f.pos[base + ra[m] + 8] : 0.0f;
        // Softmax: running max (the positive's score to begin with) and this lane's part of
        // the running sum (the positive counted once, by lane t = 0). Other losses: sums.
        ma[m] = pa[m];
        mb[m] = pb[m];
        la[m] = lb[m] = (f.loss == LEGEND_LOSS_SOFTMAX && t == 0) ? 1.0f : 0.0f;
        activa[m] = activb[m] = 0.0f;
#pragma unroll
        for (int n = 0; n < DK; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[m][n][q] = 0.0f;
    }

    const float* N = f.negs + (u64)z * k * dim;
    int tiles = (k + T - 1) / T;
    legend_fused_tile<DK>(N, dim, 0, k, sb0, f.vec);
    asm volatile("cp.async.commit_group;\n" ::);
    for (int it = 0; it < tiles; ++it) {
        if (it + 1 < tiles)
            legend_fused_tile<DK>(N, dim, (it + 1) * T, k, sb0 + ((it + 1) & 1) * T * SROW, f.vec);
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();
        const float* sn = sb0 + (it & 1) * T * SROW;
        float s[MT][8][4];
        legend_fused_scores<DK>(sa, row0, sn, g, t, s);
        u32 n0 = it * T + 2 * t;
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (f.loss == LEGEND_LOSS_SOFTMAX) {
                float xa = __int_as_float(0xff800000), xb = xa;
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        if (n0 + 8 * j + (q & 1) >= k) s[m][j][q] = __int_as_float(0xff800000);
                        if (q < 2) xa = fmaxf(xa, s[m][j][q]); else xb = fmaxf(xb, s[m][j][q]);
                    }
                float na = fmaxf(ma[m], legend_quad_max(xa));
                float nb = fmaxf(mb[m], legend_quad_max(xb));
                float sca = __expf(ma[m] - na), scb = __expf(mb[m] - nb);
                ma[m] = na;
                mb[m] = nb;
                la[m] *= sca;
                lb[m] *= scb;
#pragma unroll
                for (int n = 0; n < DK; ++n) {
                    acc[m][n][0] *= sca;
                    acc[m][n][1] *= sca;
                    acc[m][n][2] *= scb;
                    acc[m][n][3] *= scb;
                }
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        s[m][j][q] = __expf(s[m][j][q] - (q < 2 ? na : nb));
                        if (q < 2) la[m] += s[m][j][q]; else lb[m] += s[m][j][q];
                    }
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        float x = s[m][j][q];
                        bool ok = n0 + 8 * j + (q & 1) < k;
                        float term, grad;
                        if (f.loss == LEGEND_LOSS_LOGISTIC) {
                            float ex = __expf(-fabsf(x));
                            term = w * (fmaxf(x, 0.0f) + log1pf(ex));
                            grad = w * (x >= 0.0f ? 1.0f : ex) / (1.0f + ex);
                        } else {
                            float v = f.margin - (q < 2 ? pa[m] : pb[m]) + x;
                            term = v > 0.0f ? v : 0.0f;
                            grad = v > 0.0f ? 1.0f : 0.0f;
                        }
                        term = ok ? term : 0.0f;
                        s[m][j][q] = ok ? grad : 0.0f;
                        if (q < 2) {
                            la[m] += term;
                            activa[m] += s[m][j][q];
                        } else {
                            lb[m] += term;
                            activb[m] += s[m][j][q];
                        }
                    }
            }
        }
        legend_fused_accumulate<DK>(s, sn, g, t, acc);
        // Every warp is done with this stage before the next iteration refills it.
        __syncthreads();
    }

    float mine = 0.0f;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        float lsa = legend_quad_sum(la[m]), lsb = legend_quad_sum(lb[m]);
        float scale_a = 1.0f, scale_b = 1.0f, loss_a, loss_b, gpa, gpb;
        float2 sta, stb;
        if (f.loss == LEGEND_LOSS_SOFTMAX) {
            scale_a = 1.0f / lsa;
            scale_b = 1.0f / lsb;
            loss_a = ma[m] + logf(lsa) - pa[m];
            loss_b = mb[m] + logf(lsb) - pb[m];
            gpa = __expf(pa[m] - ma[m]) * scale_a - 1.0f;
            gpb = __expf(pb[m] - mb[m]) * scale_b - 1.0f;
            sta = make_float2(ma[m], scale_a);
            stb = make_float2(mb[m], scale_b);
        } else if (f.loss == LEGEND_LOSS_LOGISTIC) {
            float ea = __expf(-fabsf(pa[m])), eb = __expf(-fabsf(pb[m]));
            loss_a = fmaxf(-pa[m], 0.0f) + log1pf(ea) + lsa;
            loss_b = fmaxf(-pb[m], 0.0f) + log1pf(eb) + lsb;
            gpa = -((-pa[m] >= 0.0f ? 1.0f : ea) / (1.0f + ea));
            gpb = -((-pb[m] >= 0.0f ? 1.0f : eb) / (1.0f + eb));
            sta = make_float2(pa[m], 0.0f);
            stb = make_float2(pb[m], 0.0f);
        } else {
            loss_a = lsa;
            loss_b = lsb;
            gpa = -legend_quad_sum(activa[m]);
            gpb = -legend_quad_sum(activb[m]);
            sta = make_float2(pa[m], 0.0f);
            stb = make_float2(pb[m], 0.0f);
        }
        u32 rb = ra[m] + 8;
#pragma unroll
        for (int n = 0; n < DK; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                bool hi = q >= 2;
                u32 c = 8 * n + 2 * t + (q & 1);
                if ((hi ? vb[m] : va[m]) && c < dim)
                    f.grad_query[(base + (hi ? rb : ra[m])) * dim + c] =
                        acc[m][n][q] * (hi ? scale_b : scale_a);
            }
        if (t == 0) {
            if (va[m]) {
                f.grad_pos[base + ra[m]] = gpa;
                f.stats[base + ra[m]] = sta;
                mine += loss_a;
            }
            if (vb[m]) {
                f.grad_pos[base + rb] = gpb;
                f.stats[base + rb] = stb;
                mine += loss_b;
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
    if (lane == 0) block_loss[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int i = 0; i < LEGEND_FUSED_WARPS; ++i) total += block_loss[i];
        atomicAdd(f.loss_sum, (double)total);
    }
}

template <int DK>
__device__ __forceinline__ void legend_fused_negatives_body(const LegendFused& f) {
    extern __shared__ float legend_fused_smem[];
    constexpr int SROW = 8 * DK + 4;
    constexpr int T = LEGEND_FUSED_TILE;
    constexpr int MT = LEGEND_FUSED_MT;
    constexpr int BR = LEGEND_FUSED_BLOCK_ROWS;
    u32 z = blockIdx.z;
    u32 nrows = f.rows[z];
    u32 rbeg = blockIdx.y * f.row_split;
    u32 rend = min(nrows, rbeg + f.row_split);
    if (rbeg >= rend) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 k = f.k, dim = f.dim;
    u32 j_block = blockIdx.x * BR;
    const float* N = f.negs + (u64)z * k * dim;
    float* sa = legend_fused_smem;
    float* sb0 = legend_fused_smem + BR * SROW;
    float2* sstats = reinterpret_cast<float2*>(sb0 + 2 * T * SROW);
    // The block's negatives (rounded by the gather) in shared memory, in the first group.
    for (int part = 0; part < BR / T; ++part)
        legend_fused_tile<DK>(N, dim, j_block + part * T, k, sa + part * T * SROW, f.vec);
    int row0 = warp * 16 * MT;
    float acc[MT][DK][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < DK; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[m][n][q] = 0.0f;
    u64 base = (u64)z * f.max_rows;
    const float* Q = f.query_tf32 + base * dim;
    const float2* stats = f.stats + base;
    float w = 1.0f / (float)k;
    int tiles = (rend - rbeg + T - 1) / T;
    auto stage = [&](int it) {
        u32 r0 = rbeg + it * T;
        legend_fused_tile<DK>(Q, dim, r0, rend, sb0 + (it & 1) * T * SROW, f.vec);
        if (threadIdx.x < T) {
            u32 r = r0 + threadIdx.x;
            float* st = reinterpret_cast<float*>(&sstats[(it & 1) * T + threadIdx.x]);
            bool ok = r < rend;
            legend_cp4(st, ok ? reinterpret_cast<const float*>(&stats[r]) : Q, ok);
            legend_cp4(st + 1, ok ? reinterpret_cast<const float*>(&stats[r]) + 1 : Q, ok);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    stage(0);
    for (int it = 0; it < tiles; ++it) {
        if (it + 1 < tiles) stage(it + 1);
        else asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();
        const float* sq = sb0 + (it & 1) * T * SROW;
        const float2* st = sstats + (it & 1) * T;
        float s[MT][8][4];
        legend_fused_scores<DK>(sa, row0, sq, g, t, s);
        u32 i0 = rbeg + it * T + 2 * t;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    int i = 8 * j + 2 * t + (q & 1);
                    bool ok = i0 + 8 * j + (q & 1) < rend;
                    s[m][j][q] = ok ? legend_fused_grad(f.loss, s[m][j][q], st[i], w, f.margin) : 0.0f;
                }
        legend_fused_accumulate<DK>(s, sq, g, t, acc);
        __syncthreads();
    }
    float* out = f.grad_negs + (u64)z * k * dim;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        u32 ja = j_block + row0 + 16 * m + g, jb = ja + 8;
#pragma unroll
        for (int n = 0; n < DK; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                bool hi = q >= 2;
                u32 c = 8 * n + 2 * t + (q & 1);
                if ((hi ? jb : ja) < k && c < dim) {
                    float* to = &out[(u64)(hi ? jb : ja) * dim + c];
                    if (f.atomic) atomicAdd(to, acc[m][n][q]);
                    else *to = acc[m][n][q];
                }
            }
    }
}

// One pair of kernels per padded width 8·DK: 32, 64, 104 (d = 100) and 128, written out so
// that each entry point can be found by its name.
extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2) legend_fused_rows_d32(LegendFused f) {
    legend_fused_rows_body<4>(f);
}
extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2) legend_fused_negatives_d32(LegendFused f) {
    legend_fused_negatives_body<4>(f);
}
extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2) legend_fused_rows_d64(LegendFused f) {
    legend_fused_rows_body<8>(f);
}
extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2) legend_fused_negatives_d64(LegendFused f) {
    legend_fused_negatives_body<8>(f);
}
extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2) legend_fused_rows_d104(LegendFused f) {
    legend_fused_rows_body<13>(f);
}
extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2) legend_fused_negatives_d104(LegendFused f) {
    legend_fused_negatives_body<13>(f);
}
extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2) legend_fused_rows_d128(LegendFused f) {
    legend_fused_rows_body<16>(f);
}
extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2) legend_fused_negatives_d128(LegendFused f) {
    legend_fused_negatives_body<16>(f);
}
