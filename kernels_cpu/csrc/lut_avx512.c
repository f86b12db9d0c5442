/* The LUT GEMM's AVX-512 path (lut.c), for avx512vnni on CPUs that also have VBMI (Ice
   Lake, Zen 4 and later). Needs g % 32 == 0.

   Blocks of 8 weight rows: an 8x8 qword transpose puts one 64-weight qword of 8 rows in
   a zmm, turned into indices once (all planes) and looked up with vpermi2b in 8 tables;
   vpdpbusd with 2^p bytes sums 4 lookups and weights the plane, into int32. Prefill
   (M > 1, g = 64) runs superblocks of 4 blocks, so each activation row's tables are read
   once per 32 weight rows. The same integers and float order as the scalar path, so the
   same bits.

   Decode's cost per 8 rows x 64 weights x plane: ~16 vector instructions (1 load, 3 of
   transpose, 3 of index, 4 table loads shared by the planes, 2 vpermi2b, 2 vpdpbusd),
   plus ~1.5 per group of epilogue: few enough that one core streams the packed weights
   near its memory bandwidth (benchmarks/bench_lut.py). */
#include "lut_common.h"

#ifdef INFER_X86

/* ------------------------------------------------------------------------------------ */
/* AVX-512 VBMI + VNNI: 8 rows x 64 bytes per plane, qword-transposed, vpermi2b            */
/* ------------------------------------------------------------------------------------ */

static inline LUT_AVX512 void transpose8x8_epi64(__m512i z[8]) {
    __m512i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi64(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi64(z[2 * i], z[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int e = 0; e < 2; e++) {
            u[4 * i + e] = _mm512_shuffle_i64x2(t[4 * i + e], t[4 * i + 2 + e], 0x88);
            u[4 * i + 2 + e] = _mm512_shuffle_i64x2(t[4 * i + e], t[4 * i + 2 + e], 0xDD);
        }
    /* u[0]: columns 0, 4 of rows 0-3; u[1]: 1, 5; u[2]: 2, 6; u[3]: 3, 7; u[4..7]: rows 4-7 */
    for (int i = 0; i < 4; i++) {
        z[i] = _mm512_shuffle_i64x2(u[i], u[4 + i], 0x88);
        z[4 + i] = _mm512_shuffle_i64x2(u[i], u[4 + i], 0xDD);
    }
    /* z[k] = qword k of rows 0..7 */
}

/* Lookups of one chunk for one activation row: acc[q] += sum over planes p of 2^p times
   the table entries of qword q (idx: the chunk's indices, plane p qword q low / high
   nibbles at idx[(8p + q) * 2 + 0 / 1]). The 4 table registers of a qword serve every
   plane. */
static inline __attribute__((always_inline)) LUT_AVX512 void lookups(const int8_t *tab,
                                                                     const __m512i *idx,
                                                                     int bits, int nq,
                                                                     __m512i acc[8]) {
    for (int q = 0; q < nq; q++) {
        const int8_t *t = tab + q * 256;
        const __m512i t0 = _mm512_loadu_si512(t), t1 = _mm512_loadu_si512(t + 64),
                      t2 = _mm512_loadu_si512(t + 128), t3 = _mm512_loadu_si512(t + 192);
        for (int p = 0; p < bits; p++) {
            const __m512i pw = _mm512_set1_epi8((char)(1 << p));
            __m512i rl = _mm512_permutex2var_epi8(t0, idx[(8 * p + q) * 2], t1);
            __m512i rh = _mm512_permutex2var_epi8(t2, idx[(8 * p + q) * 2 + 1], t3);
            acc[q] = _mm512_dpbusd_epi32(acc[q], pw, rl);
            acc[q] = _mm512_dpbusd_epi32(acc[q], pw, rh);
        }
    }
}

/* The lookup indices of one chunk (up to 64 bytes of each plane) of 8 rows at w (row
   stride rb, plane stride plane): idx[(8p + q) * 2 + 0 / 1] = low / high nibbles of qword q
   of plane p, with the byte position t in bits 4-6 (vpermi2b picks table t). */
static inline LUT_AVX512 void chunk_indices(const uint8_t *w, int64_t rb, int64_t plane,
                                            int bits, __mmask64 bmask, int nq, __m512i *idx) {
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512i tpos = _mm512_set1_epi64(0x7060504030201000LL); /* byte t -> t << 4 */
    for (int p = 0; p < bits; p++, w += plane) {
        __m512i z[8];
        for (int r = 0; r < 8; r++) z[r] = _mm512_maskz_loadu_epi8(bmask, w + r * rb);
        transpose8x8_epi64(z);
        for (int q = 0; q < nq; q++) {
            idx[(8 * p + q) * 2] = _mm512_ternarylogic_epi64(z[q], low4, tpos, 0xEA); /* a&b|c */
            idx[(8 * p + q) * 2 + 1] =
                _mm512_ternarylogic_epi64(_mm512_srli_epi16(z[q], 4), low4, tpos, 0xEA);
        }
    }
}

/* Group integers of rows [n0, n0+8) for activation rows [m0, m1) -> I[(m - m0) * Istride
   + G * 8 + row]. Per chunk (64 bytes of each plane: 8 qwords, 512 elements), the weights
   are transposed and turned into indices once, then looked up for every activation row. */
static LUT_AVX512 void block8_avx512(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                                     int32_t *I, int64_t Istride, __m512i *idx) {
    const int64_t K = P->K, rb = K / 8, upg = P->g / 32, plane = P->N * rb;
    const uint8_t *w0 = P->qweight + n0 * rb;
    /* dwords 2r of a and of b (unit 0 of each row), then dwords 2r + 1 (unit 1) */
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m256i gacc[MAX_TILE_M]; /* per activation row: the group being summed (generic g) */
    for (int64_t m = m0; m < m1; m++) gacc[m - m0] = _mm256_setzero_si256();
    int64_t unit = 0, G = 0; /* the same for every activation row */
    for (int64_t c = 0; c < rb; c += 64) {
        const int nb = (int)(rb - c < 64 ? rb - c : 64); /* a multiple of 4 */
        const int nq = (nb + 7) / 8;
        const __mmask64 bmask = nb == 64 ? ~(__mmask64)0 : (((__mmask64)1 << nb) - 1);
        prefetch_next(w0 + 8 * rb, plane, P->bits, c / 64 * 8, 8); /* next block: rb / 8 lines */
        chunk_indices(w0 + c, rb, plane, P->bits, bmask, nq, idx);
        int64_t unit_end = unit, G_end = G;
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *tab = P->tables + m * P->tables_stride + c / 8 * 256;
            int32_t *Im = I + (m - m0) * Istride;
            __m512i acc[8];
            for (int q = 0; q < 8; q++) acc[q] = _mm512_setzero_si512();
            if (nq == 8) {
                lookups(tab, idx, P->bits, 8, acc);
                if (P->g == 64) { /* a group per qword: two groups' 8 rows per store */
                    for (int q = 0; q < 8; q += 2) {
                        __m512i a = _mm512_permutex2var_epi32(acc[q], even, acc[q + 1]);
                        __m512i b = _mm512_permutex2var_epi32(acc[q], odd, acc[q + 1]);
                        _mm512_storeu_si512(Im + (G + q) * 8, _mm512_add_epi32(a, b));
                    }
                    G_end = G + 8;
                    continue;
                }
            } else {
                lookups(tab, idx, P->bits, nq, acc);
            }
            /* any g % 32 == 0: units of 32 elements, dwords 2r (unit 2q) and 2r+1 (2q+1) */
            __m256i ga = gacc[m - m0];
            int64_t u = unit, Gm = G;
            for (int q = 0; q < nq; q++) {
                if (upg >= 2 && u + 2 <= upg) {
                    __m512i both = _mm512_add_epi32(acc[q], _mm512_srli_epi64(acc[q], 32));
                    ga = _mm256_add_epi32(ga, _mm512_cvtepi64_epi32(both));
                    u += 2;
                    if (u == upg) {
                        _mm256_storeu_si256((__m256i *)(Im + Gm * 8), ga);
                        ga = _mm256_setzero_si256();
                        u = 0;
                        Gm++;
                    }
                    continue;
                }
                for (int e = 0; e < 2 && 8 * q + 4 * e < nb; e++) {
                    __m512i v = e ? _mm512_srli_epi64(acc[q], 32) : acc[q];
                    ga = _mm256_add_epi32(ga, _mm512_cvtepi64_epi32(v));
                    if (++u == upg) {
                        _mm256_storeu_si256((__m256i *)(Im + Gm * 8), ga);
                        ga = _mm256_setzero_si256();
                        u = 0;
                        Gm++;
                    }
                }
            }
            gacc[m - m0] = ga;
            unit_end = u;
            G_end = Gm;
        }
        unit = unit_end;
        G = G_end;
    }
}

/* g = 64 (a group per qword), nbk blocks of 8 rows at n0: the group integers of block k
   and activation row m -> I[(m - m0) * Istride + k * ld + G * 8 + row]. The table
   registers of a pair of qwords serve every block and plane, so a superblock reads each
   activation row's tables once. */
static inline __attribute__((always_inline)) LUT_AVX512 void superblock_g64_nbk(
    const lut_problem *P, int64_t m0, int64_t m1, int64_t n0, int nbk, int32_t *I,
    int64_t Istride, int64_t ld, __m512i *idx) {
    const int64_t rb = P->K / 8, plane = P->N * rb;
    const int bits = P->bits;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t c = 0; c < rb; c += 64) {
        const int nb = (int)(rb - c < 64 ? rb - c : 64);
        const int nq = (nb + 7) / 8;
        const __mmask64 bmask = nb == 64 ? ~(__mmask64)0 : (((__mmask64)1 << nb) - 1);
        /* the next superblock: rb / 2 lines a plane */
        prefetch_next(P->qweight + (n0 + SB) * rb, plane, bits, c / 64 * 32, 32);
        for (int k = 0; k < nbk; k++)
            chunk_indices(P->qweight + (n0 + 8 * k) * rb + c, rb, plane, bits, bmask, nq,
                          idx + 64 * k);
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *tab = P->tables + m * P->tables_stride + c / 8 * 256;
            int32_t *Im = I + (m - m0) * Istride + c; /* c / 8 qwords = groups, 8 rows each */
            for (int q = 0; q < nq; q += 2) { /* a q past nq reads padding, stores past K/g */
                const int8_t *t = tab + q * 256;
                const __m512i ta0 = _mm512_loadu_si512(t), ta1 = _mm512_loadu_si512(t + 64),
                              ta2 = _mm512_loadu_si512(t + 128),
                              ta3 = _mm512_loadu_si512(t + 192),
                              tb0 = _mm512_loadu_si512(t + 256),
                              tb1 = _mm512_loadu_si512(t + 320),
                              tb2 = _mm512_loadu_si512(t + 384),
                              tb3 = _mm512_loadu_si512(t + 448);
                for (int k = 0; k < nbk; k++) {
                    const __m512i *ix = idx + 64 * k;
                    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
                    for (int p = 0; p < bits; p++) {
                        const __m512i pw = _mm512_set1_epi8((char)(1 << p));
                        const __m512i *i0 = ix + (8 * p + q) * 2;
                        a = _mm512_dpbusd_epi32(a, pw, _mm512_permutex2var_epi8(ta0, i0[0], ta1));
                        a = _mm512_dpbusd_epi32(a, pw, _mm512_permutex2var_epi8(ta2, i0[1], ta3));
                        b = _mm512_dpbusd_epi32(b, pw, _mm512_permutex2var_epi8(tb0, i0[2], tb1));
                        b = _mm512_dpbusd_epi32(b, pw, _mm512_permutex2var_epi8(tb2, i0[3], tb3));
                    }
                    /* rows' two 32-element halves: even + odd dwords; groups q, q + 1 */
                    __m512i sum = _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b),
                                                   _mm512_permutex2var_epi32(a, odd, b));
                    _mm512_storeu_si512(Im + k * ld + q * 8, sum);
                }
            }
        }
    }
}

static LUT_AVX512 void superblock_g64(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                                      int nbk, int32_t *I, int64_t Istride, int64_t ld,
                                      __m512i *idx) {
    switch (nbk) { /* a constant count for each, so the block loop unrolls */
    case 4: superblock_g64_nbk(P, m0, m1, n0, 4, I, Istride, ld, idx); break;
    case 3: superblock_g64_nbk(P, m0, m1, n0, 3, I, Istride, ld, idx); break;
    case 2: superblock_g64_nbk(P, m0, m1, n0, 2, I, Istride, ld, idx); break;
    default: superblock_g64_nbk(P, m0, m1, n0, 1, I, Istride, ld, idx); break;
    }
}

/* s or m of 8 rows, all groups, as float dst[G * 8 + row], up to K/g rounded up to 4:
   per 32 groups an 8x8 qword transpose (a qword = 4 groups of a row), then vpermw puts the
   rows of each group together. */
static inline LUT_AVX512 void transpose_sm8_avx512(const uint16_t *src, int64_t ngroups,
                                                   float *dst) {
    /* word g * 8 + r <- word r * 4 + g */
    const __m512i perm = _mm512_set_epi16(31, 27, 23, 19, 15, 11, 7, 3, 30, 26, 22, 18, 14, 10,
                                          6, 2, 29, 25, 21, 17, 13, 9, 5, 1, 28, 24, 20, 16, 12,
                                          8, 4, 0);
    for (int64_t G = 0; G < ngroups; G += 32) {
        const int64_t left = ngroups - G;
        const __mmask32 mask = left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
        __m512i z[8];
        for (int r = 0; r < 8; r++) {
            z[r] = _mm512_maskz_loadu_epi16(mask, src + r * ngroups + G);
            /* the same block of the next superblock */
            _mm_prefetch((const char *)(src + (SB + r) * ngroups + G), _MM_HINT_T0);
        }
        transpose8x8_epi64(z);
        for (int c = 0; c < 8 && 4 * c < left; c++) {
            __m512i v = _mm512_permutexvar_epi16(perm, z[c]);
            _mm512_storeu_ps(dst + (G + 4 * c) * 8, _mm512_cvtph_ps(_mm512_castsi512_si256(v)));
            _mm512_storeu_ps(dst + (G + 4 * c + 2) * 8,
                             _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)));
        }
    }
}

LUT_AVX512 void lut_rows_avx512(const lut_problem *P, int64_t m0, int64_t m1, int64_t n0,
                                   int64_t n1, lut_scratch *S) {
    const int64_t ngroups = P->K / P->g, N = P->N, ld = S->ld;
    int64_t n = n0;
    while (n + 8 <= n1) { /* superblocks of up to 4 blocks of 8 rows */
        const int nbk = (int)((n1 - n) / 8 < 4 ? (n1 - n) / 8 : 4);
        for (int k = 0; k < nbk; k++) {
            const int64_t r = (n + 8 * k) * ngroups;
            transpose_sm8_avx512(P->scales + r, ngroups, S->s + k * ld);
            transpose_sm8_avx512(P->mins + r, ngroups, S->mn + k * ld);
        }
        /* prefill: the superblock shares table registers over its 4 blocks; decode reads
           block by block (fewer interleaved weight streams) */
        if (P->g == 64 && m1 - m0 > 1)
            superblock_g64(P, m0, m1, n, nbk, S->I, 4 * ld, ld, S->idx);
        else
            for (int k = 0; k < nbk; k++)
                block8_avx512(P, m0, m1, n + 8 * k, S->I + k * ld, 4 * ld, S->idx);
        for (int64_t m = m0; m < m1; m++) { /* a chain per block */
            chain_t ch[4];
            for (int k = 0; k < nbk; k++)
                ch[k] = (chain_t){S->I + (m - m0) * 4 * ld + k * ld, S->s + k * ld,
                                  S->mn + k * ld, P->c1 + m * ngroups, P->c2 + m * ngroups,
                                  P->asum + m * ngroups, P->y + m * N + n + 8 * k};
            epilogue(ch, ngroups, nbk);
        }
        n += 8 * nbk;
    }
    if (n < n1)
        for (int64_t m = m0; m < m1; m++) lut_rows_scalar(P, m, n, n1, S->I);
}
#endif /* INFER_X86 */
