// Fused chunk products for the dot-comparator decoders (d <= 128): the score matrix of a
// chunk is computed once, on chip. It is the attention pattern with the queries as queries
// and the negatives as both keys and values, so it is computed the way attention is:
//
// - legend_fused_rows_dW: the rows of a job in blocks of 128, each walked over the job's
//   negatives in tiles: S = Q·Nᵀ (tensor cores), the loss turns S into G in registers
//   (softmax with a running maximum and sum, rescaling the accumulator; logistic and
//   ranking elementwise), dQ += G·N, and G goes out to device memory in FP16. It ends with
//   dQ, ∂L/∂pos, the loss and, for softmax, the factors that turn the G it wrote (relative
//   to the running maximum of its tile) into the final probabilities.
// - legend_fused_negatives_dW: a block owns 128 negatives of a job and walks over the job's
//   rows (a range of them when the rows are split): dN += Gᵀ·Q, with G read back. Reading
//   G (2 bytes a score) costs less than computing S a second time, which took half of this
//   kernel's mma and shared-memory loads (the benchmark batch: see Documentation/gpu.md).
//
// Two implementations share the layouts, the loss and the epilogues below:
// - Hopper (sm_90a): the rows kernel is warp-specialised and persistent, as FlashAttention-3
//   is: one block a multiprocessor, a producer warp copying each block's queries and the
//   tiles of 128 negatives into shared memory with the bulk copy engine (completing on
//   mbarriers), and two consumer warpgroups of 64 rows each, at 240 registers
//   (setmaxnreg), whose warpgroup products (wgmma) of one tile run while they compute the
//   softmax of the next. The negatives kernel's products are warpgroup products too.
// - Elsewhere (sm_80, and sm_90 without the a): eight warps a block, each owning one 16-row
//   tile of the block's 128 rows, two blocks a multiprocessor, cp.async stages of 64
//   negatives and mma.sync products (fragments through ldmatrix).
//
// The products take FP16 operands and accumulate in FP32. FP16 keeps the 10-bit
// significand of TF32, so the rounding error is TF32's, while a k16 step does twice the
// work of TF32's k8 step for the same instruction and half the shared-memory bytes
// (Documentation/gpu.md, measurement log, version 10). FP16's range is narrow, so each job's
// queries and negatives are scaled by a power of two that puts their largest magnitude just
// under FP16's largest value (maxima from legend_queries and legend_fused_absmax, scales
// from legend_fp16_scale): at the usual initialisation (1e-3) the queries of ComplEx and
// DistMult are near 1e-6, FP16 subnormals that would keep 3-4 of their bits. G (at most 1)
// gets a fixed 2^14 (LEGEND_FUSED_G_SCALE). Scores and gradients are unscaled in FP32.
//
// Layouts in device memory, written and read as whole tiles (so the bulk copy engine can
// move them, and cp.async in pieces of 16 contiguous bytes):
// - The FP16 operands (the negatives from legend_gather_negatives_half, the queries from
//   the rows kernel) in tiles of 64 rows, each laid out as in shared memory
//   (LegendHalfRows): 8 x 8 core matrices of 128 contiguous bytes. Negatives are padded
//   with zero rows to k_pad (a multiple of 128), queries to rows_pad (of 128).
// - G in blocks of 16 rows by 16 negatives (one 8 x 8 matrix of the A fragment a 128-byte
//   line), by column block of 128 negatives, then row block, so that the G of 64 rows by
//   128 negatives (a stage of the negatives kernel) is 16 contiguous KB.
// - The softmax factors by job, 64-negative tile, then row.
// The rows kernel writes the FP16 queries, G and the factors of every row of each 128-row
// block it runs, past rows[z] too (zero queries, finite G and factors), so the negatives
// kernel copies whole 64-row tiles without masks: rows past rows[z] add zero.

#define LEGEND_FUSED_WARPS 8
// Rows of the tiles of the FP16 operands in device memory, and of the walked tile of the
// mma.sync kernels (the eight 8-column blocks of a warp's score accumulators).
#define LEGEND_FUSED_TILE 64
// Shared-memory stages of the walked tiles: the copy of tile it + 2 is queued while tile it
// is used, into the stage tile it - 1 used, so one barrier an iteration orders both.
#define LEGEND_FUSED_STAGES 3
// Negatives a block of the negatives kernel owns, and a column block of G: k is padded to it.
#define LEGEND_FUSED_NEG_BLOCK 128
// Rows a block of the rows kernel owns: the rows are padded to it.
#define LEGEND_FUSED_BLOCK_ROWS 128

struct LegendFused {
    const float* query;   // group x max_rows x dim (read 16 bytes past the end: allocated so)
    u32* query_half;      // the same in FP16, tiled (written by the rows kernel)
    const u32* negs;      // group x k_pad rows, tiled (legend_gather_negatives_half)
    const float* pos;     // group x max_rows
    float* grad_pos;      // group x max_rows
    float* grad_query;    // group x max_rows x dim: sum over j of G_ij n_j
    float* grad_negs;     // group x k x dim: sum over i of G_ij q_i
    // G of each job (scaled by LEGEND_FUSED_G_SCALE; for softmax relative to the running
    // maximum of the rows kernel's tile) in blocks of 16 x 16 (legend_fused_g_block): four
    // 8 x 8 matrices a block (rows 0-7 | 8-15 by negatives 0-7, then 8-15), 16 bytes a row.
    // These are the rows kernel's A fragments, one fully written 128-byte line a register
    // and warp, and what ldmatrix reads (transposing) in the negatives kernel.
    u32* g;
    // Softmax: the factor that turns a tile's G into the probabilities (exp(running max -
    // final max) / sum), by job, 64-negative tile and row (legend_fused_corr). Unused by the
    // other losses.
    float* corr;
    const u32* rows;      // rows of each job of the group
    // Per job: the largest magnitude of its queries and of its negatives, as float bits
    // (legend_fused_absmax), from which both operands get their FP16 scales.
    const u32* absmax;
    double* loss_sum;
    u32 jobs;             // jobs of the group (the persistent rows kernel walks them all)
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

// Negatives a job's G, factors and FP16 negatives hold: k rounded up to a column block.
__device__ __forceinline__ u32 legend_fused_k_pad(u32 k) {
    return (k + LEGEND_FUSED_NEG_BLOCK - 1) / LEGEND_FUSED_NEG_BLOCK * LEGEND_FUSED_NEG_BLOCK;
}

// Rows a job's FP16 queries, G and factors hold: max_rows rounded up to a block.
__device__ __forceinline__ u32 legend_fused_rows_pad(const LegendFused& f) {
    return (f.max_rows + LEGEND_FUSED_BLOCK_ROWS - 1) / LEGEND_FUSED_BLOCK_ROWS *
           LEGEND_FUSED_BLOCK_ROWS;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of FP16 rows of `chunks`
// chunks, stored as 8 x 8 core matrices of 128 contiguous bytes: eight rows' chunk c, then
// chunk c + 1. This is the no-swizzle operand layout of wgmma, and each 8 x 8 matrix an
// ldmatrix phase reads is one 128-byte line, so neither path has bank conflicts (and rows
// need no padding). Tiles start at multiples of eight rows; two 64-row tiles in a row are
// one 128-row tile.
__device__ __forceinline__ u32 legend_half_rows_at(u32 row, u32 chunk, u32 chunks) {
    return ((row >> 3) * chunks + chunk) * 128 + (row & 7) * 16;
}

// The layout above for rows of KS k16 steps (2·KS chunks a row).
template <int KS>
struct LegendHalfRows {
    static constexpr u32 CHUNKS = 2 * KS;
    static constexpr int WORDS = 8 * KS;
    static constexpr u32 BYTES = 4 * WORDS;
    static __device__ __forceinline__ u32 at(u32 row, u32 chunk) {
        return legend_half_rows_at(row, chunk, CHUNKS);
    }
};

// Shared memory of the mma.sync rows kernel (the block's 128 FP16 queries and the stages of
// 64 negatives) and of the negatives kernel (stages of G for 64 rows by 128 negatives, the
// 64 rows' FP16 queries and their factors for the block's two 64-negative tiles).
template <int KS>
struct LegendFusedSmem {
    static constexpr u32 ROWS = (LEGEND_FUSED_BLOCK_ROWS + LEGEND_FUSED_STAGES * LEGEND_FUSED_TILE) *
                                LegendHalfRows<KS>::BYTES;
    static constexpr u32 NEGATIVES =
        LEGEND_FUSED_STAGES * (LEGEND_FUSED_TILE * LEGEND_FUSED_NEG_BLOCK * 2 +
                               LEGEND_FUSED_TILE * LegendHalfRows<KS>::BYTES +
                               LEGEND_FUSED_NEG_BLOCK * 4);
};

// The first word of 64-row tile t of job z of a tiled FP16 matrix with `tiles` tiles a job
// and dim_pad halves a row.
__device__ __forceinline__ u64 legend_fused_tile_word(u32 z, u32 tiles, u32 t, u32 dim_pad) {
    return ((u64)z * tiles + t) * (LEGEND_FUSED_TILE * dim_pad / 2);
}

// The first word of G's block of 16 rows (from row 16·rb) by 16 negatives (from 16·nb) of
// job z (128 words a block): column blocks of 128 negatives, in each the row blocks, in each
// the column block's eight blocks.
__device__ __forceinline__ u32* legend_fused_g_block(const LegendFused& f, u32 z, u32 rb,
                                                     u32 nb) {
    u32 row_blocks = legend_fused_rows_pad(f) / 16;
    u32 columns = legend_fused_k_pad(f.k) / LEGEND_FUSED_NEG_BLOCK;
    u64 block = (((u64)z * columns + nb / 8) * row_blocks + rb) * 8 + nb % 8;
    return f.g + block * 128;
}

// The softmax factors (first the running maxima) of job z's rows for the 64 negatives of
// tile `tile` (rows_pad floats).
__device__ __forceinline__ float* legend_fused_corr(const LegendFused& f, u32 z, u32 tile) {
    u32 tiles = legend_fused_k_pad(f.k) / LEGEND_FUSED_TILE;
    return f.corr + ((u64)z * tiles + tile) * legend_fused_rows_pad(f);
}

// A finite value saturated to FP16's range (only values past the clamped scales get there),
// so that it does not turn a whole row of products into infinities; an infinity or a NaN
// stays what it is, so a diverged table still shows in the loss.
__device__ __forceinline__ float legend_fp16_clamp(float x) {
    return isfinite(x) ? fminf(fmaxf(x, -65504.0f), 65504.0f) : x;
}

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
// and should not push out the negatives every block of the job reads (measurement log,
// version 17).
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
// Softmax takes the factor inside its exponent (LEGEND_FUSED_G_LOG2), so its running sums
// carry it too and it cancels where they divide.
#define LEGEND_FUSED_G_SCALE 16384.0f
#define LEGEND_FUSED_G_LOG2 14.0f

// Whether values of a matrix whose largest magnitude has the float bits `max_bits` can pass
// FP16's range once scaled by legend_fp16_scale: only where that scale was clamped (a
// largest magnitude of 2^75 or more, or not finite); elsewhere the conversions need no clamp.
__device__ __forceinline__ bool legend_fp16_scale_saturates(u32 max_bits) {
    return ((max_bits >> 23) & 0xffu) > 127 + 74;
}

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

// Stops the kernel (an error the host reports) if it was launched with less dynamic shared
// memory than it uses: the launch takes the size from legend_fused_launch.
__device__ __forceinline__ void legend_check_smem(u32 bytes) {
    u32 dynamic;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic));
    if (dynamic < bytes) __trap();
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

// A thread's two rows of a job through the loss: the rows a (row g of its warp's 16) and
// b (g + 8) of the accumulators.
struct LegendRowLoss {
    float pa, pb;            // the positives' scores (0 past the job's rows)
    float ma, mb;            // softmax: running maxima, the positive's score to begin with
    float la, lb;            // this lane's part of the running sum (softmax, times 2^14) or
                             // of the loss terms (the others)
    float activa, activb;    // ranking: this lane's part of the active negatives
};

// The loss state of rows a and b before the first tile.
__device__ __forceinline__ LegendRowLoss legend_row_loss(const LegendFused& f, u64 at_a,
                                                         bool va, bool vb, int t) {
    LegendRowLoss r;
    r.pa = va ? f.pos[at_a] : 0.0f;
    r.pb = vb ? f.pos[at_a + 8] : 0.0f;
    r.ma = r.pa;
    r.mb = r.pb;
    // The positive counted once, by lane t = 0, as exp(0) times the G scale.
    r.la = r.lb = (f.loss == LEGEND_LOSS_SOFTMAX && t == 0) ? LEGEND_FUSED_G_SCALE : 0.0f;
    r.activa = r.activb = 0.0f;
    return r;
}

// One tile of J 8-column blocks of scores (s, scaled by the operands' scales, unscaled by
// s_unscale) through the loss: s becomes G times LEGEND_FUSED_G_SCALE, and the rows' state
// moves on. For softmax, sca and scb are the factors by which the accumulators of rows a
// and b must be rescaled (their running maxima moved); 1 for the other losses. n0 is the
// negative of the lane's first column; only a TAIL tile can reach past k (its masks are
// compiled into that version only: they were a quarter of the softmax's instructions).
template <int J, bool TAIL>
__device__ __forceinline__ void legend_fused_loss_tile(const LegendFused& f, float (&s)[J][4],
                                                       LegendRowLoss& r, float s_unscale,
                                                       u32 n0, float& sca, float& scb) {
    u32 k = f.k;
    sca = scb = 1.0f;
    if (f.loss == LEGEND_LOSS_SOFTMAX) {
        // On the scores as they come (scaled by a power of two, which keeps their order and
        // makes the unscaled maximum exact): the maximum, then exp with the unscaling and
        // the G scale folded into one FFMA.
        float xa = __int_as_float(0xff800000), xb = xa;
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (TAIL && n0 + 8 * j + (q & 1) >= k) s[j][q] = __int_as_float(0xff800000);
                if (q < 2) xa = fmaxf(xa, s[j][q]); else xb = fmaxf(xb, s[j][q]);
            }
        float na = fmaxf(r.ma, legend_quad_max(xa) * s_unscale);
        float nb = fmaxf(r.mb, legend_quad_max(xb) * s_unscale);
        sca = __expf(r.ma - na);
        scb = __expf(r.mb - nb);
        r.ma = na;
        r.mb = nb;
        r.la *= sca;
        r.lb *= scb;
        constexpr float LOG2E = 1.4426950408889634f;
        float u = s_unscale * LOG2E;
        float ba = LEGEND_FUSED_G_LOG2 - na * LOG2E, bb = LEGEND_FUSED_G_LOG2 - nb * LOG2E;
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                s[j][q] = legend_exp2(fmaf(s[j][q], u, q < 2 ? ba : bb));
                if (q < 2) r.la += s[j][q]; else r.lb += s[j][q];
            }
        return;
    }
    float w = 1.0f / (float)k;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float x = s[j][q] * s_unscale;
            bool ok = !TAIL || n0 + 8 * j + (q & 1) < k;
            float term, grad;
            if (f.loss == LEGEND_LOSS_LOGISTIC) {
                float ex = __expf(-fabsf(x));
                term = w * (fmaxf(x, 0.0f) + log1pf(ex));
                grad = w * (x >= 0.0f ? 1.0f : ex) / (1.0f + ex);
            } else {
                float v = f.margin - (q < 2 ? r.pa : r.pb) + x;
                term = v > 0.0f ? v : 0.0f;
                grad = v > 0.0f ? 1.0f : 0.0f;
            }
            term = ok ? term : 0.0f;
            grad = ok ? grad : 0.0f;
            s[j][q] = grad * LEGEND_FUSED_G_SCALE;
            if (q < 2) {
                r.la += term;
                r.activa += grad;
            } else {
                r.lb += term;
                r.activb += grad;
            }
        }
}

// The same for the tile of negatives from `first`, with the masks only where it reaches past k.
template <int J>
__device__ __forceinline__ void legend_fused_loss(const LegendFused& f, float (&s)[J][4],
                                                  LegendRowLoss& r, float s_unscale, u32 first,
                                                  int t, float& sca, float& scb) {
    if (first + 8 * J > f.k)
        legend_fused_loss_tile<J, true>(f, s, r, s_unscale, first + 2 * t, sca, scb);
    else
        legend_fused_loss_tile<J, false>(f, s, r, s_unscale, first + 2 * t, sca, scb);
}

// G of a tile of J 8-column blocks (as left in s) as the A fragments of the second product:
// the accumulators of column blocks 2jj and 2jj + 1 are exactly the A fragment of k16 step
// jj (registers: row g, columns 16jj + 2t..; row g + 8; row g, columns 16jj + 8 + 2t..;
// row g + 8).
template <int J>
__device__ __forceinline__ void legend_fused_g_fragments(const float (&s)[J][4],
                                                         u32 (&ga)[J / 2][4]) {
#pragma unroll
    for (int jj = 0; jj < J / 2; ++jj) {
        ga[jj][0] = legend_half2_g(s[2 * jj][0], s[2 * jj][1]);
        ga[jj][1] = legend_half2_g(s[2 * jj][2], s[2 * jj][3]);
        ga[jj][2] = legend_half2_g(s[2 * jj + 1][0], s[2 * jj + 1][1]);
        ga[jj][3] = legend_half2_g(s[2 * jj + 1][2], s[2 * jj + 1][3]);
    }
}

// Zeros a warp's accumulators of DK 8-column blocks.
template <int DK>
__device__ __forceinline__ void legend_fused_clear(float (&acc)[DK][4]) {
#pragma unroll
    for (int n = 0; n < DK; ++n)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[n][q] = 0.0f;
}

// Multiplies the accumulators of rows a (elements 0, 1 of each block) and b by sca and scb,
// when a row of the warp needs it: past the first tiles a row's maximum seldom moves.
template <int DK>
__device__ __forceinline__ void legend_fused_rescale(float (&acc)[DK][4], float sca,
                                                     float scb) {
    if (__any_sync(0xffffffffu, sca != 1.0f || scb != 1.0f)) {
#pragma unroll
        for (int n = 0; n < DK; ++n) {
            acc[n][0] *= sca;
            acc[n][1] *= sca;
            acc[n][2] *= scb;
            acc[n][3] *= scb;
        }
    }
}

// The end of rows a and b (job z, first row at `at_a` of the job-major buffers) after the
// last tile: the loss (added into `loss`), ∂L/∂pos, and for softmax the factors of the
// `tiles` walked tiles, each `width` 64-negative tiles wide: lane t = tile % 4 kept the
// running maxima its G is relative to (`running(tile)`: rows a and b) and now turns them
// into the factors of all of the tile's 64-negative tiles. Returns what the accumulators of
// rows a (x) and b (y) are multiplied by to give dQ (the negatives' scale n_scale, G's and
// softmax's sum undone).
template <typename Running>
__device__ __forceinline__ float2 legend_fused_rows_finish(const LegendFused& f, u32 z, u64 at_a,
                                                           u32 ra, bool va, bool vb,
                                                           const LegendRowLoss& r,
                                                           float n_scale, u32 tiles, u32 width,
                                                           int t, const Running& running,
                                                           float& loss) {
    float lsa = legend_quad_sum(r.la), lsb = legend_quad_sum(r.lb);
    // dQ's unscaling, apart from n_scale: G's scale, which softmax's sums carry.
    float ua = 1.0f / LEGEND_FUSED_G_SCALE, ub = ua, loss_a, loss_b, gpa, gpb;
    if (f.loss == LEGEND_LOSS_SOFTMAX) {
        ua = 1.0f / lsa;
        ub = 1.0f / lsb;
        float fa = LEGEND_FUSED_G_SCALE * ua, fb = LEGEND_FUSED_G_SCALE * ub;
        constexpr float LOG_G = 9.704060527839234f;  // ln(2^14)
        loss_a = r.ma + logf(lsa) - LOG_G - r.pa;
        loss_b = r.mb + logf(lsb) - LOG_G - r.pb;
        gpa = __expf(r.pa - r.ma) * fa - 1.0f;
        gpb = __expf(r.pb - r.mb) * fb - 1.0f;
        for (u32 u = t; u < tiles; u += 4) {
            float2 m = running(u);
            float ca = __expf(m.x - r.ma) * fa, cb = __expf(m.y - r.mb) * fb;
            for (u32 h = 0; h < width; ++h) {
                float* ch = legend_fused_corr(f, z, u * width + h) + ra;
                ch[0] = ca;
                ch[8] = cb;
            }
        }
    } else if (f.loss == LEGEND_LOSS_LOGISTIC) {
        float ea = __expf(-fabsf(r.pa)), eb = __expf(-fabsf(r.pb));
        loss_a = fmaxf(-r.pa, 0.0f) + log1pf(ea) + lsa;
        loss_b = fmaxf(-r.pb, 0.0f) + log1pf(eb) + lsb;
        gpa = -((-r.pa >= 0.0f ? 1.0f : ea) / (1.0f + ea));
        gpb = -((-r.pb >= 0.0f ? 1.0f : eb) / (1.0f + eb));
    } else {
        loss_a = lsa;
        loss_b = lsb;
        gpa = -legend_quad_sum(r.activa);
        gpb = -legend_quad_sum(r.activb);
    }
    if (t == 0) {
        if (va) {
            f.grad_pos[at_a] = gpa;
            loss += loss_a;
        }
        if (vb) {
            f.grad_pos[at_a + 8] = gpb;
            loss += loss_b;
        }
    }
    return make_float2(ua / n_scale, ub / n_scale);
}

// The lane's two adjacent columns of row a (h = 0) or b in each 8-column block of its
// accumulators, times u, into the row of `dim` floats at `row` (as dQ leaves the mma.sync
// kernel: each store spans 16 rows; the warp-specialised kernel goes through shared memory).
template <int DK>
__device__ __forceinline__ void legend_fused_put_row(float* row, const float (&acc)[DK][4], int h,
                                                     float u, u32 dim, int t) {
#pragma unroll
    for (int n = 0; n < DK; ++n) {
        u32 c = 8 * n + 2 * t;
        if (c < dim)
            legend_fused_put_pair(row + c, c, dim, acc[n][2 * h] * u, acc[n][2 * h + 1] * u,
                                  false);
    }
}

// Makes this thread's shared-memory writes (cp.async copies, stores) visible to the
// warpgroup products and the bulk copy engine, which work through the async proxy; before
// the barrier that publishes them.
__device__ __forceinline__ void legend_fused_publish() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The loss of a warp's rows into the batch's sum: one atomic a warp.
__device__ __forceinline__ void legend_fused_add_loss(const LegendFused& f, float loss) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) loss += __shfl_xor_sync(0xffffffffu, loss, o);
    if ((threadIdx.x & 31) == 0 && loss != 0.0f) atomicAdd(f.loss_sum, (double)loss);
}

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

// Waits until at most PENDING of the warpgroup's product groups are still running (the
// latest ones: groups complete in order); the accumulators d of the groups before are ready
// after it (pinned, so that the compiler does not read them earlier).
template <int N, int PENDING = 0>
__device__ __forceinline__ void legend_wgmma_wait(float* d) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
    legend_wgmma_pin<N>(d);
}

// d (64 x 128) = A · Bᵀ, plus d where `add` is non-zero; both K-major in shared memory.
__device__ __forceinline__ void legend_wgmma_ss_n128(float* d, u64 a, u64 b, u32 add) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.u32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : LEGEND_F4(d, 0), LEGEND_F4(d, 4), LEGEND_F4(d, 8), LEGEND_F4(d, 12), LEGEND_F4(d, 16), LEGEND_F4(d, 20), LEGEND_F4(d, 24), LEGEND_F4(d, 28),
          LEGEND_F4(d, 32), LEGEND_F4(d, 36), LEGEND_F4(d, 40), LEGEND_F4(d, 44), LEGEND_F4(d, 48), LEGEND_F4(d, 52), LEGEND_F4(d, 56), LEGEND_F4(d, 60)
        : "l"(a), "l"(b), "r"(add));
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
// A u32 pinned like the accumulators (the A fragments of the register products: their
// conversions must not sink below the fence that orders them before the products).
template <int N>
__device__ __forceinline__ void legend_wgmma_pin_u32(u32* a) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// mbarriers in shared memory (addresses from __cvta_generic_to_shared) and the bulk copy
// engine, for the warp-specialised kernels.
__device__ __forceinline__ void legend_mbar_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

__device__ __forceinline__ void legend_mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar)
                 : "memory");
}

// Arrives and adds `bytes` to the transfers the barrier's phase waits for.
__device__ __forceinline__ void legend_mbar_expect(u32 bar, u32 bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(
                     bar),
                 "r"(bytes)
                 : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void legend_mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// `bytes` (a multiple of 16, 16-byte aligned both ends) from device memory into shared
// memory by the bulk copy engine, completing on the barrier `bar`.
__device__ __forceinline__ void legend_bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// Register budgets of the warp-specialised kernels' warpgroups (the kernel starts at its
// launch bound's share; the producer gives registers back, the consumers take them).
template <int N>
__device__ __forceinline__ void legend_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void legend_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// Arrives at named barrier `id` of `threads` threads without waiting.
__device__ __forceinline__ void legend_bar_arrive(u32 id, u32 threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Waits until the `threads` threads of named barrier `id` have arrived (a warpgroup's
// own barrier; 0 is __syncthreads').
__device__ __forceinline__ void legend_bar_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
#endif


// Queues the copy of a 64-row tile of a tiled FP16 matrix (contiguous, from `src`) into
// shared memory at `dst`, by all threads of the block; rows from `rlim` on become zeros.
template <int KS>
__device__ __forceinline__ void legend_fused_tile(const u32* src, u32 rlim, u32* dst) {
    // 16-byte pieces: eight rows' chunk c, then chunk c + 1 (LegendHalfRows).
    constexpr int PIECES = LEGEND_FUSED_TILE * 2 * KS;
    for (int e = threadIdx.x; e < PIECES; e += 32 * LEGEND_FUSED_WARPS) {
        u32 row = e / (16 * KS) * 8 + e % 8;
        bool ok = row < rlim;
        legend_cp16(reinterpret_cast<float*>(dst + 4 * e),
                    reinterpret_cast<const float*>(ok ? src + 4 * e : src), ok ? 16 : 0);
    }
}

// acc += G (A fragments ga of JJ k16 steps) · (the walked tile, JJ·16 rows of KS k16 steps
// at shared-memory address sb), whose rows come as B through transposing loads (or, with
// wgmma, as an N-major operand). With wgmma, the products are issued and committed here,
// and waited for by the caller.
template <int DK, int KS, int JJ>
__device__ __forceinline__ void legend_fused_accumulate(const u32 (&ga)[JJ][4], u32 sb,
                                                        int lane, float (&acc)[DK][4]) {
    using H = LegendHalfRows<KS>;
#ifdef LEGEND_WGMMA
    // B's 8·DK columns in pieces of 64, 32 and 8 (d = 100 pads to 104 = 64 + 32 + 8); along
    // K (the walked rows) its core matrices are a row group (CHUNKS · 128 bytes) apart.
    constexpr int N64 = DK / 8, N32 = DK % 8 / 4, N8 = DK % 4;
    float* d = &acc[0][0];
    // One descriptor, moved by constant byte offsets (in its 16-byte address units).
    u64 b = legend_wgmma_desc(sb, H::CHUNKS * 128, 128);
#pragma unroll
    for (int jj = 0; jj < JJ; ++jj) {
        constexpr u32 ROW_GROUP = H::CHUNKS * 128;
        u64 at = b + 2 * jj * ROW_GROUP / 16;
#pragma unroll
        for (int i = 0; i < N64; ++i) legend_wgmma_rs_n64(d + 32 * i, ga[jj], at + 8 * i * 8);
#pragma unroll
        for (int i = 0; i < N32; ++i)
            legend_wgmma_rs_n32(d + 32 * N64, ga[jj], at + 8 * N64 * 8);
#pragma unroll
        for (int i = 0; i < N8; ++i)
            legend_wgmma_rs_n8(d + 32 * N64 + 16 * N32 + 4 * i, ga[jj],
                               at + (8 * N64 + 4 * N32 + i) * 8);
    }
    legend_wgmma_commit();
#else
    // Matrices (walked rows 0-7 | 8-15) x (columns 8n.. | 8n+8..).
    u32 b_at = sb + H::at(lane & 15, lane >> 4);
#pragma unroll
    for (int jj = 0; jj < JJ; ++jj) {
#pragma unroll
        for (int n = 0; n < DK; n += 2) {
            u32 at = b_at + H::at(16 * jj, n);
            if (n + 1 < DK) {
                u32 b[4];
                legend_ldsm4_trans(at, b);
                legend_mma_f16(acc[n], ga[jj], b[0], b[1]);
                legend_mma_f16(acc[n + 1], ga[jj], b[2], b[3]);
            } else {
                u32 b0, b1;
                legend_ldsm2_trans(at, b0, b1);
                legend_mma_f16(acc[n], ga[jj], b0, b1);
            }
        }
    }
#endif
}

#ifndef LEGEND_WGMMA
// s[j] = A(the warp's 16 rows from row0) · B(rows 8j..8j+7 of the walked tile)ᵀ over the KS
// k16 steps; `sa` and `sb` are shared-memory addresses of the two tiles.
template <int KS>
__device__ __forceinline__ void legend_fused_scores(u32 sa, int row0, u32 sb, int lane,
                                                    float (&s)[8][4]) {
    using H = LegendHalfRows<KS>;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) s[j][q] = 0.0f;
    // A: matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15); B: rows 8j.. | 8j+8.., k 0-7 | 8-15.
    u32 a_at = sa + H::at(row0 + (lane & 15), lane >> 4);
    u32 b_at = sb + H::at((lane & 7) + 8 * (lane >> 4), (lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        u32 a[4];
        legend_ldsm4(a_at + H::at(0, 2 * kk), a);
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
            u32 b[4];
            legend_ldsm4(b_at + H::at(16 * jp, 2 * kk), b);
            legend_mma_f16(s[2 * jp], a, b[0], b[1]);
            legend_mma_f16(s[2 * jp + 1], a, b[2], b[3]);
        }
    }
}

// The rows kernel with mma.sync (see the top of the file): a block owns 128 rows of job
// blockIdx.y, eight warps of 16 rows, tiles of 64 negatives in three cp.async stages.
template <int DK, int KS>
__device__ __forceinline__ void legend_fused_rows_body(const LegendFused& f) {
    // 16-byte aligned: cp.async's 16-byte copies and ldmatrix's rows.
    extern __shared__ __align__(16) u32 legend_fused_smem[];
    using H = LegendHalfRows<KS>;
    constexpr int SW = H::WORDS;
    constexpr int T = LEGEND_FUSED_TILE;
    constexpr int BR = LEGEND_FUSED_BLOCK_ROWS;
    constexpr int ST = LEGEND_FUSED_STAGES;
    legend_check_smem(LegendFusedSmem<KS>::ROWS);
    u32 z = blockIdx.y;
    u32 nrows = f.rows[z];
    u32 r_block = blockIdx.x * BR;
    if (r_block >= nrows) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u64 base = (u64)z * f.max_rows;
    u32 dim = f.dim, k = f.k, k_pad = legend_fused_k_pad(k), rows_pad = legend_fused_rows_pad(f);
    u32* sb0 = legend_fused_smem + BR * SW;
    u32 sa_at = (u32)__cvta_generic_to_shared(legend_fused_smem);
    u32 sb_at = (u32)__cvta_generic_to_shared(sb0);

    // Operand scales: S comes out scaled by both, dQ by the negatives' and G's.
    float q_scale = legend_fp16_scale(f.absmax[2 * z]);
    float n_scale = legend_fp16_scale(f.absmax[2 * z + 1]);
    float s_unscale = 1.0f / (q_scale * n_scale);
    // Every tile of the padded k, so that G and the factors are written for all of it. The
    // first tiles of negatives are queued before the queries are staged, so that their
    // copies overlap that work.
    int tiles = k_pad / T;
    for (int it = 0; it < ST - 1; ++it) {
        if (it < tiles)
            legend_fused_tile<KS>(f.negs + legend_fused_tile_word(z, tiles, it, f.dim_pad), T,
                                  sb0 + it * T * SW);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    // The block's queries, scaled and converted once into shared memory; the FP16 copy in
    // device memory (the block's two tiles, laid out as here) is what the negatives kernel
    // reads. Four values a thread and step, one 16-byte load, where rows allow (d % 4 ==
    // 0; the scalar loads of this prologue cost the kernel more than their bytes).
    u32* qh = f.query_half + legend_fused_tile_word(z, rows_pad / T, r_block / T, f.dim_pad);
    if (dim % 4 == 0) {
        for (int e = threadIdx.x; e < BR * 4 * KS; e += 32 * LEGEND_FUSED_WARPS) {
            int i = e / (4 * KS), c = 4 * (e % (4 * KS));
            u32 r = r_block + i;
            bool ok = r < nrows && (u32)c < dim;
            float4 x = ok ? *reinterpret_cast<const float4*>(f.query + (base + r) * dim + c)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            uint2 v = make_uint2(legend_half2(x.x * q_scale, x.y * q_scale),
                                 legend_half2(x.z * q_scale, x.w * q_scale));
            u32 word = (H::at(i, c / 8) + 2 * (c % 8)) / 4;
            *reinterpret_cast<uint2*>(&legend_fused_smem[word]) = v;
            *reinterpret_cast<uint2*>(&qh[word]) = v;
        }
    } else {
        for (int e = threadIdx.x; e < BR * 8 * KS; e += 32 * LEGEND_FUSED_WARPS) {
            int i = e / (8 * KS), c = 2 * (e % (8 * KS));
            u32 r = r_block + i;
            bool ok = r < nrows;
            const float* q = f.query + (base + r) * dim;
            u32 v = legend_half2(ok && (u32)c < dim ? q[c] * q_scale : 0.0f,
                                 ok && (u32)c + 1 < dim ? q[c + 1] * q_scale : 0.0f);
            u32 word = (H::at(i, c / 8) + 2 * (c % 8)) / 4;
            legend_fused_smem[word] = v;
            qh[word] = v;
        }
    }
    int row0 = warp * 16;
    // Rows a = r_block + row0 + g and b = a + 8.
    u32 ra = r_block + row0 + g;
    bool va = ra < nrows, vb = ra + 8 < nrows;
    LegendRowLoss st = legend_row_loss(f, base + ra, va, vb, t);
    float acc[DK][4];
    legend_fused_clear<DK>(acc);

    // The warp's blocks of G (its 16 rows, each tile's four 16-negative blocks): each
    // fragment register fills one 128-byte line. Rows past nrows get finite values, which
    // the negatives kernel multiplies by zero queries.
    for (int it = 0; it < tiles; ++it) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2));
        // Tile it has landed, and every warp is done with tile it - 1's stage.
        __syncthreads();
        int ahead = it + ST - 1;
        if (ahead < tiles)
            legend_fused_tile<KS>(f.negs + legend_fused_tile_word(z, tiles, ahead, f.dim_pad),
                                  T, sb0 + ahead % ST * T * SW);
        asm volatile("cp.async.commit_group;\n" ::);
        u32 sn = sb_at + it % ST * T * H::BYTES;
        float s[8][4];
        legend_fused_scores<KS>(sa_at, row0, sn, lane, s);
        float sca, scb;
        // One version of the loss, with the masks, for every tile: the two of
        // legend_fused_loss spill twice as much here at 128 registers (ptxas, sm_90, d 128:
        // 196 / 200 bytes a thread against 92 / 108).
        legend_fused_loss_tile<8, true>(f, s, st, s_unscale, it * T + 2 * t, sca, scb);
        legend_fused_rescale<DK>(acc, sca, scb);
        // The running maxima this tile's G is relative to (one lane a tile and row; the same
        // lane turns them into factors at the end).
        if (f.loss == LEGEND_LOSS_SOFTMAX && t == (it & 3)) {
            float* c = legend_fused_corr(f, z, it) + ra;
            c[0] = st.ma;
            c[8] = st.mb;
        }
        u32 ga[4][4];
        legend_fused_g_fragments<8>(s, ga);
        u32* out = legend_fused_g_block(f, z, (r_block + row0) / 16, 4 * it) + lane;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
#pragma unroll
            for (int r = 0; r < 4; ++r) legend_store_streaming(out + 128 * jj + 32 * r, ga[jj][r]);
        legend_fused_accumulate<DK, KS, 4>(ga, sn, lane, acc);
    }
    float loss = 0.0f;
    auto running = [&](u32 u) {
        const float* c = legend_fused_corr(f, z, u) + ra;
        return make_float2(c[0], c[8]);
    };
    float2 u = legend_fused_rows_finish(f, z, base + ra, ra, va, vb, st, n_scale, tiles, 1, t,
                                        running, loss);
    if (va) legend_fused_put_row<DK>(f.grad_query + (base + ra) * dim, acc, 0, u.x, dim, t);
    if (vb) legend_fused_put_row<DK>(f.grad_query + (base + ra + 8) * dim, acc, 1, u.y, dim, t);
    legend_fused_add_loss(f, loss);
}
#endif

// The FP16 pair x (of G) with its halves multiplied by c.x (low) and c.y (high, both at
// most 1), in FP32.
__device__ __forceinline__ u32 legend_half2_times(u32 x, float2 c) {
    float lo, hi;
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(x));
    return legend_half2_g(lo * c.x, hi * c.y);
}

// The negatives kernel (see the top of the file): a block owns 128 negatives (column block
// blockIdx.x) of job blockIdx.z and walks over the range blockIdx.y of its rows in tiles of
// 64, three cp.async stages of: G (64 rows by the block's 128 negatives, 16 contiguous KB),
// the rows' FP16 queries, and for softmax their factors for the block's two 64-negative
// tiles. Eight warps, each owning 16 of the negatives.
template <int DK, int KS>
__device__ __forceinline__ void legend_fused_negatives_body(const LegendFused& f) {
    // 16-byte aligned: cp.async's 16-byte copies and ldmatrix's rows.
    extern __shared__ __align__(16) u32 legend_fused_smem[];
    using H = LegendHalfRows<KS>;
    constexpr int SW = H::WORDS;
    constexpr int T = LEGEND_FUSED_TILE;
    constexpr int BN = LEGEND_FUSED_NEG_BLOCK;
    constexpr int ST = LEGEND_FUSED_STAGES;
    legend_check_smem(LegendFusedSmem<KS>::NEGATIVES);
    u32 z = blockIdx.z;
    u32 nrows = f.rows[z];
    u32 rbeg = blockIdx.y * f.row_split;
    u32 rend = min(nrows, rbeg + f.row_split);
    if (rbeg >= rend) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 k = f.k, dim = f.dim, rows_pad = legend_fused_rows_pad(f);
    u32 column = blockIdx.x;
    bool softmax = f.loss == LEGEND_LOSS_SOFTMAX;
    constexpr int G_WORDS = T * BN / 2;
    u32* sg0 = legend_fused_smem;
    u32* sq0 = sg0 + ST * G_WORDS;
    float* sc0 = reinterpret_cast<float*>(sq0 + ST * T * SW);
    u32 sg_at = (u32)__cvta_generic_to_shared(sg0);
    u32 sq_at = (u32)__cvta_generic_to_shared(sq0);
    int row0 = warp * 16;
    float acc[DK][4];
    legend_fused_clear<DK>(acc);
    float q_scale = legend_fp16_scale(f.absmax[2 * z]);
    int walk = (rend - rbeg + T - 1) / T;
    // Whole tiles: rows past nrows in the last one have zero queries (see the top).
    auto stage = [&](int it) {
        u32 r0 = rbeg + it * T;
        u32* sg = sg0 + it % ST * G_WORDS;
        const u32* g = legend_fused_g_block(f, z, r0 / 16, 8 * column);
        for (int e = threadIdx.x; e < G_WORDS / 4; e += 32 * LEGEND_FUSED_WARPS)
            legend_cp16(reinterpret_cast<float*>(sg + 4 * e),
                        reinterpret_cast<const float*>(g + 4 * e), 16);
        legend_fused_tile<KS>(f.query_half + legend_fused_tile_word(z, rows_pad / T, r0 / T,
                                                                    f.dim_pad),
                              T, sq0 + it % ST * T * SW);
        if (softmax && threadIdx.x < 2 * T / 4) {
            u32 h = threadIdx.x / (T / 4), piece = threadIdx.x % (T / 4);
            legend_cp16(&sc0[it % ST * BN + h * T + 4 * piece],
                        legend_fused_corr(f, z, 2 * column + h) + r0 + 4 * piece, 16);
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
        u32 sq = sq_at + it % ST * T * H::BYTES;
        // Gᵀ as A fragments of k step jj (row block jj): (negatives 0-7 | 8-15) x (rows 0-7 |
        // 8-15) are the transposes of the block's matrices 0, 2, 1 and 3.
        int q = lane >> 3;
        u32 a_at = sg + (row0 / 16) * 512 + (((q & 1) << 1) | (q >> 1)) * 128 + (lane & 7) * 16;
        u32 ga[4][4];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) legend_ldsm4_trans(a_at + jj * (BN * 32), ga[jj]);
        if (softmax) {
            // G of each row from its tile's running maximum to the final probabilities.
            const float* c = sc0 + it % ST * BN + row0 / T * T;
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                float2 lo = *reinterpret_cast<const float2*>(&c[16 * jj + 2 * t]);
                float2 hi = *reinterpret_cast<const float2*>(&c[16 * jj + 8 + 2 * t]);
                ga[jj][0] = legend_half2_times(ga[jj][0], lo);
                ga[jj][1] = legend_half2_times(ga[jj][1], lo);
                ga[jj][2] = legend_half2_times(ga[jj][2], hi);
                ga[jj][3] = legend_half2_times(ga[jj][3], hi);
            }
        }
#ifdef LEGEND_WGMMA
        legend_wgmma_fence<4 * DK>(&acc[0][0]);
        legend_fused_accumulate<DK, KS, 4>(ga, sq, lane, acc);
        legend_wgmma_wait<4 * DK>(&acc[0][0]);
#else
        legend_fused_accumulate<DK, KS, 4>(ga, sq, lane, acc);
#endif
    }
    float* out = f.grad_negs + (u64)z * k * dim;
    float unscale = 1.0f / (q_scale * LEGEND_FUSED_G_SCALE);
    u32 ja = column * BN + row0 + g, jb = ja + 8;
#pragma unroll
    for (int n = 0; n < DK; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // The lane's two adjacent columns of negative ja (h = 0) or jb.
            u32 j = h ? jb : ja, c = 8 * n + 2 * t;
            if (j >= k || c >= dim) continue;
            legend_fused_put_pair(&out[(u64)j * dim + c], c, dim, acc[n][2 * h] * unscale,
                                  acc[n][2 * h + 1] * unscale, f.atomic);
        }
}

#ifdef LEGEND_WGMMA
// The warp-specialised persistent rows kernel (Hopper; see the top of the file).
// LEGEND_WS_THREADS: the producer warpgroup (its first thread issues every copy) and two
// consumer warpgroups. A work item is 128 rows of a job: consumer warpgroup w owns rows
// 64w.. of it, the producer walks the same items in the same order.
#define LEGEND_WS_THREADS 384
// Negatives a walked tile (two 64-row tiles of the FP16 negatives), and its stages.
#define LEGEND_WS_TILE 128
#define LEGEND_WS_STAGES 3
// Tiles whose running maxima (softmax) a consumer keeps in shared memory until it turns them
// into factors; a job of more tiles (k > 4096) keeps the rest in device memory and reads them
// back (a round trip of latency a tile, which the readback from shared memory avoids).
#define LEGEND_WS_MAXIMA 32
// Registers a thread after setmaxnreg: 128 x 24 + 256 x 240 fit the 64 K of a multiprocessor.
#define LEGEND_WS_PRODUCER_REGS 24
#define LEGEND_WS_CONSUMER_REGS 240

// Dynamic shared memory of the kernel for rows of KS k16 steps and width 8·DK, in bytes
// (legend-cuda's fused_rows_smem computes the same total): the stages of negatives, the
// block's 128 FP16 queries, each consumer's 64 FP32 queries as the bulk copy brings them
// (from the 16-byte boundary below their first float: 16 bytes more at each end), each
// consumer's running maxima (LEGEND_WS_MAXIMA tiles of its 64 rows), then the mbarriers.
template <int DK, int KS>
struct LegendWsSmem {
    static constexpr u32 ROW = 32 * KS;
    static constexpr u32 STAGE = LEGEND_WS_TILE * ROW;
    static constexpr u32 QHALF = LEGEND_WS_STAGES * STAGE;
    static constexpr u32 QF32 = QHALF + LEGEND_FUSED_BLOCK_ROWS * ROW;
    static constexpr u32 QF32_WG = 64 * 32 * DK + 32;
    static constexpr u32 MAXIMA = QF32 + 2 * QF32_WG;
    static constexpr u32 BARS = MAXIMA + 2 * LEGEND_WS_MAXIMA * 64 * 4;
    // full[stage], empty[stage], queries full[2], queries empty[2]
    static constexpr u32 TOTAL = BARS + 8 * (2 * LEGEND_WS_STAGES + 4);
};

template <int DK, int KS>
__device__ __forceinline__ void legend_fused_rows_ws(const LegendFused& f) {
    extern __shared__ __align__(128) unsigned char legend_ws_smem[];
    using L = LegendWsSmem<DK, KS>;
    using H = LegendHalfRows<KS>;
    constexpr u32 ST = LEGEND_WS_STAGES, NT = LEGEND_WS_TILE;
    u32 smem = (u32)__cvta_generic_to_shared(legend_ws_smem);
    u32 full = smem + L::BARS, empty = full + 8 * ST, q_full = empty + 8 * ST,
        q_empty = q_full + 16;
    legend_check_smem(L::TOTAL);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (u32 s = 0; s < ST; ++s) {
            legend_mbar_init(full + 8 * s, 1);
            legend_mbar_init(empty + 8 * s, 8);  // a consumer warp each
        }
        for (u32 w = 0; w < 2; ++w) {
            legend_mbar_init(q_full + 8 * w, 1);
            legend_mbar_init(q_empty + 8 * w, 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    u32 k = f.k, dim = f.dim, k_pad = legend_fused_k_pad(k), rows_pad = legend_fused_rows_pad(f);
    u32 tiles = k_pad / NT, per_job = rows_pad / LEGEND_FUSED_BLOCK_ROWS;
    u32 items = f.jobs * per_job;

    if (warp < 4) {
        // The producer: every copy of the walk, in the consumers' order.
        legend_setmaxnreg_dec<LEGEND_WS_PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        u32 n = 0, done = 0;
        for (u32 item = blockIdx.x; item < items; item += gridDim.x) {
            u32 z = item / per_job, r_block = item % per_job * LEGEND_FUSED_BLOCK_ROWS;
            u32 nrows = f.rows[z];
            if (r_block >= nrows) continue;
            for (u32 w = 0; w < 2; ++w) {
                if (done > 0) legend_mbar_wait(q_empty + 8 * w, (done - 1) & 1);
                u32 r = r_block + 64 * w;
                u32 valid = nrows > r ? min(nrows - r, 64u) : 0u;
                u64 from = (u64)(f.query + ((u64)z * f.max_rows + r) * dim);
                u64 lo = from & ~15ull, hi = (from + 4ull * valid * dim + 15) & ~15ull;
                u32 bytes = valid ? (u32)(hi - lo) : 0u;
                legend_mbar_expect(q_full + 8 * w, bytes);
                if (bytes)
                    legend_bulk_load(smem + L::QF32 + w * L::QF32_WG,
                                     reinterpret_cast<const void*>(lo), bytes, q_full + 8 * w);
            }
            for (u32 it = 0; it < tiles; ++it, ++n) {
                u32 s = n % ST;
                if (n >= ST) legend_mbar_wait(empty + 8 * s, (n / ST + 1) & 1);
                legend_mbar_expect(full + 8 * s, L::STAGE);
                legend_bulk_load(smem + s * L::STAGE,
                                 f.negs + legend_fused_tile_word(z, k_pad / LEGEND_FUSED_TILE,
                                                                 2 * it, f.dim_pad),
                                 L::STAGE, full + 8 * s);
            }
            ++done;
        }
        return;
    }

    legend_setmaxnreg_inc<LEGEND_WS_CONSUMER_REGS>();
    int wg = (warp >> 2) - 1, w4 = warp & 3, g = lane >> 2, t = lane & 3;
    // The first consumer goes first: the second lets it through its barrier once.
    if (wg == 1) legend_bar_arrive(3, 256);
    u32 tid = threadIdx.x - 128 * (wg + 1);
    u32 sq = smem + L::QHALF;
    const float* staged = reinterpret_cast<const float*>(legend_ws_smem + L::QF32 + wg * L::QF32_WG);
    // This thread's rows' running maxima (row 16·w4 + g of the warpgroup's, and + 8).
    float* maxima = reinterpret_cast<float*>(legend_ws_smem + L::MAXIMA) +
                    wg * LEGEND_WS_MAXIMA * 64 + 16 * w4 + (lane >> 2);
    float loss = 0.0f;
    u32 n = 0, done = 0;
    for (u32 item = blockIdx.x; item < items; item += gridDim.x) {
        u32 z = item / per_job, r_block = item % per_job * LEGEND_FUSED_BLOCK_ROWS;
        u32 nrows = f.rows[z];
        if (r_block >= nrows) continue;
        u64 base = (u64)z * f.max_rows;
        float q_scale = legend_fp16_scale(f.absmax[2 * z]);
        float n_scale = legend_fp16_scale(f.absmax[2 * z + 1]);
        float s_unscale = 1.0f / (q_scale * n_scale);
        u32 r_wg = r_block + 64 * wg;
        u32 valid = nrows > r_wg ? min(nrows - r_wg, 64u) : 0u;
        // The copy began at the 16-byte boundary below the first float.
        u32 skip = (u32)((u64)(f.query + (base + r_wg) * dim) & 15) / 4;
        // The warpgroup's queries, scaled and converted into its half of the block's FP16
        // tile (zeros past the job's rows and past dim), and into the FP16 copy the
        // negatives kernel reads (the same layout, one 64-row tile).
        legend_mbar_wait(q_full + 8 * wg, done & 1);
        // The last item's dQ has left the tile this conversion overwrites.
        legend_bar_sync(1 + wg, 128);
        u32* qh = f.query_half + legend_fused_tile_word(z, rows_pad / LEGEND_FUSED_TILE,
                                                        r_wg / LEGEND_FUSED_TILE, f.dim_pad);
        bool clamp = legend_fp16_scale_saturates(f.absmax[2 * z]);
        // Piece e of the tile (16 bytes: eight rows' chunk c, then chunk c + 1), so that a
        // warp writes 512 contiguous bytes.
        for (u32 e = tid; e < 64 * H::CHUNKS; e += 128) {
            u32 i = e / (8 * H::CHUNKS) * 8 + e % 8, c = e / 8 % H::CHUNKS;
            float x[8];
            const float* from = staged + skip + i * dim + 8 * c;
            if (dim % 4 == 0) {
                // Rows of whole 16-byte pieces (and skip 0): two vector reads.
#pragma unroll
                for (int v = 0; v < 8; v += 4) {
                    float4 y = i < valid && 8 * c + v < dim
                                   ? *reinterpret_cast<const float4*>(from + v)
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    x[v] = y.x;
                    x[v + 1] = y.y;
                    x[v + 2] = y.z;
                    x[v + 3] = y.w;
                }
            } else {
#pragma unroll
                for (int v = 0; v < 8; ++v) x[v] = i < valid && 8 * c + v < dim ? from[v] : 0.0f;
            }
            u32 hv[4];
#pragma unroll
            for (int v = 0; v < 4; ++v)
                hv[v] = clamp ? legend_half2(x[2 * v] * q_scale, x[2 * v + 1] * q_scale)
                              : legend_half2_g(x[2 * v] * q_scale, x[2 * v + 1] * q_scale);
            uint4 h = make_uint4(hv[0], hv[1], hv[2], hv[3]);
            *reinterpret_cast<uint4*>(legend_ws_smem + L::QHALF + H::at(64 * wg, 0) + 16 * e) = h;
            *reinterpret_cast<uint4*>(qh + 4 * e) = h;
        }
        __syncwarp();
        if (lane == 0) legend_mbar_arrive(q_empty + 8 * wg);
        legend_fused_publish();
        legend_bar_sync(1 + wg, 128);

        // Rows a = r_wg + 16·w4 + g and b = a + 8.
        u32 ra = r_wg + 16 * w4 + g;
        bool va = ra < nrows, vb = ra + 8 < nrows;
        LegendRowLoss st = legend_row_loss(f, base + ra, va, vb, t);
        float acc[DK][4];
        legend_fused_clear<DK>(acc);
        u32 sa = sq + H::at(64 * wg, 0);
        u32* g_out = legend_fused_g_block(f, z, (r_wg + 16 * w4) / 16, 0) + lane;
        u32 g_column = legend_fused_rows_pad(f) / 16 * 8 * 128;
        float s[NT / 8][4];
        u32 ga[NT / 16][4];
        // S of the tile in `stage` into s, issued (the accumulators and G's fragments
        // fenced first: the products that follow read them).
        u64 qa = legend_wgmma_desc(sa, 128, H::CHUNKS * 128);
        // Ping-pong (FlashAttention-3): the warpgroups take turns to issue their products
        // (named barriers 3 and 4), so that one's softmax runs while the other's products
        // do, instead of both waiting on the tensor cores at once (measurement log, version
        // 28).
        auto my_turn = [&]() { legend_bar_sync(3 + wg, 256); };
        auto your_turn = [&]() { legend_bar_arrive(4 - wg, 256); };
        auto scores = [&](u32 stage) {
            u64 nb = legend_wgmma_desc(smem + stage * L::STAGE, 128, H::CHUNKS * 128);
            legend_wgmma_pin<NT / 2>(&s[0][0]);
            legend_wgmma_pin_u32<NT / 4>(&ga[0][0]);
            legend_wgmma_fence<4 * DK>(&acc[0][0]);
            // k16 step kk: 256 bytes on in both (16 in the descriptors' units).
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)
                legend_wgmma_ss_n128(&s[0][0], qa + 16 * kk, nb + 16 * kk, kk);
            legend_wgmma_commit();
        };
        // Tile it's S through the loss (and for softmax the running maxima its G is
        // relative to: one lane a tile and row, the same lane turns them into factors at
        // the end); sca and scb rescale the accumulators.
        float sca, scb;
        auto loss_tile = [&](u32 it) {
            legend_fused_loss<NT / 8>(f, s, st, s_unscale, it * NT, t, sca, scb);
            if (f.loss == LEGEND_LOSS_SOFTMAX && t == (it & 3)) {
                float* c = it < LEGEND_WS_MAXIMA ? maxima + it * 64 : legend_fused_corr(f, z, 2 * it) + ra;
                c[0] = st.ma;
                c[8] = st.mb;
            }
        };
        // The tile's G into the fragments ga (once the product that read them is done),
        // and out to device memory, where the next tile's G follows one column block on.
        auto to_g = [&]() {
            legend_fused_g_fragments<NT / 8>(s, ga);
#pragma unroll
            for (int jj = 0; jj < NT / 16; ++jj)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    legend_store_streaming(g_out + 128 * jj + 32 * r, ga[jj][r]);
            g_out += g_column;
        };
        u32 prev = n % ST;
        legend_mbar_wait(full + 8 * prev, (n / ST) & 1);
        my_turn();
        scores(prev);
        your_turn();
        legend_wgmma_wait<NT / 2>(&s[0][0]);
        loss_tile(0);
        to_g();
        ++n;
        // Tile it's S is computed while tile it - 1's dQ product runs, and its loss while
        // that product still runs; then the accumulators are rescaled and G converted.
        for (u32 it = 1; it < tiles; ++it, ++n) {
            u32 stage = n % ST;
            legend_mbar_wait(full + 8 * stage, (n / ST) & 1);
            my_turn();
            scores(stage);
            legend_fused_accumulate<DK, KS, NT / 16>(ga, smem + prev * L::STAGE, lane, acc);
            your_turn();
            legend_wgmma_wait<NT / 2, 1>(&s[0][0]);
            loss_tile(it);
            legend_wgmma_wait<4 * DK>(&acc[0][0]);
            legend_wgmma_pin_u32<NT / 4>(&ga[0][0]);
            __syncwarp();
            if (lane == 0) legend_mbar_arrive(empty + 8 * prev);
            legend_fused_rescale<DK>(acc, sca, scb);
            to_g();
            prev = stage;
        }
        legend_wgmma_pin_u32<NT / 4>(&ga[0][0]);
        legend_wgmma_fence<4 * DK>(&acc[0][0]);
        my_turn();
        legend_fused_accumulate<DK, KS, NT / 16>(ga, smem + prev * L::STAGE, lane, acc);
        your_turn();
        legend_wgmma_wait<4 * DK>(&acc[0][0]);
        __syncwarp();
        if (lane == 0) legend_mbar_arrive(empty + 8 * prev);
        auto running = [&](u32 u) {
            const float* c = u < LEGEND_WS_MAXIMA ? maxima + u * 64 : legend_fused_corr(f, z, 2 * u) + ra;
            return make_float2(c[0], c[8]);
        };
        float2 u = legend_fused_rows_finish(f, z, base + ra, ra, va, vb, st, n_scale, tiles, 2,
                                            t, running, loss);
        // dQ through the warpgroup's FP16 query tile, free until the next item's queries:
        // eight rows of the warp at a time, written from the fragments, then copied out as
        // the rows lie in device memory, in whole 16-byte pieces where d % 4 == 0 (a store
        // straight from the fragments spans 16 rows, eight cache lines).
        float* stage = reinterpret_cast<float*>(legend_ws_smem + L::QHALF + wg * 64 * L::ROW) +
                       w4 * 8 * dim;
        u32 first = r_wg + 16 * w4;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            legend_fused_put_row<DK>(stage + g * dim, acc, h, h ? u.y : u.x, dim, t);
            __syncwarp();
            u32 from = first + 8 * h;
            u32 count = (nrows > from ? min(nrows - from, 8u) : 0u) * dim;
            float* to = f.grad_query + (base + from) * dim;
            if (dim % 4 == 0) {
                for (u32 i = 4 * lane; i < count; i += 128)
                    *reinterpret_cast<float4*>(to + i) = *reinterpret_cast<const float4*>(stage + i);
            } else {
                for (u32 i = lane; i < count; i += 32) to[i] = stage[i];
            }
            __syncwarp();
        }
        ++done;
    }
    legend_fused_add_loss(f, loss);
}
#endif

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

// The negatives of jobs first_job.. in FP16, scaled by their job's power of two, in the
// tiled layout (64-row tiles of LegendHalfRows, dim_pad halves a row): zeros past dim and
// from k to the padded k. The fused kernels' operand, read many times, so converted once
// here. A thread a pair of values.
extern "C" __global__ void legend_gather_negatives_half(const u32* __restrict__ negs,
                                                        u32 first_job, u32 k, u32 dim,
                                                        u32 dim_pad,
                                                        const float* __restrict__ emb,
                                                        const u32* __restrict__ absmax,
                                                        u32* __restrict__ out) {
    u32 z = blockIdx.y, pairs = dim_pad / 2, k_pad = legend_fused_k_pad(k);
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)k_pad * pairs) return;
    u32 j = (u32)(idx / pairs), c = 2 * (u32)(idx % pairs);
    float lo = 0.0f, hi = 0.0f;
    if (j < k) {
        float scale = legend_fp16_scale(absmax[2 * z + 1]);
        const float* row = emb + (u64)negs[(u64)(first_job + z) * k + j] * dim;
        lo = c < dim ? row[c] * scale : 0.0f;
        hi = c + 1 < dim ? row[c + 1] * scale : 0.0f;
    }
    u32 word = legend_half_rows_at(j % LEGEND_FUSED_TILE, c / 8, dim_pad / 8) / 4 + c % 8 / 2;
    out[legend_fused_tile_word(z, k_pad / LEGEND_FUSED_TILE, j / LEGEND_FUSED_TILE, dim_pad) +
        word] = legend_half2(lo, hi);
}
#endif

// How legend-cuda launches a program's pair of fused kernels, read from the module
// (legend_fused_launch): the rows kernel's threads a block, dynamic shared memory and whether
// it is persistent (a block a multiprocessor walking all the group's blocks of rows, else a
// block a 128 rows of a job, the jobs along y), and the negatives kernel's threads a block
// and shared memory (a block a column block by row range by job). The sizes live here only.
struct LegendFusedLaunch {
    u32 rows_threads;
    u32 rows_smem;
    u32 rows_persistent;
    u32 negatives_threads;
    u32 negatives_smem;
};

#ifdef LEGEND_WGMMA
#define LEGEND_FUSED_LAUNCH(DK, KS)                                                           \
    {LEGEND_WS_THREADS, LegendWsSmem<DK, KS>::TOTAL, 1, 32 * LEGEND_FUSED_WARPS,              \
     LegendFusedSmem<KS>::NEGATIVES}
#else
#define LEGEND_FUSED_LAUNCH(DK, KS)                                                           \
    {32 * LEGEND_FUSED_WARPS, LegendFusedSmem<KS>::ROWS, 0, 32 * LEGEND_FUSED_WARPS,          \
     LegendFusedSmem<KS>::NEGATIVES}
#endif

// One pair of kernels per padded width 8·DK: 32, 64, 104 (d = 100) and 128, written out so
// that each entry point can be found by its name. Each width is a program of its own
// (LEGEND_FUSED_WIDTH, set by legend-cuda's nvrtc.rs), compiled in parallel with the others;
// the program of the other kernels (LEGEND_FUSED_WIDTH 0) holds none of them. On Hopper the
// rows kernel is the warp-specialised one (one block of LEGEND_WS_THREADS a multiprocessor).
#ifdef LEGEND_WGMMA
#define LEGEND_FUSED_ROWS(W, DK, KS)                                                          \
    extern "C" __global__ void __launch_bounds__(LEGEND_WS_THREADS, 1)                       \
        legend_fused_rows_d##W(LegendFused f) {                                               \
        legend_fused_rows_ws<DK, KS>(f);                                                      \
    }
#else
#define LEGEND_FUSED_ROWS(W, DK, KS)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2)                 \
        legend_fused_rows_d##W(LegendFused f) {                                               \
        legend_fused_rows_body<DK, KS>(f);                                                    \
    }
#endif
#define LEGEND_FUSED_PAIR(W, DK, KS)                                                          \
    extern "C" __device__ LegendFusedLaunch legend_fused_launch =                             \
        LEGEND_FUSED_LAUNCH(DK, KS);                                                          \
    LEGEND_FUSED_ROWS(W, DK, KS)                                                              \
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
