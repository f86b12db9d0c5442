/* The CPU kernels' shared declarations: instruction-set paths, the thread pool, and the
 * quantized matmuls y = x W^T that every path implements.
 *
 * Layers (STYLE.md principle 10): kernels_cpu/reference.py defines each kernel in torch;
 * this C computes it, one function table per instruction set (scalar.c, avx2.c,
 * avx512.c, neon.c) chosen per call by the binding (kernels_cpu/ops.py), which checks
 * shapes and dtypes. module.c is the CPython module: plain data pointers, no PyTorch API.
 *
 * Every path lives in one shared object: x86 paths are compiled with per-function
 * __attribute__((target(...))) and chosen at run time with __builtin_cpu_supports, so
 * the build never uses -march=native and the same wheel runs on a CPU without AVX-512.
 *
 * Other kernel files (lut*.c, decode.c) join the same extension: setup.py compiles every
 * csrc/ .c file, they may use pool_run and the isa_* functions below, and the files that
 * define `PyMethodDef infer_lut_methods[]` or `infer_decode_methods[]` (NULL-terminated)
 * have those functions added to the module (module.c looks the tables up as weak symbols).
 */
#ifndef INFER_KERNELS_H
#define INFER_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* 64-byte aligned memory for the kernels' buffers (free() it); NULL when out of memory. */
static inline void *alloc64(size_t bytes) {
    return aligned_alloc(64, bytes ? (bytes + 63) / 64 * 64 : 64);
}

/* ------------------------------------------------------------------------------------
 * Instruction-set paths
 * ---------------------------------------------------------------------------------- */

/* The VNNI / dot-product variants differ from their base only in the int4 GEMV's
 * integer dot products (vpdpbusd / sdot instead of two-instruction sequences). */
enum {
    ISA_SCALAR = 0,
    ISA_AVX2 = 1,
    ISA_AVX2_VNNI = 2,   /* AVX-VNNI (Alder Lake, Zen 5) */
    ISA_AVX512 = 3,
    ISA_AVX512_VNNI = 4, /* AVX512-VNNI (Cascade Lake, Zen 4) */
    ISA_NEON = 5,
    ISA_NEON_DOT = 6, /* Armv8.2 dot product */
    ISA_COUNT = 7
};

const char *isa_name(int isa);
int isa_supported(int isa); /* this CPU (and OS) can run the path */
int isa_best(void);         /* the fastest supported path */
/* Features by name ("avx512vnni", "avxvnni", "dotprod", "f16c", ...): 1 when present. */
int cpu_has(const char *feature);

#if defined(__aarch64__)
#include <arm_neon.h>
/* neondot's functions: Armv8.2's dot product (sdot), chosen at run time as on x86 */
#if defined(__clang__)
#define TARGET_DOT __attribute__((target("dotprod")))
#else
#define TARGET_DOT __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
/* sdot itself. Not always_inline: the kernels' bodies carry no target, so it is inlined
 * only once they are, into a TARGET_DOT function (tests/test_neon.py checks it was). */
TARGET_DOT static inline int32x4_t neon_sdot_insn(int32x4_t acc, int8x16_t a, int8x16_t b) {
    return vdotq_s32(acc, a, b);
}
/* acc lane i + the 4 products of bytes 4i..4i+3 of a and b: sdot with `dot`, else the
 * same integers by Armv8.0's widening multiplies (pairs of products in int16: exact for
 * a in -127..127, as every kernel's codes are), so that the kernels' bodies compile for
 * both neon paths ("_dot" and "_neon" functions) and give the same bits on each. */
static inline __attribute__((always_inline)) int32x4_t neon_sdot(int32x4_t acc, int8x16_t a,
                                                                 int8x16_t b, const int dot) {
    if (dot) return neon_sdot_insn(acc, a, b);
    const int16x8_t pairs = vpaddq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)), vmull_high_s8(a, b));
    return vpadalq_s16(acc, pairs);
}
/* The digit GEMVs take x as neon.c's int4 GEMV lays it out: per block of 32, 64 bytes
 * at xc, the high digits of elements 0-15 and 16-31, then the low ones. Per lane, 256 times
 * the codes' products with the high digits plus those with the low ones: of 32 codes (lo:
 * elements 0-15, hi: 16-31), or of 16 codes with half e of the block. */
static inline __attribute__((always_inline)) int32x4_t neon_dot32(int8x16_t lo, int8x16_t hi,
                                                                  const int8_t *xc, const int dot) {
    const int32x4_t t = neon_sdot(neon_sdot(vdupq_n_s32(0), lo, vld1q_s8(xc), dot), hi, vld1q_s8(xc + 16), dot);
    return neon_sdot(neon_sdot(vshlq_n_s32(t, 8), lo, vld1q_s8(xc + 32), dot), hi, vld1q_s8(xc + 48), dot);
}
static inline __attribute__((always_inline)) int32x4_t neon_dot16(int8x16_t q, const int8_t *xc,
                                                                  int e, const int dot) {
    const int32x4_t t = vshlq_n_s32(neon_sdot(vdupq_n_s32(0), q, vld1q_s8(xc + 16 * e), dot), 8);
    return neon_sdot(t, q, vld1q_s8(xc + 32 + 16 * e), dot);
}
#endif

#if defined(__x86_64__) || defined(__i386__)
#define INFER_X86 1
/* AVX2 path: Haswell / Zen 1 and later. AVX-512 path: Skylake-X / Zen 4 and later. */
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define TARGET_AVX2_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define TARGET_AVX512_VNNI                                                                       \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512vnni")))
#endif

/* GEMV rows stream their weights once, in order, and the hardware prefetcher alone
 * leaves the GEMV well short of the read bandwidth: the kernels prefetch ahead of each 64
 * bytes they consume (a prefetch never faults, so running past a matrix's end is
 * harmless). The AVX-512 paths fetch into L2, 8 KiB ahead: into L1 the weights evict the
 * digits of x that every row reads again, and the digit GEMVs consume weights fast enough
 * that 4 KiB leaves the core waiting on memory. The AVX2 paths fetch into L1, 4 KiB
 * ahead: L2 helps them only on long rows. */
#define PREFETCH_AHEAD 8192
#define PREFETCH_AHEAD_L1 4096
#define PREFETCH_AT(p, ahead) __builtin_prefetch((const char *)(p) + (ahead), 0, 2)
#define PREFETCH_STREAM(p) PREFETCH_AT(p, PREFETCH_AHEAD)
#define PREFETCH_STREAM_L1(p) __builtin_prefetch((const char *)(p) + PREFETCH_AHEAD_L1, 0, 3)

/* An AVX-512 digit GEMV whose x's digits would fill the L1 cache (int8 and int6 rows of
 * 8192: 32 KB of digits and lane scales) runs its rows in slices of K, each slice of every
 * row of its task before the next slice, so that a slice's digits stay in L1 while the
 * rows pass: slices of 4096 elements (16 KB of digits) for int8 and int6 rows longer than
 * that, of 8192 (20 KB of two digits and lane scales) for int4's. A row's slices add up
 * in order, whatever the split of rows into tasks. Its weights are then read a slice of
 * a row at a time, rows apart: the prefetch runs SLICE_PREFETCH_ROWS rows ahead, at the
 * same slice. Smaller slices, or a prefetch one row ahead, are slower; int4's rows of 8192
 * stay whole, as slicing them slows decode. The AVX2 paths keep rows whole. */
enum { XPREP8_SLICE_CHUNKS = 64, Q4_SLICE_CHUNKS = 64, SLICE_PREFETCH_ROWS = 4 };
/* How far ahead a GEMV row of `row_bytes` prefetches its weights. */
static inline int64_t prefetch_distance(int64_t row_bytes, int sliced) {
    return sliced ? SLICE_PREFETCH_ROWS * row_bytes : PREFETCH_AHEAD;
}

/* ------------------------------------------------------------------------------------
 * Thread pool: our own, not OpenMP (torch links its own libgomp).
 *
 * pool_run calls fn(ctx, task, tid) once for each task in [0, n_tasks), spread over
 * up to `nthreads` threads (the caller is tid 0, workers 1..nthreads-1); tasks are
 * claimed dynamically, so which thread runs a task varies but each runs exactly once.
 * Kernels make each output element one task's work in a fixed order, so results do not
 * depend on the thread count. Workers spin briefly after a job (decode issues ~200
 * small matmuls per token), then sleep. A call made while the pool is busy (another
 * Python thread) runs on the caller alone.
 * ---------------------------------------------------------------------------------- */

typedef void (*pool_fn)(void *ctx, int64_t task, int tid);
void pool_run(int nthreads, int64_t n_tasks, pool_fn fn, void *ctx);

/* ------------------------------------------------------------------------------------
 * Quantized matmul y (M, N) = x (M, K) W^T, float32 activations and results
 *
 * int8 (quant/formats/int8.py): qw int8 (N, K); g = 0: scales float32 (N, 1), K any;
 *      g = 32/64/128: scales float16 (N, K/g); w = q * d.
 * int4 (quant/formats/int4.py): qw uint8 (N, K/2), each 32-element run is 16 bytes, byte i =
 *      element i (low nibble) and element 16 + i (high nibble); scales (and mins when
 *      asymmetric) float16 (N, K/g), g = 32/64/128;
 *      symmetric w = (q - 8) * d, asymmetric w = q * d + m.
 *
 * M == 1 (decode) runs the GEMV: activations stay float32, weights are widened in
 * registers and each group's partial dot product is scaled once:
 *      y[n] = sum_g d[n,g] * sum_{k in g} q[n,k] x[k]  +  sum_g c[n,g] * xsum[g]
 * (int4: c = m, or c = d with xsum = -8 * sum of x over the group when symmetric).
 * Paths with integer dot products for it (x86, neondot) instead run the int4 GEMV on x
 * as the integer GEMM's (below) two int8 digits per element, x ~ sx * (D1 * 2^8 + D0)
 * with sx = amax / IG_XMAX per block of 32: 15 significant bits per block, and the same
 * x, bit for bit, as prompts multiply. Integer dot products (vpdpbusd, vpmaddubsw +
 * vpmaddwd, sdot) then give sum q * X with ~3x fewer instructions per weight byte than
 * widening nibbles to float (which is compute-bound, not bandwidth-bound, on one core).
 * The mins' (or -8 d's) term takes its group sums from the same digits, so y is exactly
 * x's digits times W. It is not llama.cpp's one int8 digit (Q8_0 activations), which
 * costs accuracy (README compares the two). Two digits, not three: with three (23 bits)
 * the GEMV is bound by the core rather than by memory.
 * Blocks with inf or NaN take the float GEMV.
 * Where vpdpbusd exists the int8 GEMV does the same with |X| <= 2^21 (22 significant
 * bits: sum_4 (q + 128) X must fit int32), the weights made unsigned by q ^ 0x80 and the
 * 128 * X that adds taken back per block of x: sum q X = sum (q + 128) X - 128 sum X.
 * 1 < M <= 4, or M <= 8 with K >= 768 (a prompt's tokens routed to one expert; a short
 * prompt) runs the GEMV once per row of x (q_gemv_many), task by task, so a task's weights come from
 * memory once and from cache for the other rows: the same arithmetic as decode. Where the
 * path has a rows kernel (kernel_table.*_gemv_rows), it unpacks each weight row once for
 * up to 4 rows of x, each row's sums those of its one-row GEMV. Past
 * those bounds the GEMM is faster: a row's GEMV has work per output element besides its
 * dot product, which only long rows repay.
 * Larger M (prefill) runs the GEMM: a tile of weight rows is dequantized once, exactly as
 * the format defines it, into float32 scratch and multiplied with all M rows. From 16
 * rows, paths with vpdpbusd (avx512vnni, avx2vnni) run the integer GEMM instead (below)
 * for every format, plain AVX2 (vpmaddubsw, igemm_avx2.c) for all but int8, q3_k and
 * iq4_xs (their codes overflow its int16 pairs):
 * x as two int8 digits, 15 significant bits per block of 32 (bf16 keeps 8 per element,
 * llama.cpp's Q8 activations 8 per block), faster than the float GEMM on prompts.
 *
 * int6 (quant/formats/int6.py, GGUF Q6_K's blocks): qw uint8 (N, K / 256 * 210), K % 256 == 0,
 *      w = d * sc * (q - 32), q 6 bits, sc an int8 per 16, d a float16 per 256; scales
 *      and mins unused, g = 256. The GEMV runs on x as the int8 GEMV's digits (kernels.h
 *      XPREP8; |X| <= 2^21, 22 significant bits; 4 * 63 * 2^21 < 2^31) on AVX-VNNI, as
 *      int16 X on plain AVX2 (avx2.c, 15 bits per block of 32) and AVX-512 VNNI (avx512.c,
 *      15 bits per block of 256, one vpdpwssd per 32 weights), as int4's two digits on
 *      neondot (neon.c, 15 bits per block of 32): per group of 16,
 *      d sc sx (sum q X) plus the group's term d sc (-32 sx sum X) (xsum, from the same
 *      X). Without them (x with inf or NaN, or a path with neither) it runs q6_gemv_c in
 *      float. Prompts take the integer GEMM on the x86 paths that have one (codes q, a
 *      scale d sc per 16), else dequantize tiles (q6_dequant_c).
 *
 * int5 (quant/formats/int5.py, GGUF Q5_0 / Q5_1's blocks split into columns): qw uint8
 *      (N, K/2) int4's nibbles, qh uint8 (N, K/8) per block of 32 a little-endian uint32
 *      whose bit j is element j's bit 4, scales (and mins) float16 (N, K/32), g = 32;
 *      symmetric w = (q - 16) * d, asymmetric w = q * d + m. The GEMV runs as int4's on
 *      x's two digits (the same layout and xprep; 2 * 31 * 128 still fits vpmaddubsw's
 *      int16 pairs; vpdpbusd on AVX-512 VNNI), each code ORed with 16 where its qh bit is
 *      set, the -16 d (or m) term from the group sums; without digits (x with inf or NaN,
 *      or a path with none) q5_gemv_c in float. The GEMM dequantizes tiles, or on plain AVX2 runs the
 *      integer GEMM (codes 0..31, o = 16 or mins).
 * ---------------------------------------------------------------------------------- */

typedef struct {
    const float *x;       /* (M, K) */
    const void *qw;       /* int8 (N, K) or uint8 (N, K/2) */
    const void *scales;   /* float16 (N, K/g), or float32 (N, 1) for int8 with g == 0 */
    const uint16_t *mins; /* float16 (N, K/g) for asymmetric int4, else NULL */
    float *y;             /* (M, N) */
    int64_t M, N, K, g;   /* g == 0: int8 per output channel */
    const float *xsum;    /* GEMV, int4: (K/g) group sums of x[0] (times -8 if symmetric);
                           * int8 digit path: per group (one when g == 0), -128 sx sum X;
                           * int6 digit path: per 16, -32 sx sum X */
    const void *xq;       /* GEMV, digit paths: x[0] as digits and scales (xprep_fn) */
    const uint8_t *qh;    /* int5: high bits (N, K/8), else NULL */
} qmat;

/* One instruction set's kernels. Each computes the columns [n0, n1) of y. */
typedef void (*gemv_fn)(const qmat *a, int64_t n0, int64_t n1);
/* The digit GEMV for R rows of x at once (a[r]: row r's x, digits and y; the same
 * weights): each weight row is unpacked once for all rows, and each output element is
 * computed exactly as the one-row GEMV computes it. */
typedef void (*gemv_rows_fn)(const qmat *const *a, int R, int64_t n0, int64_t n1);
/* Dequantize rows [n0, n1) of W into w (n1 - n0, K) float32, bit for bit as the format's
 * definition evaluates it (one product, then a separate sum; no FMA). */
typedef void (*dequant_fn)(const qmat *a, int64_t n0, int64_t n1, float *w);
/* y[m, j] = sum_k x[m, k] w[j, k] for m < M, j < nb (rows strided by ldx, ldw, ldy);
 * accumulate: add to y instead of storing. */
typedef void (*tile_fn)(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y,
                        int64_t ldy, int64_t M, int64_t nb, int64_t K, int accumulate);

/* x (K) -> digits and block scales in the layout the path's q4_gemv_digits reads, in a
 * 64-byte aligned buffer of XPREP_BYTES(K): at most 320 bytes per 128 elements (two
 * digit bytes each, and a float scale per 4: avx512.c's layout; AVX2's and NEON's take
 * no more), AVX2's then X as int16 for its rows kernels (256 bytes per 128), then at the
 * buffer's end (xprep4_xs) each block's term sx * sum X: the int4 GEMV's mins (or -8 d)
 * term then multiplies the same x as its codes do, and y is exactly x's digits times W,
 * as in the integer GEMM. Returns -1 (and leaves the buffer) if x has inf or NaN. */
typedef int (*xprep_fn)(const float *x, int64_t K, void *buf);
#define XPREP_BYTES(K) ((((K) + 127) / 128) * (320 + 256) + 64 + (((K) + 31) / 32) * 4)
static inline float *xprep4_xs(void *buf, int64_t K) {
    return (float *)((int8_t *)buf + XPREP_BYTES(K)) - (K + 31) / 32;
}

/* Enough for a GEMV's prepared x in any path's layout (XPREP_BYTES, XPREP8_BYTES,
 * SB_XPREP_BYTES; neondot's int6, q4_k and q5_k take int4's). */
#define XPREP_MAX2(a, b) ((a) > (b) ? (a) : (b))
#define ANY_XPREP_BYTES(K) XPREP_MAX2(XPREP_BYTES(K), XPREP_MAX2(XPREP8_BYTES(K), SB_XPREP_BYTES(K)))

/* The int8 digit GEMV's x: per 64 elements three digit vectors of 64 bytes, then per
 * 64 elements 16 lane scales (lane l: elements 4l..4l+3, scale of their block of 32),
 * then per block of 32 its term -128 * sx * sum(X) (see q8_gemv_digits). */
#define XPREP8_CHUNK_BYTES 192 /* three digit vectors of 64 bytes */
#define XPREP8_BYTES(K) ((((K) + 63) / 64) * (XPREP8_CHUNK_BYTES + 64) + (((K) + 31) / 32) * 4 + 64)
/* where the per-block terms -128 sx sum X start in such a buffer */
static inline float *xprep8_xs(void *buf, int64_t K) {
    const int64_t C = (K + 63) / 64;
    return (float *)((int8_t *)buf + C * XPREP8_CHUNK_BYTES) + 16 * C;
}
/* Block b's lane scales (sx, a power of two) and term -128 sx sum X, |sum X| <= 2^26
 * (exact in double, then one rounding); the digits are the caller's. */
static inline void xprep8_block(void *buf, int64_t K, int64_t b, float sx, int64_t sum_x) {
    float *lanes = (float *)((int8_t *)buf + (K + 63) / 64 * XPREP8_CHUNK_BYTES);
    for (int i = 0; i < 8; i++) lanes[16 * (b / 2) + 8 * (b % 2) + i] = sx;
    xprep8_xs(buf, K)[b] = (float)(-128.0 * (double)sx * (double)sum_x);
}
/* An odd number of blocks leaves the last chunk's second half: zero digits, zero scale. */
static inline void xprep8_pad(void *buf, int64_t K) {
    const int64_t B = (K + 31) / 32, C = (K + 63) / 64;
    if (!(B % 2)) return;
    int8_t *d = (int8_t *)buf + (B / 2) * XPREP8_CHUNK_BYTES + 32;
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < 32; i++) d[64 * p + i] = 0;
    float *lanes = (float *)((int8_t *)buf + C * XPREP8_CHUNK_BYTES);
    for (int i = 0; i < 8; i++) lanes[16 * (B / 2) + 8 + i] = 0;
}

/* The integer GEMM (igemm.c), for prefill: x as two int8 digits per element and W's
 * codes as bytes, multiplied by integer dot products (vpdpbusd; on plain AVX2
 * vpmaddubsw with int16 sums, igemm_avx2.c; on neondot sdot, igemm_neon.c), then scaled
 * per block.
 *
 * x, row m, block b of 32: X = round(x / sx) with sx = amax / IG_XMAX (a block of zeros
 * has sx = 0), so |X| <= IG_XMAX = 32512: 15 significant bits of the block's largest
 * element, against float32's 24. X = 256 hi + lo, lo = X mod 256 in [-128, 127]. K is
 * padded with zeros to Kp, a multiple of 32. Rows go in tiles of IG_MR = 32 (the last
 * padded with zero rows); per tile, block and group of 4 elements j, 256 bytes: hi digits
 * of rows 0-15, of rows 16-31, then lo digits the same, each 64 bytes holding row l's 4
 * digits in dword lane l. Per tile, block and row: sx, off = o * sum X (o: the codes'
 * offset, below) and xs = sx * sum X (the asymmetric mins' term).
 *
 * W, a panel of rows: codes as unsigned bytes c, Kp per row (zeros past K). int4: c = q,
 * w = d (c - 8) symmetric, w = d c + m asymmetric; int5: c = q (0..31), w = d (c - 16) or
 * d c + m; q4_k, q5_k: c = q, per sub-block d = d sc and m = -dmin m (asymmetric); int8:
 * c = q + 128, w = d (c - 128); q3_k: as int8, c = 128 - q sc (q sc in -124..128: its
 * negation fits int8) with d = -d; iq4_xs: as int8, c = v + 128 (its levels). Per row and block, float d (the scale of the row's group
 * holding the block, or its channel's) and, asymmetric, m.
 *
 *     y[m, n] = sum_b  d[n,b] sx[m,b] (sum_k c[n,k] X[m,k] - o sum_k X[m,k])  +  m[n,b] xs[m,b]
 *
 * with o = 8 (int4 symmetric), 16 (int5 symmetric), 0 (asymmetric) or 128 (int8); the
 * integer sums are exact
 * (256 * 32 * 255 * 127 + 32 * 255 * 128 + 128 * 32 * 32512 < 2^31).
 * int6 and q2_k have a scale per 16: two d per block (nb, Kp / 16), each over its half of
 * the block's sums; off_lo holds o sum X over each block's first 16. int6: c = q (0..63),
 * o = 32, d = d sc; q2_k: c = q (0..3), o = 0, d = d sc and a min per 16, m = -dmin m
 * (nb, Kp / 16), times xs_lo (sx sum X over the first 16) and xs - xs_lo. */
#define IG_XMAX 32512
enum { IG_MR = 32 };
typedef struct {
    int8_t *digits;     /* (Mp / IG_MR, Kp / 32, 8, 256) */
    float *sx, *xs;     /* (Mp / IG_MR, Kp / 32, IG_MR) */
    int32_t *off;       /* (Mp / IG_MR, Kp / 32, IG_MR) */
    int32_t *off_lo;    /* as off, over elements 0..15 of each block; NULL: a d per block */
    float *xs_lo;       /* as xs, over elements 0..15, for mins per 16 (q2_k), else NULL */
    int64_t M, Kp;
    int cmax;           /* W's largest code: 15 (int4, q4_k), 31 (int5), 63 (int6), 255 (int8) */
} ig_x;
/* A row's terms for one block, at i = (t * Kp / 32 + b) * IG_MR + row in its tile: the
 * step sx from the block's amax, and o * sum X and sx * sum X from the sum of its X. */
static inline void ig_terms(const ig_x *d, int64_t i, float amax, int32_t sum, int o) {
    d->sx[i] = amax / IG_XMAX;
    d->xs[i] = d->sx[i] * (float)sum;
    d->off[i] = o * sum;
}
#if defined(__aarch64__)
/* A block of 32 floats x as the NEON paths take it: X = round(x / sx), sx = amax /
 * IG_XMAX (tiny blocks scaled up first, exactly), as digits hi = (X - lo) / 256 and lo = X
 * mod 256 in [-128, 127], 4 elements a vector in order; *sum is sum X. Returns amax, or
 * -1 for a block with inf or NaN. */
static inline __attribute__((always_inline)) float neon_block_digits(const float *x, int32x4_t hi[8],
                                                                     int32x4_t lo[8], int32_t *sum) {
    float32x4_t xv[8], m = vdupq_n_f32(0);
    for (int i = 0; i < 8; i++) {
        xv[i] = vld1q_f32(x + 4 * i);
        m = vmaxq_f32(m, vabsq_f32(xv[i])); /* FMAX: NaN propagates */
    }
    const float amax = vmaxvq_f32(m);
    if (!(amax <= 0x1.fffffep127f)) return -1; /* inf or NaN */
    const float up = amax < 0x1p-100f ? 0x1p100f : 1.0f;
    const float32x4_t vup = vdupq_n_f32(up), inv = vdupq_n_f32(amax > 0 ? IG_XMAX / (amax * up) : 0);
    int32x4_t s = vdupq_n_s32(0);
    for (int i = 0; i < 8; i++) {
        const int32x4_t X = vcvtnq_s32_f32(vmulq_f32(vmulq_f32(xv[i], vup), inv));
        lo[i] = vshrq_n_s32(vshlq_n_s32(X, 24), 24);
        hi[i] = vshrq_n_s32(vsubq_s32(X, lo[i]), 8);
        s = vaddq_s32(s, X);
    }
    *sum = vaddvq_s32(s);
    return amax;
}
#endif
/* Tile t of x (rows 32 t .. 32 t + 31 of x, each K long, up to d->M) -> its digits and
 * block terms in `d` (the caller has zeroed those of rows past d->M); o as above. Returns
 * -1 if the rows have inf or NaN (the float GEMM then runs). */
typedef int (*ig_xprep_fn)(const float *x, int64_t K, int64_t t, int o, const ig_x *d);
/* y[m, n] for every m < x->M and n < nb (y rows strided by ldy) from nb rows of codes w
 * (nb, Kp), d and m (nb, Kp / 32; m NULL unless asymmetric; (nb, Kp / 16) when x->off_lo)
 * as above. */
typedef void (*ig_panel_fn)(const ig_x *x, const uint8_t *w, const float *d, const float *m,
                            float *y, int64_t ldy, int64_t nb);

typedef struct {
    gemv_fn q8_gemv, q4_gemv;
    xprep_fn q4_xprep;      /* NULL: the path has no digit GEMV */
    gemv_fn q4_gemv_digits;
    dequant_fn q8_dequant, q4_dequant;
    tile_fn tile;
    xprep_fn q8_xprep;      /* NULL: the path has no int8 digit GEMV (it needs vpdpbusd:
                             * vpmaddubsw's int16 pairs overflow on 8-bit weights) */
    gemv_fn q8_gemv_digits;
    ig_xprep_fn ig_xprep;   /* NULL: the path has no integer GEMM (prefill dequantizes) */
    ig_panel_fn ig_panel;
    xprep_fn q6_xprep;      /* NULL: the path has no int6 digit GEMV; else x in XPREP8's
                             * bytes (its layout, or q6_xsum's) */
    gemv_fn q6_gemv_digits;
    dequant_fn q6_dequant;  /* NULL: q6_dequant_c */
    xprep_fn q5_xprep;      /* NULL: the path has no int5 digit GEMV; else q4_xprep's layout */
    gemv_fn q5_gemv_digits;
    dequant_fn q5_dequant;  /* NULL: q5_dequant_c */
    unsigned ig_kinds;      /* the formats its integer GEMM takes: IG_KIND(bits) of each */
    /* the digit GEMVs over several rows of x (NULL: one row at a time) */
    gemv_rows_fn q4_gemv_rows, q5_gemv_rows, q6_gemv_rows;
    gemv_rows_fn q8_gemv_rows; /* over float x: rows whose GEMV is the float q8_gemv */
    /* int6 on x as int16 X: that x's block of one sx (32 on plain AVX2 and neondot, 256 on
     * AVX-512 VNNI; 0: x is XPREP8's three digits, whose sums matmul.c takes), and per 16
     * elements -32 sx sum X from it (NULL where the kernel keeps the offset in its
     * integers: AVX-512 VNNI) */
    void (*q6_xsum)(const void *xq, int64_t K, float *xsum);
    int q6_xblock;
    int sb_path; /* the super-block kinds' kernels it runs (sb_for): SB_PLAIN by default */
} kernel_table;
enum { SB_PLAIN = 0, SB_AVX2 = 1, SB_AVX512_VNNI = 2, SB_NEON_DOT = 3, SB_NEON = 4 };
#define IG_KIND(bits) (1u << (bits))

/* int6 in plain C (scalar.c), every path's fallback: the GEMV in float32 (x with inf or
 * NaN, or no digit GEMV) and the GEMM's dequantization (exact; AVX-512 has its own). */
void q6_gemv_c(const qmat *a, int64_t n0, int64_t n1);
void q6_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w);
enum { Q6_BLOCK = 256, Q6_BLOCK_BYTES = 210 };
/* int5 in plain C (scalar.c), every path's fallback as int6's: the float GEMV (a->xsum:
 * per group -16 sum x, or sum x with mins) and the GEMM's dequantization. */
void q5_gemv_c(const qmat *a, int64_t n0, int64_t n1);
void q5_dequant_c(const qmat *a, int64_t n0, int64_t n1, float *w);
/* Super-block kinds beside int6 (q4k_q5k.c, q2k_q3k.c): GGUF's blocks of 256 as they lie, the
 * kind ggml's type id in place of bits, qw uint8 (N, K / 256 * block bytes), K % 256 == 0,
 * g = 256, scales and mins unused.
 * q5_k (quant/formats/q5k.py): kind Q5K, Q5_K's blocks of 176 bytes.
 * q4_k (quant/formats/q4k.py): kind Q4K, Q4_K's blocks of 144 bytes.
 * q3_k (quant/formats/q3k.py): kind Q3K, Q3_K's blocks of 110 bytes.
 * q2_k (quant/formats/q2k.py): kind Q2K, Q2_K's blocks of 84 bytes.
 * iq4_xs (quant/formats/iq4xs.py): kind IQ4XS, IQ4_XS's blocks of 136 bytes (iq4xs.c).
 * Their kernels hang off the path's table by its sb_path (matmul.c's sb_for), not in it:
 * the float GEMV (every path's fallback), xprep (x in one of q4k_q5k.c's two layouts,
 * SB_XPREP_BYTES; matrices of one x and layout share it; NULL: no integer GEMV), the
 * integer GEMV, its form over several rows, and the GEMM's dequantization. */
enum { Q2K = 10, Q3K = 11, Q4K = 12, Q5K = 13, IQ4XS = 23 };
enum { Q4K_BLOCK = 256, Q5K_BLOCK_BYTES = 176, Q4K_BLOCK_BYTES = 144, Q3K_BLOCK_BYTES = 110,
       Q2K_BLOCK_BYTES = 84, IQ4XS_BLOCK_BYTES = 136 };
#define SB_XPREP_BYTES(K) (4 * (K) + (K) / Q4K_BLOCK * 4 + (K) / 32 * 4 + (K) / 16 * 4)
/* Where that x keeps X as int16, each block's sx, and sx * sum X per 32 and per 16 */
static inline const int16_t *sb_x16(const void *buf, int64_t K) {
    return (const int16_t *)((const int8_t *)buf + 2 * K);
}
static inline const float *sb_sx(const void *buf, int64_t K) {
    return (const float *)((const int8_t *)buf + 4 * K);
}
static inline const float *sb_xs32(const void *buf, int64_t K) { return sb_sx(buf, K) + K / Q4K_BLOCK; }
static inline const float *sb_xs16(const void *buf, int64_t K) { return sb_xs32(buf, K) + K / 32; }
typedef struct {
    gemv_fn gemv_c;
    xprep_fn xprep;
    gemv_fn gemv_digits;
    gemv_rows_fn gemv_rows; /* NULL: one row at a time */
    dequant_fn dequant;
} sb_kernels;
const sb_kernels *q5k_for(const kernel_table *kt);
const sb_kernels *q4k_for(const kernel_table *kt);
const sb_kernels *q3k_for(const kernel_table *kt);
const sb_kernels *q2k_for(const kernel_table *kt);
const sb_kernels *iq4xs_for(const kernel_table *kt);
#if defined(__aarch64__)
/* neon.c's x for neondot's int4 GEMV (XPREP_BYTES, two int8 digits per block of 32), which
 * q4_k's and q5_k's neondot GEMV read too (their sub-blocks are its blocks) */
int neon_q4_xprep(const float *x, int64_t K, void *buf);
#endif
#ifdef INFER_X86
/* q4k_q5k.c's x for the super-block kinds' AVX2 and AVX-512 kernels (its layout there):
 * X per sub-block (q5_k, q4_k), or per pair of sub-blocks (q3_k, q2_k, iq4_xs, whose
 * AVX-512 kernels take two quarters or sub-blocks a vector) */
int q4k_xprep_avx2(const float *x, int64_t K, void *buf);
int sb_xprep_pairs_avx2(const float *x, int64_t K, void *buf);
#endif
/* A block's sub-block scales d * sc[j] and mins -(dmin * m[j]), rounded as the
 * dequantization rounds them (the integer GEMM's panel). */
void q4k_block_scales(const uint8_t *blk, float d[8], float m[8]);
/* A Q5_K block's codes in 0..31, sub-block by sub-block (the integer GEMM's panel) */
void q5k_block_codes(const uint8_t *blk, uint8_t c[256]);
/* A q3_k block as the integer GEMM's panel takes it: codes c = 128 - q sc (256 bytes) and
 * each block of 32's d, -d (exact: w = d sc q = -d (c - 128)). */
void q3k_block_panel(const uint8_t *blk, uint8_t c[256], float d[8]);
/* A Q2_K block for the panel: codes c = q (0..3), and per group of 16 d sc and -dmin m
 * (exact: w = d sc c - dmin m). */
void q2k_block_panel(const uint8_t *blk, uint8_t c[256], float d[16], float m[16]);
/* An IQ4_XS block for the panel: codes c = v + 128 (its levels) and each sub-block's
 * d (ls - 32) (exact: w = d (ls - 32) (c - 128)). */
void iq4xs_block_panel(const uint8_t *blk, uint8_t c[256], float d[8]);
/* Bytes of one row of W: K * bits / 8, or int6's or a super-block kind's blocks. */
static inline int64_t q_row_bytes(int bits, int64_t K) {
    return bits == 6     ? K / Q6_BLOCK * Q6_BLOCK_BYTES
           : bits == Q4K ? K / Q4K_BLOCK * Q4K_BLOCK_BYTES
           : bits == Q5K ? K / Q4K_BLOCK * Q5K_BLOCK_BYTES
           : bits == Q3K ? K / Q4K_BLOCK * Q3K_BLOCK_BYTES
           : bits == Q2K ? K / Q4K_BLOCK * Q2K_BLOCK_BYTES
           : bits == IQ4XS ? K / Q4K_BLOCK * IQ4XS_BLOCK_BYTES
                         : K * bits / 8;
}

extern const kernel_table kernels_scalar;
#ifdef INFER_X86
extern const kernel_table kernels_avx2, kernels_avx2_vnni;
extern const kernel_table kernels_avx512, kernels_avx512_vnni;
/* AVX-512 VNNI's rows kernels on x as int16 (q4_k, q5_k, int6), one call: up to 8 rows of
 * x against blocks [b0, b1) of weight row n, each row's accumulators in st (16 vectors of
 * 16 floats a weight row, 64-byte aligned) from call to call: zero at block 0, the output
 * at the row's last block. pf: how far ahead its weights are prefetched. */
typedef void (*rows_slice_fn)(const qmat *const *a, int R, int64_t n, int64_t b0, int64_t b1,
                              int64_t pf, float *st);
/* Such a kernel over rows of x 8 at a time and weight rows [n0, n1) of B blocks of 256
 * (`block_bytes` each; x 512 bytes a block and row). Where the rows' x fits 40 KiB of L1,
 * each weight row is read whole (prefetched `ahead`); else 8 weight rows at a time, K in
 * slices of 6 blocks (8 rows' slices of x, 24 KiB, stay in L1), the accumulators carried
 * between slices. A row's blocks add up in one order either way. Inline, so that
 * each caller's kernel is inlined into it with its constants. */
enum { SLICE_WHOLE_BYTES = 40960, SLICE_BLOCKS = 6, SLICE_ROWS = 8 };
static inline __attribute__((always_inline)) void rows_in_slices(
    rows_slice_fn slice, const qmat *const *a, int R, int64_t n0, int64_t n1, int64_t B,
    int64_t block_bytes, int64_t ahead) {
    float st[SLICE_ROWS][16 * 16] __attribute__((aligned(64)));
    if (R * B * 512 <= SLICE_WHOLE_BYTES) { /* x as int16: 512 bytes a block and row */
        for (int64_t n = n0; n < n1; n++)
            for (int m = 0; m < R; m += 8) slice(a + m, R - m < 8 ? R - m : 8, n, 0, B, ahead, st[0]);
        return;
    }
    const int64_t pf = prefetch_distance(B * block_bytes, 1);
    for (int m = 0; m < R; m += 8) {
        const int r = R - m < 8 ? R - m : 8;
        for (int64_t c = n0; c < n1; c += SLICE_ROWS) {
            const int64_t c1 = n1 - c < SLICE_ROWS ? n1 : c + SLICE_ROWS;
            for (int64_t b0 = 0; b0 < B; b0 += SLICE_BLOCKS)
                for (int64_t n = c; n < c1; n++)
                    slice(a + m, r, n, b0, B - b0 < SLICE_BLOCKS ? B : b0 + SLICE_BLOCKS, pf, st[n - c]);
        }
    }
}

/* avx2.c's int5 kernels, which plain AVX-512 uses too (AVX-512 VNNI has its own GEMVs). */
int avx2_q4_xprep(const float *x, int64_t K, void *buf);
void avx2_q5_gemv_digits(const qmat *a, int64_t n0, int64_t n1);
void avx2_q5_gemv_rows(const qmat *const *a, int R, int64_t n0, int64_t n1);
void avx2_q5_dequant(const qmat *a, int64_t n0, int64_t n1, float *w);
/* The integer GEMM's panel kernel on plain AVX2 (igemm_avx2.c). */
void avx2_ig_panel(const ig_x *x, const uint8_t *w, const float *d, const float *m, float *y,
                   int64_t ldy, int64_t nb);
#endif
#if defined(__aarch64__)
extern const kernel_table kernels_neon, kernels_neon_dot;
/* The integer GEMM on neondot (igemm_neon.c): x's digits and the sdot panel kernel. */
int neon_ig_xprep(const float *x, int64_t K, int64_t t, int o, const ig_x *d);
void neon_ig_panel(const ig_x *x, const uint8_t *w, const float *d, const float *m, float *y,
                   int64_t ldy, int64_t nb);
#endif
const kernel_table *kernels_for(int isa); /* NULL when the path is not built in */

/* How the drivers (matmul.c, lut.c) split a GEMV over the pool. Below
 * GEMV_MIN_BYTES_PER_THREAD of weights per thread a second thread costs more than it
 * saves. A GEMV's rows go in at least GEMV_TASKS_PER_THREAD tasks per thread, so that a
 * thread slowed by another process holds up part of the work, and no more, since each
 * task starts its weight streams cold. */
enum { GEMV_MIN_BYTES_PER_THREAD = 32 * 1024, GEMV_TASKS_PER_THREAD = 2 };

/* Threads worth using for a GEMV over `bytes` of weights. */
static inline int gemv_threads(int64_t bytes, int nthreads) {
    const int64_t most = bytes / GEMV_MIN_BYTES_PER_THREAD;
    return nthreads > most ? (most > 1 ? (int)most : 1) : nthreads;
}

/* The drivers (matmul.c): split over output rows, run on the pool. bits is 8, 6, 5, 4, or a
 * super-block kind (Q5K, Q4K, Q3K, Q2K, IQ4XS). Returns 0, or -1 when out of memory. */
int q_matmul(int bits, const qmat *a, int isa, int nthreads);
/* igemm.c: q_matmul's GEMM on the integer path (bits in the table's ig_kinds). Returns
 * 0, -1 when out of memory, or 1 when it does not apply (the path has none, or x has inf
 * or NaN). */
int q_igemm(int bits, const qmat *a, const kernel_table *kt, int nthreads);
/* n GEMVs (bits[i] as q_matmul's) as one pool job, e.g. q, k and v of a block, or the gate
 * and up projections of 8 experts: one wake-up of the pool instead of n, and small
 * matrices share the threads. Each has its M rows of x, 1 <= M <= GEMV_ROWS_MAX
 * (several sequences decoded together, guessed tokens checked, the tokens routed to an
 * expert): every row is its own GEMV, each output element computed exactly as for that
 * row alone (M == 1), while a task's weights are read from memory once for all rows.
 * Returns 0, or -1 (out of memory, n outside [1, Q_GEMV_MANY_MAX], or M out of range). */
#define Q_GEMV_MANY_MAX 16
#define GEMV_ROWS_MAX 16
int q_gemv_many(int n, const int *bits, const qmat *const *a, int isa, int nthreads);
/* q_matmul's path for M rows of x of width K (the tests read them, ops.matmul_paths):
 * at most SMALL_M rows, or WIDE_M rows of at least WIDE_K, run the GEMVs a row each
 * (q_gemv_many). A row's GEMV has work per output element besides its K-long dot
 * product, so it pays for more rows when rows are long: up to the integer GEMM's first
 * size, as the float GEMM between took twice as long (a chat turn's 9 to 15 new tokens).
 * From IGEMM_MIN_M rows the integer GEMM runs where the path has one (igemm.c); below,
 * its fixed work (x's digits, each panel's widening, tiles of 16 rows) costs more than
 * its faster dot products save, on narrow rows (512, 576) most. Else the float GEMM. */
enum { SMALL_M = 4, WIDE_M = 15, WIDE_K = 768, IGEMM_MIN_M = 16 };

/* lut.c: y (M, N) = x (M, K) W^T for W in `bits` one-bit planes (see lut.c).
 * Returns 0, or -1 when out of memory. */
int lut_matmul(const float *x, const uint8_t *qw, const uint16_t *scales, const uint16_t *mins,
               float *y, int64_t M, int64_t N, int64_t K, int bits, int g, int isa, int nthreads);
/* n LUT GEMVs of M rows of x each as one pool job, as q_gemv_many: matrices that share x
 * share its tables, built once per row. Each output element is computed exactly as
 * lut_matmul computes it for its row alone. Returns 0, or -1 (out of memory, n outside
 * [1, Q_GEMV_MANY_MAX], or M out of range). */
typedef struct {
    const float *x; /* (M, K) */
    const uint8_t *qw;
    const uint16_t *scales, *mins;
    float *y; /* (M, N) */
    int64_t M, N, K;
    int bits, g;
} lut_gemv;
int lut_gemv_many(int n, const lut_gemv *a, int isa, int nthreads);

/* Streaming read of n bytes (a multiple of 256) on nthreads threads; returns a sum of
 * the bytes so the compiler keeps the reads. For the bandwidth ceiling in benchmarks. */
double stream_read(const void *p, int64_t n, int isa, int nthreads);

/* float16 -> float32 in plain C (the scalar path; exact for every value). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13); /* inf / nan */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalize */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    union {
        uint32_t u;
        float f;
    } v = {bits};
    return v.f;
}

#endif
