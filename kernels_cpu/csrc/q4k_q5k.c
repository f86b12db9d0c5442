/* q4_k and q5_k: GGUF Q4_K's and Q5_K's blocks as they lie in the file
 * (quant/formats/q4k.py, q5k.py), every path; one kernel body serves both, `kind` a
 * constant where it is called.
 *
 * A row is K / 256 blocks of 144 bytes (Q4_K): float16 d and dmin, 12 bytes of 6-bit
 * scales sc[j] and mins m[j] for the 8 sub-blocks of 32, then 128 bytes qs in 4 runs of
 * 32: run r's low nibbles are sub-block 2r's codes in order, its high nibbles sub-block
 * 2r + 1's. Q5_K's blocks (176 bytes) hold qh[32] between the scales and qs: bit j of
 * qh[i] is bit 4 of element i of sub-block j.
 *
 *     w = (d * sc[j]) * q - (dmin * m[j])      (three float32 roundings: gguf's order)
 *
 * GEMV (AVX2): x as the integer GEMM's two int8 digits, X = round(x / sx) with one sx
 * per 256 elements (|X| <= IG_XMAX, 15 significant bits of the block's largest element),
 * so a block's products stay integers: per int32 lane, sum over the 8 sub-blocks of
 * sc[j] * sum q X, at most 32 * 15 * 128 * 63 * 256 + 32 * 15 * 128 * 63 < 2^31 with the
 * high digit's sum shifted by 8. One float FMA per block by d sx, and the mins' term
 * dmin * m[j] * (sx * sum X) per sub-block from x's sums. neondot takes x as its int4
 * GEMV does (two digits, one sx per block of 32: a sub-block), four sdot a sub-block, and
 * plain NEON the same with kernels.h's exact emulation of sdot.
 * Without digits (x with inf or NaN, or a path with none: scalar) q4k_gemv_c
 * runs in float. Several rows of x (q4k_rows) take X as int16 and sum the same integers.
 * AVX-512 VNNI runs one row and several on q4k_rows_vnni: the same integers, each
 * block's sum to float in 16 lanes (its own float steps, one row or several alike).
 * Q5_K runs q4k_rows (one row: R = 1) with each code's bit 4 added: |q sc X| <= 31 * 63 *
 * 32512, 32 of them an int32 lane a block (< 2^31).
 * GEMM: tiles dequantized exactly (q4k_dequant_c, or AVX2's), then the float tile.
 */
#include <string.h>

#include "kernels.h"

#ifdef INFER_X86
#include <immintrin.h>
#endif

/* A block's 12 scale bytes -> the bytes of u[0..3]: sc[0..7] then m[0..7] (ggml's
 * get_scale_min_k4, four words at a time as llama.cpp's kernels do). */
static inline void q4k_scale_words(const uint8_t *p, uint32_t u[4]) {
    memcpy(u, p, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t m03 = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = m03;
    u[0] &= k1;
}

static inline void q4k_scale_bytes(const uint8_t *p, uint8_t out[16]) {
    uint32_t u[4];
    q4k_scale_words(p, u);
    memcpy(out, u, 16);
}

static float q4k_half(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | p[1] << 8)); }

static inline int64_t kq_bytes(int kind) { return kind == Q5K ? Q5K_BLOCK_BYTES : Q4K_BLOCK_BYTES; }
static inline int kq_qs(int kind) { return kind == Q5K ? 48 : 16; } /* where qs starts */

/* Element i of sub-block j's code: Q4_K's nibble, with Q5_K's bit 4 from qh */
static inline int kq_code(int kind, const uint8_t *blk, int j, int i) {
    const int q = (blk[kq_qs(kind) + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
    return kind == Q5K ? q | ((blk[16 + i] >> j) & 1) << 4 : q;
}

/* ------------------------------------------------------------------------------------
 * Plain C: every path's fallback
 * ---------------------------------------------------------------------------------- */

static inline void kq_gemv_c(const int kind, const qmat *a, int64_t n0, int64_t n1) {
    const int64_t B = a->K / Q4K_BLOCK, bytes = kq_bytes(kind);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *blk = (const uint8_t *)a->qw + n * B * bytes;
        float acc[8] = {0}; /* one per sub-block: sc q x minus m x */
        for (int64_t b = 0; b < B; b++, blk += bytes) {
            const float d = q4k_half(blk), dmin = q4k_half(blk + 2);
            const float *x = a->x + b * Q4K_BLOCK;
            uint8_t sm[16];
            q4k_scale_bytes(blk + 4, sm);
            for (int j = 0; j < 8; j++) {
                float t[8] = {0}, s[8] = {0};
                for (int i = 0; i < 32; i++) {
                    t[i % 8] += (float)kq_code(kind, blk, j, i) * x[32 * j + i];
                    s[i % 8] += x[32 * j + i];
                }
                float dot = 0, sum = 0;
                for (int i = 0; i < 8; i++) dot += t[i], sum += s[i];
                acc[j] += d * (float)sm[j] * dot - dmin * (float)sm[8 + j] * sum;
            }
        }
        a->y[n] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    }
}

static inline void kq_dequant_c(const int kind, const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q4K_BLOCK, bytes = kq_bytes(kind);
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * B * bytes;
    for (int64_t nb = 0; nb < (n1 - n0) * B; nb++, blk += bytes) {
        const float d = q4k_half(blk), dmin = q4k_half(blk + 2);
        uint8_t sm[16];
        q4k_scale_bytes(blk + 4, sm);
        for (int j = 0; j < 8; j++, w += 32) {
            const float d1 = d * (float)sm[j], m1 = dmin * (float)sm[8 + j];
            for (int i = 0; i < 32; i++) w[i] = d1 * (float)kq_code(kind, blk, j, i) - m1;
        }
    }
}

#ifdef INFER_X86
TARGET_AVX2
#endif
void q4k_block_scales(const uint8_t *blk, float d[8], float m[8]) {
    uint8_t sm[16];
    q4k_scale_bytes(blk + 4, sm);
#ifdef INFER_X86 /* the same products, 8 at a time */
    const __m128i b = _mm_loadu_si128((const __m128i *)sm);
    const __m256 d0 = _mm256_set1_ps(_cvtsh_ss((uint16_t)(blk[0] | blk[1] << 8)));
    const __m256 dmin = _mm256_set1_ps(_cvtsh_ss((uint16_t)(blk[2] | blk[3] << 8)));
    _mm256_storeu_ps(d, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))));
    const __m256 mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
    _mm256_storeu_ps(m, _mm256_xor_ps(mn, _mm256_set1_ps(-0.0f)));
#else
    const float d0 = q4k_half(blk), dmin = q4k_half(blk + 2);
    for (int j = 0; j < 8; j++) d[j] = d0 * (float)sm[j], m[j] = -(dmin * (float)sm[8 + j]);
#endif
}

static void q4k_gemv_c(const qmat *a, int64_t n0, int64_t n1) { kq_gemv_c(Q4K, a, n0, n1); }
static void q5k_gemv_c(const qmat *a, int64_t n0, int64_t n1) { kq_gemv_c(Q5K, a, n0, n1); }
static void q4k_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w) { kq_dequant_c(Q4K, a, n0, n1, w); }
static void q5k_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w) { kq_dequant_c(Q5K, a, n0, n1, w); }

/* A Q5_K block's codes (0..31, sub-block by sub-block) for the integer GEMM's panel: a
 * nibble, and bit j of each qh byte moved to bit 4. On x86 (where the integer GEMM runs)
 * 32 bytes at a time. */
#ifdef INFER_X86
TARGET_AVX2 void q5k_block_codes(const uint8_t *blk, uint8_t c[256]) {
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
    const __m256i nib = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    for (int r = 0; r < 4; r++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * r));
        const __m256i h = _mm256_srli_epi16(qh, 2 * r); /* bits 2r, 2r + 1 -> 0, 1 */
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, nib),
                                           _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib),
                                           _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
        _mm256_storeu_si256((__m256i *)(c + 64 * r), lo);
        _mm256_storeu_si256((__m256i *)(c + 64 * r + 32), hi);
    }
}
#else
void q5k_block_codes(const uint8_t *blk, uint8_t c[256]) {
    const uint8_t *qh = blk + 16, *ql = blk + 48;
    for (int r = 0; r < 4; r++, ql += 32, c += 64)
        for (int l = 0; l < 32; l++) {
            c[l] = (uint8_t)((ql[l] & 15) | ((qh[l] >> (2 * r)) & 1) << 4);
            c[32 + l] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> (2 * r + 1)) & 1) << 4);
        }
}
#endif

static const sb_kernels q4k_plain = {q4k_gemv_c, NULL, NULL, NULL, q4k_dequant_c};
static const sb_kernels q5k_plain = {q5k_gemv_c, NULL, NULL, NULL, q5k_dequant_c};

#ifdef INFER_X86
#include <immintrin.h>

/* ------------------------------------------------------------------------------------
 * AVX2 (with FMA and F16C), also what the AVX-512 paths run
 * ---------------------------------------------------------------------------------- */

#define T TARGET_AVX2 static
#define TI TARGET_AVX2 static inline __attribute__((always_inline))

/* x prepared (SB_XPREP_BYTES; q2k_q3k.c reads it too), X = round(x / sx), one sx a block of 256:
 * - for one row (q4k_row): per block, per sub-block of 32, its 32 high digits then its
 *   32 low digits (X = 256 hi + lo) in element order, 512 bytes a block;
 * - for several (q4k_rows): X as int16, per block, per sub-block its 16 even elements
 *   then its 16 odd ones, 512 bytes a block (sb_xprep_pairs_avx2, for q2k_q3k.c and
 *   iq4xs.c: per pair of sub-blocks, the even elements of each, then the odd ones);
 * then per block sx, then per sub-block sx * sum X, then per group of 16 sx * sum X. */

TI int sb_xprep(const float *x, int64_t K, void *buf, const int pairs) {
    const int64_t B = K / Q4K_BLOCK;
    int8_t *xd = buf;
    int16_t *x16 = (int16_t *)(xd + 2 * K);
    float *sxs = (float *)(xd + 4 * K), *xs = sxs + B, *xs16 = xs + K / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * Q4K_BLOCK;
        __m256 mx = _mm256_setzero_ps(), bad = mx;
        for (int i = 0; i < 32; i++) {
            const __m256 v = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_and_ps(v, absmask));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(),
                                                  _CMP_NEQ_UQ)); /* NaN or inf */
        }
        if (_mm256_movemask_ps(bad)) return -1;
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        float amax = 0;
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        /* tiny blocks scaled up first (exactly) so that IG_XMAX / amax is finite */
        const float up = amax < 0x1p-100f ? 0x1p100f : 1.0f;
        const __m256 inv = _mm256_set1_ps(amax > 0 ? IG_XMAX / (amax * up) : 0);
        const __m256 vup = _mm256_set1_ps(up);
        const float sx = amax / IG_XMAX;
        sxs[b] = sx;
        for (int j = 0; j < 8; j++) {
            __m256i X[4], D[2][4], sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int i = 0; i < 4; i++) {
                const __m256 v = _mm256_loadu_ps(xb + 32 * j + 8 * i);
                X[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v, vup), inv));
                sum[i / 2] = _mm256_add_epi32(sum[i / 2], X[i]);
                D[1][i] = _mm256_srai_epi32(_mm256_slli_epi32(X[i], 24), 24); /* X = 256 hi + lo */
                D[0][i] = _mm256_srai_epi32(_mm256_sub_epi32(X[i], D[1][i]), 8);
                X[i] = _mm256_permutevar8x32_epi32(X[i], evens_first);
            }
            for (int p = 0; p < 2; p++) { /* digits fit int8: the packs do not saturate */
                const __m256i ab = _mm256_packs_epi32(D[p][0], D[p][1]);
                const __m256i cd = _mm256_packs_epi32(D[p][2], D[p][3]);
                _mm256_store_si256((__m256i *)(xd + 512 * b + 64 * j + 32 * p),
                                   _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order));
            }
            /* |X| <= IG_XMAX: these packs do not saturate either */
            const __m256i ev = _mm256_packs_epi32(_mm256_permute2x128_si256(X[0], X[1], 0x20),
                                                  _mm256_permute2x128_si256(X[2], X[3], 0x20));
            const __m256i od = _mm256_packs_epi32(_mm256_permute2x128_si256(X[0], X[1], 0x31),
                                                  _mm256_permute2x128_si256(X[2], X[3], 0x31));
            /* its 16 even elements, then its 16 odd ones; per pair of sub-blocks: even of
             * each, then odd of each */
            int16_t *xp = x16 + 256 * b + (pairs ? 64 * (j / 2) + 16 * (j % 2) : 32 * j);
            _mm256_store_si256((__m256i *)xp, _mm256_permute4x64_epi64(ev, 0xd8));
            _mm256_store_si256((__m256i *)(xp + (pairs ? 32 : 16)), _mm256_permute4x64_epi64(od, 0xd8));
            int32_t half[2]; /* the sums of X over the sub-block's two groups of 16 */
            for (int p = 0; p < 2; p++) {
                __m128i s4 = _mm256_castsi256_si128(sum[p]);
                s4 = _mm_add_epi32(s4, _mm256_extracti128_si256(sum[p], 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
                half[p] = _mm_cvtsi128_si32(s4);
                xs16[16 * b + 2 * j + p] = sx * (float)half[p];
            }
            xs[8 * b + j] = sx * (float)(half[0] + half[1]);
        }
    }
    return 0;
}

TARGET_AVX2 int q4k_xprep_avx2(const float *x, int64_t K, void *buf) { return sb_xprep(x, K, buf, 0); }
TARGET_AVX2 int sb_xprep_pairs_avx2(const float *x, int64_t K, void *buf) {
    return sb_xprep(x, K, buf, 1);
}

/* sum over pairs of codes q (bytes) times digits x, times s (int16 lanes): int32 lanes */
TI __m256i dot_scaled(__m256i q, __m256i x, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), s);
}

/* int16 lane j of each 128-bit lane of v, in every int16 lane */
TI __m256i lane16(__m256i v, int j) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
}

/* A block's bytes sc[0..7], m[0..7] in one vector: ggml's get_scale_min_k4 on the four
 * words at once, in vector registers (in general registers, the words then inserted one
 * by one, it cost the AVX-512 rows kernel a cycle per block and row of x at 8 rows) */
TI __m128i q4k_scale_vec(const uint8_t *blk) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4)); /* u0 u1 u2, 4 bytes unused */
    const __m128i p = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)); /* u0 u2 u1 u2 */
    const __m128i q = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 0, 0)); /* u0 u0 u0 u1 */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(p, _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(q, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

/* Row's float step at the end of a block, the same in every AVX2 q4_k GEMV so that a
 * row's output does not depend on the kernel: t's lanes (sc q X) times d sx, and the mins' term
 * dmin m[j] (sx sum X), xs the block's x sums, kept apart. */
TI void q4k_block_end(__m256i t, float dsx, __m256 mins, const float *xs, float dmin,
                      __m256 *acc, __m256 *accm) {
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(dsx), *acc);
    *accm = _mm256_fmadd_ps(mins, _mm256_mul_ps(_mm256_loadu_ps(xs), _mm256_set1_ps(dmin)), *accm);
}

/* A block's mins m[0..7] as floats, from the scale words' high 8 bytes */
TI __m256 q4k_mins(__m128i sm) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm, sm)));
}

/* A row's output from its two accumulators */
TI float q4k_total(__m256 acc, __m256 accm) {
    __m256 v = _mm256_sub_ps(acc, accm);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* One row: per block, sum over its sub-blocks of sc[j] q X as int32 lanes (per lane, the
 * elements 4l..4l+3 of each sub-block, as q4k_rows sums them), then floats. */
TI float q4k_row(const qmat *a, int64_t n) {
    const int64_t K = a->K, B = K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a->qw + n * B * Q4K_BLOCK_BYTES;
    const int8_t *xd = a->xq;
    const float *sxs = sb_sx(xd, K), *xs = sb_xs32(xd, K);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++, blk += Q4K_BLOCK_BYTES) {
        for (int i = 0; i < 3; i++) PREFETCH_STREAM_L1(blk + 64 * i);
        const __m128i sm = q4k_scale_vec(blk);
        /* sc[0..7] as int16 in each 128-bit lane; sub-block j's broadcast by a shuffle */
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        const __m256i *xb = (const __m256i *)(xd + 512 * b);
        __m256i th = _mm256_setzero_si256(), tl = th;
        for (int r = 0; r < 4; r++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * r));
            const __m256i lo = _mm256_and_si256(w, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
            const __m256i s0 = lane16(sc, 2 * r), s1 = lane16(sc, 2 * r + 1);
            th = _mm256_add_epi32(th, _mm256_add_epi32(dot_scaled(lo, xb[4 * r], s0),
                                                       dot_scaled(hi, xb[4 * r + 2], s1)));
            tl = _mm256_add_epi32(tl, _mm256_add_epi32(dot_scaled(lo, xb[4 * r + 1], s0),
                                                       dot_scaled(hi, xb[4 * r + 3], s1)));
        }
        const __m256i t = _mm256_add_epi32(_mm256_slli_epi32(th, 8), tl);
        const uint16_t *h = (const uint16_t *)blk;
        const float d = _cvtsh_ss(h[0]), dmin = _cvtsh_ss(h[1]);
        q4k_block_end(t, d * sxs[b], q4k_mins(sm), xs + 8 * b, dmin, &acc, &accm);
    }
    return q4k_total(acc, accm);
}

/* vpshufb controls that spread sub-block j's scale byte over int16 lanes: (sc_j, 0)
 * pairs (row 2j: times even codes) and (0, sc_j) pairs (row 2j + 1: odd codes) */
#define PAIRS(a, b) {a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b,                            \
                     a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b}
#define SUB(j) PAIRS(j, -128), PAIRS(-128, j)
static const int8_t pair_ctl[16][32] __attribute__((aligned(64))) = {
    SUB(0), SUB(1), SUB(2), SUB(3), SUB(4), SUB(5), SUB(6), SUB(7)};
#undef SUB
#undef PAIRS

/* Q5_K's bit 4 of the codes of sub-block j from qh: 16 where bit j is set */
TI __m256i q5k_high(__m256i qh, int j) {
    const __m256i bit = _mm256_set1_epi8((char)(1 << j));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(16));
}

/* Run r of a block (sub-blocks 2r and 2r + 1, 32 bytes w) for R rows: its codes times
 * their scale as int16, even and odd elements apart (vpmaddubsw by the scale pairs),
 * then per row one vpmaddwd per 16 codes with X, into t[m]. Q5_K: qh its high bits. */
TI void q4k_run(const int kind, __m256i w, __m256i qh, __m256i sc, int r, const int R,
                const int16_t *const *xb, __m256i *t) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
    if (kind == Q5K) lo = _mm256_or_si256(lo, q5k_high(qh, 2 * r)), hi = _mm256_or_si256(hi, q5k_high(qh, 2 * r + 1));
    const __m256i *ctl = (const __m256i *)pair_ctl[4 * r];
    const __m256i p[4] = {_mm256_maddubs_epi16(lo, _mm256_shuffle_epi8(sc, _mm256_load_si256(ctl))),
                          _mm256_maddubs_epi16(lo, _mm256_shuffle_epi8(sc, _mm256_load_si256(ctl + 1))),
                          _mm256_maddubs_epi16(hi, _mm256_shuffle_epi8(sc, _mm256_load_si256(ctl + 2))),
                          _mm256_maddubs_epi16(hi, _mm256_shuffle_epi8(sc, _mm256_load_si256(ctl + 3)))};
    for (int m = 0; m < R; m++) {
        const __m256i *x = (const __m256i *)(xb[m] + 64 * r);
        const __m256i u01 = _mm256_add_epi32(_mm256_madd_epi16(p[0], x[0]), _mm256_madd_epi16(p[1], x[1]));
        const __m256i u23 = _mm256_add_epi32(_mm256_madd_epi16(p[2], x[2]), _mm256_madd_epi16(p[3], x[3]));
        t[m] = _mm256_add_epi32(t[m], _mm256_add_epi32(u01, u23));
    }
}

/* Up to 4 rows of x against weight row n. Per block, its codes times their sub-block's
 * scale sc[j] as int16 (at most 15 * 63), once for all rows; then per row one vpmaddwd
 * per 16 codes with X: sum sc q X over the block in int32 lanes (each at most 32 * 945
 * * 32512 < 2^31), and one float FMA by d sx. The mins' term dmin * m[j] * (sx * sum X)
 * per sub-block from x's sums. Each row's sums are those it takes alone. */
TI void q4k_rows(const int kind, const qmat *const *a, const int R, int64_t n) {
    const int64_t K = a[0]->K, B = K / Q4K_BLOCK, bytes = kq_bytes(kind);
    const uint8_t *blk = (const uint8_t *)a[0]->qw + n * B * bytes;
    const int16_t *xd[4];
    const float *sxs[4], *xs[4];
    __m256 acc[4], accm[4];
    for (int m = 0; m < R; m++) {
        xd[m] = sb_x16(a[m]->xq, K), sxs[m] = sb_sx(a[m]->xq, K), xs[m] = sb_xs32(a[m]->xq, K);
        acc[m] = accm[m] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < B; b++, blk += bytes) {
        for (int i = 0; i < 3; i++) PREFETCH_STREAM_L1(blk + 64 * i);
        const __m128i sm = q4k_scale_vec(blk);
        const __m256i sc = _mm256_broadcastsi128_si256(sm); /* bytes sc[0..7], m[0..7] */
        const int16_t *xb[4];
        __m256i t[4];
        for (int m = 0; m < R; m++) xb[m] = xd[m] + 256 * b, t[m] = _mm256_setzero_si256();
        const __m256i *w = (const __m256i *)(blk + kq_qs(kind));
        const __m256i qh = kind == Q5K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : sc;
        if (R <= 2) {
            for (int r = 0; r < 4; r++) q4k_run(kind, _mm256_loadu_si256(w + r), qh, sc, r, R, xb, t);
        } else {
#pragma GCC unroll 1 /* unrolled, gcc hoists the four runs' products and spills them */
            for (int r = 0; r < 4; r++) q4k_run(kind, _mm256_loadu_si256(w + r), qh, sc, r, R, xb, t);
        }
        const uint16_t *h = (const uint16_t *)blk;
        const float d = _cvtsh_ss(h[0]), dmin = _cvtsh_ss(h[1]);
        const __m256 mins = q4k_mins(sm);
        for (int m = 0; m < R; m++)
            q4k_block_end(t[m], d * sxs[m][b], mins, xs[m] + 8 * b, dmin, &acc[m], &accm[m]);
    }
    for (int m = 0; m < R; m++) a[m]->y[n] = q4k_total(acc[m], accm[m]);
}

/* R rows of x, 4 at a time per weight row (its later passes read it from L1) */
TI void kq_gemv_rows(const int kind, const qmat *const *a, int R, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int m = 0; m < R; m += 4) switch (R - m) {
            case 1: q4k_rows(kind, a + m, 1, n); break;
            case 2: q4k_rows(kind, a + m, 2, n); break;
            case 3: q4k_rows(kind, a + m, 3, n); break;
            default: q4k_rows(kind, a + m, 4, n); break;
            }
}
T void q4k_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    kq_gemv_rows(Q4K, a, R, n0, n1);
}
T void q5k_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    kq_gemv_rows(Q5K, a, R, n0, n1);
}
T void q5k_gemv(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) q4k_rows(Q5K, &a, 1, n);
}

T void q4k_gemv_digits(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) a->y[n] = q4k_row(a, n);
}

/* Exactly as kq_dequant_c: a product by d sc, then the difference with dmin m, no FMA. */
TI void kq_dequant(const int kind, const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t B = a->K / Q4K_BLOCK, bytes = kq_bytes(kind);
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * B * bytes;
    const __m256i m4 = _mm256_set1_epi32(15);
    for (int64_t nb = 0; nb < (n1 - n0) * B; nb++, blk += bytes) {
        const uint16_t *h = (const uint16_t *)blk;
        const float d = _cvtsh_ss(h[0]), dmin = _cvtsh_ss(h[1]);
        uint8_t sm[16];
        q4k_scale_bytes(blk + 4, sm);
        for (int j = 0; j < 8; j++, w += 32) {
            const __m256 d1 = _mm256_set1_ps(d * (float)sm[j]);
            const __m256 m1 = _mm256_set1_ps(dmin * (float)sm[8 + j]);
            const uint8_t *qs = blk + kq_qs(kind) + 32 * (j / 2);
            const __m128i shift = _mm_cvtsi32_si128(4 * (j % 2)), hshift = _mm_cvtsi32_si128(j);
            for (int i = 0; i < 4; i++) {
                const __m128i b8 = _mm_loadl_epi64((const __m128i *)(qs + 8 * i));
                __m256i v = _mm256_and_si256(_mm256_srl_epi32(_mm256_cvtepu8_epi32(b8), shift), m4);
                if (kind == Q5K) {
                    const __m128i h8 = _mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * i));
                    const __m256i hb = _mm256_srl_epi32(_mm256_cvtepu8_epi32(h8), hshift);
                    v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(hb, _mm256_set1_epi32(1)), 4));
                }
                const __m256 q = _mm256_cvtepi32_ps(v);
                _mm256_storeu_ps(w + 8 * i, _mm256_sub_ps(_mm256_mul_ps(q, d1), m1));
            }
        }
    }
}

T void q4k_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) { kq_dequant(Q4K, a, n0, n1, w); }
T void q5k_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) { kq_dequant(Q5K, a, n0, n1, w); }

static const sb_kernels q4k_avx2 = {q4k_gemv_c, q4k_xprep_avx2, q4k_gemv_digits, q4k_gemv_rows,
                                   q4k_dequant};
static const sb_kernels q5k_avx2 = {q5k_gemv_c, q4k_xprep_avx2, q5k_gemv, q5k_gemv_rows, q5k_dequant};
#undef T
#undef TI

/* ------------------------------------------------------------------------------------
 * AVX-512 with VNNI: several rows as q4k_rows, with vpdpwssd on 512 bits
 * ---------------------------------------------------------------------------------- */

#define TI TARGET_AVX512_VNNI static inline __attribute__((always_inline))

/* Up to 8 rows of x against blocks [b0, b1) of weight row n, summing what q4k_rows sums:
 * a run's codes (32 bytes) in both 256-bit halves, times the scale pairs of its even
 * elements in the low half and of its odd ones in the high half, so that one vpdpwssd
 * per row meets the 64 bytes of X those products pair with. Each row's block sums (exact
 * integers) go to float in 16 lanes, times d sx; the mins' term (dmin m[j]) (sx sum X) in
 * 8 more. A row's accumulators start at zero on block 0, else from st, and go back to st
 * unless b1 ends the row: its blocks add up in one order however K is sliced, so a row's
 * output is the same whether it runs alone, with others, whole or in slices. pf: how far
 * ahead the weights are prefetched. */
TI void q4k_rows_vnni(const int kind, const qmat *const *a, const int R, int64_t n, int64_t b0,
                      int64_t b1, int64_t pf, __m512 *st) {
    const int64_t K = a[0]->K, B = K / Q4K_BLOCK, bytes = kq_bytes(kind);
    const uint8_t *blk = (const uint8_t *)a[0]->qw + (n * B + b0) * bytes;
    const int16_t *xd[8];
    const float *sxs[8], *xs[8];
    __m512 acc[8], accm[8];
    for (int m = 0; m < R; m++) {
        xd[m] = sb_x16(a[m]->xq, K), sxs[m] = sb_sx(a[m]->xq, K), xs[m] = sb_xs32(a[m]->xq, K);
        acc[m] = b0 ? st[2 * m] : _mm512_setzero_ps();
        accm[m] = b0 ? st[2 * m + 1] : _mm512_setzero_ps();
    }
    const __m512i m4 = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    for (int64_t b = b0; b < b1; b++, blk += bytes) {
        for (int i = 0; i < 3; i++) __builtin_prefetch(blk + 64 * i + pf, 0, 3);
        const __m128i sm = q4k_scale_vec(blk);
        const __m512i sc = _mm512_broadcast_i32x4(sm);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        __m512i t[8];
        for (int m = 0; m < R; m++) t[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) { /* sub-block j: run j / 2's low or high nibbles */
            const __m256i run = _mm256_loadu_si256((const __m256i *)(blk + kq_qs(kind) + 32 * (j / 2)));
            const __m512i w = _mm512_broadcast_i64x4(run);
            const __m512i nib = j % 2 ? _mm512_srli_epi16(w, 4) : w;
            __m512i q;
            if (kind == Q5K) { /* nibble & 15 | 16 where qh's bit j is set */
                const __mmask64 set = _mm512_test_epi8_mask(qh, _mm512_set1_epi8((char)(1 << j)));
                q = _mm512_ternarylogic_epi32(nib, m4, _mm512_maskz_mov_epi8(set, sixteen), 0xea);
            } else {
                q = _mm512_and_si512(nib, m4);
            }
            const __m512i ctl = _mm512_load_si512((const __m512i *)pair_ctl[2 * j]);
            const __m512i p = _mm512_maddubs_epi16(q, _mm512_shuffle_epi8(sc, ctl));
            for (int m = 0; m < R; m++)
                t[m] = _mm512_dpwssd_epi32(t[m], p, _mm512_loadu_si512(xd[m] + 256 * b + 32 * j));
        }
        const uint16_t *h = (const uint16_t *)blk;
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(h[0]));
        const __m256 md = _mm256_mul_ps(q4k_mins(sm), _mm256_set1_ps(_cvtsh_ss(h[1])));
        for (int m = 0; m < R; m++) {
            const __m512 dsx = _mm512_mul_ps(d, _mm512_set1_ps(sxs[m][b]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]), dsx, acc[m]);
            accm[m] = _mm512_castps256_ps512(
                _mm256_fmadd_ps(md, _mm256_loadu_ps(xs[m] + 8 * b), _mm512_castps512_ps256(accm[m])));
        }
    }
    for (int m = 0; m < R; m++) {
        if (b1 < B) {
            st[2 * m] = acc[m], st[2 * m + 1] = accm[m];
            continue;
        }
        const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(acc[m]), _mm512_extractf32x8_ps(acc[m], 1));
        a[m]->y[n] = q4k_total(v, _mm512_castps512_ps256(accm[m]));
    }
}

TI void kq_slice(const int kind, const qmat *const *a, int R, int64_t n, int64_t b0, int64_t b1,
                int64_t pf, float *st) {
    __m512 *s = (__m512 *)st;
    switch (R) {
    case 1: q4k_rows_vnni(kind, a, 1, n, b0, b1, pf, s); break;
    case 2: q4k_rows_vnni(kind, a, 2, n, b0, b1, pf, s); break;
    case 3: q4k_rows_vnni(kind, a, 3, n, b0, b1, pf, s); break;
    case 4: q4k_rows_vnni(kind, a, 4, n, b0, b1, pf, s); break;
    case 5: q4k_rows_vnni(kind, a, 5, n, b0, b1, pf, s); break;
    case 6: q4k_rows_vnni(kind, a, 6, n, b0, b1, pf, s); break;
    case 7: q4k_rows_vnni(kind, a, 7, n, b0, b1, pf, s); break;
    default: q4k_rows_vnni(kind, a, 8, n, b0, b1, pf, s); break;
    }
}
TI void q4k_slice(const qmat *const *a, int R, int64_t n, int64_t b0, int64_t b1, int64_t pf,
                float *st) {
    kq_slice(Q4K, a, R, n, b0, b1, pf, st);
}
TI void q5k_slice(const qmat *const *a, int R, int64_t n, int64_t b0, int64_t b1, int64_t pf,
                float *st) {
    kq_slice(Q5K, a, R, n, b0, b1, pf, st);
}

/* Rows of x as kernels.h's rows_in_slices runs them (int6's scheme) */
TARGET_AVX512_VNNI static void q4k_gemv_rows_vnni(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    rows_in_slices(q4k_slice, a, R, n0, n1, a[0]->K / Q4K_BLOCK, Q4K_BLOCK_BYTES, PREFETCH_AHEAD_L1);
}
TARGET_AVX512_VNNI static void q5k_gemv_rows_vnni(const qmat *const *a, int R, int64_t n0, int64_t n1) {
    rows_in_slices(q5k_slice, a, R, n0, n1, a[0]->K / Q4K_BLOCK, Q5K_BLOCK_BYTES, PREFETCH_AHEAD_L1);
}
TARGET_AVX512_VNNI static void q4k_gemv_vnni(const qmat *a, int64_t n0, int64_t n1) {
    q4k_gemv_rows_vnni(&a, 1, n0, n1);
}
TARGET_AVX512_VNNI static void q5k_gemv_vnni(const qmat *a, int64_t n0, int64_t n1) {
    q5k_gemv_rows_vnni(&a, 1, n0, n1);
}

static const sb_kernels q4k_avx512_vnni = {q4k_gemv_c, q4k_xprep_avx2, q4k_gemv_vnni,
                                           q4k_gemv_rows_vnni, q4k_dequant};
static const sb_kernels q5k_avx512_vnni = {q5k_gemv_c, q4k_xprep_avx2, q5k_gemv_vnni,
                                           q5k_gemv_rows_vnni, q5k_dequant};
#endif

/* ------------------------------------------------------------------------------------
 * AArch64 (neondot, and neon by kernels.h's neon_sdot): x as neon.c's int4 GEMV takes it,
 * two int8 digits per block of 32 with one sx each (a sub-block here), four sdot per
 * sub-block
 * ---------------------------------------------------------------------------------- */

#if defined(__aarch64__)
/* Row n: per sub-block c (a block of x), sum q X of its 32 codes by sdot on the high
 * digits, shifted by 8, plus the low ones; then (d sc[j] sx) times it, less the mins'
 * dmin m[j] (sx sum X). 4 accumulators over the sub-blocks. */
static inline __attribute__((always_inline)) void kq_row_dot(const int kind, const qmat *a, int64_t n,
                                                             const int dot) {
    const int64_t K = a->K, B = K / Q4K_BLOCK, C = K / 32, bytes = kq_bytes(kind);
    const int8_t *xd = a->xq;
    const float *sx = (const float *)(xd + C * 64), *xs = xprep4_xs((void *)a->xq, K);
    const uint8_t *blk = (const uint8_t *)a->qw + n * B * bytes;
    float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
    float mins = 0;
    const uint8x16_t m4 = vdupq_n_u8(15), b4 = vdupq_n_u8(16);
    for (int64_t b = 0; b < B; b++, blk += bytes) {
        const float d = q4k_half(blk), dmin = q4k_half(blk + 2);
        uint8_t sm[16];
        q4k_scale_bytes(blk + 4, sm);
        for (int j = 0; j < 8; j++) {
            const int64_t c = 8 * b + j;
            const uint8_t *run = blk + kq_qs(kind) + 32 * (j / 2);
            uint8x16_t lo = vld1q_u8(run), hi = vld1q_u8(run + 16); /* elements 0-15, 16-31 */
            lo = j % 2 ? vshrq_n_u8(lo, 4) : vandq_u8(lo, m4);
            hi = j % 2 ? vshrq_n_u8(hi, 4) : vandq_u8(hi, m4);
            if (kind == Q5K) { /* | 16 where qh's bit j is set */
                const uint8x16_t bit = vdupq_n_u8((uint8_t)(1 << j));
                lo = vorrq_u8(lo, vandq_u8(vtstq_u8(vld1q_u8(blk + 16), bit), b4));
                hi = vorrq_u8(hi, vandq_u8(vtstq_u8(vld1q_u8(blk + 32), bit), b4));
            }
            const int8x16_t l = vreinterpretq_s8_u8(lo), h = vreinterpretq_s8_u8(hi);
            const int8_t *xc = xd + c * 64;
            const int32x4_t t = neon_dot32(l, h, xc, dot);
            acc[j % 4] = vfmaq_n_f32(acc[j % 4], vcvtq_f32_s32(t), d * (float)sm[j] * sx[c]);
            mins += dmin * (float)sm[8 + j] * xs[c];
        }
    }
    const float32x4_t v = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
    a->y[n] = vaddvq_f32(v) - mins;
}

TARGET_DOT static void q4k_gemv_dot(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) kq_row_dot(Q4K, a, n, 1);
}
TARGET_DOT static void q5k_gemv_dot(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) kq_row_dot(Q5K, a, n, 1);
}
static void q4k_gemv_neon(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) kq_row_dot(Q4K, a, n, 0);
}
static void q5k_gemv_neon(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) kq_row_dot(Q5K, a, n, 0);
}

static const sb_kernels q4k_neon_dot = {q4k_gemv_c, neon_q4_xprep, q4k_gemv_dot, NULL, q4k_dequant_c};
static const sb_kernels q5k_neon_dot = {q5k_gemv_c, neon_q4_xprep, q5k_gemv_dot, NULL, q5k_dequant_c};
static const sb_kernels q4k_neon = {q4k_gemv_c, neon_q4_xprep, q4k_gemv_neon, NULL, q4k_dequant_c};
static const sb_kernels q5k_neon = {q5k_gemv_c, neon_q4_xprep, q5k_gemv_neon, NULL, q5k_dequant_c};
#endif

const sb_kernels *q4k_for(const kernel_table *kt) {
#ifdef INFER_X86
    if (kt->sb_path == SB_AVX512_VNNI) return &q4k_avx512_vnni;
    if (kt->sb_path == SB_AVX2) return &q4k_avx2;
#elif defined(__aarch64__)
    if (kt->sb_path == SB_NEON_DOT) return &q4k_neon_dot;
    if (kt->sb_path == SB_NEON) return &q4k_neon;
#endif
    return &q4k_plain;
}

const sb_kernels *q5k_for(const kernel_table *kt) {
#ifdef INFER_X86
    if (kt->sb_path == SB_AVX512_VNNI) return &q5k_avx512_vnni;
    if (kt->sb_path == SB_AVX2) return &q5k_avx2;
#elif defined(__aarch64__)
    if (kt->sb_path == SB_NEON_DOT) return &q5k_neon_dot;
    if (kt->sb_path == SB_NEON) return &q5k_neon;
#endif
    return &q5k_plain;
}
