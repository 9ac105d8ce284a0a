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
