/* AVX-512 paths (F, BW, VL, DQ; FMA and F16C): 16 float lanes. "avx512vnni" is the same
 * with vpdpbusd in the int4 GEMV's integer dot products.
 *
 * GEMV: one row at a time, as one sequential stream of weights. int8: 16 weights
 * widened to float per FMA (vpmovsxbd + vcvtdq2ps), each group's partial sums scaled
 * once; with VNNI, x as three int8 digits (kernels.h), 64 weights per load made unsigned
 * by one XOR, three vpdpbusd, one conversion and one FMA with the lanes' scales (fewer
 * instructions a weight than widening to float). int4: x as the integer
 * GEMM's two int8 digits, 128 weights (64 bytes) per load split into nibbles by one AND
 * and one shift, four integer dot products, one conversion and one FMA with the lanes'
 * scales.
 *
 * GEMM: a tile of dequantized rows times x in 4 x 4 blocks of dot products (16
 * accumulators, 8 loads per 16 FMAs), then one reduction of 4 accumulators into 4
 * contiguous outputs. With VNNI, from 16 rows of x, the integer GEMM (igemm.c): 32 rows
 * of x's digits by 4 rows of codes, 16 vpdpbusd per 4 elements (4 multiply-adds a lane
 * per instruction, against the float tile's one).
 */
#include <string.h>

#include "kernels.h"

#ifdef INFER_X86
#include <immintrin.h>

#define T TARGET_AVX512 static
#define TI TARGET_AVX512 static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------------------
 * Reductions. Lanes pair as (i, i + 8), (i, i + 4), (i, i + 2), (i, i + 1) in both, so
 * hsum4 gives each vector exactly the sum hsum gives it alone.
 * ---------------------------------------------------------------------------------- */

TI float hsum(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

/* (hsum(a), hsum(b), hsum(c), hsum(d)) */
TI __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v);
    return _mm512_castps512_ps128(v);
}

TI __mmask16 first16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

TI int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

TI __m512 bcast_half(const uint16_t *p) { return _mm512_set1_ps(_cvtsh_ss(*p)); }

/* 16 int8 -> float */
TI __m512 widen_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 16 bytes of int4 -> codes of elements 0..15 (lo) and 16..31 (hi), as int32 */
TI void widen_i4(const uint8_t *p, __m512i *lo, __m512i *hi) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
    *hi = _mm512_srli_epi32(v, 4);
}

/* sum_g c[g] * xsum[g]: the int4 GEMV's mins (or -8 d) term of one row */
TI float group_offset(const uint16_t *c, int64_t G, const float *xsum) {
    __m512 off = _mm512_setzero_ps();
    int64_t gi = 0;
    for (; gi + 16 <= G; gi += 16)
        off = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c + gi))),
                              _mm512_loadu_ps(xsum + gi), off);
    if (gi < G) {
        const __mmask16 m = first16(G - gi);
        off = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, c + gi)),
                              _mm512_maskz_loadu_ps(m, xsum + gi), off);
    }
    return hsum(off);
}

/* ------------------------------------------------------------------------------------
 * GEMV rows are computed one at a time: the hardware prefetchers follow one sequential
 * stream at full bandwidth but several interleaved row streams at half of it or less, so
 * sharing x loads across rows costs more than it saves. Independent accumulators (ACC of them, combined in a fixed order) hide the
 * latency of the FMA chains.
 * ---------------------------------------------------------------------------------- */

enum { ACC = 4 };

TI float hsum_acc(const __m512 *acc) {
    return hsum(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

/* ------------------------------------------------------------------------------------
 * int8 GEMV
 * ---------------------------------------------------------------------------------- */

/* sum over one group of q * x, from element k0 */
TI __m512 q8_group(const int8_t *q, const float *x, int64_t k0, const int64_t g) {
    __m512 t = _mm512_mul_ps(widen_i8(q + k0), _mm512_loadu_ps(x + k0));
    for (int64_t k = k0 + 16; k < k0 + g; k += 16)
        t = _mm512_fmadd_ps(widen_i8(q + k), _mm512_loadu_ps(x + k), t);
    for (int64_t l = k0; l < k0 + g; l += 64) /* once per 64 bytes */
        if (!(l & 63)) PREFETCH_STREAM(q + l);
    return t;
}

/* y[0, n] for group size g (0: per channel) fixed at compile time. */
TI void q8_gemv_row(const qmat *a, int64_t n, const int64_t g) {
    const int64_t K = a->K;
    const float *x = a->x;
    const int8_t *q = (const int8_t *)a->qw + n * K;
    __m512 acc[ACC];
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_setzero_ps();
    if (g) {
        const int64_t G = K / g;
        const uint16_t *s = (const uint16_t *)a->scales + n * G;
        float sc[16] __attribute__((aligned(64))); /* 16 groups' scales, as float */
        for (int64_t g0 = 0; g0 < G; g0 += 16) {
            const int64_t ng = G - g0 < 16 ? G - g0 : 16;
            __m256i h = ng == 16 ? _mm256_loadu_si256((const __m256i *)(s + g0))
                                 : _mm256_maskz_loadu_epi16(first16(ng), s + g0);
            _mm512_store_ps(sc, _mm512_cvtph_ps(h));
            /* groups in turn to ACC accumulators (constant indices: kept in registers),
             * a batch's last ng % ACC groups to the first */
            int64_t j = 0;
            for (; j + ACC <= ng; j += ACC)
                for (int u = 0; u < ACC; u++)
                    acc[u] = _mm512_fmadd_ps(q8_group(q, x, (g0 + j + u) * g, g),
                                             _mm512_set1_ps(sc[j + u]), acc[u]);
            for (; j < ng; j++)
                acc[0] = _mm512_fmadd_ps(q8_group(q, x, (g0 + j) * g, g), _mm512_set1_ps(sc[j]), acc[0]);
        }
        a->y[n] = hsum_acc(acc);
    } else {
        int64_t k = 0;
        for (; k + 16 * ACC <= K; k += 16 * ACC) {
            if (!(k & 63)) PREFETCH_STREAM(q + k);
            for (int i = 0; i < ACC; i++)
                acc[i] = _mm512_fmadd_ps(widen_i8(q + k + 16 * i), _mm512_loadu_ps(x + k + 16 * i), acc[i]);
        }
        for (; k < K; k += 16) {
            const __mmask16 m = first16(K - k);
            __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + k)));
            acc[0] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x + k), acc[0]);
        }
        a->y[n] = hsum_acc(acc) * ((const float *)a->scales)[n];
    }
}

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

/* ------------------------------------------------------------------------------------
 * int4 GEMV, float (for x with inf or NaN)
 * ---------------------------------------------------------------------------------- */

TI void q4_gemv_row(const qmat *a, int64_t n, const int64_t g) {
    const int64_t K = a->K, KB = K / 2, G = K / g;
    const float *x = a->x;
    const uint8_t *q = (const uint8_t *)a->qw + n * KB;
    const uint16_t *s = (const uint16_t *)a->scales + n * G;
    __m512 acc[ACC];
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < G; gi++) {
        __m512 t = _mm512_setzero_ps();
        for (int64_t k = gi * g; k < gi * g + g; k += 32) {
            __m512i lo, hi;
            widen_i4(q + k / 2, &lo, &hi);
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_loadu_ps(x + k), t);
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_loadu_ps(x + k + 16), t);
        }
        acc[0] = _mm512_fmadd_ps(t, bcast_half(s + gi), acc[0]); /* the rare path */
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
 * int4 GEMV on x as int8 digits
 *
 * x is cut into chunks of 128 elements = 4 blocks of 32, matching 64 bytes of a row:
 * byte 16j + i holds element 32j + i (low nibble) and 32j + 16 + i (high nibble). A
 * chunk's digits are stored as [digit 1, 0][low, high][64 bytes], byte 16j + i of
 * "low" being element 32j + i's digit and of "high" element 32j + 16 + i's, so a dot
 * product's dword lane l covers 8 elements of block l / 4; then the chunk's 16 lane
 * scales (the block's sx); at the buffer's end each block's sx * sum X (xprep4_xs).
 * X as the integer GEMM's (ig_xprep): X = round(x / sx), sx = amax / IG_XMAX, so
 * |X| <= IG_XMAX; D0 = X mod 256 in [-128, 127], D1 = (X - D0) / 256 in [-127, 127].
 * Two digits, not three: with three (23 bits) the GEMV is bound by the core rather than
 * by memory.
 * ---------------------------------------------------------------------------------- */

/* 2^k as a float, for -126 <= k <= 127 */
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

/* 16 int32 X -> three digits as 16 bytes each (int8's and int6's GEMV) */
TI void digits16(__m512i X, __m128i *d2, __m128i *d1, __m128i *d0) {
    __m512i D0 = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
    __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, D0), 8);
    __m512i D1 = _mm512_srai_epi32(_mm512_slli_epi32(X1, 24), 24);
    __m512i D2 = _mm512_srai_epi32(_mm512_sub_epi32(X1, D1), 8);
    *d2 = _mm512_cvtepi32_epi8(D2);
    *d1 = _mm512_cvtepi32_epi8(D1);
    *d0 = _mm512_cvtepi32_epi8(D0);
}

/* 16 int32 X, |X| <= IG_XMAX -> two digits as 16 bytes each */
TI void digits16_2(__m512i X, __m128i *d1, __m128i *d0) {
    __m512i D0 = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
    *d1 = _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(X, D0), 8));
    *d0 = _mm512_cvtepi32_epi8(D0);
}

enum { CHUNK = 128, CHUNK_BYTES = 2 * 2 * 64 };

/* The integer GEMM's X = round(x / sx), sx = amax / IG_XMAX, of a block (x0, x1; finite,
 * max |x| = amax); zero for a block of zeros. */
TI void ig_block_X(__m512 x0, __m512 x1, float amax, __m512i *X0, __m512i *X1) {
    *X0 = *X1 = _mm512_setzero_si512();
    if (amax > 0) {
        /* tiny blocks scaled up first (exactly) so that IG_XMAX / amax is finite */
        const __m512 up = _mm512_set1_ps(amax < 0x1p-100f ? 0x1p100f : 1.0f);
        const __m512 inv = _mm512_set1_ps(IG_XMAX / (amax * _mm512_cvtss_f32(up)));
        *X0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(x0, up), inv));
        *X1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(x1, up), inv));
    }
}

T int q4_xprep(const float *x, int64_t K, void *buf) {
    const int64_t C = (K + CHUNK - 1) / CHUNK;
    int8_t *xd = buf;
    float *lanes = (float *)(xd + C * CHUNK_BYTES);
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t c = 0; c < C; c++) {
        int8_t *d = xd + c * CHUNK_BYTES;
        for (int j = 0; j < 4; j++) {
            const int64_t k = c * CHUNK + 32 * j;
            __m128i *lo = (__m128i *)(d + 16 * j), *hi = (__m128i *)(d + 64 + 16 * j);
            if (k >= K) { /* past the end: zero digits, zero scale */
                for (int p = 0; p < 2; p++) lo[8 * p] = hi[8 * p] = _mm_setzero_si128();
                for (int i = 0; i < 4; i++) lanes[16 * c + 4 * j + i] = 0;
                continue;
            }
            __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
            if (_mm512_fpclass_ps_mask(x0, 0x99) | _mm512_fpclass_ps_mask(x1, 0x99)) /* NaN, inf */
                return -1;
            float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_and_ps(x1, absmask)));
            __m512i X0, X1;
            ig_block_X(x0, x1, amax, &X0, &X1);
            digits16_2(X0, &lo[0], &lo[8]);
            digits16_2(X1, &hi[0], &hi[8]);
            const float sx = amax / IG_XMAX;
            for (int i = 0; i < 4; i++) lanes[16 * c + 4 * j + i] = sx;
            xprep4_xs(buf, K)[k / 32] = sx * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(X0, X1));
        }
    }
    return 0;
}

#define ONES16 _mm512_set1_epi16(1)
/* t + (sum of 4 u8 x s8 products of lo and xl) + (same for hi, xh), per dword lane:
 * vpmaddubsw pairs (|15 * 128 * 2| fits int16, and so does the sum of two), vpmaddwd */
#define DOT2_MADD(t, lo, xl, hi, xh)                                                             \
    _mm512_add_epi32(t, _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, xl),        \
                                                           _mm512_maddubs_epi16(hi, xh)),       \
                                          ONES16))
#define DOT2_VNNI(t, lo, xl, hi, xh) _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t, lo, xl), hi, xh)

/* The kernel, once per dot-product flavour (a macro: the VNNI one needs its own target). */
#define Q4_GEMV_DIGITS(NAME, TARGET, DOT2)                                                       \
    /* sum over chunk c of q * X, per dword lane (8 elements of block lane / 4) */              \
    TARGET static inline __attribute__((always_inline)) __m512i NAME##_chunk(                   \
        const uint8_t *q, const int8_t *xd, int64_t KB, int64_t c, int64_t pf) {                \
        const int64_t bytes = KB - 64 * c < 64 ? KB - 64 * c : 64;                              \
        const __m512i *xc = (const __m512i *)(xd + c * CHUNK_BYTES);                            \
        const __m512i m4 = _mm512_set1_epi8(0x0f);                                              \
        PREFETCH_AT(q + 64 * c, pf);                                                            \
        /* masked loads only at the tail: streaming from memory through masked loads is */     \
        /* several times slower */                                                              \
        __m512i w = bytes == 64 ? _mm512_loadu_si512(q + 64 * c)                                \
                                : _mm512_maskz_loadu_epi8(((__mmask64)1 << bytes) - 1, q + 64 * c); \
        __m512i lo = _mm512_and_si512(w, m4);                                                   \
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);                             \
        __m512i t = DOT2(_mm512_setzero_si512(), lo, xc[0], hi, xc[1]);                         \
        return DOT2(_mm512_slli_epi32(t, 8), lo, xc[2], hi, xc[3]);                             \
    }                                                                                           \
    TARGET static inline __attribute__((always_inline)) void NAME##_row(                        \
        const qmat *a, int64_t n, const int64_t g, int64_t c0, int64_t c1) {                    \
        const int64_t K = a->K, KB = K / 2, G = K / g, C = (K + CHUNK - 1) / CHUNK;             \
        const int64_t gpc = CHUNK / g; /* groups per chunk */                                  \
        const int8_t *xd = a->xq;                                                               \
        const float *lanes = (const float *)(xd + C * CHUNK_BYTES);                             \
        const uint8_t *q = (const uint8_t *)a->qw + n * KB;                                     \
        const int64_t pf = prefetch_distance(KB, C > Q4_SLICE_CHUNKS);                          \
        const uint16_t *s = (const uint16_t *)a->scales + n * G;                                \
        /* lane l of a chunk belongs to group l / (16 / gpc) of the chunk's gpc groups */       \
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); \
        const __m512i gidx = g == 32   ? _mm512_srli_epi32(lane, 2)                             \
                             : g == 64 ? _mm512_srli_epi32(lane, 3)                             \
                                       : _mm512_setzero_si512();                                \
        __m512 acc[ACC];                                                                        \
        for (int i = 0; i < ACC; i++) acc[i] = _mm512_setzero_ps();                             \
        /* chunks in turn to ACC accumulators, the last (c1 - c0) % ACC to the first */        \
        for (int64_t c = c0; c < c1; c += ACC) {                                                \
            const int u_end = c1 - c < ACC ? (int)(c1 - c) : ACC;                               \
            for (int u = 0; u < ACC; u++) {                                                     \
                if (u >= u_end) break;                                                          \
                const int64_t cu = c + u;                                                       \
                const int64_t bytes = KB - 64 * cu < 64 ? KB - 64 * cu : 64;                    \
                const uint16_t *sc = s + cu * gpc;                                              \
                __m128i h = bytes < 64 ? _mm_maskz_loadu_epi16((__mmask8)((1u << (bytes * 2 / g)) - 1), sc) \
                            : g == 32  ? _mm_loadl_epi64((const __m128i *)sc)                   \
                            : g == 64  ? _mm_cvtsi32_si128(load_i32(sc))                        \
                                       : _mm_cvtsi32_si128(*sc);                                \
                __m512 d = _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_cvtph_ps(h))); \
                __m512 f = _mm512_cvtepi32_ps(NAME##_chunk(q, xd, KB, cu, pf));                 \
                __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps(lanes + 16 * cu));              \
                if (u_end == ACC)                                                               \
                    acc[u] = _mm512_fmadd_ps(f, scale, acc[u]);                                 \
                else                                                                            \
                    acc[0] = _mm512_fmadd_ps(f, scale, acc[0]);                                 \
            }                                                                                   \
        }                                                                                       \
        const int64_t g0 = c0 * CHUNK / g, g1 = c1 == C ? G : c1 * CHUNK / g;                   \
        const float part = hsum_acc(acc) +                                                      \
            group_offset((a->mins ? a->mins : (const uint16_t *)a->scales) + n * G + g0, g1 - g0, \
                         a->xsum + g0);                                                         \
        a->y[n] = c0 ? a->y[n] + part : part;                                                   \
    }                                                                                           \
    TARGET static void NAME(const qmat *a, int64_t n0, int64_t n1) {                            \
        const int64_t C = (a->K + CHUNK - 1) / CHUNK;                                           \
        for (int64_t c0 = 0; c0 < C; c0 += Q4_SLICE_CHUNKS) {                                   \
            const int64_t c1 = C - c0 < Q4_SLICE_CHUNKS ? C : c0 + Q4_SLICE_CHUNKS;             \
            for (int64_t n = n0; n < n1; n++) switch (a->g) {                                   \
                case 32: NAME##_row(a, n, 32, c0, c1); break;                                   \
                case 64: NAME##_row(a, n, 64, c0, c1); break;                                   \
                default: NAME##_row(a, n, 128, c0, c1); break;                                  \
                }                                                                               \
        }                                                                                       \
    }

Q4_GEMV_DIGITS(q4_gemv_digits, TARGET_AVX512, DOT2_MADD)
Q4_GEMV_DIGITS(q4_gemv_digits_vnni, TARGET_AVX512_VNNI, DOT2_VNNI)

/* ------------------------------------------------------------------------------------
 * int5 GEMV with VNNI, on x as int4's digits (q4_xprep): a chunk's 64 bytes of nibbles
 * give int4's lo and hi codes, and 16 is added where qh's bit is set. Byte 16 r + i of lo
 * is element i of the chunk's block r (bit i of its qh word), of hi element 16 + i (bit
 * 16 + i): the words' low halves, gathered, are lo's byte mask, their high halves hi's.
 * Codes <= 31. The codes are made once for up to 4 rows of x; each row adds chunk c to
 * its accumulator c % ACC as int4's one-row kernel does, and one row is this kernel
 * with R = 1, so a row's output is the same alone or in a batch. int4's rows with groups
 * of 32 take the same kernel without qh: each sums what q4_gemv_digits_vnni sums alone.
 * ---------------------------------------------------------------------------------- */

TARGET_AVX512_VNNI static inline __attribute__((always_inline)) void q5_codes(
    const uint8_t *q, const uint8_t *qh, int64_t KB, int64_t c, int64_t pf, __m512i *lo,
    __m512i *hi) {
    const int64_t bytes = KB - 64 * c < 64 ? KB - 64 * c : 64;
    const __m512i m4 = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    const __m128i halves = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    PREFETCH_AT(q + 64 * c, pf);
    if (!(c & 3)) PREFETCH_AT(qh + 16 * c, pf / 4);
    /* masked loads only at the tail (see Q4_GEMV_DIGITS) */
    const __m512i w = bytes == 64 ? _mm512_loadu_si512(q + 64 * c)
                                  : _mm512_maskz_loadu_epi8(((__mmask64)1 << bytes) - 1, q + 64 * c);
    const __m128i h = bytes == 64 ? _mm_loadu_si128((const __m128i *)(qh + 16 * c))
                                  : _mm_maskz_loadu_epi8((__mmask16)((1u << (bytes / 4)) - 1), qh + 16 * c);
    const __m128i hw = _mm_shuffle_epi8(h, halves);
    *lo = _mm512_and_si512(w, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
    *lo = _mm512_mask_add_epi8(*lo, (__mmask64)_mm_cvtsi128_si64(hw), *lo, sixteen);
    *hi = _mm512_mask_add_epi8(*hi, (__mmask64)_mm_extract_epi64(hw, 1), *hi, sixteen);
}

/* int4 g32's codes of chunk c as the one-row kernel makes them */
TARGET_AVX512_VNNI static inline __attribute__((always_inline)) void q4_codes(
    const uint8_t *q, int64_t KB, int64_t c, int64_t pf, __m512i *lo, __m512i *hi) {
    const int64_t bytes = KB - 64 * c < 64 ? KB - 64 * c : 64;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    PREFETCH_AT(q + 64 * c, pf);
    const __m512i w = bytes == 64 ? _mm512_loadu_si512(q + 64 * c)
                                  : _mm512_maskz_loadu_epi8(((__mmask64)1 << bytes) - 1, q + 64 * c);
    *lo = _mm512_and_si512(w, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
}

/* Up to 4 rows of x against weight row n, chunks c0..c1: int5 (five), or int4 with groups
 * of 32, whose rows then sum what q4_gemv_digits_vnni sums for each alone. */
TARGET_AVX512_VNNI static inline __attribute__((always_inline)) void q45_rows_vnni(
    const qmat *const *a, const int R, int64_t n, int64_t c0, int64_t c1, const int five) {
    const int64_t K = a[0]->K, KB = K / 2, G = K / 32, C = (K + CHUNK - 1) / CHUNK;
    const uint8_t *q = (const uint8_t *)a[0]->qw + n * KB;
    const uint8_t *qh = five ? a[0]->qh + n * (K / 8) : NULL;
    const uint16_t *s = (const uint16_t *)a[0]->scales + n * G;
    const int64_t pf = prefetch_distance(KB, C > Q4_SLICE_CHUNKS);
    /* lane l of a chunk belongs to its block l / 4 */
    const __m512i gidx =
        _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
    __m512 acc[4][ACC];
    const int8_t *xd[4];
    const float *lanes[4];
    for (int m = 0; m < R; m++) {
        for (int i = 0; i < ACC; i++) acc[m][i] = _mm512_setzero_ps();
        xd[m] = a[m]->xq, lanes[m] = (const float *)(xd[m] + C * CHUNK_BYTES);
    }
    /* chunks in turn to ACC accumulators, the last (c1 - c0) % ACC to the first */
    for (int64_t c = c0; c < c1; c += ACC) {
        const int u_end = c1 - c < ACC ? (int)(c1 - c) : ACC;
        for (int u = 0; u < ACC; u++) {
            if (u >= u_end) break;
            const int64_t cu = c + u, bytes = KB - 64 * cu < 64 ? KB - 64 * cu : 64;
            __m512i lo, hi;
            if (five)
                q5_codes(q, qh, KB, cu, pf, &lo, &hi);
            else
                q4_codes(q, KB, cu, pf, &lo, &hi);
            const __m128i h = bytes < 64 ? _mm_maskz_loadu_epi16((__mmask8)((1u << (bytes / 16)) - 1), s + 4 * cu)
                                         : _mm_loadl_epi64((const __m128i *)(s + 4 * cu));
            const __m512 d = _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
            for (int m = 0; m < R; m++) {
                const __m512i *xc = (const __m512i *)(xd[m] + cu * CHUNK_BYTES);
                __m512i t = DOT2_VNNI(_mm512_setzero_si512(), lo, xc[0], hi, xc[1]);
                t = DOT2_VNNI(_mm512_slli_epi32(t, 8), lo, xc[2], hi, xc[3]);
                const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps(lanes[m] + 16 * cu));
                __m512 *to = &acc[m][u_end == ACC ? u : 0];
                *to = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, *to);
            }
        }
    }
    const int64_t g0 = c0 * CHUNK / 32, g1 = c1 == C ? G : c1 * CHUNK / 32;
    const uint16_t *off = (a[0]->mins ? a[0]->mins : (const uint16_t *)a[0]->scales) + n * G + g0;
    for (int m = 0; m < R; m++) {
        const float part = hsum_acc(acc[m]) + group_offset(off, g1 - g0, a[m]->xsum + g0);
        a[m]->y[n] = c0 ? a[m]->y[n] + part : part;
    }
}

/* How many rows' slices of x (2.5 bytes an element: two digits, and a lane scale per 8)
 * fit Q45_ROWS_X_BYTES of L1 at once, for rows of K */
enum { Q45_ROWS_X_BYTES = 32768 };
static inline int64_t q45_rows_fit(int64_t K) {
    const int64_t C = (K + CHUNK - 1) / CHUNK;
    return Q45_ROWS_X_BYTES / ((C < Q4_SLICE_CHUNKS ? C : Q4_SLICE_CHUNKS) * (CHUNK_BYTES + 64));
}

/* R rows of x, K in int4's slices: as many rows at once (up to 4) as q45_rows_fit, each
 * group of rows over all the task's weight rows (from L2) before the next, so that their
 * x stays in L1. Every row sums its chunks in one order either way. */
TARGET_AVX512_VNNI static inline __attribute__((always_inline)) void q45_gemv_rows_vnni(
    const qmat *const *a, int R, int64_t n0, int64_t n1, const int five) {
    const int64_t C = (a[0]->K + CHUNK - 1) / CHUNK, fit = q45_rows_fit(a[0]->K);
    const int per = fit < 1 ? 1 : fit > 4 ? 4 : (int)fit;
    for (int64_t c0 = 0; c0 < C; c0 += Q4_SLICE_CHUNKS) {
        const int64_t c1 = C - c0 < Q4_SLICE_CHUNKS ? C : c0 + Q4_SLICE_CHUNKS;
        for (int m = 0; m < R; m += per) switch (R - m < per ? R - m : per) {
            case 1: for (int64_t n = n0; n < n1; n++) q45_rows_vnni(a + m, 1, n, c0, c1, five); break;
            case 2: for (int64_t n = n0; n < n1; n++) q45_rows_vnni(a + m, 2, n, c0, c1, five); break;
            case 3: for (int64_t n = n0; n < n1; n++) q45_rows_vnni(a + m, 3, n, c0, c1, five); break;
            default: for (int64_t n = n0; n < n1; n++) q45_rows_vnni(a + m, 4, n, c0, c1, five); break;
            }
    }
}

TARGET_AVX512_VNNI static void q5_gemv_rows_vnni(const qmat *const *a, int R, int64_t n0,
                                                 int64_t n1) {
    q45_gemv_rows_vnni(a, R, n0, n1, 1);
}

TARGET_AVX512_VNNI static void q5_gemv_vnni(const qmat *a, int64_t n0, int64_t n1) {
    q5_gemv_rows_vnni(&a, 1, n0, n1);
}

/* int4's rows: groups of 32 (GGUF's Q4_0 and Q4_1, our default) share each weight row's
 * codes while 3 or more rows' x fit L1 (K up to 4,352); longer rows, and other groups,
 * run the one-row kernel a row at a time over the task's weights, from L2 (as fast or
 * faster there, and the same sums) */
TARGET_AVX512_VNNI static void q4_gemv_rows_vnni(const qmat *const *a, int R, int64_t n0,
                                                 int64_t n1) {
    if (a[0]->g == 32 && q45_rows_fit(a[0]->K) >= 3) {
        q45_gemv_rows_vnni(a, R, n0, n1, 0);
        return;
    }
    for (int m = 0; m < R; m++) q4_gemv_digits_vnni(a[m], n0, n1);
}

/* ------------------------------------------------------------------------------------
 * int8 GEMV on x as int8 digits (VNNI only)
 *
 * x is cut into chunks of 64 elements, matching 64 bytes of a row: [digit 2, 1, 0][64
 * bytes], byte i of a digit vector being element i's digit, so dword lane l covers
 * elements 4l..4l+3 of block l / 8; then 16 lane scales per chunk (the block's sx);
 * then per block of 32, xs = -128 * sx * sum X. Digits as q4_xprep's, |X| <= 2^21: 4 * 255 * 2^21 < 2^31.
 * vpdpbusd multiplies unsigned by signed bytes: u = q ^ 0x80 = q + 128 as unsigned,
 * and sum q X = sum u X - 128 sum X, the second term added once per group (xsum).
 * ---------------------------------------------------------------------------------- */

T int q8_xprep(const float *x, int64_t K, void *buf) {
    const int64_t B = (K + 31) / 32;
    int8_t *xd = buf;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < B; b++) {
        const int64_t k = 32 * b, n = K - k < 32 ? K - k : 32;
        int8_t *d = xd + (b / 2) * XPREP8_CHUNK_BYTES + 32 * (b % 2);
        const __mmask16 m0 = first16(n), m1 = first16(n - 16 > 0 ? n - 16 : 0);
        __m512 x0 = _mm512_maskz_loadu_ps(m0, x + k), x1 = _mm512_maskz_loadu_ps(m1, x + k + 16);
        float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_and_ps(x1, absmask)));
        const int e = block_exponent(amax);
        if (e == 999 || _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q))
            return -1;
        /* X = x * 2^(21 - e) in two exact steps (the exponent may exceed float's range) */
        const __m512 s1 = _mm512_set1_ps(pow2((21 - e) / 2)), s2 = _mm512_set1_ps(pow2(21 - e - (21 - e) / 2));
        __m512i X0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(x0, s1), s2));
        __m512i X1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(x1, s1), s2));
        __m128i d2, d1, d0;
        digits16(X0, &d2, &d1, &d0);
        _mm_storeu_si128((__m128i *)(d + 0), d2);
        _mm_storeu_si128((__m128i *)(d + 64), d1);
        _mm_storeu_si128((__m128i *)(d + 128), d0);
        digits16(X1, &d2, &d1, &d0);
        _mm_storeu_si128((__m128i *)(d + 16), d2);
        _mm_storeu_si128((__m128i *)(d + 64 + 16), d1);
        _mm_storeu_si128((__m128i *)(d + 128 + 16), d0);
        const float sx = pow2((e - 21) / 2) * pow2(e - 21 - (e - 21) / 2);
        xprep8_block(buf, K, b, sx, _mm512_reduce_add_epi32(_mm512_add_epi32(X0, X1)));
    }
    xprep8_pad(buf, K);
    return 0;
}

/* sum over chunk c of (q + 128) * X, per dword lane (4 elements of block 2c + lane / 8) */
TARGET_AVX512_VNNI static inline __attribute__((always_inline)) __m512i q8_digits_chunk(
    const int8_t *q, const int8_t *xd, int64_t K, int64_t c, int64_t pf) {
    const int64_t bytes = K - 64 * c < 64 ? K - 64 * c : 64;
    const __m512i *xc = (const __m512i *)(xd + c * XPREP8_CHUNK_BYTES);
    PREFETCH_AT(q + 64 * c, pf);
    /* masked loads only at the tail (see Q4_GEMV_DIGITS); past K the digits are 0 */
    __m512i w = bytes == 64 ? _mm512_loadu_si512(q + 64 * c)
                            : _mm512_maskz_loadu_epi8(((__mmask64)1 << bytes) - 1, q + 64 * c);
    const __m512i u = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xc[0]);
    t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), u, xc[1]);
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), u, xc[2]);
}

TARGET_AVX512_VNNI static inline __attribute__((always_inline)) void q8_gemv_digits_row(
    const qmat *a, int64_t n, const int64_t g, int64_t c0, int64_t c1) {
    const int64_t K = a->K, C = (K + 63) / 64;
    const int8_t *xd = a->xq;
    const float *lanes = (const float *)(xd + C * XPREP8_CHUNK_BYTES);
    const int8_t *q = (const int8_t *)a->qw + n * K;
    const int64_t pf = prefetch_distance(K, C > XPREP8_SLICE_CHUNKS);
    /* lane l of a chunk: group 2c + l / 8 (g = 32), c (g = 64), c / 2 (g = 128) */
    const __m512i gidx = _mm512_srli_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 3);
    __m512 acc[ACC];
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = c0; c < c1; c += ACC) {
        const int u_end = c1 - c < ACC ? (int)(c1 - c) : ACC;
        for (int u = 0; u < ACC; u++) {
            if (u >= u_end) break;
            const int64_t cu = c + u;
            __m512 f = _mm512_cvtepi32_ps(q8_digits_chunk(q, xd, K, cu, pf));
            __m512 scale = _mm512_loadu_ps(lanes + 16 * cu);
            if (g) {
                const uint16_t *s = (const uint16_t *)a->scales + n * (K / g);
                __m512 d;
                if (g == 32) {
                    const int64_t gi = 2 * cu;
                    __m128i h = gi + 1 < K / g ? _mm_cvtsi32_si128(load_i32(s + gi))
                                               : _mm_cvtsi32_si128(s[gi]);
                    d = _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
                } else {
                    d = bcast_half(s + cu * 64 / g);
                }
                scale = _mm512_mul_ps(d, scale);
            }
            if (u_end == ACC)
                acc[u] = _mm512_fmadd_ps(f, scale, acc[u]);
            else
                acc[0] = _mm512_fmadd_ps(f, scale, acc[0]);
        }
    }
    float part = hsum_acc(acc);
    if (g) {
        const int64_t g0 = c0 * 64 / g, g1 = c1 == C ? K / g : c1 * 64 / g;
        part += group_offset((const uint16_t *)a->scales + n * (K / g) + g0, g1 - g0, a->xsum + g0);
    }
    part = c0 ? a->y[n] + part : part;
    /* per channel: the scale once, after the last slice */
    a->y[n] = g || c1 < C ? part : (part + a->xsum[0]) * ((const float *)a->scales)[n];
}

TARGET_AVX512_VNNI static void q8_gemv_digits(const qmat *a, int64_t n0, int64_t n1) {
    const int64_t C = (a->K + 63) / 64;
    for (int64_t c0 = 0; c0 < C; c0 += XPREP8_SLICE_CHUNKS) {
        const int64_t c1 = C - c0 < XPREP8_SLICE_CHUNKS ? C : c0 + XPREP8_SLICE_CHUNKS;
        for (int64_t n = n0; n < n1; n++) switch (a->g) {
            case 32: q8_gemv_digits_row(a, n, 32, c0, c1); break;
            case 64: q8_gemv_digits_row(a, n, 64, c0, c1); break;
            case 128: q8_gemv_digits_row(a, n, 128, c0, c1); break;
            default: q8_gemv_digits_row(a, n, 0, c0, c1); break;
            }
    }
}

/* ------------------------------------------------------------------------------------
 * int6 GEMV (kernels.h: int6): on plain AVX-512, x as the int8 GEMV's digits (XPREP8's
 * layout); with VNNI, x as int16 (below).
 *
 * Half a block (128 weights: 64 bytes of ql, 32 of qh) widens to two vectors of codes in
 * element order, with no shuffle: lo = elements 0..63 (ql & 15; top bits from qh's bits
 * 0-1 for bytes 0..31, 2-3 for 32..63), hi = elements 64..127 (ql >> 4; qh's bits 4-5,
 * 6-7), qh loaded into both 256-bit halves and shifted per half. Each vector meets one
 * chunk of x's digits (three dot products). Dword lane l of lo covers elements 4l..4l+3,
 * in the half's group of 16 number l / 4; of hi, 4 + l / 4. Codes <= 63, so vpmaddubsw's
 * int16 pairs hold (63 * 128 * 2 < 2^15).
 * ---------------------------------------------------------------------------------- */

/* Half h of an int6 block -> its codes as bytes: lo = elements 0..63, hi = 64..127 */
TI void q6_widen(const uint8_t *blk, int h, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    /* qh's top bits to bits 4-5: per 256-bit half, lo shifts left 4 / 2, hi right 0 / 2 */
    const __m512i sh_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i sh_hi = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
    *lo = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, sh_lo), m30));
    *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                          _mm512_and_si512(_mm512_srlv_epi16(qh, sh_hi), m30));
}

#define DOT1(t, q, x) _mm512_add_epi32(t, _mm512_madd_epi16(_mm512_maddubs_epi16(q, x), ONES16))

/* sum q X per dword lane, q against one chunk of x's three digits */
TI __m512 q6_gemv_digits_dot(__m512i q, const int8_t *xc) {
    const __m512i *v = (const __m512i *)xc;
    __m512i t = DOT1(_mm512_setzero_si512(), q, v[0]);
    t = DOT1(_mm512_slli_epi32(t, 8), q, v[1]);
    return _mm512_cvtepi32_ps(DOT1(_mm512_slli_epi32(t, 8), q, v[2]));
}

TI void q6_gemv_digits_slice(const qmat *a, int64_t n0, int64_t n1, int64_t b0) {
    const int64_t K = a->K, B = K / Q6_BLOCK;
    const int64_t b1 = B - b0 < XPREP8_SLICE_CHUNKS / 4 ? B : b0 + XPREP8_SLICE_CHUNKS / 4;
    const int64_t pf = prefetch_distance(B * Q6_BLOCK_BYTES, B > XPREP8_SLICE_CHUNKS / 4);
    const int8_t *xd = a->xq;
    const float *lanes = (const float *)(xd + K / 64 * XPREP8_CHUNK_BYTES);
    const __m512i g_lo = _mm512_srli_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
    const __m512i g_hi = _mm512_add_epi32(g_lo, _mm512_set1_epi32(4));
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)a->qw + n * B * Q6_BLOCK_BYTES;
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        __m512 off = _mm512_setzero_ps();
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *blk = row + b * Q6_BLOCK_BYTES;
            for (int p = 0; p < Q6_BLOCK_BYTES; p += 64) PREFETCH_AT(blk + p, pf);
            uint16_t dh;
            memcpy(&dh, blk + 208, 2);
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
            const __m512 sc = widen_i8((const int8_t *)(blk + 192));
            /* the groups' -32 sx sum X terms, times d sc */
            off = _mm512_fmadd_ps(_mm512_mul_ps(sc, d), _mm512_loadu_ps(a->xsum + 16 * b), off);
            __m512 f = _mm512_setzero_ps();
            for (int h = 0; h < 2; h++) {
                __m512i lo, hi;
                q6_widen(blk, h, &lo, &hi);
                const int64_t c = 4 * b + 2 * h; /* x's chunk for lo; c + 1 for hi */
                const __m512i at = _mm512_set1_epi32(8 * h);
                /* each lane's scale: its group's sc times its x block's sx */
                const __m512 s0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(g_lo, at), sc),
                                                _mm512_loadu_ps(lanes + 16 * c));
                const __m512 s1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_add_epi32(g_hi, at), sc),
                                                _mm512_loadu_ps(lanes + 16 * (c + 1)));
                f = _mm512_fmadd_ps(q6_gemv_digits_dot(lo, xd + c * XPREP8_CHUNK_BYTES), s0, f);
                f = _mm512_fmadd_ps(q6_gemv_digits_dot(hi, xd + (c + 1) * XPREP8_CHUNK_BYTES), s1, f);
            }
            acc[b & 1] = _mm512_fmadd_ps(f, d, acc[b & 1]);
        }
        const float part = hsum(_mm512_add_ps(acc[0], acc[1])) + hsum(off);
        a->y[n] = b0 ? a->y[n] + part : part;
    }
}
T void q6_gemv_digits(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t b0 = 0; b0 < a->K / Q6_BLOCK; b0 += XPREP8_SLICE_CHUNKS / 4)
        q6_gemv_digits_slice(a, n0, n1, b0);
}

/* ---- AVX-512 VNNI: int6 on x as int16 X, 15 significant bits per block of 256 --------
 * (in the XPREP8_BYTES buffer): X in element order (2 K bytes), then per block sx. A half
 * block's codes less 32 widen to int16 and take their group's sc once (|(q - 32) sc| <=
 * 32 * 128) for up to 8 rows of x; each row then takes one vpdpwssd per 32 weights. A
 * block's int32 lanes sum 16 products each, 16 * 32 * 128 * IG_XMAX < 2^31, so they are
 * exact, the groups' offset included; a block then takes one float step, d sx times its
 * sum. The one-row GEMV is this kernel with one row, so a row's output is the same alone
 * or in a batch. */

T int q6_xprep256(const float *x, int64_t K, void *buf) {
    int16_t *X = buf;
    float *sxs = (float *)(X + K);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / Q6_BLOCK; b++) {
        const float *xb = x + b * Q6_BLOCK;
        __m512 mx = zero;
        __mmask16 bad = 0;
        for (int i = 0; i < 16; i++) {
            const __m512 v = _mm512_loadu_ps(xb + 16 * i);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
            bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), zero, _CMP_NEQ_UQ); /* NaN or inf */
        }
        if (bad) return -1;
        const float amax = _mm512_reduce_max_ps(mx);
        /* tiny blocks scaled up first (exactly) so that IG_XMAX / amax is finite */
        const float up = amax < 0x1p-100f ? 0x1p100f : 1.0f;
        const __m512 inv = _mm512_set1_ps(amax > 0 ? IG_XMAX / (amax * up) : 0);
        const __m512 vup = _mm512_set1_ps(up);
        for (int i = 0; i < 16; i++) { /* |X| <= IG_XMAX: the narrowing keeps it */
            const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * i), vup), inv);
            _mm256_storeu_si256((__m256i *)(X + b * Q6_BLOCK + 16 * i),
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
        }
        sxs[b] = amax / IG_XMAX;
    }
    return 0;
}

/* Up to 8 rows of x against int6 weight row n, blocks b0..b1. Each row of x carries its
 * accumulator in st from block to block: zero at block 0, the output at block B. So a
 * row's arithmetic is one chain over the blocks (one step a block), whichever order the
 * blocks and weight rows are visited in. */
TARGET_AVX512_VNNI static inline __attribute__((always_inline)) void q6_rows16(
    const qmat *const *a, const int R, int64_t n, int64_t b0, int64_t b1, int64_t pf,
    __m512 *st) {
    const int64_t K = a[0]->K, B = K / Q6_BLOCK;
    const uint8_t *row = (const uint8_t *)a[0]->qw + n * B * Q6_BLOCK_BYTES;
    /* int16 lane l of a product vector takes group l / 16 of its pair (vpermw) */
    const __m512i pair = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15,
                         14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 4);
    __m512 acc[8];
    const float *sxp[8];
    const int16_t *xp[8];
    for (int m = 0; m < R; m++) {
        acc[m] = b0 ? st[m] : _mm512_setzero_ps();
        xp[m] = a[m]->xq, sxp[m] = (const float *)(xp[m] + K);
    }
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *blk = row + b * Q6_BLOCK_BYTES;
        for (int p = 0; p < Q6_BLOCK_BYTES; p += 64) PREFETCH_AT(blk + p, pf);
        uint16_t dh;
        memcpy(&dh, blk + 208, 2);
        const float d = _cvtsh_ss(dh);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
        __m512i t[8];
        for (int m = 0; m < R; m++) t[m] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512i lo, hi, p[4];
            q6_widen(blk, h, &lo, &hi);
            const __m256i q32[4] = {_mm512_castsi512_si256(lo), _mm512_extracti64x4_epi64(lo, 1),
                                    _mm512_castsi512_si256(hi), _mm512_extracti64x4_epi64(hi, 1)};
            for (int i = 0; i < 4; i++) { /* elements 32 i.. of the half: groups 2 i, 2 i + 1 */
                const __m512i s = _mm512_permutexvar_epi16(
                    _mm512_add_epi16(pair, _mm512_set1_epi16((short)(8 * h + 2 * i))), sc);
                p[i] = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm256_sub_epi8(q32[i], _mm256_set1_epi8(32))), s);
            }
            for (int m = 0; m < R; m++) {
                const __m512i *x = (const __m512i *)(xp[m] + b * Q6_BLOCK + 128 * h);
                for (int i = 0; i < 4; i++) t[m] = _mm512_dpwssd_epi32(t[m], p[i], _mm512_loadu_si512(x + i));
            }
        }
        for (int m = 0; m < R; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]), _mm512_set1_ps(d * sxp[m][b]), acc[m]);
    }
    for (int m = 0; m < R; m++) {
        if (b1 == B)
            a[m]->y[n] = hsum(acc[m]);
        else
            st[m] = acc[m];
    }
}

TARGET_AVX512_VNNI static inline __attribute__((always_inline)) void q6_slice(
    const qmat *const *a, int R, int64_t n, int64_t b0, int64_t b1, int64_t pf, float *st) {
    __m512 *s = (__m512 *)st;
    switch (R) {
    case 1: q6_rows16(a, 1, n, b0, b1, pf, s); break;
    case 2: q6_rows16(a, 2, n, b0, b1, pf, s); break;
    case 3: q6_rows16(a, 3, n, b0, b1, pf, s); break;
    case 4: q6_rows16(a, 4, n, b0, b1, pf, s); break;
    case 5: q6_rows16(a, 5, n, b0, b1, pf, s); break;
    case 6: q6_rows16(a, 6, n, b0, b1, pf, s); break;
    case 7: q6_rows16(a, 7, n, b0, b1, pf, s); break;
    default: q6_rows16(a, 8, n, b0, b1, pf, s); break;
    }
}

TARGET_AVX512_VNNI static void q6_gemv_rows16(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    rows_in_slices(q6_slice, a, R, n0, n1, a[0]->K / Q6_BLOCK, Q6_BLOCK_BYTES, PREFETCH_AHEAD);
}

TARGET_AVX512_VNNI static void q6_gemv16(const qmat *a, int64_t n0, int64_t n1) {
    q6_gemv_rows16(&a, 1, n0, n1);
}

/* ------------------------------------------------------------------------------------
 * Dequantization for the GEMM (exactly the formats' definitions: no FMA)
 * ---------------------------------------------------------------------------------- */

T void q8_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, g = a->g;
    for (int64_t n = n0; n < n1; n++, w += K) {
        const int8_t *q = (const int8_t *)a->qw + n * K;
        if (g) {
            const uint16_t *s = (const uint16_t *)a->scales + n * (K / g);
            for (int64_t k0 = 0; k0 < K; k0 += g) {
                __m512 d = bcast_half(s + k0 / g);
                for (int64_t k = k0; k < k0 + g; k += 16)
                    _mm512_storeu_ps(w + k, _mm512_mul_ps(widen_i8(q + k), d));
            }
        } else {
            __m512 d = _mm512_set1_ps(((const float *)a->scales)[n]);
            int64_t k = 0;
            for (; k + 16 <= K; k += 16) _mm512_storeu_ps(w + k, _mm512_mul_ps(widen_i8(q + k), d));
            if (k < K) {
                const __mmask16 m = first16(K - k);
                __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + k)));
                _mm512_mask_storeu_ps(w + k, m, _mm512_mul_ps(v, d));
            }
        }
    }
}

T void q4_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, g = a->g, G = K / g;
    const __m512i eight = _mm512_set1_epi32(8);
    for (int64_t n = n0; n < n1; n++, w += K) {
        const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2);
        const uint16_t *s = (const uint16_t *)a->scales + n * G;
        const uint16_t *mn = a->mins ? a->mins + n * G : NULL;
        for (int64_t gi = 0; gi < G; gi++) {
            __m512 d = bcast_half(s + gi);
            for (int64_t k = gi * g; k < gi * g + g; k += 32) {
                __m512i lo, hi;
                widen_i4(q + k / 2, &lo, &hi);
                if (mn) { /* q * d + m */
                    __m512 m = bcast_half(mn + gi);
                    _mm512_storeu_ps(w + k, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), m));
                    _mm512_storeu_ps(w + k + 16,
                                     _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), d), m));
                } else { /* (q - 8) * d */
                    lo = _mm512_sub_epi32(lo, eight);
                    hi = _mm512_sub_epi32(hi, eight);
                    _mm512_storeu_ps(w + k, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d));
                    _mm512_storeu_ps(w + k + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d));
                }
            }
        }
    }
}

/* int6, as q6_dequant_c: each half block widened as the GEMV widens it, 16 codes at a
 * time to float times their group's d * sc (every product exact) */
T void q6_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q6_BLOCK;
    const __m512i c32 = _mm512_set1_epi8(32);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)a->qw + n * B * Q6_BLOCK_BYTES;
        for (int64_t b = 0; b < B; b++, w += Q6_BLOCK) {
            const uint8_t *blk = row + b * Q6_BLOCK_BYTES;
            uint16_t dh;
            memcpy(&dh, blk + 208, 2);
            const float d = _cvtsh_ss(dh);
            int8_t q[Q6_BLOCK]; /* q - 32, in element order */
            for (int h = 0; h < 2; h++) {
                __m512i lo, hi;
                q6_widen(blk, h, &lo, &hi);
                _mm512_storeu_si512(q + 128 * h, _mm512_sub_epi8(lo, c32));
                _mm512_storeu_si512(q + 128 * h + 64, _mm512_sub_epi8(hi, c32));
            }
            for (int grp = 0; grp < 16; grp++) {
                const float ds = d * (float)(int8_t)blk[192 + grp];
                const __m512 c = widen_i8(q + 16 * grp);
                _mm512_storeu_ps(w + 16 * grp, _mm512_mul_ps(c, _mm512_set1_ps(ds)));
            }
        }
    }
}

/* ------------------------------------------------------------------------------------
 * Float tile: y[m, j] (+)= x[m, :] . w[j, :]
 * ---------------------------------------------------------------------------------- */

/* An MR x NR block of dot products, MR, NR <= 4 fixed at compile time. */
TI void tile_block(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                   int64_t K, int accumulate, const int MR, const int NR) {
    __m512 c[4][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) c[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[4];
        for (int i = 0; i < MR; i++) xv[i] = _mm512_loadu_ps(x + i * ldx + k);
        for (int j = 0; j < NR; j++) {
            __m512 wv = _mm512_loadu_ps(w + j * ldw + k);
            for (int i = 0; i < MR; i++) c[i][j] = _mm512_fmadd_ps(xv[i], wv, c[i][j]);
        }
    }
    if (k < K) {
        const __mmask16 m = first16(K - k);
        __m512 xv[4];
        for (int i = 0; i < MR; i++) xv[i] = _mm512_maskz_loadu_ps(m, x + i * ldx + k);
        for (int j = 0; j < NR; j++) {
            __m512 wv = _mm512_maskz_loadu_ps(m, w + j * ldw + k);
            for (int i = 0; i < MR; i++) c[i][j] = _mm512_fmadd_ps(xv[i], wv, c[i][j]);
        }
    }
    for (int i = 0; i < MR; i++) {
        float *yi = y + i * ldy;
        if (NR == 4) {
            __m128 v = hsum4(c[i][0], c[i][1], c[i][2], c[i][3]);
            _mm_storeu_ps(yi, accumulate ? _mm_add_ps(_mm_loadu_ps(yi), v) : v);
        } else {
            for (int j = 0; j < NR; j++) yi[j] = accumulate ? yi[j] + hsum(c[i][j]) : hsum(c[i][j]);
        }
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
        for (int64_t j = 0; j < nb; j += 4) {
            const int nr = nb - j < 4 ? (int)(nb - j) : 4;
            switch (mr * 8 + nr) {
                TILE_CASE(4, 4) TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
                TILE_CASE(3, 4) TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
                TILE_CASE(2, 4) TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
                TILE_CASE(1, 4) TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
            }
        }
    }
}

/* ------------------------------------------------------------------------------------
 * Integer GEMM (igemm.c; layouts in kernels.h): x as two int8 digits, 16 rows of x per
 * vector; W's codes broadcast 4 at a time. A block of 32 rows of x by NR rows of W: per
 * 4 elements, four 64-byte loads of digits, NR broadcasts, 4 NR vpdpbusd; per block of
 * 32, the digits' sums combined, the offset taken back, one conversion and one FMA (two
 * if asymmetric) per 16 outputs.
 * ---------------------------------------------------------------------------------- */

T int ig_xprep(const float *x, int64_t K, int64_t t, int o, const ig_x *d) {
    const int64_t Kp = d->Kp, B = Kp / 32;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    int8_t *dt = d->digits + t * B * 8 * 256;
    const int64_t rows = d->M - t * IG_MR < IG_MR ? d->M - t * IG_MR : IG_MR;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + (t * IG_MR + r) * K;
        /* row r's dword lane: in the first or second 64 bytes of each 128 */
        int8_t *dr = dt + (r / 16) * 64 + (r % 16) * 4;
        for (int64_t b = 0; b < B; b++) {
            const int64_t k = 32 * b, i = (t * B + b) * IG_MR + r, n = K - k < 32 ? K - k : 32;
            __m512 x0 = _mm512_maskz_loadu_ps(first16(n), xr + k);
            __m512 x1 = _mm512_maskz_loadu_ps(n > 16 ? first16(n - 16) : 0, xr + k + 16);
            if (_mm512_fpclass_ps_mask(x0, 0x99) | _mm512_fpclass_ps_mask(x1, 0x99)) /* NaN, inf */
                return -1;
            float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_and_ps(x1, absmask)));
            __m512i X0, X1;
            ig_block_X(x0, x1, amax, &X0, &X1);
            const __m512i L0 = _mm512_srai_epi32(_mm512_slli_epi32(X0, 24), 24);
            const __m512i L1 = _mm512_srai_epi32(_mm512_slli_epi32(X1, 24), 24);
            /* dword j of the hi (lo) digits: elements 4j..4j+3, to group j's hi (lo) vectors */
            const __m128i h0 = _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(X0, L0), 8));
            const __m128i h1 = _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(X1, L1), 8));
            const __m128i l0 = _mm512_cvtepi32_epi8(L0), l1 = _mm512_cvtepi32_epi8(L1);
            int32_t *db = (int32_t *)(dr + b * 8 * 256);
            db[0] = _mm_cvtsi128_si32(h0), db[64] = _mm_extract_epi32(h0, 1);
            db[128] = _mm_extract_epi32(h0, 2), db[192] = _mm_extract_epi32(h0, 3);
            db[256] = _mm_cvtsi128_si32(h1), db[320] = _mm_extract_epi32(h1, 1);
            db[384] = _mm_extract_epi32(h1, 2), db[448] = _mm_extract_epi32(h1, 3);
            db[32] = _mm_cvtsi128_si32(l0), db[96] = _mm_extract_epi32(l0, 1);
            db[160] = _mm_extract_epi32(l0, 2), db[224] = _mm_extract_epi32(l0, 3);
            db[288] = _mm_cvtsi128_si32(l1), db[352] = _mm_extract_epi32(l1, 1);
            db[416] = _mm_extract_epi32(l1, 2), db[480] = _mm_extract_epi32(l1, 3);
            ig_terms(d, i, amax, _mm512_reduce_add_epi32(_mm512_add_epi32(X0, X1)), o);
        }
    }
    return 0;
}

#define TV TARGET_AVX512_VNNI static inline __attribute__((always_inline))

/* ah, al = sums over the groups [J0, J1) of 4 elements of a block of codes times x's hi
 * and lo digits, for 16 MV rows of x and NR rows of W. */
TV void ig_sums(const int8_t *xd, const uint8_t *w, int64_t Kp, int64_t b, __m512i ah[4][2],
                __m512i al[4][2], const int MV, const int NR, const int J0, const int J1) {
    for (int n = 0; n < NR; n++) ah[n][0] = ah[n][1] = al[n][0] = al[n][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = J0; j < J1; j++) {
        __m512i xh[2], xl[2];
        for (int v = 0; v < MV; v++) {
            xh[v] = _mm512_load_si512(xd + j * 256 + 64 * v);
            xl[v] = _mm512_load_si512(xd + j * 256 + 128 + 64 * v);
        }
        for (int n = 0; n < NR; n++) {
            const __m512i c = _mm512_set1_epi32(load_i32(w + n * Kp + 32 * b + 4 * j));
            for (int v = 0; v < MV; v++) {
                ah[n][v] = _mm512_dpbusd_epi32(ah[n][v], c, xh[v]);
                al[n][v] = _mm512_dpbusd_epi32(al[n][v], c, xl[v]);
            }
        }
    }
}

/* f += (256 ah + al - off) sx d (+ xs m): off's and xs's rows at i (off_lo and xs_lo, or
 * off and xs minus them, for a half: `lo` 1 or 2). */
TV void ig_scale(const ig_x *x, int64_t i, const __m512i ah[4][2], const __m512i al[4][2],
                 const int lo, const float *d, int64_t stride, const float *mins, __m512 f[4][2],
                 const int MV, const int NR) {
    for (int v = 0; v < MV; v++) {
        const int64_t k = i + 16 * v;
        __m512i o = _mm512_setzero_si512(); /* the codes' offset term: none with mins (o = 0) */
        __m512 xs = _mm512_setzero_ps();
        if (mins) {
            xs = _mm512_load_ps(lo == 1 ? x->xs_lo + k : x->xs + k);
            if (lo == 2) xs = _mm512_sub_ps(xs, _mm512_load_ps(x->xs_lo + k));
        } else {
            o = _mm512_load_si512(lo == 1 ? x->off_lo + k : x->off + k);
            if (lo == 2) o = _mm512_sub_epi32(o, _mm512_load_si512(x->off_lo + k));
        }
        const __m512 sx = _mm512_load_ps(x->sx + k);
        for (int n = 0; n < NR; n++) {
            __m512i a = _mm512_add_epi32(_mm512_slli_epi32(ah[n][v], 8), al[n][v]);
            if (!mins) a = _mm512_sub_epi32(a, o);
            f[n][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(sx, _mm512_set1_ps(d[n * stride])), f[n][v]);
            if (mins) f[n][v] = _mm512_fmadd_ps(xs, _mm512_set1_ps(mins[n * stride]), f[n][v]);
        }
    }
}

/* y for rows [32 t, 32 t + 16 MV) of x and NR rows of W; MV (1, 2), NR (1-4) and H (1;
 * 2: a d per 16, each half of a block summed and scaled apart) fixed at compile time. */
TV void ig_block(const ig_x *x, int64_t t, const uint8_t *w, const float *d, const float *mins,
                 float *y, int64_t ldy, const int MV, const int NR, const int H) {
    const int64_t Kp = x->Kp, B = Kp / 32;
    const int8_t *xd = x->digits + t * B * 8 * 256;
    __m512 f[4][2];
    for (int n = 0; n < NR; n++) f[n][0] = f[n][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++, xd += 8 * 256) {
        const int64_t i = (t * B + b) * IG_MR;
        __m512i ah[4][2], al[4][2];
        if (H == 1) {
            ig_sums(xd, w, Kp, b, ah, al, MV, NR, 0, 8);
            ig_scale(x, i, ah, al, 0, d + b, B, mins ? mins + b : NULL, f, MV, NR);
        } else { /* elements 0..15, then 16..31; d and m per 16 */
            ig_sums(xd, w, Kp, b, ah, al, MV, NR, 0, 4);
            ig_scale(x, i, ah, al, 1, d + 2 * b, 2 * B, mins ? mins + 2 * b : NULL, f, MV, NR);
            ig_sums(xd, w, Kp, b, ah, al, MV, NR, 4, 8);
            ig_scale(x, i, ah, al, 2, d + 2 * b + 1, 2 * B, mins ? mins + 2 * b + 1 : NULL, f, MV, NR);
        }
    }
    const int64_t rows = x->M - t * IG_MR < 16 * MV ? x->M - t * IG_MR : 16 * MV;
    y += t * IG_MR * ldy;
    for (int v = 0; v < MV; v++) {
        if (NR == 4) { /* 4 columns x 16 rows -> 16 rows of 4: a 4 x 4 transpose per lane */
            const __m512 t0 = _mm512_unpacklo_ps(f[0][v], f[1][v]), t1 = _mm512_unpackhi_ps(f[0][v], f[1][v]);
            const __m512 t2 = _mm512_unpacklo_ps(f[2][v], f[3][v]), t3 = _mm512_unpackhi_ps(f[2][v], f[3][v]);
            const __m512 u[4] = {_mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xEE),
                                 _mm512_shuffle_ps(t1, t3, 0x44), _mm512_shuffle_ps(t1, t3, 0xEE)};
            for (int r = 0; r < 16 && 16 * v + r < rows; r++) {
                const __m512 ur = u[r % 4];
                const __m128 row = r / 4 == 0   ? _mm512_castps512_ps128(ur)
                                   : r / 4 == 1 ? _mm512_extractf32x4_ps(ur, 1)
                                   : r / 4 == 2 ? _mm512_extractf32x4_ps(ur, 2)
                                                : _mm512_extractf32x4_ps(ur, 3);
                _mm_storeu_ps(y + (16 * v + r) * ldy, row);
            }
        } else { /* the last columns of W: through memory */
            float o[4][16];
            for (int n = 0; n < NR; n++) _mm512_storeu_ps(o[n], f[n][v]);
            for (int r = 0; r < 16 && 16 * v + r < rows; r++)
                for (int n = 0; n < NR; n++) y[(16 * v + r) * ldy + n] = o[n][r];
        }
    }
}

#define IG_CASE(MV_, NR_, H_)                                                                    \
    case (MV_) * 8 + (NR_):                                                                      \
        ig_block(x, t, w + n * Kp, d + n * B * H_, m ? m + n * B * H_ : NULL, y + n, ldy, MV_, NR_, H_); \
        break;
#define IG_CASES(H_)                                                                             \
    IG_CASE(2, 4, H_) IG_CASE(2, 3, H_) IG_CASE(2, 2, H_) IG_CASE(2, 1, H_)                      \
    IG_CASE(1, 4, H_) IG_CASE(1, 3, H_) IG_CASE(1, 2, H_) IG_CASE(1, 1, H_)

/* The panel for H (above); one function each, so that their registers are allocated apart. */
TV void ig_panel_h(const ig_x *x, const uint8_t *w, const float *d, const float *m, float *y,
                   int64_t ldy, int64_t nb, const int H) {
    const int64_t Kp = x->Kp, B = Kp / 32, tiles = (x->M + IG_MR - 1) / IG_MR;
    for (int64_t t = 0; t < tiles; t++) {
        const int mv = x->M - t * IG_MR > 16 ? 2 : 1;
        for (int64_t n = 0; n < nb; n += 4) {
            const int nr = nb - n < 4 ? (int)(nb - n) : 4;
            if (H == 2)
                switch (mv * 8 + nr) { IG_CASES(2) }
            else
                switch (mv * 8 + nr) { IG_CASES(1) }
        }
    }
}

TARGET_AVX512_VNNI __attribute__((noinline)) static void ig_panel_halves(
    const ig_x *x, const uint8_t *w, const float *d, const float *m, float *y, int64_t ldy, int64_t nb) {
    ig_panel_h(x, w, d, m, y, ldy, nb, 2);
}

TARGET_AVX512_VNNI static void ig_panel(const ig_x *x, const uint8_t *w, const float *d,
                                        const float *m, float *y, int64_t ldy, int64_t nb) {
    if (x->off_lo)
        ig_panel_halves(x, w, d, m, y, ldy, nb);
    else
        ig_panel_h(x, w, d, m, y, ldy, nb, 1);
}

const kernel_table kernels_avx512 = {
    q8_gemv, q4_gemv, q4_xprep, q4_gemv_digits, q8_dequant, q4_dequant, tile,
    .q6_xprep = q8_xprep, .q6_gemv_digits = q6_gemv_digits, .q6_dequant = q6_dequant,
    .q5_xprep = avx2_q4_xprep, .q5_gemv_digits = avx2_q5_gemv_digits,
    .q5_dequant = avx2_q5_dequant, /* avx2.c's (vpmaddubsw: no vpdpbusd here) */
    .q5_gemv_rows = avx2_q5_gemv_rows, .sb_path = SB_AVX2,
};
const kernel_table kernels_avx512_vnni = {
    q8_gemv, q4_gemv, q4_xprep, q4_gemv_digits_vnni, q8_dequant, q4_dequant, tile,
    q8_xprep, q8_gemv_digits, ig_xprep, ig_panel, q6_xprep256, q6_gemv16, q6_dequant,
    q4_xprep, q5_gemv_vnni, avx2_q5_dequant, /* avx2.c's dequantization */
    IG_KIND(4) | IG_KIND(5) | IG_KIND(6) | IG_KIND(8) | IG_KIND(Q4K) | IG_KIND(Q5K) |
        IG_KIND(Q3K) | IG_KIND(Q2K) | IG_KIND(IQ4XS),
    .q4_gemv_rows = q4_gemv_rows_vnni, .q5_gemv_rows = q5_gemv_rows_vnni,
    .q6_gemv_rows = q6_gemv_rows16, .q6_xblock = Q6_BLOCK, .sb_path = SB_AVX512_VNNI,
};

#endif
