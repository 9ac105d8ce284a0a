// Batched TF32 tensor-core matrix products for the chunk score matrices and their gradients:
// C = op(A) · op(B) per batch entry (blockIdx.z), with mma.sync m16n8k8 TF32 on 128x128
// output tiles, 8 warps of 64x32, K-slices of 16 copied by cp.async into four
// shared-memory stages, and two blocks per multiprocessor so that one's stores overlap the
// other's work.

#define LEGEND_BM 128
#define LEGEND_BN 128
#define LEGEND_BK 16
// Four words of padding per shared row make the fragment loads conflict-free (the rows of
// a fragment start at banks 0, 20, 8, 28, 16, 4, 24, 12).
#define LEGEND_SROW (LEGEND_BK + 4)
// Row stride of a [k][row] tile: 8 words of padding put the rows of a fragment load
// (k = t, row = g) at banks 8t + g.
#define LEGEND_TROW (LEGEND_BM + 8)
// Row stride of the output tile staged in shared memory for the stores.
#define LEGEND_CROW (LEGEND_BN + 4)
// Floats of one operand's tile in one stage (the larger of the two layouts).
#define LEGEND_TILE (LEGEND_BM * LEGEND_SROW)
// Shared-memory stages (LEGEND_STAGES x 20 KiB a block; the launch asks for it).
#define LEGEND_STAGES 4

// Operands of one batched product. op(A) is m x k, op(B) is k x n, C is m x n.
// A "k-contiguous" operand stores element (i, kk) at i * ld + kk, the other layout at
// kk * ld + i; which one a kernel expects is part of its name.
struct LegendGemm {
    const float* a;
    long long a_batch;
    long long a_ld;
    const float* b;
    long long b_batch;
    long long b_ld;
    float* c;
    long long c_batch;
    long long c_ld;
    int m;
    int n;
    int k;
    // Per batch entry row count of M (when m_rows is set) or depth K (when k_rows is set);
    // `m`/`k` are then the maxima, which size the grid.
    const u32* m_rows;
    const u32* k_rows;
    // K range of one blockIdx.y split (a multiple of LEGEND_BK), results added atomically.
    int k_split;
    int atomic;
    // Whether the operand's rows and base are 16-byte aligned (16-byte copies).
    int a_vec;
    int b_vec;
    // Whether C's rows and base are 16-byte aligned (16-byte stores).
    int c_vec;
};

__device__ __forceinline__ u32 legend_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// Queues the copy of one operand's 128 x 16 tile: rows (of A, or columns of B) r0.. below
// `rlim`, K indices k0.. below `kend`. A k-contiguous operand lands as [row][k] (stride
// LEGEND_SROW), the other as [k][row] (stride LEGEND_TROW), so that either way the copies
// are 16 bytes wide when `vec` says rows and base are 16-byte aligned; 4 bytes otherwise.
template <bool KC>
__device__ __forceinline__ void legend_tile_copy(const float* P, long long ld, int r0, int rlim,
                                                 int k0, int kend, float* S, bool vec) {
    int tid = threadIdx.x;
    if (vec) {
#pragma unroll
        for (int v = 0; v < 2; ++v) {
            int e = tid + v * 256;
            int i = KC ? (e >> 2) : ((e & 31) * 4);
            int kk = KC ? ((e & 3) * 4) : (e >> 5);
            int gi = r0 + i, gk = k0 + kk;
            int avail = KC ? (gi < rlim ? min(max(kend - gk, 0), 4) : 0)
                           : (gk < kend ? min(max(rlim - gi, 0), 4) : 0);
            const float* src = KC ? P + (long long)gi * ld + gk : P + (long long)gk * ld + gi;
            float* dst = KC ? &S[i * LEGEND_SROW + kk] : &S[kk * LEGEND_TROW + i];
            legend_cp16(dst, avail ? src : P, avail * 4);
        }
    } else {
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            int e = tid + r * 256;
            int i = KC ? (e >> 4) : (e & 127);
            int kk = KC ? (e & 15) : (e >> 7);
            int gi = r0 + i, gk = k0 + kk;
            bool ok = gi < rlim && gk < kend;
            const float* src = KC ? P + (long long)gi * ld + gk : P + (long long)gk * ld + gi;
            float* dst = KC ? &S[i * LEGEND_SROW + kk] : &S[kk * LEGEND_TROW + i];
            legend_cp4(dst, ok ? src : P, ok);
        }
    }
}

// Queues the copies of the K-slice [k0, k0 + BK) of both operands into one stage.
template <bool A_KC, bool B_KC>
__device__ __forceinline__ void legend_gemm_stage(const LegendGemm& g, const float* A,
                                                  const float* B, int m, int m0, int n0,
                                                  int k0, int kend, float* As, float* Bs) {
    legend_tile_copy<A_KC>(A, g.a_ld, m0, m, k0, kend, As, g.a_vec);
    legend_tile_copy<B_KC>(B, g.b_ld, n0, g.n, k0, kend, Bs, g.b_vec);
}

// Stage `st` of the A and B tiles in the dynamic shared memory.
#define legend_stage_a(st) (legend_smem + (st) * 2 * LEGEND_TILE)
#define legend_stage_b(st) (legend_stage_a(st) + LEGEND_TILE)

// Element (row, k) of a staged tile in either layout.
template <bool KC>
__device__ __forceinline__ float legend_at(const float* t, int row, int k) {
    return KC ? t[row * LEGEND_SROW + k] : t[k * LEGEND_TROW + row];
}

template <bool A_KC, bool B_KC>
__device__ __forceinline__ void legend_gemm_body(const LegendGemm& g) {
    // LEGEND_STAGES stages of both operands in dynamic shared memory: the copies of the next
    // LEGEND_STAGES - 1 slices are in flight while the tensor cores work on one, which
    // hides the device-memory latency that a single slice of lookahead left exposed.
    extern __shared__ float legend_smem[];
    int z = blockIdx.z;
    int m = g.m_rows ? (int)g.m_rows[z] : g.m;
    int kdim = g.k_rows ? (int)g.k_rows[z] : g.k;
    int ntiles = (g.n + LEGEND_BN - 1) / LEGEND_BN;
    int m0 = (blockIdx.x / ntiles) * LEGEND_BM;
    int n0 = (blockIdx.x % ntiles) * LEGEND_BN;
    if (m0 >= m) return;
    int kbeg = g.k_split ? blockIdx.y * g.k_split : 0;
    int kend = g.k_split ? min(kdim, kbeg + g.k_split) : kdim;
    if (g.atomic && kbeg >= kend) return;
    const float* A = g.a + (long long)z * g.a_batch;
    const float* B = g.b + (long long)z * g.b_batch;
    float* C = g.c + (long long)z * g.c_batch;

    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int gr = lane >> 2, tq = lane & 3;
    int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

#pragma unroll
    for (int st = 0; st < LEGEND_STAGES - 1; ++st) {
        int k0 = kbeg + st * LEGEND_BK;
        if (k0 < kend)
            legend_gemm_stage<A_KC, B_KC>(g, A, B, m, m0, n0, k0, kend, legend_stage_a(st),
                                          legend_stage_b(st));
        // An empty group keeps the count of committed groups one per slice.
        asm volatile("cp.async.commit_group;\n" ::);
    }
    int it = 0;
    for (int k0 = kbeg; k0 < kend; k0 += LEGEND_BK, ++it) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(LEGEND_STAGES - 2));
        // Slice `it` has landed for every thread, and every warp is done with the stage
        // that the copies below refill (it was read in the previous iteration).
        __syncthreads();
        int next = k0 + (LEGEND_STAGES - 1) * LEGEND_BK;
        int st = (it + LEGEND_STAGES - 1) % LEGEND_STAGES;
        if (next < kend)
            legend_gemm_stage<A_KC, B_KC>(g, A, B, m, m0, n0, next, kend, legend_stage_a(st),
                                          legend_stage_b(st));
        asm volatile("cp.async.commit_group;\n" ::);
        const float* as = legend_stage_a(it % LEGEND_STAGES);
        const float* bs = legend_stage_b(it % LEGEND_STAGES);
#pragma unroll
        for (int kk = 0; kk < LEGEND_BK; kk += 8) {
            // The last slice of a short K (d = 100) is partly padding: skip its empty step.
            if (k0 + kk >= kend) break;
            u32 af[4][4], bf[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = wm + i * 16 + gr;
                af[i][0] = legend_tf32(legend_at<A_KC>(as, r, kk + tq));
                af[i][1] = legend_tf32(legend_at<A_KC>(as, r + 8, kk + tq));
                af[i][2] = legend_tf32(legend_at<A_KC>(as, r, kk + tq + 4));
                af[i][3] = legend_tf32(legend_at<A_KC>(as, r + 8, kk + tq + 4));
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                int c = wn + j * 8 + gr;
                bf[j][0] = legend_tf32(legend_at<B_KC>(bs, c, kk + tq));
                bf[j][1] = legend_tf32(legend_at<B_KC>(bs, c, kk + tq + 4));
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    asm volatile(
                        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                        : "+f"(acc[i][j][0]), "+f"(acc[i][j][1]), "+f"(acc[i][j][2]),
                          "+f"(acc[i][j][3])
                        : "r"(af[i][0]), "r"(af[i][1]), "r"(af[i][2]), "r"(af[i][3]),
                          "r"(bf[j][0]), "r"(bf[j][1]));
        }
    }
    if (g.atomic) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    int row = m0 + wm + i * 16 + gr + (q >> 1) * 8;
                    int col = n0 + wn + j * 8 + 2 * tq + (q & 1);
                    if (row < m && col < g.n) atomicAdd(&C[(long long)row * g.c_ld + col], acc[i][j][q]);
                }
        return;
    }
    // The tile goes out through shared memory, so that each warp store writes whole
    // 16-byte vectors of four consecutive columns: stores straight from the fragments
    // touch eight rows per instruction, and limited the score product more than its math.
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    float* ct = legend_smem;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q)
                ct[(wm + i * 16 + gr + (q >> 1) * 8) * LEGEND_CROW + wn + j * 8 + 2 * tq + (q & 1)] =
                    acc[i][j][q];
    __syncthreads();
#pragma unroll 4
    for (int v = 0; v < LEGEND_BM * LEGEND_BN / 4 / 256; ++v) {
        int e = threadIdx.x + v * 256;
        int row = e >> 5, c4 = (e & 31) * 4;
        int grow = m0 + row, gcol = n0 + c4;
        if (grow >= m || gcol >= g.n) continue;
        const float* from = &ct[row * LEGEND_CROW + c4];
        float* to = &C[(long long)grow * g.c_ld + gcol];
        if (g.c_vec && gcol + 3 < g.n) {
            *reinterpret_cast<float4*>(to) = *reinterpret_cast<const float4*>(from);
        } else {
            for (int c = 0; c < 4 && gcol + c < g.n; ++c) to[c] = from[c];
        }
    }
}

// S = Q · Nᵀ: both operands k-contiguous (rows of d floats).
extern "C" __global__ void __launch_bounds__(256, 2) legend_gemm_nt(LegendGemm g) {
    legend_gemm_body<true, true>(g);
}

// dQ = G · N: G k-contiguous (score rows), N n-contiguous.
extern "C" __global__ void __launch_bounds__(256, 2) legend_gemm_nn(LegendGemm g) {
    legend_gemm_body<true, false>(g);
}

// dN = Gᵀ · Q: Gᵀ read down the columns of G, Q n-contiguous.
extern "C" __global__ void __launch_bounds__(256, 2) legend_gemm_tn(LegendGemm g) {
    legend_gemm_body<false, false>(g);
}
