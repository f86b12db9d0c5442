/* The LUT kernel's scalar path: the tables for one activation row, and the portable
   row loop every SIMD path falls back to for its tail (lut.c dispatches). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lut_common.h"

/* ------------------------------------------------------------------------------------ */
/* Scalar path                                                                            */
/* ------------------------------------------------------------------------------------ */

/* Tables and per-group constants for one activation row (canonical float order).
   tables: tables_bytes(K) int8; c1, c2, asum: K/g floats each. */
void lut_build_tables(const float *x, int64_t K, int g, int bits, int8_t *tables, float *c1,
                         float *c2, float *asum) {
    const int64_t ngroups = K / g, tpg = g / 4; /* tables per group */
    const float half_levels = 0.5f * (float)((1 << bits) - 1);
    memset(tables + K / 64 * 256, 0, tables_bytes(K) - K / 64 * 256); /* past K */
    for (int64_t G = 0; G < ngroups; G++) {
        float amax = 0.0f, A = 0.0f;
        for (int64_t jj = 0; jj < tpg; jj++) {
            const float *a = x + 4 * (G * tpg + jj);
            float sa = ((fabsf(a[0]) + fabsf(a[1])) + fabsf(a[2])) + fabsf(a[3]);
            amax = sa > amax ? sa : amax;
            A += ((a[0] + a[1]) + a[2]) + a[3];
        }
        const float inv = amax >= AMAX_MIN ? 127.0f / amax : 0.0f;
        c1[G] = (amax / 127.0f) * 0.5f;
        c2[G] = half_levels * A;
        asum[G] = A;
        for (int64_t jj = 0; jj < tpg; jj++) {
            const int64_t j = G * tpg + jj;
            const float *a = x + 4 * j;
            /* idx bit i set -> +a_i, clear -> -a_i; idx 0..7 have bit 3 clear: -a3 */
            const float p01[4] = {-a[0] - a[1], a[0] - a[1], -a[0] + a[1], a[0] + a[1]};
            int8_t *t = tables + (j / 16) * 256 + (j & 1) * 128 + ((j % 16) / 2) * 16;
            for (int idx = 0; idx < 8; idx++) {
                float e = (p01[idx & 3] + ((idx & 4) ? a[2] : -a[2])) - a[3];
                float r = rintf(e * inv);
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                t[idx] = (int8_t)r;
                t[15 - idx] = (int8_t)-r;
            }
        }
    }
}

/* One row's epilogue from its group integers: the canonical order. */
static float epilogue_row(const int32_t *I, int64_t Istride, const uint16_t *s,
                          const uint16_t *mn, const float *c1, const float *c2,
                          const float *asum, int64_t ngroups) {
    float acc = 0.0f;
    for (int64_t G = 0; G < ngroups; G++) {
        float u = fmaf(c1[G], (float)I[G * Istride], c2[G]);
        acc = fmaf(half_to_float(s[G]), u, acc);
        acc = fmaf(half_to_float(mn[G]), asum[G], acc);
    }
    return acc;
}

/* Scalar rows [n0, n1) for activation row m; I scratch of ngroups int32. */
void lut_rows_scalar(const lut_problem *P, int64_t m, int64_t n0, int64_t n1, int32_t *I) {
    const int64_t K = P->K, rb = K / 8, ngroups = K / P->g, tpg = P->g / 4;
    const int8_t *tab = P->tables + m * P->tables_stride;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t G = 0; G < ngroups; G++) {
            int32_t acc = 0;
            for (int p = 0; p < P->bits; p++) {
                const uint8_t *w = P->qweight + ((int64_t)p * P->N + n) * rb;
                int32_t sp = 0;
                for (int64_t j = G * tpg; j < (G + 1) * tpg; j++) {
                    int nib = (w[j / 2] >> (4 * (j & 1))) & 15;
                    sp += tab[(j / 16) * 256 + (j & 1) * 128 + ((j % 16) / 2) * 16 + nib];
                }
                acc += sp << p;
            }
            I[G] = acc;
        }
        P->y[m * P->N + n] =
            epilogue_row(I, 1, P->scales + n * ngroups, P->mins + n * ngroups, P->c1 + m * ngroups,
                         P->c2 + m * ngroups, P->asum + m * ngroups, ngroups);
    }
}
