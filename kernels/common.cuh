// Shared definitions of Legend's CUDA kernels. The Rust side prepends this file to every
// kernel source, so the programs need no include path (NVRTC has no system headers).

typedef unsigned int u32;
typedef unsigned long long u64;

// The golden-ratio increment of splitmix64.
#define LEGEND_GOLDEN 0x9e3779b97f4a7c15ULL

// splitmix64's finaliser, bit for bit the `mix` of legend-model's init.rs and of the CPU
// sampler: CPU and GPU draw the same numbers from the same counters.
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

// Marks entity (or relation) `id` as touched by this batch; the first marker appends it to
// the list of rows the optimizer will update, so each row takes exactly one step.
__device__ __forceinline__ void legend_mark(u32* flags, u32* list, u32* count, u32 id) {
    if (atomicExch(&flags[id], 1u) == 0u) {
        list[atomicAdd(count, 1u)] = id;
    }
}

// Where a step's gradient of one table row goes: added atomically into the gradient table
// (the row is listed for legend_adagrad), or, for a node row the batch uses only once
// (`direct`, from legend_count_uses), straight into AdaGrad on its parameters and state:
// that one contribution is the row's whole gradient, so no table or second pass is needed.
// One element's AdaGrad step: state += g²; returns param − lr·g/(√state + eps). The one
// formula of legend_adagrad and of the in-place updates below.
__device__ __forceinline__ float legend_adagrad_step(float param, float& state, float g,
                                                     float lr, float eps) {
    state += g * g;
    return param - lr * g / (sqrtf(state) + eps);
}

struct LegendRowSink {
    float* grad;
    float* param;
    float* state;
    bool direct;
    float lr;
    float eps;
};

// Element k's AdaGrad state for a direct row (0 otherwise), loaded by the caller with the
// row's other values, so that the update waits for no further load.
__device__ __forceinline__ float legend_sink_state(const LegendRowSink& row, u32 k) {
    return row.direct ? row.state[k] : 0.0f;
}

// Element k of the row gets gradient g; for a direct row, `param` and `state` are the
// element's values as loaded before.
__device__ __forceinline__ void legend_sink_add(const LegendRowSink& row, u32 k, float g,
                                                float param, float state) {
    if (row.direct) {
        row.param[k] = legend_adagrad_step(param, state, g, row.lr, row.eps);
        row.state[k] = state;
    } else {
        atomicAdd(&row.grad[k], g);
    }
}

// Decoders and losses, numbered as in the Rust enums of legend-cuda.
#define LEGEND_DOT 0
#define LEGEND_DISTMULT 1
#define LEGEND_COMPLEX 2
#define LEGEND_TRANSE_L1 3
#define LEGEND_TRANSE_L2 4
#define LEGEND_LOSS_SOFTMAX 0
#define LEGEND_LOSS_LOGISTIC 1
#define LEGEND_LOSS_RANKING 2
