// RESCAL on the GPU (legend-model's Decoder::Rescal, PyTorch-BigGraph's `linear`), the
// unfused path: a relation is a d x d matrix R, row-major (R[i·d + j] multiplies s_i d_j),
// and the score is sᵀ R d. Side 1 (destinations replaced) queries with q1 = sᵀR against d,
// side 0 with q0 = R d against s, or with reciprocal relations q0 = dᵀR⁻¹ (the destination-
// side operator of the inverse matrix). The products are the dot decoders' (TF32 gemm); only
// the queries and their backward differ, here, one warp an edge as in kernels/train_queries.cu.
//
// Node rows take their gradients through the gradient table (GpuBatchEngine keeps the
// in-place step off for RESCAL): an element's gradient needs every element of the other
// rows, so no lane may update a row while the warp still reads it. The relation gradients
// are d² atomics an edge and side.

// Σ_i (a_i + c b_i) M_ij: column j of M against a + c·b (a vector times M).
__device__ __forceinline__ float legend_rescal_col(const float* M, u32 d, const float* a,
                                                   const float* b, float c, u32 j) {
    float acc = 0.0f;
    for (u32 i = 0; i < d; ++i) acc = fmaf(a[i] + c * b[i], M[(u64)i * d + j], acc);
    return acc;
}

// Σ_j M_ij (a_j + c b_j): row i of M against a + c·b (M times a vector).
__device__ __forceinline__ float legend_rescal_row(const float* M, u32 d, const float* a,
                                                   const float* b, float c, u32 i) {
    const float* m = M + (u64)i * d;
    float acc = 0.0f;
    for (u32 j = 0; j < d; ++j) acc = fmaf(m[j], a[j] + c * b[j], acc);
    return acc;
}

// The queries of edge r of chunk z0 / 2, both sides, by one warp (a lane an output element),
// with their positive scores q0·s and q1·d.
extern "C" __global__ void legend_rescal_queries(LegendJobs jobs, const float* __restrict__ emb,
                                                 const float* __restrict__ rel,
                                                 float* __restrict__ query,
                                                 float* __restrict__ pos) {
    u32 z0 = 2 * blockIdx.y;
    u32 r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (r >= jobs.rows[z0]) return;
    const u32* e = jobs.edges + 3ull * (jobs.row0[z0] + r);
    u32 d = jobs.dim;
    u64 rw = (u64)d * d;
    const float* S = emb + (u64)e[0] * d;
    const float* D = emb + (u64)e[2] * d;
    const float* R = rel + e[1] * rw;
    bool recip = jobs.inverse != 0u;
    const float* R0 = rel + (jobs.inverse + e[1]) * rw;
    u64 row0 = (u64)z0 * jobs.max_rows + r, row1 = row0 + jobs.max_rows;
    float *q0 = query + row0 * d, *q1 = query + row1 * d;
    float dot[2] = {0.0f, 0.0f};
    for (u32 t = lane; t < d; t += 32) {
        float a = recip ? legend_rescal_col(R0, d, D, D, 0.0f, t)
                        : legend_rescal_row(R, d, D, D, 0.0f, t);
        float b = legend_rescal_col(R, d, S, S, 0.0f, t);
        q0[t] = a;
        q1[t] = b;
        dot[0] = fmaf(a, S[t], dot[0]);
        dot[1] = fmaf(b, D[t], dot[1]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int k = 0; k < 2; ++k) dot[k] += __shfl_xor_sync(0xffffffffu, dot[k], o);
    if (lane == 0) {
        pos[row0] = dot[0];
        pos[row1] = dot[1];
    }
}

// Backward of one RESCAL edge by one warp. With G1 = dq1 + gp1·d and G0 = dq0 + gp0·s (each
// side's ∂L/∂q, the positive's part included), and q0, q1 recomputed:
//   ∂s = R G1 + gp0 q0,   ∂R += s ⊗ G1 (side 1), and side 0 either
//   ∂d = G0ᵀ R + gp1 q1,  ∂R += G0 ⊗ d            (q0 = R d), or
//   ∂d = R⁻¹ G0 + gp1 q1, ∂R⁻¹ += d ⊗ G0          (reciprocal, q0 = dᵀR⁻¹),
// each row also with the regulariser's gradient of its occurrence (entry by entry for R).
__device__ void legend_rescal_edge_backward(const LegendJobs& jobs, const float* emb,
                                            const float* __restrict__ rel,
                                            const float* __restrict__ grad_query,
                                            const float* __restrict__ grad_pos,
                                            float* __restrict__ emb_grad, u32* emb_flags,
                                            float* __restrict__ rel_grad, u32* rel_flags, u32 z0,
                                            u32 z1, u32 r, u32 lane, u32* new_rows, u32* n_rows,
                                            u32* new_rels, u32* n_rels) {
    const u32* e = jobs.edges + 3ull * (jobs.row0[z0] + r);
    u32 src = e[0], relation = e[1], dst = e[2];
    u32 d = jobs.dim;
    u64 rw = (u64)d * d;
    u64 row0 = (u64)z0 * jobs.max_rows + r, row1 = (u64)z1 * jobs.max_rows + r;
    const float* S = emb + (u64)src * d;
    const float* D = emb + (u64)dst * d;
    const float* R = rel + relation * rw;
    bool recip = jobs.inverse != 0u;
    u32 inverse = jobs.inverse + relation;
    const float* R0 = rel + inverse * rw;
    const float *dq0 = grad_query + row0 * d, *dq1 = grad_query + row1 * d;
    float gp0 = grad_pos[row0], gp1 = grad_pos[row1];
    LegendPenalty pen = jobs.penalty;
    float* gs = emb_grad + (u64)src * d;
    float* gd = emb_grad + (u64)dst * d;
    for (u32 t = lane; t < d; t += 32) {
        float q0 = recip ? legend_rescal_col(R0, d, D, D, 0.0f, t)
                         : legend_rescal_row(R, d, D, D, 0.0f, t);
        float q1 = legend_rescal_col(R, d, S, S, 0.0f, t);
        float side0 = recip ? legend_rescal_row(R0, d, dq0, S, gp0, t)
                            : legend_rescal_col(R, d, dq0, S, gp0, t);
        atomicAdd(gs + t, legend_rescal_row(R, d, dq1, D, gp1, t) + gp0 * q0 +
                              legend_penalty_grad(pen, S[t]));
        atomicAdd(gd + t, side0 + gp1 * q1 + legend_penalty_grad(pen, D[t]));
    }
    float* gw = rel_grad + relation * rw;
    float* gw0 = rel_grad + inverse * rw;
    for (u32 i = 0; i < d; ++i) {
        float s = S[i], t = D[i], g0 = dq0[i] + gp0 * s;
        for (u32 j = lane; j < d; j += 32) {
            u64 at = (u64)i * d + j;
            float g1 = dq1[j] + gp1 * D[j];
            if (recip) {
                atomicAdd(gw + at, s * g1 + legend_penalty_grad(pen, R[at]));
                atomicAdd(gw0 + at, t * (dq0[j] + gp0 * S[j]) + legend_penalty_grad(pen, R0[at]));
            } else {
                atomicAdd(gw + at, s * g1 + g0 * D[j] + legend_penalty_grad(pen, R[at]));
            }
        }
    }
    __syncwarp();
    if (lane == 0)
        legend_list_edge_rows(LegendDirect{}, emb_flags, src, false, dst, false, rel_flags, true,
                              relation, recip, inverse, new_rows, n_rows, new_rels, n_rels);
}

// legend_rows_backward for RESCAL (same arguments; the node rows go through the gradient
// table whatever `direct` says, see the top of the file).
LEGEND_ROWS_BACKWARD_KERNEL(legend_rescal_rows_backward, 1,
                            legend_rescal_edge_backward(jobs, emb, rel, grad_query, grad_pos,
                                                        emb_grad, emb_flags, rel_grad, rel_flags,
                                                        z0, z1, r, lane, new_rows, n_rows,
                                                        new_rels, n_rels))
