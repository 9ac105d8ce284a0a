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
// The files, concatenated in this order: fused.cuh (this description, the layouts, shared
// helpers), fused_loss.cuh (the loss and the rows' epilogue), fused_ptx.cuh (PTX wrappers
// and the operand tiles), fused_rows_sm80.cu, fused_negatives.cu, fused_rows_sm90.cu,
// fused_prepare.cu (absmax and the FP16 negatives, in the program of the other kernels) and
// fused_launch.cu (each width's pair of kernels).
//
// Two implementations share the layouts, the loss and the epilogues:
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
// Shared-memory stages of the walked tiles: the copy of tile it + 2 is queued while tile it
// is used, into the stage tile it - 1 used, so one barrier an iteration orders both.
#define LEGEND_FUSED_STAGES 3
// The tile sizes the host sizes the buffers by come from legend-cuda's kernel_abi.rs, their
// one definition, as -D options: LEGEND_FUSED_TILE (rows of the tiles of the FP16 operands in
// device memory, and of the walked tile of the mma.sync kernels), LEGEND_FUSED_NEG_BLOCK
// (negatives a block of the negatives kernel owns, and a column block of G: k is padded to
// it), LEGEND_FUSED_BLOCK_ROWS (rows a block of the rows kernel owns: the rows are padded to
// it).
#if !defined(LEGEND_FUSED_TILE) || !defined(LEGEND_FUSED_NEG_BLOCK) || \
    !defined(LEGEND_FUSED_BLOCK_ROWS)
#error "the fused tile sizes are defined by legend-cuda (kernel_abi.rs), as -D options"
#endif

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
    // Softmax and TransE L2: the factor that turns a tile's G into ∂L/∂S (softmax:
    // exp(tile's shift - final shift) / sum; TransE also divides by the tile's nearest
    // distance), by job, 64-negative tile and row (legend_fused_corr), first what the tile's
    // G is relative to (legend_fused_tile_shift). Unused by the other losses.
    float* corr;
    const u32* rows;      // rows of each job of the group
    // Per job: the largest magnitude of its queries and of its negatives, as float bits
    // (legend_fused_absmax), from which both operands get their FP16 scales.
    const u32* absmax;
    double* loss_sum;
    // TransE L2 (LEGEND_FUSED_TRANSE; null otherwise): the squared norms of the rows as FP16
    // rounds them (unscaled; queries group x max_rows from legend_queries, negatives group x
    // k_pad from legend_fused_negative_norms); and per job the complement of the float bits
    // of the smallest nearest distance of its rows (0 before any row), the negatives
    // kernel's common scale of G / dist.
    const float* query_norm;
    const float* neg_norm;
    u32* nearest;
    // TransE L2: what dQ and dN lack, per query (group x max_rows) and negative (group x k,
    // added into where `atomic`): the weight sums that times the FP32 rows they subtract
    // (legend_fused_transe_weights).
    float* query_weight;
    float* neg_weight;
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

// TransE L2's programs (LEGEND_FUSED_TRANSE 1, set by legend-cuda's nvrtc.rs) define the same
// kernels for scores -||q - n|| = -sqrt(|q|² + |n|² - 2 q·n), the products on the tensor
// cores as for the dot decoders (see legend_fused_transe_tile): a program of its own, so
// that the dot decoders' kernels keep their registers.
#ifndef LEGEND_FUSED_TRANSE
#define LEGEND_FUSED_TRANSE 0
#endif

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

// The factors (first what the tiles' G are relative to) of job z's rows for the 64 negatives of
// tile `tile` (rows_pad floats).
__device__ __forceinline__ float* legend_fused_corr(const LegendFused& f, u32 z, u32 tile) {
    u32 tiles = legend_fused_k_pad(f.k) / LEGEND_FUSED_TILE;
    return f.corr + ((u64)z * tiles + tile) * legend_fused_rows_pad(f);
}

// A store marked evict-first (st.global.cs): G streams through L2 (0.4 GB a benchmark batch)
// and should not push out the negatives every block of the job reads (measurement log,
// version 17).
__device__ __forceinline__ void legend_store_streaming(u32* p, u32 v) {
    asm volatile("st.global.cs.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// 1/sqrt(x), by the special-function unit (subnormals flushed: TransE L2's squared distances
// below 2^-126 are taken as 0 before it).
__device__ __forceinline__ float legend_rsqrt(float x) {
    float r;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
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

__device__ __forceinline__ float legend_quad_min(float v) {
    v = fminf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fminf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
