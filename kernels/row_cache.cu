// The row cache (issue 32): rows of a table on the namespace, looked up by GPU threads through
// a software cache of fixed-size lines in GPU memory, the lines read through the queue pairs.
//
// The table may be cut into partitions (a run's store: `rows_per_part` rows each, the last
// holding the rest, each partition's rows from its own namespace byte, `part_at`). A line is
// `line_bytes / row_bytes` consecutive rows of one partition (a multiple of the LBA size, so a
// line is one command and no row straddles two); line L is line L % lines_per_part of partition
// L / lines_per_part, the partition's last line holding what is left of it. Rows are whole
// 16-bit values or floats (a multiple of 2 bytes), copied out as they are. Set associative: line L lives in set L % sets, in
// one of `ways` slots, the victim chosen by a clock hand per set (legend_cache_victim: the
// policy, one function to replace). A set's metadata changes under its spin lock, held for a
// few instructions and never while anything waits.
//
// Requests are asynchronous: issue looks the line up and pins its slot (a hit; a line being
// loaded: the request waits with the one that loads it, coalesced; a miss: it claims a victim,
// marks it loading and hands it to its block's I/O warp), wait polls the slot's state, copies
// the row out and unpins. A thread issues up to `ahead` requests before it waits for them
// (1: synchronous, BaM's model; more: AGILE's).
//
// I/O: warp 0 of each block owns the block's queue pair alone: it takes the claimed lines from
// the block's miss ring, submits them while the SQ has room, reaps completions (copying staged
// data into the line) and marks lines valid or failed. The rule that keeps SQ space from
// deadlocking: only the I/O warp touches the SQ and CQ, and it waits on nothing but the
// controller; a requester waits only on a line's state, holding no lock and no SQ entry; a
// requester whose set has no evictable slot (every way pinned or loading) first finishes the
// rows it holds, whose loads depend on the I/O warps alone, then tries again. Any number of
// requesters therefore works with any SQ depth of 2 or more.

#define LEGEND_LINE_EMPTY 0u
#define LEGEND_LINE_LOADING 1u
#define LEGEND_LINE_VALID 2u
#define LEGEND_LINE_FAILED 3u
#define LEGEND_CACHE_NONE 0xffffffffu
#define LEGEND_CACHE_MAX_AHEAD 8
// Entries of a block's miss ring: at least its requesters times `ahead` (checked by the host).
#define LEGEND_CACHE_RING 4096

struct LegendCacheTable {
    u64 lines;          // device address of the line data (slots x line_bytes)
    u64 line_pages;     // bus address of each page of the line data (u64 array)
    u64 tags;           // u64 a slot: line + 1 (0: none)
    u64 state;          // u32 a slot: LEGEND_LINE_*
    u64 pins;           // u32 a slot: requests holding it
    u64 refs;           // u32 a slot: the clock's reference bit
    u64 locks;          // u32 a set
    u64 hands;          // u32 a set
    u64 stats;          // u64 x 4: hits, misses, coalesced, retries
    u64 abort;          // u32: set by a block that stopped; waiters give up
    u64 part_at;        // u64 a partition: namespace byte of its row 0 (LBA aligned)
    u64 rows_per_part;
    u64 lines_per_part;
    u64 rows;
    u64 namespace_bytes;
    u32 line_page_shift;
    u32 line_bytes;
    u32 sets;
    u32 ways;
    u32 row_bytes;      // a multiple of 2
    u32 lba_shift;
    u32 nsid;
    u32 ahead;
    // AGILE's computation-to-communication experiment: each row a thread waits for costs it
    // this many FLOP a byte, done between the issue and the waits (`overlap`: asynchronous) or
    // after the waits (synchronous).
    float flops_per_byte;
    u32 overlap;
};

// `flops_per_byte` FLOP (fused multiply-adds, 2 FLOP each) for each of `bytes` bytes.
__device__ __forceinline__ float legend_cache_work(float x, u64 bytes, float flops_per_byte) {
    u64 n = (u64)(flops_per_byte * (float)bytes * 0.5f);
    for (u64 i = 0; i < n; ++i) x = fmaf(x, 0.9999999f, 1e-7f);
    return x;
}

__device__ __forceinline__ u32 legend_ld_cg_u32(const u32* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned short legend_ld_cg_u16(const unsigned short* p) {
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}

// The line of `row` and the row's place in it.
__device__ __forceinline__ u64 legend_cache_line_of(const LegendCacheTable& c, u64 row,
                                                    u32* in_line) {
    const u64 per_line = c.line_bytes / c.row_bytes;
    const u64 part = row / c.rows_per_part, local = row - part * c.rows_per_part;
    *in_line = (u32)(local % per_line);
    return part * c.lines_per_part + local / per_line;
}

// The clock: from the set's hand, the first way neither pinned nor loading whose reference bit
// is clear, clearing the bits it passes; LEGEND_CACHE_NONE after two turns. Under the set lock.
__device__ u32 legend_cache_victim(const LegendCacheTable& c, u32 set) {
    volatile u32* hands = (volatile u32*)c.hands;
    volatile u32* pins = (volatile u32*)c.pins;
    volatile u32* st = (volatile u32*)c.state;
    volatile u32* refs = (volatile u32*)c.refs;
    u32 hand = hands[set];
    for (u32 k = 0; k < 2 * c.ways; ++k) {
        u32 w = (hand + k) % c.ways;
        u32 s = set * c.ways + w;
        if (pins[s] != 0 || st[s] == LEGEND_LINE_LOADING) continue;
        if (refs[s] != 0 && st[s] == LEGEND_LINE_VALID) {
            refs[s] = 0;
            continue;
        }
        hands[set] = (w + 1) % c.ways;
        return s;
    }
    return LEGEND_CACHE_NONE;
}

// Issues a request for `line`: the slot that holds or will hold it, pinned; LEGEND_CACHE_NONE
// when its set has nothing to evict. A miss goes to the block's miss ring.
__device__ u32 legend_cache_issue(const LegendCacheTable& c, u64 line, volatile u32* ring,
                                  u32* ring_tail) {
    u32 set = (u32)(line % c.sets);
    u32* lock = (u32*)c.locks + set;
    while (atomicCAS(lock, 0u, 1u) != 0u) __nanosleep(64);
    __threadfence();
    volatile u64* tags = (volatile u64*)c.tags;
    volatile u32* st = (volatile u32*)c.state;
    volatile u32* refs = (volatile u32*)c.refs;
    u32 found = LEGEND_CACHE_NONE, kind = 0;  // kind: 0 hit, 1 miss, 2 coalesced
    for (u32 w = 0; w < c.ways; ++w) {
        u32 s = set * c.ways + w;
        u32 v = st[s];
        if (tags[s] == line + 1 && (v == LEGEND_LINE_VALID || v == LEGEND_LINE_LOADING)) {
            found = s;
            kind = v == LEGEND_LINE_VALID ? 0 : 2;
            break;
        }
    }
    if (found == LEGEND_CACHE_NONE) {
        found = legend_cache_victim(c, set);
        if (found != LEGEND_CACHE_NONE) {
            tags[found] = line + 1;
            st[found] = LEGEND_LINE_LOADING;
            kind = 1;
        }
    }
    if (found != LEGEND_CACHE_NONE) {
        atomicAdd((u32*)c.pins + found, 1u);
        refs[found] = 1;
    }
    __threadfence();
    atomicExch(lock, 0u);
    u64* stats = (u64*)c.stats;
    if (found == LEGEND_CACHE_NONE) {
        atomicAdd(&stats[3], 1ull);
        return found;
    }
    atomicAdd(&stats[kind], 1ull);
    if (kind == 1) {
        u32 i = atomicAdd(ring_tail, 1u);
        ring[i % LEGEND_CACHE_RING] = found + 1;
    }
    return found;
}

// Waits for slot `s` to hold its line, copies row `in_line` of it to `out` and unpins it; false
// if the line's read failed or the launch was aborted.
__device__ bool legend_cache_wait(const LegendCacheTable& c, u32 s, u32 in_line,
                                  unsigned char* out) {
    volatile u32* st = (volatile u32*)c.state;
    volatile u32* abort = (volatile u32*)c.abort;
    u32 v;
    while ((v = st[s]) == LEGEND_LINE_LOADING && *abort == 0) __nanosleep(128);
    __threadfence();
    bool ok = v == LEGEND_LINE_VALID;
    if (ok) {
        // L2, not L1: the slot held another line when this multiprocessor last read it.
        const unsigned char* src =
            (const unsigned char*)(c.lines + (u64)s * c.line_bytes + (u64)in_line * c.row_bytes);
        if ((c.row_bytes & 3) == 0) {
            for (u32 i = 0; i < c.row_bytes / 4; ++i)
                ((u32*)out)[i] = legend_ld_cg_u32((const u32*)src + i);
        } else {
            // 16-bit rows of an odd width: rows (and `out`'s) are 2-byte aligned only.
            for (u32 i = 0; i < c.row_bytes / 2; ++i)
                ((unsigned short*)out)[i] = legend_ld_cg_u16((const unsigned short*)src + i);
        }
    }
    atomicSub((u32*)c.pins + s, 1u);
    return ok;
}

// Looks up rows `ids[0..n)` into `out` (n x row_bytes); one block per queue pair, warp 0 its
// I/O warp, the other warps requesters over the block's share of the ids.
extern "C" __global__ void __launch_bounds__(1024) legend_row_cache_lookup(
    LegendIoQueue* queues, LegendIoResult* results, LegendCacheTable c, const u64* ids, u64 n,
    unsigned char* out, u64 timeout_ns) {
    __shared__ unsigned char busy[LEGEND_IO_MAX_DEPTH];
    __shared__ u32 slot_of[LEGEND_IO_MAX_DEPTH];
    __shared__ u32 bytes_of[LEGEND_IO_MAX_DEPTH];
    __shared__ u32 ring[LEGEND_CACHE_RING];
    __shared__ u32 s_ring_tail, s_finished;
    __shared__ LegendIoResult s_result;
    const u32 t = threadIdx.x, lane = t & 31;
    const u32 requesters = blockDim.x - 32;
    LegendIoQueue q = queues[blockIdx.x];
    const u32 depth = q.depth;
    for (u32 i = t; i < depth; i += blockDim.x) busy[i] = 0;
    for (u32 i = t; i < LEGEND_CACHE_RING; i += blockDim.x) ring[i] = 0;
    if (t == 0) {
        s_ring_tail = 0;
        s_finished = 0;
        legend_io_result_start(s_result);
    }
    __syncthreads();
    volatile u32* abort = (volatile u32*)c.abort;
    u64 per = (n + gridDim.x - 1) / gridDim.x;
    u64 first = min((u64)blockIdx.x * per, n), end = min(first + per, n);
    if (t >= 32) {
        // A requester: ids first + r, first + r + R, ..., `ahead` issued before their waits.
        const u32 r = t - 32;
        const u32 ahead = max(1u, min(c.ahead, (u32)LEGEND_CACHE_MAX_AHEAD));
        u32 held[LEGEND_CACHE_MAX_AHEAD], held_in_line[LEGEND_CACHE_MAX_AHEAD];
        u64 held_id[LEGEND_CACHE_MAX_AHEAD];
        u32 k = 0;
        bool failed = false;
        float acc = 1.0f;
        for (u64 i0 = first + r; i0 < end && *abort == 0; i0 += (u64)requesters * ahead) {
            for (u32 a = 0; a < ahead; ++a) {
                u64 i = i0 + (u64)a * requesters;
                if (i >= end) break;
                u32 in_line, s;
                const u64 line = legend_cache_line_of(c, ids[i], &in_line);
                // Doubling pauses: with more requests in flight than the set has ways, retries
                // that came back at once kept its lock busy (the first GPU run: 351 k retries
                // for 40 k lookups, 12 k lookups/s).
                u32 pause = 256;
                while ((s = legend_cache_issue(c, line, ring, &s_ring_tail)) ==
                       LEGEND_CACHE_NONE) {
                    // Its set is full of pinned lines: finish what this thread holds, then
                    // try again (the deadlock-free rule).
                    for (u32 b = 0; b < k; ++b)
                        failed |= !legend_cache_wait(c, held[b], held_in_line[b],
                                                     out + held_id[b] * c.row_bytes);
                    k = 0;
                    if (*abort != 0) break;
                    __nanosleep(pause);
                    pause = min(2 * pause, 65536u);
                }
                if (s == LEGEND_CACHE_NONE) break;
                held[k] = s;
                held_in_line[k] = in_line;
                held_id[k] = i;
                ++k;
            }
            // Issued now, waited for later: a caller's computation goes between.
            u64 work = (u64)k * c.row_bytes;
            if (c.overlap) acc = legend_cache_work(acc, work, c.flops_per_byte);
            for (u32 b = 0; b < k; ++b)
                failed |= !legend_cache_wait(c, held[b], held_in_line[b],
                                             out + held_id[b] * c.row_bytes);
            if (!c.overlap) acc = legend_cache_work(acc, work, c.flops_per_byte);
            k = 0;
        }
        // Keeps the computation (never true).
        if (acc == -1.0f) atomicAdd((u64*)c.stats + 3, 0ull);
        if (failed && *abort == 0) atomicCAS(&s_result.kind, 0u, 1u);
        __threadfence_block();
        atomicAdd(&s_finished, 1u);
        return;
    }
    // The I/O warp.
    u32 tail = q.sq_tail, head = q.cq_head, phase = q.phase, in_flight = 0, ring_head = 0;
    u64 completed = 0, progress = legend_io_now();
    bool timed_out = false;
    const u64 lba_mask = (1ull << c.lba_shift) - 1;
    while (true) {
        // Submit: the leading run of published misses with a free SQ slot each.
        u32 room = depth - 1 - in_flight;
        u32 want = min(32u, room);
        u32 entry = 0;
        bool ready = false;
        if (lane < want) {
            entry = ((volatile u32*)ring)[(ring_head + lane) % LEGEND_CACHE_RING];
            ready = entry != 0 && !busy[(tail + lane) % depth];
        }
        u32 mask = __ballot_sync(0xffffffffu, ready);
        u32 sub = mask == 0xffffffffu ? 32 : __ffs(~mask) - 1;
        if (lane < sub) {
            ((volatile u32*)ring)[(ring_head + lane) % LEGEND_CACHE_RING] = 0;
            u32 s = entry - 1, cid = (tail + lane) % depth;
            u64 line = ((volatile u64*)c.tags)[s] - 1;
            u64 part = line / c.lines_per_part;
            u64 start = (line - part * c.lines_per_part) * c.line_bytes;
            u64 part_rows = min(c.rows_per_part, c.rows - part * c.rows_per_part);
            // The partition's last line reads the whole LBAs that hold its rows.
            u64 bytes = min((u64)c.line_bytes, part_rows * c.row_bytes - start);
            bytes = (bytes + lba_mask) & ~lba_mask;
            u64 ns = ((const u64*)c.part_at)[part] + start;
            bytes = min(bytes, c.namespace_bytes - ns);
            u64* list = (u64*)(q.lists + (u64)cid * LEGEND_IO_PAGE);
            u64 list_bus = q.lists_bus + (u64)cid * LEGEND_IO_PAGE;
            u64 prp1, prp2;
            bool staged = q.staging != 0 && bytes <= q.staging_bytes;
            if (staged)
                legend_io_prps((const u64*)q.staging_pages, q.staging_page_shift,
                               q.staging_first + (u64)cid * q.staging_bytes, bytes, list,
                               list_bus, &prp1, &prp2);
            else
                legend_io_prps((const u64*)c.line_pages, c.line_page_shift,
                               (u64)s * c.line_bytes, bytes, list, list_bus, &prp1, &prp2);
            LegendSqe sqe = legend_io_rw(2, c.nsid, ns >> c.lba_shift,
                                         (u32)(bytes >> c.lba_shift), prp1, prp2, cid);
            legend_io_store_sqe(q.sq, cid, sqe);
            busy[cid] = 1;
            slot_of[cid] = s;
            bytes_of[cid] = staged ? (u32)bytes : 0;
        }
        __threadfence_system();
        __syncwarp();
        if (sub > 0) {
            tail = (tail + sub) % depth;
            in_flight += sub;
            ring_head += sub;
            if (lane == 0) *(volatile u32*)q.sq_doorbell = tail;
        }
        // Complete: the leading run of posted entries from the head.
        u32 look = min(32u, in_flight);
        bool posted = false;
        u32 at = head + lane, cslot = at % depth;
        if (lane < look) {
            uint4 e = legend_io_load_cqe(q.cq, cslot);
            posted = ((e.w >> 16) & 1u) == (phase ^ (at >= depth ? 1u : 0u));
        }
        mask = __ballot_sync(0xffffffffu, posted);
        u32 m = mask == 0xffffffffu ? 32 : __ffs(~mask) - 1;
        u32 cid = LEGEND_CACHE_NONE, status = 0;
        if (lane < m) {
            __threadfence_system();
            uint4 e = legend_io_load_cqe(q.cq, cslot);
            cid = e.w & 0xffffu;
            status = (e.w >> 17) & 0x7fffu;
            bool stray = cid >= depth || !busy[cid];
            legend_io_note_completion(s_result, q.sq, e, stray, cid, status);
            if (stray) cid = LEGEND_CACHE_NONE;
        }
        // Staged lines into their slots, the whole warp on each in turn.
        for (u32 i = 0; i < m; ++i) {
            u32 ci = __shfl_sync(0xffffffffu, cid, i);
            u32 si = __shfl_sync(0xffffffffu, status, i);
            if (ci == LEGEND_CACHE_NONE || (si & 0x7ffu) != 0 || bytes_of[ci] == 0) continue;
            u64 src = q.staging + (u64)ci * q.staging_bytes;
            u64 dst = c.lines + (u64)slot_of[ci] * c.line_bytes;
            u32 bytes = bytes_of[ci];
            for (u32 o = lane * 64; o < bytes; o += 32 * 64) {
                uint4 v[4];
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (o + 16 * k < bytes) v[k] = legend_io_ld16_cv(src + o + 16 * k);
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (o + 16 * k < bytes) legend_io_put16(dst + o + 16 * k, v[k]);
            }
        }
        // The line's bytes before its state.
        __threadfence();
        __syncwarp();
        if (cid != LEGEND_CACHE_NONE) {
            ((volatile u32*)c.state)[slot_of[cid]] =
                (status & 0x7ffu) == 0 ? LEGEND_LINE_VALID : LEGEND_LINE_FAILED;
            busy[cid] = 0;
        }
        __syncwarp();
        u64 now = legend_io_now();
        if (m > 0) {
            legend_io_consume(head, phase, in_flight, completed, progress, m, depth, now);
            if (lane == 0) *(volatile u32*)q.cq_doorbell = head;
        }
        if (in_flight > 0 && now - progress > timeout_ns) {
            timed_out = true;
            if (lane == 0) *abort = 1;
            break;
        }
        u32 finished = ((volatile u32*)&s_finished)[0];
        if (finished == requesters && in_flight == 0) break;
        if (sub == 0 && m == 0) __nanosleep(500);
    }
    if (lane == 0) {
        if (timed_out) s_result.kind = 2;
        s_result.sq_tail = tail;
        s_result.cq_head = head;
        s_result.phase = phase;
        s_result.in_flight = in_flight;
        s_result.completed = completed;
        queues[blockIdx.x].sq_tail = tail;
        queues[blockIdx.x].cq_head = head;
        queues[blockIdx.x].phase = phase;
    }
    // The requesters' reports (a failed row) are in by the time they all finished; after a
    // timeout some may still run, and the host treats the queues as broken anyway.
    __syncwarp();
    if (lane == 0) results[blockIdx.x] = s_result;
}
