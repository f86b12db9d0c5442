/* The integer GEMM (prefill) on neondot: x's digits by ig_xprep, and the panel kernel on
 * sdot by element.
 *
 * x's digits and W's panel are igemm.c's layouts (kernels.h): per group of 4 elements a
 * q-register holds 4 rows' 4 digits (row l in lane l), so one sdot by element multiplies
 * them by a weight row's 4 codes (one lane of its codes' vector) into those 4 rows' sums.
 * A block's sum is 256 times the high digits' plus the low ones' (the high digits' sums
 * shifted by 8 before the low ones join them), exact in int32 as on x86.
 * sdot is signed: codes up to 63 go as they are, and those up to 255 (int8, q3_k,
 * iq4_xs: c = v + 128) as v, their sign bit flipped, which subtracts 128 sum X, the
 * offset term igemm.c's formula takes off (so it is not taken again).
 *
 * Registers: 8 rows of x (2 quads) by NR = 4 rows of W: 8 int32 sums, 8 float results, 8
 * code vectors and 2 of digits. Each output element is computed in one order, whatever
 * the thread count. Checked under qemu (tests/native/q_neon_check.c), not timed here.
 */
#include "kernels.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <string.h>

#define TD TARGET_DOT static inline __attribute__((always_inline))

/* x's tile t as digits (kernels.h's layout), X as every path rounds it
 * (neon_block_digits); -1 if the rows have inf or NaN. */
int neon_ig_xprep(const float *x, int64_t K, int64_t t, int o, const ig_x *d) {
    const int64_t Kp = d->Kp, B = Kp / 32;
    int8_t *dt = d->digits + t * B * 8 * 256;
    const int64_t rows = d->M - t * IG_MR < IG_MR ? d->M - t * IG_MR : IG_MR;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + (t * IG_MR + r) * K;
        int8_t *dr = dt + (r / 16) * 64 + (r % 16) * 4; /* row r's lane in each group */
        for (int64_t b = 0; b < B; b++) {
            float xb[32] = {0};
            const int64_t n = K - 32 * b < 32 ? K - 32 * b : 32;
            memcpy(xb, xr + 32 * b, (size_t)n * sizeof(float));
            int32x4_t hi[8], lo[8];
            int32_t sum;
            const float amax = neon_block_digits(xb, hi, lo, &sum);
            if (amax < 0) return -1; /* inf or NaN */
            int8_t *db = dr + b * 8 * 256;
            for (int j = 0; j < 8; j++) { /* group j: elements 4j..4j+3, row r's lane */
                int32_t h[4], l[4];
                vst1q_s32(h, hi[j]);
                vst1q_s32(l, lo[j]);
                for (int e = 0; e < 4; e++) {
                    db[256 * j + e] = (int8_t)h[e];
                    db[256 * j + 128 + e] = (int8_t)l[e];
                }
            }
            ig_terms(d, (t * B + b) * IG_MR + r, amax, sum, o);
        }
    }
    return 0;
}

/* acc + the 4 rows' digits x times lane `lane` of codes c (4 codes), per row */
TD int32x4_t dot_lane(int32x4_t acc, int8x16_t x, int8x16_t c, const int lane) {
    switch (lane) {
    case 0: return vdotq_laneq_s32(acc, x, c, 0);
    case 1: return vdotq_laneq_s32(acc, x, c, 1);
    case 2: return vdotq_laneq_s32(acc, x, c, 2);
    default: return vdotq_laneq_s32(acc, x, c, 3);
    }
}

/* Groups [J0, J1) of a block: s[n][q] = 256 sum(c hi) + sum(c lo) for row quad q */
TD void sums(const int8_t *xd, const int8x16_t c[4][2], int32x4_t s[4][2], const int NR,
             const int J0, const int J1) {
    for (int n = 0; n < NR; n++) s[n][0] = s[n][1] = vdupq_n_s32(0);
    for (int digit = 0; digit < 2; digit++) { /* high, then low */
        if (digit)
            for (int n = 0; n < NR; n++) s[n][0] = vshlq_n_s32(s[n][0], 8), s[n][1] = vshlq_n_s32(s[n][1], 8);
#pragma GCC unroll 8
        for (int j = J0; j < J1; j++) {
            const int8x16_t x0 = vld1q_s8(xd + 256 * j + 128 * digit), x1 = vld1q_s8(xd + 256 * j + 128 * digit + 16);
            for (int n = 0; n < NR; n++) {
                s[n][0] = dot_lane(s[n][0], x0, c[n][j / 4], j % 4);
                s[n][1] = dot_lane(s[n][1], x1, c[n][j / 4], j % 4);
            }
        }
    }
}

/* f += (s - off) sx d (+ xs m) for the 8 rows at i: off and xs at i (off_lo and xs_lo, or
 * off and xs less them, for a half block: `lo` 1 or 2); no off where the codes flipped. */
TD void scale(const ig_x *x, int64_t i, const int32x4_t s[4][2], const int lo, const float *d,
              int64_t stride, const float *mins, const int flip, float32x4_t f[4][2], const int NR) {
    for (int q = 0; q < 2; q++) {
        const int64_t iq = i + 4 * q;
        int32x4_t o = vdupq_n_s32(0);
        float32x4_t xs = vdupq_n_f32(0);
        if (mins) {
            xs = vld1q_f32((lo == 1 ? x->xs_lo : x->xs) + iq);
            if (lo == 2) xs = vsubq_f32(xs, vld1q_f32(x->xs_lo + iq));
        } else if (!flip) {
            o = vld1q_s32((lo == 1 ? x->off_lo : x->off) + iq);
            if (lo == 2) o = vsubq_s32(o, vld1q_s32(x->off_lo + iq));
        }
        const float32x4_t sx = vld1q_f32(x->sx + iq);
        for (int n = 0; n < NR; n++) {
            const float32x4_t a = vcvtq_f32_s32(vsubq_s32(s[n][q], o));
            f[n][q] = vfmaq_f32(f[n][q], a, vmulq_n_f32(sx, d[n * stride]));
            if (mins) f[n][q] = vfmaq_n_f32(f[n][q], xs, mins[n * stride]);
        }
    }
}

/* y for rows [32 t + 8 u, + 8) of x and NR rows of W; H 2: a d (and m) per 16 */
TD void rows8(const ig_x *x, int64_t t, int u, const uint8_t *w, const float *d, const float *mins,
              float *y, int64_t ldy, const int NR, const int H) {
    const int64_t Kp = x->Kp, B = Kp / 32;
    const int flip = x->cmax > 127;
    const int8_t *xd = x->digits + t * B * 8 * 256 + 32 * u; /* quads 2u, 2u + 1 */
    const uint8x16_t sign = vdupq_n_u8(flip ? 0x80 : 0);
    float32x4_t f[4][2];
    for (int n = 0; n < NR; n++) f[n][0] = f[n][1] = vdupq_n_f32(0);
    for (int64_t b = 0; b < B; b++, xd += 8 * 256) {
        int8x16_t c[4][2];
        for (int n = 0; n < NR; n++)
            for (int h = 0; h < 2; h++)
                c[n][h] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w + n * Kp + 32 * b + 16 * h), sign));
        const int64_t i = (t * B + b) * IG_MR + 8 * u;
        int32x4_t s[4][2];
        if (H == 1) {
            sums(xd, c, s, NR, 0, 8);
            scale(x, i, s, 0, d + b, B, mins ? mins + b : NULL, flip, f, NR);
        } else {
            sums(xd, c, s, NR, 0, 4);
            scale(x, i, s, 1, d + 2 * b, 2 * B, mins ? mins + 2 * b : NULL, flip, f, NR);
            sums(xd, c, s, NR, 4, 8);
            scale(x, i, s, 2, d + 2 * b + 1, 2 * B, mins ? mins + 2 * b + 1 : NULL, flip, f, NR);
        }
    }
    const int64_t row0 = t * IG_MR + 8 * u, rows = x->M - row0 < 8 ? x->M - row0 : 8;
    float out[4][8];
    for (int n = 0; n < NR; n++) vst1q_f32(out[n], f[n][0]), vst1q_f32(out[n] + 4, f[n][1]);
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < NR; n++) y[(row0 + r) * ldy + n] = out[n][r];
}

#define IG_CASE(NR_, H_)                                                                         \
    case NR_:                                                                                    \
        rows8(x, t, u, w + n * Kp, d + n * B * H_, m ? m + n * B * H_ : NULL, y + n, ldy, NR_, H_); \
        break;

TD void panel(const ig_x *x, const uint8_t *w, const float *d, const float *m, float *y, int64_t ldy,
              int64_t nb, const int H) {
    const int64_t Kp = x->Kp, B = Kp / 32;
    for (int64_t t = 0; t * IG_MR < x->M; t++)
        for (int u = 0; u < 4 && t * IG_MR + 8 * u < x->M; u++)
            for (int64_t n = 0; n < nb; n += 4) {
                const int nr = nb - n < 4 ? (int)(nb - n) : 4;
                switch (nr) { IG_CASE(4, H) IG_CASE(3, H) IG_CASE(2, H) IG_CASE(1, H) }
            }
}

TARGET_DOT void neon_ig_panel(const ig_x *x, const uint8_t *w, const float *d, const float *m, float *y,
                              int64_t ldy, int64_t nb) {
    if (x->off_lo)
        panel(x, w, d, m, y, ldy, nb, 2);
    else
        panel(x, w, d, m, y, ldy, nb, 1);
}

#endif
