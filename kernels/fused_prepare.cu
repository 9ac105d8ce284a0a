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
// from k to the padded k, but for column `ones` (TransE L2: dim + 1; else past dim_pad) of
// the first k rows, which holds 1 (the rows kernel's dQ product then sums each row's
// weights). The fused kernels' operand, read many times, so converted once here. A thread
// a pair of values.
extern "C" __global__ void legend_gather_negatives_half(const u32* __restrict__ negs,
                                                        u32 first_job, u32 k, u32 dim,
                                                        u32 dim_pad, u32 ones,
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
        lo = c < dim ? row[c] * scale : c == ones ? 1.0f : 0.0f;
        hi = c + 1 < dim ? row[c + 1] * scale : c + 1 == ones ? 1.0f : 0.0f;
    }
    u32 word = legend_half_rows_at(j % LEGEND_FUSED_TILE, c / 8, dim_pad / 8) / 4 + c % 8 / 2;
    out[legend_fused_tile_word(z, k_pad / LEGEND_FUSED_TILE, j / LEGEND_FUSED_TILE, dim_pad) +
        word] = legend_half2(lo, hi);
}

// TransE L2: the squared norms of job z's negatives as the fused kernels' operands hold them
// (each value times the job's FP16 scale, rounded to FP16, squared and summed in FP32,
// unscaled), so that |q|² + |n|² - 2 q·n is the squared distance of the rows the products
// use; 0 from k to the padded k (a job's stride in `out`). The queries' norms come from
// legend_queries (their scale is 1). A warp a row.
extern "C" __global__ void legend_fused_negative_norms(const u32* __restrict__ negs,
                                                       u32 first_job, u32 k, u32 dim,
                                                       const float* __restrict__ emb,
                                                       const u32* __restrict__ absmax,
                                                       float* __restrict__ out) {
    u32 z = blockIdx.y, lane = threadIdx.x & 31, k_pad = legend_fused_k_pad(k);
    u32 j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= k_pad) return;
    float sum = 0.0f, scale = legend_fp16_scale(absmax[2 * z + 1]);
    if (j < k) {
        const float* row = emb + (u64)negs[(u64)(first_job + z) * k + j] * dim;
        for (u32 c = lane; c < dim; c += 32) sum += legend_fp16_square(row[c] * scale);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) out[(u64)z * k_pad + j] = sum / (scale * scale);
}
#endif
