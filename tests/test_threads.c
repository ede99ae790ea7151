/*
 * Thread safety as docs/usage.md states it: separate caches may be used from
 * separate threads at once, skv_op_* and the config/memory queries are
 * reentrant (every worker also runs op-level selections and memory queries on
 * shared read-only inputs), and skv_last_error() is per thread.
 *
 * Each worker owns one cache (ref or cpu), prefills and decodes a seeded
 * workload of its own; its outputs and selections must be bitwise those of
 * the same work run alone on the main thread. Meanwhile the workers provoke
 * their own distinct errors and check that their thread-local message is not
 * clobbered by the others'.
 *
 * config.n_threads changes nothing of the caller: after a prefill and decodes
 * with n_threads = 1 and 3, the calling thread's omp_get_max_threads(),
 * omp_get_dynamic() and OpenBLAS's thread count are what they were, and the
 * results are bitwise those of n_threads = 0.
 */
#include <cblas.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define N_WORKERS 4
#define STEPS 3

typedef struct {
    skv_backend be;
    uint64_t seed;
    int id;
    int n_threads;       /* config.n_threads */
    float *out;          /* [STEPS * L * B * Hq * D] */
    int32_t *sel;        /* [STEPS * L * B * Hk * S] */
    int error_msg_ok;
    skv_status status;
    int32_t *op_sel;     /* [OP_HK * OP_S] from skv_op_score_select on the shared inputs */
    float *op_amax;      /* [OP_HK * OP_N] */
    size_t mem_dev, mem_host;
} job;

/* shared, read-only inputs of the op-level calls every worker makes at once */
enum { OP_HQ = 8, OP_HK = 2, OP_D = 64, OP_N = 3000, OP_S = 100 };
static skv_bf16 *g_op_q, *g_op_lm;

static skv_config small_config(skv_backend be)
{
    skv_config c = skv_config_default();
    c.n_layers = 2;
    c.n_q_heads = 8;
    c.n_kv_heads = 2;
    c.head_dim = 64;
    c.rank = 24;
    c.budget = 64;
    c.n_outlier_chunks = 4;
    c.n_local_chunks = 2;
    c.batch_size = 2;
    c.max_prompt_len = 1024;
    c.gen_capacity = STEPS;
    c.backend = be;
    return c;
}

static size_t out_len(const skv_config *c) { return (size_t)STEPS * c->n_layers * c->batch_size * c->n_q_heads * c->head_dim; }
static size_t sel_len(const skv_config *c)
{
    return (size_t)STEPS * c->n_layers * c->batch_size * c->n_kv_heads * (c->budget / c->chunk_size);
}

static void *run(void *arg)
{
    job *j = arg;
    skv_config c = small_config(j->be);
    c.n_threads = j->n_threads;
    skv_cache *cache = NULL;
    j->status = skv_cache_create(&c, &cache);
    if (j->status) return NULL;
    skvt_rng r;
    skvt_rng_seed(&r, j->seed);
    size_t row = (size_t)c.n_kv_heads * c.head_dim, S = (size_t)(c.budget / c.chunk_size);
    skv_bf16 *k = malloc((size_t)c.max_prompt_len * row * 2), *v = malloc((size_t)c.max_prompt_len * row * 2);
    j->error_msg_ok = 1;
    for (int l = 0; l < c.n_layers && !j->status; l++)
        for (int b = 0; b < c.batch_size && !j->status; b++) {
            int64_t n = skvt_rng_range(&r, 700, c.max_prompt_len);
            skvt_fill_bf16_normal(&r, k, (size_t)n * row, 1.0);
            skvt_fill_bf16_normal(&r, v, (size_t)n * row, 1.0);
            j->status = skv_prefill(cache, l, b, n, k, v, NULL);
            /* a distinct error of this thread; its message must stay ours */
            char want[64];
            snprintf(want, sizeof want, "layer = %d,", 1000 + j->id);
            skv_prefill(cache, 1000 + j->id, 0, n, k, v, NULL);
            if (!strstr(skv_last_error(), want) || !strstr(skv_cache_last_error(cache), want)) j->error_msg_ok = 0;
        }
    /* an error storm: thousands of failing calls, each message checked at once */
    for (int it = 0; it < 20000; it++) {
        char name[32], want[40];
        skv_backend ignored;
        snprintf(name, sizeof name, "bogus-%d-%d", j->id, it);
        snprintf(want, sizeof want, "\"%s\"", name);
        if (skv_backend_parse(name, &ignored) != SKV_ERR_INVALID_ARGUMENT || !strstr(skv_last_error(), want)) {
            j->error_msg_ok = 0;
            break;
        }
    }
    size_t qn = (size_t)c.batch_size * c.n_q_heads * c.head_dim, kn = (size_t)c.batch_size * row;
    skv_bf16 *q = malloc(qn * 2), *kk = malloc(kn * 2), *vv = malloc(kn * 2);
    for (int s = 0; s < STEPS && !j->status; s++)
        for (int l = 0; l < c.n_layers && !j->status; l++) {
            skvt_fill_bf16_normal(&r, q, qn, 1.0);
            skvt_fill_bf16_normal(&r, kk, kn, 1.0);
            skvt_fill_bf16_normal(&r, vv, kn, 1.0);
            size_t o = (size_t)(s * c.n_layers + l);
            j->status = skv_decode(cache, l, q, kk, vv, j->out + o * qn);
            for (int b = 0; b < c.batch_size && !j->status; b++)
                for (int h = 0; h < c.n_kv_heads && !j->status; h++)
                    j->status = skv_cache_selected(cache, l, b, h,
                                                   j->sel + (((o * c.batch_size + b) * c.n_kv_heads) + h) * S);
        }
    /* op-level calls and memory queries on shared inputs, many times over */
    for (int it = 0; it < 30 && !j->status; it++) {
        j->status = skv_op_score_select(j->be, OP_HQ, OP_HK, OP_D, OP_N, OP_S, 0.0f, g_op_q, g_op_lm, NULL, j->op_sel,
                                        NULL, j->op_amax);
        if (!j->status) j->status = skv_cache_memory(&c, &j->mem_dev, &j->mem_host);
    }
    free(k);
    free(v);
    free(q);
    free(kk);
    free(vv);
    skv_cache_free(cache);
    return NULL;
}

static void test_caller_state(uint64_t seed)
{
    const int nt0 = omp_get_max_threads(), dyn0 = omp_get_dynamic(), blas0 = openblas_get_num_threads();
    skv_config c = small_config(SKV_BACKEND_CPU);
    job base, j;
    memset(&base, 0, sizeof base);
    base.be = SKV_BACKEND_CPU, base.seed = seed, base.id = 7;
    base.out = malloc(out_len(&c) * 4), base.sel = malloc(sel_len(&c) * 4);
    base.op_sel = malloc((size_t)OP_HK * OP_S * 4), base.op_amax = malloc((size_t)OP_HK * OP_N * 4);
    j = base;
    j.out = malloc(out_len(&c) * 4), j.sel = malloc(sel_len(&c) * 4);
    run(&base);
    SKVT_CHECK_STATUS(base.status, SKV_OK, "cpu run with n_threads = 0");
    static const int nts[] = {1, 3};
    for (int k = 0; k < 2; k++) {
        j.n_threads = nts[k];
        run(&j);
        SKVT_CHECK_STATUS(j.status, SKV_OK, nts[k] == 1 ? "cpu run with n_threads = 1" : "cpu run with n_threads = 3");
        SKVT_CHECK(omp_get_max_threads() == nt0, "n_threads = %d: the caller's omp_get_max_threads() went from %d to %d",
                   nts[k], nt0, omp_get_max_threads());
        SKVT_CHECK(omp_get_dynamic() == dyn0, "n_threads = %d: the caller's omp_get_dynamic() changed", nts[k]);
        SKVT_CHECK(openblas_get_num_threads() == blas0, "n_threads = %d: OpenBLAS's thread count went from %d to %d",
                   nts[k], blas0, openblas_get_num_threads());
        SKVT_CHECK(memcmp(base.out, j.out, out_len(&c) * 4) == 0 && memcmp(base.sel, j.sel, sel_len(&c) * 4) == 0,
                   "n_threads = %d: outputs or selections differ from n_threads = 0", nts[k]);
    }
    free(base.out), free(base.sel), free(base.op_sel), free(base.op_amax), free(j.out), free(j.sel);
}

int main(void)
{
    uint64_t seed = skvt_base_seed("test_threads");
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    job par[N_WORKERS], seq[N_WORKERS];
    pthread_t th[N_WORKERS];
    g_op_q = malloc((size_t)OP_HQ * OP_D * 2);
    g_op_lm = malloc((size_t)OP_HK * OP_N * OP_D * 2);
    skvt_fill_bf16_normal(&r, g_op_q, (size_t)OP_HQ * OP_D, 1.0);
    skvt_fill_bf16_normal(&r, g_op_lm, (size_t)OP_HK * OP_N * OP_D, 1.0);
    for (int i = 0; i < N_WORKERS; i++) {
        skv_config c = small_config(i % 2 ? SKV_BACKEND_CPU : SKV_BACKEND_REF);
        memset(&par[i], 0, sizeof par[i]);
        par[i].be = c.backend, par[i].seed = skvt_rng_u64(&r), par[i].id = i;
        par[i].out = malloc(out_len(&c) * 4), par[i].sel = malloc(sel_len(&c) * 4);
        par[i].op_sel = malloc((size_t)OP_HK * OP_S * 4), par[i].op_amax = malloc((size_t)OP_HK * OP_N * 4);
        seq[i] = par[i];
        seq[i].out = malloc(out_len(&c) * 4);
        seq[i].sel = malloc(sel_len(&c) * 4);
        seq[i].op_sel = malloc((size_t)OP_HK * OP_S * 4), seq[i].op_amax = malloc((size_t)OP_HK * OP_N * 4);
    }
    test_caller_state(skvt_rng_u64(&r));
    /* the same work, alone on this thread */
    for (int i = 0; i < N_WORKERS; i++) run(&seq[i]);
    /* and all at once */
    for (int i = 0; i < N_WORKERS; i++) SKVT_CHECK(pthread_create(&th[i], NULL, run, &par[i]) == 0, "pthread_create");
    for (int i = 0; i < N_WORKERS; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N_WORKERS; i++) {
        skv_config c = small_config(par[i].be);
        const char *be = skv_backend_name(par[i].be);
        SKVT_CHECK_STATUS(seq[i].status, SKV_OK, "sequential run");
        SKVT_CHECK_STATUS(par[i].status, SKV_OK, "concurrent run");
        SKVT_CHECK(memcmp(seq[i].out, par[i].out, out_len(&c) * 4) == 0,
                   "worker %d (%s): concurrent outputs differ from the sequential run", i, be);
        SKVT_CHECK(memcmp(seq[i].sel, par[i].sel, sel_len(&c) * 4) == 0,
                   "worker %d (%s): concurrent selections differ from the sequential run", i, be);
        SKVT_CHECK(par[i].error_msg_ok, "worker %d (%s): its thread-local error message was clobbered", i, be);
        SKVT_CHECK(memcmp(seq[i].op_sel, par[i].op_sel, (size_t)OP_HK * OP_S * 4) == 0 &&
                       memcmp(seq[i].op_amax, par[i].op_amax, (size_t)OP_HK * OP_N * 4) == 0,
                   "worker %d (%s): concurrent skv_op_score_select differs from the sequential run", i, be);
        SKVT_CHECK(seq[i].mem_dev == par[i].mem_dev && seq[i].mem_host == par[i].mem_host,
                   "worker %d (%s): concurrent skv_cache_memory differs", i, be);
        free(par[i].out);
        free(par[i].sel);
        free(seq[i].out);
        free(seq[i].sel);
        free(par[i].op_sel), free(par[i].op_amax), free(seq[i].op_sel), free(seq[i].op_amax);
    }
    free(g_op_q);
    free(g_op_lm);
    return skvt_finish();
}
