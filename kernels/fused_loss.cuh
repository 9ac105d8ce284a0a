// The fused kernels' loss: softmax, logistic and ranking over a thread's two rows, their G
// fragments, and the rows' finish (dQ out, the loss summed). Part of the fused programs
// (fused.cuh describes them).

// A thread's two rows of a job through the loss: the rows a (row g of its warp's 16) and
// b (g + 8) of the accumulators.
struct LegendRowLoss {
    float pa, pb;            // the positives' scores (0 past the job's rows)
    float ma, mb;            // softmax: running maxima, the positive's score to begin with
    float la, lb;            // this lane's part of the running sum (softmax, times 2^14) or
                             // of the loss terms (the others)
    float activa, activb;    // ranking: this lane's part of the active negatives
    // TransE L2: the rows' squared query norms, the job's squared negative norms, and the
    // rows' nearest distances so far over the negatives with a gradient (infinite before
    // one; the scale of their G / dist, apart from the softmax shift ma and mb, which a
    // positive or a negative at distance 0 raises to 0 where it would carry no gradient).
    float qa, qb;
    const float* nn;
    float neara, nearb;
};

// The loss state of rows a and b (of job z) before the first tile.
__device__ __forceinline__ LegendRowLoss legend_row_loss(const LegendFused& f, u32 z, u64 at_a,
                                                         bool va, bool vb, int t) {
    LegendRowLoss r;
    r.pa = va ? f.pos[at_a] : 0.0f;
    r.pb = vb ? f.pos[at_a + 8] : 0.0f;
    // Softmax's shift starts at the positive's score (counted below); the other losses
    // have none.
    bool softmax = f.loss == LEGEND_LOSS_SOFTMAX;
    r.ma = softmax ? r.pa : 0.0f;
    r.mb = softmax ? r.pb : 0.0f;
    // A row past the job's has an infinite norm: all of its pairs at distance 0 (infinity
    // is not above its threshold), so its G are 0 and its nearest distance is none, or the
    // padding's past k (√FLT_MAX: factors far below 1). With its zero query alone it would
    // have the nearest negative's norm, and factors from it that, times the job's nearest
    // distance, overflow FP16 in the negatives kernel.
    const float inf = __int_as_float(0x7f800000);
    r.qa = LEGEND_FUSED_TRANSE ? (va ? f.query_norm[at_a] : inf) : 0.0f;
    r.qb = LEGEND_FUSED_TRANSE ? (vb ? f.query_norm[at_a + 8] : inf) : 0.0f;
    r.nn = LEGEND_FUSED_TRANSE ? f.neg_norm + (u64)z * legend_fused_k_pad(f.k) : nullptr;
    r.neara = r.nearb = inf;
    // The positive counted once, by lane t = 0, as exp(0) times the G scale.
    r.la = r.lb = (softmax && t == 0) ? LEGEND_FUSED_G_SCALE : 0.0f;
    r.activa = r.activb = 0.0f;
    return r;
}

// TransE L2: column `dim` of a valid row's FP16 query holds 1 (x[v] is column c0 + v, before
// the scale q_scale, a power of two), so that the negatives kernel's product sums each
// negative's weights (legend_fused_transe_weights).
template <int N>
__device__ __forceinline__ void legend_fused_query_ones(const LegendFused& f, float (&x)[N],
                                                        u32 c0, bool valid, float q_scale) {
#if LEGEND_FUSED_TRANSE
    if (!valid) return;
#pragma unroll
    for (int v = 0; v < N; ++v)
        if (c0 + v == f.dim) x[v] = 1.0f / q_scale;
#endif
}

// The logistic or ranking loss of one negative's score x against the positive's p: its term
// and ∂L/∂x (w = 1/k: logistic averages over the negatives).
__device__ __forceinline__ void legend_fused_term(const LegendFused& f, float x, float p, float w,
                                                  float& term, float& grad) {
    if (f.loss == LEGEND_LOSS_LOGISTIC) {
        float ex = __expf(-fabsf(x));
        term = w * (fmaxf(x, 0.0f) + log1pf(ex));
        grad = w * (x >= 0.0f ? 1.0f : ex) / (1.0f + ex);
    } else {
        float v = f.margin - p + x;
        term = v > 0.0f ? v : 0.0f;
        grad = v > 0.0f ? 1.0f : 0.0f;
    }
}

// The squared distance, relative to |q|² + |n|², below which TransE L2's fused kernels take a
// pair to be at distance 0 (2^-20: about ten times the expansion's FP32 rounding at d = 128).
#define LEGEND_TRANSE_ZERO 9.5367431640625e-7f

// TransE L2's version of legend_fused_loss_tile: s holds the scaled products q·n, which
// become squared distances |q|² + |n|² - 2 q·n (the norms of the FP16-rounded rows, so that
// this is the distance of the rows the products use, up to FP32 rounding), scores -dist
// through the loss, and G / dist, the weight of n - q in dQ (of q - n in dN). G / dist is
// unbounded as a negative nears its query, so it leaves times the row's nearest distance so
// far over the pairs with a weight (at most G, in FP16's range however near), the
// accumulators rescaled as that shrinks, as softmax rescales them as its shift grows.
// Neither the positive nor a pair at distance 0 enters that distance (either would scale
// every other pair's weight to 0), but both enter softmax's shift, the largest score, so
// that no exponential passes 2^14. sca and scb are the accumulators' factors. Per pair this
// is the loss's instructions and the expansion's: the pairs with no weight are carried as
// an infinite squared distance (at distance 0), whose rsqrt is 0, or the largest finite
// float (past k), rather than by selects.
template <int J, bool TAIL>
__device__ __forceinline__ void legend_fused_transe_tile(const LegendFused& f, float (&s)[J][4],
                                                         LegendRowLoss& r, float s_unscale,
                                                         u32 n0, float& sca, float& scb) {
    u32 k = f.k;
    const float inf = __int_as_float(0x7f800000);
    // The rows' nearest and farthest pairs: infinitely far where a pair lies at distance 0.
    float da = inf, db = inf, fara = 0.0f, farb = 0.0f, two = -2.0f * s_unscale;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        float2 nn = *reinterpret_cast<const float2*>(r.nn + n0 + 8 * j);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float norms = (q < 2 ? r.qa : r.qb) + (q & 1 ? nn.y : nn.x);
            float d2 = fmaf(s[j][q], two, norms);
            // Within the expansion's rounding of 0 (or not a normal float) a pair is at
            // distance 0: no gradient, as the CPU gives a pair at 0. One past k has none
            // either, and the largest finite float, so as not to count as one at 0.
            bool far = d2 > fmaf(LEGEND_TRANSE_ZERO, norms, 0x1p-126f);
            s[j][q] = far ? d2 : inf;
            if (TAIL && n0 + 8 * j + (q & 1) >= k) s[j][q] = __int_as_float(0x7f7fffff);
            if (q < 2) {
                da = fminf(da, s[j][q]);
                fara = fmaxf(fara, s[j][q]);
            } else {
                db = fminf(db, s[j][q]);
                farb = fmaxf(farb, s[j][q]);
            }
        }
    }
    // The new nearest distances, and what moves the accumulators: their ratio (1 while a
    // row has none: its accumulators are 0), and for softmax the exponential's shift, which
    // its sum takes alone.
    float neara = fminf(r.neara, sqrtf(legend_quad_min(da)));
    float nearb = fminf(r.nearb, sqrtf(legend_quad_min(db)));
    sca = r.neara < inf ? neara / r.neara : 1.0f;
    scb = r.nearb < inf ? nearb / r.nearb : 1.0f;
    r.neara = neara;
    r.nearb = nearb;
    // G / dist leaves times the nearest distance: finite (rsqrt's 0 times it stays 0).
    float ca = fminf(neara, 0x1p127f), cb = fminf(nearb, 0x1p127f);
    if (f.loss == LEGEND_LOSS_SOFTMAX) {
        float na = fmaxf(r.ma, legend_quad_max(fara) == inf ? 0.0f : -neara);
        float nb = fmaxf(r.mb, legend_quad_max(farb) == inf ? 0.0f : -nearb);
        float ea = __expf(r.ma - na), eb = __expf(r.mb - nb);
        r.la *= ea;
        r.lb *= eb;
        sca *= ea;
        scb *= eb;
        r.ma = na;
        r.mb = nb;
        // Per pair: 1 / dist (rsqrt(inf) = 0 for the pairs with no weight), the distance
        // (its product inf · 0 = NaN there, which max turns into 0), exp(-dist - shift)
        // with the G scale (0 past k), and G times the nearest distance over dist.
        constexpr float LOG2E = 1.4426950408889634f;
        float ba = LEGEND_FUSED_G_LOG2 - na * LOG2E, bb = LEGEND_FUSED_G_LOG2 - nb * LOG2E;
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float inv = legend_rsqrt(s[j][q]), dist = fmaxf(s[j][q] * inv, 0.0f);
                float g = legend_exp2(fmaf(dist, -LOG2E, q < 2 ? ba : bb));
                if (TAIL && n0 + 8 * j + (q & 1) >= k) g = 0.0f;
                if (q < 2) r.la += g; else r.lb += g;
                s[j][q] = (g * inv) * (q < 2 ? ca : cb);
            }
        return;
    }
    float w = 1.0f / (float)k;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float inv = legend_rsqrt(s[j][q]), dist = fmaxf(s[j][q] * inv, 0.0f);
            bool ok = !TAIL || n0 + 8 * j + (q & 1) < k;
            float term, grad;
            legend_fused_term(f, -dist, q < 2 ? r.pa : r.pb, w, term, grad);
            term = ok ? term : 0.0f;
            grad = ok ? grad : 0.0f;
            if (q < 2) {
                r.la += term;
                r.activa += grad;
            } else {
                r.lb += term;
                r.activb += grad;
            }
            s[j][q] = grad * LEGEND_FUSED_G_SCALE * (inv * (q < 2 ? ca : cb));
        }
}

// What a tile's G of rows a (x) and b is relative to, kept per tile until the rows'
// finish turns it into the tile's factors: softmax's shift, and for TransE L2 the nearest
// distance as well, as shift - ln(nearest) (-inf while there is none: the tile's G are 0).
__device__ __forceinline__ float2 legend_fused_tile_shift(const LegendRowLoss& r) {
    if (!LEGEND_FUSED_TRANSE) return make_float2(r.ma, r.mb);
    return make_float2(r.ma - __logf(r.neara), r.mb - __logf(r.nearb));
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
    if (LEGEND_FUSED_TRANSE) {
        legend_fused_transe_tile<J, TAIL>(f, s, r, s_unscale, n0, sca, scb);
        return;
    }
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
            legend_fused_term(f, x, q < 2 ? r.pa : r.pb, w, term, grad);
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
    // What turns a tile's G into the final ∂L/∂S: for softmax 1 / sum (fa, fb) times the
    // exponential's shift from the tile's running maximum.
    float fa = 1.0f, fb = 1.0f;
    bool softmax = f.loss == LEGEND_LOSS_SOFTMAX;
    if (softmax) {
        ua = 1.0f / lsa;
        ub = 1.0f / lsb;
        fa = LEGEND_FUSED_G_SCALE * ua;
        fb = LEGEND_FUSED_G_SCALE * ub;
        constexpr float LOG_G = 9.704060527839234f;  // ln(2^14)
        loss_a = r.ma + logf(lsa) - LOG_G - r.pa;
        loss_b = r.mb + logf(lsb) - LOG_G - r.pb;
        gpa = __expf(r.pa - r.ma) * fa - 1.0f;
        gpb = __expf(r.pb - r.mb) * fb - 1.0f;
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
    if (LEGEND_FUSED_TRANSE) {
        // G / dist went out times the nearest distance (none: no gradient).
        const float inf = __int_as_float(0x7f800000);
        ua = r.neara < inf ? ua / r.neara : 0.0f;
        ub = r.nearb < inf ? ub / r.nearb : 0.0f;
        // The job's smallest nearest distance, over its rows with one: the negatives
        // kernel's common scale (one atomic a warp; the bits' complement orders as the
        // distances do, reversed).
        float nearest = inf;
        if (va) nearest = r.neara;
        if (vb) nearest = fminf(nearest, r.nearb);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            nearest = fminf(nearest, __shfl_xor_sync(0xffffffffu, nearest, o));
        if ((threadIdx.x & 31) == 0 && nearest < inf)
            atomicMax(&f.nearest[z], ~__float_as_uint(nearest));
    }
    if (softmax || LEGEND_FUSED_TRANSE) {
        // The factors of the walked tiles: softmax's shift and sum, and for TransE the
        // tile's nearest distance divided out (legend_fused_tile_shift).
        for (u32 u = t; u < tiles; u += 4) {
            float2 m = running(u);
            float ca = __expf(m.x - r.ma) * fa, cb = __expf(m.y - r.mb) * fb;
            for (u32 h = 0; h < width; ++h) {
                float* ch = legend_fused_corr(f, z, u * width + h) + ra;
                ch[0] = ca;
                ch[8] = cb;
            }
        }
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

// Column c of row a (h = 0) or b of a warp's accumulators, in every lane of the row's quad.
template <int DK>
__device__ __forceinline__ float legend_fused_column(const float (&acc)[DK][4], int h, u32 c,
                                                     int t) {
    float v = 0.0f;
#pragma unroll
    for (int n = 0; n < DK; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e)
            if (8 * n + 2 * t + e == c) v = acc[n][2 * h + e];
    return legend_quad_sum(v);
}

// TransE L2's products through the distances: with W = G / dist, dQ_i = Σ_j W_ij (n_j - q_i)
// and dN_j = Σ_i W_ij (q_i - n_j), so the accumulators of the product (Σ W n, or Σ W q) lack
// their rows' own vectors times their weights' sums. Those sums come with the product: the
// other operand holds 1 in column `ones` (a padding column, zero in this operand, so the
// scores are untouched). The subtraction is left to the per-row kernels after (the rows
// and negatives backward), which read or recompute the rows' FP32 vectors anyway: a row's
// FP16 rounding would enter all of its pairs alike. This writes the sums of rows a and b
// times `scale` (what turns each row's accumulators into its gradient) to out_a and out_b
// (null: no row), added into them where `add`.
template <int DK>
__device__ __forceinline__ void legend_fused_transe_weights(const float (&acc)[DK][4], u32 ones,
                                                            float2 scale, float* out_a,
                                                            float* out_b, bool add, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float w = (h ? scale.y : scale.x) * legend_fused_column<DK>(acc, h, ones, t);
        float* out = h ? out_b : out_a;
        if (t == 0 && out) {
            if (add) atomicAdd(out, w);
            else *out = w;
        }
    }
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
