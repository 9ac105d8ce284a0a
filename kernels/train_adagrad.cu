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
