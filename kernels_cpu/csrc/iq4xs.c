/* iq4_xs: GGUF IQ4_XS's blocks as they lie in the file (quant/formats/iq4xs.py), every path.
 *
 * A row is K / 256 blocks of 136 bytes: float16 d, scales_h (uint16: sub-block j's high 2
 * bits at bits 2j), scales_l[4] (j's low 4 bits in byte j / 2, nibble j % 2), then per
 * sub-block of 32 16 bytes qs: element i's code in the low nibble of qs[i], 16 + i's in
 * its high nibble. The codes index 16 non-uniform levels v (kvalues_iq4nl):
 *
 *     w = (d * (ls - 32)) * v[q]        (both products exact in float32)
 *
 * GEMV (x86): x as q4k_q5k.c prepares it (X int16, one sx per 256). The levels go unsigned,
 * v + 128 in 1..241, so that vpmaddubsw takes them by their sub-block's scale pairs, once
 * for all rows; then each row takes one vpmaddwd or vpdpwssd per 16 or 32 weights. An
 * int32 lane holds at most 8 products (|(v + 128) sc X| <= 241 * 32 * 32512: 8 of them
 * < 2^31), so the lanes go to float every 8 (every pair of sub-blocks, two on AVX2). The
 * -128 sc sum X term per sub-block comes from x's sums per 32. One row is the rows kernel
 * with R = 1, so a row's output is the same alone or in a batch. Without x's integers
 * (x with inf or NaN, or a path with none: scalar) the float GEMV runs; NEON takes x as
 * neondot's int4 GEMV does (two int8 digits per block of 32) and the levels as signed codes
 * by a table lookup (plain NEON with kernels.h's exact emulation of sdot).
 * GEMM: on the vpdpbusd paths the integer GEMM, as int8's codes (c = v + 128, each
 * sub-block's d (ls - 32)); else tiles dequantized exactly, then the float tile.
 */
#include <string.h>

#include "kernels.h"

static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

/* A block's 8 sub-block scales ls - 32 */
static inline void iq4_scales(const uint8_t *blk, int sc[8]) {
    const int h = blk[2] | blk[3] << 8;
    for (int j = 0; j < 8; j++) sc[j] = (((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | ((h >> (2 * j)) & 3) << 4) - 32;
}

/* ------------------------------------------------------------------------------------
 * Plain C: every path's fallback
 * ---------------------------------------------------------------------------------- */

static void iq4_block_weights(const uint8_t *blk, float *w) {
    const float d = half_to_float((uint16_t)(blk[0] | blk[1] << 8));
    int sc[8];
    iq4_scales(blk, sc);
    for (int j = 0; j < 8; j++) {
        const float dl = d * (float)sc[j];
        const uint8_t *qs = blk + 8 + 16 * j;
        for (int i = 0; i < 16; i++) {
            w[32 * j + i] = dl * (float)iq4_values[qs[i] & 15];
            w[32 * j + 16 + i] = dl * (float)iq4_values[qs[i] >> 4];
        }
    }
}

static void iq4xs_gemv_c(const qmat *a, int64_t n0, int64_t n1) {
    const int64_t B = a->K / Q4K_BLOCK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *blk = (const uint8_t *)a->qw + n * B * IQ4XS_BLOCK_BYTES;
        float acc[8] = {0}, w[Q4K_BLOCK];
        for (int64_t b = 0; b < B; b++, blk += IQ4XS_BLOCK_BYTES) {
            iq4_block_weights(blk, w);
            const float *x = a->x + b * Q4K_BLOCK;
            for (int i = 0; i < Q4K_BLOCK; i++) acc[i % 8] += w[i] * x[i];
        }
        a->y[n] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    }
}

static void iq4xs_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * B * IQ4XS_BLOCK_BYTES;
    for (int64_t nb = 0; nb < (n1 - n0) * B; nb++, blk += IQ4XS_BLOCK_BYTES, w += Q4K_BLOCK)
        iq4_block_weights(blk, w);
}

static const sb_kernels iq4xs_plain = {iq4xs_gemv_c, NULL, NULL, NULL, iq4xs_dequant_c};

#ifndef INFER_X86 /* the integer GEMM runs on x86 paths only; AVX2's is below */
void iq4xs_block_panel(const uint8_t *blk, uint8_t c[256], float d[8]) {
    const float d0 = half_to_float((uint16_t)(blk[0] | blk[1] << 8));
    int sc[8];
    iq4_scales(blk, sc);
    for (int j = 0; j < 8; j++) {
        d[j] = d0 * (float)sc[j];
        for (int i = 0; i < 16; i++) {
            c[32 * j + i] = (uint8_t)(iq4_values[blk[8 + 16 * j + i] & 15] + 128);
            c[32 * j + 16 + i] = (uint8_t)(iq4_values[blk[8 + 16 * j + i] >> 4] + 128);
        }
    }
}
#endif

#ifdef INFER_X86
#include <immintrin.h>

/* The levels plus 128, for vpshufb */
#define LEVELS 1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241
static const uint8_t iq4_lut[64] __attribute__((aligned(64))) = {LEVELS, LEVELS, LEVELS, LEVELS};
#undef LEVELS

/* vpshufb controls spreading sub-blocks' scale bytes over int16 lanes in X's order (even
 * elements of sub-block 2k, of 2k + 1, then the odd ones): per pair k, (sc, 0) pairs of
 * 2k in its first two 128-bit lanes and of 2k + 1 in the last two, then (0, sc) pairs */
#define EVEN(j) j, -128, j, -128, j, -128, j, -128, j, -128, j, -128, j, -128, j, -128
#define ODD(j) -128, j, -128, j, -128, j, -128, j, -128, j, -128, j, -128, j, -128, j
#define PAIR(k) {EVEN(2 * k), EVEN(2 * k), EVEN(2 * k + 1), EVEN(2 * k + 1)},                  \
                {ODD(2 * k), ODD(2 * k), ODD(2 * k + 1), ODD(2 * k + 1)}
static const int8_t iq4_ctl[8][64] __attribute__((aligned(64))) = {PAIR(0), PAIR(1), PAIR(2), PAIR(3)};
#undef PAIR
#undef ODD
#undef EVEN

/* ------------------------------------------------------------------------------------
 * AVX2 (with FMA and F16C), also what plain AVX-512 and AVX-VNNI run
 * ---------------------------------------------------------------------------------- */

#define TI TARGET_AVX2 static inline __attribute__((always_inline))

/* A block's 8 scales ls - 32 as int8 (bytes 0-7), in vector registers */
TI __m128i iq4_scale_bytes(const uint8_t *blk) {
    uint16_t h;
    int32_t l;
    memcpy(&h, blk + 2, 2);
    memcpy(&l, blk + 4, 4);
    const __m128i lv = _mm_cvtsi32_si128(l), m4 = _mm_set1_epi8(0x0f);
    const __m128i low = _mm_unpacklo_epi8(_mm_and_si128(lv, m4), _mm_and_si128(_mm_srli_epi16(lv, 4), m4));
    const __m256i hv = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3));
    const __m128i h16 = _mm_packs_epi32(_mm256_castsi256_si128(hv), _mm256_extracti128_si256(hv, 1));
    const __m128i h8 = _mm_packs_epi16(h16, h16); /* values <= 3: <<4 stays in its byte */
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(h8, 4)), _mm_set1_epi8(32));
}

/* A row's output from its accumulators */
TI float iq4_total(__m256 acc, __m256 corr) {
    const __m256 v = _mm256_sub_ps(acc, corr);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* Up to 4 rows of x against weight row n: per sub-block its levels v + 128 in element
 * order times the scale pairs (even elements, then odd), once for all rows; per row two
 * vpmaddwd with X, the int32 lanes to float every two sub-blocks. */
TI void iq4_rows(const qmat *const *a, const int R, int64_t n) {
    const int64_t K = a[0]->K, B = K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a[0]->qw + n * B * IQ4XS_BLOCK_BYTES;
    const int16_t *xd[4];
    const float *sxs[4], *xs[4];
    __m256 acc[4], corr[4];
    for (int m = 0; m < R; m++) {
        xd[m] = sb_x16(a[m]->xq, K), sxs[m] = sb_sx(a[m]->xq, K), xs[m] = sb_xs32(a[m]->xq, K);
        acc[m] = corr[m] = _mm256_setzero_ps();
    }
    const __m256i lut = _mm256_load_si256((const __m256i *)iq4_lut), m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < B; b++, blk += IQ4XS_BLOCK_BYTES) {
        for (int i = 0; i < 3; i++) PREFETCH_STREAM_L1(blk + 64 * i);
        const float d = _cvtsh_ss(*(const uint16_t *)blk);
        const __m128i sc8 = iq4_scale_bytes(blk);
        const __m256i scb = _mm256_broadcastsi128_si256(sc8);
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), _mm256_set1_ps(128 * d));
        __m256 dsx[4];
        for (int m = 0; m < R; m++) dsx[m] = _mm256_set1_ps(d * sxs[m][b]);
        for (int k = 0; k < 4; k++) {
            __m256i t[4];
            for (int m = 0; m < R; m++) t[m] = _mm256_setzero_si256();
            for (int s = 0; s < 2; s++) { /* sub-block 2k + s */
                const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * (2 * k + s)));
                const __m256i nib = _mm256_and_si256(
                    _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1), m4);
                const __m256i c = _mm256_shuffle_epi8(lut, nib); /* elements 0-15, then 16-31 */
                const __m256i *even = (const __m256i *)iq4_ctl[2 * k] + s;
                const __m256i *odd = (const __m256i *)iq4_ctl[2 * k + 1] + s;
                const __m256i pe = _mm256_maddubs_epi16(c, _mm256_shuffle_epi8(scb, _mm256_load_si256(even)));
                const __m256i po = _mm256_maddubs_epi16(c, _mm256_shuffle_epi8(scb, _mm256_load_si256(odd)));
                for (int m = 0; m < R; m++) { /* X: per pair, even 2k, even 2k + 1, odd, odd */
                    const __m256i *x = (const __m256i *)(xd[m] + 256 * b + 64 * k) + s;
                    t[m] = _mm256_add_epi32(t[m], _mm256_add_epi32(_mm256_madd_epi16(pe, x[0]),
                                                                   _mm256_madd_epi16(po, x[2])));
                }
            }
            for (int m = 0; m < R; m++) acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[m]), dsx[m], acc[m]);
        }
        for (int m = 0; m < R; m++) corr[m] = _mm256_fmadd_ps(f, _mm256_loadu_ps(xs[m] + 8 * b), corr[m]);
    }
    for (int m = 0; m < R; m++) a[m]->y[n] = iq4_total(acc[m], corr[m]);
}

TARGET_AVX2 static void iq4xs_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m = 0; m < R; m += 4) switch (R - m) {
            case 1: iq4_rows(a + m, 1, n); break;
            case 2: iq4_rows(a + m, 2, n); break;
            case 3: iq4_rows(a + m, 3, n); break;
            default: iq4_rows(a + m, 4, n); break;
            }
}

TARGET_AVX2 static void iq4xs_gemv(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) iq4_rows(&a, 1, n);
}

/* Exactly as iq4_block_weights: the levels times d (ls - 32), both products exact */
TARGET_AVX2 static void iq4xs_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * B * IQ4XS_BLOCK_BYTES;
    const __m128i values = _mm_loadu_si128((const __m128i *)iq4_values), m4 = _mm_set1_epi8(0x0f);
    for (int64_t nb = 0; nb < (n1 - n0) * B; nb++, blk += IQ4XS_BLOCK_BYTES, w += Q4K_BLOCK) {
        const float d = _cvtsh_ss(*(const uint16_t *)blk);
        int8_t sc[16];
        _mm_storeu_si128((__m128i *)sc, iq4_scale_bytes(blk));
        for (int j = 0; j < 8; j++) {
            const __m256 dl = _mm256_set1_ps(d * (float)sc[j]);
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * j));
            const __m128i half[2] = {_mm_shuffle_epi8(values, _mm_and_si128(q, m4)),
                                     _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(q, 4), m4))};
            for (int i = 0; i < 4; i++) {
                const __m128i v8 = i % 2 ? _mm_unpackhi_epi64(half[i / 2], half[i / 2]) : half[i / 2];
                _mm256_storeu_ps(w + 32 * j + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v8)), dl));
            }
        }
    }
}

TARGET_AVX2 void iq4xs_block_panel(const uint8_t *blk, uint8_t c[256], float d[8]) {
    const __m128i lut = _mm_load_si128((const __m128i *)iq4_lut), m4 = _mm_set1_epi8(0x0f);
    for (int j = 0; j < 8; j++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * j));
        _mm_storeu_si128((__m128i *)(c + 32 * j), _mm_shuffle_epi8(lut, _mm_and_si128(q, m4)));
        _mm_storeu_si128((__m128i *)(c + 32 * j + 16),
                         _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), m4)));
    }
    const __m256 d8 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(iq4_scale_bytes(blk))),
                                    _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)blk)));
    _mm256_storeu_ps(d, d8);
}

static const sb_kernels iq4xs_avx2 = {iq4xs_gemv_c, sb_xprep_pairs_avx2, iq4xs_gemv, iq4xs_gemv_rows,
                                      iq4xs_dequant};
#undef TI

/* ------------------------------------------------------------------------------------
 * AVX-512 with VNNI: a pair of sub-blocks per 512-bit vector, up to 4 rows
 * ---------------------------------------------------------------------------------- */

#define TI TARGET_AVX512_VNNI static inline __attribute__((always_inline))

/* As iq4_rows, a pair of sub-blocks at a time: their 32 bytes as 128-bit lanes A, A, B, B,
 * the second and fourth shifted a nibble, looked up, times the scale pairs (even, then odd
 * elements), each product vector meeting 64 bytes of X in one vpdpwssd per row; lanes to
 * float every two pairs. */
TI void iq4_rows_vnni(const qmat *const *a, const int R, int64_t n) {
    const int64_t K = a[0]->K, B = K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a[0]->qw + n * B * IQ4XS_BLOCK_BYTES;
    const int16_t *xd[4];
    const float *sxs[4], *xs[4];
    __m256 acc[4], corr[4];
    for (int m = 0; m < R; m++) {
        xd[m] = sb_x16(a[m]->xq, K), sxs[m] = sb_sx(a[m]->xq, K), xs[m] = sb_xs32(a[m]->xq, K);
        acc[m] = corr[m] = _mm256_setzero_ps();
    }
    const __m512i lut = _mm512_load_si512((const __m512i *)iq4_lut), m4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < B; b++, blk += IQ4XS_BLOCK_BYTES) {
        for (int i = 0; i < 3; i++) PREFETCH_STREAM_L1(blk + 64 * i);
        const float d = _cvtsh_ss(*(const uint16_t *)blk);
        const __m128i sc8 = iq4_scale_bytes(blk);
        const __m512i scb = _mm512_broadcast_i32x4(sc8);
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), _mm256_set1_ps(128 * d));
        for (int half = 0; half < 2; half++) {
            __m512i t[4];
            for (int m = 0; m < R; m++) t[m] = _mm512_setzero_si512();
            for (int k = 2 * half; k < 2 * half + 2; k++) {
                const __m512i q = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + 8 + 32 * k)));
                const __m512i aabb = _mm512_shuffle_i64x2(q, q, 0x50);
                const __m512i nib = _mm512_and_si512(_mm512_mask_srli_epi16(aabb, 0xff00ff00, aabb, 4), m4);
                const __m512i c = _mm512_shuffle_epi8(lut, nib);
                const __m512i *ctl = (const __m512i *)iq4_ctl[2 * k];
                const __m512i pe = _mm512_maddubs_epi16(c, _mm512_shuffle_epi8(scb, _mm512_load_si512(ctl)));
                const __m512i po = _mm512_maddubs_epi16(c, _mm512_shuffle_epi8(scb, _mm512_load_si512(ctl + 1)));
                for (int m = 0; m < R; m++) {
                    const __m512i *x = (const __m512i *)(xd[m] + 256 * b + 64 * k);
                    t[m] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(t[m], pe, _mm512_loadu_si512(x)), po,
                                               _mm512_loadu_si512(x + 1));
                }
            }
            for (int m = 0; m < R; m++) {
                const __m512 tf = _mm512_cvtepi32_ps(t[m]); /* two lanes' 4 products each: exact */
                const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(tf), _mm512_extractf32x8_ps(tf, 1));
                acc[m] = _mm256_fmadd_ps(t8, _mm256_set1_ps(d * sxs[m][b]), acc[m]);
            }
        }
        for (int m = 0; m < R; m++) corr[m] = _mm256_fmadd_ps(f, _mm256_loadu_ps(xs[m] + 8 * b), corr[m]);
    }
    for (int m = 0; m < R; m++) a[m]->y[n] = iq4_total(acc[m], corr[m]);
}

TARGET_AVX512_VNNI static void iq4xs_gemv_rows_vnni(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m = 0; m < R; m += 4) switch (R - m) {
            case 1: iq4_rows_vnni(a + m, 1, n); break;
            case 2: iq4_rows_vnni(a + m, 2, n); break;
            case 3: iq4_rows_vnni(a + m, 3, n); break;
            default: iq4_rows_vnni(a + m, 4, n); break;
            }
}

TARGET_AVX512_VNNI static void iq4xs_gemv_vnni(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) iq4_rows_vnni(&a, 1, n);
}

static const sb_kernels iq4xs_avx512_vnni = {iq4xs_gemv_c, sb_xprep_pairs_avx2, iq4xs_gemv_vnni,
                                             iq4xs_gemv_rows_vnni, iq4xs_dequant};
#undef TI
#endif

/* ------------------------------------------------------------------------------------
 * AArch64 (neondot, and neon by kernels.h's neon_sdot): x as neon.c's int4 GEMV takes it
 * (two int8 digits, one sx per block of 32: a sub-block); the levels as signed codes by a
 * table lookup, four sdot a sub-block
 * ---------------------------------------------------------------------------------- */

#if defined(__aarch64__)
static inline __attribute__((always_inline)) void iq4xs_rows(const qmat *a, int64_t n0, int64_t n1,
                                                             const int dot) {
    const int64_t K = a->K, B = K / Q4K_BLOCK, C = K / 32;
    const int8_t *xd = a->xq;
    const float *sx = (const float *)(xd + C * 64);
    const int8x16_t levels = vld1q_s8(iq4_values);
    const uint8x16_t m4 = vdupq_n_u8(15);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *blk = (const uint8_t *)a->qw + n * B * IQ4XS_BLOCK_BYTES;
        float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
        for (int64_t b = 0; b < B; b++, blk += IQ4XS_BLOCK_BYTES) {
            const float d = half_to_float((uint16_t)(blk[0] | blk[1] << 8));
            int sc[8];
            iq4_scales(blk, sc);
            for (int j = 0; j < 8; j++) {
                const uint8x16_t q = vld1q_u8(blk + 8 + 16 * j);
                const int8x16_t lo = vqtbl1q_s8(levels, vandq_u8(q, m4)); /* elements 0-15 */
                const int8x16_t hi = vqtbl1q_s8(levels, vshrq_n_u8(q, 4)); /* 16-31 */
                const int64_t c = 8 * b + j;
                acc[j % 4] = vfmaq_n_f32(acc[j % 4], vcvtq_f32_s32(neon_dot32(lo, hi, xd + c * 64, dot)), d * (float)sc[j] * sx[c]);
            }
        }
        a->y[n] = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
    }
}

TARGET_DOT static void iq4xs_gemv_dot(const qmat *a, int64_t n0, int64_t n1) { iq4xs_rows(a, n0, n1, 1); }
static void iq4xs_gemv_neon(const qmat *a, int64_t n0, int64_t n1) { iq4xs_rows(a, n0, n1, 0); }

static const sb_kernels iq4xs_neon_dot = {iq4xs_gemv_c, neon_q4_xprep, iq4xs_gemv_dot, NULL, iq4xs_dequant_c};
static const sb_kernels iq4xs_neon = {iq4xs_gemv_c, neon_q4_xprep, iq4xs_gemv_neon, NULL, iq4xs_dequant_c};
#endif

const sb_kernels *iq4xs_for(const kernel_table *kt) {
#ifdef INFER_X86
    if (kt->sb_path == SB_AVX512_VNNI) return &iq4xs_avx512_vnni;
    if (kt->sb_path == SB_AVX2) return &iq4xs_avx2;
#elif defined(__aarch64__)
    if (kt->sb_path == SB_NEON_DOT) return &iq4xs_neon_dot;
    if (kt->sb_path == SB_NEON) return &iq4xs_neon;
#endif
    return &iq4xs_plain;
}
