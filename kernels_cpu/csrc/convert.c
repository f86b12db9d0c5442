/* Rewriting a GGUF file's blocks into a kernel format's, at load: GGUF Q3_K's blocks as
 * int6's (Q6_K's layout), the same values bit for bit. runtime/files/gguf_blocks.py
 * documents the two layouts; kernels_cpu/reference.py's q3k_to_q6k is the reference. */
#include <string.h>

#include "kernels.h"

enum { Q3K_BYTES = 110, Q6K_BYTES = 210, CONVERT_TASK_BLOCKS = 4096 };

/* One block: element 128 h + 32 j + i of Q3_K is bits 2j of qs[32 h + i] plus 4 if bit
 * 4h + j of hmask[i] is set, minus 4; as Q6_K's code it is that plus 32, in ql's nibble
 * and qh's 2 bits for quarter j of half h. Group g's 6-bit scale s (low 4 bits in byte
 * g % 8, nibble g / 8; high 2 in byte 8 + g % 4, bits 2 (g / 4)) becomes int8 s - 32. */
static void q3k_block(const uint8_t *src, uint8_t *dst) {
    const uint8_t *hm = src, *qs = src + 32, *sc = src + 96;
    uint8_t *ql = dst, *qh = dst + 128;
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 32; i++) {
            uint8_t q[4];
            for (int j = 0; j < 4; j++)
                q[j] = (uint8_t)(((qs[32 * h + i] >> (2 * j)) & 3) + 4 * ((hm[i] >> (4 * h + j)) & 1) + 28);
            ql[64 * h + i] = (uint8_t)((q[0] & 15) | (q[2] & 15) << 4);
            ql[64 * h + 32 + i] = (uint8_t)((q[1] & 15) | (q[3] & 15) << 4);
            qh[32 * h + i] = (uint8_t)(q[0] >> 4 | (q[1] >> 4) << 2 | (q[2] >> 4) << 4 | (q[3] >> 4) << 6);
        }
    for (int g = 0; g < 16; g++) {
        const int s = ((sc[g % 8] >> (4 * (g / 8))) & 15) | ((sc[8 + g % 4] >> (2 * (g / 4))) & 3) << 4;
        dst[192 + g] = (uint8_t)(int8_t)(s - 32);
    }
    memcpy(dst + 208, src + 108, 2); /* d */
}

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    int64_t n;
} convert_job;

static void convert_task(void *ctx, int64_t t, int tid) {
    (void)tid;
    const convert_job *j = ctx;
    const int64_t b1 = (t + 1) * CONVERT_TASK_BLOCKS < j->n ? (t + 1) * CONVERT_TASK_BLOCKS : j->n;
    for (int64_t b = t * CONVERT_TASK_BLOCKS; b < b1; b++)
        q3k_block(j->src + b * Q3K_BYTES, j->dst + b * Q6K_BYTES);
}

void q3k_to_q6k(const uint8_t *src, uint8_t *dst, int64_t nblocks, int nthreads) {
    convert_job j = {src, dst, nblocks};
    pool_run(nthreads, (nblocks + CONVERT_TASK_BLOCKS - 1) / CONVERT_TASK_BLOCKS, convert_task, &j);
}
