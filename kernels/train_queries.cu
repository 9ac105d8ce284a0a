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
//
// The step's kernels by role, in the order legend-cuda's nvrtc.rs concatenates them: this file
// the jobs and their queries (and the gathered negatives of the unfused path),
// train_loss.cu the loss over the score matrices, train_filter.cu the filtered negatives,
// train_backward.cu the rows' and negatives' backward, train_adagrad.cu the optimizer.

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
