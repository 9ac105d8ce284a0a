// Exact top-K scans of an entity table on the GPU (issue 32): every query vector scored against
// every entity row, the K best of each query kept, the same answer as the CPU path
// (legend-query), bit for bit and in the same order.
//
// Scores. A pair's score is what legend-eval's CPU kernel computes for it: eight accumulators,
// element k going to accumulator k % 8 in increasing k, a fused multiply-add per element (or a
// rounded multiply then a rounded add, the CPU's portable path: `fused`), the accumulators
// summed ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)), the elements past the last group
// of eight summed on their own, then sum + tail and the comparator's transform. Every operation
// is written with its rounding (__fadd_rn, __fmul_rn, fmaf, __fsqrt_rn, __fdiv_rn) so NVRTC
// contracts nothing the CPU does not. Rows compared at unit length (cosine) are divided by
// their norm as they are loaded, as the CPU scales a block before scoring it.
//
// Order. A candidate is a 64-bit key: the score mapped so that a better score is a smaller
// number (NaN after every number, -0 equal to +0), then the id, then a bit saying the score was
// -0 (so that it comes back as it was). The K best are the K smallest keys: ties go to the
// lower id, as the CPU's total order has it.
//
// Selection. The table is scanned a chunk of rows at a time. legend_scan_score scores a chunk
// against every query and appends the keys below the query's threshold (its K-th best key so
// far) to the query's candidate list, at most one per row, so a list never outgrows the chunk;
// legend_scan_select then merges each query's list into its K best (a bitonic sort in shared
// memory, a piece at a time) and moves the threshold. After the first chunk few rows pass a
// threshold, so the sorts are small.

typedef unsigned int u32;
typedef unsigned long long u64;

// Queries and rows of a scoring block's tile, elements of a slice of them in shared memory.
#define LEGEND_SCAN_TQ 32
#define LEGEND_SCAN_TC 64
#define LEGEND_SCAN_KS 32
#define LEGEND_SCAN_THREADS 256
// The comparators (legend-model's Comparator; RotatE's modulus stays on the CPU).
#define LEGEND_SCAN_DOT 0u
#define LEGEND_SCAN_L1 1u
#define LEGEND_SCAN_L2 2u
// A key above every candidate's: the threshold of a query that has fewer than K.
#define LEGEND_SCAN_NONE 0xffffffffffffffffull

// One chunk's scoring.
struct LegendScanScore {
    u64 queries;     // const float*: nq x dim query vectors
    u64 rows;        // const float*: n x dim rows of the chunk
    u64 norms;       // const float*: n row norms, rows compared at unit length; 0: as they are
    u64 thresholds;  // const u64*: nq, a key is kept only below its query's
    u64 excl_start;  // const u32*: nq + 1 offsets into `excl`
    u64 excl;        // const u32*: each query's ids left out, ascending
    u64 cand;        // u64*: nq x cap keys kept
    u64 cand_count;  // u32*: nq
    u64 first_id;    // the id of the chunk's row 0
    u32 n;
    u32 nq;
    u32 dim;
    u32 cap;
    u32 comparator;
    u32 fused;
};

// One round of selection.
struct LegendScanSelect {
    u64 cand;        // as above
    u64 cand_count;  // as above; set back to 0
    u64 top;         // u64*: nq x kmax, each query's best keys so far, ascending
    u64 top_count;   // u32*: nq
    u64 thresholds;  // u64*: nq, updated
    u64 tops;        // const u32*: nq, the K of each query
    u32 cap;
    u32 kmax;
    u32 sort;        // entries of the shared array: a power of two above kmax
    u32 pad;
};

// The key of `score` for entity `id` (below 2^31).
__device__ __forceinline__ u64 legend_scan_key(float score, u64 id) {
    u32 b, negative_zero = 0;
    if (isnan(score)) {
        b = 0xffffffffu;
    } else {
        u32 u = __float_as_uint(score);
        if (u == 0x80000000u) {
            u = 0;
            negative_zero = 1;
        }
        // Ascending floats as ascending integers, then reversed: better is smaller.
        u32 ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
        b = ~ascending;
    }
    return ((u64)b << 32) | (id << 1) | negative_zero;
}

// legend-eval's `Op::step`.
template <u32 CMP, bool FUSED>
__device__ __forceinline__ float legend_scan_step(float acc, float q, float c) {
    if (CMP == LEGEND_SCAN_DOT) return FUSED ? fmaf(q, c, acc) : __fadd_rn(__fmul_rn(q, c), acc);
    float d = __fsub_rn(q, c);
    if (CMP == LEGEND_SCAN_L1) return __fadd_rn(acc, fabsf(d));
    return FUSED ? fmaf(d, d, acc) : __fadd_rn(__fmul_rn(d, d), acc);
}

// legend-eval's `reduce`: the lanes in a fixed order, the tail, the final transform.
template <u32 CMP>
__device__ __forceinline__ float legend_scan_finish(const float* v, float tail) {
    float sum = __fadd_rn(__fadd_rn(__fadd_rn(v[0], v[4]), __fadd_rn(v[1], v[5])),
                          __fadd_rn(__fadd_rn(v[2], v[6]), __fadd_rn(v[3], v[7])));
    float s = __fadd_rn(sum, tail);
    if (CMP == LEGEND_SCAN_DOT) return s;
    if (CMP == LEGEND_SCAN_L1) return -s;
    return -__fsqrt_rn(s);
}

// An element of a row compared at unit length (legend-query's `unit`: a zero row stays zero).
__device__ __forceinline__ float legend_scan_unit(float x, float norm) {
    return norm > 0.0f ? __fdiv_rn(x, norm) : x;
}

// Whether `id` is among the ascending `ids[0..n)`.
__device__ bool legend_scan_excluded(const u32* ids, u32 n, u64 id) {
    u32 lo = 0, hi = n;
    while (lo < hi) {
        u32 mid = (lo + hi) / 2;
        if ((u64)ids[mid] < id) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && (u64)ids[lo] == id;
}

// Shared slices of the tile's queries and rows, a row padded by one so that the 16 rows a warp
// reads at once fall in different banks.
typedef float LegendScanSlice[LEGEND_SCAN_KS + 1];

// A block's tile: queries q0 + ty + 16 i (i < 2) against rows c0 + tx + 16 j (j < 4).
template <u32 CMP, bool FUSED>
__device__ void legend_scan_tile(const LegendScanScore& a, LegendScanSlice* qs,
                                 LegendScanSlice* cs) {
    const u32 t = threadIdx.x, tx = t % 16, ty = t / 16;
    const u32 c0 = blockIdx.x * LEGEND_SCAN_TC, q0 = blockIdx.y * LEGEND_SCAN_TQ;
    const float* Q = (const float*)a.queries;
    const float* R = (const float*)a.rows;
    const float* norms = (const float*)a.norms;
    const u32 dim = a.dim, lanes = dim / 8 * 8;
    float acc[2][4][8];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int l = 0; l < 8; ++l) acc[i][j][l] = 0.0f;
    for (u32 k0 = 0; k0 < lanes; k0 += LEGEND_SCAN_KS) {
        const u32 width = min((u32)LEGEND_SCAN_KS, lanes - k0);  // a multiple of 8
        for (u32 i = t; i < LEGEND_SCAN_TQ * LEGEND_SCAN_KS; i += LEGEND_SCAN_THREADS) {
            u32 r = i / LEGEND_SCAN_KS, k = i % LEGEND_SCAN_KS;
            qs[r][k] = (q0 + r < a.nq && k < width) ? Q[(u64)(q0 + r) * dim + k0 + k] : 0.0f;
        }
        for (u32 i = t; i < LEGEND_SCAN_TC * LEGEND_SCAN_KS; i += LEGEND_SCAN_THREADS) {
            u32 r = i / LEGEND_SCAN_KS, k = i % LEGEND_SCAN_KS;
            float v = 0.0f;
            if (c0 + r < a.n && k < width) {
                v = R[(u64)(c0 + r) * dim + k0 + k];
                if (norms) v = legend_scan_unit(v, norms[c0 + r]);
            }
            cs[r][k] = v;
        }
        __syncthreads();
        for (u32 k = 0; k < width; k += 8) {
#pragma unroll
            for (int l = 0; l < 8; ++l) {
                float qv[2], cv[4];
#pragma unroll
                for (int i = 0; i < 2; ++i) qv[i] = qs[ty + 16 * i][k + l];
#pragma unroll
                for (int j = 0; j < 4; ++j) cv[j] = cs[tx + 16 * j][k + l];
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        acc[i][j][l] = legend_scan_step<CMP, FUSED>(acc[i][j][l], qv[i], cv[j]);
            }
        }
        __syncthreads();
    }
    const u64* thresholds = (const u64*)a.thresholds;
    const u32* excl_start = (const u32*)a.excl_start;
    const u32* excl = (const u32*)a.excl;
    u64* cand = (u64*)a.cand;
    u32* cand_count = (u32*)a.cand_count;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 q = q0 + ty + 16 * i;
        if (q >= a.nq) continue;
        const u64 threshold = thresholds[q];
        const float* qrow = Q + (u64)q * dim;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 c = c0 + tx + 16 * j;
            if (c >= a.n) continue;
            const float* crow = R + (u64)c * dim;
            const float norm = norms ? norms[c] : 0.0f;
            float tail = 0.0f;
            for (u32 k = lanes; k < dim; ++k) {
                float cv = norms ? legend_scan_unit(crow[k], norm) : crow[k];
                tail = legend_scan_step<CMP, FUSED>(tail, qrow[k], cv);
            }
            const u64 id = a.first_id + c;
            const u64 key = legend_scan_key(legend_scan_finish<CMP>(acc[i][j], tail), id);
            if (key >= threshold) continue;
            if (legend_scan_excluded(excl + excl_start[q], excl_start[q + 1] - excl_start[q], id))
                continue;
            u32 at = atomicAdd(cand_count + q, 1u);
            // The host makes a chunk at most `cap` rows: a list never overflows.
            if (at < a.cap) cand[(u64)q * a.cap + at] = key;
        }
    }
}

// Scores rows first_id .. first_id + n against every query; keeps the keys below each query's
// threshold. Grid: (n / 64, nq / 32) rounded up; 256 threads.
extern "C" __global__ void __launch_bounds__(LEGEND_SCAN_THREADS) legend_scan_score(LegendScanScore a) {
    // Declared here, not in the template: one copy for all six instantiations.
    __shared__ LegendScanSlice qs[LEGEND_SCAN_TQ];
    __shared__ LegendScanSlice cs[LEGEND_SCAN_TC];
    switch (a.comparator * 2 + (a.fused ? 1 : 0)) {
        case 0: legend_scan_tile<LEGEND_SCAN_DOT, false>(a, qs, cs); break;
        case 1: legend_scan_tile<LEGEND_SCAN_DOT, true>(a, qs, cs); break;
        case 2: legend_scan_tile<LEGEND_SCAN_L1, false>(a, qs, cs); break;
        case 3: legend_scan_tile<LEGEND_SCAN_L1, true>(a, qs, cs); break;
        case 4: legend_scan_tile<LEGEND_SCAN_L2, false>(a, qs, cs); break;
        case 5: legend_scan_tile<LEGEND_SCAN_L2, true>(a, qs, cs); break;
        default: break;
    }
}

// Sorts `s[0..len)` ascending (len a power of two), the whole block.
__device__ void legend_scan_bitonic(u64* s, u32 len) {
    for (u32 k = 2; k <= len; k <<= 1) {
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = threadIdx.x; i < len; i += blockDim.x) {
                u32 other = i ^ j;
                if (other > i) {
                    u64 x = s[i], y = s[other];
                    bool ascending = (i & k) == 0;
                    if ((x > y) == ascending) {
                        s[i] = y;
                        s[other] = x;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// Merges each query's candidates into its K best. One block a query; `sort` u64 of dynamic
// shared memory. The list is taken a piece of `sort - kmax` at a time, each piece's keys below
// the current K-th best joining the kept ones in one sort.
extern "C" __global__ void __launch_bounds__(512) legend_scan_select(LegendScanSelect a) {
    extern __shared__ u64 s[];
    __shared__ u32 s_added;
    const u32 q = blockIdx.x, t = threadIdx.x;
    u32* cand_count = (u32*)a.cand_count;
    const u32 count = min(cand_count[q], a.cap);
    if (count == 0) return;
    const u32 k = ((const u32*)a.tops)[q];
    u64* top = (u64*)a.top + (u64)q * a.kmax;
    u32* top_count = (u32*)a.top_count;
    const u64* cand = (const u64*)a.cand + (u64)q * a.cap;
    u32 kept = top_count[q];
    for (u32 i = t; i < kept; i += blockDim.x) s[i] = top[i];
    const u32 piece = a.sort - a.kmax;
    for (u32 p0 = 0; p0 < count; p0 += piece) {
        if (t == 0) s_added = 0;
        __syncthreads();
        const u64 threshold = kept == k ? s[k - 1] : LEGEND_SCAN_NONE;
        const u32 end = min(count, p0 + piece);
        for (u32 i = p0 + t; i < end; i += blockDim.x) {
            u64 key = cand[i];
            if (key < threshold) s[kept + atomicAdd(&s_added, 1u)] = key;
        }
        __syncthreads();
        const u32 total = kept + s_added;
        if (total > kept) {
            u32 len = 1;
            while (len < total) len <<= 1;
            for (u32 i = total + t; i < len; i += blockDim.x) s[i] = LEGEND_SCAN_NONE;
            __syncthreads();
            legend_scan_bitonic(s, len);
            kept = min(k, total);
        }
        __syncthreads();
    }
    for (u32 i = t; i < kept; i += blockDim.x) top[i] = s[i];
    if (t == 0) {
        top_count[q] = kept;
        ((u64*)a.thresholds)[q] = kept == k ? s[k - 1] : LEGEND_SCAN_NONE;
        cand_count[q] = 0;
    }
}

// A batch's start: no query has a candidate yet.
extern "C" __global__ void legend_scan_reset(u64* thresholds, u32* top_count, u32* cand_count,
                                             u32 nq) {
    u32 q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= nq) return;
    thresholds[q] = LEGEND_SCAN_NONE;
    top_count[q] = 0;
    cand_count[q] = 0;
}

// The norm of each row, as legend-query's `unit` computes it: the squares summed in order.
extern "C" __global__ void legend_scan_norms(const float* rows, u64 n, u32 dim, float* out) {
    u64 r = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n) return;
    const float* row = rows + r * dim;
    float sum = 0.0f;
    for (u32 k = 0; k < dim; ++k) sum = __fadd_rn(sum, __fmul_rn(row[k], row[k]));
    out[r] = __fsqrt_rn(sum);
}

// Rows `ids[0..n)` of a table into `out` (n x dim), one thread an element.
extern "C" __global__ void legend_scan_gather(const float* rows, u32 dim, const u32* ids, u32 n,
                                              float* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n * dim) return;
    u64 r = i / dim, k = i % dim;
    out[i] = rows[(u64)ids[r] * dim + k];
}
