// How legend-cuda launches a program's pair of fused kernels, read from the module
// (legend_fused_launch): the rows kernel's threads a block, dynamic shared memory and whether
// it is persistent (a block a multiprocessor walking all the group's blocks of rows, else a
// block a 128 rows of a job, the jobs along y), and the negatives kernel's threads a block
// and shared memory (a block a column block by row range by job). The sizes live here only.
struct LegendFusedLaunch {
    u32 rows_threads;
    u32 rows_smem;
    u32 rows_persistent;
    u32 negatives_threads;
    u32 negatives_smem;
};

#ifdef LEGEND_WGMMA
#define LEGEND_FUSED_LAUNCH(DK, KS)                                                           \
    {LEGEND_WS_THREADS, LegendWsSmem<DK, KS>::TOTAL, 1, 32 * LEGEND_FUSED_WARPS,              \
     LegendFusedSmem<KS>::NEGATIVES}
#else
#define LEGEND_FUSED_LAUNCH(DK, KS)                                                           \
    {32 * LEGEND_FUSED_WARPS, LegendFusedSmem<KS>::ROWS, 0, 32 * LEGEND_FUSED_WARPS,          \
     LegendFusedSmem<KS>::NEGATIVES}
#endif

// One pair of kernels per padded width 8·DK: 32, 64, 104 (d = 100) and 128, written out so
// that each entry point can be found by its name. Each width is a program of its own
// (LEGEND_FUSED_WIDTH, set by legend-cuda's nvrtc.rs), compiled in parallel with the others;
// the program of the other kernels (LEGEND_FUSED_WIDTH 0) holds none of them. On Hopper the
// rows kernel is the warp-specialised one (one block of LEGEND_WS_THREADS a multiprocessor).
// TransE L2's programs name theirs legend_fused_transe_{rows,negatives}_dW.
#if LEGEND_FUSED_TRANSE
#define LEGEND_FUSED_NAME(KIND, W) legend_fused_transe_##KIND##_d##W
#else
#define LEGEND_FUSED_NAME(KIND, W) legend_fused_##KIND##_d##W
#endif
#ifdef LEGEND_WGMMA
#define LEGEND_FUSED_ROWS(W, DK, KS)                                                          \
    extern "C" __global__ void __launch_bounds__(LEGEND_WS_THREADS, 1)                       \
        LEGEND_FUSED_NAME(rows, W)(LegendFused f) {                                           \
        legend_fused_rows_ws<DK, KS>(f);                                                      \
    }
#else
#define LEGEND_FUSED_ROWS(W, DK, KS)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2)                 \
        LEGEND_FUSED_NAME(rows, W)(LegendFused f) {                                           \
        legend_fused_rows_body<DK, KS>(f);                                                    \
    }
#endif
#define LEGEND_FUSED_PAIR(W, DK, KS)                                                          \
    extern "C" __device__ LegendFusedLaunch legend_fused_launch =                             \
        LEGEND_FUSED_LAUNCH(DK, KS);                                                          \
    LEGEND_FUSED_ROWS(W, DK, KS)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * LEGEND_FUSED_WARPS, 2)                 \
        LEGEND_FUSED_NAME(negatives, W)(LegendFused f) {                                      \
        legend_fused_negatives_body<DK, KS>(f);                                               \
    }
#if LEGEND_FUSED_WIDTH == 32
LEGEND_FUSED_PAIR(32, 4, 2)
#elif LEGEND_FUSED_WIDTH == 64
LEGEND_FUSED_PAIR(64, 8, 4)
#elif LEGEND_FUSED_WIDTH == 104
LEGEND_FUSED_PAIR(104, 13, 7)
#elif LEGEND_FUSED_WIDTH == 128
LEGEND_FUSED_PAIR(128, 16, 8)
#endif
