/* The LUT GEMM's shared declarations, for lut.c (the format, the scalar path, the driver
   and the Python functions) and its SIMD paths lut_avx2.c, lut_avx512.c and lut_neon.c.
   The format, the algebra and the float order every path keeps: lut.c. */
#ifndef INFER_LUT_H
#define INFER_LUT_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#ifdef INFER_X86
#include <immintrin.h>
#endif

typedef struct {
    int64_t M, K, N;
    int bits, g;                 /* 1..4; group size, a multiple of 8 dividing K */
    const uint8_t *qweight;      /* (bits, N, K/8) */
    const uint16_t *scales;      /* (N, K/g) float16 */
    const uint16_t *mins;        /* (N, K/g) float16 */
    const int8_t *tables;        /* (M, tables_stride) from build_tables */
    int64_t tables_stride;       /* tables_bytes(K) */
    const float *c1, *c2, *asum; /* (M, K/g) each, from build_tables */
    float *y;                    /* (M, N) */
} lut_problem;

/* Per-thread scratch. Rows go in superblocks of up to SB = 32 rows, 4 blocks of 8; the
   scales and mins of block k as float at [k * ld + G * 8 + row], ld = 8 * (K/g rounded up
   to 32); the group integers likewise, per activation row of the pass at m * 4 * ld;
   idx: a chunk's lookup indices, all blocks and planes (AVX-512). */
enum { SB = 32, MAX_TILE_M = 64 };
enum { IDX_BYTES = 4 * 4 * 8 * 2 * 64 }; /* 4 blocks x 4 planes x 8 qwords x 2 zmm */
typedef struct {
    int32_t *I;    /* activation rows per pass * 4 * ld */
    float *s, *mn; /* 4 * ld each */
    int64_t ld;
    void *idx; /* IDX_BYTES, 64-byte aligned */
} lut_scratch;

/* Groups whose amax is below this get zero tables (their x is ~0): keeps 127 / amax
   finite, so every path rounds the same numbers. */
#define AMAX_MIN 1e-30f

/* Bytes of one activation row's tables: qwords rounded up to 4 (the AVX2 path reads 4
   qwords of tables at a time). */
static inline size_t tables_bytes(int64_t K) { return (size_t)((K + 255) / 256) * 4 * 256; }

/* The kernels read 8 or 16 rows of every plane at once, interleaved, which the hardware
   prefetcher does not follow (and in power-of-two shapes the planes' streams alias in
   cache sets and DRAM banks). The rows after the current block are, in each plane, one
   run of contiguous bytes: before each chunk, prefetch_next fetches the next `count`
   lines of every plane's run, a block ahead of use. It stays a loop (`unroll 1`): one
   burst of prefetches, or one beside each weight load, is much slower. */
static inline void prefetch_next(const uint8_t *base, int64_t plane, int bits, int64_t first,
                                 int count) {
    for (int p = 0; p < bits; p++)
#pragma GCC unroll 1
        for (int64_t l = first; l < first + count; l++)
            __builtin_prefetch(base + p * plane + l * 64, 0, 3); /* prefetcht0 / prfm pldl1keep */
}

/* lut.c. The scalar path runs any g (a multiple of 8), and the rows the SIMD paths leave
   past their last full block. */
void lut_build_tables(const float *x, int64_t K, int g, int bits, int8_t *tables, float *c1,
                      float *c2, float *asum);
void lut_rows_scalar(const lut_problem *P, int64_t m, int64_t n0, int64_t n1, int32_t *I);
/* One activation row's tables and constants on the fastest builder for `isa` (same bits). */
void lut_tables_row(const float *x, int64_t K, int g, int bits, int isa, int8_t *tables,
                    float *c1, float *c2, float *asum);
/* The path lut_matmul runs for a requested one (kernels.h's ids). */
int lut_isa(int isa);

/* Each SIMD path: activation rows [m0, m1) x weight rows [n0, n1), g % 32 == 0. */
#ifdef INFER_X86
#define LUT_AVX2 TARGET_AVX2
/* The AVX-512 path also needs VBMI (vpermi2b) and VNNI (vpdpbusd): Ice Lake, Zen 4 and
   later; kernels.h's avx512 without them runs the AVX2 path. */
#define LUT_AVX512                                                                         \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")))
/* lut_avx2.c (avx2, avx2vnni, and avx512 without VBMI and VNNI) */
LUT_AVX2 void lut_build_tables_avx2(const float *x, int64_t K, int g, int bits,
                                    int8_t *tables, float *c1, float *c2, float *asum);
LUT_AVX2 void lut_rows_avx2(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                            int64_t n1, lut_scratch *S);
/* lut_avx512.c (avx512vnni with VBMI) */
LUT_AVX512 void lut_rows_avx512(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                                int64_t n1, lut_scratch *S);

/* ------------------------------------------------------------------------------------ */
/* The AVX2 epilogue, also inlined into the AVX-512 path                                  */
/* ------------------------------------------------------------------------------------ */

/* The epilogue of up to 4 chains of 8 rows each, (ngroups, 8) group integers, scales and
   mins, the activation row's constants and 8 outputs: the canonical order per row. The
   chains (4 blocks of one activation row, or one block of 4 activation rows) are
   independent, which hides the latency of each row's FMA chain. */
typedef struct {
    const int32_t *I;
    const float *s, *mn, *c1, *c2, *asum;
    float *y;
} chain_t;

static inline LUT_AVX2 void epilogue_nc(const chain_t *ch, int64_t ngroups, int nc) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t G = 0; G < ngroups; G++)
        for (int k = 0; k < nc; k++) {
            const chain_t *c = ch + k;
            __m256 iv = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(c->I + G * 8)));
            __m256 u = _mm256_fmadd_ps(_mm256_broadcast_ss(c->c1 + G), iv,
                                       _mm256_broadcast_ss(c->c2 + G));
            acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(c->s + G * 8), u, acc[k]);
            acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(c->mn + G * 8),
                                     _mm256_broadcast_ss(c->asum + G), acc[k]);
        }
    for (int k = 0; k < nc; k++) _mm256_storeu_ps(ch[k].y, acc[k]);
}

static inline LUT_AVX2 void epilogue(const chain_t *ch, int64_t ngroups, int nc) {
    switch (nc) { /* a constant count for each, so the chains stay in registers */
    case 4: epilogue_nc(ch, ngroups, 4); break;
    case 3: epilogue_nc(ch, ngroups, 3); break;
    case 2: epilogue_nc(ch, ngroups, 2); break;
    default: epilogue_nc(ch, ngroups, 1); break;
    }
}
#endif /* INFER_X86 */

#if defined(__aarch64__)
/* lut_neon.c (neon, neondot); its table builder needs g % 16 == 0 */
void lut_build_tables_neon(const float *x, int64_t K, int g, int bits, int8_t *tables,
                           float *c1, float *c2, float *asum);
void lut_rows_neon(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                   lut_scratch *S);
#endif

#endif
