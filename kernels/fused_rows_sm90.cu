// The warp-specialised persistent rows kernel (sm_90a): a producer warpgroup copies, two
// consumer warpgroups take turns on the tensor cores.

#ifdef LEGEND_WGMMA
// The warp-specialised persistent rows kernel (Hopper; see fused.cuh).
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
            legend_fused_query_ones(f, x, 8 * c, i < valid, q_scale);
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
        LegendRowLoss st = legend_row_loss(f, z, base + ra, va, vb, t);
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
            if ((f.loss == LEGEND_LOSS_SOFTMAX || LEGEND_FUSED_TRANSE) && t == (it & 3)) {
                float* c = it < LEGEND_WS_MAXIMA ? maxima + it * 64 : legend_fused_corr(f, z, 2 * it) + ra;
                float2 shift = legend_fused_tile_shift(st);
                c[0] = shift.x;
                c[8] = shift.y;
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
        if (LEGEND_FUSED_TRANSE) {
            float* w = f.query_weight + base + ra;
            legend_fused_transe_weights<DK>(acc, dim + 1, make_float2(u.x * n_scale, u.y * n_scale),
                                            va ? w : nullptr, vb ? w + 8 : nullptr, false, t);
        }
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
