// Fused chunk products for the dot-comparator decoders (d <= 128): the score matrix of a
// chunk never leaves the chip. It is the attention pattern with the queries as queries and
// the negatives as both keys and values, so it is computed the way attention is:
//
// - legend_fused_rows_dN: a block owns 64 rows of a job and walks over the job's negatives
//   in tiles of 64: S = Q·Nᵀ (TF32 mma), the loss turns S into G in registers (softmax with
//   a running maximum and sum, rescaling the accumulator; logistic and ranking elementwise),
//   dQ += G·N. It ends with dQ, ∂L/∂pos, the loss and each row's statistics.
// - legend_fused_negatives_dN: a block owns 64 negatives of a job and walks over the job's
//   rows (a range of them when the rows are split): S again, G from the rows' statistics,
//   dN += Gᵀ·Q.
//
// One warp owns 16 rows (or negatives): its A fragments stay in registers for the whole
// walk, the walked operand comes through shared memory in two cp.async stages. G goes from
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

template <int DK>
__device__ __forceinline__ void legend_fused_rows_body(const LegendFused& f) {
    extern __shared__ float legend_fused_smem[];
    constexpr int SROW = 8 * DK + 4;
    constexpr int T = LEGEND_FUSED_TILE;
    __shared__ float block_loss[LEGEND_FUSED_WARPS];
    u32 z = blockIdx.y;
    u32 nrows = f.rows[z];
    if (blockIdx.x * T >= nrows) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 ra = blockIdx.x * T + warp * 16 + g, rb = ra + 8;
    bool va = ra < nrows, vb = rb < nrows;
    u64 base = (u64)z * f.max_rows;
    u32 dim = f.dim, k = f.k;

    // The warp's queries as A fragments, rounded once; the rounded copy is what the
    // negatives kernel reads.
    u32 a[DK][4];
#pragma unroll
    for (int kk = 0; kk < DK; ++kk) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            bool hi = q & 1;
            u32 r = hi ? rb : ra;
            u32 c = 8 * kk + t + ((q >> 1) << 2);
            bool ok = (hi ? vb : va) && c < dim;
            u64 at = (base + r) * dim + c;
            a[kk][q] = legend_tf32(ok ? f.query[at] : 0.0f);
            if (ok) f.query_tf32[at] = __uint_as_float(a[kk][q]);
        }
    }
    float pa = va ? f.pos[base + ra] : 0.0f, pb = vb ? f.pos[base + rb] : 0.0f;
    // Softmax: running max (the positive's score to begin with) and this lane's part of the
    // running sum (the positive counted once, by lane t = 0). Other losses: loss sums.
    float ma = pa, mb = pb;
    float la = t == 0 ? 1.0f : 0.0f, lb = la;
    float activa = 0.0f, activb = 0.0f;
    if (f.loss != LEGEND_LOSS_SOFTMAX) la = lb = 0.0f;
    float w = 1.0f / (float)k;
    float acc[DK][4];
#pragma unroll
    for (int n = 0; n < DK; ++n)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[n][q] = 0.0f;

    const float* N = f.negs + (u64)z * k * dim;
    int tiles = (k + T - 1) / T;
    legend_fused_tile<DK>(N, dim, 0, k, legend_fused_smem, f.vec);
    asm volatile("cp.async.commit_group;\n" ::);
    for (int it = 0; it < tiles; ++it) {
        if (it + 1 < tiles)
            legend_fused_tile<DK>(N, dim, (it + 1) * T, k,
                                  legend_fused_smem + ((it + 1) & 1) * T * SROW, f.vec);
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();
        const float* sn = legend_fused_smem + (it & 1) * T * SROW;
        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) s[j][q] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float* b = sn + (8 * j + g) * SROW + 8 * kk + t;
                legend_mma_tf32(s[j], a[kk][0], a[kk][1], a[kk][2], a[kk][3],
                                __float_as_uint(b[0]), __float_as_uint(b[4]));
            }
        u32 n0 = it * T + 2 * t;
        if (f.loss == LEGEND_LOSS_SOFTMAX) {
            float xa = __int_as_float(0xff800000), xb = xa;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    if (n0 + 8 * j + (q & 1) >= k) s[j][q] = __int_as_float(0xff800000);
                    if (q < 2) xa = fmaxf(xa, s[j][q]); else xb = fmaxf(xb, s[j][q]);
                }
            float na = fmaxf(ma, legend_quad_max(xa)), nb = fmaxf(mb, legend_quad_max(xb));
            float sa = __expf(ma - na), sb = __expf(mb - nb);
            ma = na;
            mb = nb;
            la *= sa;
            lb *= sb;
#pragma unroll
            for (int n = 0; n < DK; ++n) {
                acc[n][0] *= sa;
                acc[n][1] *= sa;
                acc[n][2] *= sb;
                acc[n][3] *= sb;
            }
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    s[j][q] = __expf(s[j][q] - (q < 2 ? ma : mb));
                    if (q < 2) la += s[j][q]; else lb += s[j][q];
                }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    float x = s[j][q];
                    bool ok = n0 + 8 * j + (q & 1) < k;
                    float p = q < 2 ? pa : pb;
                    float term, grad;
                    if (f.loss == LEGEND_LOSS_LOGISTIC) {
                        float ex = __expf(-fabsf(x));
                        term = w * (fmaxf(x, 0.0f) + log1pf(ex));
                        grad = w * (x >= 0.0f ? 1.0f : ex) / (1.0f + ex);
                    } else {
                        float v = f.margin - p + x;
                        term = v > 0.0f ? v : 0.0f;
                        grad = v > 0.0f ? 1.0f : 0.0f;
                    }
                    term = ok ? term : 0.0f;
                    s[j][q] = ok ? grad : 0.0f;
                    if (q < 2) {
                        la += term;
                        activa += s[j][q];
                    } else {
                        lb += term;
                        activb += s[j][q];
                    }
                }
        }
        // dQ += G·N over the tile's 64 negatives, k8 step j taking columns 8j + 2t and
        // 8j + 2t + 1 as its slots t and t + 4.
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            u32 g0 = legend_tf32(s[j][0]), g1 = legend_tf32(s[j][2]);
            u32 g2 = legend_tf32(s[j][1]), g3 = legend_tf32(s[j][3]);
            const float* b = sn + (8 * j + 2 * t) * SROW + g;
#pragma unroll
            for (int n = 0; n < DK; ++n)
                legend_mma_tf32(acc[n], g0, g1, g2, g3, __float_as_uint(b[8 * n]),
                                __float_as_uint(b[SROW + 8 * n]));
        }
        // Every warp is done with this stage before the next iteration refills it.
        __syncthreads();
    }

    la = legend_quad_sum(la);
    lb = legend_quad_sum(lb);
    float scale_a = 1.0f, scale_b = 1.0f, loss_a, loss_b, gpa, gpb;
    float2 sta, stb;
    if (f.loss == LEGEND_LOSS_SOFTMAX) {
        scale_a = 1.0f / la;
        scale_b = 1.0f / lb;
        loss_a = ma + logf(la) - pa;
        loss_b = mb + logf(lb) - pb;
        gpa = __expf(pa - ma) * scale_a - 1.0f;
        gpb = __expf(pb - mb) * scale_b - 1.0f;
        sta = make_float2(ma, scale_a);
        stb = make_float2(mb, scale_b);
    } else if (f.loss == LEGEND_LOSS_LOGISTIC) {
        float ea = __expf(-fabsf(pa)), eb = __expf(-fabsf(pb));
        loss_a = fmaxf(-pa, 0.0f) + log1pf(ea) + la;
        loss_b = fmaxf(-pb, 0.0f) + log1pf(eb) + lb;
        gpa = -((-pa >= 0.0f ? 1.0f : ea) / (1.0f + ea));
        gpb = -((-pb >= 0.0f ? 1.0f : eb) / (1.0f + eb));
        sta = make_float2(pa, 0.0f);
        stb = make_float2(pb, 0.0f);
    } else {
        loss_a = la;
        loss_b = lb;
        gpa = -legend_quad_sum(activa);
        gpb = -legend_quad_sum(activb);
        sta = make_float2(pa, 0.0f);
        stb = make_float2(pb, 0.0f);
    }
#pragma unroll
    for (int n = 0; n < DK; ++n)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            bool hi = q >= 2;
            u32 c = 8 * n + 2 * t + (q & 1);
            if ((hi ? vb : va) && c < dim)
                f.grad_query[(base + (hi ? rb : ra)) * dim + c] = acc[n][q] * (hi ? scale_b : scale_a);
        }
    float mine = 0.0f;
    if (t == 0) {
        if (va) {
            f.grad_pos[base + ra] = gpa;
            f.stats[base + ra] = sta;
            mine += loss_a;
        }
        if (vb) {
            f.grad_pos[base + rb] = gpb;
            f.stats[base + rb] = stb;
            mine += loss_b;
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
    u32 z = blockIdx.z;
    u32 nrows = f.rows[z];
    u32 rbeg = blockIdx.y * f.row_split;
    u32 rend = min(nrows, rbeg + f.row_split);
    if (rbeg >= rend) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 k = f.k, dim = f.dim;
    u32 ja = blockIdx.x * T + warp * 16 + g, jb = ja + 8;
    bool va = ja < k, vb = jb < k;
    const float* N = f.negs + (u64)z * k * dim;
    u32 a[DK][4];
#pragma unroll
    for (int kk = 0; kk < DK; ++kk)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            bool hi = q & 1;
            u32 c = 8 * kk + t + ((q >> 1) << 2);
            bool ok = (hi ? vb : va) && c < dim;
            a[kk][q] = ok ? __float_as_uint(N[(u64)(hi ? jb : ja) * dim + c]) : 0u;
        }
    float acc[DK][4];
#pragma unroll
    for (int n = 0; n < DK; ++n)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[n][q] = 0.0f;
    u64 base = (u64)z * f.max_rows;
    const float* Q = f.query_tf32 + base * dim;
    const float2* stats = f.stats + base;
    float2* sstats = reinterpret_cast<float2*>(legend_fused_smem + 2 * T * SROW);
    float w = 1.0f / (float)k;
    int tiles = (rend - rbeg + T - 1) / T;
    auto stage = [&](int it) {
        u32 r0 = rbeg + it * T;
        float* dst = legend_fused_smem + (it & 1) * T * SROW;
        legend_fused_tile<DK>(Q, dim, r0, rend, dst, f.vec);
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
        const float* sq = legend_fused_smem + (it & 1) * T * SROW;
        const float2* st = sstats + (it & 1) * T;
        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) s[j][q] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float* b = sq + (8 * j + g) * SROW + 8 * kk + t;
                legend_mma_tf32(s[j], a[kk][0], a[kk][1], a[kk][2], a[kk][3],
                                __float_as_uint(b[0]), __float_as_uint(b[4]));
            }
        u32 i0 = rbeg + it * T + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                int i = 8 * j + 2 * t + (q & 1);
                bool ok = i0 + 8 * j + (q & 1) < rend;
                s[j][q] = ok ? legend_fused_grad(f.loss, s[j][q], st[i], w, f.margin) : 0.0f;
            }
            u32 g0 = legend_tf32(s[j][0]), g1 = legend_tf32(s[j][2]);
            u32 g2 = legend_tf32(s[j][1]), g3 = legend_tf32(s[j][3]);
            const float* b = sq + (8 * j + 2 * t) * SROW + g;
#pragma unroll
            for (int n = 0; n < DK; ++n)
                legend_mma_tf32(acc[n], g0, g1, g2, g3, __float_as_uint(b[8 * n]),
                                __float_as_uint(b[SROW + 8 * n]));
        }
        __syncthreads();
    }
    float* out = f.grad_negs + (u64)z * k * dim;
#pragma unroll
    for (int n = 0; n < DK; ++n)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            bool hi = q >= 2;
            u32 c = 8 * n + 2 * t + (q & 1);
            if ((hi ? vb : va) && c < dim) {
                float* to = &out[(u64)(hi ? jb : ja) * dim + c];
                if (f.atomic) atomicAdd(to, acc[n][q]);
                else *to = acc[n][q];
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
