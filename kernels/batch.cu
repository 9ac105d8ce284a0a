// Batches built on the GPU: batch positions of a bucket in the counter-based order of
// legend-model's `Permutation` (permutation.rs holds the spec; this is it bit for bit), so
// the host uploads a bucket once and never shuffles it.

#define LEGEND_PERMUTATION_ROUNDS 6

// `LegendPermutation` in legend-cuda's batch.rs, field for field.
struct LegendPermutation {
    u64 n;
    u64 keys[LEGEND_PERMUTATION_ROUNDS];
    u32 half_bits;
    u32 unused;
};

// One pass of the Feistel network over the domain of 2 * half_bits bits.
__device__ __forceinline__ u64 legend_feistel(const LegendPermutation& p, u64 x) {
    const u32 h = p.half_bits;
    const u64 mask = ~0ULL >> (64u - h);
    u64 l = x >> h;
    u64 r = x & mask;
#pragma unroll
    for (int k = 0; k < LEGEND_PERMUTATION_ROUNDS; ++k) {
        const u64 t = l ^ (legend_mix(p.keys[k] ^ r) & mask);
        l = r;
        r = t;
    }
    return (l << h) | r;
}

// The image of position i < n: Feistel passes until the value falls below n (cycle walking).
__device__ __forceinline__ u64 legend_permute(const LegendPermutation& p, u64 i) {
    u64 x = i;
    do {
        x = legend_feistel(p, x);
    } while (x >= p.n);
    return x;
}

// One thread per edge of the batch: edge j of the batch is edge perm(first + j) of the bucket
// (three ids an edge: source, relation, destination).
extern "C" __global__ void legend_gather_batch(const u32* __restrict__ bucket,
                                               LegendPermutation perm, u64 first, u32 count,
                                               u32* __restrict__ out) {
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count) return;
    const u64 e = legend_permute(perm, first + j);
    out[3 * (u64)j] = bucket[3 * e];
    out[3 * (u64)j + 1] = bucket[3 * e + 1];
    out[3 * (u64)j + 2] = bucket[3 * e + 2];
}
