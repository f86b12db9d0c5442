/* q3_k and q2_k: GGUF Q3_K's and Q2_K's blocks as they lie in the file
 * (quant/formats/q3k.py, q2k.py), every path. One kernel body serves both, `kind` a
 * constant where it is called.
 *
 * Q3_K, 110 bytes per 256 weights: hmask[32], qs[64], 12 bytes of 6-bit scales, float16 d.
 * Q2_K, 84 bytes: scales[16] (scale in the low nibble, min in the high), qs[64], float16
 * d and dmin. In both, element 128 h + 32 j + i (half h, quarter j, i < 32) takes bits 2j
 * of qs[32 h + i] and group g = (128 h + 32 j + i) / 16's scale:
 *
 *     Q3_K: q = ((qs >> 2j) & 3) - (bit 4h + j of hmask[i] ? 0 : 4)   in -4..3
 *           w = (d * (sc - 32)) * q       (sc: low 4 bits in byte g % 8, nibble g / 8;
 *                                          high 2 in byte 8 + g % 4, bits 2 (g / 4))
 *     Q2_K: c = (qs >> 2j) & 3                                         in 0..3
 *           w = (d * sc) * c - dmin * m   (gguf's order: a separate difference)
 *
 * GEMV (x86): x as q4k_q5k.c prepares it, X = round(x / sx) as int16 with one sx per 256
 * elements. The codes go unsigned (Q3_K's c = q + 4 in 0..7), so that vpmaddubsw takes
 * them by their group's scale pairs (Q3_K's sc - 32 signed, Q2_K's sc 0..15), once for all
 * rows; then each row of x takes them with vpmaddwd or vpdpwssd: sum c sc X in int32
 * lanes (|c sc| <= 224: at most 16 * 224 * 32512 < 2^31 a lane a block), one float FMA a
 * block by d sx. The rest, per group of 16 from x's sums sx sum X: Q3_K's -4 d sc and
 * Q2_K's -dmin m. One row is the rows kernel with R = 1, so a row's output is the same
 * alone or in a batch. Without x's integers (x with inf or NaN, or a path with none:
 * scalar) the float GEMV runs; NEON takes x as neondot's int4 GEMV does (two int8 digits
 * per block of 32), the codes signed (Q3_K) or their mins from sdot by ones (Q2_K), plain
 * NEON with kernels.h's exact emulation of sdot.
 * GEMM: tiles dequantized exactly, then the float tile; on x86 paths the integer GEMM:
 * Q3_K as int8's codes on the vpdpbusd paths (q3k_block_panel), Q2_K's codes with a scale
 * and a min per 16 (q2k_block_panel).
 */
#include <string.h>

#include "kernels.h"

static inline int64_t block_bytes(int kind) { return kind == Q3K ? Q3K_BLOCK_BYTES : Q2K_BLOCK_BYTES; }
static inline int qs_at(int kind) { return kind == Q3K ? 32 : 16; }
static inline int d_at(int kind) { return kind == Q3K ? 108 : 80; }

/* A Q3_K block's 12 scale bytes -> the 16 groups' 6-bit scales minus 32 (four a word) */
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

static float half_at(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | p[1] << 8)); }

/* Element 128 h + 32 j + i's Q3_K code in -4..3 */
static inline int q3k_code(const uint8_t *blk, int h, int j, int i) {
    return ((blk[32 + 32 * h + i] >> (2 * j)) & 3) - ((blk[i] >> (4 * h + j)) & 1 ? 0 : 4);
}

/* ------------------------------------------------------------------------------------
 * Plain C: every path's fallback
 * ---------------------------------------------------------------------------------- */

/* One block's 256 weights, exactly as the format defines them */
static void block_weights(int kind, const uint8_t *blk, float *w) {
    const float d = half_at(blk + d_at(kind));
    if (kind == Q3K) {
        int8_t sc[16];
        q3k_scales(blk + 96, sc);
        for (int g = 0; g < 16; g++) {
            const float dl = d * (float)sc[g];
            for (int i = 0; i < 16; i++)
                w[16 * g + i] = dl * (float)q3k_code(blk, g / 8, (g / 2) % 4, 16 * (g % 2) + i);
        }
        return;
    }
    const float dmin = half_at(blk + 82);
    for (int g = 0; g < 16; g++) {
        const float dl = d * (float)(blk[g] & 15), ml = dmin * (float)(blk[g] >> 4);
        const uint8_t *qs = blk + 16 + 32 * (g / 8) + 16 * (g % 2);
        for (int i = 0; i < 16; i++) w[16 * g + i] = dl * (float)((qs[i] >> (2 * ((g / 2) % 4))) & 3) - ml;
    }
}

static inline void low_gemv_c(int kind, const qmat *a, int64_t n0, int64_t n1) {
    const int64_t B = a->K / Q4K_BLOCK, bytes = block_bytes(kind);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *blk = (const uint8_t *)a->qw + n * B * bytes;
        float acc[8] = {0}, w[Q4K_BLOCK];
        for (int64_t b = 0; b < B; b++, blk += bytes) {
            block_weights(kind, blk, w);
            const float *x = a->x + b * Q4K_BLOCK;
            for (int i = 0; i < Q4K_BLOCK; i++) acc[i % 8] += w[i] * x[i];
        }
        a->y[n] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    }
}

static inline void low_dequant_c(int kind, const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q4K_BLOCK, bytes = block_bytes(kind);
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * B * bytes;
    for (int64_t nb = 0; nb < (n1 - n0) * B; nb++, blk += bytes, w += Q4K_BLOCK) block_weights(kind, blk, w);
}

static void q3k_gemv_c(const qmat *a, int64_t n0, int64_t n1) { low_gemv_c(Q3K, a, n0, n1); }
static void q2k_gemv_c(const qmat *a, int64_t n0, int64_t n1) { low_gemv_c(Q2K, a, n0, n1); }
static void q3k_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w) { low_dequant_c(Q3K, a, n0, n1, w); }
static void q2k_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w) { low_dequant_c(Q2K, a, n0, n1, w); }

static const sb_kernels q3k_plain = {q3k_gemv_c, NULL, NULL, NULL, q3k_dequant_c};
static const sb_kernels q2k_plain = {q2k_gemv_c, NULL, NULL, NULL, q2k_dequant_c};

#ifndef INFER_X86 /* the integer GEMM runs on x86 paths only; AVX2's is below */
void q3k_block_panel(const uint8_t *blk, uint8_t c[256], float d[8]) {
    int8_t sc[16];
    q3k_scales(blk + 96, sc);
    for (int g = 0; g < 16; g++)
        for (int i = 0; i < 16; i++)
            c[16 * g + i] = (uint8_t)(128 - q3k_code(blk, g / 8, (g / 2) % 4, 16 * (g % 2) + i) * sc[g]);
    for (int b = 0; b < 8; b++) d[b] = -half_at(blk + 108);
}

void q2k_block_panel(const uint8_t *blk, uint8_t c[256], float d[16], float m[16]) {
    for (int g = 0; g < 16; g++) {
        const uint8_t *qs = blk + 16 + 32 * (g / 8) + 16 * (g % 2);
        for (int i = 0; i < 16; i++) c[16 * g + i] = (qs[i] >> (2 * ((g / 2) % 4))) & 3;
    }
    const float dd = half_at(blk + 80), dmin = half_at(blk + 82);
    for (int g = 0; g < 16; g++) d[g] = dd * (float)(blk[g] & 15), m[g] = -(dmin * (float)(blk[g] >> 4));
}
#endif

#ifdef INFER_X86
#include <immintrin.h>

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
 * ---------------------------------------------------------------------------------- */

#define TI TARGET_AVX2 static inline __attribute__((always_inline))

/* A Q3_K block's 16 scales sc - 32 as int8, in vector registers; the 12 bytes are read
 * as 8 + 4, never past the block */
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

/* A block's scales as bytes for vpmaddubsw (Q3_K's sc - 32, Q2_K's sc), and per group of
 * 16 the float that multiplies its x sums (Q3_K's 4 d (sc - 32), Q2_K's dmin m): the
 * row's output is sum d sx (sum c sc X) - sum_g f_g (sx sum_g X) */
TI __m128i block_scales(int kind, const uint8_t *blk, float d, __m256 f[2]) {
    __m128i sc, fb;
    __m256 mul;
    if (kind == Q3K) {
        sc = fb = q3k_scale_bytes(blk);
        mul = _mm256_set1_ps(4 * d);
    } else {
        const __m128i p = _mm_loadu_si128((const __m128i *)blk), m4 = _mm_set1_epi8(0x0f);
        sc = _mm_and_si128(p, m4);
        fb = _mm_and_si128(_mm_srli_epi16(p, 4), m4);
        mul = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(blk + 82)));
    }
    f[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(fb)), mul);
    f[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(fb, fb))), mul);
    return sc;
}

/* Quarter r of half h's unsigned codes (Q3_K's q + 4) from the half's qs */
TI __m256i quarter_codes(int kind, __m256i qs, __m256i hm, int h, int j) {
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), _mm256_set1_epi8(3));
    if (kind != Q3K) return low;
    const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + j)));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
    return _mm256_add_epi8(low, _mm256_and_si256(set, _mm256_set1_epi8(4)));
}

/* A row's output from its two accumulators */
TI float row_total(__m256 acc, __m256 corr) {
    const __m256 v = _mm256_sub_ps(acc, corr);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* Up to 4 rows of x against weight row n. Per quarter, its codes times their group's
 * scale as int16 (vpmaddubsw by the scale pairs: even elements, then odd ones), once for
 * all rows; then per row two vpmaddwd with X. */
TI void rows_avx2(const int kind, const qmat *const *a, const int R, int64_t n) {
    const int64_t K = a[0]->K, B = K / Q4K_BLOCK, bytes = block_bytes(kind);
    const uint8_t *blk = (const uint8_t *)a[0]->qw + n * B * bytes;
    const int16_t *xd[4];
    const float *sxs[4], *xs16[4];
    __m256 acc[4], corr[4];
    for (int m = 0; m < R; m++) {
        xd[m] = sb_x16(a[m]->xq, K), sxs[m] = sb_sx(a[m]->xq, K), xs16[m] = sb_xs16(a[m]->xq, K);
        acc[m] = corr[m] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < B; b++, blk += bytes) {
        for (int i = 0; i < 2; i++) PREFETCH_STREAM_L1(blk + 64 * i);
        const float d = _cvtsh_ss(*(const uint16_t *)(blk + d_at(kind)));
        __m256 f[2];
        const __m256i scb = _mm256_broadcastsi128_si256(block_scales(kind, blk, d, f));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk); /* Q3_K's hmask */
        __m256i t[4];
        for (int m = 0; m < R; m++) t[m] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + qs_at(kind) + 32 * h));
            for (int j = 0; j < 4; j++) {
                const __m256i c = quarter_codes(kind, qs, hm, h, j);
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
        for (int m = 0; m < R; m++) {
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[m]), _mm256_set1_ps(d * sxs[m][b]), acc[m]);
            const float *g = xs16[m] + 16 * b;
            corr[m] = _mm256_fmadd_ps(f[0], _mm256_loadu_ps(g), corr[m]);
            corr[m] = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(g + 8), corr[m]);
        }
    }
    for (int m = 0; m < R; m++) a[m]->y[n] = row_total(acc[m], corr[m]);
}

TI void gemv_rows_avx2(const int kind, const qmat *const *a, int R, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m = 0; m < R; m += 4) switch (R - m) {
            case 1: rows_avx2(kind, a + m, 1, n); break;
            case 2: rows_avx2(kind, a + m, 2, n); break;
            case 3: rows_avx2(kind, a + m, 3, n); break;
            default: rows_avx2(kind, a + m, 4, n); break;
            }
}

/* Exactly as block_weights: Q3_K's codes q = c - 4 times d sc (both exact), Q2_K's
 * (d sc) c - dmin m (one rounding, the difference's) */
TI void dequant_avx2(const int kind, const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q4K_BLOCK, bytes = block_bytes(kind);
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * B * bytes;
    for (int64_t nb = 0; nb < (n1 - n0) * B; nb++, blk += bytes, w += Q4K_BLOCK) {
        const float d = _cvtsh_ss(*(const uint16_t *)(blk + d_at(kind)));
        __m256 f[2];
        const __m128i sc8 = block_scales(kind, blk, d, f);
        const __m256 vd = _mm256_set1_ps(d);
        float dl[16], ml[16];
        _mm256_storeu_ps(dl, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), vd));
        _mm256_storeu_ps(dl + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc8, sc8))), vd));
        _mm256_storeu_ps(ml, f[0]); /* Q2_K: dmin m */
        _mm256_storeu_ps(ml + 8, f[1]);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
        const __m256i off = _mm256_set1_epi8(kind == Q3K ? 4 : 0);
        for (int h = 0; h < 2; h++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + qs_at(kind) + 32 * h));
            for (int j = 0; j < 4; j++) {
                const __m256i q = _mm256_sub_epi8(quarter_codes(kind, qs, hm, h, j), off);
                const int r = 4 * h + j;
                for (int i = 0; i < 4; i++) {
                    const __m128i q8 = i < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
                    const __m256i q32 = _mm256_cvtepi8_epi32(i % 2 ? _mm_unpackhi_epi64(q8, q8) : q8);
                    const int g = 2 * r + i / 2;
                    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q32), _mm256_set1_ps(dl[g]));
                    if (kind != Q3K) v = _mm256_sub_ps(v, _mm256_set1_ps(ml[g]));
                    _mm256_storeu_ps(w + 32 * r + 8 * i, v);
                }
            }
        }
    }
}

TARGET_AVX2 static void q3k_gemv(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) rows_avx2(Q3K, &a, 1, n);
}
TARGET_AVX2 static void q2k_gemv(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) rows_avx2(Q2K, &a, 1, n);
}
TARGET_AVX2 static void q3k_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    gemv_rows_avx2(Q3K, a, R, n0, n1);
}
TARGET_AVX2 static void q2k_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    gemv_rows_avx2(Q2K, a, R, n0, n1);
}
TARGET_AVX2 static void q3k_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    dequant_avx2(Q3K, a, n0, n1, w);
}
TARGET_AVX2 static void q2k_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    dequant_avx2(Q2K, a, n0, n1, w);
}

TARGET_AVX2 void q3k_block_panel(const uint8_t *blk, uint8_t c[256], float d[8]) {
    int8_t sc[16];
    _mm_storeu_si128((__m128i *)sc, q3k_scale_bytes(blk));
    const __m256i hm = _mm256_loadu_si256((const __m256i *)blk), mid = _mm256_set1_epi16(128);
    for (int h = 0; h < 2; h++) {
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
        for (int j = 0; j < 4; j++) {
            const int r = 4 * h + j;
            const __m256i q = _mm256_sub_epi8(quarter_codes(Q3K, qs, hm, h, j), _mm256_set1_epi8(4));
            const __m256i lo = _mm256_sub_epi16(mid, _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16(sc[2 * r])));
            const __m256i hi = _mm256_sub_epi16(mid, _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)), _mm256_set1_epi16(sc[2 * r + 1])));
            /* 0..252: packus keeps them; it interleaves the 128-bit lanes, so reorder */
            _mm256_storeu_si256((__m256i *)(c + 32 * r), _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xd8));
        }
    }
    const float nd = -_cvtsh_ss(*(const uint16_t *)(blk + 108));
    for (int b = 0; b < 8; b++) d[b] = nd;
}

TARGET_AVX2 void q2k_block_panel(const uint8_t *blk, uint8_t c[256], float d[16], float m[16]) {
    for (int h = 0; h < 2; h++) {
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * h));
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(c + 128 * h + 32 * j), quarter_codes(Q2K, qs, qs, h, j));
    }
    const __m128i sm = _mm_loadu_si128((const __m128i *)blk), f = _mm_set1_epi8(15);
    const __m256 dd = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(blk + 80)));
    const __m256 dmin = _mm256_set1_ps(-_cvtsh_ss(*(const uint16_t *)(blk + 82)));
    const __m128i sc = _mm_and_si128(sm, f), mn = _mm_and_si128(_mm_srli_epi16(sm, 4), f);
    for (int k = 0; k < 2; k++) { /* the same products as the dequantization's, 8 at a time */
        const __m256 s8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k ? _mm_srli_si128(sc, 8) : sc));
        const __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k ? _mm_srli_si128(mn, 8) : mn));
        _mm256_storeu_ps(d + 8 * k, _mm256_mul_ps(dd, s8));
        _mm256_storeu_ps(m + 8 * k, _mm256_mul_ps(dmin, m8));
    }
}

static const sb_kernels q3k_avx2 = {q3k_gemv_c, sb_xprep_pairs_avx2, q3k_gemv, q3k_gemv_rows, q3k_dequant};
static const sb_kernels q2k_avx2 = {q2k_gemv_c, sb_xprep_pairs_avx2, q2k_gemv, q2k_gemv_rows, q2k_dequant};
#undef TI

/* ------------------------------------------------------------------------------------
 * AVX-512 with VNNI: up to 8 rows, a pair of quarters per 512-bit vector
 * ---------------------------------------------------------------------------------- */

#define TI TARGET_AVX512_VNNI static inline __attribute__((always_inline))

/* As rows_avx2 on 512 bits, a pair of quarters at a time: quarter 2k's 32 codes in the low
 * 256 bits and 2k + 1's in the high, times the scale pairs of their even elements, then
 * of their odd ones, each product vector meeting 64 bytes of X in one vpdpwssd per row.
 * A block's sums go to float in 16 lanes, times d sx; the groups' terms take one 16-lane
 * FMA a block. */
TI void low_rows_vnni(const int kind, const qmat *const *a, const int R, int64_t n) {
    const int64_t K = a[0]->K, B = K / Q4K_BLOCK, bytes = block_bytes(kind);
    const uint8_t *blk = (const uint8_t *)a[0]->qw + n * B * bytes;
    const int16_t *xd[8];
    const float *sxs[8], *xs16[8];
    __m512 acc[8], corr[8];
    for (int m = 0; m < R; m++) {
        xd[m] = sb_x16(a[m]->xq, K), sxs[m] = sb_sx(a[m]->xq, K), xs16[m] = sb_xs16(a[m]->xq, K);
        acc[m] = corr[m] = _mm512_setzero_ps();
    }
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    for (int64_t b = 0; b < B; b++, blk += bytes) {
        for (int i = 0; i < 2; i++) PREFETCH_STREAM_L1(blk + 64 * i);
        const float d = _cvtsh_ss(*(const uint16_t *)(blk + d_at(kind)));
        __m256 f8[2];
        const __m512i scb = _mm512_broadcast_i32x4(block_scales(kind, blk, d, f8));
        const __m512 f = _mm512_insertf32x8(_mm512_castps256_ps512(f8[0]), f8[1], 1);
        const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)blk));
        __m512i t[8];
        for (int m = 0; m < R; m++) t[m] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i qs =
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + qs_at(kind) + 32 * h)));
            for (int j = 0; j < 4; j += 2) { /* quarters j and j + 1 of half h */
                const int k = 2 * h + j / 2, r = 4 * h + j;
                const __m512i low = _mm512_srlv_epi16(qs, _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)),
                                                                             _mm256_set1_epi16((short)(2 * j + 2)), 1));
                __m512i c;
                if (kind == Q3K) { /* (qs >> 2j) & 3 | 4 where set: one vpternlog (A & B | C) */
                    const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << r)),
                                                            _mm256_set1_epi8((char)(1 << (r + 1))), 1);
                    const __mmask64 set = _mm512_test_epi8_mask(hm, bits);
                    c = _mm512_ternarylogic_epi32(low, three, _mm512_maskz_mov_epi8(set, four), 0xea);
                } else {
                    c = _mm512_and_si512(low, three);
                }
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
        const __m512 dv = _mm512_set1_ps(d);
        for (int m = 0; m < R; m++) {
            const __m512 dsx = _mm512_mul_ps(dv, _mm512_set1_ps(sxs[m][b]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]), dsx, acc[m]);
            corr[m] = _mm512_fmadd_ps(f, _mm512_loadu_ps(xs16[m] + 16 * b), corr[m]);
        }
    }
    for (int m = 0; m < R; m++) a[m]->y[n] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[m], corr[m]));
}

TI void low_gemv_rows_vnni(const int kind, const qmat *const *a, int R, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m = 0; m < R; m += 8) switch (R - m < 8 ? R - m : 8) {
            case 1: low_rows_vnni(kind, a + m, 1, n); break;
            case 2: low_rows_vnni(kind, a + m, 2, n); break;
            case 3: low_rows_vnni(kind, a + m, 3, n); break;
            case 4: low_rows_vnni(kind, a + m, 4, n); break;
            case 5: low_rows_vnni(kind, a + m, 5, n); break;
            case 6: low_rows_vnni(kind, a + m, 6, n); break;
            case 7: low_rows_vnni(kind, a + m, 7, n); break;
            default: low_rows_vnni(kind, a + m, 8, n); break;
            }
}

TARGET_AVX512_VNNI static void q3k_gemv_vnni(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) low_rows_vnni(Q3K, &a, 1, n);
}
TARGET_AVX512_VNNI static void q2k_gemv_vnni(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) low_rows_vnni(Q2K, &a, 1, n);
}
TARGET_AVX512_VNNI static void q3k_gemv_rows_vnni(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    low_gemv_rows_vnni(Q3K, a, R, n0, n1);
}
TARGET_AVX512_VNNI static void q2k_gemv_rows_vnni(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    low_gemv_rows_vnni(Q2K, a, R, n0, n1);
}

static const sb_kernels q3k_avx512_vnni = {q3k_gemv_c, sb_xprep_pairs_avx2, q3k_gemv_vnni,
                                           q3k_gemv_rows_vnni, q3k_dequant};
static const sb_kernels q2k_avx512_vnni = {q2k_gemv_c, sb_xprep_pairs_avx2, q2k_gemv_vnni,
                                           q2k_gemv_rows_vnni, q2k_dequant};
#undef TI
#endif

/* ------------------------------------------------------------------------------------
 * AArch64 (neondot, and neon by kernels.h's neon_sdot): x as neon.c's int4 GEMV takes it
 * (two int8 digits, one sx per block of 32); per group of 16 two sdot per digit pair
 * ---------------------------------------------------------------------------------- */

#if defined(__aarch64__)
/* Row n. Q3_K: codes q in -4..3 as they are, times d (sc - 32) sx per group. Q2_K: codes
 * 0..3 times d sc sx, less dmin m sx (sum X) per group, the sum by sdot with ones. */
static inline __attribute__((always_inline)) void low_row_dot(const int kind, const qmat *a, int64_t n,
                                                              const int dot) {
    const int64_t K = a->K, B = K / Q4K_BLOCK, C = K / 32, bytes = block_bytes(kind);
    const int8_t *xd = a->xq;
    const float *sx = (const float *)(xd + C * 64);
    const uint8_t *blk = (const uint8_t *)a->qw + n * B * bytes;
    float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
    float32x4_t corr = vdupq_n_f32(0);
    const uint8x16_t three = vdupq_n_u8(3), four = vdupq_n_u8(4);
    const int8x16_t ones = vdupq_n_s8(1);
    for (int64_t b = 0; b < B; b++, blk += bytes) {
        const float d = half_at(blk + d_at(kind)), dmin = kind == Q2K ? half_at(blk + 82) : 0;
        int8_t sc[16];
        if (kind == Q3K) q3k_scales(blk + 96, sc);
        for (int s = 0; s < 8; s++) { /* sub-block s = 4 h + j: groups 2 s, 2 s + 1 */
            const int h = s / 4, j = s % 4;
            const uint8_t *qs = blk + qs_at(kind) + 32 * h;
            const int8x16_t down = vdupq_n_s8((int8_t)(-2 * j));
            const int64_t c = 8 * b + s;
            const int8_t *xc = xd + c * 64;
            for (int e = 0; e < 2; e++) {
                const uint8x16_t low = vandq_u8(vshlq_u8(vld1q_u8(qs + 16 * e), down), three);
                int8x16_t q;
                float ds;
                if (kind == Q3K) { /* -4 where hmask's bit 4 h + j is clear */
                    const uint8x16_t set = vtstq_u8(vld1q_u8(blk + 16 * e), vdupq_n_u8((uint8_t)(1 << s)));
                    q = vsubq_s8(vreinterpretq_s8_u8(low), vreinterpretq_s8_u8(vbicq_u8(four, set)));
                    ds = d * (float)sc[2 * s + e];
                } else {
                    q = vreinterpretq_s8_u8(low);
                    const uint8_t sm = blk[2 * s + e];
                    ds = d * (float)(sm & 15);
                    const float mn = dmin * (float)(sm >> 4);
                    corr = vfmaq_n_f32(corr, vcvtq_f32_s32(neon_dot16(ones, xc, e, dot)), mn * sx[c]);
                }
                acc[(2 * s + e) % 4] = vfmaq_n_f32(acc[(2 * s + e) % 4], vcvtq_f32_s32(neon_dot16(q, xc, e, dot)), ds * sx[c]);
            }
        }
    }
    const float32x4_t v = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
    a->y[n] = vaddvq_f32(v) - vaddvq_f32(corr);
}

TARGET_DOT static void q3k_gemv_dot(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) low_row_dot(Q3K, a, n, 1);
}
TARGET_DOT static void q2k_gemv_dot(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) low_row_dot(Q2K, a, n, 1);
}
static void q3k_gemv_neon(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) low_row_dot(Q3K, a, n, 0);
}
static void q2k_gemv_neon(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) low_row_dot(Q2K, a, n, 0);
}

static const sb_kernels q3k_neon_dot = {q3k_gemv_c, neon_q4_xprep, q3k_gemv_dot, NULL, q3k_dequant_c};
static const sb_kernels q2k_neon_dot = {q2k_gemv_c, neon_q4_xprep, q2k_gemv_dot, NULL, q2k_dequant_c};
static const sb_kernels q3k_neon = {q3k_gemv_c, neon_q4_xprep, q3k_gemv_neon, NULL, q3k_dequant_c};
static const sb_kernels q2k_neon = {q2k_gemv_c, neon_q4_xprep, q2k_gemv_neon, NULL, q2k_dequant_c};
#endif

const sb_kernels *q3k_for(const kernel_table *kt) {
#ifdef INFER_X86
    if (kt->sb_path == SB_AVX512_VNNI) return &q3k_avx512_vnni;
    if (kt->sb_path == SB_AVX2) return &q3k_avx2;
#elif defined(__aarch64__)
    if (kt->sb_path == SB_NEON_DOT) return &q3k_neon_dot;
    if (kt->sb_path == SB_NEON) return &q3k_neon;
#endif
    return &q3k_plain;
}

const sb_kernels *q2k_for(const kernel_table *kt) {
#ifdef INFER_X86
    if (kt->sb_path == SB_AVX512_VNNI) return &q2k_avx512_vnni;
    if (kt->sb_path == SB_AVX2) return &q2k_avx2;
#elif defined(__aarch64__)
    if (kt->sb_path == SB_NEON_DOT) return &q2k_neon_dot;
    if (kt->sb_path == SB_NEON) return &q2k_neon;
#endif
    return &q2k_plain;
}
