// The GPU I/O queues' transfer kernel and the command builder's test vectors (nvme_io.cuh
// describes the protocol).

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
