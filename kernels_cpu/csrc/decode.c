/* Decoded tokens through every block of a dense Llama-family or Gemma 3 model, in one call:
   R rows, each a token of its own sequence at its own position (several conversations
   decoded together), or tokens of one sequence at consecutive positions (guessed tokens
   checked at once). Every weight matrix is read once for all rows; each row computes
   exactly what it would alone (the GEMVs run per row: q_gemv_many), and attends to its
   own sequence's cache.

   The reference is runtime/model/llama.py: Block.forward for T = 1 (RMSNorm, q/k/v projections
   with optional bias, optional per-head q/k RMSNorm, rotate-half rope, KV cache write,
   grouped-query attention with an optional sliding window, o projection, residual, RMSNorm,
   SiLU(gate) * up, down projection, residual), and runtime/model/gemma3.py's Block (norms
   after attention and after the MLP, tanh-GELU(gate) * up, its own attention scale, each
   layer its rope table and window). kernels_cpu/decode.py builds the plan from
   the model's tensors and tests compare the two. Why it exists: at the default model's
   size a token is ~200 small matmuls and ~1,200 torch element-wise ops, whose Python and
   dispatch cost (`infer bench --roofline` shows it) rivals the matmuls themselves. Here the element-wise work is a few loops over vectors
   of `dim` floats, and the matmuls are the quantized kernels called directly.

   The plan is an int64 array (decode.py writes it, field order below): a header, then one
   row per layer. Pointers are addresses of tensors the model keeps alive; the plan is
   rebuilt whenever the model's tensors change.

   header:  n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, max_seq (the rope
            tables' positions), eps (float32 bits), scratch (float32, scratch_floats below),
            qk_norm_full (1: the q and k norms are over the whole projection, as OLMoE's;
            0: per head), act (0: SiLU, 1: tanh GELU), attention scale (float32 bits; 0:
            1/sqrt(head_dim)), rows (the most rows the scratch holds), HEADER = 13 words
   layer:   attn_norm, ffn_norm, q_norm (0: none), k_norm, post_attn_norm, post_ffn_norm
            (0: none), rope_cos, rope_sin (float32 (max_seq, head_dim)), window (0: none);
            every norm weight w as out = w * normed x (Gemma's 1 + w already added), then
            7 linears q k v o gate up down,
            each LIN = 9 words: kind (8 int8, 6 int6, 5 int5, 4 int4, 10-13 and 23 the
            super-block kinds q2_k .. q5_k and iq4_xs (kernels.h Q2K .. Q5K, IQ4XS),
            -1..-4 = -bits for lut),
            qweight, scales, mins (0: none), bias (float32, 0: none), N, K, g, qh (int5's
            high bits; else 0)

   Each call also takes, per row, its position and its sequence's cache (runtime/model/
   kvcache.py has the formats), CACHE_WORDS(n_layers) words a row: seq (positions the
   cache holds), kind (KV_F32, KV_BF16, KV_INT8), group (int8: values per scale), then
   per layer k_cache, v_cache ((n_kv_heads, seq, head_dim) of float32, bf16 or int8),
   k_scales, v_scales (int8: float16 (n_kv_heads, seq, head_dim / group); else unused).
   Rows of one sequence must come in position order: every row's keys and values are
   written before any row attends. A row's keys and values are written in its cache's
   format (kv_store); attention converts a bf16 or int8 sub-block of positions to float32
   in the task's buffer and reads it as it reads a float32 cache in place, so the formats
   differ from float32 only in the values stored.

   A mixture-of-experts layer has kind 0 in its gate, up and down words: decode_layers
   stops there after the attention half, with the rows' MoE inputs ffn_norm(x) in the
   scratch's first R * dim floats, and returns the layer's index. The caller routes that input
   (runtime/model/moe.py's MoE.route, in torch: the routing is the model's own), and
   decode_experts adds the chosen experts' weighted outputs (and a shared expert's) to x,
   as MoE.forward does for one token; then decode_layers goes on from the next layer.
   Experts are a table of (gate, up, down) LIN triples, one row per expert, the shared
   expert's last.
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "binding.h"
#include "kernels.h"

enum { HEADER = 13, LIN = 9, LAYER = 9 + 7 * LIN };
#define CACHE_WORDS(n_layers) (3 + 4 * (n_layers))
enum { KV_F32, KV_BF16, KV_INT8 }; /* a cache's kind (its second word) */
enum { L_Q, L_K, L_V, L_O, L_GATE, L_UP, L_DOWN };
/* Attention splits the attended positions into blocks of this many (see attn_block). */
enum { ATTN_BLOCK = 256 };

typedef struct {
    int64_t n_layers, dim, n_heads, n_kv, head_dim, hidden, max_seq, max_rows;
    float eps, attn_scale;
    /* scratch, a row each: (rows, dim), (rows, n_heads * head_dim), ... */
    float *xn, *q, *k, *v, *att, *gate, *up;
    float *part; /* attention's per-block partials: (rows, n_heads, blocks, head_dim + 2) */
    int isa, nthreads, qk_norm_full, act;
    int64_t R; /* rows in this call */
} model_t;

static int64_t attn_blocks(int64_t positions) { return (positions + ATTN_BLOCK - 1) / ATTN_BLOCK; }

/* Floats of scratch the plan's buffer must hold (decode.py's FusedDecode.prepare). */
static int64_t scratch_floats(const model_t *m) {
    const int64_t hd = m->n_heads * m->head_dim, kvd = m->n_kv * m->head_dim;
    return m->max_rows * (m->dim + 2 * hd + 2 * kvd + 2 * m->hidden +
                          m->n_heads * attn_blocks(m->max_seq) * (m->head_dim + 2));
}

static float bits_to_float(int64_t b) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)b};
    return v.f;
}

#define PTR(T, w) ((T)(intptr_t)(w))

/* y[i] = W_i x[i] (+ bias_i) for n <= Q_GEMV_MANY_MAX linears of the plan, x[i] (M_i, K_i)
   and y[i] (M_i, N_i), M_i = rows[i] (rows NULL: the call's R rows each): one pool job when all are int8/int6/int5/int4 (q_gemv_many; linears
   sharing an x quantize it once) or all lut (lut_gemv_many; linears sharing an x share
   its tables), else one such job a linear. Returns 0, or -1 when out of memory. */
static int linears_each(int n, const int64_t *const *L, const float *const *x,
                        float *const *y, const int64_t *rows, const model_t *m) {
    int bits[Q_GEMV_MANY_MAX];
    qmat a[Q_GEMV_MANY_MAX];
    lut_gemv la[Q_GEMV_MANY_MAX];
    const qmat *pa[Q_GEMV_MANY_MAX];
    int all_q = 1, all_lut = 1, rc = 0;
    for (int i = 0; i < n; i++) {
        all_q = all_q && L[i][0] > 0;
        all_lut = all_lut && L[i][0] < 0;
        bits[i] = (int)L[i][0];
        a[i] = (qmat){.x = x[i], .qw = PTR(const void *, L[i][1]),
                      .scales = PTR(const void *, L[i][2]), .mins = PTR(const uint16_t *, L[i][3]),
                      .y = y[i], .M = rows ? rows[i] : m->R, .N = L[i][5], .K = L[i][6],
                      .g = L[i][7], .qh = PTR(const uint8_t *, L[i][8])};
        la[i] = (lut_gemv){x[i], PTR(const uint8_t *, L[i][1]), PTR(const uint16_t *, L[i][2]),
                           PTR(const uint16_t *, L[i][3]), y[i], a[i].M, L[i][5], L[i][6],
                           (int)-L[i][0], (int)L[i][7]};
        pa[i] = &a[i];
    }
    if (all_q) {
        rc = q_gemv_many(n, bits, pa, m->isa, m->nthreads);
    } else if (all_lut) {
        rc = lut_gemv_many(n, la, m->isa, m->nthreads);
    } else {
        for (int i = 0; i < n; i++)
            rc |= bits[i] > 0 ? q_gemv_many(1, &bits[i], &pa[i], m->isa, m->nthreads)
                              : lut_gemv_many(1, &la[i], m->isa, m->nthreads);
    }
    for (int i = 0; i < n; i++) {
        const float *bias = PTR(const float *, L[i][4]);
        const int64_t N = L[i][5];
        if (bias)
            for (int64_t r = 0; r < a[i].M; r++)
                for (int64_t j = 0; j < N; j++) y[i][r * N + j] += bias[j];
    }
    return rc;
}

/* The same for n linears that share x. */
static int linears(int n, const int64_t *const *L, const float *x, float *const *y,
                   const model_t *m) {
    const float *xs[Q_GEMV_MANY_MAX];
    for (int i = 0; i < n; i++) xs[i] = x;
    return linears_each(n, L, xs, y, NULL, m);
}

static int linear(const int64_t *L, const float *x, float *y, const model_t *m) {
    return linears(1, &L, x, &y, m);
}

/* out = w * (x / sqrt(mean(x^2) + eps)), as RMSNorm.forward in float32 */
static void rmsnorm(const float *x, const float *w, float *out, int64_t n, float eps) {
    float p[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) p[j] += x[i + j] * x[i + j];
    float ss = ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* Rotate-half rope on each of n heads of x (n, d) at one position. */
static void rope(float *x, int64_t n, int64_t d, const float *cos, const float *sin) {
    const int64_t h = d / 2;
    for (int64_t j = 0; j < n; j++, x += d)
        for (int64_t i = 0; i < h; i++) {
            const float a = x[i], b = x[i + h];
            x[i] = a * cos[i] - b * sin[i];
            x[i + h] = b * cos[i + h] + a * sin[i + h];
        }
}

/* float32 -> float16, rounding to nearest even as torch's .to(torch.float16). */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return (uint16_t)(sign | 0x7e00);       /* NaN */
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);      /* rounds past 65504 */
    if (ax < 0x38800000)                                          /* below 2^-14: subnormal */
        return (uint16_t)(sign | (uint32_t)rintf(fabsf(f) * 16777216.0f)); /* in 2^-24s */
    uint32_t h = (ax - 0x38000000) >> 13; /* exponent rebiased, 10 bits of mantissa */
    const uint32_t rest = ax & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* a carry moves the exponent on */
    return (uint16_t)(sign | h);
}

/* float32 -> bfloat16, rounding to nearest even as torch's .to(torch.bfloat16). */
static uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffff) > 0x7f800000) return 0x7fc0; /* NaN */
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

/* n values of x (a multiple of g) into a cache of `kind` from element `at` (int8: its
   scales from at / g), as kvcache.py's KVCache.update and Int8KVCache.update store them:
   int8 per run of g, d = max |x| / 127 as float16, q = x * (1 / d) rounded to even. */
static void kv_store(int kind, int64_t g, const float *x, int64_t n, void *cache,
                     uint16_t *scales, int64_t at) {
    if (kind == KV_F32) {
        memcpy((float *)cache + at, x, (size_t)n * sizeof *x);
    } else if (kind == KV_BF16) {
        uint16_t *y = (uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++) y[i] = float_to_bf16(x[i]);
    } else {
        int8_t *q = (int8_t *)cache + at;
        for (int64_t j = 0; j < n / g; j++, x += g, q += g) {
            float amax = 0.0f;
            for (int64_t i = 0; i < g; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
            scales[at / g + j] = float_to_half(d);
            for (int64_t i = 0; i < g; i++) {
                const float r = rintf(x[i] * inv); /* NaN: 0 */
                q[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r == r ? r : 0.0f);
            }
        }
    }
}

/* ------------------------------------------------------------------------------------
 * Attention for one token, on 16-float vectors (GCC vector extensions): one source the
 * compiler turns into AVX-512, AVX2, or SSE2 / NEON code, chosen by the plan's
 * instruction set. Every path computes the same lanes in the same order, and
 * -ffp-contract=off keeps each multiply and add apart, so results do not depend on it.
 *
 * At long contexts attention is a token's largest cost, and it is memory-bound: the
 * attended keys and values are read once per key-value head (not once per query head
 * sharing it, nor once per row where a sequence's guesses are checked together), in blocks of ATTN_BLOCK positions that are the pool's tasks, with a
 * software prefetch 8 rows ahead (the hardware's alone left the loads stalling).
 * ---------------------------------------------------------------------------------- */

/* The helpers below are always inlined into their caller's target, so the ABI of passing
   64-byte vectors between functions (what -Wpsabi warns of) never comes into play. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define VI static inline __attribute__((always_inline))

VI v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

VI void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* The 16 lanes' sum: lanes i and i + 8, then i and i + 4, then (0 + 2) + (1 + 3). */
/* The 16 lanes' sum: lanes i and i + 8, then i and i + 4, then (0 + 2) + (1 + 3). */
VI float hsum16(v16 v) {
    float t[16], a[8];
    memcpy(t, &v, sizeof t);
    for (int i = 0; i < 8; i++) a[i] = t[i] + t[i + 8];
    for (int i = 0; i < 4; i++) a[i] = a[i] + a[i + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* Lane u of the result: the sum of a[u]'s 16 lanes, by one tree for the 16 (halves of
   each vector added, then quarters, eighths, pairs): 45 shuffles and adds where 16
   hsum16 take about twice as many. */
VI v16 hsum16x16(const v16 *a) {
    v16 b[8], c[4], e[2];
    for (int p = 0; p < 8; p++)
        b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; p++)
        c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(b[2 * p], b[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)
        e[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(c[2 * p], c[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30) +
           __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                   27, 29, 31);
}

/* 16 lanes held as two halves of 8 (lo: lanes 0-7): on AVX2 a v16 variable lives on the
   stack (gcc has no register for it), so its hot loops keep the same lanes in two v8s,
   which give the same bits. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

VI v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

VI void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* hsum16 of the lanes lo, hi, in its order */
VI float hsum8x2(v8 lo, v8 hi) {
    const v8 a = lo + hi;
    const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0: Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
   polynomial in r, times 2^n), within 0.97 ulp of exp in double on every 64th float of
   [-87, 0]. 0 below -87, where exp is under 2^-125 (a softmax weight that small adds
   nothing); NaN stays NaN. */
VI v16 exp16(v16 x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const v16 n = (x * 1.44269504088896341f + magic) - magic;
    const v16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f; /* ln 2 in two parts */
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    const v16i pow2n = (__builtin_convertvector(n, v16i) + 127) << 23;
    const v16 y = p * (v16)pow2n;
    return (v16)((v16i)y & ~(x < -87.0f));
}

/* x sigmoid(z) in 16 lanes: with e = exp(-|z|) <= 1 (exp16's domain), sigmoid(z) is
   1 / (1 + e) for z >= 0 and e / (1 + e) below, neither overflowing nor cancelling. */
VI v16 mul_sigmoid16(v16 x, v16 z) {
    const v16 e = exp16((v16)((v16i)z | INT32_MIN)); /* -|z| */
    const v16 r = 1.0f / (1.0f + e);
    const v16i pos = (v16i)(z >= 0.0f);
    return x * (v16)(((v16i)r & pos) | ((v16i)(e * r) & ~pos));
}

/* gate[i] = act(gate[i]) * up[i] over n elements, 16 at a time (the last ones through a
   buffer): act(x) = x sigmoid(z(x)) with z = x (SiLU) or, for GELU's tanh approximation
   0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), z = 2 u. */
static void act_mul(float *gate, const float *up, int64_t n, int gelu) {
    const float beta2 = 2 * 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i += 16) {
        float g[16] = {0}, u[16] = {0};
        const int64_t k = n - i < 16 ? n - i : 16;
        memcpy(g, gate + i, (size_t)k * sizeof(float));
        memcpy(u, up + i, (size_t)k * sizeof(float));
        const v16 x = load16(g);
        const v16 z = gelu ? beta2 * (x + kappa * (x * x * x)) : x;
        store16(g, mul_sigmoid16(x, z) * load16(u));
        memcpy(gate + i, g, (size_t)k * sizeof(float));
    }
}

typedef struct {
    const model_t *m;
    const float *q;    /* the row's queries (n_heads, head_dim) */
    float *part, *out; /* its partials (n_heads, blocks, head_dim + 2), output (n_heads, head_dim) */
    const void *kc, *vc;       /* its sequence's cache, (n_kv_heads, seq, head_dim) each */
    const uint16_t *ks, *vs;   /* int8: their scales, (n_kv_heads, seq, head_dim / group) */
    int64_t seq, kind, group;  /* the cache's positions, kind and (int8) group */
    int64_t lo, hi; /* attended positions [lo, hi] */
    int64_t blocks; /* of ATTN_BLOCK positions from lo, the last one partial */
} attn_job;

typedef uint32_t v16u __attribute__((vector_size(64)));

/* float16 -> float32 for 16 lanes, exact (as half_to_float): the bits moved into a
   float's place and scaled by 2^112, normal and subnormal alike; inf and NaN given an
   all-ones exponent. Each lane takes the 32-bit word holding its half, shifted: a
   16-lane __builtin_convertvector from uint16 becomes scalar code in GCC 12. */
VI v16 half16_to_float(const uint16_t *p) {
    uint32_t a[8];
    memcpy(a, p, sizeof a);
    const v16u w = {a[0], a[0], a[1], a[1], a[2], a[2], a[3], a[3],
                    a[4], a[4], a[5], a[5], a[6], a[6], a[7], a[7]};
    const v16u down = {0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16};
    const v16u u = (w >> down) & 0xffff;
    const v16u f = (v16u)((v16)((u & 0x7fff) << 13) * 0x1p112f);
    const v16u inf_nan = (v16u)((u & 0x7c00) == 0x7c00) & 0x7f800000;
    return (v16)(f | inf_nan | (u & 0x8000) << 16);
}

/* n values of a bf16 or int8 cache from element `at` as float32 in out: each value one
   exact conversion (int8: q times its float16 scale, one product), whatever the path.
   Plain loops: GCC's vectorizer widens int8 and uint16 in a few instructions (vpmovsx,
   vpmovzx), where a 16-lane __builtin_convertvector from them becomes scalar code (GCC
   12). */
VI void kv_float(const attn_job *J, const void *cache, const uint16_t *scales, int64_t at,
                 int64_t n, float *restrict out) {
    if (J->kind == KV_BF16) { /* the bits of a float32's high half */
        const uint16_t *restrict h = (const uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t u = (uint32_t)h[i] << 16;
            memcpy(out + i, &u, sizeof u);
        }
        return;
    }
    const int64_t g = J->group, groups = n / g;
    const int8_t *restrict q = (const int8_t *)cache + at;
    const uint16_t *s = scales + at / g;
    for (int64_t j = 0; j < groups; j += 16) { /* 16 groups' scales at a time */
        const int64_t m = groups - j < 16 ? groups - j : 16;
        float d[16];
        if (m == 16)
            store16(d, half16_to_float(s + j));
        else
            for (int64_t k = 0; k < m; k++) d[k] = half_to_float(s[j + k]);
        for (int64_t k = 0; k < m; k++, q += g, out += g)
            for (int64_t i = 0; i < g; i++) out[i] = (float)q[i] * d[k];
    }
}

/* A task's query heads at once (more share a key-value head: several passes), and the
   floats of a sub-block of rows: converted from bf16 or int8, it stays in L1 while every
   head reads it. */
enum { ATTN_HEADS = 16, ATTN_SUB_FLOATS = 4096 };

/* n floats of a cache from element `at`: in place when float32, else converted into buf. */
VI const float *kv_rows(const attn_job *J, const void *cache, const uint16_t *scales,
                        int64_t at, int64_t n, float *buf) {
    if (J->kind == KV_F32) return (const float *)cache + at;
    kv_float(J, cache, scales, at, n, buf);
    return buf;
}

/* A query head of a row, as a task sees it: the row's queries for the head, where its
   partials for the task's block go, and how many of the block's positions it attends. */
typedef struct {
    const float *q;
    float *part;
    int64_t n;
} attn_pair;

/* One block b of positions for key-value head g (a pool task), as flash-decoding splits
   it, for up to ATTN_HEADS (row, query head) pairs that share the head: one row's heads,
   or the rows of one sequence checked together. The block's keys and values are read
   from memory once for all of them, a sub-block of rows at a time. For each pair it
   leaves in its `part`: the block's largest score mx, sum of e_t = exp(score_t - mx),
   and sum of e_t v_t (each element summed over t in order); attn_combine weighs the
   blocks together. A pair's sums do not depend on the others in the task. `groups`
   (AVX-512): scores 16 positions at a time, their lanes summed together (hsum16x16),
   rather than one position's at a time. D: the head size as a constant (0: m's). */
VI void attn_block(const attn_job *J, int64_t g, int64_t b, const attn_pair *P, int64_t nh,
                   const int halves, const int groups, const int64_t D) {
    const model_t *m = J->m;
    const int64_t d = D ? D : m->head_dim, d16 = d / 16 * 16;
    const int64_t sub = ATTN_SUB_FLOATS / d < 1 ? 1 : ATTN_SUB_FLOATS / d > 64 ? 64 : ATTN_SUB_FLOATS / d;
    const int64_t lo = J->lo + b * ATTN_BLOCK;
    const int64_t at = (g * J->seq + lo) * d; /* row lo's first element in the cache */
    const int prefetch = J->kind == KV_F32;   /* rows read from memory in place */
    const float scale = m->attn_scale;
    int64_t n = 0; /* the block's positions any pair attends */
    for (int64_t j = 0; j < nh; j++) n = P[j].n > n ? P[j].n : n;
    float s[ATTN_HEADS][ATTN_BLOCK]; /* each pair's scores, then their exponentials */
    float buf[ATTN_SUB_FLOATS];      /* a converted sub-block */
    float mx[ATTN_HEADS];
    for (int64_t j = 0; j < nh; j++) mx[j] = -INFINITY;
    for (int64_t t0 = 0; t0 < n; t0 += sub) {
        const int64_t nk = n - t0 < sub ? n - t0 : sub;
        const float *kb = kv_rows(J, J->kc, J->ks, at + t0 * d, nk * d, buf);
        for (int64_t j = 0; j < nh; j++) {
            const int64_t nt = P[j].n - t0 < nk ? P[j].n - t0 : nk; /* as it alone would */
            if (nt <= 0) continue;
            const float *q = P[j].q;
            int64_t t = 0;
            if (groups) { /* 16 positions' scores at once, their lanes summed by one tree */
                v16 top = {0};
                top += mx[j];
                for (; t + 16 <= nt; t += 16) {
                    v16 acc[16];
                    for (int u = 0; u < 16; u++) {
                        const float *k = kb + (t + u) * d;
                        if (prefetch)
                            for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(k + 8 * d + i, 0, 3);
                        v16 a = {0};
                        for (int64_t i = 0; i < d16; i += 16) a += load16(q + i) * load16(k + i);
                        acc[u] = a;
                    }
                    v16 dot = hsum16x16(acc);
                    for (int64_t i = d16; i < d; i++)
                        for (int u = 0; u < 16; u++) dot[u] += q[i] * kb[(t + u) * d + i];
                    dot *= scale;
                    store16(s[j] + t0 + t, dot);
                    const v16i more = dot > top; /* NaN is never more, as below */
                    top = (v16)(((v16i)dot & more) | ((v16i)top & ~more));
                }
                for (int u = 0; u < 16; u++)
                    if (top[u] > mx[j]) mx[j] = top[u];
            }
            for (; t < nt; t++) {
                const float *k = kb + t * d;
                if (prefetch)
                    for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(k + 8 * d + i, 0, 3);
                float dot;
                if (halves) {
                    v8 lo = {0}, hi = {0};
                    for (int64_t i = 0; i < d16; i += 16) {
                        lo += load8(q + i) * load8(k + i);
                        hi += load8(q + i + 8) * load8(k + i + 8);
                    }
                    dot = hsum8x2(lo, hi);
                } else {
                    v16 acc = {0};
                    for (int64_t i = 0; i < d16; i += 16) acc += load16(q + i) * load16(k + i);
                    dot = hsum16(acc);
                }
                for (int64_t i = d16; i < d; i++) dot += q[i] * k[i];
                s[j][t0 + t] = dot * scale;
                if (s[j][t0 + t] > mx[j]) mx[j] = s[j][t0 + t];
            }
        }
    }
    for (int64_t j = 0; j < nh; j++) {
        /* each score s = exp(s - mx), summed by lane; the last partial vector through a buffer */
        float *sj = s[j], *part = P[j].part;
        const int64_t n = P[j].n;
        v16 sum16 = {0};
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) {
            const v16 e = exp16(load16(sj + t) - mx[j]);
            store16(sj + t, e);
            sum16 += e;
        }
        if (t < n) {
            float tail[16];
            for (int i = 0; i < 16; i++) tail[i] = t + i < n ? sj[t + i] - mx[j] : -INFINITY;
            const v16 e = exp16(load16(tail));
            store16(tail, e);
            for (int64_t i = 0; t + i < n; i++) sj[t + i] = tail[i];
            sum16 += e;
        }
        part[0] = mx[j];
        part[1] = hsum16(sum16);
    }
    for (int64_t t0 = 0; t0 < n; t0 += sub) {
        const int64_t nk = n - t0 < sub ? n - t0 : sub;
        const float *vb = kv_rows(J, J->vc, J->vs, at + t0 * d, nk * d, buf);
        for (int64_t j = 0; j < nh; j++) {
            const int64_t nt = P[j].n - t0 < nk ? P[j].n - t0 : nk;
            if (nt <= 0) continue;
            const float *e = s[j] + t0;
            float *out = P[j].part + 2;
            /* up to 64 elements at a time, so each row of V is read once (not once per 16),
               the sums carried from the sub-block before */
            for (int64_t i = 0; i < d16; i += 64) {
                const int64_t nv = d16 - i < 64 ? (d16 - i) / 16 : 4;
                v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                if (t0) {
                    a0 = load16(out + i);
                    if (nv > 1) a1 = load16(out + i + 16);
                    if (nv > 2) a2 = load16(out + i + 32);
                    if (nv > 3) a3 = load16(out + i + 48);
                }
                const float *v = vb + i;
                if (nv == 4 && halves) { /* the same lanes, in v8 halves */
                    v8 b[8];
                    for (int u = 0; u < 8; u++) b[u] = t0 ? load8(out + i + 8 * u) : (v8){0};
                    for (int64_t t = 0; t < nt; t++, v += d) {
                        if (prefetch)
                            for (int u = 0; u < 4; u++) __builtin_prefetch(v + 8 * d + 16 * u, 0, 3);
                        for (int u = 0; u < 8; u++) b[u] += load8(v + 8 * u) * e[t];
                    }
                    for (int u = 0; u < 8; u++) store8(out + i + 8 * u, b[u]);
                    continue;
                }
                if (nv == 4) {
                    for (int64_t t = 0; t < nt; t++, v += d) {
                        if (prefetch) {
                            __builtin_prefetch(v + 8 * d, 0, 3);
                            __builtin_prefetch(v + 8 * d + 16, 0, 3);
                            __builtin_prefetch(v + 8 * d + 32, 0, 3);
                            __builtin_prefetch(v + 8 * d + 48, 0, 3);
                        }
                        a0 += load16(v) * e[t];
                        a1 += load16(v + 16) * e[t];
                        a2 += load16(v + 32) * e[t];
                        a3 += load16(v + 48) * e[t];
                    }
                } else {
                    for (int64_t t = 0; t < nt; t++, v += d) {
                        a0 += load16(v) * e[t];
                        if (nv > 1) a1 += load16(v + 16) * e[t];
                        if (nv > 2) a2 += load16(v + 32) * e[t];
                    }
                }
                store16(out + i, a0);
                if (nv > 1) store16(out + i + 16, a1);
                if (nv > 2) store16(out + i + 32, a2);
                if (nv > 3) store16(out + i + 48, a3);
            }
            for (int64_t i = d16; i < d; i++) {
                float acc = t0 ? out[i] : 0.0f;
                for (int64_t t = 0; t < nt; t++) acc += vb[t * d + i] * e[t];
                out[i] = acc;
            }
        }
    }
}

/* Each head's output: the blocks' sums weighed by exp(mx_b - max_b mx_b), in block order,
   over the weighed sum of their e_t sums. */
static void attn_combine(const attn_job *J) {
    const model_t *m = J->m;
    const int64_t d = m->head_dim, nb = J->blocks;
    for (int64_t h = 0; h < m->n_heads; h++) {
        const float *part = J->part + h * nb * (d + 2);
        float *out = J->out + h * d;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t b = 0; b < nb; b++)
            if (part[b * (d + 2)] > mx) mx = part[b * (d + 2)];
        memset(out, 0, (size_t)d * sizeof *out);
        for (int64_t b = 0; b < nb; b++) {
            const float *p = part + b * (d + 2), w = expf(p[0] - mx);
            sum += w * p[1];
            for (int64_t i = 0; i < d; i++) out[i] += w * p[2 + i];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < d; i++) out[i] *= inv;
    }
}

/* Every row's attention as one pool job. Rows in a run (one sequence's, attending from
   the same first position: guesses checked together) share tasks, so a block's keys and
   values are read once for all of them. Run i's tasks are numbered after run i - 1's: per
   key-value head g and block b, `chunks[i]` tasks of ATTN_HEADS of its (row, query head)
   pairs, row by row. */
typedef struct {
    attn_job row[GEMV_ROWS_MAX];
    int64_t run[GEMV_ROWS_MAX + 1];   /* run i: rows run[i] .. run[i + 1] - 1 */
    int64_t first[GEMV_ROWS_MAX + 1]; /* its first task */
    int64_t blocks[GEMV_ROWS_MAX], chunks[GEMV_ROWS_MAX];
    int64_t runs;
} attn_rows;

/* Task `task`'s run, key-value head g and block b, and its (row, query head) pairs in P;
   returns how many (rows that end before the block have none there). */
static int64_t attn_pairs(const attn_rows *A, int64_t task, int64_t *run, int64_t *g, int64_t *b,
                          attn_pair *P) {
    int64_t i = 0;
    while (task >= A->first[i + 1]) i++;
    task -= A->first[i];
    const model_t *m = A->row[0].m;
    const int64_t rep = m->n_heads / m->n_kv, d = m->head_dim, c = task % A->chunks[i];
    *run = A->run[i];
    *g = task / A->chunks[i] / A->blocks[i];
    *b = task / A->chunks[i] % A->blocks[i];
    const int64_t last = (A->run[i + 1] - A->run[i]) * rep;
    int64_t nh = 0;
    for (int64_t k = c * ATTN_HEADS; k < (c + 1) * ATTN_HEADS && k < last; k++) {
        const attn_job *R = &A->row[A->run[i] + k / rep];
        const int64_t h = *g * rep + k % rep, lo = R->lo + *b * ATTN_BLOCK;
        if (*b >= R->blocks) continue;
        const int64_t end = lo + ATTN_BLOCK - 1 < R->hi ? lo + ATTN_BLOCK - 1 : R->hi;
        P[nh++] = (attn_pair){R->q + h * d, R->part + (h * R->blocks + *b) * (d + 2), end - lo + 1};
    }
    return nh;
}

/* attn_block compiled for each instruction set, with the common head sizes constant */
#define ATTN_TASK(NAME, TARGET, HALVES, GROUPS)                                                  \
    TARGET static void NAME(void *ctx, int64_t task, int tid) {                                 \
        (void)tid;                                                                              \
        const attn_rows *A = ctx;                                                               \
        attn_pair P[ATTN_HEADS];                                                                \
        int64_t run, g, b;                                                                      \
        const int64_t nh = attn_pairs(A, task, &run, &g, &b, P), d = A->row[0].m->head_dim;     \
        const attn_job *J = &A->row[run]; /* the run's cache and first position */             \
        if (d == 64)                                                                            \
            attn_block(J, g, b, P, nh, HALVES, GROUPS, 64);                                     \
        else if (d == 128)                                                                      \
            attn_block(J, g, b, P, nh, HALVES, GROUPS, 128);                                    \
        else                                                                                    \
            attn_block(J, g, b, P, nh, HALVES, GROUPS, 0);                                      \
    }
ATTN_TASK(attn_task, , 0, 0)
#ifdef INFER_X86
ATTN_TASK(attn_task_avx2, TARGET_AVX2, 1, 0) /* 8 float lanes a register */
ATTN_TASK(attn_task_avx512, TARGET_AVX512, 0, 1) /* 32 registers of 16: 16 positions' sums */
#endif

static pool_fn attn_task_for(int isa) {
#ifdef INFER_X86
    if (isa == ISA_AVX512 || isa == ISA_AVX512_VNNI) return attn_task_avx512;
    if (isa == ISA_AVX2 || isa == ISA_AVX2_VNNI) return attn_task_avx2;
#endif
    (void)isa;
    return attn_task;
}

/* One block for the call's R rows: x (R, dim) is their residual stream, pos[r] row r's
   position, cache[r] its CACHE_WORDS (the top of the file), l the layer. Returns
   0, -1 when out of memory, or 1 after the attention half of a mixture-of-experts layer
   (m->xn then holds the rows' MoE inputs). */
static int block(const model_t *m, const int64_t *P, int64_t l, float *x, const int64_t *pos,
                 const int64_t *cache) {
    const float *attn_norm = PTR(const float *, P[0]), *ffn_norm = PTR(const float *, P[1]);
    const float *q_norm = PTR(const float *, P[2]), *k_norm = PTR(const float *, P[3]);
    const float *post_attn = PTR(const float *, P[4]), *post_ffn = PTR(const float *, P[5]);
    const float *cos_table = PTR(const float *, P[6]), *sin_table = PTR(const float *, P[7]);
    const int64_t *lin = P + 9;
    const int64_t d = m->head_dim, dim = m->dim, window = P[8], R = m->R;
    const int64_t hd = m->n_heads * d, kvd = m->n_kv * d, hidden = lin[L_GATE * LIN + 5];
    const int64_t cw = CACHE_WORDS(m->n_layers);
    int rc = 0;

    for (int64_t r = 0; r < R; r++) rmsnorm(x + r * dim, attn_norm, m->xn + r * dim, dim, m->eps);
    const int64_t *qkv[3] = {lin + L_Q * LIN, lin + L_K * LIN, lin + L_V * LIN};
    rc |= linears(3, qkv, m->xn, (float *const[]){m->q, m->k, m->v}, m);
    attn_rows A;
    A.runs = 0;
    int64_t work = 0;
    for (int64_t r = 0; r < R; r++) {
        float *q = m->q + r * hd, *k = m->k + r * kvd, *v = m->v + r * kvd;
        if (q_norm && m->qk_norm_full) {
            rmsnorm(q, q_norm, q, hd, m->eps);
            rmsnorm(k, k_norm, k, kvd, m->eps);
        } else if (q_norm) {
            for (int64_t h = 0; h < m->n_heads; h++) rmsnorm(q + h * d, q_norm, q + h * d, d, m->eps);
            for (int64_t h = 0; h < m->n_kv; h++) rmsnorm(k + h * d, k_norm, k + h * d, d, m->eps);
        }
        const int64_t *c = cache + r * cw, p = pos[r], seq = c[0], kind = c[1], group = c[2];
        rope(q, m->n_heads, d, cos_table + p * d, sin_table + p * d);
        rope(k, m->n_kv, d, cos_table + p * d, sin_table + p * d);
        const int64_t *layer = c + 3 + 4 * l; /* k, v, k_scales, v_scales */
        void *kc = PTR(void *, layer[0]), *vc = PTR(void *, layer[1]);
        uint16_t *ks = PTR(uint16_t *, layer[2]), *vs = PTR(uint16_t *, layer[3]);
        for (int64_t h = 0; h < m->n_kv; h++) {
            kv_store((int)kind, group, k + h * d, d, kc, ks, (h * seq + p) * d);
            kv_store((int)kind, group, v + h * d, d, vc, vs, (h * seq + p) * d);
        }
        const int64_t lo = window && p >= window ? p - window + 1 : 0;
        const int64_t blocks = attn_blocks(p - lo + 1);
        A.row[r] = (attn_job){m, q, m->part + r * m->n_heads * attn_blocks(m->max_seq) * (d + 2),
                              m->att + r * hd, kc, vc, ks, vs, seq, kind, group, lo, p, blocks};
        if (r == 0 || kc != A.row[r - 1].kc || lo != A.row[r - 1].lo) {
            A.run[A.runs] = r;
            A.blocks[A.runs++] = 0;
        }
        if (blocks > A.blocks[A.runs - 1]) A.blocks[A.runs - 1] = blocks;
        work += (p - lo + 1) * hd;
    }
    A.run[A.runs] = R;
    A.first[0] = 0;
    for (int64_t i = 0; i < A.runs; i++) {
        const int64_t pairs = (A.run[i + 1] - A.run[i]) * (m->n_heads / m->n_kv);
        A.chunks[i] = (pairs + ATTN_HEADS - 1) / ATTN_HEADS;
        A.first[i + 1] = A.first[i] + m->n_kv * A.blocks[i] * A.chunks[i];
    }
    /* every row's keys and values are in place: rows of one sequence see those before them */
    pool_run(work >= 1 << 16 ? m->nthreads : 1, A.first[A.runs], attn_task_for(m->isa), &A);
    for (int64_t r = 0; r < R; r++) attn_combine(&A.row[r]);
    rc |= linear(lin + L_O * LIN, m->att, m->xn, m);
    for (int64_t r = 0; r < R; r++) {
        float *y = m->xn + r * dim, *xr = x + r * dim;
        if (post_attn) rmsnorm(y, post_attn, y, dim, m->eps);
        for (int64_t i = 0; i < dim; i++) xr[i] += y[i];
        rmsnorm(xr, ffn_norm, y, dim, m->eps);
    }
    if (lin[L_GATE * LIN] == 0) return rc ? rc : 1; /* mixture of experts: the caller's */
    const int64_t *gate_up[2] = {lin + L_GATE * LIN, lin + L_UP * LIN};
    rc |= linears(2, gate_up, m->xn, (float *const[]){m->gate, m->up}, m);
    for (int64_t r = 0; r < R; r++) {
        act_mul(m->gate + r * hidden, m->up + r * hidden, hidden, m->act);
    }
    rc |= linear(lin + L_DOWN * LIN, m->gate, m->xn, m);
    for (int64_t r = 0; r < R; r++) {
        float *y = m->xn + r * dim, *xr = x + r * dim;
        if (post_ffn) rmsnorm(y, post_ffn, y, dim, m->eps);
        for (int64_t i = 0; i < dim; i++) xr[i] += y[i];
    }
    return rc;
}

/* The model of a plan's header for R rows, its scratch laid out, after checking the
   rows' positions and caches. Returns 0, or -1 with a ValueError set when the plan, the
   rows or the arguments are bad. */
static int plan_model(const int64_t *H, long long n_words, long long scratch_n, long long R,
                      const int64_t *pos, const int64_t *cache, long long isa, long long threads,
                      model_t *m) {
    if (!H || n_words < HEADER || !pos || !cache) goto bad;
    *m = (model_t){H[0], H[1], H[2], H[3], H[4], H[5], H[6], H[12], bits_to_float(H[7]),
                   bits_to_float(H[11])};
    if (m->n_layers < 0 || n_words != HEADER + m->n_layers * LAYER || m->n_kv <= 0 ||
        m->n_heads % m->n_kv || m->head_dim % 2 || m->max_rows < 1 ||
        m->max_rows > GEMV_ROWS_MAX || R < 1 || R > m->max_rows ||
        scratch_n < scratch_floats(m) || !H[8] || (H[9] != 0 && H[9] != 1) ||
        (H[10] != 0 && H[10] != 1) || isa < 0 || isa >= ISA_COUNT || !isa_supported((int)isa))
        goto bad;
    const int64_t cw = CACHE_WORDS(m->n_layers);
    for (long long r = 0; r < R; r++) {
        const int64_t *c = cache + r * cw, seq = c[0], kind = c[1], group = c[2];
        if (pos[r] < 0 || pos[r] >= seq || seq > m->max_seq || kind < KV_F32 || kind > KV_INT8 ||
            (kind == KV_INT8 && (group < 1 || m->head_dim % group)))
            goto bad;
        for (int64_t l = 0; l < m->n_layers; l++)
            for (int w = 0; w < (kind == KV_INT8 ? 4 : 2); w++)
                if (!c[3 + 4 * l + w]) goto bad;
    }
    m->R = R;
    m->qk_norm_full = (int)H[9];
    m->act = (int)H[10];
    if (m->attn_scale == 0.0f) m->attn_scale = 1.0f / sqrtf((float)m->head_dim);
    const int64_t rows = m->max_rows, hd = m->n_heads * m->head_dim, kvd = m->n_kv * m->head_dim;
    float *s = PTR(float *, H[8]);
    m->xn = s, s += rows * m->dim;
    m->q = s, s += rows * hd;
    m->att = s, s += rows * hd;
    m->k = s, s += rows * kvd;
    m->v = s, s += rows * kvd;
    m->gate = s, s += rows * m->hidden;
    m->up = s, s += rows * m->hidden;
    m->part = s;
    m->isa = (int)isa;
    m->nthreads = threads < 1 ? 1 : threads > 255 ? 255 : (int)threads;
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "decode_layers: bad plan, rows or arguments");
    return -1;
}

/* decode_layers(plan, n_words, scratch_floats, x, rows, pos, cache, isa, threads, first,
   last): blocks first .. last - 1 for `rows` tokens, x (rows, dim) float32 their residual
   stream entering layer `first`, pos (rows,) int64 their positions, cache (rows,
   CACHE_WORDS) int64 their sequences' caches. Returns `last` when they all ran, or the
   index of the mixture-of-experts layer it stopped at (see the top of the file). */
static PyObject *py_decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[11];
    if (infer_parse_ints(args, nargs, 11, v, "decode_layers")) return NULL;
    const int64_t *H = PTR(const int64_t *, v[0]);
    const int64_t *pos = PTR(const int64_t *, v[5]), *cache = PTR(const int64_t *, v[6]);
    model_t m;
    if (plan_model(H, v[1], v[2], v[4], pos, cache, v[7], v[8], &m)) return NULL;
    if (!v[3] || v[9] < 0 || v[9] > v[10] || v[10] > m.n_layers) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: bad plan, rows or arguments");
        return NULL;
    }
    float *x = PTR(float *, v[3]);
    int64_t l = v[9];
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (; l < v[10]; l++)
        if ((rc = block(&m, H + HEADER + l * LAYER, l, x, pos, cache))) break;
    Py_END_ALLOW_THREADS;
    if (rc < 0) return PyErr_NoMemory();
    return PyLong_FromLongLong(l);
}

/* decode_kv_store(x, n, kind, group, cache, scales): n float32 values of x into a cache of
   `kind` from its first element, as the fused step writes keys and values (for tests
   against kvcache.py). */
static PyObject *py_decode_kv_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[6];
    if (infer_parse_ints(args, nargs, 6, v, "decode_kv_store")) return NULL;
    const long long n = v[1], kind = v[2], g = v[3];
    if (!v[0] || !v[4] || n < 0 || kind < KV_F32 || kind > KV_INT8 ||
        (kind == KV_INT8 && (g < 1 || n % g || !v[5]))) {
        PyErr_SetString(PyExc_ValueError, "decode_kv_store: bad arguments");
        return NULL;
    }
    kv_store((int)kind, g, PTR(const float *, v[0]), n, PTR(void *, v[4]),
             PTR(uint16_t *, v[5]), 0);
    Py_RETURN_NONE;
}

/* Chosen experts are run this many at a time: their gate and up GEMVs (2 per expert) as
   one pool job, then their down GEMVs as another. */
enum { EXPERTS_AT_ONCE = Q_GEMV_MANY_MAX / 2 };

/* out[r] += sum over the experts row r chose of w * down_e(SiLU(gate_e(x[r])) * up_e(x[r])),
   for R rows: each row's experts added in ascending id order (each product rounded,
   then added, as MoE.forward's out += y * w), each expert run once on the rows that chose
   it (its GEMVs over those rows: each row computed as alone). T[e]: expert e's 3 LIN
   words; ids, w (R, k) the rows' choices, each row's in ascending id order; x and out
   (R, dim). Returns 0, or -1 when out of memory. */
static int experts_rows(const int64_t *const *T, int64_t n_experts, int R, int k,
                        const int64_t *ids, const float *w, const float *x, float *out,
                        int64_t dim, const model_t *m) {
    /* who chose each expert: members[first[e] .. first[e + 1]) = (row, weight), rows ascending */
    int64_t *first = calloc((size_t)n_experts + 1, sizeof *first);
    int64_t *member = malloc(sizeof *member * (size_t)(R * k));
    float *member_w = malloc(sizeof *member_w * (size_t)(R * k));
    int64_t most = 0; /* the widest expert's hidden size */
    int rc = first && member && member_w ? 0 : -1;
    for (int64_t i = 0; !rc && i < R * k; i++) first[ids[i] + 1]++;
    for (int64_t e = 0; !rc && e < n_experts; e++) {
        first[e + 1] += first[e];
        if (first[e + 1] > first[e] && T[e][5] > most) most = T[e][5];
    }
    int64_t *fill = rc ? NULL : malloc(sizeof *fill * (size_t)n_experts);
    float *buf = rc ? NULL : malloc(sizeof *buf * (size_t)(R * k) * (size_t)(2 * dim + 2 * most));
    if (!fill || !buf) rc = -1;
    for (int64_t e = 0; !rc && e < n_experts; e++) fill[e] = first[e];
    for (int r = 0; !rc && r < R; r++)
        for (int i = 0; i < k; i++) {
            const int64_t e = ids[r * k + i];
            member[fill[e]] = r, member_w[fill[e]++] = w[r * k + i];
        }
    int64_t e = 0;
    while (!rc && e < n_experts) {
        /* the next EXPERTS_AT_ONCE chosen experts, their rows gathered */
        int64_t chosen[EXPERTS_AT_ONCE], rows[Q_GEMV_MANY_MAX], down_rows[EXPERTS_AT_ONCE];
        const int64_t *gu[Q_GEMV_MANY_MAX], *down[EXPERTS_AT_ONCE];
        const float *gu_in[Q_GEMV_MANY_MAX], *down_in[EXPERTS_AT_ONCE];
        float *gu_out[Q_GEMV_MANY_MAX], *down_out[EXPERTS_AT_ONCE];
        int nc = 0;
        float *b = buf;
        for (; e < n_experts && nc < EXPERTS_AT_ONCE; e++) {
            const int64_t M = first[e + 1] - first[e], hidden = T[e][5];
            if (!M) continue;
            float *xg = b, *g = xg + M * dim, *u = g + M * hidden, *y = u + M * hidden;
            b = y + M * dim;
            for (int64_t j = 0; j < M; j++)
                memcpy(xg + j * dim, x + member[first[e] + j] * dim, (size_t)dim * sizeof *x);
            chosen[nc] = e;
            gu[2 * nc] = T[e], gu[2 * nc + 1] = T[e] + LIN;
            gu_in[2 * nc] = gu_in[2 * nc + 1] = xg;
            gu_out[2 * nc] = g, gu_out[2 * nc + 1] = u;
            rows[2 * nc] = rows[2 * nc + 1] = down_rows[nc] = M;
            down[nc] = T[e] + 2 * LIN, down_in[nc] = g, down_out[nc] = y;
            nc++;
        }
        if (!nc) break;
        rc |= linears_each(2 * nc, gu, gu_in, gu_out, rows, m);
        for (int c = 0; c < nc; c++)
            for (int64_t j = 0; j < rows[2 * c]; j++) {
                const int64_t h = gu[2 * c][5];
                act_mul(gu_out[2 * c] + j * h, gu_out[2 * c + 1] + j * h, h, 0);
            }
        rc |= linears_each(nc, down, down_in, down_out, down_rows, m);
        for (int c = 0; c < nc; c++) /* ascending experts: each row's sum in its order */
            for (int64_t j = 0; j < down_rows[c]; j++) {
                const int64_t at = first[chosen[c]] + j;
                const float we = member_w[at], *y = down_out[c] + j * dim;
                float *o = out + member[at] * dim;
                for (int64_t i = 0; i < dim; i++) {
                    const float t = y[i] * we;
                    o[i] += t;
                }
            }
    }
    free(first);
    free(member);
    free(member_w);
    free(fill);
    free(buf);
    return rc;
}

/* decode_experts(table, n_rows, ids, weights, k, shared_w, xn, x, rows, dim, sums,
   sums_floats, isa, threads, phase): x (rows, dim) += the mixture of experts' output for
   its input xn (rows, dim), as MoE.forward for each row alone: row r's k experts
   ids[r] (int64 (rows, k)) with weights[r] (float32) from the router, added in ascending
   id order, then the shared expert (the table's last row) scaled by shared_w[r] (float32
   (rows,); 0: none). table: int64 (n_rows, 3 * LIN). Each chosen expert runs once, on
   the rows that chose it. The sums are kept in `sums` (rows, dim), so a token's experts
   may come in several calls (rows == 1), in ascending order: phase bit 0 starts the
   sums, bit 1 ends them (the shared expert, then x += the sums); one call is phase 3. */
static PyObject *py_decode_experts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[15];
    if (infer_parse_ints(args, nargs, 15, v, "decode_experts")) return NULL;
    const int64_t *table = PTR(const int64_t *, v[0]), *ids = PTR(const int64_t *, v[2]);
    const float *weights = PTR(const float *, v[3]), *shared_w = PTR(const float *, v[5]);
    const float *xn = PTR(const float *, v[6]);
    float *x = PTR(float *, v[7]), *sums = PTR(float *, v[10]);
    const long long n_rows = v[1], k = v[4], R = v[8], dim = v[9];
    const long long routed = n_rows - (shared_w != NULL);
    if (!table || !ids || !weights || !xn || !x || !sums || k < 1 || k > routed || R < 1 ||
        R > GEMV_ROWS_MAX || dim < 1 || v[11] < R * dim || v[12] < 0 || v[12] >= ISA_COUNT ||
        !isa_supported((int)v[12]) || v[14] < 0 || v[14] > 3)
        goto bad;
    for (long long i = 0; i < R * k; i++)
        if (ids[i] < 0 || ids[i] >= routed) goto bad;
    const int64_t **T = malloc(sizeof *T * (size_t)n_rows);
    if (!T) return PyErr_NoMemory();
    for (long long r = 0; r < n_rows; r++) { /* (gate, up, down) of matching widths */
        const int64_t *t = T[r] = table + r * 3 * LIN;
        if (t[0] == 0 || t[5] < 1 || t[6] != dim || t[LIN + 5] != t[5] || t[LIN + 6] != dim ||
            t[2 * LIN + 6] != t[5] || t[2 * LIN + 5] != dim) {
            free(T);
            goto bad;
        }
    }
    model_t m = {.dim = dim, .isa = (int)v[12], .R = R};
    m.nthreads = v[13] < 1 ? 1 : v[13] > 255 ? 255 : (int)v[13];
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS;
    if (v[14] & 1) memset(sums, 0, (size_t)(R * dim) * sizeof *sums);
    rc |= experts_rows(T, routed, (int)R, (int)k, ids, weights, xn, sums, dim, &m);
    if (v[14] & 2) {
        if (shared_w) {
            int64_t zeros[GEMV_ROWS_MAX] = {0};
            rc |= experts_rows(T + routed, 1, (int)R, 1, zeros, shared_w, xn, sums, dim, &m);
        }
        for (int64_t i = 0; i < R * dim; i++) x[i] += sums[i];
    }
    Py_END_ALLOW_THREADS;
    free(T);
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
bad:
    PyErr_SetString(PyExc_ValueError, "decode_experts: bad table, experts or arguments");
    return NULL;
}

static PyObject *py_decode_layout(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return Py_BuildValue("(iiiiii)", HEADER, LAYER, LIN, (int)EXPERTS_AT_ONCE, (int)ATTN_BLOCK,
                         (int)GEMV_ROWS_MAX);
}

PyMethodDef infer_decode_methods[] = {
    {"decode_layers", (PyCFunction)(void (*)(void))py_decode_layers, METH_FASTCALL,
     "decode_layers(plan, n_words, scratch_floats, x, rows, pos, cache, isa, threads, first, "
     "last): blocks first..last-1 for rows tokens, up to a mixture-of-experts layer "
     "(runtime/model/fused_decode.py builds the plan); returns where it stopped"},
    {"decode_experts", (PyCFunction)(void (*)(void))py_decode_experts, METH_FASTCALL,
     "decode_experts(table, n_rows, ids, weights, k, shared_w, xn, x, rows, dim, sums, "
     "sums_floats, isa, threads, phase): x += a mixture of experts' output for each row"},
    {"decode_kv_store", (PyCFunction)(void (*)(void))py_decode_kv_store, METH_FASTCALL,
     "decode_kv_store(x, n, kind, group, cache, scales): n floats into a KV cache's format"},
    {"decode_layout", py_decode_layout, METH_NOARGS,
     "(header words, words per layer, words per linear, experts run at once, attention "
     "block, most rows a call) of the decode plan"},
    {NULL, NULL, 0, NULL},
};
