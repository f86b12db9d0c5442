/* The LUT GEMM's NEON path (lut.c), for neon and neondot. Needs g % 32 == 0 (its table
   builder g % 16 == 0).

   The AVX2 path in 128 bits: 16 weight rows at a time, a 16x16 byte transpose
   (trn1/trn2) puts byte j of 16 rows in a register, looked up with tbl (vqtbl1q_s8, one
   table per register); int16 sums per unit, int32 per group. neondot runs it too: with
   rows in lanes, sdot would sum 4 rows' lookups, so it has nothing to add here. Tables:
   4 at a time, mirrored with one tbl of 4 registers each. The same integers and float
   order as the scalar path, so the same bits. */
#include <string.h>

#include "lut_common.h"

#if defined(__aarch64__)
#include <arm_neon.h>

/* ------------------------------------------------------------------------------------ */
/* NEON: 16 rows x 16 bytes per plane, byte-transposed, tbl                               */
/* ------------------------------------------------------------------------------------ */


/* lut_build_tables, 4 tables (16 activations) at a time, lanes = tables: the same operations
   per lane as the scalar code, so the same bits (vcvtnq rounds to nearest even, as rintf
   in the default mode; maxnm ignores a NaN as the scalar compare does). Needs g % 16 == 0. */
void lut_build_tables_neon(const float *x, int64_t K, int g, int bits, int8_t *tables,
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

void lut_rows_neon(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
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
        for (int64_t m = m0; m < m1; m++) lut_rows_scalar(P, m, n, n1, S->I);
}
#endif /* __aarch64__ */
