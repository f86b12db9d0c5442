/* The NEON int8, int4, int5, int6 and super-block kinds' matmuls (kernels_cpu/csrc/neon.c,
   q4k_q5k.c, q2k_q3k.c, iq4xs.c, igemm_neon.c) against the scalar path, without Python.

   AArch64 only; tests/test_neon.py builds it with a cross compiler and runs it under
   qemu-aarch64, once on a CPU with dotprod and once without:

     aarch64-linux-gnu-gcc -O2 -std=c11 -ffp-contract=off -pthread -Ikernels_cpu/csrc \
         tests/native/q_neon_check.c \
         kernels_cpu/csrc/{pool,cpu,scalar,neon,matmul,igemm,igemm_neon,q4k_q5k,q2k_q3k,iq4xs}.c \
         -lm -o q_neon
     qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu max ./q_neon   (or -cpu cortex-a53)

   Awkward shapes as tests/test_kernels_q.py's: M = 1 and 3 (a GEMV per row), 7 and 12 (a
   GEMV per row when K >= 768, else the float GEMM; kernels.h's SMALL_M, WIDE_M), 16 and 41
   (neondot's integer GEMM: one tile, and two with a part); N odd; K = 32 x odd (256 x 1, 3, 6 for the blocks
   of 256). Each result must equal the scalar path's up to float summation order (1e-5 of
   sum |x| |w|) and, where the rows run one of the digit GEMVs or the integer GEMM, what x's
   two int8 digits lose: half a step, amax / IG_XMAX per block of 32 (kernels.h), and
   float32's rounding of it, times sum |w| over the block.
   1 and 2 threads must give the same bits; where dotprod runs, neon (sdot emulated) the
   bits of neondot but for int4 (float x on neon) and from 16 rows (neondot's integer GEMM,
   neon's float one). Prints "dotprod=D cases=C" and exits 0 when every case holds, 1
   otherwise. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "random_inputs.h"

/* W[n, k] as the format defines it (kernels.h, "Quantized matmul") */
static double weight(const qmat *a, int bits, int64_t n, int64_t k) {
    const int64_t K = a->K, g = a->g;
    if (bits == 8) {
        const double q = ((const int8_t *)a->qw)[n * K + k];
        return g ? q * half_to_float(((const uint16_t *)a->scales)[n * (K / g) + k / g])
                 : q * ((const float *)a->scales)[n];
    }
    const uint8_t byte = ((const uint8_t *)a->qw)[n * (K / 2) + k / 32 * 16 + k % 16];
    int q = k % 32 < 16 ? byte & 15 : byte >> 4;
    if (bits == 5) q |= ((a->qh[n * (K / 8) + k / 8] >> (k % 8)) & 1) << 4; /* bit k % 32 */
    const int64_t G = n * (K / g) + k / g;
    const double d = half_to_float(((const uint16_t *)a->scales)[G]);
    return a->mins ? q * d + half_to_float(a->mins[G]) : (q - (bits == 5 ? 16 : 8)) * d;
}

/* Runs `a` (its x and weights set) on the scalar path and on `isa` with 1 and 2 threads.
   Each result must equal the scalar one up to float summation order (1e-5 of sum |x| |w|,
   w the N x K weights as the format defines them) and, with two_digits, what x's two int8
   digits lose: half a step, amax / IG_XMAX per block of 32, and float32's rounding of it,
   times sum |w| over the block. 1 and 2 threads must give the same bits, and with
   `as_neon` neondot the bits of neon (whose sdot is kernels.h's exact emulation). `what`
   names the case in a failure. */
static int compare(int isa, int bits, qmat *a, const float *w, int two_digits, int as_neon,
                   const char *what) {
    const int64_t M = a->M, N = a->N, K = a->K;
    const float *x = a->x;
    float *ys = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * M * N),
          *y2 = malloc(sizeof(float) * M * N);
    int bad = 0;
    a->y = ys;
    if (q_matmul(bits, a, ISA_SCALAR, 1)) bad = 1;
    a->y = y1;
    if (q_matmul(bits, a, isa, 1)) bad = 1;
    a->y = y2;
    if (q_matmul(bits, a, isa, 2)) bad = 1;
    if (memcmp(y1, y2, sizeof(float) * M * N)) {
        printf("THREADS %s %s M=%ld N=%ld K=%ld: 1 and 2 threads differ\n", isa_name(isa), what,
               (long)M, (long)N, (long)K);
        bad = 1;
    }
    if (as_neon && isa == ISA_NEON_DOT) {
        a->y = y2;
        if (q_matmul(bits, a, ISA_NEON, 1) || memcmp(y1, y2, sizeof(float) * M * N)) {
            printf("NEON %s M=%ld N=%ld K=%ld: neon and neondot differ\n", what, (long)M,
                   (long)N, (long)K);
            bad = 1;
        }
    }
    for (int64_t m = 0; m < M && !bad; m++)
        for (int64_t n = 0; n < N; n++) {
            double tol = 1e-30, digits = 0;
            for (int64_t b = 0; b < K / 32; b++) {
                double amax = 0, wsum = 0;
                for (int64_t k = 32 * b; k < 32 * b + 32; k++) {
                    const double wk = fabs(w[n * K + k]), xk = fabs(x[m * K + k]);
                    tol += 1e-5 * wk * xk;
                    wsum += wk;
                    amax = xk > amax ? xk : amax;
                }
                digits += amax * wsum;
            }
            if (two_digits) tol += (0.5 / IG_XMAX + 0x1p-21) * digits;
            const double err = fabs((double)y1[m * N + n] - ys[m * N + n]);
            if (!(err <= tol)) {
                printf("MISMATCH %s %s M=%ld N=%ld K=%ld at (%ld, %ld): %.9g against %.9g "
                       "(tolerance %.3g)\n", isa_name(isa), what, (long)M, (long)N, (long)K, (long)m,
                       (long)n, y1[m * N + n], ys[m * N + n], tol);
                bad = 1;
                break;
            }
        }
    free(ys), free(y1), free(y2);
    return bad;
}

static int runs_gemv(int64_t M, int64_t K) { return M <= SMALL_M || (M <= WIDE_M && K >= WIDE_K); }

/* Whether `isa` runs a matmul of M rows on x's two digits: a digit GEMV (`digits`: the
   path has one for the kind), or the integer GEMM (neondot's). */
static int on_digits(int isa, int kind, int digits, int64_t M, int64_t K) {
    if (M >= IGEMM_MIN_M) return (kernels_for(isa)->ig_kinds & IG_KIND(kind)) != 0;
    return digits && runs_gemv(M, K);
}

static int check(int isa, int bits, int g, int sym, int64_t M, int64_t N, int64_t K) {
    const int64_t nq = bits == 8 ? N * K : N * K / 2, ns = g ? N * (K / g) : N;
    float *x = malloc(sizeof(float) * M * K), *w = malloc(sizeof(float) * N * K);
    uint8_t *qw = malloc((size_t)nq), *qh = malloc((size_t)(N * K / 8));
    uint16_t *s = malloc(2 * ns), *mn = sym ? NULL : malloc(2 * ns);
    float *sf = malloc(sizeof(float) * N);
    activations(x, M * K);
    if (M > 1) memset(x + K, 0, sizeof(float) * 32); /* a block of zeros */
    if (M > 2)
        for (int k = 0; k < 32; k++) x[2 * K + k] *= 1e-30f; /* a block of tiny values */
    for (int64_t i = 0; i < nq; i++) qw[i] = (uint8_t)next_u32();
    for (int64_t i = 0; i < N * K / 8; i++) qh[i] = (uint8_t)next_u32();
    for (int64_t i = 0; i < ns; i++) s[i] = rand_half();
    for (int64_t i = 0; mn && i < ns; i++) mn[i] = rand_half();
    for (int64_t i = 0; i < N; i++) sf[i] = uniform() * 0.02f + 0.001f;
    qmat a = {.x = x, .qw = qw, .scales = bits == 8 && !g ? (const void *)sf : s, .mins = mn,
              .M = M, .N = N, .K = K, .g = g, .qh = bits == 5 ? qh : NULL};
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) w[n * K + k] = (float)weight(&a, bits, n, k);
    const kernel_table *kt = kernels_for(isa);
    const int digits = (bits == 4 && kt->q4_xprep) || (bits == 5 && kt->q5_xprep);
    char what[64];
    snprintf(what, sizeof what, "bits=%d g=%d sym=%d", bits, g, sym);
    const int bad = compare(isa, bits, &a, w, on_digits(isa, bits, digits, M, K),
                            bits != 4 && M < IGEMM_MIN_M, what);
    free(x), free(w), free(qw), free(qh), free(s), free(mn), free(sf);
    return bad;
}

/* The super-block kinds' kernels on a path (NULL for int6, which hangs off the table) */
static const sb_kernels *sb_of(int kind, const kernel_table *kt) {
    return kind == Q4K ? q4k_for(kt) : kind == Q5K ? q5k_for(kt) : kind == Q3K ? q3k_for(kt)
         : kind == Q2K ? q2k_for(kt) : kind == IQ4XS ? iq4xs_for(kt) : NULL;
}

/* int6, q5_k, q4_k, q3_k, q2_k and iq4_xs (GGUF's blocks, random bytes with sane float16 d
   and dmin) against the scalar path, with the same tolerances; the weights from the
   scalar dequantization. The neon GEMVs take x as int4's two digits per block of 32. */
static int check_kq(int isa, int kind, int64_t M, int64_t N, int64_t K) {
    const int64_t bytes = kind == 6 ? Q6_BLOCK_BYTES : kind == Q5K ? Q5K_BLOCK_BYTES
                        : kind == Q4K ? Q4K_BLOCK_BYTES : kind == Q3K ? Q3K_BLOCK_BYTES
                        : kind == Q2K ? Q2K_BLOCK_BYTES : IQ4XS_BLOCK_BYTES;
    const int d_at = kind == 6 ? 208 : kind == Q3K ? 108 : kind == Q2K ? 80 : 0; /* float16 d */
    const int dmin_at = kind == Q4K || kind == Q5K ? 2 : kind == Q2K ? 82 : -1;
    const int64_t B = K / Q4K_BLOCK;
    float *x = malloc(sizeof(float) * M * K), *w = malloc(sizeof(float) * N * K);
    uint8_t *qw = malloc((size_t)(N * B * bytes));
    activations(x, M * K);
    if (M > 1) memset(x + K, 0, sizeof(float) * 32); /* a block of zeros */
    for (int64_t i = 0; i < N * B * bytes; i++) qw[i] = (uint8_t)next_u32();
    for (int64_t blk = 0; blk < N * B; blk++) {
        const uint16_t d = rand_half(), dmin = rand_half();
        memcpy(qw + blk * bytes + d_at, &d, 2);
        if (dmin_at >= 0) memcpy(qw + blk * bytes + dmin_at, &dmin, 2);
    }
    qmat a = {.x = x, .qw = qw, .M = M, .N = N, .K = K, .g = Q4K_BLOCK};
    if (kind == 6)
        q6_dequant_c(&a, 0, N, w);
    else
        sb_of(kind, kernels_for(ISA_SCALAR))->dequant(&a, 0, N, w);
    const kernel_table *kt = kernels_for(isa);
    const int digits = kind == 6 ? kt->q6_xprep != NULL : sb_of(kind, kt)->xprep != NULL;
    char what[32];
    snprintf(what, sizeof what, "kind=%d", kind);
    const int bad = compare(isa, kind, &a, w, on_digits(isa, kind, digits, M, K), M < IGEMM_MIN_M,
                            what);
    free(x), free(w), free(qw);
    return bad;
}

int main(void) {
    const int dot = cpu_has("dotprod");
    if (isa_supported(ISA_NEON_DOT) != dot) {
        printf("DISPATCH neondot supported=%d, dotprod=%d\n", isa_supported(ISA_NEON_DOT), dot);
        return 1;
    }
    /* (bits, g, symmetric) as tests/test_kernels_q.py's KINDS, int6 aside (check_kq) */
    static const int KINDS[][3] = {{8, 0, 1},  {8, 32, 1},  {8, 64, 1},  {8, 128, 1},
                                   {4, 32, 1}, {4, 32, 0},  {4, 64, 1},  {4, 64, 0},
                                   {4, 128, 1}, {4, 128, 0}, {5, 32, 1}, {5, 32, 0}};
    static const int64_t KS[] = {32 * 7, 128 * 3, 32 * 5, 32 * 38, 64 * 3};
    static const int64_t NS[] = {1, 37};
    static const int64_t MS[] = {1, 3, 7, 12, 16, 41};
    const int isas[2] = {ISA_NEON, ISA_NEON_DOT};
    int cases = 0, bad = 0;
    for (int i = 0; i < (dot ? 2 : 1); i++)
        for (size_t k = 0; k < sizeof KINDS / sizeof *KINDS; k++)
            for (size_t kk = 0; kk < sizeof KS / sizeof *KS; kk++) {
                if (KINDS[k][1] && KS[kk] % KINDS[k][1]) continue;
                for (size_t n = 0; n < sizeof NS / sizeof *NS; n++)
                    for (size_t m = 0; m < sizeof MS / sizeof *MS; m++, cases++)
                        bad |= check(isas[i], KINDS[k][0], KINDS[k][1], KINDS[k][2], MS[m],
                                     NS[n], KS[kk]);
            }
    static const int KQ[] = {6, Q5K, Q4K, Q3K, Q2K, IQ4XS};
    static const int64_t KQ_KS[] = {256, 256 * 3, 256 * 6};
    for (int i = 0; i < (dot ? 2 : 1); i++)
        for (size_t k = 0; k < sizeof KQ / sizeof *KQ; k++)
            for (size_t kk = 0; kk < sizeof KQ_KS / sizeof *KQ_KS; kk++)
                for (size_t n = 0; n < sizeof NS / sizeof *NS; n++)
                    for (size_t m = 0; m < sizeof MS / sizeof *MS; m++, cases++)
                        bad |= check_kq(isas[i], KQ[k], MS[m], NS[n], KQ_KS[kk]);
    printf("dotprod=%d cases=%d %s\n", dot, cases, bad ? "FAILED" : "ok");
    return bad;
}
