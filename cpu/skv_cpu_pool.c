/*
 * The cpu backend's team (layer 0, skv_cpu_base.h): helper threads of the
 * calling thread that take work items beside it (skv_cpu_run). Every
 * parallel loop of the backend, prefill and decode, runs here. Each thread
 * that runs such work gets its own helpers, created when first needed and
 * ended when it exits.
 *
 * Why not an OpenMP parallel region: a region ends only when every thread of
 * its team has arrived at its closing barrier, and on a machine whose cores
 * are busy with other work a team thread is often not running (the scheduler
 * gives its core to another process for a slice of milliseconds), so each of
 * the dozens of regions of a decode step or a factorization waited for a
 * slice, and OpenMP's default waiting (spinning) spent the waiter's own share
 * of the CPU doing it (a factorization's regions also ran beside OpenBLAS's
 * threads, which wait for work by polling too: skv_cpu_blas_begin). Here a job ends when its last item is done: the caller takes items
 * itself from the start and never waits for a helper that has not started,
 * only for items in progress. Helpers spin briefly after a job, then sleep:
 * no thread burns a core while there is no work.
 *
 * Like OpenMP's thread pool, the team is the process's, not a call's: its
 * memory is mapped (not malloc'ed: the library's heap calls are the calls'),
 * and when it cannot be mapped or a helper cannot start, the work runs on
 * the calling thread alone, with the same results.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include "skv_cpu_base.h"

#define SKV_CPU_POOL_MAX 256 /* helpers of one thread */
#define SKV_CPU_SPIN 4000    /* polls of a helper between jobs (about 0.1-0.3 ms) before it sleeps */

typedef struct skv_cpu_pool skv_cpu_pool;

typedef struct {
    skv_cpu_pool *pool;
    int id; /* 1 .. n_helpers */
} skv_cpu_helper_arg;

struct skv_cpu_pool {
    pid_t pid; /* the process whose threads these are (a fork's child has none of them) */
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int stop, n_helpers;
    pthread_t th[SKV_CPU_POOL_MAX];
    skv_cpu_helper_arg arg[SKV_CPU_POOL_MAX];
    /* the job: written under mu while no helper is inside one (active == 0) */
    uint64_t gen;  /* jobs published so far (atomic reads outside mu) */
    int open;      /* 1 while helpers may join the job (atomic reads outside mu) */
    int nt;        /* threads of the job: helper i joins it iff i < nt */
    skv_cpu_item_fn fn;
    void *ctx;
    int64_t n;
    int64_t next;  /* atomic: the next item to hand out */
    int64_t done;  /* atomic: items finished */
    int active;    /* atomic: helpers inside the job */
};

static inline void skv_cpu_relax(void)
{
#if SKV_CPU_X86
    __builtin_ia32_pause();
#endif
}

/* Items until none is left; each finished one counted (release: its writes are the caller's). */
static void skv_cpu_take(skv_cpu_pool *p, skv_cpu_item_fn fn, void *ctx, int64_t n, int id)
{
    int64_t i;
    while ((i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED)) < n) {
        fn(ctx, i, id);
        __atomic_add_fetch(&p->done, 1, __ATOMIC_RELEASE);
    }
}

static int skv_cpu_job_ready(skv_cpu_pool *p, uint64_t seen)
{
    return __atomic_load_n(&p->open, __ATOMIC_ACQUIRE) && __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE) != seen;
}

static void *skv_cpu_helper(void *varg)
{
    skv_cpu_helper_arg *a = varg;
    skv_cpu_pool *p = a->pool;
    uint64_t seen = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
    for (;;) {
        for (int i = 0; i < SKV_CPU_SPIN && !skv_cpu_job_ready(p, seen) && !__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE); i++)
            skv_cpu_relax();
        pthread_mutex_lock(&p->mu);
        while (!p->stop && !(p->open && p->gen != seen)) pthread_cond_wait(&p->wake, &p->mu);
        if (p->stop) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        seen = p->gen;
        if (a->id >= p->nt) {
            pthread_mutex_unlock(&p->mu);
            continue;
        }
        skv_cpu_item_fn fn = p->fn;
        void *ctx = p->ctx;
        int64_t n = p->n;
        __atomic_add_fetch(&p->active, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&p->mu);
        skv_cpu_take(p, fn, ctx, n, a->id);
        __atomic_sub_fetch(&p->active, 1, __ATOMIC_RELEASE);
    }
}

static void skv_cpu_pool_free(void *v)
{
    skv_cpu_pool *p = v;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_helpers; i++) pthread_join(p->th[i], NULL);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    munmap(p, sizeof *p);
}

static pthread_key_t skv_cpu_pool_key;
static int skv_cpu_pool_key_ok;
static pthread_once_t skv_cpu_pool_once = PTHREAD_ONCE_INIT;

static void skv_cpu_pool_key_init(void) { skv_cpu_pool_key_ok = pthread_key_create(&skv_cpu_pool_key, skv_cpu_pool_free) == 0; }

/* This thread's pool with up to want helpers (fewer if threads cannot be created); NULL if none. */
static skv_cpu_pool *skv_cpu_pool_get(int want)
{
    pthread_once(&skv_cpu_pool_once, skv_cpu_pool_key_init);
    if (!skv_cpu_pool_key_ok) return NULL;
    skv_cpu_pool *p = pthread_getspecific(skv_cpu_pool_key);
    if (p && p->pid != getpid()) p = NULL; /* in a fork's child: left alone (its lock may be held), a new one */
    if (!p) {
        p = mmap(NULL, sizeof *p, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); /* zeroed */
        if (p == MAP_FAILED) return NULL;
        p->pid = getpid();
        if (pthread_mutex_init(&p->mu, NULL)) {
            munmap(p, sizeof *p);
            return NULL;
        }
        if (pthread_cond_init(&p->wake, NULL) || pthread_setspecific(skv_cpu_pool_key, p)) {
            pthread_mutex_destroy(&p->mu);
            munmap(p, sizeof *p);
            return NULL;
        }
    }
    if (want > SKV_CPU_POOL_MAX) want = SKV_CPU_POOL_MAX;
    if (p->n_helpers < want) {
        /* helpers take no signals: those stay with the application's threads */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        while (p->n_helpers < want) {
            skv_cpu_helper_arg *a = &p->arg[p->n_helpers];
            a->pool = p, a->id = p->n_helpers + 1;
            if (pthread_create(&p->th[p->n_helpers], NULL, skv_cpu_helper, a)) break;
            p->n_helpers++;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    return p;
}

void skv_cpu_run(int nt, int64_t n, skv_cpu_item_fn fn, void *ctx)
{
    skv_cpu_pool *p = nt > 1 && n > 1 ? skv_cpu_pool_get(nt - 1) : NULL;
    if (!p || !p->n_helpers) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->nt = nt < p->n_helpers + 1 ? nt : p->n_helpers + 1;
    p->fn = fn, p->ctx = ctx, p->n = n;
    __atomic_store_n(&p->next, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&p->gen, p->gen + 1, __ATOMIC_RELEASE);
    __atomic_store_n(&p->open, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    skv_cpu_take(p, fn, ctx, n, 0);
    /* every item is handed out: close the job to helpers not yet in it, then wait for the ones in it */
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->open, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&p->mu);
    for (int spin = 0;
         __atomic_load_n(&p->done, __ATOMIC_ACQUIRE) < n || __atomic_load_n(&p->active, __ATOMIC_ACQUIRE) > 0; spin++) {
        if (spin < 2000) skv_cpu_relax();
        else sched_yield(); /* a helper was descheduled inside an item: let it run */
    }
}
