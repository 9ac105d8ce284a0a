// GPU-initiated NVMe I/O: thread blocks build NVMe commands, write them into their queue
// pair's submission queue, ring the doorbell and poll completions, so a partition swap needs no
// CPU on its data path (the paper's Section 5, "Legend's batched protocol").
//
// One queue pair per thread block; the queue pairs of a launch may belong to several
// controllers (a striped store's members), each block serving the commands of its own
// controller's jobs (`ranges`). In each round thread i writes the SQE of its command at slot
// tail + i (no atomics), the block fences (system scope: the controller reads the SQ over
// PCIe) and one thread rings the SQ doorbell once for the whole batch; one thread then polls the
// CQ slot at the head by phase tag, and once it is posted thread i looks at slot head + i, the
// leading run of posted completions is consumed and one thread moves the CQ head and rings its
// doorbell once. A new batch is submitted while the previous one completes, so two batches are
// in flight.
//
// Beside training (the I/O kernels share the GPU with the step): a block that moved nothing
// sleeps, longer each idle round up to LEGEND_IO_MAX_PAUSE_NS; it fences only after writing
// entries, and polls one CQ entry, not one a command in flight, until the head's is posted
// (for rings in host memory each poll is a read across PCIe).
//
// Small commands can go through staging slots in pinned host memory the GPU maps (the proxy
// controller: it reaches host memory with a memcpy, but GPU memory only with one CUDA copy a
// command, which caps small random reads at ~80 k commands/s whatever the queue depth). A
// queue's slot i stages the command with id i: a Write's data is copied in before submission,
// a Read's is copied out by the whole block after its completion, before the slot (and its id)
// can be reused, so a staging slot has one owner at a time without any bookkeeping.
//
// Beyond the paper: the command id is the SQ slot, and a slot is reused only once the command
// written there completed (completions come in any order), so an id is never in flight twice;
// every completion's status is checked, and a failure stops the block's submissions and is
// reported with the command's LBA, block count and decoded status; a block that sees no
// completion for `timeout_ns` stops and reports its queue's state instead of hanging (the
// host then deletes the queue pair, which waits for or aborts what it still holds).
//
// The layouts and the Read/Write builder mirror legend-nvme-protocol (Rust); the test vectors
// in kernels/testdata/sqe_vectors.txt pin both to the same bytes.

typedef unsigned int u32;
typedef unsigned long long u64;

// Deepest queue a block drives (its in-flight bookkeeping lives in shared memory); the same
// limit as legend-nvme-protocol's MAX_DEPTH.
#define LEGEND_IO_MAX_DEPTH 1024
// NVMe memory page (CC.MPS = 0).
#define LEGEND_IO_PAGE 4096ULL
// The shortest and longest pause of an idle block between two polls (it doubles while nothing
// moves): a completion is microseconds away at best, and a 1 MiB command at an SSD's rate
// hundreds of them.
#define LEGEND_IO_MIN_PAUSE_NS 500u
#define LEGEND_IO_MAX_PAUSE_NS 8000u

// One queue pair, driven by one block. The ring state is carried from launch to launch: the
// block reads it at the start and writes it back at the end.
struct LegendIoQueue {
    u64 sq;           // SQ, 64-byte entries (device-visible address)
    u64 cq;           // CQ, 16-byte entries
    u64 sq_doorbell;  // 32-bit SQ tail doorbell
    u64 cq_doorbell;  // 32-bit CQ head doorbell
    u64 lists;        // `depth` PRP list pages of 4 KiB, one per slot
    u64 lists_bus;    // the same pages, as the controller addresses them
    u32 depth;
    u32 qid;
    u32 sq_tail;
    u32 cq_head;
    u32 phase;
    u32 pad;
    u64 staging;        // device address of the queue's staging slots (0: none)
    u64 staging_pages;  // bus address of each page of the staging memory (u64 array)
    u64 staging_first;  // byte of the staging memory (as `staging_pages` counts) slot 0 starts at
    u32 staging_bytes;  // bytes of a slot: commands of at most this many bytes are staged
    u32 staging_page_shift;  // log2 of the staging memory's page size
};

// One transfer between a buffer and consecutive LBAs, cut into commands of `command_bytes`.
struct LegendIoJob {
    u64 pages;          // bus address of each page of the buffer (u64 array)
    u64 offset;         // byte of the buffer the transfer starts at
    u64 bytes;          // bytes to move (a multiple of the LBA size)
    u64 lba;            // first LBA
    u64 command_bytes;  // bytes a command moves (the last one fewer)
    u64 first_command;  // index of its first command among the launch's commands
    u64 device;         // device address of the buffer's byte 0 (staged commands copy there)
    u32 page_shift;     // log2 of the buffer's page size (16: GPU mappings, 12: host memory)
    u32 opcode;         // 1 write, 2 read
    u32 nsid;
    u32 lba_shift;
};

// What a block reports.
struct LegendIoResult {
    u32 kind;       // 0 done, 1 a command failed, 2 timeout, 3 a completion for no command
    u32 status;     // the failed command's status field (SCT << 8 | SC, DNR, More)
    u64 lba;        // the failed command's LBA
    u32 opcode;
    u32 blocks;
    u32 sq_tail;    // the queue when the block stopped
    u32 cq_head;
    u32 phase;
    u32 in_flight;
    u32 last_cqe[4];
    u64 completed;  // commands completed
};

// The 64-byte submission queue entry (legend-nvme-protocol's `Sqe`).
struct LegendSqe {
    u32 cdw0, nsid, cdw2, cdw3;
    u64 mptr, prp1, prp2;
    u32 cdw[6];
};

// A block's result before its first command.
__device__ __forceinline__ void legend_io_result_start(LegendIoResult& r) {
    r.kind = 0;
    r.status = 0;
    r.lba = 0;
    r.opcode = 0;
    r.blocks = 0;
    r.completed = 0;
}

// Keeps completion entry `e` in the result (the stray one, or the last seen on a timeout).
__device__ __forceinline__ void legend_io_keep_cqe(LegendIoResult& r, uint4 e) {
    r.last_cqe[0] = e.x;
    r.last_cqe[1] = e.y;
    r.last_cqe[2] = e.z;
    r.last_cqe[3] = e.w;
}

// Notes a completion in the block's result, the first failure only: an entry naming no
// command in flight (`stray`: kind 3, the entry kept), or a command that failed (kind 1: its
// status, and its opcode, LBA and blocks from its SQE in `sq`).
__device__ __forceinline__ void legend_io_note_completion(LegendIoResult& r, u64 sq, uint4 e,
                                                          bool stray, u32 cid, u32 status) {
    if (stray) {
        if (atomicCAS(&r.kind, 0u, 3u) == 0u) legend_io_keep_cqe(r, e);
    } else if ((status & 0x7ffu) != 0 && atomicCAS(&r.kind, 0u, 1u) == 0u) {
        volatile LegendSqe* sqe = (volatile LegendSqe*)(sq + (u64)cid * 64);
        r.status = status;
        r.opcode = sqe->cdw0 & 0xffu;
        r.lba = (u64)sqe->cdw[0] | ((u64)sqe->cdw[1] << 32);
        r.blocks = (sqe->cdw[2] & 0xffffu) + 1;
    }
}

// Consumes `m` completions of a queue of `depth` entries: the CQ head moves on (the phase
// flips when it wraps), the commands leave `in_flight`, and `progress` is now. The caller
// rings the CQ doorbell with the new head.
__device__ __forceinline__ void legend_io_consume(u32& head, u32& phase, u32& in_flight,
                                                  u64& completed, u64& progress, u32 m,
                                                  u32 depth, u64 now) {
    u32 h = head + m;
    if (h >= depth) phase ^= 1u;
    head = h % depth;
    in_flight -= m;
    completed += m;
    progress = now;
}

// Bus address of byte `at` of a buffer whose `1 << page_shift`-byte pages are at `pages`.
__device__ __forceinline__ u64 legend_io_bus(const u64* pages, u32 page_shift, u64 at) {
    return pages[at >> page_shift] + (at & ((1ULL << page_shift) - 1));
}

// The PRP entries of a transfer of `len` bytes starting at byte `at` of the buffer; entries
// beyond PRP2 go to the list page `list` (the controller's address `list_bus`), as
// legend-nvme-protocol's `prp::build` does.
__device__ __forceinline__ void legend_io_prps(const u64* pages, u32 page_shift, u64 at,
                                               u64 len, u64* list, u64 list_bus, u64* prp1,
                                               u64* prp2) {
    u64 first = at & ~(LEGEND_IO_PAGE - 1);
    u64 n = (at - first + len + LEGEND_IO_PAGE - 1) / LEGEND_IO_PAGE;
    *prp1 = legend_io_bus(pages, page_shift, at);
    if (n == 1) {
        *prp2 = 0;
    } else if (n == 2) {
        *prp2 = legend_io_bus(pages, page_shift, first + LEGEND_IO_PAGE);
    } else {
        for (u64 k = 1; k < n; ++k) {
            list[k - 1] = legend_io_bus(pages, page_shift, first + k * LEGEND_IO_PAGE);
        }
        *prp2 = list_bus;
    }
}

// A Read (2) or Write (1) of `blocks` blocks at `lba` (legend-nvme-protocol's
// `Sqe::read_write`), with command id `cid`.
__device__ __forceinline__ LegendSqe legend_io_rw(u32 opcode, u32 nsid, u64 lba, u32 blocks,
                                                  u64 prp1, u64 prp2, u32 cid) {
    LegendSqe s;
    s.cdw0 = opcode | (cid << 16);
    s.nsid = nsid;
    s.cdw2 = 0;
    s.cdw3 = 0;
    s.mptr = 0;
    s.prp1 = prp1;
    s.prp2 = prp2;
    s.cdw[0] = (u32)lba;
    s.cdw[1] = (u32)(lba >> 32);
    s.cdw[2] = blocks - 1;
    s.cdw[3] = 0;
    s.cdw[4] = 0;
    s.cdw[5] = 0;
    return s;
}

// Where a staged command's data is in GPU memory, and how many bytes (0: not staged).
struct LegendIoStage {
    u64 device;
    u32 bytes;
};

// The SQE of command `g` of the launch (its job found by `first_command`, which increases with
// the job), for slot `slot`. A command that fits the queue's staging slot names that slot in
// its PRPs, and `stage` says where its data is in GPU memory.
__device__ __forceinline__ LegendSqe legend_io_command(const LegendIoJob* jobs, u32 njobs, u64 g,
                                                       const LegendIoQueue& q, u32 slot,
                                                       LegendIoStage* stage) {
    u32 lo = 0, hi = njobs;
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (jobs[mid].first_command <= g) lo = mid; else hi = mid;
    }
    u32 j = lo;
    const LegendIoJob& job = jobs[j];
    u64 done = (g - job.first_command) * job.command_bytes;
    u64 len = min(job.command_bytes, job.bytes - done);
    u64* list = (u64*)(q.lists + (u64)slot * LEGEND_IO_PAGE);
    u64 list_bus = q.lists_bus + (u64)slot * LEGEND_IO_PAGE;
    u64 prp1, prp2;
    stage->device = job.device + job.offset + done;
    stage->bytes = 0;
    if (q.staging != 0 && len <= q.staging_bytes) {
        stage->bytes = (u32)len;
        legend_io_prps((const u64*)q.staging_pages, q.staging_page_shift,
                       q.staging_first + (u64)slot * q.staging_bytes, len, list, list_bus, &prp1,
                       &prp2);
    } else {
        legend_io_prps((const u64*)job.pages, job.page_shift, job.offset + done, len, list,
                       list_bus, &prp1, &prp2);
    }
    return legend_io_rw(job.opcode, job.nsid, job.lba + (done >> job.lba_shift),
                        (u32)(len >> job.lba_shift), prp1, prp2, slot);
}

__device__ __forceinline__ u64 legend_io_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// 16-byte volatile accesses (generic addresses: the rings may be GPU or host memory).
__device__ __forceinline__ void legend_io_st16(u64 p, uint4 v) {
    asm volatile("st.volatile.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ uint4 legend_io_ld16(u64 p) {
    uint4 v;
    asm volatile("ld.volatile.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// Staging memory is written by the controller between two reads of the same address: loads
// of it must not be served from a cache (.cv: fetch again).
__device__ __forceinline__ uint4 legend_io_ld16_cv(u64 p) {
    uint4 v;
    asm volatile("ld.global.cv.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// 16 bytes to `p`, which may be only 4-byte aligned (a job's offset is a multiple of 4).
__device__ __forceinline__ void legend_io_put16(u64 p, uint4 v) {
    if ((p & 15) == 0) {
        *(uint4*)p = v;
    } else {
        u32* w = (u32*)p;
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    }
}

__device__ __forceinline__ uint4 legend_io_get16(u64 p) {
    if ((p & 15) == 0) return *(const uint4*)p;
    const u32* w = (const u32*)p;
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// One thread copies a staged Write's `bytes` (a multiple of 16: of the LBA size) from GPU
// memory into its staging slot, with independent loads in flight.
__device__ __forceinline__ void legend_io_stage_write(u64 staging, u64 device, u32 bytes) {
    for (u32 at = 0; at < bytes; at += 4 * 16) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (at + 16 * k < bytes) v[k] = legend_io_get16(device + at + 16 * k);
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (at + 16 * k < bytes) legend_io_st16(staging + at + 16 * k, v[k]);
    }
}

__device__ __forceinline__ void legend_io_store_sqe(u64 sq, u32 slot, const LegendSqe& s) {
    const uint4* src = (const uint4*)&s;
#pragma unroll
    for (int i = 0; i < 4; ++i) legend_io_st16(sq + (u64)slot * 64 + 16 * i, src[i]);
}

__device__ __forceinline__ uint4 legend_io_load_cqe(u64 cq, u32 slot) {
    return legend_io_ld16(cq + (u64)slot * 16);
}

// The commands [ranges[2b], ranges[2b + 1]) of the launch (numbered job after job, each
// job's `first_command` on) go through queue pair `queues[b]`, b = blockIdx.x; they must be
// commands of jobs of that queue's controller. `latencies`, if not null, receives each
// command's submission-to-completion time in nanoseconds.
// At most 511 threads: a queue holds two batches and a free slot (LEGEND_IO_MAX_DEPTH).
extern "C" __global__ void __launch_bounds__(512) legend_nvme_io(LegendIoQueue* queues, const LegendIoJob* jobs,
                                          u32 njobs, const u64* ranges, LegendIoResult* results,
                                          u64 timeout_ns, u64* latencies) {
    __shared__ unsigned char busy[LEGEND_IO_MAX_DEPTH];
    __shared__ u64 command_of[LEGEND_IO_MAX_DEPTH];
    __shared__ u64 started[LEGEND_IO_MAX_DEPTH];
    // A staged Read's destination and bytes, by slot; the slots a round's copy moves, by the
    // completion's place in the round (NO_COPY: nothing to copy).
    __shared__ u64 stage_device[LEGEND_IO_MAX_DEPTH];
    __shared__ u32 stage_bytes[LEGEND_IO_MAX_DEPTH];
    __shared__ u32 copy_slot[LEGEND_IO_MAX_DEPTH];
    const u32 NO_COPY = 0xffffffffu;
    __shared__ u32 s_tail, s_head, s_phase, s_in_flight, s_first_stop, s_look, s_stop;
    __shared__ u64 s_next, s_end, s_completed, s_progress;
    __shared__ LegendIoResult s_result;

    const u32 t = threadIdx.x, T = blockDim.x;
    LegendIoQueue q = queues[blockIdx.x];
    const u32 depth = q.depth;
    for (u32 i = t; i < depth; i += T) busy[i] = 0;
    if (t == 0) {
        s_next = ranges[2 * blockIdx.x];
        s_end = ranges[2 * blockIdx.x + 1];
        s_tail = q.sq_tail;
        s_head = q.cq_head;
        s_phase = q.phase;
        s_in_flight = 0;
        s_completed = 0;
        s_stop = 0;
        s_progress = legend_io_now();
        legend_io_result_start(s_result);
    }
    __syncthreads();
    u32 pause = LEGEND_IO_MIN_PAUSE_NS;
    while (true) {
        // Submit: up to T commands into the slots from the tail whose last command completed.
        u64 left = s_stop ? 0 : s_end - s_next;
        u32 n = (u32)min((u64)min(T, depth - 1 - s_in_flight), left);
        if (t == 0) s_first_stop = n;
        __syncthreads();
        u32 slot = (s_tail + t) % depth;
        if (t < n && busy[slot]) atomicMin(&s_first_stop, t);
        __syncthreads();
        n = s_first_stop;
        if (t < n) {
            u64 g = s_next + t;
            LegendIoStage stage;
            LegendSqe sqe = legend_io_command(jobs, njobs, g, q, slot, &stage);
            bool read = (sqe.cdw0 & 0xffu) == 2;
            if (stage.bytes != 0 && !read)
                legend_io_stage_write(q.staging + (u64)slot * q.staging_bytes, stage.device,
                                      stage.bytes);
            stage_device[slot] = stage.device;
            stage_bytes[slot] = read ? stage.bytes : 0;
            legend_io_store_sqe(q.sq, slot, sqe);
            busy[slot] = 1;
            command_of[slot] = g;
            started[slot] = legend_io_now();
        }
        // The entries (and PRP lists) must reach the controller before the doorbell does.
        if (n > 0) __threadfence_system();
        __syncthreads();
        if (t == 0 && n > 0) {
            s_tail = (s_tail + n) % depth;
            s_in_flight += n;
            s_next += n;
            *(volatile u32*)q.sq_doorbell = s_tail;
        }
        __syncthreads();

        // Complete: the leading run of posted entries from the head, up to T of them; none
        // while the head's entry is not posted, which one thread polls.
        u32 look = min(T, s_in_flight);
        u32 at = s_head + t;
        u32 cslot = at % depth;
        u32 want = s_phase ^ (at >= depth ? 1u : 0u);
        if (t == 0) {
            bool posted = look > 0 && ((legend_io_load_cqe(q.cq, cslot).w >> 16) & 1u) == want;
            s_look = posted ? look : 0;
            s_first_stop = s_look;
        }
        __syncthreads();
        look = s_look;
        if (t < look) {
            uint4 e = legend_io_load_cqe(q.cq, cslot);
            if (((e.w >> 16) & 1u) != want) atomicMin(&s_first_stop, t);
        }
        __syncthreads();
        u32 m = s_first_stop;
        u32 my_slot = NO_COPY;
        if (t < m) {
            // Re-read behind a fence: the phase tag may have been seen before the rest.
            __threadfence_system();
            uint4 e = legend_io_load_cqe(q.cq, cslot);
            u32 cid = e.w & 0xffffu;
            u32 status = (e.w >> 17) & 0x7fffu;
            bool stray = cid >= depth || !busy[cid];
            legend_io_note_completion(s_result, q.sq, e, stray, cid, status);
            if (!stray) {
                my_slot = cid;
                // A failed Read's slot holds nothing to copy.
                if ((status & 0x7ffu) != 0) stage_bytes[cid] = 0;
            }
            copy_slot[t] = my_slot != NO_COPY && stage_bytes[my_slot] != 0 ? my_slot : NO_COPY;
        }
        __syncthreads();
        if (q.staging != 0 && m > 0) {
            // The round's staged Reads, copied out of their slots by the whole block: chunk c
            // is 16 bytes of the (c / per)-th completion, eight independent loads a thread in
            // flight (each crosses the bus to host memory).
            const u32 per = q.staging_bytes / 16;
            const u64 chunks = (u64)m * per;
            for (u64 c0 = t; c0 < chunks; c0 += 8ull * T) {
                uint4 v[8];
                u64 to[8];
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    to[k] = 0;
                    u64 c = c0 + (u64)k * T;
                    if (c >= chunks) continue;
                    u32 s = copy_slot[c / per];
                    u32 at = (u32)(c % per) * 16;
                    if (s == NO_COPY || at >= stage_bytes[s]) continue;
                    v[k] = legend_io_ld16_cv(q.staging + (u64)s * q.staging_bytes + at);
                    to[k] = stage_device[s] + at;
                }
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (to[k] != 0) legend_io_put16(to[k], v[k]);
            }
            __syncthreads();
        }
        if (my_slot != NO_COPY) {
            // The latency includes the copy out of staging: the data is where it was asked for.
            if (latencies) latencies[command_of[my_slot]] = legend_io_now() - started[my_slot];
            busy[my_slot] = 0;
        }
        __syncthreads();
        if (t == 0) {
            u64 now = legend_io_now();
            if (m > 0) {
                legend_io_consume(s_head, s_phase, s_in_flight, s_completed, s_progress, m,
                                  depth, now);
                *(volatile u32*)q.cq_doorbell = s_head;
            }
            // A failure stops further submissions; what is in flight still completes.
            if (s_result.kind != 0) s_stop = 1;
            if (s_in_flight > 0 && now - s_progress > timeout_ns) {
                s_result.kind = 2;
                s_stop = 2;
            }
        }
        __syncthreads();
        if (s_stop == 2 || (s_in_flight == 0 && (s_stop || s_next == s_end))) break;
        // Nothing moved: let the training kernels sharing this multiprocessor have its issue
        // slots for a while, longer each idle round (n and m are the same on every thread).
        if (n == 0 && m == 0) {
            __nanosleep(pause);
            pause = min(2 * pause, LEGEND_IO_MAX_PAUSE_NS);
        } else {
            pause = LEGEND_IO_MIN_PAUSE_NS;
        }
    }
    if (t == 0) {
        s_result.sq_tail = s_tail;
        s_result.cq_head = s_head;
        s_result.phase = s_phase;
        s_result.in_flight = s_in_flight;
        s_result.completed = s_completed;
        if (s_result.kind == 2)
            legend_io_keep_cqe(s_result, legend_io_load_cqe(q.cq, (s_head + depth - 1) % depth));
        results[blockIdx.x] = s_result;
        queues[blockIdx.x].sq_tail = s_tail;
        queues[blockIdx.x].cq_head = s_head;
        queues[blockIdx.x].phase = s_phase;
    }
}

// One test vector of the command builder: the inputs of a Read/Write over a buffer.
struct LegendSqeVector {
    u64 pages;  // the buffer's page table (u64 array)
    u64 offset;
    u64 lba;
    u64 list_bus;
    u32 page_shift;
    u32 opcode;
    u32 nsid;
    u32 blocks;
    u32 lba_shift;
    u32 cid;
};

// Builds vector i's SQE into `out[16 i ..]` and its PRP list into `lists[512 i ..]`, with the
// I/O kernel's own functions, for comparison with legend-nvme-protocol's bytes.
extern "C" __global__ void legend_nvme_sqe_vectors(const LegendSqeVector* v, u32 n, u32* out,
                                                   u64* lists) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const LegendSqeVector& x = v[i];
    u64 len = (u64)x.blocks << x.lba_shift;
    u64 prp1, prp2;
    legend_io_prps((const u64*)x.pages, x.page_shift, x.offset, len, lists + 512ULL * i,
                   x.list_bus, &prp1, &prp2);
    LegendSqe s = legend_io_rw(x.opcode, x.nsid, x.lba, x.blocks, prp1, prp2, x.cid);
    const u32* w = (const u32*)&s;
    for (int k = 0; k < 16; ++k) out[16 * i + k] = w[k];
}

// ---------------------------------------------------------------------------------------------
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
