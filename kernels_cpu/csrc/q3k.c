/* q3_k: GGUF Q3_K's blocks as they lie in the file (quant/formats/q3k.py), every path.
 *
 * A row is K / 256 blocks of 110 bytes: hmask[32], qs[64], 12 bytes of 6-bit scales, then
 * float16 d. Element 128 h + 32 j + i (half h, quarter j, i < 32) has the code
 *
 *     q = ((qs[32 h + i] >> 2j) & 3) - (bit 4h + j of hmask[i] ? 0 : 4)      in -4..3
 *
 * and group (128 h + 32 j + i) / 16's scale sc - 32 (sc's low 4 bits in byte g % 8, nibble
 * g / 8; its high 2 in byte 8 + g % 4, bits 2 (g / 4)):
 *
 *     w = (d * (sc - 32)) * q       (both products exact in float32)
 *
 * GEMV (x86): x as q4k.c prepares it, X = round(x / sx) as int16 with one sx per 256
 * elements, each sub-block of 32 as its 16 even elements then its 16 odd ones. A quarter's
 * codes are sign-extended to int16 in that order and multiplied by their group's scale
 * once (|q (sc - 32)| <= 128), then each row of x takes them with one integer dot product
 * per 16 or 32 (vpmaddwd, vpdpwssd): per int32 lane at most 16 * 128 * 32512 < 2^31 a block.
 * One float FMA a block by d sx. One row is the rows kernel with R = 1, so a row's output
 * is the same alone or in a batch. Without x's integers (x with inf or NaN, or a path with
 * none: scalar, NEON) q3k_gemv_c runs in float.
 * GEMM: tiles dequantized exactly (q3k_dequant_c, or AVX2's), then the float tile.
 */
#include <string.h>

#include "kernels.h"

/* A block's 12 scale bytes -> the 16 groups' 6-bit scales minus 32, as int8 (four groups
 * a word) */
static inline void q3k_scales(const uint8_t *p, int8_t out[16]) {
    uint32_t u[3], v[4];
    memcpy(u, p, 12);
    const uint32_t low4 = 0x0f0f0f0f, two = 0x03030303;
    v[0] = (u[0] & low4) | ((u[2] & two) << 4); /* groups 0-3 */
    v[1] = (u[1] & low4) | (((u[2] >> 2) & two) << 4);
    v[2] = ((u[0] >> 4) & low4) | (((u[2] >> 4) & two) << 4);
    v[3] = ((u[1] >> 4) & low4) | (((u[2] >> 6) & two) << 4);
    uint8_t b[16];
    memcpy(b, v, 16);
    for (int g = 0; g < 16; g++) out[g] = (int8_t)(b[g] - 32);
}

static float q3k_half(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | p[1] << 8)); }

/* Element 128 h + 32 j + i's code in -4..3 */
static inline int q3k_code(const uint8_t *blk, int h, int j, int i) {
    return ((blk[32 + 32 * h + i] >> (2 * j)) & 3) - ((blk[i] >> (4 * h + j)) & 1 ? 0 : 4);
}

/* ------------------------------------------------------------------------------------
 * Plain C: every path's fallback
 * ---------------------------------------------------------------------------------- */

static void q3k_gemv_c(const qmat *a, int64_t n0, int64_t n1) {
    const int64_t B = a->K / Q4K_BLOCK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *blk = (const uint8_t *)a->qw + n * B * Q3K_BLOCK_BYTES;
        float acc[8] = {0}; /* one per group of 16, mod 8 */
        for (int64_t b = 0; b < B; b++, blk += Q3K_BLOCK_BYTES) {
            const float d = q3k_half(blk + 108);
            const float *x = a->x + b * Q4K_BLOCK;
            int8_t sc[16];
            q3k_scales(blk + 96, sc);
            for (int g = 0; g < 16; g++) {
                const int h = g / 8, j = (g / 2) % 4, i0 = 16 * (g % 2);
                const float *xg = x + 16 * g;
                float t[4] = {0};
                for (int i = 0; i < 16; i++) t[i % 4] += (float)q3k_code(blk, h, j, i0 + i) * xg[i];
                acc[g % 8] += d * (float)sc[g] * ((t[0] + t[2]) + (t[1] + t[3]));
            }
        }
        a->y[n] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    }
}

static void q3k_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * B * Q3K_BLOCK_BYTES;
    for (int64_t nb = 0; nb < (n1 - n0) * B; nb++, blk += Q3K_BLOCK_BYTES, w += Q4K_BLOCK) {
        const float d = q3k_half(blk + 108);
        int8_t sc[16];
        q3k_scales(blk + 96, sc);
        for (int g = 0; g < 16; g++) {
            const float dl = d * (float)sc[g];
            const int h = g / 8, j = (g / 2) % 4, i0 = 16 * (g % 2);
            for (int i = 0; i < 16; i++) w[16 * g + i] = dl * (float)q3k_code(blk, h, j, i0 + i);
        }
    }
}

static const sb_kernels q3k_plain = {q3k_gemv_c, NULL, NULL, NULL, q3k_dequant_c};

#ifndef INFER_X86 /* the integer GEMM runs on x86 paths only; AVX2's is below */
void q3k_block_panel(const uint8_t *blk, uint8_t c[256], float d[8]) {
    int8_t sc[16];
    q3k_scales(blk + 96, sc);
    for (int g = 0; g < 16; g++)
        for (int i = 0; i < 16; i++)
            c[16 * g + i] = (uint8_t)(128 - q3k_code(blk, g / 8, (g / 2) % 4, 16 * (g % 2) + i) * sc[g]);
    for (int b = 0; b < 8; b++) d[b] = -q3k_half(blk + 108);
}
#endif

#ifdef INFER_X86
#include <immintrin.h>

/* Where q4k.c's prepared x keeps X (int16), the blocks' sx and the groups' sx sum X */
static inline const int16_t *q3k_x16(const void *buf, int64_t K) {
    return (const int16_t *)((const int8_t *)buf + 2 * K);
}
static inline const float *q3k_sx(const void *buf, int64_t K) {
    return (const float *)((const int8_t *)buf + 4 * K);
}
static inline const float *q3k_xs16(const void *buf, int64_t K) {
    return q3k_sx(buf, K) + K / Q4K_BLOCK + K / 32;
}

/* vpshufb controls that spread the scale bytes of a pair of quarters (r = 2k, 2k + 1:
 * groups 4k .. 4k + 3) over int16 lanes in X's order (the even elements of quarter 2k,
 * of 2k + 1, then the odd ones): per pair, for the even elements (4k, 0), (4k + 1, 0),
 * (4k + 2, 0), (4k + 3, 0) pairs in its four 128-bit lanes (elements 0-14 and 16-30 of
 * each quarter), then for the odd ones (0, g) pairs */
#define EVEN(g) g, -128, g, -128, g, -128, g, -128, g, -128, g, -128, g, -128, g, -128
#define ODD(g) -128, g, -128, g, -128, g, -128, g, -128, g, -128, g, -128, g, -128, g
#define PAIR(g) {EVEN(g), EVEN(g + 1), EVEN(g + 2), EVEN(g + 3)}, {ODD(g), ODD(g + 1), ODD(g + 2), ODD(g + 3)}
static const int8_t group_ctl[8][64] __attribute__((aligned(64))) = {PAIR(0), PAIR(4), PAIR(8), PAIR(12)};
#undef PAIR
#undef ODD
#undef EVEN

/* ------------------------------------------------------------------------------------
 * AVX2 (with FMA and F16C), also what plain AVX-512 and AVX-VNNI run
 *
 * Codes go unsigned, c = q + 4 in 0..7, so that vpmaddubsw takes them by their scale
 * pairs: sum c sc X in int32 lanes (|c sc| <= 224: at most 16 * 224 * 32512 < 2^31 a
 * lane a block), one float FMA a block by d sx, and the -4 sum sc X term per group of 16
 * from x's sums, sx sum X, times d sc.
 * ---------------------------------------------------------------------------------- */

#define TI TARGET_AVX2 static inline __attribute__((always_inline))

/* A block's 16 scales sc - 32 as int8 (group g's low 4 bits in byte g % 8, nibble g / 8;
 * its high 2 in byte 8 + g % 4, bits 2 (g / 4)), in vector registers; the 12 bytes are
 * read as 8 + 4, never past the block */
TI __m128i q3k_scale_bytes(const uint8_t *blk) {
    int32_t tail;
    memcpy(&tail, blk + 104, 4);
    const __m128i p = _mm_insert_epi32(_mm_loadl_epi64((const __m128i *)(blk + 96)), tail, 2);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(p, m4), _mm_and_si128(_mm_srli_epi16(p, 4), m4));
    /* bytes 8-11 in every dword, dword k shifted down by 2k: group g's 2 bits at bits 0-1 */
    const __m128i h = _mm_shuffle_epi8(p, _mm_set1_epi32(0x0b0a0908));
    const __m128i h2 = _mm_and_si128(_mm_srlv_epi32(h, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi32(h2, 4)), _mm_set1_epi8(32));
}

/* A row's output from its two accumulators: sum c sc X steps, and the groups' terms */
TI float q3k_total(__m256 acc, __m256 corr) {
    const __m256 v = _mm256_fnmadd_ps(_mm256_set1_ps(4.0f), corr, acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* Up to 4 rows of x against weight row n. Per quarter, its codes c times their group's
 * scale as int16 (vpmaddubsw by the scale pairs: even elements, then odd ones), once
 * for all rows; then per row two vpmaddwd with X. */
TI void q3k_rows(const qmat *const *a, const int R, int64_t n) {
    const int64_t K = a[0]->K, B = K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a[0]->qw + n * B * Q3K_BLOCK_BYTES;
    const int16_t *xd[4];
    const float *sxs[4], *xs16[4];
    __m256 acc[4], corr[4];
    for (int m = 0; m < R; m++) {
        xd[m] = q3k_x16(a[m]->xq, K), sxs[m] = q3k_sx(a[m]->xq, K), xs16[m] = q3k_xs16(a[m]->xq, K);
        acc[m] = corr[m] = _mm256_setzero_ps();
    }
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int64_t b = 0; b < B; b++, blk += Q3K_BLOCK_BYTES) {
        for (int i = 0; i < 2; i++) PREFETCH_STREAM_L1(blk + 64 * i);
        const __m128i sc8 = q3k_scale_bytes(blk);
        const __m256i scb = _mm256_broadcastsi128_si256(sc8);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
        __m256i t[4];
        for (int m = 0; m < R; m++) t[m] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
            for (int j = 0; j < 4; j++) {
                const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + j)));
                const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), three);
                const __m256i c = _mm256_add_epi8(low, _mm256_and_si256(set, four));
                const int r = 4 * h + j, k = r / 2, second = r % 2;
                const __m256i *even = (const __m256i *)group_ctl[2 * k] + second;
                const __m256i *odd = (const __m256i *)group_ctl[2 * k + 1] + second;
                const __m256i pe = _mm256_maddubs_epi16(c, _mm256_shuffle_epi8(scb, _mm256_load_si256(even)));
                const __m256i po = _mm256_maddubs_epi16(c, _mm256_shuffle_epi8(scb, _mm256_load_si256(odd)));
                for (int m = 0; m < R; m++) { /* X: per pair of quarters, even 2k, even 2k + 1, odd, odd */
                    const __m256i *x = (const __m256i *)(xd[m] + 256 * b + 64 * k) + second;
                    t[m] = _mm256_add_epi32(t[m], _mm256_add_epi32(_mm256_madd_epi16(pe, x[0]),
                                                                   _mm256_madd_epi16(po, x[2])));
                }
            }
        }
        const float d = _cvtsh_ss(*(const uint16_t *)(blk + 108));
        const __m256 vd = _mm256_set1_ps(d);
        const __m256 scd0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), vd);
        const __m256 scd1 =
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc8, sc8))), vd);
        for (int m = 0; m < R; m++) {
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[m]), _mm256_set1_ps(d * sxs[m][b]), acc[m]);
            const float *g = xs16[m] + 16 * b;
            corr[m] = _mm256_fmadd_ps(scd0, _mm256_loadu_ps(g), corr[m]);
            corr[m] = _mm256_fmadd_ps(scd1, _mm256_loadu_ps(g + 8), corr[m]);
        }
    }
    for (int m = 0; m < R; m++) a[m]->y[n] = q3k_total(acc[m], corr[m]);
}

TARGET_AVX2 static void q3k_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m = 0; m < R; m += 4) switch (R - m) {
            case 1: q3k_rows(a + m, 1, n); break;
            case 2: q3k_rows(a + m, 2, n); break;
            case 3: q3k_rows(a + m, 3, n); break;
            default: q3k_rows(a + m, 4, n); break;
            }
}

TARGET_AVX2 static void q3k_gemv(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) q3k_rows(&a, 1, n);
}

/* Exactly as q3k_dequant_c (both products exact): per quarter, its codes q = c - 4 as
 * floats times their group's d sc. */
TARGET_AVX2 static void q3k_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * B * Q3K_BLOCK_BYTES;
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int64_t nb = 0; nb < (n1 - n0) * B; nb++, blk += Q3K_BLOCK_BYTES, w += Q4K_BLOCK) {
        const __m128i sc8 = q3k_scale_bytes(blk);
        const __m256 vd = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(blk + 108)));
        float dl[16];
        _mm256_storeu_ps(dl, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), vd));
        _mm256_storeu_ps(dl + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc8, sc8))), vd));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
        for (int h = 0; h < 2; h++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
            for (int j = 0; j < 4; j++) {
                const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + j)));
                const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), three);
                const __m256i q = _mm256_sub_epi8(low, _mm256_andnot_si256(set, four));
                const int r = 4 * h + j;
                float *o = w + 32 * r;
                for (int i = 0; i < 4; i++) {
                    const __m128i q8 = i < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
                    const __m256i q32 = _mm256_cvtepi8_epi32(i % 2 ? _mm_unpackhi_epi64(q8, q8) : q8);
                    const __m256 step = _mm256_set1_ps(dl[2 * r + i / 2]);
                    _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(q32), step));
                }
            }
        }
    }
}

TARGET_AVX2 void q3k_block_panel(const uint8_t *blk, uint8_t c[256], float d[8]) {
    int8_t sc[16];
    _mm_storeu_si128((__m128i *)sc, q3k_scale_bytes(blk));
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)blk), mid = _mm256_set1_epi16(128);
    for (int h = 0; h < 2; h++) {
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
        for (int j = 0; j < 4; j++) {
            const int r = 4 * h + j;
            const __m256i bit = _mm256_set1_epi8((char)(1 << r));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), three);
            const __m256i q = _mm256_sub_epi8(low, _mm256_andnot_si256(set, four));
            const __m256i lo = _mm256_sub_epi16(mid, _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16(sc[2 * r])));
            const __m256i hi = _mm256_sub_epi16(mid, _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)), _mm256_set1_epi16(sc[2 * r + 1])));
            /* 0..252: packus keeps them; it interleaves the 128-bit lanes, so reorder */
            _mm256_storeu_si256((__m256i *)(c + 32 * r), _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xd8));
        }
    }
    const float nd = -_cvtsh_ss(*(const uint16_t *)(blk + 108));
    for (int b = 0; b < 8; b++) d[b] = nd;
}

static const sb_kernels q3k_avx2 = {q3k_gemv_c, q4k_xprep_avx2, q3k_gemv, q3k_gemv_rows,
                                    q3k_dequant};
#undef TI

/* ------------------------------------------------------------------------------------
 * AVX-512 with VNNI: up to 8 rows, a quarter's 32 products per vpdpwssd
 * ---------------------------------------------------------------------------------- */

#define TI TARGET_AVX512_VNNI static inline __attribute__((always_inline))

/* As q3k_rows on 512 bits, a pair of quarters at a time: quarter 2k's 32 codes in the low
 * 256 bits and 2k + 1's in the high, times the scale pairs of their even elements, then
 * of their odd ones, each product vector meeting 64 bytes of X in one vpdpwssd per row.
 * The groups' terms take one 16-lane FMA a block. */
TI void q3k_rows_vnni(const qmat *const *a, const int R, int64_t n) {
    const int64_t K = a[0]->K, B = K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a[0]->qw + n * B * Q3K_BLOCK_BYTES;
    const int16_t *xd[8];
    const float *sxs[8], *xs16[8];
    __m256 acc[8];
    __m512 corr[8];
    for (int m = 0; m < R; m++) {
        xd[m] = q3k_x16(a[m]->xq, K), sxs[m] = q3k_sx(a[m]->xq, K), xs16[m] = q3k_xs16(a[m]->xq, K);
        acc[m] = _mm256_setzero_ps(), corr[m] = _mm512_setzero_ps();
    }
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    for (int64_t b = 0; b < B; b++, blk += Q3K_BLOCK_BYTES) {
        for (int i = 0; i < 2; i++) PREFETCH_STREAM_L1(blk + 64 * i);
        const __m128i sc8 = q3k_scale_bytes(blk);
        const __m512i scb = _mm512_broadcast_i32x4(sc8);
        const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)blk));
        __m512i t[8];
        for (int m = 0; m < R; m++) t[m] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i qs =
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h)));
            for (int j = 0; j < 4; j += 2) { /* quarters j and j + 1 of half h */
                const int k = 2 * h + j / 2, r = 4 * h + j;
                const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << r)),
                                                        _mm256_set1_epi8((char)(1 << (r + 1))), 1);
                const __mmask64 set = _mm512_test_epi8_mask(hm, bits);
                const __m512i low = _mm512_srlv_epi16(qs, _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)),
                                                                             _mm256_set1_epi16((short)(2 * j + 2)), 1));
                /* c = (qs >> 2j) & 3 | 4 where set: one vpternlog (A & B | C) */
                const __m512i c = _mm512_ternarylogic_epi32(low, three, _mm512_maskz_mov_epi8(set, four), 0xea);
                const __m512i *ctl = (const __m512i *)group_ctl[2 * k];
                const __m512i pe = _mm512_maddubs_epi16(c, _mm512_shuffle_epi8(scb, _mm512_load_si512(ctl)));
                const __m512i po = _mm512_maddubs_epi16(c, _mm512_shuffle_epi8(scb, _mm512_load_si512(ctl + 1)));
                for (int m = 0; m < R; m++) {
                    const __m512i *x = (const __m512i *)(xd[m] + 256 * b + 64 * k);
                    t[m] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(t[m], pe, _mm512_loadu_si512(x)), po,
                                               _mm512_loadu_si512(x + 1));
                }
            }
        }
        const float d = _cvtsh_ss(*(const uint16_t *)(blk + 108));
        const __m512 scd = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), _mm512_set1_ps(d));
        for (int m = 0; m < R; m++) {
            const __m256i t8 =
                _mm256_add_epi32(_mm512_castsi512_si256(t[m]), _mm512_extracti64x4_epi64(t[m], 1));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t8), _mm256_set1_ps(d * sxs[m][b]), acc[m]);
            corr[m] = _mm512_fmadd_ps(scd, _mm512_loadu_ps(xs16[m] + 16 * b), corr[m]);
        }
    }
    for (int m = 0; m < R; m++) {
        const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(corr[m]),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(corr[m]), 1)));
        a[m]->y[n] = q3k_total(acc[m], c8);
    }
}

TARGET_AVX512_VNNI static void q3k_gemv_rows_vnni(const qmat *const *a, int R, int64_t n0,
                                                  int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m = 0; m < R; m += 8) switch (R - m < 8 ? R - m : 8) {
            case 1: q3k_rows_vnni(a + m, 1, n); break;
            case 2: q3k_rows_vnni(a + m, 2, n); break;
            case 3: q3k_rows_vnni(a + m, 3, n); break;
            case 4: q3k_rows_vnni(a + m, 4, n); break;
            case 5: q3k_rows_vnni(a + m, 5, n); break;
            case 6: q3k_rows_vnni(a + m, 6, n); break;
            case 7: q3k_rows_vnni(a + m, 7, n); break;
            default: q3k_rows_vnni(a + m, 8, n); break;
            }
}

TARGET_AVX512_VNNI static void q3k_gemv_vnni(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) q3k_rows_vnni(&a, 1, n);
}

static const sb_kernels q3k_avx512_vnni = {q3k_gemv_c, q4k_xprep_avx2, q3k_gemv_vnni,
                                           q3k_gemv_rows_vnni, q3k_dequant};
#undef TI
#endif

const sb_kernels *q3k_for(const kernel_table *kt) {
#ifdef INFER_X86
    if (kt == &kernels_avx512_vnni) return &q3k_avx512_vnni;
    if (kt == &kernels_avx2 || kt == &kernels_avx2_vnni || kt == &kernels_avx512) return &q3k_avx2;
#endif
    (void)kt;
    return &q3k_plain;
}
