// One training step on chunks of positives that share negatives (the CPU math of
// legend-model's ChunkWorkspace::forward_backward, for the dot-comparator decoders).
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
    u32 first_job;
    u32 max_rows;
    u32 dim;
    int decoder;
};

// Queries of every row of the group (q = op(anchor, relation)) and the positive scores
// pos = <q, true candidate>.
extern "C" __global__ void legend_queries(LegendJobs jobs, const float* __restrict__ emb,
                                          const float* __restrict__ rel,
                                          float* __restrict__ query, float* __restrict__ pos) {
    u32 z = blockIdx.y;
    u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (r >= jobs.rows[z]) return;
    u32 side = (jobs.first_job + z) & 1;
    const u32* e = jobs.edges + 3ull * (jobs.row0[z] + r);
    u64 anchor = side ? e[0] : e[2];
    u64 truth = side ? e[2] : e[0];
    u32 d = jobs.dim;
    const float* a = emb + anchor * d;
    const float* t = emb + truth * d;
    const float* w = rel + (u64)e[1] * d;
    float* q = query + ((u64)z * jobs.max_rows + r) * d;
    float dot = 0.0f;
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
        }
    } else {
        for (u32 k = lane; k < d; k += 32) {
            float v = jobs.decoder == LEGEND_DISTMULT ? a[k] * w[k] : a[k];
            q[k] = v;
            dot += v * t[k];
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) pos[(u64)z * jobs.max_rows + r] = dot;
}

// Copies the negatives of every job of the group into dense k x d blocks.
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

// Backward through the positive score and the query operator of every row: with
// dq = G·N + grad_pos · true (from the product kernel), adds ∂L/∂anchor and
// ∂L/∂true = grad_pos · q into the entity gradient table and ∂L/∂relation into the relation
// one, and marks the rows for the optimizer.
extern "C" __global__ void legend_rows_backward(
    LegendJobs jobs, const float* __restrict__ emb, const float* __restrict__ rel,
    const float* __restrict__ query, const float* __restrict__ grad_query,
    const float* __restrict__ grad_pos, float* __restrict__ emb_grad, u32* emb_flags,
    u32* emb_list, u32* emb_count, float* __restrict__ rel_grad, u32* rel_flags, u32* rel_list,
    u32* rel_count) {
    u32 z = blockIdx.y;
    u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (r >= jobs.rows[z]) return;
    u32 side = (jobs.first_job + z) & 1;
    const u32* e = jobs.edges + 3ull * (jobs.row0[z] + r);
    u32 anchor = side ? e[0] : e[2];
    u32 truth = side ? e[2] : e[0];
    u32 relation = e[1];
    u32 d = jobs.dim;
    u64 row = (u64)z * jobs.max_rows + r;
    const float* a = emb + (u64)anchor * d;
    const float* t = emb + (u64)truth * d;
    const float* w = rel + (u64)relation * d;
    const float* q = query + row * d;
    const float* dq = grad_query + row * d;
    float gp = grad_pos[row];
    float* ga = emb_grad + (u64)anchor * d;
    float* gt = emb_grad + (u64)truth * d;
    float* gw = rel_grad + (u64)relation * d;
    if (jobs.decoder == LEGEND_COMPLEX) {
        u32 h = d / 2;
        for (u32 k = lane; k < h; k += 32) {
            float gre = dq[k] + gp * t[k], gim = dq[k + h] + gp * t[k + h];
            atomicAdd(&gt[k], gp * q[k]);
            atomicAdd(&gt[k + h], gp * q[k + h]);
            float are = a[k], aim = a[k + h], rre = w[k], rim = w[k + h];
            // Transposes of the 2x2 real Jacobians of the complex products.
            if (side) {
                atomicAdd(&ga[k], gre * rre + gim * rim);
                atomicAdd(&ga[k + h], gim * rre - gre * rim);
                atomicAdd(&gw[k], gre * are + gim * aim);
                atomicAdd(&gw[k + h], gim * are - gre * aim);
            } else {
                atomicAdd(&ga[k], gre * rre - gim * rim);
                atomicAdd(&ga[k + h], gre * rim + gim * rre);
                atomicAdd(&gw[k], gre * are + gim * aim);
                atomicAdd(&gw[k + h], gre * aim - gim * are);
            }
        }
    } else {
        for (u32 k = lane; k < d; k += 32) {
            float g = dq[k] + gp * t[k];
            atomicAdd(&gt[k], gp * q[k]);
            if (jobs.decoder == LEGEND_DISTMULT) {
                atomicAdd(&ga[k], g * w[k]);
                atomicAdd(&gw[k], g * a[k]);
            } else {
                atomicAdd(&ga[k], g);
            }
        }
    }
    if (lane == 0) {
        legend_mark(emb_flags, emb_list, emb_count, anchor);
        legend_mark(emb_flags, emb_list, emb_count, truth);
        if (jobs.decoder != LEGEND_DOT) legend_mark(rel_flags, rel_list, rel_count, relation);
    }
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
    for (u32 t = lane; t < dim; t += 32) {
        float g = grad[base + t];
        float s = state[base + t] + g * g;
        state[base + t] = s;
        param[base + t] -= lr * g / (sqrtf(s) + eps);
        grad[base + t] = 0.0f;
    }
    if (lane == 0) flags[id] = 0u;
}
