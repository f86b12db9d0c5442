/* The machine's read bandwidth, measured the way the kernels read: a streaming sum over
 * a large buffer, split into chunks on the same pool (llm.c's napkin math needs the
 * ceiling measured, not quoted). */
#include <stdlib.h>

#include "kernels.h"

#ifdef INFER_X86
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

enum { CHUNK = 1 << 20 };

static double sum_scalar(const uint64_t *p, int64_t n) {
    uint64_t s[4] = {0};
    for (int64_t i = 0; i < n / 8; i += 4) {
        s[0] += p[i];
        s[1] += p[i + 1];
        s[2] += p[i + 2];
        s[3] += p[i + 3];
    }
    return (double)(s[0] + s[1] + s[2] + s[3]);
}

#ifdef INFER_X86
TARGET_AVX2 static double sum_avx2(const uint64_t *p, int64_t n) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < n / 8; i += 16) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i *)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i *)(p + i + 4)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i *)(p + i + 8)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i *)(p + i + 12)));
    }
    s0 = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, s0);
    return (double)(out[0] + out[1] + out[2] + out[3]);
}

TARGET_AVX512 static double sum_avx512(const uint64_t *p, int64_t n) {
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < n / 8; i += 32) {
        s0 = _mm512_add_epi64(s0, _mm512_loadu_si512(p + i));
        s1 = _mm512_add_epi64(s1, _mm512_loadu_si512(p + i + 8));
        s2 = _mm512_add_epi64(s2, _mm512_loadu_si512(p + i + 16));
        s3 = _mm512_add_epi64(s3, _mm512_loadu_si512(p + i + 24));
    }
    s0 = _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3));
    return (double)_mm512_reduce_add_epi64(s0);
}
#endif

#if defined(__aarch64__)
static double sum_neon(const uint64_t *p, int64_t n) {
    uint64x2_t s0 = vdupq_n_u64(0), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < n / 8; i += 8) {
        s0 = vaddq_u64(s0, vld1q_u64(p + i));
        s1 = vaddq_u64(s1, vld1q_u64(p + i + 2));
        s2 = vaddq_u64(s2, vld1q_u64(p + i + 4));
        s3 = vaddq_u64(s3, vld1q_u64(p + i + 6));
    }
    s0 = vaddq_u64(vaddq_u64(s0, s1), vaddq_u64(s2, s3));
    return (double)(vgetq_lane_u64(s0, 0) + vgetq_lane_u64(s0, 1));
}
#endif

typedef struct {
    const char *p;
    int64_t n;
    int isa;
    double *sums;
} job_t;

static void task(void *ctx, int64_t t, int tid) {
    (void)tid;
    const job_t *j = ctx;
    const int64_t off = t * CHUNK, n = j->n - off < CHUNK ? j->n - off : CHUNK;
    const uint64_t *p = (const uint64_t *)(j->p + off);
    double s;
    switch (j->isa) {
#ifdef INFER_X86
    case ISA_AVX512:
    case ISA_AVX512_VNNI: s = sum_avx512(p, n); break;
    case ISA_AVX2:
    case ISA_AVX2_VNNI: s = sum_avx2(p, n); break;
#endif
#if defined(__aarch64__)
    case ISA_NEON:
    case ISA_NEON_DOT: s = sum_neon(p, n); break;
#endif
    default: s = sum_scalar(p, n); break;
    }
    j->sums[t] = s;
}

double stream_read(const void *p, int64_t n, int isa, int nthreads) {
    int64_t n_tasks = (n + CHUNK - 1) / CHUNK;
    job_t j = {p, n, isa, calloc((size_t)n_tasks, sizeof(double))};
    if (!j.sums) return -1;
    pool_run(nthreads, n_tasks, task, &j);
    double s = 0;
    for (int64_t t = 0; t < n_tasks; t++) s += j.sums[t];
    free(j.sums);
    return s;
}
