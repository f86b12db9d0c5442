/* The LUT GEMM's AVX2 path (lut.c), for avx2, avx2vnni and avx512 (kernels.h's ids; the
   avx512vnni CPUs with VBMI run lut_avx512.c). Needs g % 32 == 0.

   16 weight rows at a time: a 16x16 byte transpose per 128-bit lane puts one byte
   position of 16 rows in a lane, looked up with vpshufb (one table per lane); int16
   accumulation (a 32-element unit is at most 15240), int32 per group. The same integers
   and float order as the scalar path, so the same bits. */
#include <string.h>

#include "lut_common.h"

#ifdef INFER_X86

/* ------------------------------------------------------------------------------------ */
/* Scales and mins in lanes, the epilogue's chains, the table builder                    */
/* ------------------------------------------------------------------------------------ */

/* s or m of 8 rows, all groups, as float dst[G * 8 + row]: the epilogue reads rows in
   lanes. 8x8 float transposes; the last ngroups % 8 groups one by one. */
static inline LUT_AVX2 void transpose_sm8(const uint16_t *src, int64_t ngroups, float *dst) {
    int64_t G = 0;
    for (; G + 8 <= ngroups; G += 8) {
        __m256 r[8], t[8], u[8];
        for (int i = 0; i < 8; i++) {
            r[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i * ngroups + G)));
            /* the same block of the next superblock */
            _mm_prefetch((const char *)(src + (i + SB) * ngroups + G), _MM_HINT_T0);
        }
        for (int i = 0; i < 4; i++) {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 2; i++) {
            u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
            u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
            u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
            u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
        }
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps(dst + (G + i) * 8, _mm256_permute2f128_ps(u[i], u[4 + i], 0x20));
            _mm256_storeu_ps(dst + (G + 4 + i) * 8, _mm256_permute2f128_ps(u[i], u[4 + i], 0x31));
        }
    }
    for (; G < ngroups; G++)
        for (int i = 0; i < 8; i++) dst[G * 8 + i] = _cvtsh_ss(src[i * ngroups + G]);
}

/* Chains for blocks [0, nb) of the superblock at row n, activation row m. */
static inline void block_chains(const lut_problem *P, const lut_scratch *S, int64_t m,
                                int64_t n, int nb, chain_t *ch) {
    const int64_t ng = P->K / P->g;
    for (int k = 0; k < nb; k++)
        ch[k] = (chain_t){S->I + k * S->ld, S->s + k * S->ld, S->mn + k * S->ld, P->c1 + m * ng,
                          P->c2 + m * ng, P->asum + m * ng, P->y + m * P->N + n + 8 * k};
}

/* lut_build_tables, 8 tables (32 activations) at a time, lanes = tables: the same operations
   per lane as the scalar code, so the same bits. Needs g % 32 == 0. */
LUT_AVX2 void lut_build_tables_avx2(const float *x, int64_t K, int g, int bits,
                                       int8_t *tables, float *c1, float *c2, float *asum) {
    const int64_t ngroups = K / g;
    const float half_levels = 0.5f * (float)((1 << bits) - 1);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    /* 4x4 byte transpose in each lane: byte 4e + i -> 4i + e */
    const __m256i tr4 = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0,
                                         4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    /* table = its 8 entries, then the same reversed (to be negated) */
    const __m256i mirA = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2,
                                          3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i mirB = _mm256_add_epi8(mirA, _mm256_set1_epi8(8));
    const __m256i neg = _mm256_setr_epi8(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1, 1,
                                         1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    memset(tables + K / 64 * 256, 0, tables_bytes(K) - K / 64 * 256); /* past K */
    for (int64_t G = 0; G < ngroups; G++) {
        /* a_i of 8 tables; lanes hold tables 0, 2, 4, 6, 1, 3, 5, 7 of the 8 */
        __m256 amax = _mm256_setzero_ps();
        float A = 0.0f;
        for (int64_t c = 0; c < g / 32; c++) {
            const float *p = x + G * g + 32 * c;
            __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8),
                   v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
            __m256 u0 = _mm256_unpacklo_ps(v0, v1), u1 = _mm256_unpackhi_ps(v0, v1);
            __m256 u2 = _mm256_unpacklo_ps(v2, v3), u3 = _mm256_unpackhi_ps(v2, v3);
            __m256 a0 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2)));
            __m256 a1 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2)));
            __m256 a2 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3)));
            __m256 a3 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3)));
            __m256 sa = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                              _mm256_andnot_ps(sign, a2)),
                _mm256_andnot_ps(sign, a3));
            amax = _mm256_max_ps(amax, sa);
            float t[8];
            _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), a2), a3));
            static const int lane[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* of table k */
            for (int k = 0; k < 8; k++) A += t[lane[k]]; /* sequential, in table order */
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float am = _mm_cvtss_f32(m4);
        const float inv = am >= AMAX_MIN ? 127.0f / am : 0.0f;
        c1[G] = (am / 127.0f) * 0.5f;
        c2[G] = half_levels * A;
        asum[G] = A;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int64_t c = 0; c < g / 32; c++) {
            const float *p = x + G * g + 32 * c;
            __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8),
                   v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
            __m256 u0 = _mm256_unpacklo_ps(v0, v1), u1 = _mm256_unpackhi_ps(v0, v1);
            __m256 u2 = _mm256_unpacklo_ps(v2, v3), u3 = _mm256_unpackhi_ps(v2, v3);
            __m256 a0 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2)));
            __m256 a1 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u0), _mm256_castps_pd(u2)));
            __m256 a2 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3)));
            __m256 a3 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u1), _mm256_castps_pd(u3)));
            const __m256 n0 = _mm256_xor_ps(a0, sign), n2 = _mm256_xor_ps(a2, sign);
            const __m256 p01[4] = {_mm256_sub_ps(n0, a1), _mm256_sub_ps(a0, a1),
                                   _mm256_add_ps(n0, a1), _mm256_add_ps(a0, a1)};
            __m256i e[8];
            for (int idx = 0; idx < 8; idx++) {
                __m256 v = _mm256_sub_ps(_mm256_add_ps(p01[idx & 3], (idx & 4) ? a2 : n2), a3);
                __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(v, vinv)); /* rint: MXCSR default */
                e[idx] = _mm256_max_epi32(_mm256_min_epi32(r, lim), nlim);
            }
            /* (entry, table) int32 -> per table its 8 entries as bytes */
            __m256i q0 = _mm256_packs_epi16(_mm256_packs_epi32(e[0], e[1]),
                                            _mm256_packs_epi32(e[2], e[3]));
            __m256i q1 = _mm256_packs_epi16(_mm256_packs_epi32(e[4], e[5]),
                                            _mm256_packs_epi32(e[6], e[7]));
            q0 = _mm256_shuffle_epi8(q0, tr4); /* 4 tables x entries 0..3 */
            q1 = _mm256_shuffle_epi8(q1, tr4); /* 4 tables x entries 4..7 */
            __m256i r01 = _mm256_unpacklo_epi32(q0, q1); /* tables 0, 1 of the lane: 8 entries */
            __m256i r23 = _mm256_unpackhi_epi32(q0, q1);
            __m256i t0 = _mm256_sign_epi8(_mm256_shuffle_epi8(r01, mirA), neg);
            __m256i t1 = _mm256_sign_epi8(_mm256_shuffle_epi8(r01, mirB), neg);
            __m256i t2 = _mm256_sign_epi8(_mm256_shuffle_epi8(r23, mirA), neg);
            __m256i t3 = _mm256_sign_epi8(_mm256_shuffle_epi8(r23, mirB), neg);
            /* lane 0: even tables j0, j0+2, .. (low nibbles), lane 1: odd (high nibbles);
               they fill 4 consecutive 16-byte slots of their half of the qword's 256 */
            const int64_t j0 = (G * g + 32 * c) / 4;
            int8_t *lo = tables + (j0 / 16) * 256 + ((j0 % 16) / 2) * 16, *hi = lo + 128;
            _mm_storeu_si128((__m128i *)lo, _mm256_castsi256_si128(t0));
            _mm_storeu_si128((__m128i *)(lo + 16), _mm256_castsi256_si128(t1));
            _mm_storeu_si128((__m128i *)(lo + 32), _mm256_castsi256_si128(t2));
            _mm_storeu_si128((__m128i *)(lo + 48), _mm256_castsi256_si128(t3));
            _mm_storeu_si128((__m128i *)hi, _mm256_extracti128_si256(t0, 1));
            _mm_storeu_si128((__m128i *)(hi + 16), _mm256_extracti128_si256(t1, 1));
            _mm_storeu_si128((__m128i *)(hi + 32), _mm256_extracti128_si256(t2, 1));
            _mm_storeu_si128((__m128i *)(hi + 48), _mm256_extracti128_si256(t3, 1));
        }
    }
}

/* ------------------------------------------------------------------------------------ */
/* AVX2: 16 rows x 32 bytes per plane, byte-transposed, vpshufb                           */
/* ------------------------------------------------------------------------------------ */

/* In each 128-bit lane: R[r] = 16 bytes of row r  ->  O[i] = byte i of rows 0..15. */
static inline LUT_AVX2 void transpose16x16_epi8(const __m256i R[16], __m256i O[16]) {
    __m256i S1[16], S2[16], S3[16];
    for (int k = 0; k < 8; k++) {
        S1[2 * k] = _mm256_unpacklo_epi8(R[2 * k], R[2 * k + 1]);
        S1[2 * k + 1] = _mm256_unpackhi_epi8(R[2 * k], R[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++)
        for (int s = 0; s < 2; s++) {
            S2[4 * k + 2 * s] = _mm256_unpacklo_epi16(S1[4 * k + s], S1[4 * k + 2 + s]);
            S2[4 * k + 2 * s + 1] = _mm256_unpackhi_epi16(S1[4 * k + s], S1[4 * k + 2 + s]);
        }
    for (int kk = 0; kk < 2; kk++)
        for (int i = 0; i < 4; i++) {
            S3[8 * kk + 2 * i] = _mm256_unpacklo_epi32(S2[8 * kk + i], S2[8 * kk + 4 + i]);
            S3[8 * kk + 2 * i + 1] = _mm256_unpackhi_epi32(S2[8 * kk + i], S2[8 * kk + 4 + i]);
        }
    for (int i = 0; i < 8; i++) {
        O[2 * i] = _mm256_unpacklo_epi64(S3[i], S3[8 + i]);
        O[2 * i + 1] = _mm256_unpackhi_epi64(S3[i], S3[8 + i]);
    }
}

/* Group integers of rows [n0, n0+16) for activation row m -> I[h * ld + G * 8 + row] for
   the two blocks h of 8 rows. */
static LUT_AVX2 void block16_avx2(const lut_problem *P, int64_t m, int64_t n0, int32_t *I,
                                  int64_t ld) {
    const int64_t K = P->K, rb = K / 8, upg = P->g / 32; /* 32-element units per group */
    const int8_t *tab = P->tables + m * P->tables_stride;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i gacc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    int64_t unit = 0, G = 0;
    for (int64_t c = 0; c < rb; c += 32) {
        const int nb = (int)(rb - c < 32 ? rb - c : 32); /* bytes, a multiple of 4 */
        __m256i acc[4][2];
        for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nb / 4),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        /* the next block of 16 rows: rb / 4 lines a plane, 8 per chunk of 32 bytes */
        prefetch_next(P->qweight + (n0 + 16) * rb, P->N * rb, P->bits, c / 32 * 8, 8);
        for (int p = 0; p < P->bits; p++) {
            __m256i R[16], O[16];
            const uint8_t *w = P->qweight + ((int64_t)p * P->N + n0) * rb + c;
            for (int r = 0; r < 16; r++)
                R[r] = nb == 32 ? _mm256_loadu_si256((const __m256i *)(w + r * rb))
                                : _mm256_maskload_epi32((const int *)(w + r * rb), mask);
            transpose16x16_epi8(R, O);
            const __m256i pw = _mm256_set1_epi8((char)(1 << p));
            const int jn = nb < 16 ? nb : 16;
            for (int j = 0; j < jn; j++) {
                /* lane 0: byte j (qword j/8, position j%8); lane 1: byte 16+j (qword 2+j/8) */
                const int8_t *t0 = tab + (c / 8 + j / 8) * 256 + (j % 8) * 16;
                const int8_t *t1 = t0 + 2 * 256;
                __m256i tlo = _mm256_loadu2_m128i((const __m128i *)t1, (const __m128i *)t0);
                __m256i thi =
                    _mm256_loadu2_m128i((const __m128i *)(t1 + 128), (const __m128i *)(t0 + 128));
                __m256i lo = _mm256_and_si256(O[j], low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(O[j], 4), low4);
                __m256i rl = _mm256_shuffle_epi8(tlo, lo), rh = _mm256_shuffle_epi8(thi, hi);
                /* pairs (lo, hi) of one row -> 2^p (lo + hi) in int16; rows 0-7 and 8-15 */
                __m256i a0 = _mm256_maddubs_epi16(pw, _mm256_unpacklo_epi8(rl, rh));
                __m256i a1 = _mm256_maddubs_epi16(pw, _mm256_unpackhi_epi8(rl, rh));
                acc[j / 4][0] = _mm256_add_epi16(acc[j / 4][0], a0);
                acc[j / 4][1] = _mm256_add_epi16(acc[j / 4][1], a1);
            }
        }
        /* unit u of the chunk: acc[u % 4], lane u / 4 */
        for (int u = 0; u < nb / 4; u++) {
            for (int h = 0; h < 2; h++) {
                __m128i v = u < 4 ? _mm256_castsi256_si128(acc[u][h])
                                  : _mm256_extracti128_si256(acc[u - 4][h], 1);
                gacc[h] = _mm256_add_epi32(gacc[h], _mm256_cvtepi16_epi32(v));
            }
            if (++unit == upg) {
                _mm256_storeu_si256((__m256i *)(I + G * 8), gacc[0]);
                _mm256_storeu_si256((__m256i *)(I + ld + G * 8), gacc[1]);
                gacc[0] = gacc[1] = _mm256_setzero_si256();
                unit = 0;
                G++;
            }
        }
    }
}

LUT_AVX2 void lut_rows_avx2(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                               int64_t n1, lut_scratch *S) {
    const int64_t ngroups = P->K / P->g;
    int64_t n = n0;
    while (n + 16 <= n1) { /* superblocks of 32 or 16 rows */
        const int nb = n + 32 <= n1 ? 4 : 2;
        for (int k = 0; k < nb; k++) {
            transpose_sm8(P->scales + (n + 8 * k) * ngroups, ngroups, S->s + k * S->ld);
            transpose_sm8(P->mins + (n + 8 * k) * ngroups, ngroups, S->mn + k * S->ld);
        }
        for (int64_t m = m0; m < m1; m++) {
            chain_t ch[4];
            for (int k = 0; k < nb; k += 2)
                block16_avx2(P, m, n + 8 * k, S->I + k * S->ld, S->ld);
            block_chains(P, S, m, n, nb, ch);
            epilogue(ch, ngroups, nb);
        }
        n += 8 * nb;
    }
    if (n < n1)
        for (int64_t m = m0; m < m1; m++) lut_rows_scalar(P, m, n, n1, S->I);
}
#endif /* INFER_X86 */
