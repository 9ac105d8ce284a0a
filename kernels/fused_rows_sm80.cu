// The fused rows kernel with mma.sync (sm_80, and sm_90 without the a-features): S, the
// loss, G and dQ per block of 128 rows.

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

// The rows kernel with mma.sync (see fused.cuh): a block owns 128 rows of job
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
            float4 y = ok ? *reinterpret_cast<const float4*>(f.query + (base + r) * dim + c)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            float x[4] = {y.x, y.y, y.z, y.w};
            legend_fused_query_ones(f, x, c, r < nrows, q_scale);
            uint2 v = make_uint2(legend_half2(x[0] * q_scale, x[1] * q_scale),
                                 legend_half2(x[2] * q_scale, x[3] * q_scale));
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
            float x[2] = {ok && (u32)c < dim ? q[c] : 0.0f, ok && (u32)c + 1 < dim ? q[c + 1] : 0.0f};
            legend_fused_query_ones(f, x, c, ok, q_scale);
            u32 v = legend_half2(x[0] * q_scale, x[1] * q_scale);
            u32 word = (H::at(i, c / 8) + 2 * (c % 8)) / 4;
            legend_fused_smem[word] = v;
            qh[word] = v;
        }
    }
    int row0 = warp * 16;
    // Rows a = r_block + row0 + g and b = a + 8.
    u32 ra = r_block + row0 + g;
    bool va = ra < nrows, vb = ra + 8 < nrows;
    LegendRowLoss st = legend_row_loss(f, z, base + ra, va, vb, t);
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
        // What this tile's G is relative to (legend_fused_tile_shift; one lane a tile and
        // row, the same lane turns it into factors at the end).
        if ((f.loss == LEGEND_LOSS_SOFTMAX || LEGEND_FUSED_TRANSE) && t == (it & 3)) {
            float* c = legend_fused_corr(f, z, it) + ra;
            float2 shift = legend_fused_tile_shift(st);
            c[0] = shift.x;
            c[8] = shift.y;
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
    if (LEGEND_FUSED_TRANSE) {
        float* w = f.query_weight + base + ra;
        legend_fused_transe_weights<DK>(acc, dim + 1, make_float2(u.x * n_scale, u.y * n_scale),
                                        va ? w : nullptr, vb ? w + 8 : nullptr, false, t);
    }
    if (va) legend_fused_put_row<DK>(f.grad_query + (base + ra) * dim, acc, 0, u.x, dim, t);
    if (vb) legend_fused_put_row<DK>(f.grad_query + (base + ra + 8) * dim, acc, 1, u.y, dim, t);
    legend_fused_add_loss(f, loss);
}
#endif
