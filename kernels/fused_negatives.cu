// The fused negatives kernel: S again and dN per block of 128 negatives (mma.sync, or
// wgmma on sm_90a).

// The FP16 pair x (of G) with its halves multiplied by c.x (low) and c.y (high, both at
// most 1), in FP32.
__device__ __forceinline__ u32 legend_half2_times(u32 x, float2 c) {
    float2 v = legend_half2_unpack(x);
    return legend_half2_g(v.x * c.x, v.y * c.y);
}

// The negatives kernel (see fused.cuh): a block owns 128 negatives (column block
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
    // Softmax and TransE L2 turn each tile's G into ∂L/∂S (or G / dist) by the rows kernel's
    // factors; TransE's, times the job's smallest nearest distance, stay at most 1.
    bool factors = f.loss == LEGEND_LOSS_SOFTMAX || LEGEND_FUSED_TRANSE;
    float nearest = 1.0f;
    if (LEGEND_FUSED_TRANSE && f.nearest[z] != 0u) nearest = __uint_as_float(~f.nearest[z]);
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
        if (factors && threadIdx.x < 2 * T / 4) {
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
        if (factors) {
            // G of each row from its tile's running maximum to the final probabilities.
            const float* c = sc0 + it % ST * BN + row0 / T * T;
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                float2 lo = *reinterpret_cast<const float2*>(&c[16 * jj + 2 * t]);
                float2 hi = *reinterpret_cast<const float2*>(&c[16 * jj + 8 + 2 * t]);
                lo.x *= nearest;
                lo.y *= nearest;
                hi.x *= nearest;
                hi.y *= nearest;
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
    u32 ja = column * BN + row0 + g, jb = ja + 8;
    float unscale = 1.0f / (q_scale * LEGEND_FUSED_G_SCALE * nearest);
    if (LEGEND_FUSED_TRANSE) {
        float* w = f.neg_weight + (u64)z * k;
        legend_fused_transe_weights<DK>(acc, dim, make_float2(unscale * q_scale, unscale * q_scale),
                                        ja < k ? w + ja : nullptr, jb < k ? w + jb : nullptr,
                                        f.atomic, t);
    }
    float* out = f.grad_negs + (u64)z * k * dim;
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
