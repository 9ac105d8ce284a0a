// One training step on chunks of positives that share negatives (the CPU math of
// legend-model's ChunkWorkspace::forward_backward). TransE's distance products and its
// per-row parts live in kernels/distance.cu.
//
// A launch covers a group of "jobs": job j = 2c + s is side s of chunk c, s = 0 replacing
// sources (query from relation and destination), s = 1 replacing destinations (query from
// source and relation). Buffers of a group are indexed by z = j - first_job. Rows of a
// job are edges[row0[z] .. row0[z] + rows[z]] (rows x 3 ids: source, relation, destination).
// One warp handles one row everywhere below: lanes stride over the d elements, or over the
// d/2 complex pairs for ComplEx (real half first), so each element is read once.

struct LegendJobs {
    const u32* edges;
    const u32* row0;
    const u32* rows;
    // Fused path: legend_queries adds each job's largest query magnitude (float bits) into
    // absmax[2z] (see kernels/fused_prepare.cu); null otherwise.
    u32* absmax;
    // TransE L2 on the fused path (null otherwise), per query (z·max_rows + r, as the
    // queries): legend_queries writes its squared norm as the fused kernels round it, and
    // legend_rows_backward subtracts its weight sum times the query from dQ (what the rows
    // kernel left out: legend_fused_transe_weights).
    float* query_norm;
    const float* query_weight;
    u32 first_job;
    u32 max_rows;
    u32 dim;
    int decoder;
    // Reciprocal relations: the first inverse row (relation r's inverse is row inverse + r),
    // through which side 0 is scored as (destination, r⁻¹, ?) with the destination-side
    // operator; 0 without them.
    u32 inverse;
    // The regulariser, added by legend_rows_backward into the gradient of every row of a
    // positive, once per occurrence.
    LegendPenalty penalty;
    u32 pad;
};

// ComplEx's queries of both sides of an edge from one complex element of S, D and the
// relation: q0 = w·conj(d) against S (side 0), q1 = s·w against D (side 1), as (re, im).
// One formula for legend_queries and the rows backward, which recomputes them.
__device__ __forceinline__ void legend_complex_queries(float sre, float sim, float dre,
                                                       float dim_, float rre, float rim,
                                                       float (&q)[4]) {
    q[0] = rre * dre + rim * dim_;
    q[1] = rre * dim_ - rim * dre;
    q[2] = sre * rre - sim * rim;
    q[3] = sre * rim + sim * rre;
}

// Reciprocal relations: side 0's query is the destination-side operator of (d, r⁻¹),
// q0 = d·w⁻¹, in place of legend_complex_queries' q[0], q[1].
__device__ __forceinline__ void legend_complex_inverse_query(float dre, float dim_, float r0re,
                                                             float r0im, float (&q)[4]) {
    q[0] = dre * r0re - dim_ * r0im;
    q[1] = dre * r0im + dim_ * r0re;
}

// The queries of both sides of an edge (side 0: q0 = op(D, relation) against the true S;
// side 1: q1 = op(S, relation) against D), V elements of each lane (of each half for
// ComplEx), with their positive scores and largest magnitudes added into dot and largest.
template <int V>
__device__ __forceinline__ void legend_query_pair(int decoder, u32 d, const float* S,
                                                  const float* D, const float* w,
                                                  const float* w0, bool recip, float* q0,
                                                  float* q1, u32 lane, float (&dot)[2],
                                                  float (&largest)[2]) {
    if (decoder == LEGEND_COMPLEX) {
        u32 h = d / 2;
        for (u32 k = V * lane; k < h; k += 32 * V) {
            LegendVec<V> sre = legend_ld<V>(S + k), sim = legend_ld<V>(S + k + h);
            LegendVec<V> dre = legend_ld<V>(D + k), dim_ = legend_ld<V>(D + k + h);
            LegendVec<V> rre = legend_ld<V>(w + k), rim = legend_ld<V>(w + k + h);
            LegendVec<V> r0re = recip ? legend_ld<V>(w0 + k) : rre;
            LegendVec<V> r0im = recip ? legend_ld<V>(w0 + k + h) : rim;
            LegendVec<V> q0re, q0im, q1re, q1im;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                float q[4];
                legend_complex_queries(sre.v[v], sim.v[v], dre.v[v], dim_.v[v], rre.v[v],
                                       rim.v[v], q);
                if (recip) legend_complex_inverse_query(dre.v[v], dim_.v[v], r0re.v[v],
                                                        r0im.v[v], q);
                q0re.v[v] = q[0];
                q0im.v[v] = q[1];
                q1re.v[v] = q[2];
                q1im.v[v] = q[3];
                dot[0] += q0re.v[v] * sre.v[v] + q0im.v[v] * sim.v[v];
                dot[1] += q1re.v[v] * dre.v[v] + q1im.v[v] * dim_.v[v];
                largest[0] = fmaxf(largest[0], fmaxf(fabsf(q0re.v[v]), fabsf(q0im.v[v])));
                largest[1] = fmaxf(largest[1], fmaxf(fabsf(q1re.v[v]), fabsf(q1im.v[v])));
            }
            legend_st<V>(q0 + k, q0re);
            legend_st<V>(q0 + k + h, q0im);
            legend_st<V>(q1 + k, q1re);
            legend_st<V>(q1 + k + h, q1im);
        }
    } else {
        bool distmult = decoder == LEGEND_DISTMULT;
        for (u32 k = V * lane; k < d; k += 32 * V) {
            LegendVec<V> s = legend_ld<V>(S + k), t = legend_ld<V>(D + k);
            LegendVec<V> r = distmult ? legend_ld<V>(w + k) : LegendVec<V>{};
            LegendVec<V> r0 = distmult && recip ? legend_ld<V>(w0 + k) : r;
            LegendVec<V> a, b;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                a.v[v] = distmult ? t.v[v] * r0.v[v] : t.v[v];
                b.v[v] = distmult ? s.v[v] * r.v[v] : s.v[v];
                dot[0] += a.v[v] * s.v[v];
                dot[1] += b.v[v] * t.v[v];
                largest[0] = fmaxf(largest[0], fabsf(a.v[v]));
                largest[1] = fmaxf(largest[1], fabsf(b.v[v]));
            }
            legend_st<V>(q0 + k, a);
            legend_st<V>(q1 + k, b);
        }
    }
}

// Queries and positive scores of edge r of chunk z0 / 2, both sides (rows r of jobs z0 and
// z0 + 1), by one warp: each row of the edge is read once. Sets each side's largest query
// magnitude (0 where the queries take no FP16 copy: TransE off the fused path).
__device__ void legend_query_edge(const LegendJobs& jobs, const float* __restrict__ emb,
                                  const float* __restrict__ rel, float* __restrict__ query,
                                  float* __restrict__ pos, u32 z0, u32 r, u32 lane,
                                  float (&largest)[2]) {
    const u32* e = jobs.edges + 3ull * (jobs.row0[z0] + r);
    u32 d = jobs.dim;
    const float* S = emb + (u64)e[0] * d;
    const float* D = emb + (u64)e[2] * d;
    const float* w = rel + (u64)e[1] * d;
    bool recip = jobs.inverse != 0u;
    const float* w0 = recip ? rel + (u64)(jobs.inverse + e[1]) * d : w;
    u64 row0 = (u64)z0 * jobs.max_rows + r, row1 = row0 + jobs.max_rows;
    float *q0 = query + row0 * d, *q1 = query + row1 * d;
    largest[0] = largest[1] = 0.0f;
    float dot[2] = {0.0f, 0.0f};
    // Rows start 16-byte aligned; ComplEx's halves 8-byte aligned when h is even.
    if (jobs.decoder >= LEGEND_TRANSE_L1) {
        // dot holds the distances, sq the queries' squared norms.
        bool l2 = jobs.decoder == LEGEND_TRANSE_L2, norms = jobs.query_norm != nullptr;
        float sq[2] = {0.0f, 0.0f};
        if (d % 4 == 0)
            legend_transe_queries<4>(l2, d, S, D, w, w0, recip, q0, q1, lane, dot, sq, largest,
                                     norms);
        else
            legend_transe_queries<1>(l2, d, S, D, w, w0, recip, q0, q1, lane, dot, sq, largest,
                                     norms);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                dot[s] += __shfl_xor_sync(0xffffffffu, dot[s], o);
                sq[s] += __shfl_xor_sync(0xffffffffu, sq[s], o);
                largest[s] = fmaxf(largest[s], __shfl_xor_sync(0xffffffffu, largest[s], o));
            }
        if (lane == 0) {
            pos[row0] = l2 ? -sqrtf(dot[0]) : -dot[0];
            pos[row1] = l2 ? -sqrtf(dot[1]) : -dot[1];
            if (norms) {
                jobs.query_norm[row0] = sq[0];
                jobs.query_norm[row1] = sq[1];
            }
        }
        return;
    }
    int dec = jobs.decoder;
    if (dec == LEGEND_COMPLEX) {
        if (d % 4 == 0) legend_query_pair<2>(dec, d, S, D, w, w0, recip, q0, q1, lane, dot, largest);
        else legend_query_pair<1>(dec, d, S, D, w, w0, recip, q0, q1, lane, dot, largest);
    } else if (d % 4 == 0) {
        legend_query_pair<4>(dec, d, S, D, w, w0, recip, q0, q1, lane, dot, largest);
    } else if (d % 2 == 0) {
        legend_query_pair<2>(dec, d, S, D, w, w0, recip, q0, q1, lane, dot, largest);
    } else {
        legend_query_pair<1>(dec, d, S, D, w, w0, recip, q0, q1, lane, dot, largest);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            dot[s] += __shfl_xor_sync(0xffffffffu, dot[s], o);
            largest[s] = fmaxf(largest[s], __shfl_xor_sync(0xffffffffu, largest[s], o));
        }
    if (lane == 0) {
        pos[row0] = dot[0];
        pos[row1] = dot[1];
    }
}

// Queries and positive scores of every edge of the group's chunks (blockIdx.y), a warp an
// edge; with jobs.absmax, each job's largest query magnitude too (one atomic a block and
// side).
extern "C" __global__ void legend_queries(LegendJobs jobs, const float* __restrict__ emb,
                                          const float* __restrict__ rel,
                                          float* __restrict__ query, float* __restrict__ pos) {
    __shared__ u32 block_largest[2];
    if (threadIdx.x < 2) block_largest[threadIdx.x] = 0u;
    __syncthreads();
    u32 z0 = 2 * blockIdx.y;
    u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (r < jobs.rows[z0]) {
        float largest[2];
        legend_query_edge(jobs, emb, rel, query, pos, z0, r, lane, largest);
        if (lane == 0 && jobs.absmax) {
            atomicMax(&block_largest[0], __float_as_uint(largest[0]));
            atomicMax(&block_largest[1], __float_as_uint(largest[1]));
        }
    }
    __syncthreads();
    if (threadIdx.x < 2 && jobs.absmax && block_largest[threadIdx.x])
        atomicMax(&jobs.absmax[2 * (z0 + threadIdx.x)], block_largest[threadIdx.x]);
}

// Copies the negatives of every job of the group into dense k x d blocks for the unfused
// products (which round to TF32 as they load) and TransE's FP32 distances.
extern "C" __global__ void legend_gather_negatives(const u32* __restrict__ negs, u32 first_job,
                                                   u32 k, u32 dim, const float* __restrict__ emb,
                                                   float* __restrict__ out) {
    u32 z = blockIdx.y;
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)k * dim) return;
    u64 j = idx / dim, t = idx % dim;
    u64 id = negs[(u64)(first_job + z) * k + j];
    out[(u64)z * k * dim + idx] = emb[id * dim + t];
}

// Rows handled by one block of the loss kernel (8 warps, 4 rows each), so that the loss
// sum takes one atomic per 32 rows.
#define LEGEND_LOSS_ROWS 32
// Scores per lane kept in registers by the softmax loss (rows of up to 32 x this many).
#define LEGEND_LOSS_REGS 32

// (softplus(x), sigmoid(x)) from one exp(-|x|), stable on both tails; (0, 0) at x = -∞
// (legend-model's softplus_sigmoid).
__device__ __forceinline__ float2 legend_softplus_sigmoid(float x) {
    float ex = expf(-fabsf(x));
    return make_float2(fmaxf(x, 0.0f) + log1pf(ex), (x >= 0.0f ? 1.0f : ex) / (1.0f + ex));
}

// The self-adversarial loss of one row (legend-model's Loss::SelfAdversarial): weights p =
// softmax(α · neg) over the row's negatives (an excluded, -∞, one weighs 0), held constant
// in the gradient; softplus(-(γ + pos)) + Σ_j p_j softplus(γ + neg_j). Overwrites the scores
// with p_j sigmoid(γ + neg_j) and returns (loss, ∂L/∂pos), the same on every lane.
__device__ float2 legend_self_adversarial_row(float* s, float p, u32 k, float margin,
                                              float temperature, u32 lane) {
    const float minus_inf = __int_as_float(0xff800000);
    float mx = minus_inf;
    for (u32 j = lane; j < k; j += 32) mx = fmaxf(mx, s[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float total = 0.0f;
    for (u32 j = lane; j < k; j += 32)
        total += s[j] == minus_inf ? 0.0f : expf(temperature * (s[j] - mx));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    float inv = total > 0.0f ? 1.0f / total : 0.0f;
    float neg = 0.0f;
    for (u32 j = lane; j < k; j += 32) {
        float x = s[j];
        float w = x == minus_inf ? 0.0f : expf(temperature * (x - mx)) * inv;
        float2 sp = legend_softplus_sigmoid(margin + x);
        neg += w * sp.x;
        s[j] = w * sp.y;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) neg += __shfl_xor_sync(0xffffffffu, neg, o);
    float2 sp = legend_softplus_sigmoid(-(margin + p));
    return make_float2(sp.x + neg, -sp.y);
}

// Loss of each row against its k negative scores; overwrites the scores with ∂L/∂score
// and writes ∂L/∂pos. Adds the group's loss into *loss_sum. `margin` is the ranking
// loss's margin and the self-adversarial loss's γ, `temperature` the latter's α.
extern "C" __global__ void legend_loss(float* __restrict__ scores, const float* __restrict__ pos,
                                       float* __restrict__ grad_pos, const u32* __restrict__ rows,
                                       u32 max_rows, u32 k, int loss, float margin,
                                       float temperature, double* __restrict__ loss_sum) {
    __shared__ float partial[8];
    u32 z = blockIdx.y;
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float total_loss = 0.0f;
    for (u32 i = 0; i < LEGEND_LOSS_ROWS / 8; ++i) {
        u32 r = blockIdx.x * LEGEND_LOSS_ROWS + i * 8 + warp;
        if (r >= rows[z]) break;
        u64 row = (u64)z * max_rows + r;
        float* s = scores + row * k;
        float p = pos[row];
        float row_loss, gpos;
        if (loss == LEGEND_LOSS_SOFTMAX && k <= 32 * LEGEND_LOSS_REGS) {
            // The whole row in registers: one read and one write of the scores.
            float v[LEGEND_LOSS_REGS];
            float mx = p;
#pragma unroll
            for (int c = 0; c < LEGEND_LOSS_REGS; ++c) {
                u32 j = lane + 32 * c;
                v[c] = j < k ? s[j] : __int_as_float(0xff800000);
                mx = fmaxf(mx, v[c]);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < LEGEND_LOSS_REGS; ++c) {
                v[c] = expf(v[c] - mx);
                sum += v[c];
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            float pe = expf(p - mx);
            sum += pe;
            float inv = 1.0f / sum;
#pragma unroll
            for (int c = 0; c < LEGEND_LOSS_REGS; ++c) {
                u32 j = lane + 32 * c;
                if (j < k) s[j] = v[c] * inv;
            }
            row_loss = (mx - p) + logf(sum);
            gpos = pe * inv - 1.0f;
        } else if (loss == LEGEND_LOSS_SOFTMAX) {
            float mx = p;
            for (u32 j = lane; j < k; j += 32) mx = fmaxf(mx, s[j]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float sum = 0.0f;
            for (u32 j = lane; j < k; j += 32) {
                float ex = expf(s[j] - mx);
                s[j] = ex;
                sum += ex;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            float pe = expf(p - mx);
            sum += pe;
            float inv = 1.0f / sum;
            for (u32 j = lane; j < k; j += 32) s[j] *= inv;
            row_loss = (mx - p) + logf(sum);
            gpos = pe * inv - 1.0f;
        } else if (loss == LEGEND_LOSS_LOGISTIC) {
            float w = 1.0f / (float)(k > 0 ? k : 1);
            float neg = 0.0f;
            for (u32 j = lane; j < k; j += 32) {
                float x = s[j];
                float ex = expf(-fabsf(x));
                neg += fmaxf(x, 0.0f) + log1pf(ex);
                s[j] = w * (x >= 0.0f ? 1.0f : ex) / (1.0f + ex);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) neg += __shfl_xor_sync(0xffffffffu, neg, o);
            float ex = expf(-fabsf(p));
            row_loss = fmaxf(-p, 0.0f) + log1pf(ex) + w * neg;
            gpos = -((-p >= 0.0f ? 1.0f : ex) / (1.0f + ex));
        } else if (loss == LEGEND_LOSS_SELF_ADVERSARIAL) {
            float2 lg = legend_self_adversarial_row(s, p, k, margin, temperature, lane);
            row_loss = lg.x;
            gpos = lg.y;
        } else {
            float hinge = 0.0f, active = 0.0f;
            for (u32 j = lane; j < k; j += 32) {
                float v = margin - p + s[j];
                bool on = v > 0.0f;
                hinge += on ? v : 0.0f;
                active += on ? 1.0f : 0.0f;
                s[j] = on ? 1.0f : 0.0f;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                hinge += __shfl_xor_sync(0xffffffffu, hinge, o);
                active += __shfl_xor_sync(0xffffffffu, active, o);
            }
            row_loss = hinge;
            gpos = -active;
        }
        if (lane == 0) grad_pos[row] = gpos;
        total_loss += row_loss;
    }
    if (lane == 0) partial[warp] = total_loss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int w = 0; w < 8; ++w) t += partial[w];
        atomicAdd(loss_sum, (double)t);
    }
}

// Filtered negatives: the known edges sorted twice, as triples (source, relation,
// destination) and (relation, destination, source) (legend-cuda's known.rs). A row's known
// neighbours on one side are then a contiguous range of one of them: the keys whose first two
// ids are the row's (source, relation), or its (relation, destination).

// Whether the first two ids of `key` are below (above, when `above`) (p0, p1).
__device__ __forceinline__ bool legend_key_beyond(const u32* key, u32 p0, u32 p1, bool above) {
    return above ? (key[0] > p0 || (key[0] == p0 && key[1] > p1))
                 : (key[0] < p0 || (key[0] == p0 && key[1] < p1));
}

// The first of the `n` sorted keys whose first two ids are not below (p0, p1), or, when
// `upper`, above them; found by the whole warp, 32 pivots a step (the same on every lane).
__device__ u32 legend_warp_bound(const u32* __restrict__ keys, u32 n, u32 p0, u32 p1, bool upper,
                                 u32 lane) {
    u32 lo = 0, hi = n;
    while (lo < hi) {
        u32 step = (hi - lo + 31) / 32;
        u32 pivot = lo + lane * step;
        // The predicate is monotone; past `hi` it holds.
        bool holds = pivot >= hi ||
                     (upper ? legend_key_beyond(keys + 3ull * pivot, p0, p1, true)
                            : !legend_key_beyond(keys + 3ull * pivot, p0, p1, false));
        u32 mask = __ballot_sync(0xffffffffu, holds);
        if (mask == 0u) {
            lo = lo + 31 * step + 1;
        } else {
            u32 f = __ffs(mask) - 1;
            if (f == 0) return lo;
            u32 below = lo + (f - 1) * step;
            hi = min(hi, lo + f * step);
            lo = below + 1;
        }
    }
    return lo;
}

// Sets to −∞ the score of every negative that, put in its edge's place, makes a known edge,
// so the loss leaves it out with a zero gradient, as the CPU engine's exclusion masks do
// (training.negatives.filtered). One warp a row: it finds the row's known neighbours (job 2c
// replaces sources: the (s', relation, destination) known; 2c + 1 destinations: the (source,
// relation, d')) and tests each negative against them, in registers when there are at most
// 32, else by a binary search of the range. `edges` and `negs` hold global ids (the engine
// keeps copies from before the slot remap); blockIdx.y is the job in the group.
extern "C" __global__ void __launch_bounds__(256) legend_filter_known(
    const u32* __restrict__ edges, const u32* __restrict__ row0, const u32* __restrict__ rows,
    u32 first_job, u32 max_rows, const u32* __restrict__ negs, u32 k,
    const u32* __restrict__ by_source, const u32* __restrict__ by_destination, u32 known,
    float* __restrict__ scores) {
    u32 z = blockIdx.y, lane = threadIdx.x & 31;
    u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows[z]) return;
    const u32* e = edges + 3ull * (row0[z] + r);
    u32 job = first_job + z;
    bool replaces_destination = job & 1u;
    const u32* keys = replaces_destination ? by_source : by_destination;
    u32 p0 = replaces_destination ? e[0] : e[1], p1 = replaces_destination ? e[1] : e[2];
    u32 lo = legend_warp_bound(keys, known, p0, p1, false, lane);
    u32 hi = legend_warp_bound(keys, known, p0, p1, true, lane);
    const u32* job_negs = negs + (u64)job * k;
    float* row = scores + ((u64)z * max_rows + r) * k;
    const float minus_inf = __int_as_float(0xff800000);
    u32 count = hi - lo;
    if (count <= 32) {
        u32 mine = lane < count ? keys[3ull * (lo + lane) + 2] : 0u;
        for (u32 base = 0; base < k; base += 32) {
            u32 j = base + lane;
            u32 n = j < k ? job_negs[j] : 0u;
            bool hit = false;
            for (u32 t = 0; t < count; ++t) hit |= __shfl_sync(0xffffffffu, mine, t) == n;
            if (j < k && hit) row[j] = minus_inf;
        }
        return;
    }
    // Many neighbours: the range is sorted by its third id.
    for (u32 j = lane; j < k; j += 32) {
        u32 n = job_negs[j], a = lo, b = hi;
        while (a < b) {
            u32 m = a + (b - a) / 2;
            if (keys[3ull * m + 2] < n) a = m + 1;
            else b = m;
        }
        if (a < hi && keys[3ull * a + 2] == n) row[j] = minus_inf;
    }
}

// Marks `id` in `flags`; the first marker appends it to the block's list.
__device__ __forceinline__ void legend_mark_local(u32* flags, u32 id, u32* list, u32* count) {
    if (atomicExch(&flags[id], 1u) == 0u) list[atomicAdd(count, 1u)] = id;
}

// What the backward kernels need to update a node row used once by the batch in place
// (legend_count_uses, LegendRowSink): the AdaGrad state and settings, the use counts (null
// when every row goes through the gradient table: GpuBatchEngine::forward_backward), and the
// rounding legend_adagrad applies to the rows it updates (dtype LEGEND_DTYPE_F32: none).
struct LegendDirect {
    float* state;
    u32* uses;
    float lr;
    float eps;
    u32 row_wise;  // one state float a row (legend_finish_direct_rows) instead of one an element
    u32 pad;
    LegendRounding rounding;
};

// After an edge's backward, once every lane has read its rows (lane 0 calls it): a node row
// updated in place is done, its use count back to zero; the others, the edge's relation row
// (`relation_row`: the decoder has one) and its inverse's (`recip`) are marked for
// legend_adagrad in the block's lists.
__device__ __forceinline__ void legend_list_edge_rows(const LegendDirect& direct, u32* emb_flags,
                                                      u32 src, bool src_direct, u32 dst,
                                                      bool dst_direct, u32* rel_flags,
                                                      bool relation_row, u32 relation, bool recip,
                                                      u32 inverse, u32* new_rows, u32* n_rows,
                                                      u32* new_rels, u32* n_rels) {
    if (src_direct) direct.uses[src] = 0u;
    else legend_mark_local(emb_flags, src, new_rows, n_rows);
    if (dst_direct) direct.uses[dst] = 0u;
    else legend_mark_local(emb_flags, dst, new_rows, n_rows);
    if (relation_row) legend_mark_local(rel_flags, relation, new_rels, n_rels);
    if (recip) legend_mark_local(rel_flags, inverse, new_rels, n_rels);
}

// The sink of node row `id` (d floats a row), direct when the batch uses the row once.
__device__ __forceinline__ LegendRowSink legend_node_sink(float* emb, float* emb_grad,
                                                          const LegendDirect& direct, u32 id,
                                                          u32 d) {
    u64 at = (u64)id * d;
    bool once = direct.uses && direct.uses[id] == 1u;
    bool row_wise = direct.row_wise != 0u;
    return LegendRowSink{emb_grad + at,  emb + at,   direct.state + (row_wise ? id : at),
                         once,          direct.lr,  direct.eps,
                         row_wise};
}

// Backward of one ComplEx edge by one warp, V complex pairs a lane (of each half): the
// queries are recomputed (legend_complex_queries), a few products instead of two more rows
// to load. With reciprocal relations (`recip`), side 0's query is d·w0 (w0 the inverse row,
// which takes side 0's relation gradient; w then side 1's alone). Every row also gets the
// regulariser's gradient of its occurrence. X: whether either may be on (false compiles the
// plain step, whose registers they would crowd).
template <int V, bool X>
__device__ __forceinline__ void legend_complex_edge_backward(
    LegendPenalty pen, bool recip, u32 h, u32 lane, const float* S, const float* D,
    const float* w, const float* w0, const float* dq0, const float* dq1, float gp0, float gp1,
    const LegendRowSink& gs, const LegendRowSink& gd, const LegendRowSink& gw,
    const LegendRowSink& gw0) {
    recip = X && recip;
    for (u32 k = V * lane; k < h; k += 32 * V) {
        LegendVec<V> sre = legend_ld<V>(S + k), sim = legend_ld<V>(S + k + h);
        LegendVec<V> dre = legend_ld<V>(D + k), dim_ = legend_ld<V>(D + k + h);
        LegendVec<V> rre = legend_ld<V>(w + k), rim = legend_ld<V>(w + k + h);
        LegendVec<V> r0re = recip ? legend_ld<V>(w0 + k) : rre;
        LegendVec<V> r0im = recip ? legend_ld<V>(w0 + k + h) : rim;
        LegendVec<V> a0re = legend_ld<V>(dq0 + k), a0im = legend_ld<V>(dq0 + k + h);
        LegendVec<V> a1re = legend_ld<V>(dq1 + k), a1im = legend_ld<V>(dq1 + k + h);
        LegendVec<V> ssre = legend_sink_states<V>(gs, k), ssim = legend_sink_states<V>(gs, k + h);
        LegendVec<V> sdre = legend_sink_states<V>(gd, k), sdim = legend_sink_states<V>(gd, k + h);
        LegendVec<V> gsre, gsim, gdre, gdim, gwre, gwim, gw0re, gw0im;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            float q[4];
            legend_complex_queries(sre.v[v], sim.v[v], dre.v[v], dim_.v[v], rre.v[v], rim.v[v],
                                   q);
            if (recip)
                legend_complex_inverse_query(dre.v[v], dim_.v[v], r0re.v[v], r0im.v[v], q);
            float g0re = a0re.v[v] + gp0 * sre.v[v], g0im = a0im.v[v] + gp0 * sim.v[v];
            float g1re = a1re.v[v] + gp1 * dre.v[v], g1im = a1im.v[v] + gp1 * dim_.v[v];
            // Transposes of the 2x2 real Jacobians of the complex products, plus the
            // positive-score gradients of the true candidates.
            gsre.v[v] = gp0 * q[0] + g1re * rre.v[v] + g1im * rim.v[v];
            gsim.v[v] = gp0 * q[1] + g1im * rre.v[v] - g1re * rim.v[v];
            gwre.v[v] = g1re * sre.v[v] + g1im * sim.v[v];
            gwim.v[v] = g1im * sre.v[v] - g1re * sim.v[v];
            if (recip) {
                // Side 0 through q0 = d·w0, the destination-side operator.
                gdre.v[v] = gp1 * q[2] + g0re * r0re.v[v] + g0im * r0im.v[v];
                gdim.v[v] = gp1 * q[3] + g0im * r0re.v[v] - g0re * r0im.v[v];
                gw0re.v[v] = g0re * dre.v[v] + g0im * dim_.v[v];
                gw0im.v[v] = g0im * dre.v[v] - g0re * dim_.v[v];
            } else {
                gdre.v[v] = gp1 * q[2] + g0re * rre.v[v] - g0im * rim.v[v];
                gdim.v[v] = gp1 * q[3] + g0re * rim.v[v] + g0im * rre.v[v];
                gwre.v[v] += g0re * dre.v[v] + g0im * dim_.v[v];
                gwim.v[v] += g0re * dim_.v[v] - g0im * dre.v[v];
            }
            if (X && pen.kind != LEGEND_PENALTY_NONE) {
                float2 ps = legend_penalty_grad2(pen, sre.v[v], sim.v[v]);
                float2 pd = legend_penalty_grad2(pen, dre.v[v], dim_.v[v]);
                float2 pw = legend_penalty_grad2(pen, rre.v[v], rim.v[v]);
                float2 pw0 = legend_penalty_grad2(pen, r0re.v[v], r0im.v[v]);
                gsre.v[v] += ps.x;
                gsim.v[v] += ps.y;
                gdre.v[v] += pd.x;
                gdim.v[v] += pd.y;
                gwre.v[v] += pw.x;
                gwim.v[v] += pw.y;
                gw0re.v[v] += pw0.x;
                gw0im.v[v] += pw0.y;
            }
        }
        legend_sink_add<V>(gs, k, gsre, sre, ssre);
        legend_sink_add<V>(gs, k + h, gsim, sim, ssim);
        legend_sink_add<V>(gd, k, gdre, dre, sdre);
        legend_sink_add<V>(gd, k + h, gdim, dim_, sdim);
        legend_sink_add<V>(gw, k, gwre, LegendVec<V>{}, LegendVec<V>{});
        legend_sink_add<V>(gw, k + h, gwim, LegendVec<V>{}, LegendVec<V>{});
        if (recip) {
            legend_sink_add<V>(gw0, k, gw0re, LegendVec<V>{}, LegendVec<V>{});
            legend_sink_add<V>(gw0, k + h, gw0im, LegendVec<V>{}, LegendVec<V>{});
        }
    }
}

// Backward of one Dot (queries S and D themselves) or DistMult edge by one warp, V elements
// a lane; reciprocal relations (`recip`) and X as for ComplEx: side 0's query is D ⊙ w0.
template <int V, bool X>
__device__ __forceinline__ void legend_dot_edge_backward(
    LegendPenalty pen, bool recip, bool distmult, u32 d, u32 lane, const float* S,
    const float* D, const float* w, const float* w0, const float* dq0, const float* dq1,
    float gp0, float gp1, const LegendRowSink& gs, const LegendRowSink& gd,
    const LegendRowSink& gw, const LegendRowSink& gw0) {
    recip = X && recip;
    bool penalised = X && pen.kind != LEGEND_PENALTY_NONE;
    for (u32 k = V * lane; k < d; k += 32 * V) {
        LegendVec<V> s = legend_ld<V>(S + k), t = legend_ld<V>(D + k);
        LegendVec<V> r = distmult ? legend_ld<V>(w + k) : LegendVec<V>{};
        LegendVec<V> r0 = distmult && recip ? legend_ld<V>(w0 + k) : r;
        LegendVec<V> a0 = legend_ld<V>(dq0 + k), a1 = legend_ld<V>(dq1 + k);
        LegendVec<V> ss = legend_sink_states<V>(gs, k), sd = legend_sink_states<V>(gd, k);
        LegendVec<V> ps, pd, pw, pw0;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            float wk = distmult ? r.v[v] : 1.0f, w0k = distmult ? r0.v[v] : 1.0f;
            float g0 = a0.v[v] + gp0 * s.v[v], g1 = a1.v[v] + gp1 * t.v[v];
            ps.v[v] = gp0 * t.v[v] * w0k + g1 * wk;
            pd.v[v] = gp1 * s.v[v] * wk + g0 * w0k;
            pw.v[v] = (recip ? 0.0f : g0 * t.v[v]) + g1 * s.v[v];
            pw0.v[v] = g0 * t.v[v];
            if (penalised) {
                ps.v[v] += legend_penalty_grad(pen, s.v[v]);
                pd.v[v] += legend_penalty_grad(pen, t.v[v]);
                pw.v[v] += legend_penalty_grad(pen, wk);
                pw0.v[v] += legend_penalty_grad(pen, w0k);
            }
        }
        legend_sink_add<V>(gs, k, ps, s, ss);
        legend_sink_add<V>(gd, k, pd, t, sd);
        if (distmult) legend_sink_add<V>(gw, k, pw, LegendVec<V>{}, LegendVec<V>{});
        if (distmult && recip) legend_sink_add<V>(gw0, k, pw0, LegendVec<V>{}, LegendVec<V>{});
    }
}

// The work of one warp in legend_rows_backward: edge `r` of chunk z0 / 2. X: whether
// reciprocal relations (jobs.inverse) or a regulariser (jobs.penalty) may be on; R: whether
// the in-place steps may be rounded (legend_node_sink).
template <bool X, bool R>
__device__ void legend_edge_backward(LegendJobs jobs, float* emb, const float* __restrict__ rel,
                                     const float* __restrict__ pos,
                                     const float* __restrict__ grad_query,
                                     const float* __restrict__ grad_pos,
                                     float* __restrict__ emb_grad, u32* emb_flags,
                                     const LegendDirect& direct, float* __restrict__ rel_grad,
                                     u32* rel_flags, u32 z0, u32 z1, u32 r, u32 lane,
                                     u32* new_rows, u32* n_rows, u32* new_rels, u32* n_rels) {
    const u32* e = jobs.edges + 3ull * (jobs.row0[z0] + r);
    u32 src = e[0], relation = e[1], dst = e[2];
    u32 d = jobs.dim;
    // Side 0 replaces sources (query from the destination), side 1 destinations.
    u64 row0 = (u64)z0 * jobs.max_rows + r, row1 = (u64)z1 * jobs.max_rows + r;
    // Read before any update: a row updated in place is used by this edge alone, and each
    // lane reads the elements it then writes.
    const float* S = emb + (u64)src * d;
    const float* D = emb + (u64)dst * d;
    const float* w = rel + (u64)relation * d;
    // Reciprocal relations: side 0 goes through the inverse row (jobs.inverse + relation).
    bool recip = X && jobs.inverse != 0u;
    u32 inverse = jobs.inverse + relation;
    const float* w0 = recip ? rel + (u64)inverse * d : w;
    const float *dq0 = grad_query + row0 * d, *dq1 = grad_query + row1 * d;
    float gp0 = grad_pos[row0], gp1 = grad_pos[row1];
    LegendRowSink gs = legend_node_sink(emb, emb_grad, direct, src, d);
    LegendRowSink gd = legend_node_sink(emb, emb_grad, direct, dst, d);
    LegendRowSink gw{rel_grad + (u64)relation * d, nullptr, nullptr, false, 0.0f, 0.0f};
    LegendRowSink gw0{rel_grad + (u64)inverse * d, nullptr, nullptr, false, 0.0f, 0.0f};
    LegendPenalty pen = jobs.penalty;
    // Rows start 16-byte aligned; ComplEx's halves 8-byte aligned when h is even.
    if (jobs.decoder >= LEGEND_TRANSE_L1) {
        // The positives' weights: gp, over the distance (-pos, as legend_queries left it)
        // for L2, where the CPU's subgradient at distance 0 is 0.
        bool l2 = jobs.decoder == LEGEND_TRANSE_L2;
        float c0 = gp0, c1 = gp1;
        if (l2) {
            float d0 = -pos[row0], d1 = -pos[row1];
            c0 = d0 > 0.0f ? gp0 / d0 : 0.0f;
            c1 = d1 > 0.0f ? gp1 / d1 : 0.0f;
        }
        float2 wq = jobs.query_weight
                        ? make_float2(jobs.query_weight[row0], jobs.query_weight[row1])
                        : make_float2(0.0f, 0.0f);
        if (d % 4 == 0)
            legend_transe_edge_backward<4, X>(pen, recip, l2, d, lane, S, D, w, w0, dq0, dq1, wq,
                                              c0, c1, gs, gd, gw, gw0);
        else
            legend_transe_edge_backward<1, X>(pen, recip, l2, d, lane, S, D, w, w0, dq0, dq1, wq,
                                              c0, c1, gs, gd, gw, gw0);
    } else if (jobs.decoder == LEGEND_COMPLEX) {
        if (d % 4 == 0)
            legend_complex_edge_backward<2, X>(pen, recip, d / 2, lane, S, D, w, w0, dq0, dq1,
                                               gp0, gp1, gs, gd, gw, gw0);
        else
            legend_complex_edge_backward<1, X>(pen, recip, d / 2, lane, S, D, w, w0, dq0, dq1,
                                               gp0, gp1, gs, gd, gw, gw0);
    } else {
        bool distmult = jobs.decoder == LEGEND_DISTMULT;
        if (d % 4 == 0)
            legend_dot_edge_backward<4, X>(pen, recip, distmult, d, lane, S, D, w, w0, dq0, dq1,
                                           gp0, gp1, gs, gd, gw, gw0);
        else if (d % 2 == 0)
            legend_dot_edge_backward<2, X>(pen, recip, distmult, d, lane, S, D, w, w0, dq0, dq1,
                                           gp0, gp1, gs, gd, gw, gw0);
        else
            legend_dot_edge_backward<1, X>(pen, recip, distmult, d, lane, S, D, w, w0, dq0, dq1,
                                           gp0, gp1, gs, gd, gw, gw0);
    }
    const LegendRowSink* const ends[2] = {&gs, &gd};
    const u32 end_ids[2] = {src, dst};
    legend_finish_direct_rows<R, 2>(ends, end_ids, direct.rounding, d, lane);
    __syncwarp();
    if (lane == 0)
        legend_list_edge_rows(direct, emb_flags, src, gs.direct, dst, gd.direct, rel_flags,
                              jobs.decoder != LEGEND_DOT, relation, recip, inverse, new_rows,
                              n_rows, new_rels, n_rels);
}

// Backward through the positive scores and the query operators of every edge, both sides
// at once (jobs 2c and 2c + 1 of a chunk share their rows, and launches hold whole chunks):
// with dq = G·N + grad_pos · true (from the product kernel), adds ∂L/∂source,
// ∂L/∂destination and ∂L/∂relation of the edge into the gradient tables, one atomic per
// element and table, and marks the rows for the optimizer; a node row the batch uses once
// (direct.uses) gets its AdaGrad step here instead. blockIdx.y is the chunk. Four blocks of
// 8 warps an SM (at most 64 registers, a few spilled): more loads in flight, faster than
// three or two (Documentation/gpu.md, measurement log, version 19). The body runs `edge(z0,
// z1, r, lane, new_rows, n_rows, new_rels, n_rels)` for edge r of the chunk, one warp an
// edge, which lists the rows it newly marks in the block's arrays: legend_edge_backward<X, R>
// for LEGEND_ROWS_BACKWARD's kernels, the RotatE and RESCAL edges for their own kernels
// (kernels/rotate.cu, kernels/rescal.cu).
template <typename Edge>
__device__ __forceinline__ void legend_rows_backward_body(const LegendJobs& jobs, u32* emb_list,
                                                          u32* emb_count, u32* rel_list,
                                                          u32* rel_count, Edge edge) {
    // Rows newly marked by this block, appended to the global lists with one atomic per
    // block: a per-row atomic on the shared counters serialised the whole kernel.
    __shared__ u32 new_rows[16], new_rels[16], n_rows, n_rels, base_rows, base_rels;
    if (threadIdx.x == 0) n_rows = n_rels = 0;
    __syncthreads();
    u32 z0 = 2 * blockIdx.y, z1 = z0 + 1;
    u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (r < jobs.rows[z0]) edge(z0, z1, r, lane, new_rows, &n_rows, new_rels, &n_rels);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (n_rows) base_rows = atomicAdd(emb_count, n_rows);
        if (n_rels) base_rels = atomicAdd(rel_count, n_rels);
    }
    __syncthreads();
    if (threadIdx.x < n_rows) emb_list[base_rows + threadIdx.x] = new_rows[threadIdx.x];
    if (threadIdx.x < n_rels) rel_list[base_rels + threadIdx.x] = new_rels[threadIdx.x];
}

// A rows-backward kernel `name`, BLOCKS blocks of 8 warps a multiprocessor: the arguments
// every rows backward takes (GpuBatchEngine::passes launches them alike), and
// legend_rows_backward_body running the edge call that follows BLOCKS, which may name those
// arguments and the body's (z0, z1, r, lane, new_rows, n_rows, new_rels, n_rels).
#define LEGEND_ROWS_BACKWARD_KERNEL(name, BLOCKS, ...)                                          \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS) name(                            \
        LegendJobs jobs, float* emb, const float* __restrict__ rel,                             \
        const float* __restrict__ pos, const float* __restrict__ grad_query,                    \
        const float* __restrict__ grad_pos, float* __restrict__ emb_grad, u32* emb_flags,       \
        u32* emb_list, u32* emb_count, LegendDirect direct, float* __restrict__ rel_grad,       \
        u32* rel_flags, u32* rel_list, u32* rel_count) {                                        \
        legend_rows_backward_body(jobs, emb_list, emb_count, rel_list, rel_count,               \
                                  [&](u32 z0, u32 z1, u32 r, u32 lane, u32* new_rows,           \
                                      u32* n_rows, u32* new_rels, u32* n_rels) { __VA_ARGS__; }); \
    }

// The kernels over legend_edge_backward<X, R> (X and R as there): legend_rows_backward is the
// plain step, legend_rows_backward_rounded the one whose in-place steps round (16-bit rows),
// legend_rows_backward_extra the one with reciprocal relations or a regulariser, rounded or not
// (their registers would crowd the plain one's; it runs three blocks a multiprocessor, where it
// spills far less: "16-bit rows" in Documentation/gpu.md).
#define LEGEND_ROWS_BACKWARD(name, X, R, BLOCKS)                                                \
    LEGEND_ROWS_BACKWARD_KERNEL(name, BLOCKS,                                                   \
                                legend_edge_backward<X, R>(                                     \
                                    jobs, emb, rel, pos, grad_query, grad_pos, emb_grad,        \
                                    emb_flags, direct, rel_grad, rel_flags, z0, z1, r, lane,    \
                                    new_rows, n_rows, new_rels, n_rels))

LEGEND_ROWS_BACKWARD(legend_rows_backward, false, false, 4)
LEGEND_ROWS_BACKWARD(legend_rows_backward_rounded, false, true, 4)
LEGEND_ROWS_BACKWARD(legend_rows_backward_extra, true, true, 3)

// A whole row's gradient g - w · row into its sink (w: what TransE L2's fused kernels left
// out, 0 elsewhere), V elements a lane: the in-place AdaGrad step of a direct row,
// otherwise reductions into the gradient table.
template <int V>
__device__ __forceinline__ void legend_sink_row(const LegendRowSink& row, const float* g,
                                                float w, u32 dim, u32 lane) {
    for (u32 t = V * lane; t < dim; t += 32 * V) {
        LegendVec<V> x = legend_ld<V>(g + t);
        LegendVec<V> p = row.direct || w != 0.0f ? legend_ld<V>(row.param + t) : LegendVec<V>{};
#pragma unroll
        for (int v = 0; v < V; ++v) x.v[v] = fmaf(-w, p.v[v], x.v[v]);
        legend_sink_add<V>(row, t, x, p, legend_sink_states<V>(row, t));
    }
}

// Adds the gradients of the negatives (k x d per job, less neg_weight times the row where
// given: TransE L2 on the fused path) into the entity gradient table; a row the batch uses
// once (direct.uses) gets its AdaGrad step here instead.
extern "C" __global__ void legend_negatives_backward(const u32* __restrict__ negs, u32 first_job,
                                                     u32 k, u32 dim,
                                                     const float* __restrict__ grad_negs,
                                                     const float* __restrict__ neg_weight,
                                                     float* emb, float* __restrict__ emb_grad,
                                                     u32* emb_flags, u32* emb_list,
                                                     u32* emb_count, LegendDirect direct) {
    u32 z = blockIdx.y;
    u32 j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (j >= k) return;
    u32 id = negs[(u64)(first_job + z) * k + j];
    const float* g = grad_negs + ((u64)z * k + j) * dim;
    LegendRowSink row = legend_node_sink(emb, emb_grad, direct, id, dim);
    float w = neg_weight ? neg_weight[(u64)z * k + j] : 0.0f;
    if (dim % 4 == 0) legend_sink_row<4>(row, g, w, dim, lane);
    else legend_sink_row<1>(row, g, w, dim, lane);
    const LegendRowSink* const rows[1] = {&row};
    const u32 ids[1] = {id};
    legend_finish_direct_rows<true, 1>(rows, ids, direct.rounding, dim, lane);
    if (row.direct) {
        // Every lane has read the use count (legend_node_sink) before it is cleared.
        __syncwarp();
        if (lane == 0) direct.uses[id] = 0u;
    } else if (lane == 0) {
        legend_mark(emb_flags, emb_list, emb_count, id);
    }
}

// Counts the batch's uses of each node row into uses (zero before): both endpoints of
// every edge and every negative of every job, a thread each. A row used once can take its
// AdaGrad step in the backward kernels (LegendDirect); they and legend_adagrad set the
// counts back to zero.
extern "C" __global__ void legend_count_uses(const u32* __restrict__ edges, u32 batch_len,
                                             const u32* __restrict__ negs, u32 n_negs,
                                             u32* uses) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 endpoints = 2ull * batch_len;
    if (i < endpoints) atomicAdd(&uses[edges[3 * (i >> 1) + ((i & 1) ? 2 : 0)]], 1u);
    else if (i < endpoints + n_negs) atomicAdd(&uses[negs[i - endpoints]], 1u);
}

// AdaGrad on every row marked this batch (one warp a row), in place. Element-wise
// (row_state 0): state += g²; param -= lr · g / (sqrt(state) + eps) per element. Row-wise
// (row_state 1, one accumulator a row): state += mean(g²) over the row, then every element
// steps by lr · g / (sqrt(state) + eps). Node rows stored in 16 bits are then rounded
// (`rounding`, LEGEND_DTYPE_F32 for none). Leaves the gradient rows, marks and use counts
// zeroed for the next batch.
template <int V>
__device__ __forceinline__ void legend_adagrad_row(float* param, float* state, float* grad,
                                                   u64 id, u32 dim, bool row_state, float scale,
                                                   float lr, float eps,
                                                   const LegendRounding& rounding, bool round,
                                                   u64 key, u32 lane) {
    // V floats at a time where rows allow (16-byte accesses: a row of d = 100 is 25 of them,
    // one pass of the warp instead of four dependent ones).
    u64 base = id * dim;
    for (u32 t = V * lane; t < dim; t += 32 * V) {
        LegendVec<V> p = legend_ld<V>(param + base + t), g = legend_ld<V>(grad + base + t);
        LegendVec<V> s = row_state ? LegendVec<V>{} : legend_ld<V>(state + base + t);
        legend_update_piece<V>(p, g, s, row_state, true, scale, lr, eps, rounding, round, key,
                               id, t);
        legend_st<V>(param + base + t, p);
        if (!row_state) legend_st<V>(state + base + t, s);
        legend_st<V>(grad + base + t, LegendVec<V>{});
    }
}

extern "C" __global__ void legend_adagrad(float* __restrict__ param, float* __restrict__ state,
                                          float* __restrict__ grad, u32* flags, u32* uses,
                                          const u32* __restrict__ list,
                                          const u32* __restrict__ count, u32 dim,
                                          u32 row_state, float lr, float eps,
                                          LegendRounding rounding) {
    u32 w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (w >= *count) return;
    u64 id = list[w];
    bool round = rounding.dtype != LEGEND_DTYPE_F32;
    u64 key = round ? legend_round_key(rounding, id) : 0ull;
    float s = 0.0f, scale = 0.0f;
    if (row_state) {
        s = state[id] + legend_row_sq(grad + id * dim, dim, lane) / (float)dim;
        scale = lr / (sqrtf(s) + eps);
    }
    if ((dim & 3) == 0)
        legend_adagrad_row<4>(param, state, grad, id, dim, row_state, scale, lr, eps, rounding,
                              round, key, lane);
    else
        legend_adagrad_row<1>(param, state, grad, id, dim, row_state, scale, lr, eps, rounding,
                              round, key, lane);
    // Every lane has read the row's state before it is written.
    __syncwarp();
    if (lane == 0) {
        if (row_state) state[id] = s;
        flags[id] = 0u;
        uses[id] = 0u;
    }
}
