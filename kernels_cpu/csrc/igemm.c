/* The integer GEMM (prefill): the parts every instruction set shares, and its driver.
 *
 * The float GEMM (matmul.c) dequantizes a tile of W to float32 and runs FMAs: one
 * multiply-add per weight and row of x. Here each row of x becomes two int8 digits per
 * element (kernels.h: 15 significant bits per block of 32) and W's codes stay bytes:
 * vpdpbusd does 4 multiply-adds per 32-bit lane; plain AVX2's vpmaddubsw 2 per 16-bit
 * lane, summed in int16 over a block (igemm_avx2.c), which is why it takes only codes
 * up to 31 (int4, q4_k, int5); neondot's sdot by element 4 (igemm_neon.c). x, prepared once per call, is laid out
 * for the kernel (16 rows' digits per vector); W is read in its own row order, a byte
 * per code, so a panel's preparation is a sequential widening of nibbles (int4, q4_k;
 * int5 adds its qh bits) or a flip of sign bits (int8), nothing strided. llama.cpp's one
 * int8 digit (Q8 activations) would be faster still and costs accuracy; two digits keep
 * `infer eval`'s KL where the float GEMM has it (benchmarks/README.md).
 *
 * Steps: tiles of 32 rows of x become digits on the pool (the path's ig_xprep); then each
 * task widens one panel of IG_NR rows of W into its thread's scratch and runs the path's
 * panel kernel over every row of x. Each output element is computed by one task in a
 * fixed order: any thread count gives the same bits. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef INFER_X86
#include <immintrin.h>
#endif

enum { IG_NR = 32 }; /* rows of W per task */

/* ------------------------------------------------------------------------------------
 * Panels of W: codes (nb, Kp), d and m (nb, Kp / 32); layouts in kernels.h
 * ---------------------------------------------------------------------------------- */

/* A row's d (or m) for each block: its group's scale, converted once a group (by F16C on
 * x86: every x86 path with an integer GEMM has it). */
#ifdef INFER_X86
__attribute__((target("avx,f16c")))
#endif
static void row_scales(const uint16_t *s, int64_t G, int64_t per, float *d) {
    int64_t gi = 0;
#ifdef INFER_X86
    if (per == 1) /* groups of 32: one scale a block */
        for (; gi + 8 <= G; gi += 8)
            _mm256_storeu_ps(d + gi, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + gi))));
#endif
    for (; gi < G; gi++) {
#ifdef INFER_X86
        const float v = _cvtsh_ss(s[gi]);
#else
        const float v = half_to_float(s[gi]);
#endif
        for (int64_t b = gi * per; b < (gi + 1) * per; b++) d[b] = v;
    }
}

/* int4 and int5: n blocks of 16 bytes, byte i = element i (low nibble) and element 16 + i
 * (high), as 32 codes each; with h (int5), ORed with 16 where the block's qh bit (one
 * uint32 per 32) is set. On x86 a block a vector. */
#ifdef INFER_X86
TARGET_AVX2 static void nibble_codes(const uint8_t *q, const uint8_t *h, int64_t n, uint8_t *w) {
    const __m256i nib = _mm256_set1_epi8(15), halves = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, /* byte i: */
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3); /* qh byte i / 8 */
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll), b4 = _mm256_set1_epi8(16);
    for (int64_t i = 0; i < n; i++, q += 16, w += 32) {
        const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
        __m256i c = _mm256_and_si256(_mm256_srlv_epi32(v, halves), nib);
        if (h) {
            int32_t hb;
            memcpy(&hb, h + 4 * i, 4);
            const __m256i e = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(hb), spread), bit);
            c = _mm256_or_si256(c, _mm256_and_si256(_mm256_cmpeq_epi8(e, bit), b4));
        }
        _mm256_storeu_si256((__m256i *)w, c);
    }
}
#else
static void nibble_codes(const uint8_t *q, const uint8_t *h, int64_t n, uint8_t *w) {
    for (int64_t i = 0; i < n; i++, q += 16, w += 32)
        for (int l = 0; l < 16; l++) {
            w[l] = q[l] & 15, w[16 + l] = q[l] >> 4;
            if (h) {
                w[l] |= ((h[4 * i + l / 8] >> (l % 8)) & 1) << 4;
                w[16 + l] |= ((h[4 * i + 2 + l / 8] >> (l % 8)) & 1) << 4;
            }
        }
}
#endif

/* int4 (h NULL) and int5 (h its high bits): codes, and d and m per block */
static void panel_q45(const qmat *a, const uint8_t *h, int64_t n0, int64_t nb, uint8_t *w, float *d,
                      float *m) {
    const int64_t K = a->K, B = K / 32, G = K / a->g;
    nibble_codes((const uint8_t *)a->qw + n0 * (K / 2), h ? h + n0 * (K / 8) : NULL, nb * B, w);
    for (int64_t r = 0; r < nb; r++) {
        row_scales((const uint16_t *)a->scales + (n0 + r) * G, G, a->g / 32, d + r * B);
        if (m) row_scales(a->mins + (n0 + r) * G, G, a->g / 32, m + r * B);
    }
}

/* A Q4_K block's codes for the panel: 4 runs of 32 bytes, low nibbles one sub-block, high
 * the next. On x86 32 bytes at a time. */
#ifdef INFER_X86
TARGET_AVX2 static void q4k_block_codes(const uint8_t *blk, uint8_t *c) {
    const __m256i nib = _mm256_set1_epi8(15);
    for (int r = 0; r < 4; r++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * r));
        _mm256_storeu_si256((__m256i *)(c + 64 * r), _mm256_and_si256(v, nib));
        _mm256_storeu_si256((__m256i *)(c + 64 * r + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
    }
}
#else
static void q4k_block_codes(const uint8_t *blk, uint8_t *c) {
    for (int r = 0; r < 4; r++)
        for (int l = 0; l < 32; l++)
            c[64 * r + l] = blk[16 + 32 * r + l] & 15, c[64 * r + 32 + l] = blk[16 + 32 * r + l] >> 4;
}
#endif

/* q4_k and q5_k (its codes with bit 4, q4k_q5k.c): d and m per sub-block from q4k_q5k.c,
 * as the dequantization rounds them (the two share the scales' layout). */
static void panel_k(int kind, const qmat *a, int64_t n0, int64_t nb, uint8_t *w, float *d, float *m) {
    const int64_t NB = a->K / Q4K_BLOCK, bytes = q_row_bytes(kind, Q4K_BLOCK);
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * NB * bytes;
    for (int64_t i = 0; i < nb * NB; i++, blk += bytes, w += Q4K_BLOCK, d += 8, m += 8) {
        q4k_block_scales(blk, d, m);
        if (kind == Q5K)
            q5k_block_codes(blk, w);
        else
            q4k_block_codes(blk, w);
    }
}

/* q3_k: per block of 256 its codes c = 128 - q sc and -d (q2k_q3k.c), the int8 panel's form */
static void panel_q3k(const qmat *a, int64_t n0, int64_t nb, uint8_t *w, float *d) {
    const int64_t NB = a->K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * NB * Q3K_BLOCK_BYTES;
    for (int64_t i = 0; i < nb * NB; i++, blk += Q3K_BLOCK_BYTES, w += Q4K_BLOCK, d += 8)
        q3k_block_panel(blk, w, d);
}

/* q2_k: its codes q and per 16 d sc and -dmin m (q2k_q3k.c) */
static void panel_q2k(const qmat *a, int64_t n0, int64_t nb, uint8_t *w, float *d, float *m) {
    const int64_t NB = a->K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * NB * Q2K_BLOCK_BYTES;
    for (int64_t i = 0; i < nb * NB; i++, blk += Q2K_BLOCK_BYTES, w += Q4K_BLOCK, d += 16, m += 16)
        q2k_block_panel(blk, w, d, m);
}

/* iq4_xs: its levels plus 128 and each sub-block's scale (iq4xs.c), the int8 panel's form */
static void panel_iq4xs(const qmat *a, int64_t n0, int64_t nb, uint8_t *w, float *d) {
    const int64_t NB = a->K / Q4K_BLOCK;
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * NB * IQ4XS_BLOCK_BYTES;
    for (int64_t i = 0; i < nb * NB; i++, blk += IQ4XS_BLOCK_BYTES, w += Q4K_BLOCK, d += 8)
        iq4xs_block_panel(blk, w, d);
}

/* int6: per block of 256 its codes q (0..63; GGUF Q6_K's ql and qh: per half h and
 * quarter j, 32 elements from one run of each, qh's bits 2j and 2j + 1 to bits 4 and 5)
 * and d sc per 16, exact in float. On x86 32 codes at a time. */
#ifdef INFER_X86
TARGET_AVX2 static void q6_block_codes(const uint8_t *blk, uint8_t *c) {
    const __m256i nib = _mm256_set1_epi8(15), high = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i hb[4] = {_mm256_slli_epi16(qh, 4), _mm256_slli_epi16(qh, 2), qh,
                               _mm256_srli_epi16(qh, 2)};
        for (int j = 0; j < 4; j++) {
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (j & 1)));
            const __m256i lo = j < 2 ? ql : _mm256_srli_epi16(ql, 4);
            _mm256_storeu_si256((__m256i *)(c + 128 * h + 32 * j),
                                _mm256_or_si256(_mm256_and_si256(lo, nib), _mm256_and_si256(hb[j], high)));
        }
    }
}
#else
static void q6_block_codes(const uint8_t *blk, uint8_t *c) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                c[128 * h + 32 * j + l] = (uint8_t)(((blk[64 * h + 32 * (j & 1) + l] >> (j < 2 ? 0 : 4)) & 15) |
                                                    ((blk[128 + 32 * h + l] >> (2 * j)) & 3) << 4);
}
#endif

static void panel_q6(const qmat *a, int64_t n0, int64_t nb, uint8_t *w, float *d) {
    const int64_t NB = a->K / Q6_BLOCK;
    const uint8_t *blk = (const uint8_t *)a->qw + n0 * NB * Q6_BLOCK_BYTES;
    for (int64_t i = 0; i < nb * NB; i++, blk += Q6_BLOCK_BYTES, w += Q6_BLOCK, d += 16) {
        q6_block_codes(blk, w);
        const float dd = half_to_float((uint16_t)(blk[208] | blk[209] << 8));
        for (int g = 0; g < 16; g++) d[g] = dd * (float)(int8_t)blk[192 + g];
    }
}

/* w = q ^ 0x80 (int8 as unsigned codes) for the first n bytes, or those of the whole
 * vectors in n on x86; returns how many were done. */
#ifdef INFER_X86
TARGET_AVX2 static int64_t flip_signs(const uint8_t *q, int64_t n, uint8_t *w) {
    int64_t k = 0;
    for (; k + 32 <= n; k += 32)
        _mm256_storeu_si256((__m256i *)(w + k), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + k)),
                                                                 _mm256_set1_epi8((char)0x80)));
    return k;
}
#else
static int64_t flip_signs(const uint8_t *q, int64_t n, uint8_t *w) {
    for (int64_t k = 0; k < n; k++) w[k] = q[k] ^ 0x80;
    return n;
}
#endif

/* int8: K bytes per row, any K when per channel (zeros past K meet x's zero digits). */
static void panel_q8(const qmat *a, int64_t n0, int64_t nb, uint8_t *w, float *d) {
    const int64_t K = a->K, Kp = (K + 31) / 32 * 32, B = Kp / 32;
    for (int64_t r = 0; r < nb; r++, w += Kp) {
        const uint8_t *q = (const uint8_t *)a->qw + (n0 + r) * K;
        int64_t k = flip_signs(q, K, w);
        for (; k < K; k++) w[k] = q[k] ^ 0x80;
        for (; k < Kp; k++) w[k] = 0;
        if (a->g)
            row_scales((const uint16_t *)a->scales + (n0 + r) * (K / a->g), K / a->g, a->g / 32,
                       d + r * B);
        else
            for (int64_t b = 0; b < B; b++) d[r * B + b] = ((const float *)a->scales)[n0 + r];
    }
}

/* ------------------------------------------------------------------------------------
 * The driver
 * ---------------------------------------------------------------------------------- */

typedef struct {
    const qmat *a;
    const kernel_table *kt;
    ig_x x;
    int bits, o;
    int8_t *bad;         /* x prep: per tile, x has inf or NaN */
    uint8_t *scratch;    /* panels: per thread, codes then d then m */
    int64_t panel_bytes; /* per thread */
} ig_job;

static void xprep_task(void *ctx, int64_t t, int tid) {
    (void)tid;
    const ig_job *j = ctx;
    const ig_x *x = &j->x;
    const int64_t B = x->Kp / 32;
    if (x->M - t * IG_MR < IG_MR) { /* the last tile's missing rows: zeros */
        memset(x->digits + t * B * 8 * 256, 0, (size_t)(B * 8 * 256));
        memset(x->sx + t * B * IG_MR, 0, (size_t)(B * IG_MR) * sizeof(float));
        memset(x->xs + t * B * IG_MR, 0, (size_t)(B * IG_MR) * sizeof(float));
        memset(x->off + t * B * IG_MR, 0, (size_t)(B * IG_MR) * sizeof(int32_t));
    }
    j->bad[t] = (int8_t)(j->kt->ig_xprep(j->a->x, j->a->K, t, j->o, x) != 0);
    if (x->off_lo) /* o sum X (and sx sum X) over each block's first 16, from the digits */
        for (int64_t b = 0; b < B; b++)
            for (int r = 0; r < IG_MR; r++) {
                const int64_t i = (t * B + b) * IG_MR + r;
                const int8_t *p = x->digits + (t * B + b) * 8 * 256 + (r / 16) * 64 + (r % 16) * 4;
                int32_t s = 0;
                for (int g = 0; g < 4; g++)
                    for (int e = 0; e < 4; e++) s += 256 * p[256 * g + e] + p[256 * g + 128 + e];
                x->off_lo[i] = j->o * s;
                if (x->xs_lo) x->xs_lo[i] = x->sx[i] * (float)s;
            }
}

static void panel_task(void *ctx, int64_t t, int tid) {
    const ig_job *j = ctx;
    const qmat *a = j->a;
    const int64_t Kp = j->x.Kp, B = Kp / 32, n0 = t * IG_NR;
    const int64_t nb = a->N - n0 < IG_NR ? a->N - n0 : IG_NR;
    uint8_t *w = j->scratch + tid * j->panel_bytes;
    const int per = j->x.off_lo ? 2 : 1; /* d (and m) per 16 or per 32 */
    float *d = (float *)(w + IG_NR * Kp), *m = j->o == 0 ? d + per * IG_NR * B : NULL;
    if (j->bits == 8)
        panel_q8(a, n0, nb, w, d);
    else if (j->bits == 5)
        panel_q45(a, a->qh, n0, nb, w, d, m);
    else if (j->bits == Q4K || j->bits == Q5K)
        panel_k(j->bits, a, n0, nb, w, d, m);
    else if (j->bits == Q3K)
        panel_q3k(a, n0, nb, w, d);
    else if (j->bits == IQ4XS)
        panel_iq4xs(a, n0, nb, w, d);
    else if (j->bits == 6)
        panel_q6(a, n0, nb, w, d);
    else if (j->bits == Q2K)
        panel_q2k(a, n0, nb, w, d, m);
    else
        panel_q45(a, NULL, n0, nb, w, d, m);
    j->kt->ig_panel(&j->x, w, d, m, a->y + n0, a->N, nb);
}

int q_igemm(int bits, const qmat *a, const kernel_table *kt, int nthreads) {
    if (!kt->ig_xprep) return 1;
    const int64_t Kp = (a->K + 31) / 32 * 32, B = Kp / 32, T = (a->M + IG_MR - 1) / IG_MR;
    /* the codes' offset: asymmetric (mins, q4_k's, q5_k's and q2_k's too) 0, else int4 8,
     * int5 16, int6 32, int8, q3_k and iq4_xs 128 */
    const int o = bits == 8 || bits == Q3K || bits == IQ4XS            ? 128
                  : a->mins || bits == Q4K || bits == Q5K || bits == Q2K ? 0
                  : bits == 6                                            ? 32
                  : bits == 5                                            ? 16
                                                                         : 8;
    const int halves = bits == 6 || bits == Q2K; /* a scale per 16 */
    ig_job j = {.a = a, .kt = kt, .bits = bits, .o = o};
    int8_t *digits = alloc64((size_t)(T * B * 8 * 256));
    /* per tile, block and row: sx, xs, off, and with halves off_lo and xs_lo */
    const int64_t n = T * B * IG_MR;
    float *sx = alloc64((size_t)n * (3 + 2 * halves) * 4);
    j.x = (ig_x){digits, sx, sx + n, (int32_t *)(sx + 2 * n), halves ? (int32_t *)(sx + 3 * n) : NULL,
                 halves && o == 0 ? sx + 4 * n : NULL, a->M, Kp,
                 bits == 8 || bits == Q3K || bits == IQ4XS ? 255
                 : bits == 6                              ? 63
                 : bits == 5 || bits == Q5K               ? 31
                                                          : 15};
    j.bad = calloc((size_t)T, 1);
    /* codes, then d and m: per 32, or per 16 with halves */
    j.panel_bytes = (IG_NR * Kp + 2 * (1 + halves) * IG_NR * B * (int64_t)sizeof(float) + 63) / 64 * 64;
    const int64_t n_panels = (a->N + IG_NR - 1) / IG_NR;
    const int threads = nthreads < n_panels ? nthreads : (int)n_panels;
    j.scratch = alloc64((size_t)(threads * j.panel_bytes));
    int rc = -1;
    if (digits && sx && j.bad && j.scratch) {
        pool_run(nthreads, T, xprep_task, &j);
        rc = memchr(j.bad, 1, (size_t)T) ? 1 : 0;
        if (!rc) pool_run(threads, n_panels, panel_task, &j);
    }
    free(digits);
    free(sx);
    free(j.bad);
    free(j.scratch);
    return rc;
}
