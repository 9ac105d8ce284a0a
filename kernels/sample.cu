// Negative sampling on the GPU, draw for draw the CPU sampler of legend-engine: draw i of list
// l uses 64 bits of the counter-based stream keys[l]; the first `by_degree` draws of a list
// pick rows in proportion to their degree, the others uniformly, both over the concatenation
// of the given partitions (ranges of global entity ids).

// One thread per draw; `out` is lists x k entity ids. `degree_prefix` holds the prefix sums
// of the degrees over global ids (num_entities + 1 values, degree_prefix[0] = 0).
extern "C" __global__ void legend_sample_negatives(
    const u64* __restrict__ keys, u32 lists, u32 k, u32 by_degree,
    const u64* __restrict__ part_start, const u64* __restrict__ part_rows, u32 num_parts,
    u64 total_rows, const u64* __restrict__ degree_prefix, u64 total_weight,
    u32* __restrict__ out) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)lists * k) return;
    u32 list = (u32)(idx / k);
    u32 i = (u32)(idx % k);
    u64 bits = legend_draw(keys[list], i);
    u64 id = 0;
    if (i < by_degree && total_weight > 0) {
        u64 w = legend_below(bits, total_weight);
        for (u32 p = 0; p < num_parts; ++p) {
            u64 start = part_start[p];
            u64 end = start + part_rows[p];
            u64 base = degree_prefix[start];
            u64 total = degree_prefix[end] - base;
            if (w < total) {
                // The last row j in [start, end) whose prefix is <= base + w: the row whose
                // degree interval holds w (rows of degree 0 own an empty interval).
                u64 target = base + w;
                u64 lo = start, hi = end;
                while (hi - lo > 1) {
                    u64 mid = lo + (hi - lo) / 2;
                    if (degree_prefix[mid] <= target) lo = mid; else hi = mid;
                }
                id = lo;
                break;
            }
            w -= total;
        }
    } else {
        u64 r = legend_below(bits, total_rows);
        for (u32 p = 0; p < num_parts; ++p) {
            if (r < part_rows[p]) { id = part_start[p] + r; break; }
            r -= part_rows[p];
        }
    }
    out[idx] = (u32)id;
}

// Rewrites global entity ids into rows of a slot-indexed node table (a partition buffer on
// the GPU): id -> slot_of[id / rows_per_partition] * rows_per_partition
// + id % rows_per_partition. Element i is rewritten when bit (i % step) of `which` is set
// (edges: step 3, which 0b101 for source and destination; negatives: step 1, which 1). The
// host has checked that every partition met is resident.
extern "C" __global__ void legend_remap_ids(u32* __restrict__ ids, u64 n, u32 step, u32 which,
                                            const u32* __restrict__ slot_of,
                                            u64 rows_per_partition) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || !((which >> (i % step)) & 1u)) return;
    u64 id = ids[i];
    u64 p = id / rows_per_partition;
    ids[i] = (u32)((u64)slot_of[p] * rows_per_partition + id % rows_per_partition);
}
