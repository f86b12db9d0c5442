/* Drivers for the quantized matmuls: pick GEMV or GEMM, prepare what every row shares,
 * split output rows into tasks, run them on the pool. Each output element is computed
 * by one task in an order that depends only on the shapes, so any thread count gives
 * the same bits. */
#include <stdlib.h>

#include "kernels.h"

/* GEMM: rows dequantized per tile, and the K slice the float tile works on at a time,
 * so that a slice of the tile (TILE_N x TILE_K x 4 bytes = 32 KB) stays in L1 while
 * every row of x passes over it. */
enum { TILE_N = 16, TILE_K = 512 };
/* GEMV: tasks of about this many weight bytes, and at least GEMV_TASKS_PER_THREAD per
 * thread (kernels.h). Each task is one sequential stream, long enough for the threads to
 * read at the full bandwidth (streams broken every 64 KiB fall well short of it). */
enum { GEMV_TASK_BYTES = 1024 * 1024 };
/* q_gemv_many's tasks for several rows (q_matmul: SMALL_M, WIDE_M in kernels.h): weights
 * of about SMALL_TASK_BYTES, which stay in L2 while the rows pass. */
enum { SMALL_TASK_BYTES = 128 * 1024 };

/* The kernels of super-block kind `bits` on the path, or NULL for the other formats. */
static const sb_kernels *sb_for(int bits, const kernel_table *kt) {
    return bits == Q4K     ? q4k_for(kt)
           : bits == Q5K   ? q5k_for(kt)
           : bits == Q3K   ? q3k_for(kt)
           : bits == Q2K   ? q2k_for(kt)
           : bits == IQ4XS ? iq4xs_for(kt)
                           : NULL;
}

typedef struct {
    const qmat *a;
    gemv_fn gemv;
    dequant_fn dequant;
    tile_fn tile;
    int64_t rows;   /* per task */
    float *scratch; /* GEMM: TILE_N x K floats per thread */
} job_t;

static void gemv_task(void *ctx, int64_t t, int tid) {
    (void)tid;
    const job_t *j = ctx;
    int64_t n0 = t * j->rows, n1 = n0 + j->rows < j->a->N ? n0 + j->rows : j->a->N;
    j->gemv(j->a, n0, n1);
}

static void gemm_task(void *ctx, int64_t t, int tid) {
    const job_t *j = ctx;
    const qmat *a = j->a;
    const int64_t K = a->K, n0 = t * TILE_N, nb = a->N - n0 < TILE_N ? a->N - n0 : TILE_N;
    float *w = j->scratch + (int64_t)tid * TILE_N * K; /* (nb, K) */
    j->dequant(a, n0, n0 + nb, w);
    for (int64_t k0 = 0; k0 < K; k0 += TILE_K) {
        int64_t kc = K - k0 < TILE_K ? K - k0 : TILE_K;
        j->tile(a->x + k0, K, w + k0, K, a->y + n0, a->N, a->M, nb, kc, k0 > 0);
    }
}

/* Prepare one GEMV as a job: what its rows share (x's group sums and int8 digits) and its
 * split into tasks for `nthreads`. `tmp` receives what must be freed after the job.
 * `xq_ready`: x's digits in this format's layout from an earlier job of the same x
 * (q, k and v share one x), or NULL. */
static int gemv_prepare(int bits, qmat *a, const kernel_table *kt, int nthreads, job_t *j,
                        void *tmp[2], const void *xq_ready) {
    const sb_kernels *sb = sb_for(bits, kt);
    const gemv_fn plain = sb          ? sb->gemv_c
                          : bits == 8 ? kt->q8_gemv
                          : bits == 6 ? q6_gemv_c
                          : bits == 5 ? q5_gemv_c
                                      : kt->q4_gemv;
    *j = (job_t){a, plain, NULL, NULL, 0, NULL};
    tmp[0] = tmp[1] = NULL;
    if (sb && sb->xprep) { /* x in q4k_q5k.c's integer layout (neondot: int4's); inf or
                            * NaN: float */
        if (!xq_ready) {
            if (!(tmp[1] = alloc64(ANY_XPREP_BYTES(a->K)))) return -1;
            if (sb->xprep(a->x, a->K, tmp[1]) == 0) xq_ready = tmp[1];
        }
        if (xq_ready) {
            a->xq = xq_ready;
            j->gemv = sb->gemv_digits;
        }
    }
    if (bits == 6 && kt->q6_xprep) { /* x as the int8 GEMV's digits (or the path's own
                                      * layout, q6_xsum); inf or NaN: float */
        const int64_t K = a->K;
        /* per 16: -32 sx sum X, from the digits the kernel multiplies (not where the
         * kernel keeps the offset in its integers) */
        const int sums = kt->q6_xsum || !kt->q6_xblock;
        if (sums && !(tmp[0] = malloc((size_t)(K / 16) * sizeof(float)))) return -1;
        if (!xq_ready) {
            if (!(tmp[1] = alloc64(ANY_XPREP_BYTES(K)))) return -1;
            if (kt->q6_xprep(a->x, K, tmp[1]) == 0) xq_ready = tmp[1];
        }
        if (xq_ready) {
            float *xsum = tmp[0];
            if (kt->q6_xsum) {
                kt->q6_xsum(xq_ready, K, xsum);
            } else if (sums) {
                const int8_t *xd = xq_ready;
                const float *lanes = (const float *)(xd + (K + 63) / 64 * XPREP8_CHUNK_BYTES);
                for (int64_t s = 0; s < K / 16; s++) {
                    const int8_t *d = xd + (s / 4) * XPREP8_CHUNK_BYTES + 16 * (s % 4);
                    int32_t t = 0;
                    for (int i = 0; i < 16; i++) t += d[i] * 65536 + d[64 + i] * 256 + d[128 + i];
                    xsum[s] = -32.0f * lanes[16 * (s / 4) + 4 * (s % 4)] * (float)t;
                }
            }
            a->xq = xq_ready;
            a->xsum = xsum;
            j->gemv = kt->q6_gemv_digits;
        }
    }
    if (bits == 4 || bits == 5) { /* group sums of x, shared by every row: the mins' (or
                                   * -8 d's, int5's -16 d's) term */
        const int64_t G = a->K / a->g;
        float *xsum = malloc((size_t)G * sizeof *xsum);
        if (!(tmp[0] = xsum)) return -1;
        const xprep_fn prep = bits == 4 ? kt->q4_xprep : kt->q5_xprep;
        int on_digits = 0;
        if (prep) { /* x as int8 digits; x with inf or NaN keeps the float GEMV */
            if (!xq_ready) {
                if (!(tmp[1] = alloc64(XPREP_BYTES(a->K)))) return -1;
                if (prep(a->x, a->K, tmp[1]) == 0) xq_ready = tmp[1];
            }
            if (xq_ready) {
                a->xq = xq_ready;
                j->gemv = bits == 4 ? kt->q4_gemv_digits : kt->q5_gemv_digits;
                on_digits = 1;
            }
        }
        const float f = a->mins ? 1.0f : bits == 4 ? -8.0f : -16.0f;
        if (on_digits) {
            /* the group sums of the digits the codes multiply */
            const float *xs = xprep4_xs((void *)a->xq, a->K);
            for (int64_t gi = 0, per = a->g / 32; gi < G; gi++) {
                float t = 0;
                for (int64_t b = gi * per; b < (gi + 1) * per; b++) t += xs[b];
                xsum[gi] = f * t;
            }
        } else {
            for (int64_t gi = 0; gi < G; gi++) { /* 8 partial sums: no add-latency chain */
                const float *xg = a->x + gi * a->g;
                float p[8] = {0};
                for (int64_t k = 0; k < a->g; k += 8)
                    for (int i = 0; i < 8; i++) p[i] += xg[k + i];
                xsum[gi] = f * (((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7])));
            }
        }
        a->xsum = xsum;
    }
    if (bits == 8 && kt->q8_xprep) { /* x as int8 digits; x with inf or NaN: float GEMV */
        const int64_t K = a->K, B = (K + 31) / 32;
        const int64_t G = a->g ? K / a->g : 1, per = a->g ? a->g / 32 : B; /* blocks a group */
        if (!(tmp[0] = malloc((size_t)G * sizeof(float)))) return -1;
        if (!xq_ready) {
            if (!(tmp[1] = alloc64(XPREP8_BYTES(K)))) return -1;
            if (kt->q8_xprep(a->x, K, tmp[1]) == 0) xq_ready = tmp[1];
        }
        if (xq_ready) {
            const float *xs = xprep8_xs((void *)xq_ready, K);
            float *xsum = tmp[0];
            for (int64_t gi = 0; gi < G; gi++) { /* -128 sx sum X over the group's blocks */
                float t = 0;
                for (int64_t b = gi * per; b < (gi + 1) * per; b++) t += xs[b];
                xsum[gi] = t;
            }
            a->xq = xq_ready;
            a->xsum = xsum;
            j->gemv = kt->q8_gemv_digits;
        }
    }
    const int64_t row_bytes = q_row_bytes(bits, a->K);
    int64_t rows = (GEMV_TASK_BYTES + row_bytes - 1) / row_bytes;
    const int64_t per = (int64_t)GEMV_TASKS_PER_THREAD * nthreads;
    const int64_t fair = (a->N + per - 1) / per;
    j->rows = rows < fair ? rows : fair;
    return 0;
}

static int gemv(int bits, qmat *a, const kernel_table *kt, int nthreads) {
    const int64_t row_bytes = q_row_bytes(bits, a->K);
    nthreads = gemv_threads(a->N * row_bytes, nthreads);
    job_t j;
    void *tmp[2];
    int rc = gemv_prepare(bits, a, kt, nthreads, &j, tmp, NULL);
    if (!rc) pool_run(nthreads, (a->N + j.rows - 1) / j.rows, gemv_task, &j);
    free(tmp[0]);
    free(tmp[1]);
    return rc;
}

/* The function that lays out x's digits for a GEMV of `bits` (NULL: none): GEMVs whose
   x is the same array and whose functions are the same share the digits. */
static xprep_fn xprep_of(const kernel_table *kt, int bits) {
    const sb_kernels *sb = sb_for(bits, kt);
    return sb          ? sb->xprep
           : bits == 8 ? kt->q8_xprep
           : bits == 6 ? kt->q6_xprep
           : bits == 5 ? kt->q5_xprep
                       : kt->q4_xprep;
}

/* Several GEMVs of several rows each as one pool job (q_gemv_many): matrix i's tasks are
   numbered after matrix i - 1's, and a task runs every row of x over its weight rows, so
   the weights come from memory once and from cache for the other rows. */
typedef struct {
    int n;
    int64_t M[Q_GEMV_MANY_MAX];                /* rows of x of each matrix */
    job_t (*jobs)[GEMV_ROWS_MAX];              /* [matrix][row of x]: one GEMV each */
    gemv_rows_fn rows[Q_GEMV_MANY_MAX];        /* NULL: matrix i's rows one by one */
    const qmat *(*a)[GEMV_ROWS_MAX];           /* [matrix][row of x] */
    int64_t first[Q_GEMV_MANY_MAX + 1];        /* first task of each matrix; first[n] = all */
} many_job;

static void many_task(void *ctx, int64_t t, int tid) {
    const many_job *m = ctx;
    int i = 0;
    while (t >= m->first[i + 1]) i++;
    if (m->rows[i]) {
        const job_t *j = &m->jobs[i][0];
        const int64_t n0 = (t - m->first[i]) * j->rows, N = j->a->N;
        m->rows[i](m->a[i], (int)m->M[i], n0, n0 + j->rows < N ? n0 + j->rows : N);
        return;
    }
    for (int64_t r = 0; r < m->M[i]; r++) gemv_task((void *)&m->jobs[i][r], t - m->first[i], tid);
}

/* The path's GEMV over several rows for a matrix whose rows all took `gemv`, or NULL. */
static gemv_rows_fn rows_of(const kernel_table *kt, int bits, gemv_fn gemv) {
    const sb_kernels *sb = sb_for(bits, kt);
    if (sb) return gemv == sb->gemv_digits ? sb->gemv_rows : NULL;
    if (bits == 8 && gemv == kt->q8_gemv) return kt->q8_gemv_rows;
    if (bits == 6) return gemv == kt->q6_gemv_digits ? kt->q6_gemv_rows : NULL;
    if (bits == 5) return gemv == kt->q5_gemv_digits ? kt->q5_gemv_rows : NULL;
    if (bits == 4) return gemv == kt->q4_gemv_digits ? kt->q4_gemv_rows : NULL;
    return NULL;
}

int q_gemv_many(int n, const int *bits, const qmat *const *a_in, int isa, int nthreads) {
    const kernel_table *kt = kernels_for(isa);
    if (!kt || n < 1 || n > Q_GEMV_MANY_MAX) return n == 0 ? 0 : -1;
    int64_t bytes = 0;
    for (int i = 0; i < n; i++) {
        if (a_in[i]->M < 1 || a_in[i]->M > GEMV_ROWS_MAX) return -1;
        bytes += a_in[i]->N * q_row_bytes(bits[i], a_in[i]->K);
    }
    nthreads = gemv_threads(bytes, nthreads < 1 ? 1 : nthreads);
    /* per matrix and row: its qmat, its job and what gemv_prepare allocated */
    const int64_t M = GEMV_ROWS_MAX;
    qmat *a = malloc(sizeof(qmat) * (size_t)(n * M));
    job_t(*jobs)[GEMV_ROWS_MAX] = malloc(sizeof *jobs * (size_t)n);
    const qmat *(*ptrs)[GEMV_ROWS_MAX] = malloc(sizeof *ptrs * (size_t)n);
    void **tmp = calloc((size_t)(2 * n * M), sizeof(void *));
    many_job m = {.n = n, .jobs = jobs, .a = ptrs};
    int rc = a && jobs && ptrs && tmp ? 0 : -1;
    for (int i = 0; i < n && !rc; i++) {
        const int64_t row_bytes = q_row_bytes(bits[i], a_in[i]->K), Mi = m.M[i] = a_in[i]->M;
        for (int64_t r = 0; r < Mi && !rc; r++) {
            qmat *ar = &a[i * M + r];
            *ar = *a_in[i];
            ar->x = a_in[i]->x + r * ar->K, ar->y = a_in[i]->y + r * ar->N, ar->M = 1;
            ar->xq = NULL; /* set by gemv_prepare */
            const void *xq = NULL; /* row r of an earlier matrix of the same x and layout */
            for (int k = 0; k < i && !xq; k++)
                if (a_in[k]->x == a_in[i]->x && a_in[k]->K == ar->K && a_in[k]->M == Mi &&
                    xprep_of(kt, bits[k]) == xprep_of(kt, bits[i]))
                    xq = a[k * M + r].xq;
            rc = gemv_prepare(bits[i], ar, kt, nthreads, &jobs[i][r], &tmp[2 * (i * M + r)], xq);
            ptrs[i][r] = ar;
        }
        if (rc) break;
        m.rows[i] = Mi > 1 ? rows_of(kt, bits[i], jobs[i][0].gemv) : NULL;
        for (int64_t r = 1; r < Mi; r++) /* a row with inf or NaN took the float GEMV */
            if (jobs[i][r].gemv != jobs[i][0].gemv) m.rows[i] = NULL;
        if (Mi > 1) { /* tasks small enough that their weights stay in L2 while rows pass */
            int64_t rows = (SMALL_TASK_BYTES + row_bytes - 1) / row_bytes;
            rows = rows < jobs[i][0].rows ? rows : jobs[i][0].rows;
            for (int64_t r = 0; r < Mi; r++) jobs[i][r].rows = rows;
        }
        m.first[i + 1] = m.first[i] + (a_in[i]->N + jobs[i][0].rows - 1) / jobs[i][0].rows;
    }
    if (!rc) pool_run(nthreads, m.first[n], many_task, &m);
    if (tmp)
        for (int64_t k = 0; k < 2 * n * M; k++) free(tmp[k]);
    free(tmp);
    free(ptrs);
    free(jobs);
    free(a);
    return rc;
}

static int gemm(int bits, const qmat *a, const kernel_table *kt, int nthreads) {
    const int64_t n_tasks = (a->N + TILE_N - 1) / TILE_N;
    if (nthreads > n_tasks) nthreads = (int)n_tasks;
    const dequant_fn q6 = kt->q6_dequant ? kt->q6_dequant : q6_dequant_c;
    const dequant_fn q5 = kt->q5_dequant ? kt->q5_dequant : q5_dequant_c;
    const sb_kernels *sb = sb_for(bits, kt);
    const dequant_fn dq = sb          ? sb->dequant
                          : bits == 8 ? kt->q8_dequant
                          : bits == 6 ? q6
                          : bits == 5 ? q5
                                      : kt->q4_dequant;
    job_t j = {a, NULL, dq, kt->tile, TILE_N, NULL};
    if (!(j.scratch = alloc64((size_t)nthreads * TILE_N * a->K * sizeof(float)))) return -1;
    pool_run(nthreads, n_tasks, gemm_task, &j);
    free(j.scratch);
    return 0;
}

int q_matmul(int bits, const qmat *a_in, int isa, int nthreads) {
    qmat a = *a_in;
    const kernel_table *kt = kernels_for(isa);
    if (!kt || a.M <= 0 || a.N <= 0) return 0;
    if (nthreads < 1) nthreads = 1;
    if (a.M == 1) return gemv(bits, &a, kt, nthreads);
    const int rows = a.M <= SMALL_M || (a.M <= WIDE_M && a.K >= WIDE_K);
    if (rows) { /* a few rows (a short prompt, a prompt's tokens routed to one expert) */
        const qmat *pa = &a;
        return q_gemv_many(1, &bits, &pa, isa, nthreads);
    }
    const int igemm = a.M >= IGEMM_MIN_M && (kt->ig_kinds & IG_KIND(bits));
    const int rc = igemm ? q_igemm(bits, &a, kt, nthreads) : 1;
    return rc <= 0 ? rc : gemm(bits, &a, kt, nthreads);
}
