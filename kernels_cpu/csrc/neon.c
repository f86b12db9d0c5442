/* AArch64 paths: "neon" (Advanced SIMD, every AArch64 CPU) and "neondot" (Armv8.2 dot
 * product: the int4 GEMV on x as int8 digits, with sdot). 4 float lanes. The same
 * algorithms as avx512.c (see there and kernels.h):
 *
 * GEMV: one row at a time, ACC accumulators. int8 and (neon) int4 widen weights to float;
 * neondot's int4 GEMV takes x as two int8 digits per element (15 significant bits a
 * block: the integer GEMM's x, as on x86), one 32-element block (16 bytes of a row) per
 * step, four sdot; the int5 and int6 GEMVs (and the super-block kinds') take the same x
 * on both paths, their bodies compiled twice: with sdot ("_dot") and with kernels.h's
 * exact emulation of it ("_neon"), the same bits.
 * GEMM: dequantized tile times x in 4 x 4 blocks of dot products (16 accumulators of
 * the 32 registers).
 */
#include <string.h>

#include "kernels.h"

#if defined(__aarch64__)
#include <arm_neon.h>

#define TI static inline __attribute__((always_inline))

enum { ACC = 4 };

/* Sum of 4 lanes: (0 + 1) + (2 + 3) */
TI float hsum(float32x4_t v) {
    float32x2_t p = vpadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(p, 0) + vget_lane_f32(p, 1);
}

TI float hsum_acc(const float32x4_t *acc) {
    return hsum(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
}

/* 4 float16 -> float */
TI float32x4_t halfs4(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

/* n < 4 float16 (the rest zero) -> float */
TI float32x4_t halfs_part(const uint16_t *p, int64_t n) {
    uint16_t tmp[4] = {0};
    memcpy(tmp, p, (size_t)n * sizeof *tmp);
    return halfs4(tmp);
}

/* 16 int8 -> 4 x 4 floats */
TI void widen_i8(const int8_t *p, float32x4_t w[4]) {
    int8x16_t b = vld1q_s8(p);
    int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
    w[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    w[1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
    w[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    w[3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
}

/* 16 bytes of int4 -> codes of elements 0..31 as 8 x 4 ints (low nibbles first) */
TI void widen_i4(const uint8_t *p, int32x4_t c[8]) {
    uint8x16_t b = vld1q_u8(p);
    uint8x16_t n[2] = {vandq_u8(b, vdupq_n_u8(15)), vshrq_n_u8(b, 4)};
    for (int h = 0; h < 2; h++) {
        uint16x8_t lo = vmovl_u8(vget_low_u8(n[h])), hi = vmovl_u8(vget_high_u8(n[h]));
        c[4 * h + 0] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo)));
        c[4 * h + 1] = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(lo)));
        c[4 * h + 2] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi)));
        c[4 * h + 3] = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(hi)));
    }
}

/* sum_g c[g] * xsum[g]: the int4 GEMV's mins (or -8 d) term of one row */
TI float group_offset(const uint16_t *c, int64_t G, const float *xsum) {
    float32x4_t off = vdupq_n_f32(0);
    int64_t gi = 0;
    for (; gi + 4 <= G; gi += 4) off = vfmaq_f32(off, halfs4(c + gi), vld1q_f32(xsum + gi));
    if (gi < G) {
        float xs[4] = {0};
        memcpy(xs, xsum + gi, (size_t)(G - gi) * sizeof *xs);
        off = vfmaq_f32(off, halfs_part(c + gi, G - gi), vld1q_f32(xs));
    }
    return hsum(off);
}

/* ------------------------------------------------------------------------------------
 * int8 GEMV
 * ---------------------------------------------------------------------------------- */

/* sum over one group of q * x, from element k0 */
TI float32x4_t q8_group(const int8_t *q, const float *x, int64_t k0, const int64_t g) {
    float32x4_t t = vdupq_n_f32(0);
    for (int64_t k = k0; k < k0 + g; k += 16) {
        float32x4_t w[4];
        widen_i8(q + k, w);
        for (int i = 0; i < 4; i++) t = vfmaq_f32(t, w[i], vld1q_f32(x + k + 4 * i));
    }
    return t;
}

TI void q8_gemv_row(const qmat *a, int64_t n, const int64_t g) {
    const int64_t K = a->K;
    const float *x = a->x;
    const int8_t *q = (const int8_t *)a->qw + n * K;
    float32x4_t acc[ACC];
    for (int i = 0; i < ACC; i++) acc[i] = vdupq_n_f32(0);
    if (g) {
        const int64_t G = K / g;
        const uint16_t *s = (const uint16_t *)a->scales + n * G;
        int64_t j = 0;
        for (; j + ACC <= G; j += ACC) {
            const float32x4_t d = halfs4(s + j);
            acc[0] = vfmaq_laneq_f32(acc[0], q8_group(q, x, (j + 0) * g, g), d, 0);
            acc[1] = vfmaq_laneq_f32(acc[1], q8_group(q, x, (j + 1) * g, g), d, 1);
            acc[2] = vfmaq_laneq_f32(acc[2], q8_group(q, x, (j + 2) * g, g), d, 2);
            acc[3] = vfmaq_laneq_f32(acc[3], q8_group(q, x, (j + 3) * g, g), d, 3);
        }
        for (; j < G; j++) acc[0] = vfmaq_n_f32(acc[0], q8_group(q, x, j * g, g), half_to_float(s[j]));
        a->y[n] = hsum_acc(acc);
    } else {
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            float32x4_t w[4];
            widen_i8(q + k, w);
            for (int i = 0; i < 4; i++) acc[i] = vfmaq_f32(acc[i], w[i], vld1q_f32(x + k + 4 * i));
        }
        if (k < K) { /* the last K % 16 through a zero-padded copy */
            int8_t qt[16] = {0};
            float xt[16] = {0};
            memcpy(qt, q + k, (size_t)(K - k));
            memcpy(xt, x + k, (size_t)(K - k) * sizeof *xt);
            float32x4_t w[4];
            widen_i8(qt, w);
            for (int i = 0; i < 4; i++) acc[0] = vfmaq_f32(acc[0], w[i], vld1q_f32(xt + 4 * i));
        }
        a->y[n] = hsum_acc(acc) * ((const float *)a->scales)[n];
    }
}

#define ROWS_LOOP(ROW, g)                                                                        \
    do {                                                                                         \
        for (int64_t n = n0; n < n1; n++) ROW(a, n, g);                                          \
    } while (0)

static void q8_gemv(const qmat *a, int64_t n0, int64_t n1) {
    switch (a->g) {
    case 32: ROWS_LOOP(q8_gemv_row, 32); break;
    case 64: ROWS_LOOP(q8_gemv_row, 64); break;
    case 128: ROWS_LOOP(q8_gemv_row, 128); break;
    default: ROWS_LOOP(q8_gemv_row, 0); break;
    }
}

/* ------------------------------------------------------------------------------------
 * int4 GEMV, float
 * ---------------------------------------------------------------------------------- */

TI float32x4_t q4_group(const uint8_t *q, const float *x, int64_t k0, const int64_t g) {
    float32x4_t t = vdupq_n_f32(0);
    for (int64_t k = k0; k < k0 + g; k += 32) {
        int32x4_t c[8];
        widen_i4(q + k / 2, c);
        for (int i = 0; i < 8; i++) t = vfmaq_f32(t, vcvtq_f32_s32(c[i]), vld1q_f32(x + k + 4 * i));
    }
    return t;
}

TI void q4_gemv_row(const qmat *a, int64_t n, const int64_t g) {
    const int64_t K = a->K, G = K / g;
    const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2);
    const uint16_t *s = (const uint16_t *)a->scales + n * G;
    float32x4_t acc[ACC];
    for (int i = 0; i < ACC; i++) acc[i] = vdupq_n_f32(0);
    int64_t j = 0;
    for (; j + ACC <= G; j += ACC) {
        const float32x4_t d = halfs4(s + j);
        acc[0] = vfmaq_laneq_f32(acc[0], q4_group(q, a->x, (j + 0) * g, g), d, 0);
        acc[1] = vfmaq_laneq_f32(acc[1], q4_group(q, a->x, (j + 1) * g, g), d, 1);
        acc[2] = vfmaq_laneq_f32(acc[2], q4_group(q, a->x, (j + 2) * g, g), d, 2);
        acc[3] = vfmaq_laneq_f32(acc[3], q4_group(q, a->x, (j + 3) * g, g), d, 3);
    }
    for (; j < G; j++) acc[0] = vfmaq_n_f32(acc[0], q4_group(q, a->x, j * g, g), half_to_float(s[j]));
    a->y[n] = hsum_acc(acc) + group_offset(a->mins ? a->mins + n * G : s, G, a->xsum);
}

static void q4_gemv(const qmat *a, int64_t n0, int64_t n1) {
    switch (a->g) {
    case 32: ROWS_LOOP(q4_gemv_row, 32); break;
    case 64: ROWS_LOOP(q4_gemv_row, 64); break;
    default: ROWS_LOOP(q4_gemv_row, 128); break;
    }
}

/* ------------------------------------------------------------------------------------
 * int4 GEMV on x as int8 digits (neondot)
 *
 * One chunk = one block of 32 elements = 16 bytes of a row; its digits are stored as
 * [digit 1, 0][low, high][16 bytes] (low: elements 0..15, high: 16..31), 64 bytes,
 * and after all chunks one scale per block; at the buffer's end each block's sx * sum X
 * (kernels.h, xprep4_xs). X as the integer GEMM's and the x86 paths' (avx512.c).
 * ---------------------------------------------------------------------------------- */

enum { CHUNK = 32, CHUNK_BYTES = 2 * 2 * 16 };

/* 16 int32 digits (4 vectors) -> 16 bytes (they fit int8: no saturation) */
TI int8x16_t narrow16(const int32x4_t v[4]) {
    int16x8_t a = vcombine_s16(vmovn_s32(v[0]), vmovn_s32(v[1]));
    int16x8_t b = vcombine_s16(vmovn_s32(v[2]), vmovn_s32(v[3]));
    return vcombine_s8(vmovn_s16(a), vmovn_s16(b));
}

static int q4_xprep(const float *x, int64_t K, void *buf) {
    const int64_t C = K / CHUNK; /* int4 rows are whole blocks */
    int8_t *xd = buf;
    float *scale = (float *)(xd + C * CHUNK_BYTES);
    for (int64_t c = 0; c < C; c++) {
        int32x4_t hi[8], lo[8];
        int32_t sum;
        const float amax = neon_block_digits(x + c * CHUNK, hi, lo, &sum);
        if (amax < 0) return -1; /* inf or NaN */
        int8_t *out = xd + c * CHUNK_BYTES;
        vst1q_s8(out, narrow16(hi));          /* elements 0..15 */
        vst1q_s8(out + 16, narrow16(hi + 4)); /* elements 16..31 */
        vst1q_s8(out + 32, narrow16(lo));
        vst1q_s8(out + 48, narrow16(lo + 4));
        scale[c] = amax / IG_XMAX;
        xprep4_xs(buf, K)[c] = scale[c] * (float)sum;
    }
    return 0;
}

int neon_q4_xprep(const float *x, int64_t K, void *buf) { return q4_xprep(x, K, buf); }

/* sum over block c of q * X, per lane */
TI int32x4_t q4_chunk(const uint8_t *q, const int8_t *xd, int64_t c, const int dot) {
    const int8_t *xc = xd + c * CHUNK_BYTES;
    uint8x16_t w = vld1q_u8(q + 16 * c);
    int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(w, vdupq_n_u8(15)));
    int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(w, 4));
    return neon_dot32(lo, hi, xc, dot);
}

TARGET_DOT TI void q4_digits_row(const qmat *a, int64_t n, const int64_t g) {
    const int64_t K = a->K, G = K / g, C = K / CHUNK, bpg = g / CHUNK; /* blocks per group */
    const int8_t *xd = a->xq;
    const float *scale = (const float *)(xd + C * CHUNK_BYTES);
    const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2);
    const uint16_t *s = (const uint16_t *)a->scales + n * G;
    float32x4_t acc[ACC];
    for (int i = 0; i < ACC; i++) acc[i] = vdupq_n_f32(0);
    /* blocks in turn to ACC accumulators, the last C % ACC to the first */
    int64_t c = 0;
    for (; c + ACC <= C; c += ACC)
        for (int u = 0; u < ACC; u++) {
            const float d = half_to_float(s[(c + u) / bpg]) * scale[c + u];
            acc[u] = vfmaq_n_f32(acc[u], vcvtq_f32_s32(q4_chunk(q, xd, c + u, 1)), d);
        }
    for (; c < C; c++)
        acc[0] = vfmaq_n_f32(acc[0], vcvtq_f32_s32(q4_chunk(q, xd, c, 1)), half_to_float(s[c / bpg]) * scale[c]);
    a->y[n] = hsum_acc(acc) +
              group_offset((a->mins ? a->mins : (const uint16_t *)a->scales) + n * G, G, a->xsum);
}

/* int5: block c's codes, int4's nibbles ORed with 16 where the block's qh bit (a
 * little-endian uint32 per 32) is set, times X per lane as q4_chunk */
TI int32x4_t q5_chunk(const uint8_t *q, const uint8_t *qh, const int8_t *xd, int64_t c,
                     const int dot) {
    static const uint8_t bits[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    static const uint8_t lo_idx[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
    const int8_t *xc = xd + c * CHUNK_BYTES;
    const uint8x16_t w = vld1q_u8(q + 16 * c), b = vld1q_u8(bits), sixteen = vdupq_n_u8(16);
    uint32_t hb;
    memcpy(&hb, qh + 4 * c, 4);
    const uint8x16_t h = vreinterpretq_u8_u32(vdupq_n_u32(hb)), idx = vld1q_u8(lo_idx);
    const uint8x16_t h0 = vqtbl1q_u8(h, idx), h1 = vqtbl1q_u8(h, vaddq_u8(idx, vdupq_n_u8(2)));
    const int8x16_t lo = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(w, vdupq_n_u8(15)), vandq_u8(vtstq_u8(h0, b), sixteen)));
    const int8x16_t hi = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(w, 4), vandq_u8(vtstq_u8(h1, b), sixteen)));
    return neon_dot32(lo, hi, xc, dot);
}

/* int5 (g = 32): as q4_digits_row, the codes from q5_chunk; the -16 d (or mins) term from
 * x's group sums (xsum). neon and neondot (below) alike. */
TI void q5_digits_rows(const qmat *a, int64_t n0, int64_t n1, const int dot) {
    const int64_t K = a->K, C = K / CHUNK;
    const int8_t *xd = a->xq;
    const float *scale = (const float *)(xd + C * CHUNK_BYTES);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2), *qh = a->qh + n * (K / 8);
        const uint16_t *s = (const uint16_t *)a->scales + n * C;
        float32x4_t acc[ACC];
        for (int i = 0; i < ACC; i++) acc[i] = vdupq_n_f32(0);
        for (int64_t c = 0; c < C; c++)
            acc[c % ACC] = vfmaq_n_f32(acc[c % ACC], vcvtq_f32_s32(q5_chunk(q, qh, xd, c, dot)),
                                       half_to_float(s[c]) * scale[c]);
        a->y[n] = hsum_acc(acc) + group_offset((a->mins ? a->mins : (const uint16_t *)a->scales) + n * C, C, a->xsum);
    }
}

static void q5_gemv_digits_neon(const qmat *a, int64_t n0, int64_t n1) { q5_digits_rows(a, n0, n1, 0); }
TARGET_DOT static void q5_gemv_digits_dot(const qmat *a, int64_t n0, int64_t n1) {
    q5_digits_rows(a, n0, n1, 1);
}

TARGET_DOT static void q4_gemv_digits(const qmat *a, int64_t n0, int64_t n1) {
    switch (a->g) {
    case 32: ROWS_LOOP(q4_digits_row, 32); break;
    case 64: ROWS_LOOP(q4_digits_row, 64); break;
    default: ROWS_LOOP(q4_digits_row, 128); break;
    }
}

/* int6 (GGUF Q6_K's blocks) on x as int4's digits: per group of 16 (a half block of x)
 * d sc sx (sum q X) by two sdot per digit pair, plus the group's term d sc (-32 sx sum X)
 * (xsum, q6_xsum). Codes q (0..63) per sub-block s = 4 h + j of 32: ql's nibbles (low for
 * j < 2) and qh's bits 2j, 2j + 1 (kernels.h, int6). */
static void q6_xsum(const void *xq, int64_t K, float *xsum) {
    const int8_t *xd = xq;
    const float *sx = (const float *)(xd + K / CHUNK * CHUNK_BYTES);
    for (int64_t g = 0; g < K / 16; g++) { /* chunk g / 2, elements 16 (g % 2) .. + 15 */
        const int8_t *c = xd + (g / 2) * CHUNK_BYTES + 16 * (g % 2);
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += 256 * c[i] + c[32 + i];
        xsum[g] = -32.0f * sx[g / 2] * (float)t;
    }
}

TI void q6_digits_row(const qmat *a, int64_t n, const int dot) {
    const int64_t K = a->K, B = K / Q6_BLOCK, C = K / CHUNK;
    const int8_t *xd = a->xq;
    const float *sx = (const float *)(xd + C * CHUNK_BYTES);
    const uint8_t *blk = (const uint8_t *)a->qw + n * B * Q6_BLOCK_BYTES;
    float32x4_t acc[ACC];
    for (int i = 0; i < ACC; i++) acc[i] = vdupq_n_f32(0);
    float groups = 0;
    const uint8x16_t m4 = vdupq_n_u8(15), m2 = vdupq_n_u8(3);
    for (int64_t b = 0; b < B; b++, blk += Q6_BLOCK_BYTES) {
        const float d = half_to_float((uint16_t)(blk[208] | blk[209] << 8));
        const int8_t *sc = (const int8_t *)blk + 192;
        for (int s = 0; s < 8; s++) {
            const int h = s / 4, j = s % 4;
            const uint8_t *ql = blk + 64 * h + 32 * (j & 1), *qh = blk + 128 + 32 * h;
            const int8x16_t down = vdupq_n_s8((int8_t)(-2 * j));
            int8x16_t q[2];
            for (int e = 0; e < 2; e++) { /* elements 16 e .. 16 e + 15 */
                const uint8x16_t l = vld1q_u8(ql + 16 * e);
                const uint8x16_t nib = j < 2 ? vandq_u8(l, m4) : vshrq_n_u8(l, 4);
                const uint8x16_t hb = vandq_u8(vshlq_u8(vld1q_u8(qh + 16 * e), down), m2);
                q[e] = vreinterpretq_s8_u8(vorrq_u8(nib, vshlq_n_u8(hb, 4)));
            }
            const int64_t c = 8 * b + s;
            const int8_t *xc = xd + c * CHUNK_BYTES;
            for (int e = 0; e < 2; e++) {
                const int32x4_t t = neon_dot16(q[e], xc, e, dot);
                const float ds = d * (float)sc[2 * s + e];
                acc[(2 * s + e) % ACC] = vfmaq_n_f32(acc[(2 * s + e) % ACC], vcvtq_f32_s32(t), ds * sx[c]);
                groups += ds * a->xsum[16 * b + 2 * s + e];
            }
        }
    }
    a->y[n] = hsum_acc(acc) + groups;
}

static void q6_gemv_digits_neon(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) q6_digits_row(a, n, 0);
}
TARGET_DOT static void q6_gemv_digits_dot(const qmat *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) q6_digits_row(a, n, 1);
}

/* ------------------------------------------------------------------------------------
 * Dequantization for the GEMM (the formats' definitions: no FMA)
 * ---------------------------------------------------------------------------------- */

static void q8_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, g = a->g;
    for (int64_t n = n0; n < n1; n++, w += K) {
        const int8_t *q = (const int8_t *)a->qw + n * K;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            const float d = g ? half_to_float(((const uint16_t *)a->scales)[n * (K / g) + k / g])
                              : ((const float *)a->scales)[n];
            float32x4_t v[4];
            widen_i8(q + k, v);
            for (int i = 0; i < 4; i++) vst1q_f32(w + k + 4 * i, vmulq_n_f32(v[i], d));
        }
        for (; k < K; k++) w[k] = (float)q[k] * ((const float *)a->scales)[n]; /* g == 0 only */
    }
}

static void q4_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, g = a->g, G = K / g;
    for (int64_t n = n0; n < n1; n++, w += K) {
        const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2);
        for (int64_t k = 0; k < K; k += 32) {
            const float32x4_t d = vdupq_n_f32(half_to_float(((const uint16_t *)a->scales)[n * G + k / g]));
            int32x4_t c[8];
            widen_i4(q + k / 2, c);
            if (a->mins) { /* q * d + m */
                const float32x4_t m = vdupq_n_f32(half_to_float(a->mins[n * G + k / g]));
                for (int i = 0; i < 8; i++)
                    vst1q_f32(w + k + 4 * i, vaddq_f32(vmulq_f32(vcvtq_f32_s32(c[i]), d), m));
            } else { /* (q - 8) * d */
                for (int i = 0; i < 8; i++)
                    vst1q_f32(w + k + 4 * i, vmulq_f32(vcvtq_f32_s32(vsubq_s32(c[i], vdupq_n_s32(8))), d));
            }
        }
    }
}

/* ------------------------------------------------------------------------------------
 * Float tile
 * ---------------------------------------------------------------------------------- */

TI void tile_block(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                   int64_t K, int accumulate, const int MR, const int NR) {
    float32x4_t c[4][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) c[i][j] = vdupq_n_f32(0);
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        float32x4_t xv[4];
        for (int i = 0; i < MR; i++) xv[i] = vld1q_f32(x + i * ldx + k);
        for (int j = 0; j < NR; j++) {
            float32x4_t wv = vld1q_f32(w + j * ldw + k);
            for (int i = 0; i < MR; i++) c[i][j] = vfmaq_f32(c[i][j], xv[i], wv);
        }
    }
    if (k < K) { /* the last K % 4 through zero-padded copies */
        float xt[4][4] = {{0}}, wt[4][4] = {{0}};
        for (int i = 0; i < MR; i++) memcpy(xt[i], x + i * ldx + k, (size_t)(K - k) * sizeof(float));
        for (int j = 0; j < NR; j++) memcpy(wt[j], w + j * ldw + k, (size_t)(K - k) * sizeof(float));
        for (int j = 0; j < NR; j++)
            for (int i = 0; i < MR; i++) c[i][j] = vfmaq_f32(c[i][j], vld1q_f32(xt[i]), vld1q_f32(wt[j]));
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

static void tile(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
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

/* int4 on neon keeps its float GEMV (widened codes) */
const kernel_table kernels_neon = {
    q8_gemv, q4_gemv, NULL, NULL, q8_dequant, q4_dequant, tile,
    .q6_xprep = q4_xprep, .q6_gemv_digits = q6_gemv_digits_neon, .q6_xsum = q6_xsum, .q6_xblock = 32,
    .q5_xprep = q4_xprep, .q5_gemv_digits = q5_gemv_digits_neon, .sb_path = SB_NEON,
};
const kernel_table kernels_neon_dot = {
    q8_gemv, q4_gemv, q4_xprep, q4_gemv_digits, q8_dequant, q4_dequant, tile,
    .q6_xprep = q4_xprep, .q6_gemv_digits = q6_gemv_digits_dot, .q6_xsum = q6_xsum, .q6_xblock = 32,
    .q5_xprep = q4_xprep, .q5_gemv_digits = q5_gemv_digits_dot, .sb_path = SB_NEON_DOT,
    .ig_xprep = neon_ig_xprep, .ig_panel = neon_ig_panel,
    .ig_kinds = IG_KIND(4) | IG_KIND(5) | IG_KIND(6) | IG_KIND(8) | IG_KIND(Q4K) | IG_KIND(Q5K) |
                IG_KIND(Q3K) | IG_KIND(Q2K) | IG_KIND(IQ4XS),
};

#endif
