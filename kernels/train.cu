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
    // absmax[2z] (see kernels/fused.cu); null otherwise.
    u32* absmax;
    u32 first_job;
    u32 max_rows;
    u32 dim;
    int decoder;
};

// Query of row r of job z (q = op(anchor, relation)) and its positive score
// pos = <q, true candidate> (TransE: -||q - true candidate||), by one warp. Returns the
// row's largest query magnitude (0 for TransE, whose queries need no FP16 scale).
__device__ float legend_query_row(const LegendJobs& jobs, const float* __restrict__ emb,
                                  const float* __restrict__ rel, float* __restrict__ query,
                                  float* __restrict__ pos, u32 z, u32 r, u32 lane) {
    u32 side = (jobs.first_job + z) & 1;
    const u32* e = jobs.edges + 3ull * (jobs.row0[z] + r);
    u64 anchor = side ? e[0] : e[2];
    u64 truth = side ? e[2] : e[0];
    u32 d = jobs.dim;
    const float* a = emb + anchor * d;
    const float* t = emb + truth * d;
    const float* w = rel + (u64)e[1] * d;
    float* q = query + ((u64)z * jobs.max_rows + r) * d;
    if (jobs.decoder >= LEGEND_TRANSE_L1) {
        legend_transe_query(jobs.decoder == LEGEND_TRANSE_L2, side, a, w, t, q, d, lane,
                            pos + (u64)z * jobs.max_rows + r);
        return 0.0f;
    }
    float dot = 0.0f, largest = 0.0f;
    if (jobs.decoder == LEGEND_COMPLEX) {
        u32 h = d / 2;
        for (u32 k = lane; k < h; k += 32) {
            float are = a[k], aim = a[k + h], rre = w[k], rim = w[k + h];
            float qre, qim;
            if (side) {
                qre = are * rre - aim * rim;
                qim = are * rim + aim * rre;
            } else {
                qre = rre * are + rim * aim;
                qim = rre * aim - rim * are;
            }
            q[k] = qre;
            q[k + h] = qim;
            dot += qre * t[k] + qim * t[k + h];
            largest = fmaxf(largest, fmaxf(fabsf(qre), fabsf(qim)));
        }
    } else {
        for (u32 k = lane; k < d; k += 32) {
            float v = jobs.decoder == LEGEND_DISTMULT ? a[k] * w[k] : a[k];
            q[k] = v;
            dot += v * t[k];
            largest = fmaxf(largest, fabsf(v));
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        dot += __shfl_xor_sync(0xffffffffu, dot, o);
        largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, o));
    }
    if (lane == 0) pos[(u64)z * jobs.max_rows + r] = dot;
    return largest;
}

// Queries and positive scores of every row of the group, a warp a row; with jobs.absmax,
// each job's largest query magnitude too (one atomic a block).
extern "C" __global__ void legend_queries(LegendJobs jobs, const float* __restrict__ emb,
                                          const float* __restrict__ rel,
                                          float* __restrict__ query, float* __restrict__ pos) {
    __shared__ u32 block_largest;
    if (threadIdx.x == 0) block_largest = 0u;
    __syncthreads();
    u32 z = blockIdx.y;
    u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (r < jobs.rows[z]) {
        float largest = legend_query_row(jobs, emb, rel, query, pos, z, r, lane);
        if (lane == 0 && jobs.absmax) atomicMax(&block_largest, __float_as_uint(largest));
    }
    __syncthreads();
    if (threadIdx.x == 0 && jobs.absmax && block_largest)
        atomicMax(&jobs.absmax[2 * z], block_largest);
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

// Loss of each row against its k negative scores; overwrites the scores with ∂L/∂score
// and writes ∂L/∂pos. Adds the group's loss into *loss_sum.
extern "C" __global__ void legend_loss(float* __restrict__ scores, const float* __restrict__ pos,
                                       float* __restrict__ grad_pos, const u32* __restrict__ rows,
                                       u32 max_rows, u32 k, int loss, float margin,
                                       double* __restrict__ loss_sum) {
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

// Marks `id` in `flags`; the first marker appends it to the block's list.
__device__ __forceinline__ void legend_mark_local(u32* flags, u32 id, u32* list, u32* count) {
    if (atomicExch(&flags[id], 1u) == 0u) list[atomicAdd(count, 1u)] = id;
}

// The work of one warp in legend_rows_backward: edge `r` of chunk z0 / 2.
__device__ void legend_edge_backward(LegendJobs jobs, const float* __restrict__ emb,
                                     const float* __restrict__ rel,
                                     const float* __restrict__ query,
                                     const float* __restrict__ grad_query,
                                     const float* __restrict__ grad_pos,
                                     float* __restrict__ emb_grad, u32* emb_flags,
                                     float* __restrict__ rel_grad, u32* rel_flags, u32 z0,
                                     u32 z1, u32 r, u32 lane, u32* new_rows, u32* n_rows,
                                     u32* new_rels, u32* n_rels) {
    const u32* e = jobs.edges + 3ull * (jobs.row0[z0] + r);
    u32 src = e[0], relation = e[1], dst = e[2];
    u32 d = jobs.dim;
    // Side 0 replaces sources (query from the destination), side 1 destinations.
    u64 row0 = (u64)z0 * jobs.max_rows + r, row1 = (u64)z1 * jobs.max_rows + r;
    const float* S = emb + (u64)src * d;
    const float* D = emb + (u64)dst * d;
    const float* w = rel + (u64)relation * d;
    const float *q0 = query + row0 * d, *q1 = query + row1 * d;
    const float *dq0 = grad_query + row0 * d, *dq1 = grad_query + row1 * d;
    float gp0 = grad_pos[row0], gp1 = grad_pos[row1];
    float* gs = emb_grad + (u64)src * d;
    float* gd = emb_grad + (u64)dst * d;
    float* gw = rel_grad + (u64)relation * d;
    if (jobs.decoder >= LEGEND_TRANSE_L1) {
        legend_transe_edge_backward(jobs.decoder == LEGEND_TRANSE_L2, d, lane, S, D, q0, q1, dq0,
                                    dq1, gp0, gp1, gs, gd, gw);
    } else if (jobs.decoder == LEGEND_COMPLEX) {
        u32 h = d / 2;
        for (u32 k = lane; k < h; k += 32) {
            float sre = S[k], sim = S[k + h], dre = D[k], dim_ = D[k + h];
            float rre = w[k], rim = w[k + h];
            float g0re = dq0[k] + gp0 * sre, g0im = dq0[k + h] + gp0 * sim;
            float g1re = dq1[k] + gp1 * dre, g1im = dq1[k + h] + gp1 * dim_;
            // Transposes of the 2x2 real Jacobians of the complex products, plus the
            // positive-score gradients of the true candidates.
            atomicAdd(&gs[k], gp0 * q0[k] + g1re * rre + g1im * rim);
            atomicAdd(&gs[k + h], gp0 * q0[k + h] + g1im * rre - g1re * rim);
            atomicAdd(&gd[k], gp1 * q1[k] + g0re * rre - g0im * rim);
            atomicAdd(&gd[k + h], gp1 * q1[k + h] + g0re * rim + g0im * rre);
            atomicAdd(&gw[k], g0re * dre + g0im * dim_ + g1re * sre + g1im * sim);
            atomicAdd(&gw[k + h], g0re * dim_ - g0im * dre + g1im * sre - g1re * sim);
        }
    } else {
        bool distmult = jobs.decoder == LEGEND_DISTMULT;
        for (u32 k = lane; k < d; k += 32) {
            float g0 = dq0[k] + gp0 * S[k], g1 = dq1[k] + gp1 * D[k];
            float wk = distmult ? w[k] : 1.0f;
            atomicAdd(&gs[k], gp0 * q0[k] + g1 * wk);
            atomicAdd(&gd[k], gp1 * q1[k] + g0 * wk);
            if (distmult) atomicAdd(&gw[k], g0 * D[k] + g1 * S[k]);
        }
    }
    if (lane == 0) {
        legend_mark_local(emb_flags, src, new_rows, n_rows);
        legend_mark_local(emb_flags, dst, new_rows, n_rows);
        if (jobs.decoder != LEGEND_DOT) legend_mark_local(rel_flags, relation, new_rels, n_rels);
    }
}

// Backward through the positive scores and the query operators of every edge, both sides
// at once (jobs 2c and 2c + 1 of a chunk share their rows, and launches hold whole chunks):
// with dq = G·N + grad_pos · true (from the product kernel), adds ∂L/∂source,
// ∂L/∂destination and ∂L/∂relation of the edge into the gradient tables, one atomic per
// element and table, and marks the rows for the optimizer. blockIdx.y is the chunk.
extern "C" __global__ void legend_rows_backward(
    LegendJobs jobs, const float* __restrict__ emb, const float* __restrict__ rel,
    const float* __restrict__ query, const float* __restrict__ grad_query,
    const float* __restrict__ grad_pos, float* __restrict__ emb_grad, u32* emb_flags,
    u32* emb_list, u32* emb_count, float* __restrict__ rel_grad, u32* rel_flags, u32* rel_list,
    u32* rel_count) {
    // Rows newly marked by this block, appended to the global lists with one atomic per
    // block: a per-row atomic on the shared counters serialised the whole kernel.
    __shared__ u32 new_rows[16], new_rels[8], n_rows, n_rels, base_rows, base_rels;
    if (threadIdx.x == 0) n_rows = n_rels = 0;
    __syncthreads();
    u32 z0 = 2 * blockIdx.y, z1 = z0 + 1;
    u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (r < jobs.rows[z0]) legend_edge_backward(jobs, emb, rel, query, grad_query, grad_pos,
                                                emb_grad, emb_flags, rel_grad, rel_flags, z0, z1,
                                                r, lane, new_rows, &n_rows, new_rels, &n_rels);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (n_rows) base_rows = atomicAdd(emb_count, n_rows);
        if (n_rels) base_rels = atomicAdd(rel_count, n_rels);
    }
    __syncthreads();
    if (threadIdx.x < n_rows) emb_list[base_rows + threadIdx.x] = new_rows[threadIdx.x];
    if (threadIdx.x < n_rels) rel_list[base_rels + threadIdx.x] = new_rels[threadIdx.x];
}

// Adds the gradients of the negatives (k x d per job) into the entity gradient table.
extern "C" __global__ void legend_negatives_backward(const u32* __restrict__ negs, u32 first_job,
                                                     u32 k, u32 dim,
                                                     const float* __restrict__ grad_negs,
                                                     float* __restrict__ emb_grad, u32* emb_flags,
                                                     u32* emb_list, u32* emb_count) {
    u32 z = blockIdx.y;
    u32 j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (j >= k) return;
    u32 id = negs[(u64)(first_job + z) * k + j];
    const float* g = grad_negs + ((u64)z * k + j) * dim;
    float* out = emb_grad + (u64)id * dim;
    for (u32 t = lane; t < dim; t += 32) atomicAdd(&out[t], g[t]);
    if (lane == 0) legend_mark(emb_flags, emb_list, emb_count, id);
}

// Elementwise AdaGrad on every row marked this batch (one warp a row), in place:
// state += g²; param -= lr · g / (sqrt(state) + eps). Leaves the gradient rows and marks
// zeroed for the next batch.
extern "C" __global__ void legend_adagrad(float* __restrict__ param, float* __restrict__ state,
                                          float* __restrict__ grad, u32* flags,
                                          const u32* __restrict__ list,
                                          const u32* __restrict__ count, u32 dim, float lr,
                                          float eps) {
    u32 w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (w >= *count) return;
    u64 id = list[w];
    u64 base = id * dim;
    if ((dim & 3) == 0) {
        // 16-byte accesses where rows allow them: a row of d = 100 is 25 of them, one
        // pass of the warp instead of four dependent ones.
        float4* p4 = reinterpret_cast<float4*>(param + base);
        float4* s4 = reinterpret_cast<float4*>(state + base);
        float4* g4 = reinterpret_cast<float4*>(grad + base);
        for (u32 t = lane; t < dim / 4; t += 32) {
            float4 g = g4[t], s = s4[t], p = p4[t];
            s.x += g.x * g.x;
            s.y += g.y * g.y;
            s.z += g.z * g.z;
            s.w += g.w * g.w;
            p.x -= lr * g.x / (sqrtf(s.x) + eps);
            p.y -= lr * g.y / (sqrtf(s.y) + eps);
            p.z -= lr * g.z / (sqrtf(s.z) + eps);
            p.w -= lr * g.w / (sqrtf(s.w) + eps);
            s4[t] = s;
            p4[t] = p;
            g4[t] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    } else {
        for (u32 t = lane; t < dim; t += 32) {
            float g = grad[base + t];
            float s = state[base + t] + g * g;
            state[base + t] = s;
            param[base + t] -= lr * g / (sqrtf(s) + eps);
            grad[base + t] = 0.0f;
        }
    }
    if (lane == 0) flags[id] = 0u;
}
