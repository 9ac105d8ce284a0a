// The fused kernels' PTX: mma.sync and ldmatrix (sm_80), Hopper's wgmma, mbarriers, bulk
// copies, register budgets and named barriers (sm_90a), and the operand tiles' copies and
// products built on them.

__device__ __forceinline__ void legend_mma_f16(float* c, const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix: four (or two) 8 x 8 FP16 matrices, lane 8i + r giving the address of row r of
// matrix i; `trans` hands each lane a column pair instead of a row pair. Volatile: the
// shared memory they read changes across the barriers of the tile loop.
__device__ __forceinline__ void legend_ldsm4(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void legend_ldsm4_trans(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void legend_ldsm2_trans(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr));
}

// Hopper's warpgroup products (wgmma, sm_90a): four warps multiply a 64-row A by B, reading
// B (and A, unless it comes from registers) from shared memory by descriptor, without the
// ldmatrix traffic through registers that bounds the mma.sync version. Operands lie in
// 8 x 8 FP16 core matrices of 128 contiguous bytes (LegendHalfRows). The accumulators are
// mma.sync's: warp w of the group holds rows 16w.., as m16n8 fragments by 8-column block.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LEGEND_WGMMA 1
#define LEGEND_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])

// A no-swizzle operand descriptor (PTX ISA, "matrix descriptor"): the start address and the
// byte offsets from a core matrix to the next along K (`lead`) and along M or N (`stride`),
// each in 16-byte units.
__device__ __forceinline__ u64 legend_wgmma_desc(u32 addr, u32 lead, u32 stride) {
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(stride >> 4) << 32);
}

// Pins accumulators d at this point of the program (an empty asm that claims to change
// them): no write of them moves below it, no read above it.
template <int N>
__device__ __forceinline__ void legend_wgmma_pin(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Orders the warpgroup's register writes before the products that follow. The accumulators'
// last writes are pinned ahead of it: the compiler would otherwise sink, say, their zeroing
// to the product that first uses them, and ptxas would serialise the products around it.
template <int N>
__device__ __forceinline__ void legend_wgmma_fence(float* d) {
    legend_wgmma_pin<N>(d);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void legend_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most PENDING of the warpgroup's product groups are still running (the
// latest ones: groups complete in order); the accumulators d of the groups before are ready
// after it (pinned, so that the compiler does not read them earlier).
template <int N, int PENDING = 0>
__device__ __forceinline__ void legend_wgmma_wait(float* d) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
    legend_wgmma_pin<N>(d);
}

// d (64 x 128) = A · Bᵀ, plus d where `add` is non-zero; both K-major in shared memory.
__device__ __forceinline__ void legend_wgmma_ss_n128(float* d, u64 a, u64 b, u32 add) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.u32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : LEGEND_F4(d, 0), LEGEND_F4(d, 4), LEGEND_F4(d, 8), LEGEND_F4(d, 12), LEGEND_F4(d, 16), LEGEND_F4(d, 20), LEGEND_F4(d, 24), LEGEND_F4(d, 28),
          LEGEND_F4(d, 32), LEGEND_F4(d, 36), LEGEND_F4(d, 40), LEGEND_F4(d, 44), LEGEND_F4(d, 48), LEGEND_F4(d, 52), LEGEND_F4(d, 56), LEGEND_F4(d, 60)
        : "l"(a), "l"(b), "r"(add));
}

// d (64 x 8) += A · B, A from registers (mma.sync's A fragments), B N-major in shared memory.
__device__ __forceinline__ void legend_wgmma_rs_n8(float* d, const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 1;\n}\n"
        : LEGEND_F4(d, 0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 32) += A · B, A from registers (mma.sync's A fragments), B N-major in shared memory.
__device__ __forceinline__ void legend_wgmma_rs_n32(float* d, const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n"
        : LEGEND_F4(d, 0), LEGEND_F4(d, 4), LEGEND_F4(d, 8), LEGEND_F4(d, 12)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 64) += A · B, A from registers (mma.sync's A fragments), B N-major in shared memory.
__device__ __forceinline__ void legend_wgmma_rs_n64(float* d, const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : LEGEND_F4(d, 0), LEGEND_F4(d, 4), LEGEND_F4(d, 8), LEGEND_F4(d, 12), LEGEND_F4(d, 16), LEGEND_F4(d, 20), LEGEND_F4(d, 24), LEGEND_F4(d, 28)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// A u32 pinned like the accumulators (the A fragments of the register products: their
// conversions must not sink below the fence that orders them before the products).
template <int N>
__device__ __forceinline__ void legend_wgmma_pin_u32(u32* a) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// mbarriers in shared memory (addresses from __cvta_generic_to_shared) and the bulk copy
// engine, for the warp-specialised kernels.
__device__ __forceinline__ void legend_mbar_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

__device__ __forceinline__ void legend_mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar)
                 : "memory");
}

// Arrives and adds `bytes` to the transfers the barrier's phase waits for.
__device__ __forceinline__ void legend_mbar_expect(u32 bar, u32 bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(
                     bar),
                 "r"(bytes)
                 : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void legend_mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// `bytes` (a multiple of 16, 16-byte aligned both ends) from device memory into shared
// memory by the bulk copy engine, completing on the barrier `bar`.
__device__ __forceinline__ void legend_bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// Register budgets of the warp-specialised kernels' warpgroups (the kernel starts at its
// launch bound's share; the producer gives registers back, the consumers take them).
template <int N>
__device__ __forceinline__ void legend_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void legend_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// Arrives at named barrier `id` of `threads` threads without waiting.
__device__ __forceinline__ void legend_bar_arrive(u32 id, u32 threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Waits until the `threads` threads of named barrier `id` have arrived (a warpgroup's
// own barrier; 0 is __syncthreads').
__device__ __forceinline__ void legend_bar_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
#endif


// Queues the copy of a 64-row tile of a tiled FP16 matrix (contiguous, from `src`) into
// shared memory at `dst`, by all threads of the block; rows from `rlim` on become zeros.
template <int KS>
__device__ __forceinline__ void legend_fused_tile(const u32* src, u32 rlim, u32* dst) {
    // 16-byte pieces: eight rows' chunk c, then chunk c + 1 (LegendHalfRows).
    constexpr int PIECES = LEGEND_FUSED_TILE * 2 * KS;
    for (int e = threadIdx.x; e < PIECES; e += 32 * LEGEND_FUSED_WARPS) {
        u32 row = e / (16 * KS) * 8 + e % 8;
        bool ok = row < rlim;
        legend_cp16(reinterpret_cast<float*>(dst + 4 * e),
                    reinterpret_cast<const float*>(ok ? src + 4 * e : src), ok ? 16 : 0);
    }
}

// acc += G (A fragments ga of JJ k16 steps) · (the walked tile, JJ·16 rows of KS k16 steps
// at shared-memory address sb), whose rows come as B through transposing loads (or, with
// wgmma, as an N-major operand). With wgmma, the products are issued and committed here,
// and waited for by the caller.
template <int DK, int KS, int JJ>
__device__ __forceinline__ void legend_fused_accumulate(const u32 (&ga)[JJ][4], u32 sb,
                                                        int lane, float (&acc)[DK][4]) {
    using H = LegendHalfRows<KS>;
#ifdef LEGEND_WGMMA
    // B's 8·DK columns in pieces of 64, 32 and 8 (d = 100 pads to 104 = 64 + 32 + 8); along
    // K (the walked rows) its core matrices are a row group (CHUNKS · 128 bytes) apart.
    constexpr int N64 = DK / 8, N32 = DK % 8 / 4, N8 = DK % 4;
    float* d = &acc[0][0];
    // One descriptor, moved by constant byte offsets (in its 16-byte address units).
    u64 b = legend_wgmma_desc(sb, H::CHUNKS * 128, 128);
#pragma unroll
    for (int jj = 0; jj < JJ; ++jj) {
        constexpr u32 ROW_GROUP = H::CHUNKS * 128;
        u64 at = b + 2 * jj * ROW_GROUP / 16;
#pragma unroll
        for (int i = 0; i < N64; ++i) legend_wgmma_rs_n64(d + 32 * i, ga[jj], at + 8 * i * 8);
#pragma unroll
        for (int i = 0; i < N32; ++i)
            legend_wgmma_rs_n32(d + 32 * N64, ga[jj], at + 8 * N64 * 8);
#pragma unroll
        for (int i = 0; i < N8; ++i)
            legend_wgmma_rs_n8(d + 32 * N64 + 16 * N32 + 4 * i, ga[jj],
                               at + (8 * N64 + 4 * N32 + i) * 8);
    }
    legend_wgmma_commit();
#else
    // Matrices (walked rows 0-7 | 8-15) x (columns 8n.. | 8n+8..).
    u32 b_at = sb + H::at(lane & 15, lane >> 4);
#pragma unroll
    for (int jj = 0; jj < JJ; ++jj) {
#pragma unroll
        for (int n = 0; n < DK; n += 2) {
            u32 at = b_at + H::at(16 * jj, n);
            if (n + 1 < DK) {
                u32 b[4];
                legend_ldsm4_trans(at, b);
                legend_mma_f16(acc[n], ga[jj], b[0], b[1]);
                legend_mma_f16(acc[n + 1], ga[jj], b[2], b[3]);
            } else {
                u32 b0, b1;
                legend_ldsm2_trans(at, b0, b1);
                legend_mma_f16(acc[n], ga[jj], b0, b1);
            }
        }
    }
#endif
}
