/* Random inputs for the native kernel checks (lut_neon_check.c, q_neon_check.c):
   deterministic, so a failure repeats. */
#ifndef INFER_TESTS_RANDOM_INPUTS_H
#define INFER_TESTS_RANDOM_INPUTS_H

#include <stdint.h>

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) { /* xorshift64* */
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (uint32_t)((rng * 0x2545F4914F6CDD1Dull) >> 32);
}
static float uniform(void) { return (float)(next_u32() >> 8) / 16777216.0f; }

/* A float16 of magnitude 2^-6 .. 2^2 and random sign */
static uint16_t rand_half(void) {
    uint32_t r = next_u32();
    return (uint16_t)(((r & 1) << 15) | ((9 + (r >> 1) % 8) << 10) | ((r >> 4) & 0x3ff));
}

/* heavy-tailed activations (outliers set a group's scale), as hidden states */
static void activations(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float u = uniform();
        x[i] = (2.0f * uniform() - 1.0f) * u * u * u * u * 3.0f;
    }
}

#endif
