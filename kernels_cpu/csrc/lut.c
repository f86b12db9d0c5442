/* T-MAC style LUT GEMM for the lut1..lut4 formats (quant/formats/lut.py): y (M, N) = x (M, K) W^T.

   Weights: b one-bit planes, qweight uint8 (b, N, K/8); bit i of byte t of plane p, row n
   is bit p of q[n, 8t+i]; w = q*s + m per group of g (scales, mins f16 (N, K/g)).
   The 4-element group j (elements 4j..4j+3) is the low nibble of byte j/2 if j is even,
   the high nibble if odd.

   The algebra (per activation row; a = x, b_pk = bit p of q_k, s_i = 2 b_i - 1 in {-1,+1}):

     sum_k q_k a_k = sum_p 2^p sum_k b_pk a_k
     sum_k b_k a_k = 1/2 (sum_k s_k a_k + A)             A = sum_k a_k over the group
     sum_{k in j} s_k a_k = S_j[nib]                     S_j[idx] = sum_i (2 bit_i(idx) - 1) a_4j+i

   S_j is sign-symmetric, S_j[15 - idx] = -S_j[idx] (15 - idx flips every bit), so only
   idx 0..7 are computed and 8..15 mirrored (T-MAC / SAIL "mirror consolidation").
   max |S_j| = sum_i |a_4j+i|. Tables are quantized to int8 with one scale per weight
   group G (the g/4 tables of the group share it):

     amax_G = max_j (((|a0| + |a1|) + |a2|) + |a3|)       lam_G = amax_G / 127
     t_j[idx] = clamp(rint(S_j[idx] * (127 / amax_G)), -127, 127)   (t_j[15-idx] = -t_j[idx])

   and for row n, group G the integer  I = sum_p 2^p sum_{j in G} t_j[nib_p(n, j)]  (exact;
   |I| <= 15 * 2 * 127 * g/8) gives

     sum_{k in G} w_k a_k ~= s * (c1_G * I + c2_G) + m * A_G,   c1 = lam/2, c2 = (2^b-1)/2 * A

   Canonical float order (every path computes exactly this, so they agree bit for bit):
     per table: S = ((+-a0 +- a1) +- a2) - a3 as written in lut_build_tables; A_G =
     sequential sum over the group's tables of (((a0 + a1) + a2) + a3);
     per row: acc = 0; for G in order: u = fma(c1, I, c2); acc = fma(s, u, acc);
     acc = fma(m, A, acc).  y = acc.

   Table layout, per activation row, per 64 weights (one "qword": 8 bytes of each plane,
   16 tables): 256 int8; bytes [16t, 16t+16) = table of the low nibble of byte t (j = 2t),
   bytes [128 + 16t, ...) = table of the high nibble (j = 2t + 1), t = 0..7. So AVX-512
   VBMI looks a byte up in 8 tables at once with vpermi2b, index (t << 4) | nibble.

   Paths (same integers, same float order), chosen from kernels.h's ids by lut_isa:
     scalar      here; any g (a multiple of 8)
     avx2        lut_avx2.c (avx2, avx2vnni, avx512): 16 rows at a time, vpshufb
     avx512vnni  lut_avx512.c (with VBMI): blocks of 8 rows, vpermi2b and vpdpbusd
     neon        lut_neon.c (neon, neondot): 16 rows at a time, tbl
   The SIMD paths need g % 32 == 0; rows past their last full block use scalar. Shared
   declarations: lut_common.h; the scalar path: lut_scalar.c.
*/

/* INFER_NO_PYTHON leaves out the CPython functions at the end, so the kernels build alone
   (tests/native/lut_neon_check.c, cross-compiled for AArch64). */
#ifndef INFER_NO_PYTHON
#include "binding.h"
#endif

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "lut_common.h"

/* ------------------------------------------------------------------------------------ */
/* Driver: tables once per activation row, then row blocks on the pool                   */
/* ------------------------------------------------------------------------------------ */

/* Rows per block in a task: the SIMD paths' superblocks (32; 16 and 8 at the end) */
enum { LUT_BLOCK = SB };
/* Activation rows per pass (prefill): their tables stay in L2 (~256 KB) while every row
   block passes over them; the block's weights stay in L1/L2 across the pass's rows. */
enum { TABLE_TILE_BYTES = 256 * 1024 };

static int64_t scratch_ld(int64_t K, int g) { return 8 * ((K / g + 31) / 32 * 32); }

/* The path lut.c runs for a requested one (cached: CPUID is slow in a VM): its AVX-512
   path (ISA_AVX512_VNNI) also needs VBMI (Ice Lake, Zen 4 and later); plain avx512 promises
   no VNNI, so it and the AVX-VNNI level run the AVX2 path; neondot runs the NEON path. */
static int lut_isa_detect(int isa) {
#ifdef INFER_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX512_VNNI && isa_supported(ISA_AVX512_VNNI) &&
        __builtin_cpu_supports("avx512vbmi"))
        return ISA_AVX512_VNNI;
    if ((isa == ISA_AVX2 || isa == ISA_AVX2_VNNI || isa == ISA_AVX512 ||
         isa == ISA_AVX512_VNNI) &&
        isa_supported(ISA_AVX2))
        return ISA_AVX2;
#endif
#if defined(__aarch64__)
    if ((isa == ISA_NEON || isa == ISA_NEON_DOT) && isa_supported(isa)) return ISA_NEON;
#endif
    (void)isa;
    return ISA_SCALAR;
}

int lut_isa(int isa) {
    static _Atomic int cache[ISA_COUNT]; /* path + 1; 0: not yet known */
    if (isa < 0 || isa >= ISA_COUNT) return ISA_SCALAR;
    int c = atomic_load_explicit(&cache[isa], memory_order_relaxed);
    if (!c) atomic_store_explicit(&cache[isa], c = lut_isa_detect(isa) + 1, memory_order_relaxed);
    return c - 1;
}

/* Activation rows [m0, m1) x weight rows [n0, n1). */
static void rows_any(const lut_problem *P, int isa, int64_t m0, int64_t m1, int64_t n0,
                     int64_t n1, lut_scratch *S) {
#ifdef INFER_X86
    if (P->g % 32 == 0 && isa == ISA_AVX512_VNNI) {
        lut_rows_avx512(P, m0, m1, n0, n1, S);
        return;
    }
    if (P->g % 32 == 0 && isa == ISA_AVX2) {
        lut_rows_avx2(P, m0, m1, n0, n1, S);
        return;
    }
#endif
#if defined(__aarch64__)
    if (P->g % 32 == 0 && isa == ISA_NEON) {
        lut_rows_neon(P, m0, m1, n0, n1, S);
        return;
    }
#endif
    (void)isa;
    for (int64_t m = m0; m < m1; m++) lut_rows_scalar(P, m, n0, n1, S->I);
}

typedef struct {
    lut_problem P; /* for the current pass: M = its rows, tables and y offset to it */
    const float *x; /* the pass's activation rows (P.M, K) */
    int isa;
    int64_t rows; /* weight rows per task */
    lut_scratch *scratch; /* per thread */
} lut_job;

/* One activation row's tables and constants, on the fastest builder (same bits). */
void lut_tables_row(const float *x, int64_t K, int g, int bits, int isa, int8_t *tables,
                       float *c1, float *c2, float *asum) {
#ifdef INFER_X86
    if (isa != ISA_SCALAR && g % 32 == 0) {
        lut_build_tables_avx2(x, K, g, bits, tables, c1, c2, asum);
        return;
    }
#endif
#if defined(__aarch64__)
    if (isa == ISA_NEON && g % 16 == 0) {
        lut_build_tables_neon(x, K, g, bits, tables, c1, c2, asum);
        return;
    }
#endif
    (void)isa;
    lut_build_tables(x, K, g, bits, tables, c1, c2, asum);
}

static void tables_task(void *ctx, int64_t m, int tid) {
    (void)tid;
    const lut_job *J = ctx;
    const lut_problem *P = &J->P;
    const int64_t ng = P->K / P->g;
    lut_tables_row(J->x + m * P->K, P->K, P->g, P->bits, J->isa,
               (int8_t *)P->tables + m * P->tables_stride, (float *)P->c1 + m * ng,
               (float *)P->c2 + m * ng, (float *)P->asum + m * ng);
}

static void rows_task(void *ctx, int64_t t, int tid) {
    const lut_job *J = ctx;
    const int64_t n0 = t * J->rows, n1 = n0 + J->rows < J->P.N ? n0 + J->rows : J->P.N;
    rows_any(&J->P, J->isa, 0, J->P.M, n0, n1, &J->scratch[tid]);
}

/* Weight rows per task over N rows, in whole blocks: `per` tasks per thread. A GEMV takes
   kernels.h's GEMV_TASKS_PER_THREAD; a GEMM 4: its tasks are long, and more of them even
   out a thread that falls behind. */
enum { GEMM_TASKS_PER_THREAD = 4 };
static int64_t task_rows(int64_t N, int nthreads, int per) {
    const int64_t blocks = (N + LUT_BLOCK - 1) / LUT_BLOCK;
    const int64_t want = (int64_t)per * nthreads;
    const int64_t tasks = want < blocks ? want : blocks;
    return (blocks + tasks - 1) / tasks * LUT_BLOCK;
}

/* Per-thread scratch for nthreads threads, group integers of nI int32 and scratch width
   ld: idx (IDX_BYTES), I (nI), s and mn (4 * ld each), in one block *mem (free both the
   block and the returned array); NULL when out of memory. */
static lut_scratch *scratch_new(int nthreads, int64_t ld, int64_t nI, char **mem) {
    const size_t per_thread = IDX_BYTES + 4 * (size_t)(nI + 8 * ld);
    char *scr = *mem = aligned_alloc(64, per_thread * (size_t)nthreads);
    lut_scratch *scratch = malloc(sizeof(lut_scratch) * (size_t)nthreads);
    if (!scr || !scratch) {
        free(scratch);
        return NULL;
    }
    for (int t = 0; t < nthreads; t++) {
        char *b = scr + per_thread * t;
        float *f = (float *)(b + IDX_BYTES + 4 * nI);
        scratch[t] = (lut_scratch){(int32_t *)(b + IDX_BYTES), f, f + 4 * ld, ld, b};
    }
    return scratch;
}

/* y (M, N) = x (M, K) W^T (declared in kernels.h). Returns 0, or -1 when out of memory. */
int lut_matmul(const float *x, const uint8_t *qw, const uint16_t *scales,
                      const uint16_t *mins, float *y, int64_t M, int64_t N, int64_t K, int bits,
                      int g, int isa, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    isa = lut_isa(isa);
    const int64_t ng = K / g, stride = (int64_t)tables_bytes(K);
    int64_t tile = TABLE_TILE_BYTES / stride;
    tile = tile < 1 ? 1 : tile > MAX_TILE_M ? MAX_TILE_M : tile;
    if (tile > M) tile = M;
    if (nthreads < 1) nthreads = 1;
    if (M == 1) nthreads = gemv_threads(N * K * bits / 8, nthreads);
    const int64_t rows = task_rows(N, nthreads, M == 1 ? GEMV_TASKS_PER_THREAD
                                                       : GEMM_TASKS_PER_THREAD);
    const int64_t tasks = (N + rows - 1) / rows;

    const int64_t ld = scratch_ld(K, g);
    int8_t *tables = aligned_alloc(64, (size_t)(tile * stride));
    float *consts = malloc(sizeof(float) * 3 * (size_t)(tile * ng));
    char *scr = NULL;
    lut_scratch *scratch = scratch_new(nthreads, ld, tile * 4 * ld, &scr);
    int rc = 0;
    if (!tables || !consts || !scratch) {
        rc = -1;
        goto done;
    }
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
        const int64_t mt = M - m0 < tile ? M - m0 : tile;
        lut_job J = {
            .P = {mt, K, N, bits, g, qw, scales, mins, tables, stride, consts, consts + mt * ng,
                  consts + 2 * mt * ng, y + m0 * N},
            .x = x + m0 * K,
            .isa = isa,
            .rows = rows,
            .scratch = scratch,
        };
        if (mt == 1)
            tables_task(&J, 0, 0);
        else
            pool_run(nthreads, mt, tables_task, &J);
        pool_run(nthreads, tasks, rows_task, &J);
    }
done:
    free(tables);
    free(consts);
    free(scr);
    free(scratch);
    return rc;
}

/* Several GEMVs as one pool job (declared in kernels.h): tasks numbered across the
   matrices in order; matrices with the same x, K and g share its tables (c2 is per bit
   width: lut_build_tables' half_levels * A, recomputed here in the same float operation). */
typedef struct {
    int n;
    lut_job jobs[Q_GEMV_MANY_MAX];
    int64_t first[Q_GEMV_MANY_MAX + 1]; /* first task of each job; first[n] = all */
} lut_many_job;

static void lut_many_task(void *ctx, int64_t t, int tid) {
    const lut_many_job *m = ctx;
    int i = 0;
    while (t >= m->first[i + 1]) i++;
    rows_task((void *)&m->jobs[i], t - m->first[i], tid);
}

int lut_gemv_many(int n, const lut_gemv *a, int isa, int nthreads) {
    if (n < 1 || n > Q_GEMV_MANY_MAX) return n == 0 ? 0 : -1;
    isa = lut_isa(isa);
    if (nthreads < 1) nthreads = 1;
    int64_t bytes = 0, ld = 0, table_bytes = 0, consts = 0, M_most = 1;
    int owner[Q_GEMV_MANY_MAX]; /* the first matrix with the same x, M, K and g */
    for (int i = 0; i < n; i++) {
        const int64_t M = a[i].M; /* rows of x, each its own GEMV */
        if (M < 1 || M > GEMV_ROWS_MAX) return -1;
        M_most = M > M_most ? M : M_most;
        bytes += a[i].N * a[i].K * a[i].bits / 8;
        const int64_t l = scratch_ld(a[i].K, a[i].g);
        ld = l > ld ? l : ld;
        owner[i] = i;
        for (int k = 0; k < i && owner[i] == i; k++)
            if (a[k].x == a[i].x && a[k].M == M && a[k].K == a[i].K && a[k].g == a[i].g)
                owner[i] = k;
        if (owner[i] == i) { /* its tables, c1 and asum, per row */
            table_bytes += M * (int64_t)tables_bytes(a[i].K);
            consts += 2 * M * a[i].K / a[i].g;
        }
        consts += M * a[i].K / a[i].g; /* c2 */
    }
    nthreads = gemv_threads(bytes, nthreads);
    int8_t *tables = aligned_alloc(64, (size_t)(table_bytes + 63) / 64 * 64);
    float *cbuf = malloc(sizeof(float) * (size_t)consts);
    char *scr = NULL;
    lut_scratch *scratch = scratch_new(nthreads, ld, M_most * 4 * ld, &scr);
    int rc = 0;
    if (!tables || !cbuf || !scratch) {
        rc = -1;
        goto done;
    }
    lut_many_job m = {.n = n};
    int8_t *tp = tables;
    float *cp = cbuf;
    for (int i = 0; i < n; i++) {
        const int64_t K = a[i].K, ng = K / a[i].g, stride = (int64_t)tables_bytes(K), M = a[i].M;
        /* c1, c2 and asum (M, ng) each, as lut_matmul lays them out */
        lut_problem P = {M, K, a[i].N, a[i].bits, a[i].g, a[i].qw, a[i].scales, a[i].mins,
                         NULL, stride, NULL, NULL, NULL, a[i].y};
        if (owner[i] == i) {
            P.tables = tp, P.c1 = cp, P.c2 = cp + M * ng, P.asum = cp + 2 * M * ng;
            for (int64_t r = 0; r < M; r++)
                lut_tables_row(a[i].x + r * K, K, a[i].g, a[i].bits, isa, tp + r * stride,
                               cp + r * ng, cp + (M + r) * ng, cp + (2 * M + r) * ng);
            tp += M * stride, cp += 3 * M * ng;
        } else {
            const lut_problem *o = &m.jobs[owner[i]].P;
            P.tables = o->tables, P.c1 = o->c1, P.asum = o->asum, P.c2 = cp;
            const float half_levels = 0.5f * (float)((1 << a[i].bits) - 1);
            for (int64_t G = 0; G < M * ng; G++) cp[G] = half_levels * o->asum[G];
            cp += M * ng;
        }
        const int64_t rows = task_rows(a[i].N, nthreads, GEMV_TASKS_PER_THREAD);
        m.jobs[i] = (lut_job){.P = P, .x = a[i].x, .isa = isa, .rows = rows, .scratch = scratch};
        m.first[i + 1] = m.first[i] + (a[i].N + rows - 1) / rows;
    }
    pool_run(nthreads, m.first[n], lut_many_task, &m);
done:
    free(tables);
    free(cbuf);
    free(scr);
    free(scratch);
    return rc;
}

#ifndef INFER_NO_PYTHON
/* ------------------------------------------------------------------------------------ */
/* Python functions, added to infer.kernels_cpu._C by module.c                           */
/* ------------------------------------------------------------------------------------ */

static int bad_sizes(const char *name, long long M, long long K, long long bits, long long g) {
    if (M < 0 || K <= 0 || bits < 1 || bits > 4 || g <= 0 || g % 8 || K % g) {
        PyErr_Format(PyExc_ValueError, "%s: bad sizes M=%lld K=%lld bits=%lld g=%lld", name, M, K,
                     bits, g);
        return 1;
    }
    return 0;
}

/* isa_supported, cached: its CPUID is slow in a VM and decode calls ~200 matmuls a token */
static int bad_isa(long long isa) {
    static _Atomic int ok[ISA_COUNT]; /* 1 + supported; 0: not yet known */
    int c = isa >= 0 && isa < ISA_COUNT ? atomic_load_explicit(&ok[isa], memory_order_relaxed) : 1;
    if (!c) atomic_store_explicit(&ok[isa], c = 1 + isa_supported((int)isa), memory_order_relaxed);
    if (c != 2) {
        PyErr_Format(PyExc_ValueError, "instruction set %lld is not available on this CPU", isa);
        return 1;
    }
    return 0;
}

/* lut_matmul(x, qweight, scales, mins, y, M, N, K, bits, g, isa, threads) */
static PyObject *py_lut_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[12];
    if (infer_parse_ints(args, nargs, 12, v, "lut_matmul")) return NULL;
    if (bad_sizes("lut_matmul", v[5], v[7], v[8], v[9])) return NULL;
    if (v[6] < 0 || ((v[5] && v[6]) && (!v[0] || !v[1] || !v[2] || !v[3] || !v[4]))) {
        PyErr_SetString(PyExc_ValueError, "lut_matmul: bad N or null data pointer");
        return NULL;
    }
    if (bad_isa(v[10])) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = lut_matmul((const float *)(intptr_t)v[0], (const uint8_t *)(intptr_t)v[1],
                    (const uint16_t *)(intptr_t)v[2], (const uint16_t *)(intptr_t)v[3],
                    (float *)(intptr_t)v[4], v[5], v[6], v[7], (int)v[8], (int)v[9], (int)v[10],
                    v[11] < 1 ? 1 : v[11] > 255 ? 255 : (int)v[11]);
    Py_END_ALLOW_THREADS;
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* lut_tables(x, tables, c1, c2, asum, M, K, bits, g, isa): the int8 tables
   (M, lut_tables_bytes(K)) and per-group constants (M, K/g) the matmul builds, for tests. */
static PyObject *py_lut_tables(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[10];
    if (infer_parse_ints(args, nargs, 10, v, "lut_tables")) return NULL;
    if (bad_isa(v[9])) return NULL;
    if (bad_sizes("lut_tables", v[5], v[6], v[7], v[8])) return NULL;
    if (v[5] && (!v[0] || !v[1] || !v[2] || !v[3] || !v[4])) {
        PyErr_SetString(PyExc_ValueError, "lut_tables: null data pointer");
        return NULL;
    }
    const int64_t M = v[5], K = v[6], ng = K / v[8], stride = (int64_t)tables_bytes(K);
    const int isa = lut_isa((int)v[9]);
    for (int64_t m = 0; m < M; m++)
        lut_tables_row((const float *)(intptr_t)v[0] + m * K, K, (int)v[8], (int)v[7], isa,
                   (int8_t *)(intptr_t)v[1] + m * stride, (float *)(intptr_t)v[2] + m * ng,
                   (float *)(intptr_t)v[3] + m * ng, (float *)(intptr_t)v[4] + m * ng);
    Py_RETURN_NONE;
}

static PyObject *py_lut_tables_bytes(PyObject *self, PyObject *arg) {
    (void)self;
    long long K = PyLong_AsLongLong(arg);
    if (K == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(K > 0 ? (long long)tables_bytes(K) : 0);
}

static PyObject *py_lut_isa(PyObject *self, PyObject *arg) {
    (void)self;
    long isa = PyLong_AsLong(arg);
    if (isa == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(lut_isa((int)isa));
}

PyMethodDef infer_lut_methods[] = {
    {"lut_matmul", (PyCFunction)(void (*)(void))py_lut_matmul, METH_FASTCALL,
     "lut_matmul(x, qweight, scales, mins, y, M, N, K, bits, group_size, isa, threads): "
     "y = x W^T, W in lut1..lut4 bit planes (int8 activation tables)"},
    {"lut_tables", (PyCFunction)(void (*)(void))py_lut_tables, METH_FASTCALL,
     "lut_tables(x, tables, c1, c2, asum, M, K, bits, group_size, isa): the matmul's tables"},
    {"lut_tables_bytes", py_lut_tables_bytes, METH_O, "bytes of one activation row's tables"},
    {"lut_isa", py_lut_isa, METH_O, "the path lut_matmul runs for a requested one"},
    {NULL, NULL, 0, NULL},
};
#endif /* INFER_NO_PYTHON */
