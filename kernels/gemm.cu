// Batched TF32 tensor-core matrix products for the chunk score matrices and their gradients:
// C = op(A) · op(B) per batch entry (blockIdx.z), with mma.sync m16n8k8 TF32 on 128x128
// output tiles, 8 warps of 64x32, and the next K-slice loaded into registers while the
// current one is multiplied.

#define LEGEND_BM 128
#define LEGEND_BN 128
#define LEGEND_BK 32
// One word of padding per shared row makes the fragment loads conflict-free (row r starts
// at bank 4r).
#define LEGEND_SROW (LEGEND_BK + 4)

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
};

__device__ __forceinline__ u32 legend_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

template <bool A_KC, bool B_KC>
__device__ __forceinline__ void legend_gemm_load(const LegendGemm& g, const float* A,
                                                 const float* B, int m, int m0, int n0, int k0,
                                                 int kend, float* ra, float* rb) {
    int tid = threadIdx.x;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
        int e = tid + r * 256;
        int row = A_KC ? (e >> 5) : (e & 127);
        int kk = A_KC ? (e & 31) : (e >> 7);
        int gi = m0 + row, gk = k0 + kk;
        ra[r] = (gi < m && gk < kend)
                    ? (A_KC ? A[(long long)gi * g.a_ld + gk] : A[(long long)gk * g.a_ld + gi])
                    : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) {
        int e = tid + r * 256;
        int col = B_KC ? (e >> 5) : (e & 127);
        int kk = B_KC ? (e & 31) : (e >> 7);
        int gj = n0 + col, gk = k0 + kk;
        rb[r] = (gj < g.n && gk < kend)
                    ? (B_KC ? B[(long long)gj * g.b_ld + gk] : B[(long long)gk * g.b_ld + gj])
                    : 0.0f;
    }
}

template <bool A_KC, bool B_KC>
__device__ __forceinline__ void legend_gemm_body(const LegendGemm& g) {
    __shared__ u32 As[LEGEND_BM * LEGEND_SROW];
    __shared__ u32 Bs[LEGEND_BN * LEGEND_SROW];
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

    float ra[16], rb[16];
    legend_gemm_load<A_KC, B_KC>(g, A, B, m, m0, n0, kbeg, kend, ra, rb);
    for (int k0 = kbeg; k0 < kend; k0 += LEGEND_BK) {
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            int e = tid + r * 256;
            int row = A_KC ? (e >> 5) : (e & 127);
            int kk = A_KC ? (e & 31) : (e >> 7);
            As[row * LEGEND_SROW + kk] = legend_tf32(ra[r]);
            int col = B_KC ? (e >> 5) : (e & 127);
            int kb = B_KC ? (e & 31) : (e >> 7);
            Bs[col * LEGEND_SROW + kb] = legend_tf32(rb[r]);
        }
        __syncthreads();
        // The next slice's global loads are in flight while the tensor cores work.
        if (k0 + LEGEND_BK < kend)
            legend_gemm_load<A_KC, B_KC>(g, A, B, m, m0, n0, k0 + LEGEND_BK, kend, ra, rb);
#pragma unroll
        for (int kk = 0; kk < LEGEND_BK; kk += 8) {
            // The last slice of a short K (d = 100) is mostly padding: skip its empty steps.
            if (k0 + kk >= kend) break;
            u32 af[4][4], bf[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = wm + i * 16 + gr;
                af[i][0] = As[r * LEGEND_SROW + kk + tq];
                af[i][1] = As[(r + 8) * LEGEND_SROW + kk + tq];
                af[i][2] = As[r * LEGEND_SROW + kk + tq + 4];
                af[i][3] = As[(r + 8) * LEGEND_SROW + kk + tq + 4];
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                int c = wn + j * 8 + gr;
                bf[j][0] = Bs[c * LEGEND_SROW + kk + tq];
                bf[j][1] = Bs[c * LEGEND_SROW + kk + tq + 4];
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
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                int row = m0 + wm + i * 16 + gr + (q >> 1) * 8;
                int col = n0 + wn + j * 8 + 2 * tq + (q & 1);
                if (row < m && col < g.n) {
                    float* out = &C[(long long)row * g.c_ld + col];
                    if (g.atomic) atomicAdd(out, acc[i][j][q]); else *out = acc[i][j][q];
                }
            }
}

// S = Q · Nᵀ: both operands k-contiguous (rows of d floats).
extern "C" __global__ void __launch_bounds__(256) legend_gemm_nt(LegendGemm g) {
    legend_gemm_body<true, true>(g);
}

// dQ = G · N: G k-contiguous (score rows), N n-contiguous.
extern "C" __global__ void __launch_bounds__(256) legend_gemm_nn(LegendGemm g) {
    legend_gemm_body<true, false>(g);
}

// dN = Gᵀ · Q: Gᵀ read down the columns of G, Q n-contiguous.
extern "C" __global__ void __launch_bounds__(256) legend_gemm_tn(LegendGemm g) {
    legend_gemm_body<false, false>(g);
}
