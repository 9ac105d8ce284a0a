// The loss of a step over its score matrices (see train_queries.cu for the jobs).

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
