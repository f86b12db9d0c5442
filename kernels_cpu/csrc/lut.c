/* T-MAC style LUT GEMM for the lut1..lut4 formats (quant/lut.py): y (M, N) = x (M, K) W^T.

   Weights: b one-bit planes, qweight uint8 (b, N, K/8); bit i of byte t of plane p, row n
   is bit p of q[n, 8t+i]; w = q*s + m per group of g (scales, mins f16 (N, K/g)).
   The 4-element group j (elements 4j..4j+3) is the low nibble of byte j/2 if j is even,
   the high nibble if odd.

   The algebra (per activation row; a = x, b_pk = bit p of q_k, s_i = 2 b_i - 1 in {-1,+1}):

     sum_k q_k a_k = sum_p 2^p sum_k b_pk a_k
     sum_k b_k a_k = 1/2 (sum_k s_k a_k + A)             A = sum_k a_k over the group
     sum_{k in j} s_k a_k = S_j[nib]                     S_j[idx] = sum_i (2 bit_i(idx) - 1) a_4j+i

   S_j is sign-symmetric, S_j[15 - idx] = -S_j[idx] (15 - idx flips every bit), so only
   idx 0..7 are computed and 8..15 mirrored (T-MAC / SAIL "mirror consolidation").
   max |S_j| = sum_i |a_4j+i|. Tables are quantized to int8 with one scale per weight
   group G (the g/4 tables of the group share it):

     amax_G = max_j (((|a0| + |a1|) + |a2|) + |a3|)       lam_G = amax_G / 127
     t_j[idx] = clamp(rint(S_j[idx] * (127 / amax_G)), -127, 127)   (t_j[15-idx] = -t_j[idx])

   and for row n, group G the integer  I = sum_p 2^p sum_{j in G} t_j[nib_p(n, j)]  (exact;
   |I| <= 15 * 2 * 127 * g/8) gives

     sum_{k in G} w_k a_k ~= s * (c1_G * I + c2_G) + m * A_G,   c1 = lam/2, c2 = (2^b-1)/2 * A

   Canonical float order (every path computes exactly this, so they agree bit for bit):
     per table: S = ((+-a0 +- a1) +- a2) - a3 as written in build_tables; A_G = sequential
     sum over the group's tables of (((a0 + a1) + a2) + a3);
     per row: acc = 0; for G in order: u = fma(c1, I, c2); acc = fma(s, u, acc);
     acc = fma(m, A, acc).  y = acc.

   Table layout, per activation row, per 64 weights (one "qword": 8 bytes of each plane,
   16 tables): 256 int8; bytes [16t, 16t+16) = table of the low nibble of byte t (j = 2t),
   bytes [128 + 16t, ...) = table of the high nibble (j = 2t + 1), t = 0..7. So AVX-512
   VBMI looks a byte up in 8 tables at once with vpermi2b, index (t << 4) | nibble.

   Paths (same integers, same float order), chosen from kernels.h's ids by lut_isa:
     scalar      any g (multiple of 8)
     avx2        (avx2, avx2vnni, avx512) g % 32 == 0; 16 rows at a time: a 16x16 byte
                 transpose per 128-bit lane puts one byte position of 16 rows in a lane,
                 looked up with vpshufb (one table per lane); int16 accumulation (a
                 32-element unit is at most 15240), int32 per group
     avx512vnni  (+ VBMI: Ice Lake, Zen 4 and later) g % 32 == 0; blocks of 8 rows: an
                 8x8 qword transpose puts one 64-weight qword of 8 rows in a zmm, turned
                 into indices once (all planes) and looked up with vpermi2b in 8 tables;
                 vpdpbusd with 2^p bytes sums 4 lookups and weights the plane, into int32.
                 Prefill (M > 1, g = 64) runs superblocks of 4 blocks, so each activation
                 row's tables are read once per 32 weight rows.
     neon        (neon, neondot) g % 32 == 0; the AVX2 path in 128 bits: 16 rows at a time,
                 a 16x16 byte transpose (trn1/trn2) puts byte j of 16 rows in a register,
                 looked up with tbl (vqtbl1q_s8, one table per register); int16 sums per
                 unit, int32 per group. neondot runs it too: with rows in lanes, sdot would
                 sum 4 rows' lookups, so it has nothing to add here. Tables (g % 16 == 0):
                 4 at a time, mirrored with one tbl of 4 registers each.
   Rows past the last full block, and groups that are not a multiple of 32, use scalar.
   Weight rows are read 8 or 16 at a time, interleaved, which the hardware prefetcher
   does not follow: the kernels prefetch the next block (superblock) themselves.

   Decode costs, per 8 rows x 64 weights x plane, ~16 vector instructions (1 load, 3 of
   transpose, 3 of index, 4 table loads shared by the planes, 2 vpermi2b, 2 vpdpbusd),
   plus per group ~1.5 of epilogue: on a Zen 5 core lut2 runs at ~18-20 GB/s and lut4 at
   ~22-26 GB/s of packed weights (benchmarks/bench_lut.py), near one core's bandwidth.
*/

/* INFER_NO_PYTHON leaves out the CPython functions at the end, so the kernels build alone
   (tests/native/lut_neon_check.c, cross-compiled for AArch64). */
#ifndef INFER_NO_PYTHON
#include "binding.h"
#endif

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef INFER_X86
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
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

/* ------------------------------------------------------------------------------------ */
/* Shared helpers                                                                         */
/* ------------------------------------------------------------------------------------ */

/* Groups whose amax is below this get zero tables (their x is ~0): keeps 127 / amax
   finite, so every path rounds the same numbers. */
#define AMAX_MIN 1e-30f

static size_t tables_bytes(int64_t K) {
    /* qwords rounded up to 4 (the AVX2 path reads 4 qwords of tables at a time) */
    return (size_t)((K + 255) / 256) * 4 * 256;
}

/* Tables and per-group constants for one activation row (canonical float order).
   tables: tables_bytes(K) int8; c1, c2, asum: K/g floats each. */
static void build_tables(const float *x, int64_t K, int g, int bits, int8_t *tables, float *c1,
                         float *c2, float *asum) {
    const int64_t ngroups = K / g, tpg = g / 4; /* tables per group */
    const float half_levels = 0.5f * (float)((1 << bits) - 1);
    memset(tables + K / 64 * 256, 0, tables_bytes(K) - K / 64 * 256); /* past K */
    for (int64_t G = 0; G < ngroups; G++) {
        float amax = 0.0f, A = 0.0f;
        for (int64_t jj = 0; jj < tpg; jj++) {
            const float *a = x + 4 * (G * tpg + jj);
            float sa = ((fabsf(a[0]) + fabsf(a[1])) + fabsf(a[2])) + fabsf(a[3]);
            amax = sa > amax ? sa : amax;
            A += ((a[0] + a[1]) + a[2]) + a[3];
        }
        const float inv = amax >= AMAX_MIN ? 127.0f / amax : 0.0f;
        c1[G] = (amax / 127.0f) * 0.5f;
        c2[G] = half_levels * A;
        asum[G] = A;
        for (int64_t jj = 0; jj < tpg; jj++) {
            const int64_t j = G * tpg + jj;
            const float *a = x + 4 * j;
            /* idx bit i set -> +a_i, clear -> -a_i; idx 0..7 have bit 3 clear: -a3 */
            const float p01[4] = {-a[0] - a[1], a[0] - a[1], -a[0] + a[1], a[0] + a[1]};
            int8_t *t = tables + (j / 16) * 256 + (j & 1) * 128 + ((j % 16) / 2) * 16;
            for (int idx = 0; idx < 8; idx++) {
                float e = (p01[idx & 3] + ((idx & 4) ? a[2] : -a[2])) - a[3];
                float r = rintf(e * inv);
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                t[idx] = (int8_t)r;
                t[15 - idx] = (int8_t)-r;
            }
        }
    }
}

/* One row's epilogue from its group integers: the canonical order. */
static float epilogue_row(const int32_t *I, int64_t Istride, const uint16_t *s,
                          const uint16_t *mn, const float *c1, const float *c2,
                          const float *asum, int64_t ngroups) {
    float acc = 0.0f;
    for (int64_t G = 0; G < ngroups; G++) {
        float u = fmaf(c1[G], (float)I[G * Istride], c2[G]);
        acc = fmaf(half_to_float(s[G]), u, acc);
        acc = fmaf(half_to_float(mn[G]), asum[G], acc);
    }
    return acc;
}

/* Scalar rows [n0, n1) for activation row m; I scratch of ngroups int32. */
static void rows_scalar(const lut_problem *P, int64_t m, int64_t n0, int64_t n1, int32_t *I) {
    const int64_t K = P->K, rb = K / 8, ngroups = K / P->g, tpg = P->g / 4;
    const int8_t *tab = P->tables + m * P->tables_stride;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t G = 0; G < ngroups; G++) {
            int32_t acc = 0;
            for (int p = 0; p < P->bits; p++) {
                const uint8_t *w = P->qweight + ((int64_t)p * P->N + n) * rb;
                int32_t sp = 0;
                for (int64_t j = G * tpg; j < (G + 1) * tpg; j++) {
                    int nib = (w[j / 2] >> (4 * (j & 1))) & 15;
                    sp += tab[(j / 16) * 256 + (j & 1) * 128 + ((j % 16) / 2) * 16 + nib];
                }
                acc += sp << p;
            }
            I[G] = acc;
        }
        P->y[m * P->N + n] =
            epilogue_row(I, 1, P->scales + n * ngroups, P->mins + n * ngroups, P->c1 + m * ngroups,
                         P->c2 + m * ngroups, P->asum + m * ngroups, ngroups);
    }
}

/* Prefetching. The kernels read 8 or 16 rows of every plane at once, interleaved, which
   the hardware prefetcher does not follow, and in power-of-two shapes the planes' streams
   alias (cache sets, DRAM banks: lut4 4096 x 4096 ran at half speed with a prefetch of the
   same bytes a block on). The rows after the current block are, in each plane, one region
   of contiguous bytes: before each chunk, prefetch_next fetches the next `count` lines of
   every plane's region, a sequential run per plane, a block ahead of use. Measured on Zen
   5 (lut4, 11008 x 4096, one core): this loop as written 20 GB/s; the same prefetches
   unrolled into one burst (gcc -O3 does that to a constant trip count) 12; one beside
   each weight load 4-6. Hence `unroll 1`. */
static inline void prefetch_next(const uint8_t *base, int64_t plane, int bits, int64_t first,
                                 int count) {
    for (int p = 0; p < bits; p++)
#pragma GCC unroll 1
        for (int64_t l = first; l < first + count; l++)
            __builtin_prefetch(base + p * plane + l * 64, 0, 3); /* prefetcht0 / prfm pldl1keep */
}

#ifdef INFER_X86
/* ------------------------------------------------------------------------------------ */
/* AVX2 helpers (also inlined into the AVX-512 path)                                     */
/* ------------------------------------------------------------------------------------ */

/* The AVX-512 path also needs VBMI (vpermi2b) and VNNI (vpdpbusd): Ice Lake, Zen 4 and
   later; kernels.h's avx512 without them runs the AVX2 path here. */
#define LUT_AVX2 TARGET_AVX2
#define LUT_AVX512                                                                         \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")))

/* s or m of 8 rows, all groups, as float dst[G * 8 + row]: the epilogue reads rows in
   lanes. 8x8 float transposes; the last ngroups % 8 groups one by one. */
static inline LUT_AVX2 void transpose_sm8(const uint16_t *src, int64_t ngroups, float *dst) {
    int64_t G = 0;
    for (; G + 8 <= ngroups; G += 8) {
        __m256 r[8], t[8], u[8];
        for (int i = 0; i < 8; i++) {
            r[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i * ngroups + G)));
            /* the same block of the next superblock */
            _mm_prefetch((const char *)(src + (i + SB) * ngroups + G), _MM_HINT_T0);
        }
        for (int i = 0; i < 4; i++) {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 2; i++) {
            u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
            u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
            u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
            u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
        }
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps(dst + (G + i) * 8, _mm256_permute2f128_ps(u[i], u[4 + i], 0x20));
            _mm256_storeu_ps(dst + (G + 4 + i) * 8, _mm256_permute2f128_ps(u[i], u[4 + i], 0x31));
        }
    }
    for (; G < ngroups; G++)
        for (int i = 0; i < 8; i++) dst[G * 8 + i] = _cvtsh_ss(src[i * ngroups + G]);
}

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

/* Chains for blocks [0, nb) of the superblock at row n, activation row m. */
static inline void block_chains(const lut_problem *P, const lut_scratch *S, int64_t m,
                                int64_t n, int nb, chain_t *ch) {
    const int64_t ng = P->K / P->g;
    for (int k = 0; k < nb; k++)
        ch[k] = (chain_t){S->I + k * S->ld, S->s + k * S->ld, S->mn + k * S->ld, P->c1 + m * ng,
                          P->c2 + m * ng, P->asum + m * ng, P->y + m * P->N + n + 8 * k};
}

/* build_tables, 8 tables (32 activations) at a time, lanes = tables: the same operations
   per lane as the scalar code, so the same bits. Needs g % 32 == 0. */
static LUT_AVX2 void build_tables_avx2(const float *x, int64_t K, int g, int bits,
                                       int8_t *tables, float *c1, float *c2, float *asum) {
    const int64_t ngroups = K / g;
    const float half_levels = 0.5f * (float)((1 << bits) - 1);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    /* 4x4 byte transpose in each lane: byte 4e + i -> 4i + e */
    const __m256i tr4 = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0,
                                         4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    /* table = its 8 entries, then the same reversed (to be negated) */
    const __m256i mirA = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2,
                                          3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i mirB = _mm256_add_epi8(mirA, _mm256_set1_epi8(8));
    const __m256i neg = _mm256_setr_epi8(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1, 1,
                                         1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    memset(tables + K / 64 * 256, 0, tables_bytes(K) - K / 64 * 256); /* past K */
    for (int64_t G = 0; G < ngroups; G++) {
        /* a_i of 8 tables; lanes hold tables 0, 2, 4, 6, 1, 3, 5, 7 of the 8 */
        __m256 amax = _mm256_setzero_ps();
        float A = 0.0f;
        for (int64_t c = 0; c < g / 32; c++) {
            const float *p = x + G * g + 32 * c;
            __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8),
                   v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
            __m256 u0 = _mm256_unpacklo_ps(v0, v1), u1 = _mm256_unpackhi_ps(v0, v1);
            __m256 u2 = _mm256_unpacklo_ps(v2, v3), u3 = _mm256_unpackhi_ps(v2, v3);
            __m256 a0 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2)));
            __m256 a1 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2)));
            __m256 a2 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3)));
            __m256 a3 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3)));
            __m256 sa = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                              _mm256_andnot_ps(sign, a2)),
                _mm256_andnot_ps(sign, a3));
            amax = _mm256_max_ps(amax, sa);
            float t[8];
            _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), a2), a3));
            static const int lane[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* of table k */
            for (int k = 0; k < 8; k++) A += t[lane[k]]; /* sequential, in table order */
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float am = _mm_cvtss_f32(m4);
        const float inv = am >= AMAX_MIN ? 127.0f / am : 0.0f;
        c1[G] = (am / 127.0f) * 0.5f;
        c2[G] = half_levels * A;
        asum[G] = A;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int64_t c = 0; c < g / 32; c++) {
            const float *p = x + G * g + 32 * c;
            __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8),
                   v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
            __m256 u0 = _mm256_unpacklo_ps(v0, v1), u1 = _mm256_unpackhi_ps(v0, v1);
            __m256 u2 = _mm256_unpacklo_ps(v2, v3), u3 = _mm256_unpackhi_ps(v2, v3);
            __m256 a0 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2)));
            __m256 a1 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2)));
            __m256 a2 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3)));
            __m256 a3 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3)));
            const __m256 n0 = _mm256_xor_ps(a0, sign), n2 = _mm256_xor_ps(a2, sign);
            const __m256 p01[4] = {_mm256_sub_ps(n0, a1), _mm256_sub_ps(a0, a1),
                                   _mm256_add_ps(n0, a1), _mm256_add_ps(a0, a1)};
            __m256i e[8];
            for (int idx = 0; idx < 8; idx++) {
                __m256 v = _mm256_sub_ps(_mm256_add_ps(p01[idx & 3], (idx & 4) ? a2 : n2), a3);
                __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(v, vinv)); /* rint: MXCSR default */
                e[idx] = _mm256_max_epi32(_mm256_min_epi32(r, lim), nlim);
            }
            /* (entry, table) int32 -> per table its 8 entries as bytes */
            __m256i q0 = _mm256_packs_epi16(_mm256_packs_epi32(e[0], e[1]),
                                            _mm256_packs_epi32(e[2], e[3]));
            __m256i q1 = _mm256_packs_epi16(_mm256_packs_epi32(e[4], e[5]),
                                            _mm256_packs_epi32(e[6], e[7]));
            q0 = _mm256_shuffle_epi8(q0, tr4); /* 4 tables x entries 0..3 */
            q1 = _mm256_shuffle_epi8(q1, tr4); /* 4 tables x entries 4..7 */
            __m256i r01 = _mm256_unpacklo_epi32(q0, q1); /* tables 0, 1 of the lane: 8 entries */
            __m256i r23 = _mm256_unpackhi_epi32(q0, q1);
            __m256i t0 = _mm256_sign_epi8(_mm256_shuffle_epi8(r01, mirA), neg);
            __m256i t1 = _mm256_sign_epi8(_mm256_shuffle_epi8(r01, mirB), neg);
            __m256i t2 = _mm256_sign_epi8(_mm256_shuffle_epi8(r23, mirA), neg);
            __m256i t3 = _mm256_sign_epi8(_mm256_shuffle_epi8(r23, mirB), neg);
            /* lane 0: even tables j0, j0+2, .. (low nibbles), lane 1: odd (high nibbles);
               they fill 4 consecutive 16-byte slots of their half of the qword's 256 */
            const int64_t j0 = (G * g + 32 * c) / 4;
            int8_t *lo = tables + (j0 / 16) * 256 + ((j0 % 16) / 2) * 16, *hi = lo + 128;
            _mm_storeu_si128((__m128i *)lo, _mm256_castsi256_si128(t0));
            _mm_storeu_si128((__m128i *)(lo + 16), _mm256_castsi256_si128(t1));
            _mm_storeu_si128((__m128i *)(lo + 32), _mm256_castsi256_si128(t2));
            _mm_storeu_si128((__m128i *)(lo + 48), _mm256_castsi256_si128(t3));
            _mm_storeu_si128((__m128i *)hi, _mm256_extracti128_si256(t0, 1));
            _mm_storeu_si128((__m128i *)(hi + 16), _mm256_extracti128_si256(t1, 1));
            _mm_storeu_si128((__m128i *)(hi + 32), _mm256_extracti128_si256(t2, 1));
            _mm_storeu_si128((__m128i *)(hi + 48), _mm256_extracti128_si256(t3, 1));
        }
    }
}

/* ------------------------------------------------------------------------------------ */
/* AVX2: 16 rows x 32 bytes per plane, byte-transposed, vpshufb                           */
/* ------------------------------------------------------------------------------------ */

/* In each 128-bit lane: R[r] = 16 bytes of row r  ->  O[i] = byte i of rows 0..15. */
static inline LUT_AVX2 void transpose16x16_epi8(const __m256i R[16], __m256i O[16]) {
    __m256i S1[16], S2[16], S3[16];
    for (int k = 0; k < 8; k++) {
        S1[2 * k] = _mm256_unpacklo_epi8(R[2 * k], R[2 * k + 1]);
        S1[2 * k + 1] = _mm256_unpackhi_epi8(R[2 * k], R[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++)
        for (int s = 0; s < 2; s++) {
            S2[4 * k + 2 * s] = _mm256_unpacklo_epi16(S1[4 * k + s], S1[4 * k + 2 + s]);
            S2[4 * k + 2 * s + 1] = _mm256_unpackhi_epi16(S1[4 * k + s], S1[4 * k + 2 + s]);
        }
    for (int kk = 0; kk < 2; kk++)
        for (int i = 0; i < 4; i++) {
            S3[8 * kk + 2 * i] = _mm256_unpacklo_epi32(S2[8 * kk + i], S2[8 * kk + 4 + i]);
            S3[8 * kk + 2 * i + 1] = _mm256_unpackhi_epi32(S2[8 * kk + i], S2[8 * kk + 4 + i]);
        }
    for (int i = 0; i < 8; i++) {
        O[2 * i] = _mm256_unpacklo_epi64(S3[i], S3[8 + i]);
        O[2 * i + 1] = _mm256_unpackhi_epi64(S3[i], S3[8 + i]);
    }
}

/* Group integers of rows [n0, n0+16) for activation row m -> I[h * ld + G * 8 + row] for
   the two blocks h of 8 rows. */
static LUT_AVX2 void block16_avx2(const lut_problem *P, int64_t m, int64_t n0, int32_t *I,
                                  int64_t ld) {
    const int64_t K = P->K, rb = K / 8, upg = P->g / 32; /* 32-element units per group */
    const int8_t *tab = P->tables + m * P->tables_stride;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i gacc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    int64_t unit = 0, G = 0;
    for (int64_t c = 0; c < rb; c += 32) {
        const int nb = (int)(rb - c < 32 ? rb - c : 32); /* bytes, a multiple of 4 */
        __m256i acc[4][2];
        for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nb / 4),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        /* the next block of 16 rows: rb / 4 lines a plane, 8 per chunk of 32 bytes */
        prefetch_next(P->qweight + (n0 + 16) * rb, P->N * rb, P->bits, c / 32 * 8, 8);
        for (int p = 0; p < P->bits; p++) {
            __m256i R[16], O[16];
            const uint8_t *w = P->qweight + ((int64_t)p * P->N + n0) * rb + c;
            for (int r = 0; r < 16; r++)
                R[r] = nb == 32 ? _mm256_loadu_si256((const __m256i *)(w + r * rb))
                                : _mm256_maskload_epi32((const int *)(w + r * rb), mask);
            transpose16x16_epi8(R, O);
            const __m256i pw = _mm256_set1_epi8((char)(1 << p));
            const int jn = nb < 16 ? nb : 16;
            for (int j = 0; j < jn; j++) {
                /* lane 0: byte j (qword j/8, position j%8); lane 1: byte 16+j (qword 2+j/8) */
                const int8_t *t0 = tab + (c / 8 + j / 8) * 256 + (j % 8) * 16;
                const int8_t *t1 = t0 + 2 * 256;
                __m256i tlo = _mm256_loadu2_m128i((const __m128i *)t1, (const __m128i *)t0);
                __m256i thi =
                    _mm256_loadu2_m128i((const __m128i *)(t1 + 128), (const __m128i *)(t0 + 128));
                __m256i lo = _mm256_and_si256(O[j], low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(O[j], 4), low4);
                __m256i rl = _mm256_shuffle_epi8(tlo, lo), rh = _mm256_shuffle_epi8(thi, hi);
                /* pairs (lo, hi) of one row -> 2^p (lo + hi) in int16; rows 0-7 and 8-15 */
                __m256i a0 = _mm256_maddubs_epi16(pw, _mm256_unpacklo_epi8(rl, rh));
                __m256i a1 = _mm256_maddubs_epi16(pw, _mm256_unpackhi_epi8(rl, rh));
                acc[j / 4][0] = _mm256_add_epi16(acc[j / 4][0], a0);
                acc[j / 4][1] = _mm256_add_epi16(acc[j / 4][1], a1);
            }
        }
        /* unit u of the chunk: acc[u % 4], lane u / 4 */
        for (int u = 0; u < nb / 4; u++) {
            for (int h = 0; h < 2; h++) {
                __m128i v = u < 4 ? _mm256_castsi256_si128(acc[u][h])
                                  : _mm256_extracti128_si256(acc[u - 4][h], 1);
                gacc[h] = _mm256_add_epi32(gacc[h], _mm256_cvtepi16_epi32(v));
            }
            if (++unit == upg) {
                _mm256_storeu_si256((__m256i *)(I + G * 8), gacc[0]);
                _mm256_storeu_si256((__m256i *)(I + ld + G * 8), gacc[1]);
                gacc[0] = gacc[1] = _mm256_setzero_si256();
                unit = 0;
                G++;
            }
        }
    }
}

static LUT_AVX2 void rows_avx2(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                               int64_t n1, lut_scratch *S) {
    const int64_t ngroups = P->K / P->g;
    int64_t n = n0;
    while (n + 16 <= n1) { /* superblocks of 32 or 16 rows */
        const int nb = n + 32 <= n1 ? 4 : 2;
        for (int k = 0; k < nb; k++) {
            transpose_sm8(P->scales + (n + 8 * k) * ngroups, ngroups, S->s + k * S->ld);
            transpose_sm8(P->mins + (n + 8 * k) * ngroups, ngroups, S->mn + k * S->ld);
        }
        for (int64_t m = m0; m < m1; m++) {
            chain_t ch[4];
            for (int k = 0; k < nb; k += 2)
                block16_avx2(P, m, n + 8 * k, S->I + k * S->ld, S->ld);
            block_chains(P, S, m, n, nb, ch);
            epilogue(ch, ngroups, nb);
        }
        n += 8 * nb;
    }
    if (n < n1)
        for (int64_t m = m0; m < m1; m++) rows_scalar(P, m, n, n1, S->I);
}

/* ------------------------------------------------------------------------------------ */
/* AVX-512 VBMI + VNNI: 8 rows x 64 bytes per plane, qword-transposed, vpermi2b            */
/* ------------------------------------------------------------------------------------ */

static inline LUT_AVX512 void transpose8x8_epi64(__m512i z[8]) {
    __m512i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi64(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi64(z[2 * i], z[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int e = 0; e < 2; e++) {
            u[4 * i + e] = _mm512_shuffle_i64x2(t[4 * i + e], t[4 * i + 2 + e], 0x88);
            u[4 * i + 2 + e] = _mm512_shuffle_i64x2(t[4 * i + e], t[4 * i + 2 + e], 0xDD);
        }
    /* u[0]: columns 0, 4 of rows 0-3; u[1]: 1, 5; u[2]: 2, 6; u[3]: 3, 7; u[4..7]: rows 4-7 */
    for (int i = 0; i < 4; i++) {
        z[i] = _mm512_shuffle_i64x2(u[i], u[4 + i], 0x88);
        z[4 + i] = _mm512_shuffle_i64x2(u[i], u[4 + i], 0xDD);
    }
    /* z[k] = qword k of rows 0..7 */
}

/* Lookups of one chunk for one activation row: acc[q] += sum over planes p of 2^p times
   the table entries of qword q (idx: the chunk's indices, plane p qword q low / high
   nibbles at idx[(8p + q) * 2 + 0 / 1]). The 4 table registers of a qword serve every
   plane. */
static inline __attribute__((always_inline)) LUT_AVX512 void lookups(const int8_t *tab,
                                                                     const __m512i *idx,
                                                                     int bits, int nq,
                                                                     __m512i acc[8]) {
    for (int q = 0; q < nq; q++) {
        const int8_t *t = tab + q * 256;
        const __m512i t0 = _mm512_loadu_si512(t), t1 = _mm512_loadu_si512(t + 64),
                      t2 = _mm512_loadu_si512(t + 128), t3 = _mm512_loadu_si512(t + 192);
        for (int p = 0; p < bits; p++) {
            const __m512i pw = _mm512_set1_epi8((char)(1 << p));
            __m512i rl = _mm512_permutex2var_epi8(t0, idx[(8 * p + q) * 2], t1);
            __m512i rh = _mm512_permutex2var_epi8(t2, idx[(8 * p + q) * 2 + 1], t3);
            acc[q] = _mm512_dpbusd_epi32(acc[q], pw, rl);
            acc[q] = _mm512_dpbusd_epi32(acc[q], pw, rh);
        }
    }
}

/* The lookup indices of one chunk (up to 64 bytes of each plane) of 8 rows at w (row
   stride rb, plane stride plane): idx[(8p + q) * 2 + 0 / 1] = low / high nibbles of qword q
   of plane p, with the byte position t in bits 4-6 (vpermi2b picks table t). */
static inline LUT_AVX512 void chunk_indices(const uint8_t *w, int64_t rb, int64_t plane,
                                            int bits, __mmask64 bmask, int nq, __m512i *idx) {
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512i tpos = _mm512_set1_epi64(0x7060504030201000LL); /* byte t -> t << 4 */
    for (int p = 0; p < bits; p++, w += plane) {
        __m512i z[8];
        for (int r = 0; r < 8; r++) z[r] = _mm512_maskz_loadu_epi8(bmask, w + r * rb);
        transpose8x8_epi64(z);
        for (int q = 0; q < nq; q++) {
            idx[(8 * p + q) * 2] = _mm512_ternarylogic_epi64(z[q], low4, tpos, 0xEA); /* a&b|c */
            idx[(8 * p + q) * 2 + 1] =
                _mm512_ternarylogic_epi64(_mm512_srli_epi16(z[q], 4), low4, tpos, 0xEA);
        }
    }
}

/* Group integers of rows [n0, n0+8) for activation rows [m0, m1) -> I[(m - m0) * Istride
   + G * 8 + row]. Per chunk (64 bytes of each plane: 8 qwords, 512 elements), the weights
   are transposed and turned into indices once, then looked up for every activation row. */
static LUT_AVX512 void block8_avx512(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                                     int32_t *I, int64_t Istride, __m512i *idx) {
    const int64_t K = P->K, rb = K / 8, upg = P->g / 32, plane = P->N * rb;
    const uint8_t *w0 = P->qweight + n0 * rb;
    /* dwords 2r of a and of b (unit 0 of each row), then dwords 2r + 1 (unit 1) */
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m256i gacc[MAX_TILE_M]; /* per activation row: the group being summed (generic g) */
    for (int64_t m = m0; m < m1; m++) gacc[m - m0] = _mm256_setzero_si256();
    int64_t unit = 0, G = 0; /* the same for every activation row */
    for (int64_t c = 0; c < rb; c += 64) {
        const int nb = (int)(rb - c < 64 ? rb - c : 64); /* a multiple of 4 */
        const int nq = (nb + 7) / 8;
        const __mmask64 bmask = nb == 64 ? ~(__mmask64)0 : (((__mmask64)1 << nb) - 1);
        prefetch_next(w0 + 8 * rb, plane, P->bits, c / 64 * 8, 8); /* next block: rb / 8 lines */
        chunk_indices(w0 + c, rb, plane, P->bits, bmask, nq, idx);
        int64_t unit_end = unit, G_end = G;
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *tab = P->tables + m * P->tables_stride + c / 8 * 256;
            int32_t *Im = I + (m - m0) * Istride;
            __m512i acc[8];
            for (int q = 0; q < 8; q++) acc[q] = _mm512_setzero_si512();
            if (nq == 8) {
                lookups(tab, idx, P->bits, 8, acc);
                if (P->g == 64) { /* a group per qword: two groups' 8 rows per store */
                    for (int q = 0; q < 8; q += 2) {
                        __m512i a = _mm512_permutex2var_epi32(acc[q], even, acc[q + 1]);
                        __m512i b = _mm512_permutex2var_epi32(acc[q], odd, acc[q + 1]);
                        _mm512_storeu_si512(Im + (G + q) * 8, _mm512_add_epi32(a, b));
                    }
                    G_end = G + 8;
                    continue;
                }
            } else {
                lookups(tab, idx, P->bits, nq, acc);
            }
            /* any g % 32 == 0: units of 32 elements, dwords 2r (unit 2q) and 2r+1 (2q+1) */
            __m256i ga = gacc[m - m0];
            int64_t u = unit, Gm = G;
            for (int q = 0; q < nq; q++) {
                if (upg >= 2 && u + 2 <= upg) {
                    __m512i both = _mm512_add_epi32(acc[q], _mm512_srli_epi64(acc[q], 32));
                    ga = _mm256_add_epi32(ga, _mm512_cvtepi64_epi32(both));
                    u += 2;
                    if (u == upg) {
                        _mm256_storeu_si256((__m256i *)(Im + Gm * 8), ga);
                        ga = _mm256_setzero_si256();
                        u = 0;
                        Gm++;
                    }
                    continue;
                }
                for (int e = 0; e < 2 && 8 * q + 4 * e < nb; e++) {
                    __m512i v = e ? _mm512_srli_epi64(acc[q], 32) : acc[q];
                    ga = _mm256_add_epi32(ga, _mm512_cvtepi64_epi32(v));
                    if (++u == upg) {
                        _mm256_storeu_si256((__m256i *)(Im + Gm * 8), ga);
                        ga = _mm256_setzero_si256();
                        u = 0;
                        Gm++;
                    }
                }
            }
            gacc[m - m0] = ga;
            unit_end = u;
            G_end = Gm;
        }
        unit = unit_end;
        G = G_end;
    }
}

/* g = 64 (a group per qword), nbk blocks of 8 rows at n0: the group integers of block k
   and activation row m -> I[(m - m0) * Istride + k * ld + G * 8 + row]. The table
   registers of a pair of qwords serve every block and plane, so a superblock reads each
   activation row's tables once. */
static inline __attribute__((always_inline)) LUT_AVX512 void superblock_g64_nbk(
    const lut_problem *P, int64_t m0, int64_t m1, int64_t n0, int nbk, int32_t *I,
    int64_t Istride, int64_t ld, __m512i *idx) {
    const int64_t rb = P->K / 8, plane = P->N * rb;
    const int bits = P->bits;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t c = 0; c < rb; c += 64) {
        const int nb = (int)(rb - c < 64 ? rb - c : 64);
        const int nq = (nb + 7) / 8;
        const __mmask64 bmask = nb == 64 ? ~(__mmask64)0 : (((__mmask64)1 << nb) - 1);
        /* the next superblock: rb / 2 lines a plane */
        prefetch_next(P->qweight + (n0 + SB) * rb, plane, bits, c / 64 * 32, 32);
        for (int k = 0; k < nbk; k++)
            chunk_indices(P->qweight + (n0 + 8 * k) * rb + c, rb, plane, bits, bmask, nq,
                          idx + 64 * k);
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *tab = P->tables + m * P->tables_stride + c / 8 * 256;
            int32_t *Im = I + (m - m0) * Istride + c; /* c / 8 qwords = groups, 8 rows each */
            for (int q = 0; q < nq; q += 2) { /* a q past nq reads padding, stores past K/g */
                const int8_t *t = tab + q * 256;
                const __m512i ta0 = _mm512_loadu_si512(t), ta1 = _mm512_loadu_si512(t + 64),
                              ta2 = _mm512_loadu_si512(t + 128),
                              ta3 = _mm512_loadu_si512(t + 192),
                              tb0 = _mm512_loadu_si512(t + 256),
                              tb1 = _mm512_loadu_si512(t + 320),
                              tb2 = _mm512_loadu_si512(t + 384),
                              tb3 = _mm512_loadu_si512(t + 448);
                for (int k = 0; k < nbk; k++) {
                    const __m512i *ix = idx + 64 * k;
                    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
                    for (int p = 0; p < bits; p++) {
                        const __m512i pw = _mm512_set1_epi8((char)(1 << p));
                        const __m512i *i0 = ix + (8 * p + q) * 2;
                        a = _mm512_dpbusd_epi32(a, pw, _mm512_permutex2var_epi8(ta0, i0[0], ta1));
                        a = _mm512_dpbusd_epi32(a, pw, _mm512_permutex2var_epi8(ta2, i0[1], ta3));
                        b = _mm512_dpbusd_epi32(b, pw, _mm512_permutex2var_epi8(tb0, i0[2], tb1));
                        b = _mm512_dpbusd_epi32(b, pw, _mm512_permutex2var_epi8(tb2, i0[3], tb3));
                    }
                    /* rows' two 32-element halves: even + odd dwords; groups q, q + 1 */
                    __m512i sum = _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b),
                                                   _mm512_permutex2var_epi32(a, odd, b));
                    _mm512_storeu_si512(Im + k * ld + q * 8, sum);
                }
            }
        }
    }
}

static LUT_AVX512 void superblock_g64(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                                      int nbk, int32_t *I, int64_t Istride, int64_t ld,
                                      __m512i *idx) {
    switch (nbk) { /* a constant count for each, so the block loop unrolls */
    case 4: superblock_g64_nbk(P, m0, m1, n0, 4, I, Istride, ld, idx); break;
    case 3: superblock_g64_nbk(P, m0, m1, n0, 3, I, Istride, ld, idx); break;
    case 2: superblock_g64_nbk(P, m0, m1, n0, 2, I, Istride, ld, idx); break;
    default: superblock_g64_nbk(P, m0, m1, n0, 1, I, Istride, ld, idx); break;
    }
}

/* s or m of 8 rows, all groups, as float dst[G * 8 + row], up to K/g rounded up to 4:
   per 32 groups an 8x8 qword transpose (a qword = 4 groups of a row), then vpermw puts the
   rows of each group together. */
static inline LUT_AVX512 void transpose_sm8_avx512(const uint16_t *src, int64_t ngroups,
                                                   float *dst) {
    /* word g * 8 + r <- word r * 4 + g */
    const __m512i perm = _mm512_set_epi16(31, 27, 23, 19, 15, 11, 7, 3, 30, 26, 22, 18, 14, 10,
                                          6, 2, 29, 25, 21, 17, 13, 9, 5, 1, 28, 24, 20, 16, 12,
                                          8, 4, 0);
    for (int64_t G = 0; G < ngroups; G += 32) {
        const int64_t left = ngroups - G;
        const __mmask32 mask = left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
        __m512i z[8];
        for (int r = 0; r < 8; r++) {
            z[r] = _mm512_maskz_loadu_epi16(mask, src + r * ngroups + G);
            /* the same block of the next superblock */
            _mm_prefetch((const char *)(src + (SB + r) * ngroups + G), _MM_HINT_T0);
        }
        transpose8x8_epi64(z);
        for (int c = 0; c < 8 && 4 * c < left; c++) {
            __m512i v = _mm512_permutexvar_epi16(perm, z[c]);
            _mm512_storeu_ps(dst + (G + 4 * c) * 8, _mm512_cvtph_ps(_mm512_castsi512_si256(v)));
            _mm512_storeu_ps(dst + (G + 4 * c + 2) * 8,
                             _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)));
        }
    }
}

static LUT_AVX512 void rows_avx512(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                                   int64_t n1, lut_scratch *S) {
    const int64_t ngroups = P->K / P->g, N = P->N, ld = S->ld;
    int64_t n = n0;
    while (n + 8 <= n1) { /* superblocks of up to 4 blocks of 8 rows */
        const int nbk = (int)((n1 - n) / 8 < 4 ? (n1 - n) / 8 : 4);
        for (int k = 0; k < nbk; k++) {
            const int64_t r = (n + 8 * k) * ngroups;
            transpose_sm8_avx512(P->scales + r, ngroups, S->s + k * ld);
            transpose_sm8_avx512(P->mins + r, ngroups, S->mn + k * ld);
        }
        /* prefill: the superblock shares table registers over its 4 blocks; decode reads
           block by block (fewer interleaved weight streams) */
        if (P->g == 64 && m1 - m0 > 1)
            superblock_g64(P, m0, m1, n, nbk, S->I, 4 * ld, ld, S->idx);
        else
            for (int k = 0; k < nbk; k++)
                block8_avx512(P, m0, m1, n + 8 * k, S->I + k * ld, 4 * ld, S->idx);
        for (int64_t m = m0; m < m1; m++) { /* a chain per block */
            chain_t ch[4];
            for (int k = 0; k < nbk; k++)
                ch[k] = (chain_t){S->I + (m - m0) * 4 * ld + k * ld, S->s + k * ld,
                                  S->mn + k * ld, P->c1 + m * ngroups, P->c2 + m * ngroups,
                                  P->asum + m * ngroups, P->y + m * N + n + 8 * k};
            epilogue(ch, ngroups, nbk);
        }
        n += 8 * nbk;
    }
    if (n < n1)
        for (int64_t m = m0; m < m1; m++) rows_scalar(P, m, n, n1, S->I);
}
#endif /* INFER_X86 */

#if defined(__aarch64__)
/* ------------------------------------------------------------------------------------ */
/* NEON: 16 rows x 16 bytes per plane, byte-transposed, tbl                               */
/* ------------------------------------------------------------------------------------ */

/* build_tables, 4 tables (16 activations) at a time, lanes = tables: the same operations
   per lane as the scalar code, so the same bits (vcvtnq rounds to nearest even, as rintf
   in the default mode; maxnm ignores a NaN as the scalar compare does). Needs g % 16 == 0. */
static void build_tables_neon(const float *x, int64_t K, int g, int bits, int8_t *tables,
                              float *c1, float *c2, float *asum) {
    const int64_t ngroups = K / g;
    const float half_levels = 0.5f * (float)((1 << bits) - 1);
    const int32x4_t lim = vdupq_n_s32(127), nlim = vdupq_n_s32(-127);
    /* table k of 4 from the bytes {B0, B1} = entry e, table k at 4e + k, and their
       negatives {N0, N1} at 32 + 4e + k: entries 0..7, then 7..0 negated (the mirror) */
    uint8x16_t sel[4];
    for (int k = 0; k < 4; k++) {
        uint8_t v[16];
        for (int e = 0; e < 8; e++) v[e] = (uint8_t)(4 * e + k), v[15 - e] = (uint8_t)(32 + v[e]);
        sel[k] = vld1q_u8(v);
    }
    memset(tables + K / 64 * 256, 0, tables_bytes(K) - K / 64 * 256); /* past K */
    for (int64_t G = 0; G < ngroups; G++) {
        const float *xg = x + G * g;
        float32x4_t amax = vdupq_n_f32(0.0f);
        float A = 0.0f;
        for (int64_t c = 0; c < g; c += 16) {
            const float32x4x4_t a = vld4q_f32(xg + c); /* a.val[i] = a_i of 4 tables */
            float32x4_t sa = vaddq_f32(vaddq_f32(vaddq_f32(vabsq_f32(a.val[0]),
                                                           vabsq_f32(a.val[1])),
                                                 vabsq_f32(a.val[2])),
                                       vabsq_f32(a.val[3]));
            amax = vmaxnmq_f32(amax, sa);
            float t[4];
            vst1q_f32(t, vaddq_f32(vaddq_f32(vaddq_f32(a.val[0], a.val[1]), a.val[2]), a.val[3]));
            for (int k = 0; k < 4; k++) A += t[k]; /* sequential, in table order */
        }
        const float am = vmaxnmvq_f32(amax);
        const float inv = am >= AMAX_MIN ? 127.0f / am : 0.0f;
        c1[G] = (am / 127.0f) * 0.5f;
        c2[G] = half_levels * A;
        asum[G] = A;
        for (int64_t c = 0; c < g; c += 16) {
            const float32x4x4_t a = vld4q_f32(xg + c);
            const float32x4_t a0 = a.val[0], a1 = a.val[1], a2 = a.val[2], a3 = a.val[3];
            const float32x4_t n0 = vnegq_f32(a0), n2 = vnegq_f32(a2);
            const float32x4_t p01[4] = {vsubq_f32(n0, a1), vsubq_f32(a0, a1), vaddq_f32(n0, a1),
                                        vaddq_f32(a0, a1)};
            int16x8_t e16[4];
            for (int idx = 0; idx < 8; idx += 2) {
                int32x4_t r[2];
                for (int i = 0; i < 2; i++) {
                    const int d = idx + i;
                    float32x4_t v = vsubq_f32(vaddq_f32(p01[d & 3], (d & 4) ? a2 : n2), a3);
                    r[i] = vminq_s32(vmaxq_s32(vcvtnq_s32_f32(vmulq_n_f32(v, inv)), nlim), lim);
                }
                e16[idx / 2] = vcombine_s16(vmovn_s32(r[0]), vmovn_s32(r[1]));
            }
            /* byte 4e + k: entry e of table k */
            const int8x16_t b0 = vcombine_s8(vmovn_s16(e16[0]), vmovn_s16(e16[1]));
            const int8x16_t b1 = vcombine_s8(vmovn_s16(e16[2]), vmovn_s16(e16[3]));
            const int8x16x4_t src = {{b0, b1, vnegq_s8(b0), vnegq_s8(b1)}};
            /* tables j0 .. j0 + 3: j0, j0 + 2 low nibbles (adjacent slots), j0 + 1, j0 + 3
               high nibbles (128 on) */
            const int64_t j0 = (G * g + c) / 4;
            int8_t *lo = tables + (j0 / 16) * 256 + ((j0 % 16) / 2) * 16, *hi = lo + 128;
            vst1q_s8(lo, vqtbl4q_s8(src, sel[0]));
            vst1q_s8(hi, vqtbl4q_s8(src, sel[1]));
            vst1q_s8(lo + 16, vqtbl4q_s8(src, sel[2]));
            vst1q_s8(hi + 16, vqtbl4q_s8(src, sel[3]));
        }
    }
}

/* R[r] = 16 bytes of row r  ->  O[i] = byte i of rows 0..15: trn1 / trn2 at 8, 16, 32 and
   64 bits; after the stage of width d bytes, register i holds rows (i & ~(2d - 1)) ..
   + 2d - 1 of the columns congruent to i mod 2d. */
static inline void transpose16x16_u8(const uint8x16_t R[16], uint8x16_t O[16]) {
    uint8x16_t A[16], B[16], C[16];
    for (int i = 0; i < 16; i += 2) {
        A[i] = vtrn1q_u8(R[i], R[i + 1]);
        A[i + 1] = vtrn2q_u8(R[i], R[i + 1]);
    }
    for (int i = 0; i < 16; i++) {
        if (i & 2) continue;
        uint16x8_t a = vreinterpretq_u16_u8(A[i]), b = vreinterpretq_u16_u8(A[i + 2]);
        B[i] = vreinterpretq_u8_u16(vtrn1q_u16(a, b));
        B[i + 2] = vreinterpretq_u8_u16(vtrn2q_u16(a, b));
    }
    for (int i = 0; i < 16; i++) {
        if (i & 4) continue;
        uint32x4_t a = vreinterpretq_u32_u8(B[i]), b = vreinterpretq_u32_u8(B[i + 4]);
        C[i] = vreinterpretq_u8_u32(vtrn1q_u32(a, b));
        C[i + 4] = vreinterpretq_u8_u32(vtrn2q_u32(a, b));
    }
    for (int i = 0; i < 8; i++) {
        uint64x2_t a = vreinterpretq_u64_u8(C[i]), b = vreinterpretq_u64_u8(C[i + 8]);
        O[i] = vreinterpretq_u8_u64(vtrn1q_u64(a, b));
        O[i + 8] = vreinterpretq_u8_u64(vtrn2q_u64(a, b));
    }
}

/* The lookups of one plane of a chunk: units [0, nu) (4 bytes each) of O, the transposed
   bytes, in the tables at tab (the chunk's first qword); acc[u][h] += 2^p times the unit's
   sum for rows 8h .. 8h + 7. Inlined with nu = 4 the loops unroll and O stays in
   registers. */
static inline __attribute__((always_inline)) void lookups_neon(const uint8x16_t O[16],
                                                               const int8_t *tab, int nu,
                                                               int16_t pw,
                                                               int16x8_t acc[4][2]) {
    const uint8x16_t low4 = vdupq_n_u8(15);
#pragma GCC unroll 4
    for (int u = 0; u < nu; u++) {
        int16x8_t s0 = vdupq_n_s16(0), s1 = vdupq_n_s16(0); /* rows 0-7, 8-15 */
#pragma GCC unroll 4
        for (int j = 4 * u; j < 4 * u + 4; j++) {
            /* byte j: qword j / 8, position j % 8 */
            const int8_t *t = tab + (j / 8) * 256 + (j % 8) * 16;
            int8x16_t rl = vqtbl1q_s8(vld1q_s8(t), vandq_u8(O[j], low4));
            int8x16_t rh = vqtbl1q_s8(vld1q_s8(t + 128), vshrq_n_u8(O[j], 4));
            s0 = vaddq_s16(s0, vaddl_s8(vget_low_s8(rl), vget_low_s8(rh)));
            s1 = vaddq_s16(s1, vaddl_high_s8(rl, rh));
        }
        acc[u][0] = vmlaq_n_s16(acc[u][0], s0, pw);
        acc[u][1] = vmlaq_n_s16(acc[u][1], s1, pw);
    }
}

/* Group integers of rows [n0, n0+16) for activation row m -> I[h * ld + G * 8 + row] for
   the two halves h of 8 rows. Per chunk of 16 bytes of each plane (4 units of 32
   elements): transpose, then per byte j one tbl of the low nibbles in table (j, low) and
   one of the high nibbles in (j, high); a unit's 8 lookups per row are summed in int16
   (|.| <= 1016), weighted 2^p per plane (<= 15240 over the planes), then widened into
   int32 per group. */
static void block16_neon(const lut_problem *P, int64_t m, int64_t n0, int32_t *I, int64_t ld) {
    const int64_t rb = P->K / 8, upg = P->g / 32, plane = P->N * rb;
    const int8_t *tab = P->tables + m * P->tables_stride;
    int32x4_t gacc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    int64_t unit = 0, G = 0;
    for (int64_t c = 0; c < rb; c += 16) {
        const int nb = (int)(rb - c < 16 ? rb - c : 16); /* bytes, a multiple of 4 */
        int16x8_t acc[4][2];
        for (int u = 0; u < 4; u++) acc[u][0] = acc[u][1] = vdupq_n_s16(0);
        /* the next block of 16 rows: rb / 4 lines a plane, 4 per chunk of 16 bytes */
        prefetch_next(P->qweight + (n0 + 16) * rb, plane, P->bits, c / 16 * 4, 4);
        for (int p = 0; p < P->bits; p++) {
            const uint8_t *w = P->qweight + ((int64_t)p * P->N + n0) * rb + c;
            uint8x16_t R[16], O[16];
            if (nb == 16) {
                for (int r = 0; r < 16; r++) R[r] = vld1q_u8(w + r * rb);
                transpose16x16_u8(R, O);
                lookups_neon(O, tab + c / 8 * 256, 4, (int16_t)(1 << p), acc);
            } else { /* the last chunk of a row: 4, 8 or 12 bytes */
                for (int r = 0; r < 16; r++) {
                    uint8_t tmp[16] = {0};
                    memcpy(tmp, w + r * rb, (size_t)nb);
                    R[r] = vld1q_u8(tmp);
                }
                transpose16x16_u8(R, O);
                lookups_neon(O, tab + c / 8 * 256, nb / 4, (int16_t)(1 << p), acc);
            }
        }
        for (int u = 0; u < nb / 4; u++) {
            for (int h = 0; h < 2; h++) {
                gacc[2 * h] = vaddw_s16(gacc[2 * h], vget_low_s16(acc[u][h]));
                gacc[2 * h + 1] = vaddw_high_s16(gacc[2 * h + 1], acc[u][h]);
            }
            if (++unit == upg) {
                for (int h = 0; h < 2; h++) {
                    vst1q_s32(I + h * ld + G * 8, gacc[2 * h]);
                    vst1q_s32(I + h * ld + G * 8 + 4, gacc[2 * h + 1]);
                }
                for (int k = 0; k < 4; k++) gacc[k] = vdupq_n_s32(0);
                unit = 0;
                G++;
            }
        }
    }
}

/* s or m of 8 rows, all groups, as float dst[G * 8 + row] (the epilogue reads rows in
   lanes): 4x4 float transposes; the last ngroups % 4 groups one by one. Prefetches the
   same half of the next block of 16 rows. */
static inline void transpose_sm8_neon(const uint16_t *src, int64_t ngroups, float *dst) {
    int64_t G = 0;
    for (; G + 4 <= ngroups; G += 4) {
        float32x4_t v[8];
        for (int r = 0; r < 8; r++) {
            v[r] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(src + r * ngroups + G)));
            __builtin_prefetch(src + (r + 16) * ngroups + G, 0, 3);
        }
        for (int h = 0; h < 2; h++) { /* rows 4h .. 4h + 3 */
            const float32x4_t *q = v + 4 * h;
            float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(q[0], q[1]));
            float64x2_t t1 = vreinterpretq_f64_f32(vtrn2q_f32(q[0], q[1]));
            float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(q[2], q[3]));
            float64x2_t t3 = vreinterpretq_f64_f32(vtrn2q_f32(q[2], q[3]));
            vst1q_f32(dst + G * 8 + 4 * h, vreinterpretq_f32_f64(vtrn1q_f64(t0, t2)));
            vst1q_f32(dst + (G + 1) * 8 + 4 * h, vreinterpretq_f32_f64(vtrn1q_f64(t1, t3)));
            vst1q_f32(dst + (G + 2) * 8 + 4 * h, vreinterpretq_f32_f64(vtrn2q_f64(t0, t2)));
            vst1q_f32(dst + (G + 3) * 8 + 4 * h, vreinterpretq_f32_f64(vtrn2q_f64(t1, t3)));
        }
    }
    for (; G < ngroups; G++)
        for (int r = 0; r < 8; r++) dst[G * 8 + r] = half_to_float(src[r * ngroups + G]);
}

/* The epilogue of 16 rows (two halves of 8 at ld apart in I, s and mn), activation row
   constants c1, c2, asum: the canonical order per row, 4 independent FMA chains.
   vfmaq_n_f32(a, b, n) = fma(b, n, a): u = fma(c1, I, c2) as the scalar path's fmaf. */
static void epilogue16_neon(const int32_t *I, const float *s, const float *mn, int64_t ld,
                            const float *c1, const float *c2, const float *asum,
                            int64_t ngroups, float *y) {
    float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f),
                          vdupq_n_f32(0.0f)};
    for (int64_t G = 0; G < ngroups; G++)
        for (int k = 0; k < 4; k++) { /* rows 4k .. 4k + 3: half k / 2, lanes 4 (k % 2) */
            const int64_t o = (k / 2) * ld + G * 8 + 4 * (k % 2);
            float32x4_t u = vfmaq_n_f32(vdupq_n_f32(c2[G]), vcvtq_f32_s32(vld1q_s32(I + o)), c1[G]);
            acc[k] = vfmaq_f32(acc[k], vld1q_f32(s + o), u);
            acc[k] = vfmaq_n_f32(acc[k], vld1q_f32(mn + o), asum[G]);
        }
    for (int k = 0; k < 4; k++) vst1q_f32(y + 4 * k, acc[k]);
}

static void rows_neon(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                      lut_scratch *S) {
    const int64_t ngroups = P->K / P->g, ld = S->ld;
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16) {
        for (int h = 0; h < 2; h++) {
            transpose_sm8_neon(P->scales + (n + 8 * h) * ngroups, ngroups, S->s + h * ld);
            transpose_sm8_neon(P->mins + (n + 8 * h) * ngroups, ngroups, S->mn + h * ld);
        }
        for (int64_t m = m0; m < m1; m++) { /* prefill: the block's weights stay in L1 */
            block16_neon(P, m, n, S->I, ld);
            epilogue16_neon(S->I, S->s, S->mn, ld, P->c1 + m * ngroups, P->c2 + m * ngroups,
                            P->asum + m * ngroups, ngroups, P->y + m * P->N + n);
        }
    }
    if (n < n1)
        for (int64_t m = m0; m < m1; m++) rows_scalar(P, m, n, n1, S->I);
}
#endif /* __aarch64__ */

/* ------------------------------------------------------------------------------------ */
/* Driver: tables once per activation row, then row blocks on the pool                   */
/* ------------------------------------------------------------------------------------ */

/* Rows per block in a task: the SIMD paths' superblocks (32; 16 and 8 at the end) */
enum { LUT_BLOCK = SB };
/* Activation rows per pass (prefill): their tables stay in L2 (~256 KB) while every row
   block passes over them; the block's weights stay in L1/L2 across the pass's rows. */
enum { TABLE_TILE_BYTES = 256 * 1024 };

static int64_t scratch_ld(int64_t K, int g) { return 8 * ((K / g + 31) / 32 * 32); }

/* The path lut.c runs for a requested one (cached: CPUID is slow in a VM): its AVX-512
   path (ISA_AVX512_VNNI) also needs VBMI (Ice Lake, Zen 4 and later); plain avx512 promises
   no VNNI, so it and the AVX-VNNI level run the AVX2 path; neondot runs the NEON path. */
static int lut_isa_detect(int isa) {
#ifdef INFER_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX512_VNNI && isa_supported(ISA_AVX512_VNNI) &&
        __builtin_cpu_supports("avx512vbmi"))
        return ISA_AVX512_VNNI;
    if ((isa == ISA_AVX2 || isa == ISA_AVX2_VNNI || isa == ISA_AVX512 ||
         isa == ISA_AVX512_VNNI) &&
        isa_supported(ISA_AVX2))
        return ISA_AVX2;
#endif
#if defined(__aarch64__)
    if ((isa == ISA_NEON || isa == ISA_NEON_DOT) && isa_supported(isa)) return ISA_NEON;
#endif
    (void)isa;
    return ISA_SCALAR;
}

static int lut_isa(int isa) {
    static _Atomic int cache[ISA_COUNT]; /* path + 1; 0: not yet known */
    if (isa < 0 || isa >= ISA_COUNT) return ISA_SCALAR;
    int c = atomic_load_explicit(&cache[isa], memory_order_relaxed);
    if (!c) atomic_store_explicit(&cache[isa], c = lut_isa_detect(isa) + 1, memory_order_relaxed);
    return c - 1;
}

/* Activation rows [m0, m1) x weight rows [n0, n1). */
static void rows_any(const lut_problem *P, int isa, int64_t m0, int64_t m1, int64_t n0,
                     int64_t n1, lut_scratch *S) {
#ifdef INFER_X86
    if (P->g % 32 == 0 && isa == ISA_AVX512_VNNI) {
        rows_avx512(P, m0, m1, n0, n1, S);
        return;
    }
    if (P->g % 32 == 0 && isa == ISA_AVX2) {
        rows_avx2(P, m0, m1, n0, n1, S);
        return;
    }
#endif
#if defined(__aarch64__)
    if (P->g % 32 == 0 && isa == ISA_NEON) {
        rows_neon(P, m0, m1, n0, n1, S);
        return;
    }
#endif
    (void)isa;
    for (int64_t m = m0; m < m1; m++) rows_scalar(P, m, n0, n1, S->I);
}

typedef struct {
    lut_problem P; /* for the current pass: M = its rows, tables and y offset to it */
    const float *x; /* the pass's activation rows (P.M, K) */
    int isa;
    int64_t rows; /* weight rows per task */
    lut_scratch *scratch; /* per thread */
} lut_job;

/* One activation row's tables and constants, on the fastest builder (same bits). */
static void tables_row(const float *x, int64_t K, int g, int bits, int isa, int8_t *tables,
                       float *c1, float *c2, float *asum) {
#ifdef INFER_X86
    if (isa != ISA_SCALAR && g % 32 == 0) {
        build_tables_avx2(x, K, g, bits, tables, c1, c2, asum);
        return;
    }
#endif
#if defined(__aarch64__)
    if (isa == ISA_NEON && g % 16 == 0) {
        build_tables_neon(x, K, g, bits, tables, c1, c2, asum);
        return;
    }
#endif
    (void)isa;
    build_tables(x, K, g, bits, tables, c1, c2, asum);
}

static void tables_task(void *ctx, int64_t m, int tid) {
    (void)tid;
    const lut_job *J = ctx;
    const lut_problem *P = &J->P;
    const int64_t ng = P->K / P->g;
    tables_row(J->x + m * P->K, P->K, P->g, P->bits, J->isa,
               (int8_t *)P->tables + m * P->tables_stride, (float *)P->c1 + m * ng,
               (float *)P->c2 + m * ng, (float *)P->asum + m * ng);
}

static void rows_task(void *ctx, int64_t t, int tid) {
    const lut_job *J = ctx;
    const int64_t n0 = t * J->rows, n1 = n0 + J->rows < J->P.N ? n0 + J->rows : J->P.N;
    rows_any(&J->P, J->isa, 0, J->P.M, n0, n1, &J->scratch[tid]);
}

/* Weight rows per task over N rows, in whole blocks: `per` tasks per thread. A GEMV takes
   kernels.h's GEMV_TASKS_PER_THREAD; a GEMM 4 (a 1B lut2's 64-token prompt ran 18 % slower
   with 2, benchmarks/ab_extension.py). */
enum { GEMM_TASKS_PER_THREAD = 4 };
static int64_t task_rows(int64_t N, int nthreads, int per) {
    const int64_t blocks = (N + LUT_BLOCK - 1) / LUT_BLOCK;
    const int64_t want = (int64_t)per * nthreads;
    const int64_t tasks = want < blocks ? want : blocks;
    return (blocks + tasks - 1) / tasks * LUT_BLOCK;
}

/* Per-thread scratch for nthreads threads, group integers of nI int32 and scratch width
   ld: idx (IDX_BYTES), I (nI), s and mn (4 * ld each), in one block *mem (free both the
   block and the returned array); NULL when out of memory. */
static lut_scratch *scratch_new(int nthreads, int64_t ld, int64_t nI, char **mem) {
    const size_t per_thread = IDX_BYTES + 4 * (size_t)(nI + 8 * ld);
    char *scr = *mem = aligned_alloc(64, per_thread * (size_t)nthreads);
    lut_scratch *scratch = malloc(sizeof(lut_scratch) * (size_t)nthreads);
    if (!scr || !scratch) {
        free(scratch);
        return NULL;
    }
    for (int t = 0; t < nthreads; t++) {
        char *b = scr + per_thread * t;
        float *f = (float *)(b + IDX_BYTES + 4 * nI);
        scratch[t] = (lut_scratch){(int32_t *)(b + IDX_BYTES), f, f + 4 * ld, ld, b};
    }
    return scratch;
}

/* y (M, N) = x (M, K) W^T (declared in kernels.h). Returns 0, or -1 when out of memory. */
int lut_matmul(const float *x, const uint8_t *qw, const uint16_t *scales,
                      const uint16_t *mins, float *y, int64_t M, int64_t N, int64_t K, int bits,
                      int g, int isa, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    isa = lut_isa(isa);
    const int64_t ng = K / g, stride = (int64_t)tables_bytes(K);
    int64_t tile = TABLE_TILE_BYTES / stride;
    tile = tile < 1 ? 1 : tile > MAX_TILE_M ? MAX_TILE_M : tile;
    if (tile > M) tile = M;
    if (nthreads < 1) nthreads = 1;
    if (M == 1) nthreads = gemv_threads(N * K * bits / 8, nthreads);
    const int64_t rows = task_rows(N, nthreads, M == 1 ? GEMV_TASKS_PER_THREAD
                                                       : GEMM_TASKS_PER_THREAD);
    const int64_t tasks = (N + rows - 1) / rows;

    const int64_t ld = scratch_ld(K, g);
    int8_t *tables = aligned_alloc(64, (size_t)(tile * stride));
    float *consts = malloc(sizeof(float) * 3 * (size_t)(tile * ng));
    char *scr = NULL;
    lut_scratch *scratch = scratch_new(nthreads, ld, tile * 4 * ld, &scr);
    int rc = 0;
    if (!tables || !consts || !scratch) {
        rc = -1;
        goto done;
    }
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
        const int64_t mt = M - m0 < tile ? M - m0 : tile;
        lut_job J = {
            .P = {mt, K, N, bits, g, qw, scales, mins, tables, stride, consts, consts + mt * ng,
                  consts + 2 * mt * ng, y + m0 * N},
            .x = x + m0 * K,
            .isa = isa,
            .rows = rows,
            .scratch = scratch,
        };
        if (mt == 1)
            tables_task(&J, 0, 0);
        else
            pool_run(nthreads, mt, tables_task, &J);
        pool_run(nthreads, tasks, rows_task, &J);
    }
done:
    free(tables);
    free(consts);
    free(scr);
    free(scratch);
    return rc;
}

/* Several GEMVs as one pool job (declared in kernels.h): tasks numbered across the
   matrices in order; matrices with the same x, K and g share its tables (c2 is per bit
   width: build_tables' half_levels * A, recomputed here in the same float operation). */
typedef struct {
    int n;
    lut_job jobs[Q_GEMV_MANY_MAX];
    int64_t first[Q_GEMV_MANY_MAX + 1]; /* first task of each job; first[n] = all */
} lut_many_job;

static void lut_many_task(void *ctx, int64_t t, int tid) {
    const lut_many_job *m = ctx;
    int i = 0;
    while (t >= m->first[i + 1]) i++;
    rows_task((void *)&m->jobs[i], t - m->first[i], tid);
}

int lut_gemv_many(int n, const lut_gemv *a, int isa, int nthreads) {
    if (n < 1 || n > Q_GEMV_MANY_MAX) return n == 0 ? 0 : -1;
    isa = lut_isa(isa);
    if (nthreads < 1) nthreads = 1;
    int64_t bytes = 0, ld = 0, table_bytes = 0, consts = 0;
    int owner[Q_GEMV_MANY_MAX]; /* the first matrix with the same x, K and g */
    for (int i = 0; i < n; i++) {
        bytes += a[i].N * a[i].K * a[i].bits / 8;
        const int64_t l = scratch_ld(a[i].K, a[i].g);
        ld = l > ld ? l : ld;
        owner[i] = i;
        for (int k = 0; k < i && owner[i] == i; k++)
            if (a[k].x == a[i].x && a[k].K == a[i].K && a[k].g == a[i].g) owner[i] = k;
        if (owner[i] == i) { /* its tables, c1 and asum */
            table_bytes += (int64_t)tables_bytes(a[i].K);
            consts += 2 * a[i].K / a[i].g;
        }
        consts += a[i].K / a[i].g; /* c2 */
    }
    nthreads = gemv_threads(bytes, nthreads);
    int8_t *tables = aligned_alloc(64, (size_t)(table_bytes + 63) / 64 * 64);
    float *cbuf = malloc(sizeof(float) * (size_t)consts);
    char *scr = NULL;
    lut_scratch *scratch = scratch_new(nthreads, ld, 4 * ld, &scr); /* one activation row */
    int rc = 0;
    if (!tables || !cbuf || !scratch) {
        rc = -1;
        goto done;
    }
    lut_many_job m = {.n = n};
    int8_t *tp = tables;
    float *cp = cbuf;
    for (int i = 0; i < n; i++) {
        const int64_t K = a[i].K, ng = K / a[i].g, stride = (int64_t)tables_bytes(K);
        lut_problem P = {1, K, a[i].N, a[i].bits, a[i].g, a[i].qw, a[i].scales, a[i].mins,
                         NULL, stride, NULL, NULL, NULL, a[i].y};
        if (owner[i] == i) {
            P.tables = tp, P.c1 = cp, P.asum = cp + ng, P.c2 = cp + 2 * ng;
            tp += stride, cp += 3 * ng;
            tables_row(a[i].x, K, a[i].g, a[i].bits, isa, tp - stride, (float *)P.c1,
                       (float *)P.c2, (float *)P.asum);
        } else {
            const lut_problem *o = &m.jobs[owner[i]].P;
            P.tables = o->tables, P.c1 = o->c1, P.asum = o->asum, P.c2 = cp;
            const float half_levels = 0.5f * (float)((1 << a[i].bits) - 1);
            for (int64_t G = 0; G < ng; G++) cp[G] = half_levels * o->asum[G];
            cp += ng;
        }
        const int64_t rows = task_rows(a[i].N, nthreads, GEMV_TASKS_PER_THREAD);
        m.jobs[i] = (lut_job){.P = P, .x = a[i].x, .isa = isa, .rows = rows, .scratch = scratch};
        m.first[i + 1] = m.first[i] + (a[i].N + rows - 1) / rows;
    }
    pool_run(nthreads, m.first[n], lut_many_task, &m);
done:
    free(tables);
    free(cbuf);
    free(scr);
    free(scratch);
    return rc;
}

#ifndef INFER_NO_PYTHON
/* ------------------------------------------------------------------------------------ */
/* Python functions, added to infer.kernels_cpu._C by module.c                           */
/* ------------------------------------------------------------------------------------ */

static int bad_sizes(const char *name, long long M, long long K, long long bits, long long g) {
    if (M < 0 || K <= 0 || bits < 1 || bits > 4 || g <= 0 || g % 8 || K % g) {
        PyErr_Format(PyExc_ValueError, "%s: bad sizes M=%lld K=%lld bits=%lld g=%lld", name, M, K,
                     bits, g);
        return 1;
    }
    return 0;
}

/* isa_supported, cached: its CPUID is slow in a VM and decode calls ~200 matmuls a token */
static int bad_isa(long long isa) {
    static _Atomic int ok[ISA_COUNT]; /* 1 + supported; 0: not yet known */
    int c = isa >= 0 && isa < ISA_COUNT ? atomic_load_explicit(&ok[isa], memory_order_relaxed) : 1;
    if (!c) atomic_store_explicit(&ok[isa], c = 1 + isa_supported((int)isa), memory_order_relaxed);
    if (c != 2) {
        PyErr_Format(PyExc_ValueError, "instruction set %lld is not available on this CPU", isa);
        return 1;
    }
    return 0;
}

/* lut_matmul(x, qweight, scales, mins, y, M, N, K, bits, g, isa, threads) */
static PyObject *py_lut_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[12];
    if (infer_parse_ints(args, nargs, 12, v, "lut_matmul")) return NULL;
    if (bad_sizes("lut_matmul", v[5], v[7], v[8], v[9])) return NULL;
    if (v[6] < 0 || ((v[5] && v[6]) && (!v[0] || !v[1] || !v[2] || !v[3] || !v[4]))) {
        PyErr_SetString(PyExc_ValueError, "lut_matmul: bad N or null data pointer");
        return NULL;
    }
    if (bad_isa(v[10])) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = lut_matmul((const float *)(intptr_t)v[0], (const uint8_t *)(intptr_t)v[1],
                    (const uint16_t *)(intptr_t)v[2], (const uint16_t *)(intptr_t)v[3],
                    (float *)(intptr_t)v[4], v[5], v[6], v[7], (int)v[8], (int)v[9], (int)v[10],
                    v[11] < 1 ? 1 : v[11] > 255 ? 255 : (int)v[11]);
    Py_END_ALLOW_THREADS;
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* lut_tables(x, tables, c1, c2, asum, M, K, bits, g, isa): the int8 tables
   (M, lut_tables_bytes(K)) and per-group constants (M, K/g) the matmul builds, for tests. */
static PyObject *py_lut_tables(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[10];
    if (infer_parse_ints(args, nargs, 10, v, "lut_tables")) return NULL;
    if (bad_isa(v[9])) return NULL;
    if (bad_sizes("lut_tables", v[5], v[6], v[7], v[8])) return NULL;
    if (v[5] && (!v[0] || !v[1] || !v[2] || !v[3] || !v[4])) {
        PyErr_SetString(PyExc_ValueError, "lut_tables: null data pointer");
        return NULL;
    }
    const int64_t M = v[5], K = v[6], ng = K / v[8], stride = (int64_t)tables_bytes(K);
    const int isa = lut_isa((int)v[9]);
    for (int64_t m = 0; m < M; m++)
        tables_row((const float *)(intptr_t)v[0] + m * K, K, (int)v[8], (int)v[7], isa,
                   (int8_t *)(intptr_t)v[1] + m * stride, (float *)(intptr_t)v[2] + m * ng,
                   (float *)(intptr_t)v[3] + m * ng, (float *)(intptr_t)v[4] + m * ng);
    Py_RETURN_NONE;
}

static PyObject *py_lut_tables_bytes(PyObject *self, PyObject *arg) {
    (void)self;
    long long K = PyLong_AsLongLong(arg);
    if (K == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(K > 0 ? (long long)tables_bytes(K) : 0);
}

static PyObject *py_lut_isa(PyObject *self, PyObject *arg) {
    (void)self;
    long isa = PyLong_AsLong(arg);
    if (isa == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(lut_isa((int)isa));
}

PyMethodDef infer_lut_methods[] = {
    {"lut_matmul", (PyCFunction)(void (*)(void))py_lut_matmul, METH_FASTCALL,
     "lut_matmul(x, qweight, scales, mins, y, M, N, K, bits, group_size, isa, threads): "
     "y = x W^T, W in lut1..lut4 bit planes (int8 activation tables)"},
    {"lut_tables", (PyCFunction)(void (*)(void))py_lut_tables, METH_FASTCALL,
     "lut_tables(x, tables, c1, c2, asum, M, K, bits, group_size, isa): the matmul's tables"},
    {"lut_tables_bytes", py_lut_tables_bytes, METH_O, "bytes of one activation row's tables"},
    {"lut_isa", py_lut_isa, METH_O, "the path lut_matmul runs for a requested one"},
    {NULL, NULL, 0, NULL},
};
#endif /* INFER_NO_PYTHON */
