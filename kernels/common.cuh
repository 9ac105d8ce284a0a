// Shared definitions of Legend's CUDA kernels. The Rust side prepends this file to every
// kernel source, so the programs need no include path (NVRTC has no system headers).

typedef unsigned int u32;
typedef unsigned long long u64;

// The golden-ratio increment of splitmix64.
#define LEGEND_GOLDEN 0x9e3779b97f4a7c15ULL

// The counter-based random numbers of legend-model's rng.rs, bit for bit (CPU and GPU draw the
// same numbers from the same counters; kernels/testdata/rng_vectors.txt pins both).
// splitmix64's finaliser.
__device__ __forceinline__ u64 legend_mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// The i-th 64-bit draw of the counter-based stream `key`.
__device__ __forceinline__ u64 legend_draw(u64 key, u64 i) {
    return legend_mix(key + (i + 1) * LEGEND_GOLDEN);
}

// A uniform integer below n from 64 random bits: the high word of bits * n (multiply-shift).
__device__ __forceinline__ u64 legend_below(u64 bits, u64 n) {
    return __umul64hi(bits, n);
}

// The key of the stream named by seed and two counters: legend-model's rng::key(seed, [a, b]).
__device__ __forceinline__ u64 legend_key2(u64 seed, u64 a, u64 b) {
    u64 k = legend_mix(seed + LEGEND_GOLDEN);
    k = legend_mix(k ^ (a + LEGEND_GOLDEN));
    return legend_mix(k ^ (b + LEGEND_GOLDEN));
}

// Node rows' formats at rest (legend-model's Dtype, by its index in Dtype::ALL).
#define LEGEND_DTYPE_F32 0u
#define LEGEND_DTYPE_BF16 1u
#define LEGEND_DTYPE_F16 2u

// x with its low `drop` bits cleared after adding the top `drop` bits of `random`: a
// stochastic rounding of its magnitude to a grid with `drop` fewer significand bits.
__device__ __forceinline__ float legend_keep_top_bits(float x, u32 drop, u32 random) {
    if (!isfinite(x)) return x;
    u32 mask = (1u << drop) - 1u;
    return __uint_as_float((__float_as_uint(x) + (random >> (32u - drop))) & ~mask);
}

// legend-model's Dtype::round_stochastic, bit for bit: x to one of its two neighbours in
// `dtype`, up with probability equal to its distance from the lower one over their gap.
__device__ __forceinline__ float legend_round_stochastic(float x, u32 dtype, u32 random) {
    if (dtype == LEGEND_DTYPE_BF16) return legend_keep_top_bits(x, 16u, random);
    if (dtype != LEGEND_DTYPE_F16) return x;
    float magnitude = fabsf(x);
    if (magnitude >= 6.103515625e-5f || !isfinite(magnitude))
        return legend_keep_top_bits(x, 13u, random);
    // Subnormal halves: the multiples of 2^-24.
    float scaled = magnitude * 16777216.0f;
    float fl = floorf(scaled);
    bool up = (float)(random >> 8) * (1.0f / 16777216.0f) < scaled - fl;
    return copysignf((fl + (up ? 1.0f : 0.0f)) / 16777216.0f, x);
}

// legend-model's Dtype::round_nearest (ties to even): initial rows.
__device__ __forceinline__ float legend_round_nearest(float x, u32 dtype) {
    if (dtype == LEGEND_DTYPE_BF16) {
        if (!isfinite(x)) return x;
        u32 b = __float_as_uint(x);
        return __uint_as_float((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);
    }
    if (dtype == LEGEND_DTYPE_F16) {
        unsigned short h;
        float y;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(h));
        return y;
    }
    return x;
}

// Whether the rounded x is representable in `dtype` (f16: at most 65504).
__device__ __forceinline__ bool legend_fits(float x, u32 dtype) {
    return dtype == LEGEND_DTYPE_F16 ? fabsf(x) <= 65504.0f : isfinite(x);
}

// The rounding of a step's updated node rows (legend-model's StepRounding): row r's element
// i is rounded with the top 32 bits of draw(key(batch key, [3, global row]), i), the batch key
// being legend-model's BatchKey (seed, epoch, bucket, batch within the bucket).
// The table may be slot-indexed: table row t holds global row partition_of_slot[t /
// rows_per_slot] · rows_per_slot + t % rows_per_slot (identity when partition_of_slot is
// null). The out-of-range element of smallest (global row, element) lands in out_of_range
// as row << 32 | element (u64 max: none). dtype LEGEND_DTYPE_F32 rounds nothing.
struct LegendRounding {
    u64 batch_key;
    const u32* partition_of_slot;
    u64* out_of_range;
    u32 dtype;
    u32 rows_per_slot;
};

// The global id of table row `row`.
__device__ __forceinline__ u64 legend_global_row(const LegendRounding& r, u64 row) {
    if (!r.partition_of_slot) return row;
    u64 slot = row / r.rows_per_slot;
    return (u64)r.partition_of_slot[slot] * r.rows_per_slot + row % r.rows_per_slot;
}

// The stream that rounds table row `row`'s elements this step: legend_key2(batch key, 3,
// global row) (legend-model's BatchKey::rounding).
__device__ __forceinline__ u64 legend_round_key(const LegendRounding& r, u64 row) {
    return legend_key2(r.batch_key, 3ull, legend_global_row(r, row));
}

// Element t of table row `row` after its step, rounded with the row's stream `key`
// (legend_round_key). The global row of an out-of-range report is found only then.
__device__ __forceinline__ float legend_round_element(const LegendRounding& r, u64 key, u64 row,
                                                      u32 t, float x) {
    float y = legend_round_stochastic(x, r.dtype, (u32)(legend_draw(key, t) >> 32));
    if (!legend_fits(y, r.dtype)) {
        atomicMin(r.out_of_range, (legend_global_row(r, row) << 32) | t);
        return x;
    }
    return y;
}

// Marks entity (or relation) `id` as touched by this batch; the first marker appends it to
// the list of rows the optimizer will update, so each row takes exactly one step.
__device__ __forceinline__ void legend_mark(u32* flags, u32* list, u32* count, u32 id) {
    if (atomicExch(&flags[id], 1u) == 0u) {
        list[atomicAdd(count, 1u)] = id;
    }
}

// Asynchronous 4-byte copy into shared memory, zero-filled when `valid` is false (then
// nothing is read from `src`).
__device__ __forceinline__ void legend_cp4(float* dst, const float* src, bool valid) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    int bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}

// Asynchronous 16-byte copy of which the first `bytes` come from `src`, the rest zeros.
__device__ __forceinline__ void legend_cp16(float* dst, const float* src, int bytes) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}

// A finite value saturated to FP16's range (in the fused kernels only values past the
// clamped scales get there), so that it does not turn a whole row of products into
// infinities; an infinity or a NaN stays what it is, so a diverged table still shows in
// the loss.
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

// The two FP16 values of a register as floats, the low half first.
__device__ __forceinline__ float2 legend_half2_unpack(u32 x) {
    float lo, hi;
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(x));
    return make_float2(lo, hi);
}

// The square of x as the fused kernels' FP16 operands hold it (saturated, rounded to
// nearest; exact in FP32): TransE L2's fused kernels expand distances with the squared norms
// of the rows their products use.
__device__ __forceinline__ float legend_fp16_square(float x) {
    float h = legend_half2_unpack(legend_half2(x, 0.0f)).x;
    return h * h;
}

// x rounded to FP16's 11 significant bits (to nearest, ties to even) at any exponent: what
// FP16 holds of x times a power-of-two scale that keeps it a normal FP16 value, divided
// back, for callers that round before the scale is known (TransE L2's queries).
__device__ __forceinline__ float legend_fp16_digits(float x) {
    u32 b = __float_as_uint(x);
    return __uint_as_float((b + 0xfffu + ((b >> 13) & 1u)) & ~0x1fffu);
}

// V consecutive floats of a row, moved as one access: the per-row kernels read and write
// whole float2/float4 pieces where the rows allow (one pass of a warp over a row of
// d = 100).
template <int V>
struct LegendVec {
    float v[V];
};

template <int V>
__device__ __forceinline__ LegendVec<V> legend_ld(const float* p) {
    LegendVec<V> r;
    if constexpr (V == 4) {
        float4 x = *reinterpret_cast<const float4*>(p);
        r.v[0] = x.x;
        r.v[1] = x.y;
        r.v[2] = x.z;
        r.v[3] = x.w;
    } else if constexpr (V == 2) {
        float2 x = *reinterpret_cast<const float2*>(p);
        r.v[0] = x.x;
        r.v[1] = x.y;
    } else {
        r.v[0] = *p;
    }
    return r;
}

template <int V>
__device__ __forceinline__ void legend_st(float* p, const LegendVec<V>& x) {
    if constexpr (V == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(x.v[0], x.v[1], x.v[2], x.v[3]);
    } else if constexpr (V == 2) {
        *reinterpret_cast<float2*>(p) = make_float2(x.v[0], x.v[1]);
    } else {
        *p = x.v[0];
    }
}

// One element's AdaGrad step: state += g²; returns param − lr·g/(√state + eps). The one
// formula of legend_adagrad and of the in-place updates below.
__device__ __forceinline__ float legend_adagrad_step(float param, float& state, float g,
                                                     float lr, float eps) {
    state += g * g;
    return param - lr * g / (sqrtf(state) + eps);
}

// p[0 .. 4] += x (p 16-byte aligned): one vector reduction on sm_90 and later (a little
// faster than four atomics there), four atomics before.
__device__ __forceinline__ void legend_red4(float* p, const LegendVec<4>& x) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(x.v[0]),
                 "f"(x.v[1]), "f"(x.v[2]), "f"(x.v[3])
                 : "memory");
#else
#pragma unroll
    for (int v = 0; v < 4; ++v) atomicAdd(p + v, x.v[v]);
#endif
}

// p[0], p[1] += x, y (p 8-byte aligned): one vector reduction on sm_90 and later, two
// atomics before.
__device__ __forceinline__ void legend_red2(float* p, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}

// Where a step's gradient of one table row goes: added atomically into the gradient table
// (the row is listed for legend_adagrad), or, for a node row the batch uses only once
// (`direct`, from legend_count_uses), straight into AdaGrad on its parameters and state:
// that one contribution is the row's whole gradient, so no table or second pass is needed.
// With row-wise state (one accumulator a row) a direct row's gradient is stored whole in its
// gradient row first, and legend_finish_direct_rows then takes the step.
struct LegendRowSink {
    float* grad;
    float* param;
    float* state;
    bool direct;
    float lr;
    float eps;
    bool row_wise;
};

// Elements k .. k + V of a direct row's AdaGrad state (zeros otherwise), loaded by the
// caller with the row's other values, so that the update waits for no further load.
template <int V>
__device__ __forceinline__ LegendVec<V> legend_sink_states(const LegendRowSink& row, u32 k) {
    LegendVec<V> s{};
    if (row.direct && !row.row_wise) s = legend_ld<V>(row.state + k);
    return s;
}

// Elements k .. k + V of the row get gradients g; for a direct row, `param` and `state`
// are the elements' values as loaded before (one vector store each), otherwise one vector
// reduction, faster than scalar atomics once the loads are vectors too (Documentation/gpu.md,
// measurement log, version 24).
template <int V>
__device__ __forceinline__ void legend_sink_add(const LegendRowSink& row, u32 k,
                                                const LegendVec<V>& g, const LegendVec<V>& param,
                                                LegendVec<V> state) {
    if (row.direct && row.row_wise) {
        legend_st<V>(row.grad + k, g);
    } else if (row.direct) {
        LegendVec<V> p;
#pragma unroll
        for (int v = 0; v < V; ++v)
            p.v[v] = legend_adagrad_step(param.v[v], state.v[v], g.v[v], row.lr, row.eps);
        legend_st<V>(row.param + k, p);
        legend_st<V>(row.state + k, state);
    } else if constexpr (V == 4) {
        legend_red4(row.grad + k, g);
    } else if constexpr (V == 2) {
        legend_red2(row.grad + k, g.v[0], g.v[1]);
    } else {
        atomicAdd(&row.grad[k], g.v[0]);
    }
}

// New values of elements t .. t + V of a row (table row `id`), in registers: `p` its
// parameters, `g` its gradient, `s` its AdaGrad state (element-wise). `scale`: the row-wise
// step's lr / (sqrt(state) + eps), which `p` takes with its gradient; 0 with element-wise
// `step`, which takes legend_adagrad_step; neither when `p` is already stepped. Then rounded
// where `round`, with the row's stream `key`. The one formula of legend_adagrad and of the end
// of the in-place steps (legend_finish_direct_rows), so both paths give the same bits.
template <int V>
__device__ __forceinline__ void legend_update_piece(LegendVec<V>& p, const LegendVec<V>& g,
                                                    LegendVec<V>& s, bool row_wise, bool step,
                                                    float scale, float lr, float eps,
                                                    const LegendRounding& rounding, bool round,
                                                    u64 key, u64 id, u32 t) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
        if (row_wise) p.v[v] = p.v[v] - scale * g.v[v];
        else if (step) p.v[v] = legend_adagrad_step(p.v[v], s.v[v], g.v[v], lr, eps);
        if (round) p.v[v] = legend_round_element(rounding, key, id, t + v, p.v[v]);
    }
}

// A row's sum of g² for its row-wise step, each lane over elements lane, lane + 32, ... and then
// across the warp: the one order of legend_adagrad and the in-place steps.
__device__ __forceinline__ float legend_row_sq(const float* g, u32 dim, u32 lane) {
    float sq = 0.0f;
#pragma unroll 4
    for (u32 t = lane; t < dim; t += 32) sq += g[t] * g[t];
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    return sq;
}

// The end of the in-place step of the direct rows among `rows` (table rows `ids`), by the warp
// that gave them their gradients (legend_sink_add), after every lane's part. With row-wise
// state, the step itself: mean(g²) over the row first, then every element steps by
// lr · g / (sqrt(state) + eps) and the gradient row is cleared. Where node rows are rounded (R
// and a 16-bit `rounding`), the rows' new values then get legend_adagrad's rounding.
// legend_update_piece and legend_row_sq make both paths give the same bits. Here rather than
// in legend_sink_add, whose loops' registers are spoken for; the rows side by side and V
// elements a lane, so that their loads are in flight together (Documentation/gpu.md, "16-bit
// rows").
template <bool R, int N, int V>
__device__ __forceinline__ void legend_finish_rows_v(const LegendRowSink* const (&rows)[N],
                                                     const u32 (&ids)[N],
                                                     const LegendRounding& rounding, u32 dim,
                                                     u32 lane) {
    const bool round = R && rounding.dtype != LEGEND_DTYPE_F32;
    bool active[N], row_wise = false, any = false;
#pragma unroll
    for (int n = 0; n < N; ++n) {
        active[n] = rows[n]->direct && (rows[n]->row_wise || round);
        row_wise |= rows[n]->direct && rows[n]->row_wise;
        any |= active[n];
    }
    if (!any) return;
    // Every lane's part of the rows is in memory.
    __syncwarp();
    // Each row's stream: lane n finds row n's, one key computation for all of them.
    u64 key[N];
    u64 mine = round ? legend_round_key(rounding, ids[lane < N ? lane : 0]) : 0ull;
#pragma unroll
    for (int n = 0; n < N; ++n) key[n] = __shfl_sync(0xffffffffu, mine, n);
    float state[N], scale[N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
        state[n] = 0.0f;
        scale[n] = 0.0f;
        if (rows[n]->direct && rows[n]->row_wise) {
            state[n] = *rows[n]->state + legend_row_sq(rows[n]->grad, dim, lane) / (float)dim;
            scale[n] = rows[n]->lr / (sqrtf(state[n]) + rows[n]->eps);
        }
    }
    for (u32 t = V * lane; t < dim; t += 32 * V) {
        LegendVec<V> p[N], g[N];
#pragma unroll
        for (int n = 0; n < N; ++n) {
            if (!active[n]) continue;
            p[n] = legend_ld<V>(rows[n]->param + t);
            g[n] = rows[n]->row_wise ? legend_ld<V>(rows[n]->grad + t) : LegendVec<V>{};
        }
#pragma unroll
        for (int n = 0; n < N; ++n) {
            if (!active[n]) continue;
            LegendVec<V> unused{};
            legend_update_piece<V>(p[n], g[n], unused, rows[n]->row_wise, false, scale[n], 0.0f,
                                   0.0f, rounding, round, key[n], ids[n], t);
            legend_st<V>(rows[n]->param + t, p[n]);
            if (rows[n]->row_wise) legend_st<V>(rows[n]->grad + t, LegendVec<V>{});
        }
    }
    if (row_wise) {
        // Every lane has read the states before they are written.
        __syncwarp();
        if (lane == 0) {
#pragma unroll
            for (int n = 0; n < N; ++n)
                if (rows[n]->direct && rows[n]->row_wise) *rows[n]->state = state[n];
        }
    }
}

template <bool R, int N>
__device__ __forceinline__ void legend_finish_direct_rows(const LegendRowSink* const (&rows)[N],
                                                          const u32 (&ids)[N],
                                                          const LegendRounding& rounding,
                                                          u32 dim, u32 lane) {
    if constexpr (!R) {
        // Unrounded: the rows one after another, an element a lane, in the fewest registers
        // (the plain rows backward's are spoken for).
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const LegendRowSink* const one[1] = {rows[n]};
            const u32 one_id[1] = {ids[n]};
            legend_finish_rows_v<false, 1, 1>(one, one_id, rounding, dim, lane);
        }
    } else if (dim % 4 == 0) {
        // Rows start 16-byte aligned when d is a multiple of 4.
        legend_finish_rows_v<R, N, 4>(rows, ids, rounding, dim, lane);
    } else {
        legend_finish_rows_v<R, N, 1>(rows, ids, rounding, dim, lane);
    }
}

// The regulariser of the rows of a batch's positives (optimizer.regularizer: LEGEND_PENALTY_*
// as numbered by legend-cuda's PENALTY_CODES) with its weight λ.
struct LegendPenalty {
    int kind;
    float weight;
};

// Its gradient for one occurrence of a real element x: 3λ|x|x for N3, 2λx for L2
// (legend-model's Regularizer::add_gradient).
__device__ __forceinline__ float legend_penalty_grad(LegendPenalty pen, float x) {
    if (pen.kind == LEGEND_PENALTY_N3) return 3.0f * pen.weight * fabsf(x) * x;
    if (pen.kind == LEGEND_PENALTY_L2) return 2.0f * pen.weight * x;
    return 0.0f;
}

// The same for a complex element (re, im): N3 penalises its modulus m, d m³/d re = 3 m re.
__device__ __forceinline__ float2 legend_penalty_grad2(LegendPenalty pen, float re, float im) {
    if (pen.kind == LEGEND_PENALTY_N3) {
        float c = 3.0f * pen.weight * sqrtf(re * re + im * im);
        return make_float2(c * re, c * im);
    }
    return make_float2(legend_penalty_grad(pen, re), legend_penalty_grad(pen, im));
}

// Decoders and losses are numbered by legend-cuda (`DECODER_CODES`, `LOSS_CODES` in
// engine/mod.rs), which defines LEGEND_DOT .. LEGEND_TRANSE_L2 and LEGEND_LOSS_SOFTMAX ..
// LEGEND_LOSS_RANKING on the NVRTC command line.
