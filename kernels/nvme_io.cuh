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
//
// By kernel role: this file holds what the kernels share (the queue, job and command layouts,
// the command builder, the ring accesses); nvme_io.cu the transfer kernel and the builder's
// test vectors; row_cache.cu the row cache's lookups through the same queues. legend-cuda's
// nvrtc.rs compiles them as one program, in that order.

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
