/* The NEON LUT-GEMV path against the scalar one, bit for bit, without Python.

   AArch64 only; tests/test_neon.py builds it with a cross compiler and runs it under
   qemu-aarch64, once on a CPU with dotprod and once without:

     aarch64-linux-gnu-gcc -O2 -std=c11 -ffp-contract=off -pthread -DINFER_NO_PYTHON \
         -Ikernels_cpu/csrc tests/native/lut_neon_check.c kernels_cpu/csrc/pool.c \
         kernels_cpu/csrc/cpu.c kernels_cpu/csrc/scalar.c kernels_cpu/csrc/neon.c \
         kernels_cpu/csrc/igemm_neon.c kernels_cpu/csrc/lut.c kernels_cpu/csrc/lut_scalar.c \
         kernels_cpu/csrc/lut_neon.c -lm -o lut_neon
     qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu max ./lut_neon   (or -cpu cortex-a53)

   Prints "dotprod=D cases=C" and exits 0 when every case matches, 1 otherwise. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lut_common.h"
#include "random_inputs.h"

/* x W^T in double from the dequantized weights, for a loose check of the scalar path */
static double exact(const float *x, const uint8_t *qw, const uint16_t *s, const uint16_t *mn,
                    int64_t N, int64_t K, int bits, int g, int64_t n) {
    double acc = 0.0;
    for (int64_t k = 0; k < K; k++) {
        int q = 0;
        for (int p = 0; p < bits; p++)
            q |= ((qw[(p * N + n) * (K / 8) + k / 8] >> (k % 8)) & 1) << p;
        const int64_t G = n * (K / g) + k / g;
        acc += ((double)q * half_to_float(s[G]) + half_to_float(mn[G])) * x[k];
    }
    return acc;
}

static int check(int64_t M, int64_t N, int64_t K, int g, int bits, int dot) {
    const int64_t nq = (int64_t)bits * N * K / 8, ns = N * (K / g);
    float *x = malloc(sizeof(float) * M * K), *ys = malloc(sizeof(float) * M * N),
          *yn = malloc(sizeof(float) * M * N);
    uint8_t *qw = malloc((size_t)nq);
    uint16_t *s = malloc(2 * ns), *mn = malloc(2 * ns);
    activations(x, M * K);
    if (M > 1) memset(x + K, 0, sizeof(float) * g); /* a group of zeros: zero tables */
    for (int64_t i = 0; i < nq; i++) qw[i] = (uint8_t)next_u32();
    for (int64_t i = 0; i < ns; i++) s[i] = rand_half(), mn[i] = rand_half();
    int bad = 0;
    /* tables and constants of every activation row: the NEON builder gives the same bits */
    const int64_t tb = (int64_t)tables_bytes(K), ng = K / g;
    int8_t *t0 = malloc((size_t)tb), *t1 = malloc((size_t)tb);
    float *f0 = malloc(sizeof(float) * 3 * ng), *f1 = malloc(sizeof(float) * 3 * ng);
    for (int64_t m = 0; m < M; m++) {
        lut_build_tables(x + m * K, K, g, bits, t0, f0, f0 + ng, f0 + 2 * ng);
        memset(t1, 0x55, (size_t)tb);
        lut_tables_row(x + m * K, K, g, bits, lut_isa(ISA_NEON), t1, f1, f1 + ng, f1 + 2 * ng);
        if (memcmp(t0, t1, (size_t)tb) || memcmp(f0, f1, sizeof(float) * 3 * ng)) {
            printf("TABLES differ: row %ld K=%ld g=%d bits=%d\n", (long)m, (long)K, g, bits);
            bad = 1;
        }
    }
    free(t0), free(t1), free(f0), free(f1);
    if (lut_matmul(x, qw, s, mn, ys, M, N, K, bits, g, ISA_SCALAR, 1)) bad = 1;
    /* the requested paths: neon, neondot where this CPU has it, on 1 and 2 threads */
    const int isas[3] = {ISA_NEON, ISA_NEON, ISA_NEON_DOT}, threads[3] = {1, 2, 1};
    for (int i = 0; i < (dot ? 3 : 2); i++) {
        memset(yn, 0xff, sizeof(float) * M * N);
        if (lut_matmul(x, qw, s, mn, yn, M, N, K, bits, g, isas[i], threads[i]) ||
            memcmp(ys, yn, sizeof(float) * M * N)) {
            for (int64_t e = 0; e < M * N; e++)
                if (memcmp(ys + e, yn + e, sizeof(float))) {
                    printf("MISMATCH %s threads=%d M=%ld N=%ld K=%ld g=%d bits=%d at (%ld, %ld):"
                           " %.9g != %.9g\n", isa_name(isas[i]), threads[i], (long)M, (long)N,
                           (long)K, g, bits, (long)(e / N), (long)(e % N), ys[e], yn[e]);
                    break;
                }
            bad = 1;
        }
    }
    /* scalar against the exact product: the tables' int8 rounding, a few percent at most */
    double err = 0.0, ref = 0.0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double e = exact(x + m * K, qw, s, mn, N, K, bits, g, n);
            err += (ys[m * N + n] - e) * (ys[m * N + n] - e);
            ref += e * e;
        }
    if (!(err <= 0.03 * 0.03 * ref)) {
        printf("SCALAR OFF M=%ld N=%ld K=%ld g=%d bits=%d: rel err %.3g\n", (long)M, (long)N,
               (long)K, g, bits, sqrt(err / ref));
        bad = 1;
    }
    free(x), free(ys), free(yn), free(qw), free(s), free(mn);
    return bad;
}

int main(void) {
    const int dot = cpu_has("dotprod");
    /* the dispatch: the NEON path for both requests (neondot only where the CPU has it) */
    if (lut_isa(ISA_NEON) != ISA_NEON || lut_isa(ISA_NEON_DOT) != (dot ? ISA_NEON : ISA_SCALAR)) {
        printf("DISPATCH neon -> %d, neondot -> %d (dotprod=%d)\n", lut_isa(ISA_NEON),
               lut_isa(ISA_NEON_DOT), dot);
        return 1;
    }
    /* (K, g): K % 256 != 0, a group of 32 with K % 64 = 32, g = 96 (units across chunks),
       g = 128, and groups that are not a multiple of 32 (scalar) */
    static const int64_t KG[][2] = {{64, 64},   {192, 64}, {576, 64}, {448, 64}, {160, 32},
                                    {1024, 128}, {384, 128}, {192, 96}, {72, 8},  {96, 16},
                                    {96, 32}};
    static const int64_t NS[] = {1, 16, 37, 67};
    static const int64_t MS[] = {1, 7};
    int cases = 0, bad = 0;
    for (size_t k = 0; k < sizeof KG / sizeof *KG; k++)
        for (int bits = 1; bits <= 4; bits++)
            for (size_t n = 0; n < sizeof NS / sizeof *NS; n++)
                for (size_t m = 0; m < sizeof MS / sizeof *MS; m++, cases++)
                    bad |= check(MS[m], NS[n], KG[k][0], (int)KG[k][1], bits, dot);
    printf("dotprod=%d cases=%d %s\n", dot, cases, bad ? "FAILED" : "ok");
    return bad;
}
