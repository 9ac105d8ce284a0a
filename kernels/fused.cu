// Fused chunk products for the dot-comparator decoders (d <= 128): the score matrix of a
// chunk is computed once, on chip. It is the attention pattern with the queries as queries
// and the negatives as both keys and values, so it is computed the way attention is:
//
// - legend_fused_rows_dN: a block owns 128 rows of a job and walks over the job's negatives
//   in tiles of 64: S = Q·Nᵀ (tensor-core mma), the loss turns S into G in registers
//   (softmax with a running maximum and sum, rescaling the accumulator; logistic and
//   ranking elementwise), dQ += G·N, and G goes out to device memory in FP16. It ends with
//   dQ, ∂L/∂pos, the loss and, for softmax, the factors that turn the G it wrote (relative
//   to the running maximum of its tile) into the final probabilities.
// - legend_fused_negatives_dN: a block owns 128 negatives of a job and walks over the job's
//   rows (a range of them when the rows are split): dN += Gᵀ·Q, with G read back. Reading
//   G (2 bytes a score) costs less than computing S a second time, which took half of this
//   kernel's mma and shared-memory loads (the benchmark batch: see Documentation/gpu.md).
//
// The products take FP16 operands and accumulate in FP32 (mma m16n8k16). FP16 keeps the
// 10-bit significand of TF32, so the rounding error is TF32's, while a k16 step does twice
// the work of TF32's k8 step for the same instruction and half the shared-memory bytes
// (the benchmark batch: 2.50 -> 1.95 ms on an H100). FP16's range is narrow, so each job's
// queries and negatives are scaled by a power of two that puts their largest magnitude just
// under FP16's largest value (maxima from legend_queries and legend_fused_absmax, scales
// from legend_fp16_scale): at the usual initialisation (1e-3) the queries of ComplEx and
// DistMult are near 1e-6, FP16 subnormals that would keep 3-4 of their bits. G (at most 1)
// gets a fixed 2^14 (LEGEND_FUSED_G_SCALE). Scores and gradients are unscaled in FP32.
//
// The block's own operand sits in shared memory for the whole walk, the walked one comes
// through shared memory in three cp.async stages of 64 rows (LEGEND_FUSED_STAGES), and
// operands are read with ldmatrix, or by the warpgroup products (wgmma) on Hopper. Eight
// warps a block, each owning one 16-row tile of the block's 128 rows, at 128 registers a
// thread, two blocks a multiprocessor (16 warps): with FP16 operands this
// beats the TF32 version's four warps owning two tiles each at 255 registers (each B
// fragment feeding two products, 8 warps a multiprocessor): 1.95 -> 1.74 ms a batch.
// G goes from the accumulator of S straight into the A fragment of the next product: the
// accumulators of two adjacent 8-column blocks are the A fragment of a k16 step.
// Both operands arrive in FP16: the negatives from legend_gather_negatives_half, the queries
// from the rows kernel (query_half).
//
// On Hopper (sm_90a) the products are warpgroup products (wgmma): the four warps of each
// half of a block multiply their 64 rows at once, reading the shared-memory operands by
// descriptor (G, in registers, stays an A fragment). Same math and accumulator layout, so
// the loss and G code is shared. On an H100 the benchmark batch's rows kernel went 0.535 ->
// 0.479 ms (0.40 ms once its prologue loaded in 16-byte pieces); its negatives kernel stayed
// near 0.29-0.30 ms (bound by its L2 traffic; 0.28 ms with paired dN stores; see
// Documentation/gpu.md). The mma.sync path, timed there with LEGEND_CUDA_ARCH=sm_90, took
// 0.56 and 0.32 ms in this layout.

#define LEGEND_FUSED_WARPS 8
// Rows of the walked tile (the eight 8-column blocks of a warp's score accumulators).
#define LEGEND_FUSED_TILE 64
// Shared-memory stages of the walked tiles: the copy of tile it + 2 is queued while tile it
// is used, into the stage tile it - 1 used, so one barrier an iteration orders both.
#define LEGEND_FUSED_STAGES 3

struct LegendFused {
    const float* query;   // group x max_rows x dim
    u32* query_half;      // the same in FP16, dim_pad halves a row (written by the rows kernel)
    const u32* negs;      // group x k x dim_pad halves (legend_gather_negatives_half)
    const float* pos;     // group x max_rows
    float* grad_pos;      // group x max_rows
    float* grad_query;    // group x max_rows x dim: sum over j of G_ij n_j
    float* grad_negs;     // group x k x dim: sum over i of G_ij q_i
    // G of each job (scaled by LEGEND_FUSED_G_SCALE; for softmax relative to the running
    // maximum of the rows kernel's tile), in blocks of 16 rows by 16 negatives: block
    // (row / 16, negative / 16) of job z at legend_fused_g_block, four 8 x 8 matrices a
    // block (rows 0-7 | 8-15 by negatives 0-7, then 8-15), 16 bytes a row. These are the
    // rows kernel's A fragments, one fully written 128-byte line a register and warp, and
    // what ldmatrix reads (transposing) in the negatives kernel.
    u32* g;
    // Softmax: group x max_rows x (tiles of k): the factor that turns a tile's G into the
    // probabilities (exp(running max - final max) / sum). Unused by the other losses.
    float* corr;
    const u32* rows;      // rows of each job of the group
    // Per job: the largest magnitude of its queries and of its negatives, as float bits
    // (legend_fused_absmax), from which both operands get their FP16 scales.
    const u32* absmax;
    double* loss_sum;
    u32 max_rows;
    u32 k;
    u32 dim;
    // Halves a row of query_half and negs: dim rounded up to the 16 of an mma's k step.
    u32 dim_pad;
    int loss;
    float margin;
    // Rows per blockIdx.y range in the negatives kernel (a multiple of the tile).
    u32 row_split;
    // Whether the negatives kernel adds into grad_negs (row ranges > 1) or stores.
    int atomic;
};

// A finite value saturated to FP16's range (only values past the clamped scales get there),
// so that it does not turn a whole row of products into infinities; an infinity or a NaN
// stays what it is, so a diverged table still shows in the loss.
__device__ __forceinline__ float legend_fp16_clamp(float x) {
    return isfinite(x) ? fminf(fmaxf(x, -65504.0f), 65504.0f) : x;
}

// Two floats as FP16 in one register, `lo` in the low half (the lower k or column index).
// Two floats known to lie in FP16's range (G, at most LEGEND_FUSED_G_SCALE) as FP16 in one
// register, `lo` in the low half (the lower k or column index): no clamp.
__device__ __forceinline__ u32 legend_half2_g(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Two floats of any size as FP16 in one register (the operands), saturated as above.
__device__ __forceinline__ u32 legend_half2(float lo, float hi) {
    return legend_half2_g(legend_fp16_clamp(lo), legend_fp16_clamp(hi));
}

// A store marked evict-first (st.global.cs): G streams through L2 (0.4 GB a benchmark batch)
// and should not push out the negatives every block of the job reads (rows kernel 0.550 ->
// 0.538 ms on an H100).
__device__ __forceinline__ void legend_store_streaming(u32* p, u32 v) {
    asm volatile("st.global.cs.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// 2^x, by the special-function unit (as __expf, whose argument it takes already
// multiplied by log2(e)).
__device__ __forceinline__ float legend_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// G (at most 1 for every loss: a probability, a weighted sigmoid, an indicator) enters the
// second product scaled by 2^14: a softmax probability or a logistic weight of 1/k with a
// small sigmoid is often below FP16's smallest normal (6e-5), and unscaled it would lose its
// digits or vanish. The products come out 2^14 too large and are unscaled with the operands'.
#define LEGEND_FUSED_G_SCALE 16384.0f

__device__ __forceinline__ void legend_mma_f16(float* c, const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix: four (or two) 8 x 8 FP16 matrices, lane 8i + r giving the address of row r of
// matrix i; `trans` hands each lane a column pair instead of a row pair. Volatile: the
// shared memory they read changes across the barriers of the tile loop.
__device__ __forceinline__ void legend_ldsm4(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void legend_ldsm4_trans(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void legend_ldsm2_trans(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr));
}

// Hopper's warpgroup products (wgmma, sm_90a): four warps multiply a 64-row A by B, reading
// B (and A, unless it comes from registers) from shared memory by descriptor, without the
// ldmatrix traffic through registers that bounds the mma.sync version. Operands lie in
// 8 x 8 FP16 core matrices of 128 contiguous bytes (LegendHalfRows). The accumulators are
// mma.sync's: warp w of the group holds rows 16w.., as m16n8 fragments by 8-column block.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LEGEND_WGMMA 1
#define LEGEND_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])

// A no-swizzle operand descriptor (PTX ISA, "matrix descriptor"): the start address and the
// byte offsets from a core matrix to the next along K (`lead`) and along M or N (`stride`),
// each in 16-byte units.
__device__ __forceinline__ u64 legend_wgmma_desc(u32 addr, u32 lead, u32 stride) {
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(stride >> 4) << 32);
}

// Pins accumulators d at this point of the program (an empty asm that claims to change
// them): no write of them moves below it, no read above it.
template <int N>
__device__ __forceinline__ void legend_wgmma_pin(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Orders the warpgroup's register writes before the products that follow. The accumulators'
// last writes are pinned ahead of it: the compiler would otherwise sink, say, their zeroing
// to the product that first uses them, and ptxas would serialise the products around it.
template <int N>
__device__ __forceinline__ void legend_wgmma_fence(float* d) {
    legend_wgmma_pin<N>(d);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void legend_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits for every product the warpgroup issued; the accumulators d are ready after it
// (pinned, so that the compiler does not read them earlier).
template <int N>
__device__ __forceinline__ void legend_wgmma_wait(float* d) {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    legend_wgmma_pin<N>(d);
}

// d (64 x 64) += A · Bᵀ, both K-major in shared memory (descriptors a and b).
__device__ __forceinline__ void legend_wgmma_ss_n64(float* d, u64 a, u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : LEGEND_F4(d, 0), LEGEND_F4(d, 4), LEGEND_F4(d, 8), LEGEND_F4(d, 12), LEGEND_F4(d, 16), LEGEND_F4(d, 20), LEGEND_F4(d, 24), LEGEND_F4(d, 28)
        : "l"(a), "l"(b));
}

// d (64 x 8) += A · B, A from registers (mma.sync's A fragments), B N-major in shared memory.
__device__ __forceinline__ void legend_wgmma_rs_n8(float* d, const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 1;\n}\n"
        : LEGEND_F4(d, 0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 32) += A · B, A from registers (mma.sync's A fragments), B N-major in shared memory.
__device__ __forceinline__ void legend_wgmma_rs_n32(float* d, const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n"
        : LEGEND_F4(d, 0), LEGEND_F4(d, 4), LEGEND_F4(d, 8), LEGEND_F4(d, 12)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 64) += A · B, A from registers (mma.sync's A fragments), B N-major in shared memory.
__device__ __forceinline__ void legend_wgmma_rs_n64(float* d, const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : LEGEND_F4(d, 0), LEGEND_F4(d, 4), LEGEND_F4(d, 8), LEGEND_F4(d, 12), LEGEND_F4(d, 16), LEGEND_F4(d, 20), LEGEND_F4(d, 24), LEGEND_F4(d, 28)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
#endif

// Makes this thread's shared-memory writes (cp.async copies, stores) visible to the
// warpgroup products, which read through the async proxy; before the barrier that
// publishes a stage.
__device__ __forceinline__ void legend_fused_publish() {
#ifdef LEGEND_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Shared-memory tiles of FP16 rows of KS k16 steps (2·KS 16-byte chunks a row), stored as
// 8 x 8 core matrices of 128 contiguous bytes: eight rows' chunk c, then chunk c + 1. This is
// the no-swizzle operand layout of wgmma, and each 8 x 8 matrix an ldmatrix phase reads is
// one 128-byte line, so neither path has bank conflicts (and rows need no padding).
template <int KS>
struct LegendHalfRows {
    static constexpr u32 CHUNKS = 2 * KS;
    static constexpr int WORDS = 8 * KS;
    static constexpr u32 BYTES = 4 * WORDS;
    // Byte offset of chunk `chunk` of row `row` in the tile (tiles start at multiples of
    // eight rows).
    static __device__ __forceinline__ u32 at(u32 row, u32 chunk) {
        return ((row >> 3) * CHUNKS + chunk) * 128 + (row & 7) * 16;
    }
};

// The power of two that brings a matrix whose largest magnitude has the float bits
// `max_bits` into [2^14, 2^15), FP16's top octave: products of embeddings (1e-6 and less
// at the usual initialisation) would otherwise fall into FP16's subnormals and lose their
// digits. Clamped to 2^±60, so that the product of two scales and its inverse stay normal
// floats; 1 for a zero (or non-finite) matrix.
__device__ __forceinline__ float legend_fp16_scale(u32 max_bits) {
    int e = (int)((max_bits >> 23) & 0xffu);
    if (e == 0 || e == 255) return 1.0f;
    int s = max(-60, min(60, 14 - (e - 127)));
    return __int_as_float((s + 127) << 23);
}

// Queues the copy of rows [r0, r0 + TILE) of a matrix of 16·KS halves a row (already
// zero-padded) into a tile of LegendHalfRows<KS>; rows at or past `rlim` become zeros.
template <int KS>
__device__ __forceinline__ void legend_fused_tile(const u32* P, u32 r0, u32 rlim, u32* S) {
    constexpr int CHUNKS = 2 * KS;  // 16-byte pieces of a row
    for (int e = threadIdx.x; e < LEGEND_FUSED_TILE * CHUNKS; e += 32 * LEGEND_FUSED_WARPS) {
        int i = e / CHUNKS, c = e % CHUNKS;
        u32 r = r0 + i;
        bool ok = r < rlim;
        const u32* src = ok ? P + (u64)r * (8 * KS) + 4 * c : P;
        legend_cp16(reinterpret_cast<float*>(&S[LegendHalfRows<KS>::at(i, c) / 4]),
                    reinterpret_cast<const float*>(src), ok ? 16 : 0);
    }
}

// Columns c and c + 1 of a row of `dim` floats at `to` (column c) get x and y, stored or
// (`add`) added atomically: one 8-byte access when d is even (rows 8-byte aligned, c even),
// else one per column inside the row. The fused kernels' outputs, from the accumulators'
// column pairs.
__device__ __forceinline__ void legend_fused_put_pair(float* to, u32 c, u32 dim, float x,
                                                      float y, bool add) {
    if (dim % 2 == 0) {
        if (add) legend_red2(to, x, y);
        else *reinterpret_cast<float2*>(to) = make_float2(x, y);
        return;
    }
    for (u32 v = 0; v < 2 && c + v < dim; ++v) {
        if (add) atomicAdd(to + v, v ? y : x);
        else to[v] = v ? y : x;
    }
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
// rows, zero past `dim` and at rows from `rlim`; each warp takes 16·MT of them, so that
// every B fragment it loads feeds MT products.
#define LEGEND_FUSED_MT 1
#define LEGEND_FUSED_BLOCK_ROWS (16 * LEGEND_FUSED_MT * LEGEND_FUSED_WARPS)

// s[m][j] = A(tile m) · B(rows 8j..8j+7 of the walked tile)ᵀ over the KS k16 steps; `sa`
// and `sb` are shared-memory addresses of the two tiles.
template <int KS>
__device__ __forceinline__ void legend_fused_scores(u32 sa, int row0, u32 sb, int lane,
                                                    float (&s)[LEGEND_FUSED_MT][8][4]) {
    using H = LegendHalfRows<KS>;
#pragma unroll
    for (int m = 0; m < LEGEND_FUSED_MT; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) s[m][j][q] = 0.0f;
#ifdef LEGEND_WGMMA
    // The warpgroup's 64 rows (from row0 rounded down) against the tile's 64, K-major both.
    float* d = &s[0][0][0];
    u32 a0 = sa + H::at(row0 & ~63, 0);
    legend_wgmma_fence<32>(d);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
        legend_wgmma_ss_n64(d, legend_wgmma_desc(a0 + 256 * kk, 128, H::CHUNKS * 128),
                            legend_wgmma_desc(sb + 256 * kk, 128, H::CHUNKS * 128));
    legend_wgmma_commit();
    legend_wgmma_wait<32>(d);
#else
    // A: matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15); B: rows 8j.. | 8j+8.., k 0-7 | 8-15.
    u32 a_at = sa + H::at(row0 + (lane & 15), lane >> 4);
    u32 b_at = sb + H::at((lane & 7) + 8 * (lane >> 4), (lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        u32 a[LEGEND_FUSED_MT][4];
#pragma unroll
        for (int m = 0; m < LEGEND_FUSED_MT; ++m)
            legend_ldsm4(a_at + H::at(16 * m, 2 * kk), a[m]);
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
            u32 b[4];
            legend_ldsm4(b_at + H::at(16 * jp, 2 * kk), b);
#pragma unroll
            for (int m = 0; m < LEGEND_FUSED_MT; ++m) {
                legend_mma_f16(s[m][2 * jp], a[m], b[0], b[1]);
                legend_mma_f16(s[m][2 * jp + 1], a[m], b[2], b[3]);
            }
        }
    }
#endif
}

// The scores of a tile in true units (the operands came scaled).
__device__ __forceinline__ void legend_fused_unscale(float (&s)[8][4], float by) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) s[j][q] *= by;
}

// Negatives a job's G keeps: k rounded up to the walked tile, so that the rows kernel
// writes whole tiles (zeros past k).
__device__ __forceinline__ u32 legend_fused_k_pad(u32 k) {
    return (k + LEGEND_FUSED_TILE - 1) / LEGEND_FUSED_TILE * LEGEND_FUSED_TILE;
}

// The first word of G's block of 16 rows (from row 16·rb) by 16 negatives (from 16·nb)
// of job z (128 words a block; rows padded to 16).
__device__ __forceinline__ u32* legend_fused_g_block(const LegendFused& f, u32 z, u32 rb,
                                                     u32 nb) {
    u32 nbs = legend_fused_k_pad(f.k) / 16;
    u64 job = (u64)((f.max_rows + 15) / 16) * nbs;
    return f.g + ((u64)z * job + (u64)rb * nbs + nb) * 128;
}

// G of a tile (as left in s) as the A fragments of the second product, scaled by
// LEGEND_FUSED_G_SCALE: the accumulators of column blocks 2jj and 2jj + 1 are exactly the A
// fragment of k16 step jj (registers: row g, columns 16jj + 2t..; row g + 8; row g,
// columns 16jj + 8 + 2t..; row g + 8).
__device__ __forceinline__ void legend_fused_g_fragments(const float (&s)[LEGEND_FUSED_MT][8][4],
                                                         u32 (&ga)[LEGEND_FUSED_MT][4][4]) {
    constexpr float G = LEGEND_FUSED_G_SCALE;
#pragma unroll
    for (int m = 0; m < LEGEND_FUSED_MT; ++m)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            ga[m][jj][0] = legend_half2_g(G * s[m][2 * jj][0], G * s[m][2 * jj][1]);
            ga[m][jj][1] = legend_half2_g(G * s[m][2 * jj][2], G * s[m][2 * jj][3]);
            ga[m][jj][2] = legend_half2_g(G * s[m][2 * jj + 1][0], G * s[m][2 * jj + 1][1]);
            ga[m][jj][3] = legend_half2_g(G * s[m][2 * jj + 1][2], G * s[m][2 * jj + 1][3]);
        }
}

// acc[m] += G(tile m, A fragments ga) · (the walked tile), whose rows come as B through
// transposing loads (or, with wgmma, as an N-major operand).
template <int DK, int KS>
__device__ __forceinline__ void legend_fused_accumulate(const u32 (&ga)[LEGEND_FUSED_MT][4][4],
                                                        u32 sb, int lane,
                                                        float (&acc)[LEGEND_FUSED_MT][DK][4]) {
    using H = LegendHalfRows<KS>;
#ifdef LEGEND_WGMMA
    static_assert(LEGEND_FUSED_MT == 1, "a warpgroup product gives each warp 16 rows");
    // B's 8·DK columns in pieces of 64, 32 and 8 (d = 100 pads to 104 = 64 + 32 + 8); along
    // K (the walked rows) its core matrices are a row group (CHUNKS · 128 bytes) apart.
    constexpr int N64 = DK / 8, N32 = DK % 8 / 4, N8 = DK % 4;
    float* d = &acc[0][0][0];
    legend_wgmma_fence<4 * DK>(d);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
        u32 at = sb + H::at(16 * jj, 0);
#pragma unroll
        for (int i = 0; i < N64; ++i)
            legend_wgmma_rs_n64(d + 32 * i, ga[0][jj],
                                legend_wgmma_desc(at + 8 * i * 128, H::CHUNKS * 128, 128));
#pragma unroll
        for (int i = 0; i < N32; ++i)
            legend_wgmma_rs_n32(d + 32 * N64, ga[0][jj],
                                legend_wgmma_desc(at + 8 * N64 * 128, H::CHUNKS * 128, 128));
#pragma unroll
        for (int i = 0; i < N8; ++i)
            legend_wgmma_rs_n8(d + 32 * N64 + 16 * N32 + 4 * i, ga[0][jj],
                               legend_wgmma_desc(at + (8 * N64 + 4 * N32 + i) * 128,
                                                 H::CHUNKS * 128, 128));
    }
    legend_wgmma_commit();
    legend_wgmma_wait<4 * DK>(d);
#else
    // Matrices (walked rows 0-7 | 8-15) x (columns 8n.. | 8n+8..).
    u32 b_at = sb + H::at(lane & 15, lane >> 4);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int n = 0; n < DK; n += 2) {
            u32 at = b_at + H::at(16 * jj, n);
            if (n + 1 < DK) {
                u32 b[4];
                legend_ldsm4_trans(at, b);
#pragma unroll
                for (int m = 0; m < LEGEND_FUSED_MT; ++m) {
                    legend_mma_f16(acc[m][n], ga[m][jj], b[0], b[1]);
                    legend_mma_f16(acc[m][n + 1], ga[m][jj], b[2], b[3]);
                }
            } else {
                u32 b0, b1;
                legend_ldsm2_trans(at, b0, b1);
#pragma unroll
                for (int m = 0; m < LEGEND_FUSED_MT; ++m)
                    legend_mma_f16(acc[m][n], ga[m][jj], b0, b1);
            }
        }
    }
#endif
}

template <int DK, int KS>
__device__ __forceinline__ void legend_fused_rows_body(const LegendFused& f) {
    // 16-byte aligned: cp.async's 16-byte copies and ldmatrix's rows.
    extern __shared__ __align__(16) u32 legend_fused_smem[];
    constexpr int SW = LegendHalfRows<KS>::WORDS;
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
    u32* sb0 = legend_fused_smem + BR * SW;
    u32 sa_at = (u32)__cvta_generic_to_shared(legend_fused_smem);
    u32 sb_at = (u32)__cvta_generic_to_shared(sb0);

    // Operand scales: S comes out scaled by both, dQ by the negatives' and G's.
    float q_scale = legend_fp16_scale(f.absmax[2 * z]);
    float n_scale = legend_fp16_scale(f.absmax[2 * z + 1]);
    float s_unscale = 1.0f / (q_scale * n_scale);
    // The first tiles of negatives are queued before the queries are staged, so that their
    // copies overlap that work.
    const u32* N = f.negs + (u64)z * k * (f.dim_pad / 2);
    int tiles = (k + T - 1) / T;
    constexpr int ST = LEGEND_FUSED_STAGES;
    for (int it = 0; it < ST - 1; ++it) {
        if (it < tiles) legend_fused_tile<KS>(N, it * T, k, sb0 + it * T * SW);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    // The block's queries, scaled and converted once into shared memory; the FP16 copy in
    // device memory is what the negatives kernel reads. Four values a thread and step, one
    // 16-byte load, where rows allow (d % 4 == 0; the scalar loads of this prologue cost the
    // kernel more than their bytes).
    if (dim % 4 == 0) {
        for (int e = threadIdx.x; e < BR * 4 * KS; e += 32 * LEGEND_FUSED_WARPS) {
            int i = e / (4 * KS), c = 4 * (e % (4 * KS));
            u32 r = r_block + i;
            bool ok = r < nrows && (u32)c < dim;
            float4 x = ok ? *reinterpret_cast<const float4*>(f.query + (base + r) * dim + c)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            uint2 v = make_uint2(legend_half2(x.x * q_scale, x.y * q_scale),
                                 legend_half2(x.z * q_scale, x.w * q_scale));
            *reinterpret_cast<uint2*>(
                &legend_fused_smem[(LegendHalfRows<KS>::at(i, c / 8) + 2 * (c % 8)) / 4]) = v;
            if (r < nrows)
                *reinterpret_cast<uint2*>(&f.query_half[(base + r) * (f.dim_pad / 2) + c / 2]) =
                    v;
        }
    } else {
        for (int e = threadIdx.x; e < BR * 8 * KS; e += 32 * LEGEND_FUSED_WARPS) {
            int i = e / (8 * KS), c = 2 * (e % (8 * KS));
            u32 r = r_block + i;
            bool ok = r < nrows;
            const float* q = f.query + (base + r) * dim;
            u32 v = legend_half2(ok && (u32)c < dim ? q[c] * q_scale : 0.0f,
                                 ok && (u32)c + 1 < dim ? q[c + 1] * q_scale : 0.0f);
            legend_fused_smem[(LegendHalfRows<KS>::at(i, c / 8) + 2 * (c % 8)) / 4] = v;
            if (ok) f.query_half[(base + r) * (f.dim_pad / 2) + c / 2] = v;
        }
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

    // The warp's blocks of G (its 16 rows, each tile's four 16-negative blocks): each
    // fragment register fills one 128-byte line. Rows past nrows get finite values, which
    // the negatives kernel multiplies by zero queries.
    u32* g_out = legend_fused_g_block(f, z, (r_block + row0) / 16, 0) + lane;
    // The rows' softmax factors (first the running maxima).
    float* corr_at[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) corr_at[m] = f.corr + (base + ra[m]) * tiles;
    for (int it = 0; it < tiles; ++it) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2));
        legend_fused_publish();
        // Tile it has landed, and every warp is done with tile it - 1's stage.
        __syncthreads();
        int ahead = it + ST - 1;
        if (ahead < tiles) legend_fused_tile<KS>(N, ahead * T, k, sb0 + ahead % ST * T * SW);
        asm volatile("cp.async.commit_group;\n" ::);
        u32 sn = sb_at + it % ST * T * LegendHalfRows<KS>::BYTES;
        float s[MT][8][4];
        legend_fused_scores<KS>(sa_at, row0, sn, lane, s);
        u32 n0 = it * T + 2 * t;
        // Only the last tile can reach past k.
        bool tail = (it + 1) * T > k;
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (f.loss == LEGEND_LOSS_SOFTMAX) {
                // On the scores as they come (scaled by a power of two, which keeps their
                // order and makes the unscaled maximum exact): the maximum, then exp with the
                // unscaling folded into one FFMA.
                float xa = __int_as_float(0xff800000), xb = xa;
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        if (tail && n0 + 8 * j + (q & 1) >= k) s[m][j][q] = __int_as_float(0xff800000);
                        if (q < 2) xa = fmaxf(xa, s[m][j][q]); else xb = fmaxf(xb, s[m][j][q]);
                    }
                float na = fmaxf(ma[m], legend_quad_max(xa) * s_unscale);
                float nb = fmaxf(mb[m], legend_quad_max(xb) * s_unscale);
                float sca = __expf(ma[m] - na), scb = __expf(mb[m] - nb);
                ma[m] = na;
                mb[m] = nb;
                // The running maxima this tile's G is relative to (one lane a tile and row;
                // the same lane turns them into factors at the end).
                if (t == (it & 3)) {
                    if (va[m]) corr_at[m][it] = na;
                    if (vb[m]) corr_at[m][8 * tiles + it] = nb;
                }
                la[m] *= sca;
                lb[m] *= scb;
                // Past the first tiles a row's maximum seldom moves: the accumulator is
                // rescaled only when one of the warp's rows' did.
                if (__any_sync(0xffffffffu, sca != 1.0f || scb != 1.0f)) {
#pragma unroll
                    for (int n = 0; n < DK; ++n) {
                        acc[m][n][0] *= sca;
                        acc[m][n][1] *= sca;
                        acc[m][n][2] *= scb;
                        acc[m][n][3] *= scb;
                    }
                }
                constexpr float LOG2E = 1.4426950408889634f;
                float u = s_unscale * LOG2E, ba = na * LOG2E, bb = nb * LOG2E;
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        s[m][j][q] = legend_exp2(fmaf(s[m][j][q], u, -(q < 2 ? ba : bb)));
                        if (q < 2) la[m] += s[m][j][q]; else lb[m] += s[m][j][q];
                    }
            } else {
                legend_fused_unscale(s[m], s_unscale);
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        float x = s[m][j][q];
                        bool ok = !tail || n0 + 8 * j + (q & 1) < k;
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
        u32 ga[MT][4][4];
        legend_fused_g_fragments(s, ga);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (r_block + row0 + 16 * m >= nrows) continue;
            u32* out = g_out + (u64)m * (legend_fused_k_pad(k) / 16) * 128 + 4 * it * 128;
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int r = 0; r < 4; ++r) legend_store_streaming(out + 128 * jj + 32 * r, ga[m][jj][r]);
        }
        legend_fused_accumulate<DK, KS>(ga, sn, lane, acc);
    }

    float mine = 0.0f;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        float lsa = legend_quad_sum(la[m]), lsb = legend_quad_sum(lb[m]);
        float scale_a = 1.0f, scale_b = 1.0f, loss_a, loss_b, gpa, gpb;
        if (f.loss == LEGEND_LOSS_SOFTMAX) {
            scale_a = 1.0f / lsa;
            scale_b = 1.0f / lsb;
            loss_a = ma[m] + logf(lsa) - pa[m];
            loss_b = mb[m] + logf(lsb) - pb[m];
            gpa = __expf(pa[m] - ma[m]) * scale_a - 1.0f;
            gpb = __expf(pb[m] - mb[m]) * scale_b - 1.0f;
            for (int u = t; u < tiles; u += 4) {
                if (va[m]) corr_at[m][u] = __expf(corr_at[m][u] - ma[m]) * scale_a;
                if (vb[m]) corr_at[m][8 * tiles + u] = __expf(corr_at[m][8 * tiles + u] - mb[m]) * scale_b;
            }
        } else if (f.loss == LEGEND_LOSS_LOGISTIC) {
            float ea = __expf(-fabsf(pa[m])), eb = __expf(-fabsf(pb[m]));
            loss_a = fmaxf(-pa[m], 0.0f) + log1pf(ea) + lsa;
            loss_b = fmaxf(-pb[m], 0.0f) + log1pf(eb) + lsb;
            gpa = -((-pa[m] >= 0.0f ? 1.0f : ea) / (1.0f + ea));
            gpb = -((-pb[m] >= 0.0f ? 1.0f : eb) / (1.0f + eb));
        } else {
            loss_a = lsa;
            loss_b = lsb;
            gpa = -legend_quad_sum(activa[m]);
            gpb = -legend_quad_sum(activb[m]);
        }
        u32 rb = ra[m] + 8;
#pragma unroll
        for (int n = 0; n < DK; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // The lane's two adjacent columns of row a (h = 0) or b.
                u32 c = 8 * n + 2 * t;
                if (!(h ? vb[m] : va[m]) || c >= dim) continue;
                float u = (h ? scale_b : scale_a) / (n_scale * LEGEND_FUSED_G_SCALE);
                legend_fused_put_pair(&f.grad_query[(base + (h ? rb : ra[m])) * dim + c], c, dim,
                                      acc[m][n][2 * h] * u, acc[m][n][2 * h + 1] * u, false);
            }
        if (t == 0) {
            if (va[m]) {
                f.grad_pos[base + ra[m]] = gpa;
                mine += loss_a;
            }
            if (vb[m]) {
                f.grad_pos[base + rb] = gpb;
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

// The FP16 pair x (of G) with its halves multiplied by c.x (low) and c.y (high, both at
// most 1), in FP32.
__device__ __forceinline__ u32 legend_half2_times(u32 x, float2 c) {
    float lo, hi;
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(x));
    return legend_half2_g(lo * c.x, hi * c.y);
}

template <int DK, int KS>
__device__ __forceinline__ void legend_fused_negatives_body(const LegendFused& f) {
    // 16-byte aligned: cp.async's 16-byte copies and ldmatrix's rows.
    extern __shared__ __align__(16) u32 legend_fused_smem[];
    constexpr int SW = LegendHalfRows<KS>::WORDS;
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
    u32 pairs = f.dim_pad / 2;
    u32 tiles = legend_fused_k_pad(k) / T;
    bool softmax = f.loss == LEGEND_LOSS_SOFTMAX;
    // LEGEND_FUSED_STAGES stages of: G (T rows by the block's BR negatives, in its blocks of
    // 16 x 16, by rows then negatives), the rows' FP16 queries, and for softmax the rows'
    // factors of the block's BR / T tiles of negatives.
    constexpr int G_WORDS = T * BR / 2;
    u32* sg0 = legend_fused_smem;
    constexpr int ST = LEGEND_FUSED_STAGES;
    u32* sq0 = sg0 + ST * G_WORDS;
    float* sc0 = reinterpret_cast<float*>(sq0 + ST * T * SW);
    u32 sg_at = (u32)__cvta_generic_to_shared(sg0);
    u32 sq_at = (u32)__cvta_generic_to_shared(sq0);
    u64 base = (u64)z * f.max_rows;
    const u32* Q = f.query_half + base * pairs;
    const float* corr = f.corr + base * tiles;
    u32 first_tile = j_block / T;
    int row0 = warp * 16 * MT;
    float acc[MT][DK][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < DK; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[m][n][q] = 0.0f;
    float q_scale = legend_fp16_scale(f.absmax[2 * z]);
    int walk = (rend - rbeg + T - 1) / T;
    auto stage = [&](int it) {
        u32 r0 = rbeg + it * T;
        u32* sg = sg0 + it % ST * G_WORDS;
        // Each 16-row block's BR / 16 blocks lie together (BR · 32 bytes). Row blocks from
        // rend on and negatives past the padded k come as zeros (the rows kernel wrote zeros
        // from k to the padding, and finite values in rows past nrows of its blocks).
        constexpr int CHUNKS = BR * 2;  // 16-byte pieces of a row block
        for (int e = threadIdx.x; e < (T / 16) * CHUNKS; e += 32 * LEGEND_FUSED_WARPS) {
            int rb = e / CHUNKS, c = e % CHUNKS;
            u32 nb = j_block / 16 + c / 32;
            bool ok = r0 + 16 * rb < rend && nb < tiles * (T / 16);
            const u32* src = ok ? legend_fused_g_block(f, z, r0 / 16 + rb, nb) + 4 * (c % 32) : f.g;
            legend_cp16(reinterpret_cast<float*>(&sg[rb * (BR * 8) + 4 * c]),
                        reinterpret_cast<const float*>(src), ok ? 16 : 0);
        }
        legend_fused_tile<KS>(Q, r0, rend, sq0 + it % ST * T * SW);
        if (softmax && threadIdx.x < BR) {
            u32 i = threadIdx.x % T, u = threadIdx.x / T;
            bool ok = r0 + i < rend && first_tile + u < tiles;
            legend_cp4(&sc0[it % ST * BR + u * T + i],
                       ok ? &corr[(u64)(r0 + i) * tiles + first_tile + u] : corr, ok);
        }
    };
    for (int it = 0; it < ST - 1; ++it) {
        if (it < walk) stage(it);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int it = 0; it < walk; ++it) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2));
        legend_fused_publish();
        // Stage it has landed, and every warp is done with stage it - 1.
        __syncthreads();
        if (it + ST - 1 < walk) stage(it + ST - 1);
        asm volatile("cp.async.commit_group;\n" ::);
        u32 sg = sg_at + it % ST * G_WORDS * 4;
        u32 sq = sq_at + it % ST * T * LegendHalfRows<KS>::BYTES;
        // Gᵀ as A fragments of k step jj (row block jj): (negatives 0-7 | 8-15) x (rows 0-7 |
        // 8-15) are the transposes of the block's matrices 0, 2, 1 and 3.
        int q = lane >> 3;
        u32 a_at = sg + (row0 / 16) * 512 + (((q & 1) << 1) | (q >> 1)) * 128 + (lane & 7) * 16;
        u32 ga[MT][4][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
                legend_ldsm4_trans(a_at + 512 * m + jj * (BR * 32), ga[m][jj]);
        if (softmax) {
            // G of each row from its tile's running maximum to the final probabilities.
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const float* c = sc0 + it % ST * BR + (row0 + 16 * m) / T * T;
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    float2 lo = *reinterpret_cast<const float2*>(&c[16 * jj + 2 * t]);
                    float2 hi = *reinterpret_cast<const float2*>(&c[16 * jj + 8 + 2 * t]);
                    ga[m][jj][0] = legend_half2_times(ga[m][jj][0], lo);
                    ga[m][jj][1] = legend_half2_times(ga[m][jj][1], lo);
                    ga[m][jj][2] = legend_half2_times(ga[m][jj][2], hi);
                    ga[m][jj][3] = legend_half2_times(ga[m][jj][3], hi);
                }
            }
        }
        legend_fused_accumulate<DK, KS>(ga, sq, lane, acc);
    }
    float* out = f.grad_negs + (u64)z * k * dim;
    float unscale = 1.0f / (q_scale * LEGEND_FUSED_G_SCALE);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        u32 ja = j_block + row0 + 16 * m + g, jb = ja + 8;
#pragma unroll
        for (int n = 0; n < DK; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // The lane's two adjacent columns of negative ja (h = 0) or jb.
                u32 j = h ? jb : ja, c = 8 * n + 2 * t;
                if (j >= k || c >= dim) continue;
                legend_fused_put_pair(&out[(u64)j * dim + c], c, dim, acc[m][n][2 * h] * unscale,
                                      acc[m][n][2 * h + 1] * unscale, f.atomic);
            }
    }
}

// The fused kernels' helpers, in the program of the other kernels (LEGEND_FUSED_WIDTH 0).
#if LEGEND_FUSED_WIDTH == 0
// Largest magnitude of each job's negatives (rows of `emb` by id), as float bits into
// absmax[2z + 1] (cleared before legend_queries, which fills absmax[2z]): non-negative floats
// order like their bits. A warp a row, the job's negatives spread over the blockIdx.x.
extern "C" __global__ void legend_fused_absmax(const u32* __restrict__ negs, u32 first_job,
                                               u32 k, u32 dim, const float* __restrict__ emb,
                                               u32* __restrict__ absmax) {
    u32 z = blockIdx.y, lane = threadIdx.x & 31, warps = gridDim.x * (blockDim.x >> 5);
    const u32* ids = negs + (u64)(first_job + z) * k;
    float largest = 0.0f;
    for (u32 j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); j < k; j += warps) {
        const float* row = emb + (u64)ids[j] * dim;
        for (u32 c = lane; c < dim; c += 32) largest = fmaxf(largest, fabsf(row[c]));
    }
    for (int o = 16; o > 0; o >>= 1)
        largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, o));
    if (lane == 0) atomicMax(&absmax[2 * z + 1], __float_as_uint(largest));
}

// The negatives of jobs first_job.. in FP16, dim_pad halves a row (zeros past dim), scaled
// by their job's power of two: the fused kernels' operand, read many times, so converted
// once here.
extern "C" __global__ void legend_gather_negatives_half(const u32* __restrict__ negs,
                                                        u32 first_job, u32 k, u32 dim,
                                                        u32 dim_pad,
                                                        const float* __restrict__ emb,
                                                        const u32* __restrict__ absmax,
                                                        u32* __restrict__ out) {
    u32 z = blockIdx.y, pairs = dim_pad / 2;
    float scale = legend_fp16_scale(absmax[2 * z + 1]);
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)k * pairs) return;
    u64 j = idx / pairs;
    u32 c = 2 * (u32)(idx % pairs);
    const float* row = emb + (u64)negs[(u64)(first_job + z) * k + j] * dim;
    out[(u64)z * k * pairs + idx] =
        legend_half2(c < dim ? row[c] * scale : 0.0f, c + 1 < dim ? row[c + 1] * scale : 0.0f);
}
#endif

// One pair of kernels per padded width 8·DK: 32, 64, 104 (d = 100) and 128, written out so
// that each entry point can be found by its name. Each width is a program of its own
// (LEGEND_FUSED_WIDTH, set by legend-cuda's nvrtc.rs), compiled in parallel with the others;
// the program of the other kernels (LEGEND_FUSED_WIDTH 0) holds none of them.
#define LEGEND_FUSED_PAIR(W, DK, KS)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2)                 \
        legend_fused_rows_d##W(LegendFused f) {                                               \
        legend_fused_rows_body<DK, KS>(f);                                                    \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2)                 \
        legend_fused_negatives_d##W(LegendFused f) {                                          \
        legend_fused_negatives_body<DK, KS>(f);                                               \
    }
#if LEGEND_FUSED_WIDTH == 32
LEGEND_FUSED_PAIR(32, 4, 2)
#elif LEGEND_FUSED_WIDTH == 64
LEGEND_FUSED_PAIR(64, 8, 4)
#elif LEGEND_FUSED_WIDTH == 104
LEGEND_FUSED_PAIR(104, 13, 7)
#elif LEGEND_FUSED_WIDTH == 128
LEGEND_FUSED_PAIR(128, 16, 8)
#endif
