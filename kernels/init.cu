// Counter-based initialisation of embedding rows (the hash spec of legend-model's init.rs):
// element t of row `row` is a pure function of (seed, table, row, t).

// The shared RNG test vectors: for each input (a, b, c), out holds mix(a), draw(a, b),
// below(a, c) and key(a, [b, c]) (kernels/testdata/rng_vectors.txt).
extern "C" __global__ void legend_rng_vectors(const u64* in, u32 n, u64* out) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 a = in[3 * i], b = in[3 * i + 1], c = in[3 * i + 2];
    out[4 * i] = legend_mix(a);
    out[4 * i + 1] = legend_draw(a, b);
    out[4 * i + 2] = legend_below(a, c);
    out[4 * i + 3] = legend_key2(a, b, c);
}

// One thread per element of `rows` consecutive rows starting at global row `first_row`.
// `normal` selects N(0, scale^2) (Box-Muller in double precision, one output per element);
// otherwise uniform on (-scale, scale). Each value is then rounded to the nearest of `dtype`
// (node rows stored in 16 bits; LEGEND_DTYPE_F32 for none), as legend-model's Init::node_row.
extern "C" __global__ void legend_init_rows(float* out, u64 first_row, u32 rows, u32 dim,
                                            u64 seed, u32 table_tag, int normal, float scale,
                                            u32 dtype) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)rows * dim) return;
    u64 row = first_row + idx / dim;
    u64 t = idx % dim;
    u64 key = legend_mix(legend_mix(seed + (u64)(table_tag + 1) * LEGEND_GOLDEN) ^ row);
    u64 bits = legend_draw(key, t);
    float value;
    if (normal) {
        const double scale32 = 1.0 / 4294967296.0;
        double u1 = ((double)(bits >> 32) + 0.5) * scale32;
        double u2 = (double)(bits & 0xffffffffULL) * scale32;
        double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
        value = (float)((double)scale * z);
    } else {
        float u = ((float)(bits >> 40) + 0.5f) * (1.0f / 16777216.0f);
        value = scale * __fsub_rn(__fmul_rn(2.0f, u), 1.0f);
    }
    out[idx] = legend_round_nearest(value, dtype);
}

// Node rows to their 16-bit format at rest (`dtype`): n f32 values, each representable (the
// step and the initialisation round), into n 16-bit values, exactly. One thread a value.
extern "C" __global__ void legend_narrow_rows(const float* __restrict__ in,
                                              unsigned short* __restrict__ out, u64 n,
                                              u32 dtype) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = in[i];
    unsigned short h;
    if (dtype == LEGEND_DTYPE_BF16) h = (unsigned short)(__float_as_uint(x) >> 16);
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    out[i] = h;
}

// The inverse of legend_narrow_rows: n 16-bit values of `dtype` widened to f32 (exact).
extern "C" __global__ void legend_widen_rows(const unsigned short* __restrict__ in,
                                             float* __restrict__ out, u64 n, u32 dtype) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned short h = in[i];
    float x;
    if (dtype == LEGEND_DTYPE_BF16) x = __uint_as_float((u32)h << 16);
    else asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    out[i] = x;
}
