// The backward of a step: the rows' gradients (or their in-place AdaGrad steps, for rows
// used once) and the negatives' (see train_queries.cu for the jobs).

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
