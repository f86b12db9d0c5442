/* Portable path: plain C11, any CPU. Dot products keep 8 partial sums (element k goes to
 * sum k % 8), which breaks the add-latency chain and lets compilers use whatever
 * vector unit the baseline target has, without reassociating anything. */
#include "kernels.h"

enum { L = 8 };

/* Sum of L partial sums, pairing (i, i + 4), (i, i + 2), (i, i + 1). */
static float hsum(const float *p) {
    float a0 = p[0] + p[4], a1 = p[1] + p[5], a2 = p[2] + p[6], a3 = p[3] + p[7];
    return (a0 + a2) + (a1 + a3);
}

/* ---------------------------------------------------------------------------------- */

static void q8_gemv(const qmat *a, int64_t n0, int64_t n1) {
    const int64_t K = a->K, g = a->g;
    const float *x = a->x;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *q = (const int8_t *)a->qw + n * K;
        float acc[L] = {0};
        if (g) {
            const uint16_t *s = (const uint16_t *)a->scales + n * (K / g);
            for (int64_t k0 = 0; k0 < K; k0 += g) {
                float t[L] = {0};
                for (int64_t k = k0; k < k0 + g; k += L)
                    for (int i = 0; i < L; i++) t[i] += (float)q[k + i] * x[k + i];
                const float d = half_to_float(s[k0 / g]);
                for (int i = 0; i < L; i++) acc[i] += t[i] * d;
            }
            a->y[n] = hsum(acc);
        } else {
            for (int64_t k = 0; k < K; k++) acc[k % L] += (float)q[k] * x[k];
            a->y[n] = hsum(acc) * ((const float *)a->scales)[n];
        }
    }
}

static void q4_gemv(const qmat *a, int64_t n0, int64_t n1) {
    const int64_t K = a->K, g = a->g, G = K / g;
    const float *x = a->x;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2);
        const uint16_t *s = (const uint16_t *)a->scales + n * G;
        const uint16_t *c = a->mins ? a->mins + n * G : s; /* times xsum */
        float acc[L] = {0}, off[L] = {0};
        for (int64_t gi = 0; gi < G; gi++) {
            float t[L] = {0};
            for (int64_t k = gi * g; k < gi * g + g; k += 32) {
                const uint8_t *b = q + k / 2;
                for (int i = 0; i < 16; i++) t[i % L] += (float)(b[i] & 15) * x[k + i];
                for (int i = 0; i < 16; i++) t[i % L] += (float)(b[i] >> 4) * x[k + 16 + i];
            }
            const float d = half_to_float(s[gi]);
            for (int i = 0; i < L; i++) acc[i] += t[i] * d;
            off[gi % L] += half_to_float(c[gi]) * a->xsum[gi];
        }
        a->y[n] = hsum(acc) + hsum(off);
    }
}

/* ---------------------------------------------------------------------------------- */

static void q8_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, g = a->g;
    for (int64_t n = n0; n < n1; n++, w += K) {
        const int8_t *q = (const int8_t *)a->qw + n * K;
        for (int64_t k = 0; k < K; k++) {
            float d = g ? half_to_float(((const uint16_t *)a->scales)[n * (K / g) + k / g])
                        : ((const float *)a->scales)[n];
            w[k] = (float)q[k] * d;
        }
    }
}

static void q4_dequant(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, g = a->g, G = K / g;
    for (int64_t n = n0; n < n1; n++, w += K) {
        const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2);
        for (int64_t k = 0; k < K; k++) {
            const uint8_t b = q[k / 32 * 16 + k % 16];
            const int code = k % 32 < 16 ? b & 15 : b >> 4;
            const float d = half_to_float(((const uint16_t *)a->scales)[n * G + k / g]);
            if (a->mins) {
                float p = (float)code * d; /* q * d + m: one product, then a separate sum */
                w[k] = p + half_to_float(a->mins[n * G + k / g]);
            } else {
                w[k] = (float)(code - 8) * d;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------- */

/* int5's block b of row q: codes 0..31, the nibbles as int4's and bit 4 from qh. */
static void q5_codes(const uint8_t *q, const uint8_t *qh, int64_t b, int code[32]) {
    const uint8_t *qs = q + 16 * b, *h = qh + 4 * b;
    const uint32_t bits = h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
    for (int i = 0; i < 16; i++) {
        code[i] = (qs[i] & 15) | ((bits >> i) & 1) << 4;
        code[16 + i] = (qs[i] >> 4) | ((bits >> (16 + i)) & 1) << 4;
    }
}

void q5_gemv_c(const qmat *a, int64_t n0, int64_t n1) {
    const int64_t K = a->K, G = K / 32;
    const float *x = a->x;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2), *qh = a->qh + n * (K / 8);
        const uint16_t *s = (const uint16_t *)a->scales + n * G;
        const uint16_t *c = a->mins ? a->mins + n * G : s; /* times xsum */
        float acc[L] = {0}, off[L] = {0};
        for (int64_t b = 0; b < G; b++) {
            int code[32];
            q5_codes(q, qh, b, code);
            float t[L] = {0};
            for (int i = 0; i < 32; i++) t[i % L] += (float)code[i] * x[32 * b + i];
            const float d = half_to_float(s[b]);
            for (int i = 0; i < L; i++) acc[i] += t[i] * d;
            off[b % L] += half_to_float(c[b]) * a->xsum[b];
        }
        a->y[n] = hsum(acc) + hsum(off);
    }
}

void q5_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, G = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *q = (const uint8_t *)a->qw + n * (K / 2), *qh = a->qh + n * (K / 8);
        for (int64_t b = 0; b < G; b++, w += 32) {
            int code[32];
            q5_codes(q, qh, b, code);
            const float d = half_to_float(((const uint16_t *)a->scales)[n * G + b]);
            if (a->mins) {
                const float m = half_to_float(a->mins[n * G + b]);
                for (int i = 0; i < 32; i++) {
                    const float p = (float)code[i] * d; /* one product, then the sum */
                    w[i] = p + m;
                }
            } else {
                for (int i = 0; i < 32; i++) w[i] = (float)(code[i] - 16) * d;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------- */

/* An int6 block's codes minus 32, in element order (quant/formats/int6.py's layout): per half h
 * and quarter j, 32 elements from one run of ql and of qh. */
static void q6_codes(const uint8_t *blk, int8_t q[Q6_BLOCK]) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++) {
            const uint8_t *ql = blk + 64 * h + 32 * (j & 1), *qh = blk + 128 + 32 * h;
            const int shift = j < 2 ? 0 : 4;
            for (int l = 0; l < 32; l++)
                q[128 * h + 32 * j + l] =
                    (int8_t)((((ql[l] >> shift) & 15) | (((qh[l] >> (2 * j)) & 3) << 4)) - 32);
        }
}

static float q6_d(const uint8_t *blk) { return half_to_float((uint16_t)(blk[208] | blk[209] << 8)); }

void q6_gemv_c(const qmat *a, int64_t n0, int64_t n1) {
    const int64_t K = a->K, B = K / Q6_BLOCK;
    const float *x = a->x;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)a->qw + n * B * Q6_BLOCK_BYTES;
        float acc[L] = {0};
        for (int64_t b = 0; b < B; b++) {
            const uint8_t *blk = row + b * Q6_BLOCK_BYTES;
            const float d = q6_d(blk), *xb = x + b * Q6_BLOCK;
            int8_t q[Q6_BLOCK];
            q6_codes(blk, q);
            for (int s = 0; s < 16; s++) {
                float t[L] = {0};
                for (int i = 16 * s; i < 16 * s + 16; i++) t[i % L] += (float)q[i] * xb[i];
                const float ds = d * (float)(int8_t)blk[192 + s];
                for (int i = 0; i < L; i++) acc[i] += t[i] * ds;
            }
        }
        a->y[n] = hsum(acc);
    }
}

void q6_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w) {
    const int64_t K = a->K, B = K / Q6_BLOCK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)a->qw + n * B * Q6_BLOCK_BYTES;
        for (int64_t b = 0; b < B; b++, w += Q6_BLOCK) {
            const uint8_t *blk = row + b * Q6_BLOCK_BYTES;
            const float d = q6_d(blk);
            int8_t q[Q6_BLOCK];
            q6_codes(blk, q);
            for (int i = 0; i < Q6_BLOCK; i++) /* d * sc exact, and so the product */
                w[i] = (float)q[i] * (d * (float)(int8_t)blk[192 + i / 16]);
        }
    }
}

static void tile(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                 int64_t M, int64_t nb, int64_t K, int accumulate) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t j = 0; j < nb; j++) {
            const float *xm = x + m * ldx, *wj = w + j * ldw;
            float acc[L] = {0};
            int64_t k = 0;
            for (; k + L <= K; k += L)
                for (int i = 0; i < L; i++) acc[i] += xm[k + i] * wj[k + i];
            for (int i = 0; k + i < K; i++) acc[i] += xm[k + i] * wj[k + i];
            const float s = hsum(acc);
            y[m * ldy + j] = accumulate ? y[m * ldy + j] + s : s;
        }
    }
}

const kernel_table kernels_scalar = {q8_gemv, q4_gemv, NULL, NULL, q8_dequant, q4_dequant, tile};
