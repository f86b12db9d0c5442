/* A small thread pool for the kernels (see kernels.h for the contract).
 *
 * One job at a time. The job's tasks are claimed by compare-and-swap on one 64-bit word,
 *
 *     word = seq (32 bits) | nthreads (8 bits) | next task (24 bits)
 *
 * so a worker that wakes late can only claim a task of the job it read the fields of
 * (a newer job has a newer seq and the swap fails), and the caller waits only for tasks
 * to finish, never for a worker to wake. Workers spin for SPIN_NS after their last task,
 * then sleep on their own condition variable; the caller signals only sleepers it needs.
 */
#define _GNU_SOURCE /* sched_yield, clock_gettime, pthread_atfork */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

enum { MAX_THREADS = 255, MAX_TASKS = 1 << 24 };

/* How long a worker spins for the next job before sleeping. Decode's matmuls come tens
 * of microseconds apart, so workers stay awake through a token. While spinning a worker
 * yields its core every few microseconds: on an idle core that returns at once, and on
 * a busy machine (torch's threads, other processes) the others run instead, and the
 * caller, which claims tasks too, does the work of a worker that is not running. */
#define SPIN_NS 100000
/* How long the caller spins for the last tasks before yielding its core. */
#define WAIT_SPIN_NS 50000

#define SEQ(w) ((uint32_t)((w) >> 32))
#define NTHR(w) ((int)(((w) >> 24) & 0xff))
#define NEXT(w) ((int64_t)((w) & 0xffffff))

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic int sleeping;
    uint32_t start_seq; /* the last job published before the worker started */
} worker_t;

typedef struct {
    pool_fn fn;
    void *ctx;
    int64_t n_tasks;
} job_t;

static struct {
    _Atomic uint64_t word;
    _Atomic int64_t done; /* tasks finished in the current job */
    /* Job seq's fields are jobs[seq & 1], written before `word` publishes seq. A worker
     * reads them, then re-reads `word`: while it still shows seq, job seq + 1 is not
     * published, so job seq + 2 (the next writer of this slot) has not begun. */
    job_t jobs[2];
    pthread_mutex_t run_mu; /* held by the caller for the whole job */
    int n_workers;          /* started; guarded by run_mu */
    worker_t workers[MAX_THREADS + 1];
} P = {.run_mu = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim and run tasks of job `seq` until none is left. */
static void run_tasks(uint32_t seq, int tid) {
    const job_t job = P.jobs[seq & 1];
    uint64_t w = atomic_load_explicit(&P.word, memory_order_acquire);
    for (;;) {
        if (SEQ(w) != seq || NEXT(w) >= job.n_tasks) return;
        if (!atomic_compare_exchange_weak_explicit(&P.word, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* w now holds the current word */
        job.fn(job.ctx, NEXT(w), tid);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
        w = atomic_load_explicit(&P.word, memory_order_acquire);
    }
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    worker_t *me = &P.workers[id];
    uint32_t seen = me->start_seq;
    for (;;) {
        /* Spin for a job that includes this worker, then sleep. */
        int64_t t0 = now_ns();
        uint64_t w;
        for (unsigned i = 1;; i++) {
            w = atomic_load_explicit(&P.word, memory_order_acquire);
            if (SEQ(w) != seen) {
                seen = SEQ(w);
                if (id < NTHR(w)) break;
            }
            cpu_relax();
            if (!(i & 63)) sched_yield(); /* a thread waiting for this core (torch's) runs */
            if (!(i & 255) && now_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&me->mu);
                atomic_store(&me->sleeping, 1); /* then re-check: pairs with pool_run */
                for (;;) {
                    w = atomic_load(&P.word);
                    if (SEQ(w) != seen) {
                        seen = SEQ(w);
                        if (id < NTHR(w)) break;
                    }
                    pthread_cond_wait(&me->cv, &me->mu);
                }
                atomic_store(&me->sleeping, 0);
                pthread_mutex_unlock(&me->mu);
                break;
            }
        }
        run_tasks(seen, id);
    }
    return NULL;
}

/* Start workers 1..n (run_mu held, so no job is live and they start idle). */
static int ensure_workers(int n) {
    while (P.n_workers < n) {
        int id = P.n_workers + 1;
        worker_t *w = &P.workers[id];
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        atomic_store(&w->sleeping, 0);
        w->start_seq = SEQ(atomic_load(&P.word));
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t th;
        int err = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (err) break;
        P.n_workers = id;
    }
    return P.n_workers;
}

/* The child of a fork has none of the parent's workers. */
static void after_fork_child(void) {
    pthread_mutex_init(&P.run_mu, NULL);
    P.n_workers = 0;
}

static pthread_once_t once = PTHREAD_ONCE_INIT;
static void init_once(void) { pthread_atfork(NULL, NULL, after_fork_child); }

void pool_run(int nthreads, int64_t n_tasks, pool_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (nthreads > n_tasks) nthreads = (int)n_tasks;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads <= 1 || n_tasks >= MAX_TASKS || pthread_mutex_trylock(&P.run_mu) != 0) {
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    pthread_once(&once, init_once);
    int have = ensure_workers(nthreads - 1);
    if (have + 1 < nthreads) nthreads = have + 1;

    uint32_t seq = SEQ(atomic_load(&P.word)) + 1;
    P.jobs[seq & 1] = (job_t){fn, ctx, n_tasks};
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    /* seq_cst store, then read each worker's flag: pairs with the worker's store of
     * `sleeping` then re-read of `word`, so a worker going to sleep sees the job or is
     * signalled. */
    atomic_store(&P.word, (uint64_t)seq << 32 | (uint64_t)nthreads << 24);
    for (int i = 1; i < nthreads; i++) {
        worker_t *w = &P.workers[i];
        if (atomic_load(&w->sleeping)) {
            pthread_mutex_lock(&w->mu);
            pthread_cond_signal(&w->cv);
            pthread_mutex_unlock(&w->mu);
        }
    }
    run_tasks(seq, 0);
    int64_t t0 = 0;
    for (unsigned i = 1; atomic_load_explicit(&P.done, memory_order_acquire) < n_tasks; i++) {
        cpu_relax();
        if (!(i & 255)) {
            int64_t t = now_ns();
            if (!t0) t0 = t;
            else if (t - t0 > WAIT_SPIN_NS) sched_yield();
        }
    }
    pthread_mutex_unlock(&P.run_mu);
}
