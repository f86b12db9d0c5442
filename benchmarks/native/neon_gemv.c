/* One matmul (K = 4096, one thread) of a super-block kind on a path, for
   benchmarks/neon_instructions.py to count its instructions under qemu:

     neon_gemv ISA KIND N M [setup-only]

   ISA as kernels.h numbers the paths, KIND ggml's type id (int6: 6), N rows of random
   blocks, M rows of x (1: a GEMV; 32: a prompt's GEMM); with a fifth argument the matmul
   is skipped (the setup's count). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../tests/native/random_inputs.h"
#include "kernels.h"

int main(int argc, char **argv) {
    if (argc < 5) return 2;
    const int isa = atoi(argv[1]), kind = atoi(argv[2]);
    const int64_t N = atoi(argv[3]), M = atoi(argv[4]), K = 4096, B = K / 256;
    const int64_t bytes = kind == 6 ? Q6_BLOCK_BYTES : kind == Q5K ? Q5K_BLOCK_BYTES
                        : kind == Q4K ? Q4K_BLOCK_BYTES : kind == Q3K ? Q3K_BLOCK_BYTES
                        : kind == Q2K ? Q2K_BLOCK_BYTES : IQ4XS_BLOCK_BYTES;
    const int d_at = kind == 6 ? 208 : kind == Q3K ? 108 : kind == Q2K ? 80 : 0;
    float *x = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * N);
    uint8_t *qw = malloc((size_t)(N * B * bytes));
    activations(x, M * K);
    for (int64_t i = 0; i < N * B * bytes; i++) qw[i] = (uint8_t)next_u32();
    for (int64_t blk = 0; blk < N * B; blk++) {
        const uint16_t d = rand_half();
        memcpy(qw + blk * bytes + d_at, &d, 2);
        if (kind == Q4K || kind == Q5K) memcpy(qw + blk * bytes + 2, &d, 2);
    }
    qmat a = {.x = x, .y = y, .qw = qw, .M = M, .N = N, .K = K, .g = 256};
    if (argc < 6 && q_matmul(kind, &a, isa, 1)) return 1;
    printf("%g\n", y[0]);
    return 0;
}
