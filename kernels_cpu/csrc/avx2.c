/* AVX2 paths (with FMA and F16C): 8 float lanes; "avx2vnni" is the same with AVX-VNNI's
 * vpdpbusd in the int4 and int8 GEMVs. The same algorithms as avx512.c (see there).
 *
 * GEMV: one row at a time. int8: 8 weights widened per FMA; with AVX-VNNI x as three
 * int8 digits, 32 weights per load (fewer instructions a weight than widening to float).
 * int4: x as two int8 digits, 64 weights (32 bytes) per load; for several rows of x
 * (batched decode) int4 and int5 unpack the codes once for up to 4 rows, x as int16. int6:
 * x as int8's digits, a block's quarter (32 weights) widened to bytes per dot product.
 * GEMM: 4 x 2 blocks of dot products (8 accumulators, 6 loads per 8 FMAs: 16 registers
 * do not hold the 4 x 4 block avx512.c uses). From 16 rows of x, the integer GEMM
 * (igemm.c): with AVX-VNNI here, 16 rows of x by 3 rows of codes; without it the same x
 * (ig_xprep) and igemm_avx2.c's vpmaddubsw panel.
 */
#include <string.h>

#include "kernels.h"

#ifdef INFER_X86
#include <immintrin.h>

#define T TARGET_AVX2 static
#define TI TARGET_AVX2 static inline __attribute__((always_inline))


/* Sum of 8 lanes: (i, i + 4), then (0 + 1) + (2 + 3). */
TI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

TI __m256 bcast_half(const uint16_t *p) { return _mm256_set1_ps(_cvtsh_ss(*p)); }

TI int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

TI __m256 widen_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Mask of the first n < 8 lanes, for maskload / maskstore. */
TI __m256i first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 int8 (n < 8 of them, the rest zero) -> float */
TI __m256 widen_i8_part(const int8_t *p, int64_t n) {
    int8_t tmp[8] = {0};
    memcpy(tmp, p, (size_t)n);
    return widen_i8(tmp);
}

/* 16 bytes of int4 -> codes of elements 0..7, 8..15 (lo) and 16..23, 24..31 (hi) */
TI void widen_i4(const uint8_t *p, __m256i c[4]) {
    __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    const __m256i m = _mm256_set1_epi32(15);
    c[0] = _mm256_and_si256(v0, m);
    c[1] = _mm256_and_si256(v1, m);
    c[2] = _mm256_srli_epi32(v0, 4);
    c[3] = _mm256_srli_epi32(v1, 4);
}

/* n < 8 float16 (the rest zero) -> float */
TI __m256 halfs_part(const uint16_t *p, int64_t n) {
    uint16_t tmp[8] = {0};
    memcpy(tmp, p, (size_t)n * sizeof *tmp);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tmp));
}

/* sum_g c[g] * xsum[g]: the int4 GEMV's mins (or -8 d) term of one row */
TI float group_offset(const uint16_t *c, int64_t G, const float *xsum) {
    __m256 off = _mm256_setzero_ps();
    int64_t gi = 0;
    for (; gi + 8 <= G; gi += 8)
        off = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + gi))),
                              _mm256_loadu_ps(xsum + gi), off);
    if (gi < G)
        off = _mm256_fmadd_ps(halfs_part(c + gi, G - gi),
                              _mm256_maskload_ps(xsum + gi, first_lanes(G - gi)), off);
    return hsum(off);
}

/* GEMV rows one at a time, as one sequential stream (see avx512.c), with ACC
 * independent accumulators combined in a fixed order. */
enum { ACC = 4 };

TI float hsum_acc(const __m256 *acc) {
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

/* ------------------------------------------------------------------------------------
 * int8 GEMV
 * ---------------------------------------------------------------------------------- */

/* Up to 2 rows of x against int8 weight row n, the codes widened once for both; one row
 * alone is the GEMV (q8_gemv), so a row's output is the same alone or beside another
 * (2 rows: their accumulators and sums fill the 16 registers) */
TI void q8_group_rows(const int8_t *q, const qmat *const *a, const int R, int64_t k0,
                      const int64_t g, __m256 *t) {
    __m256 w = widen_i8(q + k0);
    for (int m = 0; m < R; m++) t[m] = _mm256_mul_ps(w, _mm256_loadu_ps(a[m]->x + k0));
    for (int64_t k = k0 + 8; k < k0 + g; k += 8) {
        w = widen_i8(q + k);
        for (int m = 0; m < R; m++) t[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a[m]->x + k), t[m]);
    }
    for (int64_t l = k0; l < k0 + g; l += 64)
        if (!(l & 63)) PREFETCH_STREAM_L1(q + l);
}

TI void q8_rows(const qmat *const *a, const int R, int64_t n, const int64_t g) {
    const int64_t K = a[0]->K;
    const int8_t *q = (const int8_t *)a[0]->qw + n * K;
    __m256 acc[2][ACC], t[2];
    for (int m = 0; m < R; m++)
        for (int i = 0; i < ACC; i++) acc[m][i] = _mm256_setzero_ps();
    if (g) {
        const int64_t G = K / g;
        const uint16_t *s = (const uint16_t *)a[0]->scales + n * G;
        float sc[8] __attribute__((aligned(32)));
        for (int64_t g0 = 0; g0 < G; g0 += 8) {
            const int64_t ng = G - g0 < 8 ? G - g0 : 8;
            _mm256_store_ps(sc, ng == 8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g0)))
                                        : halfs_part(s + g0, ng));
            int64_t j = 0;
            for (; j + ACC <= ng; j += ACC)
                for (int u = 0; u < ACC; u++) {
                    q8_group_rows(q, a, R, (g0 + j + u) * g, g, t);
                    for (int m = 0; m < R; m++)
                        acc[m][u] = _mm256_fmadd_ps(t[m], _mm256_set1_ps(sc[j + u]), acc[m][u]);
                }
            for (; j < ng; j++) {
                q8_group_rows(q, a, R, (g0 + j) * g, g, t);
                for (int m = 0; m < R; m++)
                    acc[m][0] = _mm256_fmadd_ps(t[m], _mm256_set1_ps(sc[j]), acc[m][0]);
            }
        }
        for (int m = 0; m < R; m++) a[m]->y[n] = hsum_acc(acc[m]);
    } else {
        int64_t k = 0;
        for (; k + 8 * ACC <= K; k += 8 * ACC) {
            if (!(k & 63)) PREFETCH_STREAM_L1(q + k);
            for (int i = 0; i < ACC; i++) {
                const __m256 w = widen_i8(q + k + 8 * i);
                for (int m = 0; m < R; m++)
                    acc[m][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a[m]->x + k + 8 * i), acc[m][i]);
            }
        }
        for (; k + 8 <= K; k += 8) {
            const __m256 w = widen_i8(q + k);
            for (int m = 0; m < R; m++)
                acc[m][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a[m]->x + k), acc[m][0]);
        }
        if (k < K) {
            const __m256 w = widen_i8_part(q + k, K - k);
            for (int m = 0; m < R; m++)
                acc[m][0] = _mm256_fmadd_ps(w, _mm256_maskload_ps(a[m]->x + k, first_lanes(K - k)), acc[m][0]);
        }
        for (int m = 0; m < R; m++) a[m]->y[n] = hsum_acc(acc[m]) * ((const float *)a[0]->scales)[n];
    }
}

TI void q8_gemv_row(const qmat *a, int64_t n, const int64_t g) { q8_rows(&a, 1, n, g); }

#define ROWS_LOOP(ROW, g)                                                                        \
    do {                                                                                         \
        for (int64_t n = n0; n < n1; n++) ROW(a, n, g);                                          \
    } while (0)

T void q8_gemv(const qmat *a, int64_t n0, int64_t n1) {
    switch (a->g) {
    case 32: ROWS_LOOP(q8_gemv_row, 32); break;
    case 64: ROWS_LOOP(q8_gemv_row, 64); break;
    case 128: ROWS_LOOP(q8_gemv_row, 128); break;
    default: ROWS_LOOP(q8_gemv_row, 0); break;
    }
}

#define Q8_ROWS(g)                                                                               \
    for (int64_t n = n0; n < n1; n++)                                                           \
        for (int m = 0; m < R; m += 2) R - m == 1 ? q8_rows(a + m, 1, n, g) : q8_rows(a + m, 2, n, g)

/* R rows of float x, 2 at a time per weight row (its later passes read it from L1) */
T void q8_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    switch (a[0]->g) {
    case 32: Q8_ROWS(32); break;
    case 64: Q8_ROWS(64); break;
    case 128: Q8_ROWS(128); break;
    default: Q8_ROWS(0); break;
    }
}

/* ------------------------------------------------------------------------------------
 * int4 GEMV, float (for x with inf or NaN)
 * ---------------------------------------------------------------------------------- */

TI void q4_gemv_row(const qmat *a, int64_t n, const int64_t g) {
    const int64_t K = a->K, KB = K / 2, G = K / g;
    const float *x = a->x;
    const uint8_t *q = (const uint8_t *)a->qw + n * KB;
    const uint16_t *s = (const uint16_t *)a->scales + n * G;
    __m256 acc[ACC];
    for (int i = 0; i < ACC; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < G; gi++) {
        __m256 t = _mm256_setzero_ps();
        for (int64_t k = gi * g; k < gi * g + g; k += 32) {
            __m256i c[4];
            widen_i4(q + k / 2, c);
            for (int i = 0; i < 4; i++)
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[i]), _mm256_loadu_ps(x + k + 8 * i), t);
        }
        acc[0] = _mm256_fmadd_ps(t, bcast_half(s + gi), acc[0]); /* the rare path */
    }
    a->y[n] = hsum_acc(acc) + group_offset((a->mins ? a->mins : (const uint16_t *)a->scales) + n * G, G, a->xsum);
}

T void q4_gemv(const qmat *a, int64_t n0, int64_t n1) {
    switch (a->g) {
    case 32: ROWS_LOOP(q4_gemv_row, 32); break;
    case 64: ROWS_LOOP(q4_gemv_row, 64); break;
    default: ROWS_LOOP(q4_gemv_row, 128); break;
    }
}

/* ------------------------------------------------------------------------------------
 * int4 GEMV on x as int8 digits (avx512.c describes the digits)
 *
 * Chunks of 64 elements = 2 blocks = 32 bytes of a row; a chunk's digits are stored as
 * [digit 1, 0][low, high][32 bytes], then its 8 lane scales (lane l: block l / 4), then
 * for the rows kernels X as int16 (x16_of): per chunk 4 vectors, lane k of vector v the
 * X that the chunk's weight byte 2k + v % 2 multiplies in its low (v < 2) or high nibble.
 * ---------------------------------------------------------------------------------- */

/* 2^k as a float, for -126 <= k <= 127 (the int8 digit GEMV's block scales) */
TI float pow2(int k) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)(k + 127) << 23};
    return v.f;
}

/* One block's exponent e (max |x| < 2^e), or 999 for inf / NaN. */
TI int block_exponent(float amax) {
    union {
        float f;
        uint32_t u;
    } v = {amax};
    const int ef = (int)(v.u >> 23) & 0xff;
    return ef == 0xff ? 999 : (ef ? ef : 1) - 126;
}

enum { CHUNK = 64, CHUNK_BYTES = 2 * 2 * 32 };

/* where q4_xprep's int16 X starts: after C chunks of digits and lane scales */
TI int16_t *x16_of(const void *buf, int64_t C) {
    return (int16_t *)((int8_t *)buf + C * (CHUNK_BYTES + 32));
}

/* 32 int32 X (4 vectors) -> three digits as 32 bytes each, in element order (int8's) */
TI void digits32(const __m256i X[4], __m256i d[3]) {
    __m256i D[3][4];
    for (int i = 0; i < 4; i++) {
        D[2][i] = _mm256_srai_epi32(_mm256_slli_epi32(X[i], 24), 24);
        __m256i X1 = _mm256_srai_epi32(_mm256_sub_epi32(X[i], D[2][i]), 8);
        D[1][i] = _mm256_srai_epi32(_mm256_slli_epi32(X1, 24), 24);
        D[0][i] = _mm256_srai_epi32(_mm256_sub_epi32(X1, D[1][i]), 8);
    }
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int p = 0; p < 3; p++) { /* digits fit int8: the packs do not saturate */
        __m256i ab = _mm256_packs_epi32(D[p][0], D[p][1]), cd = _mm256_packs_epi32(D[p][2], D[p][3]);
        d[p] = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
    }
}

/* 32 int32 X (4 vectors), |X| <= IG_XMAX -> two digits as 32 bytes each, in element order */
TI void digits32_2(const __m256i X[4], __m256i d[2]) {
    __m256i D[2][4];
    for (int i = 0; i < 4; i++) {
        D[1][i] = _mm256_srai_epi32(_mm256_slli_epi32(X[i], 24), 24);
        D[0][i] = _mm256_srai_epi32(_mm256_sub_epi32(X[i], D[1][i]), 8);
    }
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int p = 0; p < 2; p++) { /* digits fit int8: the packs do not saturate */
        __m256i ab = _mm256_packs_epi32(D[p][0], D[p][1]), cd = _mm256_packs_epi32(D[p][2], D[p][3]);
        d[p] = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
    }
}

/* A block of 32 elements (4 vectors) -> max |x|, or -1 if it holds NaN or inf */
TI float block_amax(const __m256 v[4]) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps(), bad = mx;
    for (int j = 0; j < 4; j++) {
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[j], absmask));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v[j], v[j]), _mm256_setzero_ps(),
                                              _CMP_NEQ_UQ)); /* NaN or inf */
    }
    if (_mm256_movemask_ps(bad)) return -1;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* The integer GEMM's X = round(x / sx), sx = amax / IG_XMAX, of a block (4 vectors); sum X */
TI int32_t ig_block_X(const __m256 v[4], float amax, __m256i X[4]) {
    /* tiny blocks scaled up first (exactly) so that IG_XMAX / amax is finite */
    const float up = amax < 0x1p-100f ? 0x1p100f : 1.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0 ? IG_XMAX / (amax * up) : 0);
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        X[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(up)), inv));
        sum = _mm256_add_epi32(sum, X[j]);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
}

T int q4_xprep(const float *x, int64_t K, void *buf) {
    const int64_t C = (K + CHUNK - 1) / CHUNK;
    int8_t *xd = buf;
    float *lanes = (float *)(xd + C * CHUNK_BYTES);
    const __m256i evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t c = 0; c < C; c++) {
        int8_t *d = xd + c * CHUNK_BYTES;
        for (int j = 0; j < 2; j++) {
            const int64_t k = c * CHUNK + 32 * j;
            __m128i *x16 = (__m128i *)(x16_of(buf, C) + 64 * c + 8 * j); /* block j's halves */
            if (k >= K) { /* past the end: zero digits, zero scale */
                for (int p = 0; p < 2; p++) {
                    _mm_store_si128((__m128i *)(d + 64 * p + 16 * j), _mm_setzero_si128());
                    _mm_store_si128((__m128i *)(d + 64 * p + 32 + 16 * j), _mm_setzero_si128());
                }
                for (int v = 0; v < 4; v++) _mm_store_si128(x16 + 2 * v, _mm_setzero_si128());
                for (int i = 0; i < 4; i++) lanes[8 * c + 4 * j + i] = 0;
                continue;
            }
            __m256 xv[4];
            for (int i = 0; i < 4; i++) xv[i] = _mm256_loadu_ps(x + k + 8 * i);
            const float amax = block_amax(xv);
            if (amax < 0) return -1;
            __m256i X[4], dg[2];
            const int32_t sum_x = ig_block_X(xv, amax, X);
            digits32_2(X, dg);
            for (int p = 0; p < 2; p++) { /* elements 0..15 -> low, 16..31 -> high */
                _mm_store_si128((__m128i *)(d + 64 * p + 16 * j), _mm256_castsi256_si128(dg[p]));
                _mm_store_si128((__m128i *)(d + 64 * p + 32 + 16 * j), _mm256_extracti128_si256(dg[p], 1));
            }
            /* elements 0..15 (16..31) as int16, evens then odds: the low (high) nibbles of
             * the block's bytes 0, 2, .. then 1, 3, ..; |X| <= IG_XMAX: no saturation */
            for (int h = 0; h < 2; h++) {
                const __m256i eo = _mm256_packs_epi32(
                    _mm256_permutevar8x32_epi32(X[2 * h], evens_first),
                    _mm256_permutevar8x32_epi32(X[2 * h + 1], evens_first));
                _mm_store_si128(x16 + 4 * h, _mm256_castsi256_si128(eo));
                _mm_store_si128(x16 + 4 * h + 2, _mm256_extracti128_si256(eo, 1));
            }
            const float sx = amax / IG_XMAX;
            for (int i = 0; i < 4; i++) lanes[8 * c + 4 * j + i] = sx;
            xprep4_xs(buf, K)[k / 32] = sx * (float)sum_x;
        }
    }
    return 0;
}

#define DOT2_MADD(t, lo, xl, hi, xh)                                                             \
    _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),        \
                                                           _mm256_maddubs_epi16(hi, xh)),       \
                                          _mm256_set1_epi16(1)))
#define DOT2_VNNI(t, lo, xl, hi, xh)                                                             \
    _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(t, lo, xl), hi, xh)

#define Q4_GEMV_DIGITS(NAME, TARGET, DOT2)                                                       \
    /* sum over chunk c of q * X, per dword lane (8 elements of block 2c + lane / 4) */         \
    TARGET static inline __attribute__((always_inline)) __m256i NAME##_chunk(                   \
        const uint8_t *q, const int8_t *xd, int64_t KB, int64_t c) {                            \
        const __m256i *xc = (const __m256i *)(xd + c * CHUNK_BYTES);                            \
        const __m256i m4 = _mm256_set1_epi8(0x0f);                                              \
        const uint8_t *qc = q + 32 * c;                                                         \
        if (!(c & 1)) PREFETCH_STREAM_L1(qc); /* once per 64 bytes */                              \
        __m256i w = KB - 32 * c >= 32                                                           \
                        ? _mm256_loadu_si256((const __m256i *)qc)                               \
                        : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)qc));          \
        __m256i lo = _mm256_and_si256(w, m4);                                                   \
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);                             \
        __m256i t = DOT2(_mm256_setzero_si256(), lo, xc[0], hi, xc[1]);                         \
        return DOT2(_mm256_slli_epi32(t, 8), lo, xc[2], hi, xc[3]);                             \
    }                                                                                           \
    TARGET static inline __attribute__((always_inline)) void NAME##_row(const qmat *a, int64_t n, \
                                                                        const int64_t g) {      \
        const int64_t K = a->K, KB = K / 2, G = K / g, C = (K + CHUNK - 1) / CHUNK;             \
        const int8_t *xd = a->xq;                                                               \
        const float *lanes = (const float *)(xd + C * CHUNK_BYTES);                             \
        const uint8_t *q = (const uint8_t *)a->qw + n * KB;                                     \
        const uint16_t *s = (const uint16_t *)a->scales + n * G;                                \
        /* g = 32: lanes 0-3 take the chunk's first group, 4-7 its second; else one group */   \
        const __m256i gidx = g == 32 ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)                \
                                     : _mm256_setzero_si256();                                  \
        __m256 acc[ACC];                                                                        \
        for (int i = 0; i < ACC; i++) acc[i] = _mm256_setzero_ps();                             \
        /* chunks in turn to ACC accumulators, the last C % ACC to the first */                \
        for (int64_t c = 0; c < C; c += ACC) {                                                  \
            const int u_end = C - c < ACC ? (int)(C - c) : ACC;                                 \
            for (int u = 0; u < ACC; u++) {                                                     \
                if (u >= u_end) break;                                                          \
                const int64_t cu = c + u;                                                       \
                const uint16_t *sc = s + cu * CHUNK / g; /* the chunk's first group */          \
                int32_t h2 = sc[0];                                                             \
                if (g == 32 && KB - 32 * cu >= 32) h2 |= (int32_t)sc[1] << 16;                  \
                __m256 d = _mm256_permutevar8x32_ps(                                            \
                    _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(h2))), gidx);          \
                __m256 f = _mm256_cvtepi32_ps(NAME##_chunk(q, xd, KB, cu));                     \
                __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(lanes + 8 * cu));               \
                if (u_end == ACC)                                                               \
                    acc[u] = _mm256_fmadd_ps(f, scale, acc[u]);                                 \
                else                                                                            \
                    acc[0] = _mm256_fmadd_ps(f, scale, acc[0]);                                 \
            }                                                                                   \
        }                                                                                       \
        a->y[n] = hsum_acc(acc) +                                                               \
                  group_offset((a->mins ? a->mins : (const uint16_t *)a->scales) + n * G, G,    \
                               a->xsum);                                                        \
    }                                                                                           \
    TARGET static void NAME(const qmat *a, int64_t n0, int64_t n1) {                            \
        switch (a->g) {                                                                         \
        case 32: ROWS_LOOP(NAME##_row, 32); break;                                              \
        case 64: ROWS_LOOP(NAME##_row, 64); break;                                              \
        default: ROWS_LOOP(NAME##_row, 128); break;                                             \
        }                                                                                       \
    }

Q4_GEMV_DIGITS(q4_gemv_digits, TARGET_AVX2, DOT2_MADD)
Q4_GEMV_DIGITS(q4_gemv_digits_vnni, TARGET_AVX2_VNNI, DOT2_VNNI)

/* ------------------------------------------------------------------------------------
 * int5 GEMV on x as int4's digits (same layout, q4_xprep): the nibbles as int4's, with
 * 16 ORed into each code whose qh bit is set; codes <= 31, so vpmaddubsw's pairs stay
 * within int16 (4 * 31 * 128 after DOT2_MADD's add). Groups of 32: a chunk's two blocks.
 * ---------------------------------------------------------------------------------- */

/* 16 where bit j of the chunk's qh (8 bytes in every 64-bit lane of h) is set, for the
 * 32 codes whose qh bytes `idx` picks: byte i of each 128-bit lane tests bit i % 8. */
TI __m256i q5_high(__m256i h, __m256i idx) {
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(h, idx), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

/* chunk c's codes (bytes, <= 31): lo of its bytes' low nibbles, hi of their high ones;
 * full: the chunk has both its blocks */
TI void q5_codes(const uint8_t *q, const uint8_t *qh, int64_t c, const int full, __m256i *lo,
                 __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    /* lanes: block 2c's low (high) 16 codes, then block 2c + 1's: qh bytes 0-1 (2-3) of
     * each block, the blocks' qh at bytes 0-3 and 4-7 */
    const __m256i lo_idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5);
    const __m256i hi_idx = _mm256_add_epi8(lo_idx, _mm256_set1_epi8(2));
    const uint8_t *qc = q + 32 * c;
    if (!(c & 1)) PREFETCH_STREAM_L1(qc); /* once per 64 bytes */
    if (!(c & 7)) PREFETCH_STREAM_L1(qh + 8 * c);
    __m256i w = full ? _mm256_loadu_si256((const __m256i *)qc)
                     : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)qc));
    int64_t hb = full ? 0 : (int64_t)(uint32_t)load_i32(qh + 8 * c);
    if (full) memcpy(&hb, qh + 8 * c, 8);
    const __m256i h = _mm256_set1_epi64x(hb);
    *lo = _mm256_or_si256(_mm256_and_si256(w, m4), q5_high(h, lo_idx));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), q5_high(h, hi_idx));
}

#define Q5_GEMV_DIGITS(NAME, TARGET, DOT2)                                                       \
    /* sum over chunk c of q * X, per dword lane (8 elements of block 2c + lane / 4) */         \
    TARGET static inline __attribute__((always_inline)) __m256i NAME##_chunk(                   \
        const uint8_t *q, const uint8_t *qh, const int8_t *xd, int64_t KB, int64_t c) {         \
        const __m256i *xc = (const __m256i *)(xd + c * CHUNK_BYTES);                            \
        __m256i lo, hi;                                                                         \
        q5_codes(q, qh, c, KB - 32 * c >= 32, &lo, &hi);                                        \
        __m256i t = DOT2(_mm256_setzero_si256(), lo, xc[0], hi, xc[1]);                         \
        return DOT2(_mm256_slli_epi32(t, 8), lo, xc[2], hi, xc[3]);                             \
    }                                                                                           \
    TARGET static void NAME(const qmat *a, int64_t n0, int64_t n1) {                            \
        const int64_t K = a->K, KB = K / 2, G = K / 32, C = (K + CHUNK - 1) / CHUNK;            \
        const int8_t *xd = a->xq;                                                               \
        const float *lanes = (const float *)(xd + C * CHUNK_BYTES);                             \
        const __m256i gidx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);                         \
        for (int64_t n = n0; n < n1; n++) {                                                     \
            const uint8_t *q = (const uint8_t *)a->qw + n * KB, *qh = a->qh + n * (K / 8);      \
            const uint16_t *s = (const uint16_t *)a->scales + n * G;                            \
            __m256 acc[ACC];                                                                    \
            for (int i = 0; i < ACC; i++) acc[i] = _mm256_setzero_ps();                         \
            /* chunks in turn to ACC accumulators, the last C % ACC to the first */            \
            for (int64_t c = 0; c < C; c += ACC) {                                              \
                const int u_end = C - c < ACC ? (int)(C - c) : ACC;                             \
                for (int u = 0; u < ACC; u++) {                                                 \
                    if (u >= u_end) break;                                                      \
                    const int64_t cu = c + u;                                                   \
                    int32_t h2 = s[2 * cu]; /* the chunk's two scales */                        \
                    if (KB - 32 * cu >= 32) h2 |= (int32_t)s[2 * cu + 1] << 16;                 \
                    __m256 d = _mm256_permutevar8x32_ps(                                        \
                        _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(h2))), gidx);      \
                    __m256 f = _mm256_cvtepi32_ps(NAME##_chunk(q, qh, xd, KB, cu));             \
                    __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(lanes + 8 * cu));           \
                    if (u_end == ACC)                                                           \
                        acc[u] = _mm256_fmadd_ps(f, scale, acc[u]);                             \
                    else                                                                        \
                        acc[0] = _mm256_fmadd_ps(f, scale, acc[0]);                             \
                }                                                                               \
            }                                                                                   \
            a->y[n] = hsum_acc(acc) +                                                           \
                      group_offset((a->mins ? a->mins : (const uint16_t *)a->scales) + n * G,   \
                                   G, a->xsum);                                                 \
        }                                                                                       \
    }

Q5_GEMV_DIGITS(q5_gemv_digits, TARGET_AVX2, DOT2_MADD)
Q5_GEMV_DIGITS(q5_gemv_digits_vnni, TARGET_AVX2_VNNI, DOT2_VNNI)

/* ------------------------------------------------------------------------------------
 * int4 and int5 GEMVs over several rows of x (plain AVX2)
 *
 * A chunk's codes are unpacked once for up to 4 rows of x, as int16 with even and odd
 * bytes apart; then per row one vpmaddwd per 16 codes with X as int16 (x16_of): lane l
 * sums the products of the weight bytes 4l..4l+3, DOT2_MADD's lane l, exactly. The
 * floats are the one-row kernel's, op for op, so each row's y is its one-row y bit for bit.
 * ---------------------------------------------------------------------------------- */

/* chunk c's codes as int16: the low nibbles of its even bytes, of its odd bytes, then
 * the high nibbles the same (the order of x16_of's vectors) */
TI void q45_codes(const uint8_t *q, const uint8_t *qh, int64_t c, const int full, const int five,
                  __m256i v[4]) {
    if (five) {
        __m256i lo, hi;
        q5_codes(q, qh, c, full, &lo, &hi);
        const __m256i ff = _mm256_set1_epi16(0xff);
        v[0] = _mm256_and_si256(lo, ff), v[1] = _mm256_srli_epi16(lo, 8);
        v[2] = _mm256_and_si256(hi, ff), v[3] = _mm256_srli_epi16(hi, 8);
        return;
    }
    const uint8_t *qc = q + 32 * c;
    if (!(c & 1)) PREFETCH_STREAM_L1(qc); /* once per 64 bytes */
    const __m256i w = full ? _mm256_loadu_si256((const __m256i *)qc)
                           : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)qc));
    const __m256i m4 = _mm256_set1_epi16(0x0f);
    v[0] = _mm256_and_si256(w, m4), v[1] = _mm256_and_si256(_mm256_srli_epi16(w, 8), m4);
    v[2] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4), v[3] = _mm256_srli_epi16(w, 12);
}

/* chunk c's group scales d over its lanes, the values the one-row kernel takes */
TI __m256 q45_d(const uint16_t *s, int64_t c, const int full, const int64_t g) {
    const uint16_t *sc = s + c * CHUNK / g;
    if (g > 32) return _mm256_set1_ps(_cvtsh_ss(sc[0]));
    const int32_t h2 = full ? load_i32(sc) : sc[0];
    const __m256i gidx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(h2));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d2), gidx);
}

/* Chunk c into acc[m] for each of R rows, as one row adds it to its accumulator. */
TI void q45_chunk_rows(const uint8_t *q, const uint8_t *qh, const uint16_t *s, int64_t c,
                       const int full, const int64_t g, const int five, const int R,
                       const int16_t *const *x16, const float *const *lanes, __m256 *acc) {
    __m256i v[4];
    q45_codes(q, qh, c, full, five, v);
    const __m256 d = q45_d(s, c, full, g);
    for (int m = 0; m < R; m++) {
        const __m256i *x = (const __m256i *)(x16[m] + 64 * c);
        const __m256i t = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(v[0], x[0]), _mm256_madd_epi16(v[1], x[1])),
            _mm256_add_epi32(_mm256_madd_epi16(v[2], x[2]), _mm256_madd_epi16(v[3], x[3])));
        const __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(lanes[m] + 8 * c));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, acc[m]);
    }
}

/* Up to 4 rows of x against weight row n, in one pass: each row adds chunk c to its
 * accumulator c % ACC (the last C % ACC chunks to the first), as one row does. Their 16
 * accumulators stay in memory (an FMA's operand, then a store): faster than a pass over
 * the row per accumulator (x read strided, slow on long rows) or rows in pairs. */
TI void q45_rows(const qmat *const *a, const int R, int64_t n, const int64_t g, const int five) {
    const int64_t K = a[0]->K, KB = K / 2, G = K / g, C = (K + CHUNK - 1) / CHUNK;
    const int64_t F = C / ACC * ACC, W = KB / 32 / ACC * ACC; /* in rounds; whole ones */
    const uint8_t *q = (const uint8_t *)a[0]->qw + n * KB;
    const uint8_t *qh = five ? a[0]->qh + n * (K / 8) : NULL;
    const uint16_t *s = (const uint16_t *)a[0]->scales + n * G;
    const int16_t *x16[4];
    const float *lanes[4];
    for (int m = 0; m < R; m++) {
        lanes[m] = (const float *)((const int8_t *)a[m]->xq + C * CHUNK_BYTES);
        x16[m] = x16_of(a[m]->xq, C);
    }
    __m256 acc[ACC][4];
    for (int u = 0; u < ACC; u++)
        for (int m = 0; m < R; m++) acc[u][m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < W; c += ACC)
        for (int u = 0; u < ACC; u++)
            q45_chunk_rows(q, qh, s, c + u, 1, g, five, R, x16, lanes, acc[u]);
    for (int64_t c = W; c < C; c++) /* a half chunk, and the chunks past the rounds */
        q45_chunk_rows(q, qh, s, c, KB - 32 * c >= 32, g, five, R, x16, lanes,
                       acc[c < F ? c % ACC : 0]);
    const uint16_t *off = (a[0]->mins ? a[0]->mins : (const uint16_t *)a[0]->scales) + n * G;
    for (int m = 0; m < R; m++) {
        const __m256 am[ACC] = {acc[0][m], acc[1][m], acc[2][m], acc[3][m]};
        a[m]->y[n] = hsum_acc(am) + group_offset(off, G, a[m]->xsum);
    }
}

/* R rows of x, 4 at a time, each 4 over all the task's weight rows (from L2) before the
 * next 4, so that only 4 rows' x share L1. Every row sums its chunks in one order either
 * way. (Fewer rows at a time on long rows, as AVX-512 VNNI does, is slower here: these
 * rows share more of a weight row's unpacking.) */
#define Q45_ROWS(g, five)                                                                        \
    for (int m = 0; m < R; m += 4) switch (R - m < 4 ? R - m : 4) {                             \
        case 1: for (int64_t n = n0; n < n1; n++) q45_rows(a + m, 1, n, g, five); break;         \
        case 2: for (int64_t n = n0; n < n1; n++) q45_rows(a + m, 2, n, g, five); break;         \
        case 3: for (int64_t n = n0; n < n1; n++) q45_rows(a + m, 3, n, g, five); break;         \
        default: for (int64_t n = n0; n < n1; n++) q45_rows(a + m, 4, n, g, five); break;        \
        }

T void q4_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    switch (a[0]->g) {
    case 32: Q45_ROWS(32, 0); break;
    case 64: Q45_ROWS(64, 0); break;
    default: Q45_ROWS(128, 0); break;
    }
}

T void q5_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) { Q45_ROWS(32, 1); }

/* ------------------------------------------------------------------------------------
 * int8 GEMV on x as int8 digits (AVX-VNNI only: vpmaddubsw's int16 pairs overflow on
 * 8-bit weights). x in avx512.c's layout (kernels.h XPREP8_BYTES): per 64 elements three
 * 64-byte digit vectors, 16 lane scales, and per block of 32 its -128 sx sum X. Here a
 * block is one 32-byte half of a chunk, and its 8 dword lanes share one scale.
 * ---------------------------------------------------------------------------------- */

T int q8_xprep(const float *x, int64_t K, void *buf) {
    const int64_t B = (K + 31) / 32;
    int8_t *xd = buf;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < B; b++) {
        const int64_t k = 32 * b, n = K - k < 32 ? K - k : 32;
        int8_t *d = xd + (b / 2) * XPREP8_CHUNK_BYTES + 32 * (b % 2);
        __m256 xv[4], m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            const int64_t left = n - 8 * i;
            xv[i] = left >= 8 ? _mm256_loadu_ps(x + k + 8 * i)
                    : left > 0 ? _mm256_maskload_ps(x + k + 8 * i, first_lanes(left))
                               : _mm256_setzero_ps();
            m = _mm256_max_ps(m, _mm256_and_ps(xv[i], absmask));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv[i], xv[i], _CMP_UNORD_Q));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const int e = block_exponent(_mm_cvtss_f32(h));
        if (e == 999 || _mm256_movemask_ps(nan)) return -1;
        /* X = x * 2^(21 - e), |X| <= 2^21 (avx512.c) */
        const __m256 s1 = _mm256_set1_ps(pow2((21 - e) / 2)), s2 = _mm256_set1_ps(pow2(21 - e - (21 - e) / 2));
        __m256i X[4], dg[3], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            X[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(xv[i], s1), s2));
            sum = _mm256_add_epi32(sum, X[i]);
        }
        digits32(X, dg);
        for (int p = 0; p < 3; p++) _mm256_storeu_si256((__m256i *)(d + 64 * p), dg[p]);
        int32_t v[8];
        _mm256_storeu_si256((__m256i *)v, sum);
        int64_t total = 0;
        for (int i = 0; i < 8; i++) total += v[i];
        xprep8_block(buf, K, b, pow2((e - 21) / 2) * pow2(e - 21 - (e - 21) / 2), total);
    }
    xprep8_pad(buf, K);
    return 0;
}

/* sum over block b of (q + 128) * X, per dword lane */
TARGET_AVX2_VNNI static inline __attribute__((always_inline)) __m256i q8_digits_block(
    const int8_t *q, const int8_t *xd, int64_t K, int64_t b) {
    const int64_t bytes = K - 32 * b < 32 ? K - 32 * b : 32;
    const int8_t *xb = xd + (b / 2) * XPREP8_CHUNK_BYTES + 32 * (b % 2);
    if (!(b & 1)) PREFETCH_STREAM_L1(q + 32 * b); /* once per 64 bytes */
    __m256i w;
    if (bytes == 32) {
        w = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
    } else { /* the row's tail: past K the digits are 0 */
        int8_t tail[32] = {0};
        memcpy(tail, q + 32 * b, (size_t)bytes);
        w = _mm256_loadu_si256((const __m256i *)tail);
    }
    const __m256i u = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    __m256i t = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, _mm256_loadu_si256((const __m256i *)xb));
    t = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(t, 8), u, _mm256_loadu_si256((const __m256i *)(xb + 64)));
    return _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(t, 8), u, _mm256_loadu_si256((const __m256i *)(xb + 128)));
}

TARGET_AVX2_VNNI static inline __attribute__((always_inline)) void q8_gemv_digits_row(
    const qmat *a, int64_t n, const int64_t g) {
    const int64_t K = a->K, B = (K + 31) / 32, C = (K + 63) / 64;
    const int8_t *xd = a->xq;
    const float *lanes = (const float *)(xd + C * XPREP8_CHUNK_BYTES);
    const int8_t *q = (const int8_t *)a->qw + n * K;
    const uint16_t *s = g ? (const uint16_t *)a->scales + n * (K / g) : NULL;
    __m256 acc[ACC];
    for (int i = 0; i < ACC; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b += ACC) {
        const int u_end = B - b < ACC ? (int)(B - b) : ACC;
        for (int u = 0; u < ACC; u++) {
            if (u >= u_end) break;
            const int64_t bu = b + u;
            __m256 f = _mm256_cvtepi32_ps(q8_digits_block(q, xd, K, bu));
            float sc = lanes[16 * (bu / 2) + 8 * (bu % 2)];
            if (g) sc *= _cvtsh_ss(s[bu * 32 / g]);
            if (u_end == ACC)
                acc[u] = _mm256_fmadd_ps(f, _mm256_set1_ps(sc), acc[u]);
            else
                acc[0] = _mm256_fmadd_ps(f, _mm256_set1_ps(sc), acc[0]);
        }
    }
    if (g)
        a->y[n] = hsum_acc(acc) + group_offset(s, K / g, a->xsum);
    else
        a->y[n] = (hsum_acc(acc) + a->xsum[0]) * ((const float *)a->scales)[n];
}

TARGET_AVX2_VNNI static void q8_gemv_digits(const qmat *a, int64_t n0, int64_t n1) {
    switch (a->g) {
    case 32: ROWS_LOOP(q8_gemv_digits_row, 32); break;
    case 64: ROWS_LOOP(q8_gemv_digits_row, 64); break;
    case 128: ROWS_LOOP(q8_gemv_digits_row, 128); break;
    default: ROWS_LOOP(q8_gemv_digits_row, 0); break;
    }
}

/* ------------------------------------------------------------------------------------
 * int6 GEMV on x as the int8 GEMV's digits (avx512.c has the layout). Per half block: 64
 * bytes of ql as two vectors, 32 of qh as one, widened to four vectors of codes, each
 * element order over one block of x (32 elements, one sx): quarter j takes ql's low (j <
 * 2) or high nibbles and qh's bits 2j..2j+1. Dword lane l of quarter j covers elements
 * 4l..4l+3: the half's group of 16 number 2j + l / 4. vpmaddubsw pairs hold for codes <= 63.
 * ---------------------------------------------------------------------------------- */

/* Half h of an int6 block widened to codes (0..63): q[j] holds the half's elements
 * 32 j .. 32 j + 31 in order. */
TI void q6_quarters(const uint8_t *blk, int h, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const uint8_t *ql = blk + 64 * h;
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}

/* ---- plain AVX2: x as int16 X, 15 significant bits per block of 32 -----------------
 * (in the XPREP8_BYTES buffer): per block of 32, its 16 even elements' X then its 16 odd
 * ones (64 bytes); then per block sx. A quarter's codes as int16, even and odd bytes
 * apart, take one vpmaddwd per 16 with X, so dword lane l sums elements 4l..4l+3 as the
 * digit kernels' lanes do. The codes are unpacked once for up to 4 rows of x. */

T int q6_xprep16(const float *x, int64_t K, void *buf) {
    int16_t *xd = buf;
    float *sxs = (float *)(xd + K);
    const __m256i evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t k = 0; k < K; k += 32) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + k + 8 * i);
        const float amax = block_amax(v);
        if (amax < 0) return -1;
        __m256i X[4];
        ig_block_X(v, amax, X);
        for (int i = 0; i < 4; i++) X[i] = _mm256_permutevar8x32_epi32(X[i], evens_first);
        /* |X| <= IG_XMAX: the packs do not saturate */
        const __m256i ev = _mm256_packs_epi32(_mm256_permute2x128_si256(X[0], X[1], 0x20),
                                              _mm256_permute2x128_si256(X[2], X[3], 0x20));
        const __m256i od = _mm256_packs_epi32(_mm256_permute2x128_si256(X[0], X[1], 0x31),
                                              _mm256_permute2x128_si256(X[2], X[3], 0x31));
        _mm256_store_si256((__m256i *)(xd + k), _mm256_permute4x64_epi64(ev, 0xd8));
        _mm256_store_si256((__m256i *)(xd + k + 16), _mm256_permute4x64_epi64(od, 0xd8));
        sxs[k / 32] = amax / IG_XMAX;
    }
    return 0;
}

/* per 16 elements -32 sx sum X, the groups' offset term, from q6_xprep16's x */
T void q6_xsum16(const void *xq, int64_t K, float *xsum) {
    const int16_t *xd = xq;
    const float *sxs = (const float *)(xd + K);
    for (int64_t k = 0; k < K; k += 16) {
        int32_t t = 0; /* elements k..k+15: evens and odds of the first or second half */
        const int16_t *e = xd + (k & ~31) + (k & 16) / 2;
        for (int i = 0; i < 8; i++) t += e[i] + e[16 + i];
        xsum[k / 16] = -32.0f * sxs[k / 32] * (float)t;
    }
}

/* Block b of an int6 row (blk) for R rows of x: prefetch, its d and its halves' group
 * scales sc; each row's groups' -32 sx sum X terms (xsum), times d sc, added to off[m]. */
TI __m256 q6_block_start(const uint8_t *blk, int64_t b, const qmat *const *a, const int R,
                         __m256 sc[2], __m256 *off) {
    for (int p = 0; p < Q6_BLOCK_BYTES; p += 64) PREFETCH_STREAM_L1(blk + p);
    uint16_t dh;
    memcpy(&dh, blk + 208, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
    for (int h = 0; h < 2; h++) {
        sc[h] = widen_i8((const int8_t *)(blk + 192 + 8 * h));
        const __m256 scd = _mm256_mul_ps(sc[h], d);
        for (int m = 0; m < R; m++)
            off[m] = _mm256_fmadd_ps(scd, _mm256_loadu_ps(a[m]->xsum + 16 * b + 8 * h), off[m]);
    }
    return d;
}

/* Up to 4 rows of x against int6 weight row n (each row's sums as it takes them alone) */
TI void q6_rows(const qmat *const *a, const int R, int64_t n) {
    const int64_t K = a[0]->K, B = K / Q6_BLOCK;
    const uint8_t *row = (const uint8_t *)a[0]->qw + n * B * Q6_BLOCK_BYTES;
    const __m256i g0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), two = _mm256_set1_epi32(2);
    const __m256i low8 = _mm256_set1_epi16(0xff);
    __m256 acc[4][2], off[4];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = off[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *blk = row + b * Q6_BLOCK_BYTES;
        __m256 sc[2], f[4];
        const __m256 d = q6_block_start(blk, b, a, R, sc, off);
        for (int m = 0; m < R; m++) f[m] = _mm256_setzero_ps();
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6_quarters(blk, h, q);
            __m256i gj = g0;
#pragma GCC unroll 1 /* unrolled, gcc hoists the quarters' codes and spills them */
            for (int j = 0; j < 4; j++, gj = _mm256_add_epi32(gj, two)) {
                const int64_t xb = 8 * b + 4 * h + j; /* x's block of 32 */
                const __m256i ev = _mm256_and_si256(q[j], low8), od = _mm256_srli_epi16(q[j], 8);
                const __m256 scj = _mm256_permutevar8x32_ps(sc[h], gj);
                for (int m = 0; m < R; m++) {
                    const int16_t *xd = a[m]->xq;
                    const float sx = ((const float *)(xd + K))[xb];
                    const __m256i *X = (const __m256i *)(xd + 32 * xb);
                    const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(ev, X[0]), _mm256_madd_epi16(od, X[1]));
                    f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(scj, _mm256_set1_ps(sx)), f[m]);
                }
            }
        }
        for (int m = 0; m < R; m++) acc[m][b & 1] = _mm256_fmadd_ps(f[m], d, acc[m][b & 1]);
    }
    for (int m = 0; m < R; m++) a[m]->y[n] = hsum(_mm256_add_ps(acc[m][0], acc[m][1])) + hsum(off[m]);
}

/* R rows of x, 4 at a time per weight row (its later passes read it from L1) */
T void q6_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m = 0; m < R; m += 4) switch (R - m) {
            case 1: q6_rows(a + m, 1, n); break;
            case 2: q6_rows(a + m, 2, n); break;
            case 3: q6_rows(a + m, 3, n); break;
            default: q6_rows(a + m, 4, n); break;
            }
}

T void q6_gemv_x16(const qmat *a, int64_t n0, int64_t n1) { q6_gemv_rows(&a, 1, n0, n1); }

/* ---- AVX-VNNI: x as the int8 GEMV's three digits (22 bits), one vpdpbusd each ---- */

/* sum q X per dword lane, q against one block of x's three digits */
TARGET_AVX2_VNNI static inline __attribute__((always_inline)) __m256 q6_dot_vnni(__m256i q, const int8_t *xb) {
    __m256i t = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, _mm256_loadu_si256((const __m256i *)xb));
    t = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(t, 8), q, _mm256_loadu_si256((const __m256i *)(xb + 64)));
    t = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(t, 8), q, _mm256_loadu_si256((const __m256i *)(xb + 128)));
    return _mm256_cvtepi32_ps(t);
}

/* Up to 4 rows of x against int6 weight row n: each half block widened once (its codes
 * and its lanes' group scales) for every row; each row then takes the one-row steps in
 * their order, so its output is the same alone or in a batch. */
TARGET_AVX2_VNNI static inline __attribute__((always_inline)) void q6_rows_vnni(
    const qmat *const *a, const int R, int64_t n) {
    const int64_t K = a[0]->K, B = K / Q6_BLOCK;
    const uint8_t *row = (const uint8_t *)a[0]->qw + n * B * Q6_BLOCK_BYTES;
    const __m256i g0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), two = _mm256_set1_epi32(2);
    const int8_t *xd[4];
    const float *lanes[4];
    __m256 acc[4][2], off[4];
    for (int m = 0; m < R; m++) {
        xd[m] = a[m]->xq, lanes[m] = (const float *)(xd[m] + K / 64 * XPREP8_CHUNK_BYTES);
        acc[m][0] = acc[m][1] = off[m] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *blk = row + b * Q6_BLOCK_BYTES;
        __m256 sc[2], f[4];
        const __m256 d = q6_block_start(blk, b, a, R, sc, off);
        for (int m = 0; m < R; m++) f[m] = _mm256_setzero_ps();
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6_quarters(blk, h, q);
            __m256i gj = g0;
            for (int j = 0; j < 4; j++, gj = _mm256_add_epi32(gj, two)) {
                const int64_t xb = 8 * b + 4 * h + j; /* x's block of 32 */
                const __m256 scj = _mm256_permutevar8x32_ps(sc[h], gj);
                for (int m = 0; m < R; m++) {
                    const int8_t *dg = xd[m] + (xb / 2) * XPREP8_CHUNK_BYTES + 32 * (xb % 2);
                    const float sx = lanes[m][16 * (xb / 2) + 8 * (xb % 2)];
                    const __m256 s = _mm256_mul_ps(scj, _mm256_set1_ps(sx));
                    f[m] = _mm256_fmadd_ps(q6_dot_vnni(q[j], dg), s, f[m]);
                }
            }
        }
        for (int m = 0; m < R; m++) acc[m][b & 1] = _mm256_fmadd_ps(f[m], d, acc[m][b & 1]);
    }
    for (int m = 0; m < R; m++)
        a[m]->y[n] = hsum(_mm256_add_ps(acc[m][0], acc[m][1])) + hsum(off[m]);
}

/* R rows of x, 4 at a time per weight row (its later passes read it from L1) */
TARGET_AVX2_VNNI static void q6_gemv_rows_vnni(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m = 0; m < R; m += 4) switch (R - m < 4 ? R - m : 4) {
            case 1: q6_rows_vnni(a + m, 1, n); break;
            case 2: q6_rows_vnni(a + m, 2, n); break;
            case 3: q6_rows_vnni(a + m, 3, n); break;
            default: q6_rows_vnni(a + m, 4, n); break;
            }
}

TARGET_AVX2_VNNI static void q6_gemv_digits_vnni(const qmat *a, int64_t n0, int64_t n1) {
    q6_gemv_rows_vnni(&a, 1, n0, n1);
}

/* int6, as q6_dequant_c: each half block widened as the GEMV widens it (q6_quarters), 8
 * codes at a time to float times their group's d * sc (every product exact) */
T void q6_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q6_BLOCK;
    const __m256i c32 = _mm256_set1_epi8(32);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)a->qw + n * B * Q6_BLOCK_BYTES;
        for (int64_t b = 0; b < B; b++, w += Q6_BLOCK) {
            const uint8_t *blk = row + b * Q6_BLOCK_BYTES;
            uint16_t dh;
            memcpy(&dh, blk + 208, 2);
            const float d = _cvtsh_ss(dh);
            for (int h = 0; h < 2; h++) {
                __m256i q[4];
                q6_quarters(blk, h, q);
                for (int j = 0; j < 4; j++) {
                    int8_t c[32];
                    _mm256_storeu_si256((__m256i *)c, _mm256_sub_epi8(q[j], c32));
                    float *wj = w + 128 * h + 32 * j;
                    for (int k = 0; k < 4; k++) { /* group 8 h + 2 j + k / 2 */
                        const float ds = d * (float)(int8_t)blk[192 + 8 * h + 2 * j + k / 2];
                        _mm256_storeu_ps(wj + 8 * k, _mm256_mul_ps(widen_i8(c + 8 * k), _mm256_set1_ps(ds)));
                    }
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------
 * Dequantization for the GEMM (the formats' definitions: no FMA)
 * ---------------------------------------------------------------------------------- */

T void q8_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, g = a->g;
    for (int64_t n = n0; n < n1; n++, w += K) {
        const int8_t *q = (const int8_t *)a->qw + n * K;
        if (g) {
            const uint16_t *s = (const uint16_t *)a->scales + n * (K / g);
            for (int64_t k0 = 0; k0 < K; k0 += g) {
                __m256 d = bcast_half(s + k0 / g);
                for (int64_t k = k0; k < k0 + g; k += 8)
                    _mm256_storeu_ps(w + k, _mm256_mul_ps(widen_i8(q + k), d));
            }
        } else {
            __m256 d = _mm256_set1_ps(((const float *)a->scales)[n]);
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) _mm256_storeu_ps(w + k, _mm256_mul_ps(widen_i8(q + k), d));
            if (k < K)
                _mm256_maskstore_ps(w + k, first_lanes(K - k),
                                    _mm256_mul_ps(widen_i8_part(q + k, K - k), d));
        }
    }
}

T void q4_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, g = a->g, G = K / g;
    const __m256i eight = _mm256_set1_epi32(8);
    for (int64_t n = n0; n < n1; n++, w += K) {
        const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2);
        const uint16_t *s = (const uint16_t *)a->scales + n * G;
        const uint16_t *mn = a->mins ? a->mins + n * G : NULL;
        for (int64_t gi = 0; gi < G; gi++) {
            __m256 d = bcast_half(s + gi);
            __m256 m = mn ? bcast_half(mn + gi) : _mm256_setzero_ps();
            for (int64_t k = gi * g; k < gi * g + g; k += 32) {
                __m256i c[4];
                widen_i4(q + k / 2, c);
                for (int i = 0; i < 4; i++) {
                    __m256 v = mn ? _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c[i]), d), m)
                                  : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c[i], eight)), d);
                    _mm256_storeu_ps(w + k + 8 * i, v);
                }
            }
        }
    }
}

/* int5 (groups of 32): int4's widening, bit 4 of each code from its block's qh. */
T void q5_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, G = K / 32;
    const __m256i sixteen = _mm256_set1_epi32(16), one = _mm256_set1_epi32(1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2), *qh = a->qh + n * (K / 8);
        const uint16_t *s = (const uint16_t *)a->scales + n * G;
        const uint16_t *mn = a->mins ? a->mins + n * G : NULL;
        for (int64_t b = 0; b < G; b++, w += 32) {
            const __m256 d = bcast_half(s + b);
            const __m256 m = mn ? bcast_half(mn + b) : _mm256_setzero_ps();
            const __m256i h = _mm256_set1_epi32(load_i32(qh + 4 * b));
            __m256i c[4];
            widen_i4(q + 16 * b, c); /* elements 8i .. 8i + 7 */
            for (int i = 0; i < 4; i++) {
                const __m256i bit = _mm256_and_si256(
                    _mm256_srlv_epi32(h, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i))), one);
                const __m256i code = _mm256_or_si256(c[i], _mm256_slli_epi32(bit, 4));
                const __m256 v = mn ? _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(code), d), m)
                                    : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(code, sixteen)), d);
                _mm256_storeu_ps(w + 8 * i, v);
            }
        }
    }
}

/* ------------------------------------------------------------------------------------
 * Float tile
 * ---------------------------------------------------------------------------------- */

TI void tile_block(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                   int64_t K, int accumulate, const int MR, const int NR) {
    __m256 c[4][2];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) c[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[4];
        for (int i = 0; i < MR; i++) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
        for (int j = 0; j < NR; j++) {
            __m256 wv = _mm256_loadu_ps(w + j * ldw + k);
            for (int i = 0; i < MR; i++) c[i][j] = _mm256_fmadd_ps(xv[i], wv, c[i][j]);
        }
    }
    if (k < K) {
        const __m256i m = first_lanes(K - k);
        __m256 xv[4];
        for (int i = 0; i < MR; i++) xv[i] = _mm256_maskload_ps(x + i * ldx + k, m);
        for (int j = 0; j < NR; j++) {
            __m256 wv = _mm256_maskload_ps(w + j * ldw + k, m);
            for (int i = 0; i < MR; i++) c[i][j] = _mm256_fmadd_ps(xv[i], wv, c[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float *yij = y + i * ldy + j;
            *yij = accumulate ? *yij + hsum(c[i][j]) : hsum(c[i][j]);
        }
}

#define TILE_CASE(MR_, NR_)                                                                      \
    case (MR_) * 8 + (NR_):                                                                      \
        tile_block(x + m * ldx, ldx, w + j * ldw, ldw, y + m * ldy + j, ldy, K, accumulate,      \
                   MR_, NR_);                                                                    \
        break;

T void tile(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
            int64_t M, int64_t nb, int64_t K, int accumulate) {
    for (int64_t m = 0; m < M; m += 4) {
        const int mr = M - m < 4 ? (int)(M - m) : 4;
        for (int64_t j = 0; j < nb; j += 2) {
            const int nr = nb - j < 2 ? 1 : 2;
            switch (mr * 8 + nr) {
                TILE_CASE(4, 2) TILE_CASE(4, 1) TILE_CASE(3, 2) TILE_CASE(3, 1)
                TILE_CASE(2, 2) TILE_CASE(2, 1) TILE_CASE(1, 2) TILE_CASE(1, 1)
            }
        }
    }
}

/* ------------------------------------------------------------------------------------
 * Integer GEMM (igemm.c; layouts in kernels.h): x's digits for both AVX2 tables; with
 * AVX-VNNI the panel kernel below, as avx512.c's, in 16 registers. 16 rows of x at a
 * time (two vectors of 8) by NR = 3 rows of W, the digits
 * one after the other into the same accumulators (shifted by 8 between them), so that 6
 * accumulators, 6 sums and 2 vectors of digits fit: per 4 elements and digit, two loads
 * of digits, three broadcasts of codes, six vpdpbusd.
 * ---------------------------------------------------------------------------------- */

T int ig_xprep(const float *x, int64_t K, int64_t t, int o, const ig_x *d) {
    const int64_t Kp = d->Kp, B = Kp / 32;
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int8_t *dt = d->digits + t * B * 8 * 256;
    const int64_t rows = d->M - t * IG_MR < IG_MR ? d->M - t * IG_MR : IG_MR;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + (t * IG_MR + r) * K;
        int32_t *dr = (int32_t *)(dt + (r / 16) * 64 + (r % 16) * 4); /* row r's dword lane */
        for (int64_t b = 0; b < B; b++) {
            const int64_t k = 32 * b, i = (t * B + b) * IG_MR + r, n = K - k < 32 ? K - k : 32;
            __m256 v[4];
            for (int j = 0; j < 4; j++)
                v[j] = n >= 8 * j + 8 ? _mm256_loadu_ps(xr + k + 8 * j)
                       : n > 8 * j    ? _mm256_maskload_ps(xr + k + 8 * j, first_lanes(n - 8 * j))
                                      : _mm256_setzero_ps();
            const float amax = block_amax(v);
            if (amax < 0) return -1;
            __m256i X[4], L[4], H[4];
            const int32_t sum_x = ig_block_X(v, amax, X);
            for (int j = 0; j < 4; j++) {
                L[j] = _mm256_srai_epi32(_mm256_slli_epi32(X[j], 24), 24);
                H[j] = _mm256_srai_epi32(_mm256_sub_epi32(X[j], L[j]), 8);
            }
            /* digits fit int8: the packs do not saturate; bytes in element order */
            const __m256i hi = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(H[0], H[1]), _mm256_packs_epi32(H[2], H[3])), order);
            const __m256i lo = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(L[0], L[1]), _mm256_packs_epi32(L[2], L[3])), order);
            int32_t *db = dr + b * 8 * 64; /* dword j of each: group j's hi (lo) vector */
            db[0 * 64] = _mm256_extract_epi32(hi, 0), db[1 * 64] = _mm256_extract_epi32(hi, 1);
            db[2 * 64] = _mm256_extract_epi32(hi, 2), db[3 * 64] = _mm256_extract_epi32(hi, 3);
            db[4 * 64] = _mm256_extract_epi32(hi, 4), db[5 * 64] = _mm256_extract_epi32(hi, 5);
            db[6 * 64] = _mm256_extract_epi32(hi, 6), db[7 * 64] = _mm256_extract_epi32(hi, 7);
            db[0 * 64 + 32] = _mm256_extract_epi32(lo, 0), db[1 * 64 + 32] = _mm256_extract_epi32(lo, 1);
            db[2 * 64 + 32] = _mm256_extract_epi32(lo, 2), db[3 * 64 + 32] = _mm256_extract_epi32(lo, 3);
            db[4 * 64 + 32] = _mm256_extract_epi32(lo, 4), db[5 * 64 + 32] = _mm256_extract_epi32(lo, 5);
            db[6 * 64 + 32] = _mm256_extract_epi32(lo, 6), db[7 * 64 + 32] = _mm256_extract_epi32(lo, 7);
            ig_terms(d, i, amax, sum_x, o);
        }
    }
    return 0;
}

#define TV TARGET_AVX2_VNNI static inline __attribute__((always_inline))

/* acc = sum over the groups [J0, J1) of 4 elements of a block of codes times X (256 hi +
 * lo), for 16 rows of x and NR rows of W. */
TV void ig_sums(const int8_t *xd, const uint8_t *w, int64_t Kp, int64_t b, __m256i acc[3][2],
                const int NR, const int J0, const int J1) {
    for (int n = 0; n < NR; n++) acc[n][0] = acc[n][1] = _mm256_setzero_si256();
    for (int digit = 0; digit < 2; digit++) { /* hi, then lo: acc = 256 sum(hi) + sum(lo) */
        if (digit)
            for (int n = 0; n < NR; n++)
                for (int h = 0; h < 2; h++) acc[n][h] = _mm256_slli_epi32(acc[n][h], 8);
#pragma GCC unroll 8
        for (int j = J0; j < J1; j++) {
            const __m256i x0 = _mm256_load_si256((const __m256i *)(xd + j * 256 + 128 * digit));
            const __m256i x1 = _mm256_load_si256((const __m256i *)(xd + j * 256 + 128 * digit + 32));
            for (int n = 0; n < NR; n++) {
                const __m256i c = _mm256_set1_epi32(load_i32(w + n * Kp + 32 * b + 4 * j));
                acc[n][0] = _mm256_dpbusd_avx_epi32(acc[n][0], c, x0);
                acc[n][1] = _mm256_dpbusd_avx_epi32(acc[n][1], c, x1);
            }
        }
    }
}

/* f += (acc - off) sx d (+ xs m): off's and xs's 16 rows at i (off_lo and xs_lo, or off and
 * xs minus them, for a half: `lo` 1 or 2). */
TV void ig_scale(const ig_x *x, int64_t i, const __m256i acc[3][2], const int lo, const float *d,
                 int64_t stride, const float *mins, __m256 f[3][2], const int NR) {
    for (int h = 0; h < 2; h++) {
        const int64_t k = i + 8 * h;
        __m256i o = _mm256_setzero_si256(); /* the codes' offset term: none with mins (o = 0) */
        __m256 xs = _mm256_setzero_ps();
        if (mins) {
            xs = _mm256_load_ps(lo == 1 ? x->xs_lo + k : x->xs + k);
            if (lo == 2) xs = _mm256_sub_ps(xs, _mm256_load_ps(x->xs_lo + k));
        } else {
            o = _mm256_load_si256((const __m256i *)(lo == 1 ? x->off_lo + k : x->off + k));
            if (lo == 2) o = _mm256_sub_epi32(o, _mm256_load_si256((const __m256i *)(x->off_lo + k)));
        }
        const __m256 sx = _mm256_load_ps(x->sx + k);
        for (int n = 0; n < NR; n++) {
            const __m256 a = _mm256_cvtepi32_ps(mins ? acc[n][h] : _mm256_sub_epi32(acc[n][h], o));
            f[n][h] = _mm256_fmadd_ps(a, _mm256_mul_ps(sx, _mm256_set1_ps(d[n * stride])), f[n][h]);
            if (mins) f[n][h] = _mm256_fmadd_ps(xs, _mm256_set1_ps(mins[n * stride]), f[n][h]);
        }
    }
}

/* y for rows [32 t + 16 v, + 16) of x and NR (1-3) rows of W; NR and H (1; 2: a d per 16,
 * each half of a block summed and scaled apart) fixed at compile time. */
TV void ig_block(const ig_x *x, int64_t t, int v, const uint8_t *w, const float *d,
                 const float *mins, float *y, int64_t ldy, const int NR, const int H) {
    const int64_t Kp = x->Kp, B = Kp / 32;
    const int8_t *xd = x->digits + t * B * 8 * 256 + 64 * v;
    __m256 f[3][2];
    for (int n = 0; n < NR; n++) f[n][0] = f[n][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++, xd += 8 * 256) {
        const int64_t i = (t * B + b) * IG_MR + 16 * v;
        __m256i acc[3][2];
        if (H == 1) {
            ig_sums(xd, w, Kp, b, acc, NR, 0, 8);
            ig_scale(x, i, acc, 0, d + b, B, mins ? mins + b : NULL, f, NR);
        } else { /* elements 0..15, then 16..31; d and m per 16 */
            ig_sums(xd, w, Kp, b, acc, NR, 0, 4);
            ig_scale(x, i, acc, 1, d + 2 * b, 2 * B, mins ? mins + 2 * b : NULL, f, NR);
            ig_sums(xd, w, Kp, b, acc, NR, 4, 8);
            ig_scale(x, i, acc, 2, d + 2 * b + 1, 2 * B, mins ? mins + 2 * b + 1 : NULL, f, NR);
        }
    }
    const int64_t row0 = t * IG_MR + 16 * v, rows = x->M - row0 < 16 ? x->M - row0 : 16;
    for (int r = 0; r < rows; r++) /* lane r % 8 of half r / 8, moved to lane 0 */
        for (int n = 0; n < NR; n++)
            y[(row0 + r) * ldy + n] = _mm256_cvtss_f32(
                _mm256_permutevar8x32_ps(f[n][r / 8], _mm256_set1_epi32(r % 8)));
}

#define IG_CASE(NR_, H_)                                                                         \
    case NR_:                                                                                    \
        ig_block(x, t, v, w + n * Kp, d + n * B * H_, m ? m + n * B * H_ : NULL, y + n, ldy, NR_, H_); \
        break;

/* The panel for H (above); one function each, so that their registers are allocated apart. */
TV void ig_panel_h(const ig_x *x, const uint8_t *w, const float *d, const float *m, float *y,
                   int64_t ldy, int64_t nb, const int H) {
    const int64_t Kp = x->Kp, B = Kp / 32;
    for (int64_t t = 0; t * IG_MR < x->M; t++)
        for (int v = 0; v < 2 && t * IG_MR + 16 * v < x->M; v++)
            for (int64_t n = 0; n < nb; n += 3) {
                const int nr = nb - n < 3 ? (int)(nb - n) : 3;
                if (H == 2)
                    switch (nr) { IG_CASE(3, 2) IG_CASE(2, 2) IG_CASE(1, 2) }
                else
                    switch (nr) { IG_CASE(3, 1) IG_CASE(2, 1) IG_CASE(1, 1) }
            }
}

TARGET_AVX2_VNNI __attribute__((noinline)) static void ig_panel_halves(
    const ig_x *x, const uint8_t *w, const float *d, const float *m, float *y, int64_t ldy, int64_t nb) {
    ig_panel_h(x, w, d, m, y, ldy, nb, 2);
}

TARGET_AVX2_VNNI static void ig_panel(const ig_x *x, const uint8_t *w, const float *d,
                                      const float *m, float *y, int64_t ldy, int64_t nb) {
    if (x->off_lo)
        ig_panel_halves(x, w, d, m, y, ldy, nb);
    else
        ig_panel_h(x, w, d, m, y, ldy, nb, 1);
}

const kernel_table kernels_avx2 = {
    q8_gemv, q4_gemv, q4_xprep, q4_gemv_digits, q8_dequant, q4_dequant, tile,
    .ig_xprep = ig_xprep, .ig_panel = avx2_ig_panel, /* vpmaddubsw: codes up to 63 */
    .ig_kinds = IG_KIND(4) | IG_KIND(5) | IG_KIND(6) | IG_KIND(Q4K) | IG_KIND(Q5K) | IG_KIND(Q2K),
    .q6_xprep = q6_xprep16, .q6_gemv_digits = q6_gemv_x16, .q6_dequant = q6_dequant,
    .q6_xsum = q6_xsum16, .q6_xblock = 32, .q6_gemv_rows = q6_gemv_rows,
    .q5_xprep = q4_xprep, .q5_gemv_digits = q5_gemv_digits, .q5_dequant = q5_dequant,
    .q4_gemv_rows = q4_gemv_rows, .q5_gemv_rows = q5_gemv_rows, .q8_gemv_rows = q8_gemv_rows,
    .sb_path = SB_AVX2,
};
const kernel_table kernels_avx2_vnni = {
    q8_gemv, q4_gemv, q4_xprep, q4_gemv_digits_vnni, q8_dequant, q4_dequant, tile,
    q8_xprep, q8_gemv_digits, ig_xprep, ig_panel, q8_xprep, q6_gemv_digits_vnni, q6_dequant,
    .q5_xprep = q4_xprep, .q5_gemv_digits = q5_gemv_digits_vnni, .q5_dequant = q5_dequant,
    .ig_kinds = IG_KIND(4) | IG_KIND(5) | IG_KIND(6) | IG_KIND(8) | IG_KIND(Q4K) | IG_KIND(Q5K) |
                IG_KIND(Q3K) | IG_KIND(Q2K) | IG_KIND(IQ4XS),
    /* the plain AVX2 rows kernels: their int32 lanes are the VNNI one-row kernels' */
    .q4_gemv_rows = q4_gemv_rows, .q5_gemv_rows = q5_gemv_rows, .q6_gemv_rows = q6_gemv_rows_vnni,
    .sb_path = SB_AVX2,
};

/* For the AVX-512 tables (kernels.h): their CPUs run this AVX2 code. */
TARGET_AVX2 int avx2_q4_xprep(const float *x, int64_t K, void *buf) { return q4_xprep(x, K, buf); }
TARGET_AVX2 void avx2_q5_gemv_digits(const qmat *a, int64_t n0, int64_t n1) {
    q5_gemv_digits(a, n0, n1);
}
TARGET_AVX2 void avx2_q5_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    q5_gemv_rows(a, R, n0, n1);
}
TARGET_AVX2 void avx2_q5_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    q5_dequant(a, n0, n1, w);
}

#endif
