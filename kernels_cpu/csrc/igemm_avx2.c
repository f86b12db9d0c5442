/* The integer GEMM's panel kernel on plain AVX2 (no VNNI): vpmaddubsw with int16 sums.
 *
 * x's digits and W's panel are igemm.c's layouts (kernels.h), prepared by avx2.c's
 * ig_xprep. Without vpdpbusd a product of 4 bytes is vpmaddubsw (codes times digits, int16
 * pairs) then vpmaddwd (pairs to int32): two multiply-pipe instructions per 32 products,
 * so four per 32 elements for x's two digits, what float FMAs (8 a vector) cost. Here
 * the int16 pairs are summed over whole runs of
 * groups of 4 with vpaddw and widened by one vpmaddwd per run and digit (by 256 for the
 * high digit, by 1 for the low one), so a digit costs ~1.1 multiply-pipe instructions per
 * 32 products. A pair is at most 2 * cmax * 128 (|digit| <= 128), and a word sums one pair
 * per group: int4's codes (<= 15) allow 8 groups (a block: 30720 < 32767), int5's (<= 31)
 * 4 (31744), int6's (<= 63) 2 (32256; its scale per 16 ends a sum every 4 groups anyway).
 * int8's codes (<= 255) overflow a single pair, so int8 stays on the float GEMM.
 *
 * Registers: 8 rows of x (one vector per digit) by NR rows of W, each row's 4 codes
 * broadcast to every lane: 2 NR int16 sums, NR float results, 2 digit vectors and a
 * broadcast: NR = 4 fits 15 registers. int5's int32 sums of a block's first half then
 * wait on the stack while the second half runs, still faster than NR = 3 without spills.
 */
#include "kernels.h"

#ifdef INFER_X86
#include <immintrin.h>
#include <string.h>

#define TI TARGET_AVX2 static inline __attribute__((always_inline))

TI int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* f += (s - off) sx d (+ xs m) for 8 rows of x at i: off and xs at i (off_lo and xs_lo, or
 * off and xs minus them, for a half block: `lo` 1 or 2). */
TI void ig_scale8(const ig_x *x, int64_t i, const __m256i s[4], const int lo, const float *d,
                  int64_t stride, const float *mins, __m256 f[4], const int NR) {
    __m256i o = _mm256_setzero_si256(); /* the codes' offset term: none with mins (o = 0) */
    __m256 xs = _mm256_setzero_ps();
    if (mins) {
        xs = _mm256_load_ps(lo == 1 ? x->xs_lo + i : x->xs + i);
        if (lo == 2) xs = _mm256_sub_ps(xs, _mm256_load_ps(x->xs_lo + i));
    } else {
        o = _mm256_load_si256((const __m256i *)(lo == 1 ? x->off_lo + i : x->off + i));
        if (lo == 2) o = _mm256_sub_epi32(o, _mm256_load_si256((const __m256i *)(x->off_lo + i)));
    }
    const __m256 sx = _mm256_load_ps(x->sx + i);
    for (int n = 0; n < NR; n++) {
        const __m256 a = _mm256_cvtepi32_ps(mins ? s[n] : _mm256_sub_epi32(s[n], o));
        f[n] = _mm256_fmadd_ps(a, _mm256_mul_ps(sx, _mm256_set1_ps(d[n * stride])), f[n]);
        if (mins) f[n] = _mm256_fmadd_ps(xs, _mm256_set1_ps(mins[n * stride]), f[n]);
    }
}

/* y for rows [32 t + 8 u, + 8) of x and NR rows of W; RUN groups of 4 summed in int16; H
 * 2: a d (and m) per 16 (int6, q2_k), each half of a block scaled apart. */
TI void ig_block8(const ig_x *x, int64_t t, int u, const uint8_t *w, const float *d,
                  const float *mins, float *y, int64_t ldy, const int NR, const int RUN, const int H) {
    const int64_t Kp = x->Kp, B = Kp / 32;
    const int8_t *xd = x->digits + t * B * 8 * 256 + 32 * u;
    const __m256i by256 = _mm256_set1_epi16(256), by1 = _mm256_set1_epi16(1);
    __m256 f[4];
    for (int n = 0; n < NR; n++) f[n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++, xd += 8 * 256) {
        __m256i s[4]; /* int32: 256 sum(c hi) + sum(c lo) over the block */
        for (int r0 = 0; r0 < 8; r0 += RUN) {
            __m256i sh[4], sl[4];
#pragma GCC unroll 8
            for (int j = r0; j < r0 + RUN; j++) {
                const __m256i xh = _mm256_load_si256((const __m256i *)(xd + j * 256));
                const __m256i xl = _mm256_load_si256((const __m256i *)(xd + j * 256 + 128));
                for (int n = 0; n < NR; n++) {
                    const __m256i c = _mm256_set1_epi32(load_i32(w + n * Kp + 32 * b + 4 * j));
                    const __m256i ph = _mm256_maddubs_epi16(c, xh);
                    const __m256i pl = _mm256_maddubs_epi16(c, xl);
                    sh[n] = j == r0 ? ph : _mm256_add_epi16(sh[n], ph);
                    sl[n] = j == r0 ? pl : _mm256_add_epi16(sl[n], pl);
                    /* keep the sums in order: reassociated into trees they spill */
                    __asm__("" : "+x"(sh[n]), "+x"(sl[n]));
                }
            }
            for (int n = 0; n < NR; n++) {
                const __m256i v = _mm256_add_epi32(_mm256_madd_epi16(sh[n], by256),
                                                   _mm256_madd_epi16(sl[n], by1));
                s[n] = r0 % (8 / H) ? _mm256_add_epi32(s[n], v) : v;
            }
            if (H == 2 && r0 + RUN == 4) /* elements 0..15 */
                ig_scale8(x, (t * B + b) * IG_MR + 8 * u, s, 1, d + 2 * b, 2 * B,
                          mins ? mins + 2 * b : NULL, f, NR);
        }
        const int64_t i = (t * B + b) * IG_MR + 8 * u;
        if (H == 1)
            ig_scale8(x, i, s, 0, d + b, B, mins ? mins + b : NULL, f, NR);
        else /* elements 16..31 */
            ig_scale8(x, i, s, 2, d + 2 * b + 1, 2 * B, mins ? mins + 2 * b + 1 : NULL, f, NR);
    }
    const int64_t row0 = t * IG_MR + 8 * u, rows = x->M - row0 < 8 ? x->M - row0 : 8;
    float out[4][8];
    for (int n = 0; n < NR; n++) _mm256_storeu_ps(out[n], f[n]);
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < NR; n++) y[(row0 + r) * ldy + n] = out[n][r];
}

#define IG_CASE(NR_, RUN_, H_)                                                                   \
    case NR_:                                                                                    \
        ig_block8(x, t, u, w + n * Kp, d + n * B * H_, m ? m + n * B * H_ : NULL, y + n, ldy, NR_, RUN_, H_); \
        break;

/* Codes of at most 15 (int4, q4_k) sum a whole block in int16, up to 31 (int5, q5_k) half;
 * the kinds with a d per 16 (int6, codes up to 63; q2_k) a quarter. */
TI void ig_panel_run(const ig_x *x, const uint8_t *w, const float *d, const float *m, float *y,
                     int64_t ldy, int64_t nb, const int RUN, const int H) {
    const int64_t Kp = x->Kp, B = Kp / 32;
    for (int64_t t = 0; t * IG_MR < x->M; t++)
        for (int u = 0; u < 4 && t * IG_MR + 8 * u < x->M; u++)
            for (int64_t n = 0; n < nb; n += 4) {
                const int nr = nb - n < 4 ? (int)(nb - n) : 4;
                switch (nr) { IG_CASE(4, RUN, H) IG_CASE(3, RUN, H) IG_CASE(2, RUN, H) IG_CASE(1, RUN, H) }
            }
}

TARGET_AVX2 __attribute__((noinline)) static void ig_panel_halves(const ig_x *x, const uint8_t *w,
                                                                   const float *d, const float *m,
                                                                   float *y, int64_t ldy, int64_t nb) {
    ig_panel_run(x, w, d, m, y, ldy, nb, 2, 2);
}

TARGET_AVX2 void avx2_ig_panel(const ig_x *x, const uint8_t *w, const float *d, const float *m,
                               float *y, int64_t ldy, int64_t nb) {
    if (x->off_lo)
        ig_panel_halves(x, w, d, m, y, ldy, nb);
    else if (x->cmax > 15)
        ig_panel_run(x, w, d, m, y, ldy, nb, 4, 1);
    else
        ig_panel_run(x, w, d, m, y, ldy, nb, 8, 1);
}

#endif
